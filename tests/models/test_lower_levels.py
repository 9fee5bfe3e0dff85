"""The kernels' own tests, run again at every level below this CPU's (SPECULANT_NATIVE forces it): each level
is its own build of vec.h's kernels, and must keep the same promises (every weight the file's, every row the
same bits at any row count, greedy speculation equal to plain) wherever a CPU stops at it."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from speculant.models import native

ROOT = Path(__file__).parents[2]
# The tests that run the native kernels' every entry point: GGUF matrices, attention, the layer operations,
# argmax and sampling, every linear layer's kernel at 1 to 700 rows and every weight path's batch invariance, and a
# GGUF model's greedy speculation against plain decoding; the model's own tests (the fused stack against its
# modules, which a level's paths can make or break) and the prefix cache's hits against cold prefills.
KERNEL_TESTS = ["tests/models/test_ggml.py", "tests/models/test_attention.py", "tests/engine/test_sampling.py",
                "tests/models/test_row_invariance.py::test_a_row_gets_the_same_bits_at_any_row_count",
                "tests/models/test_row_invariance.py::test_packed_linear_matches_the_plain_product",
                "tests/engine/test_batch_invariance.py", "tests/models/test_models.py",
                "tests/scheduler/test_prefix_cache.py", "tests/models/test_gdn_native.py"]
BELOW = [lv for lv in native.LEVELS[1:] if native.LEVELS.index(lv) < native.LEVELS.index(native.cpu_level())
         and native.build_of(lv) != native.build_of(native.cpu_level())]


# Each level costs a build (~3 min on 2 cores): the default suite takes avx2, the lowest (no VNNI: the 16-bit
# pair sums); avxvnni differs from it in one instruction and runs with the slow suites.
LOWER = [pytest.param("avx2"), pytest.param("avxvnni", marks=pytest.mark.slow), pytest.param("avx512")]


@pytest.mark.parametrize("level", LOWER)
def test_kernel_tests_pass_at_each_lower_level(level):
    if level not in BELOW:
        pytest.skip(f"the {level} level is this CPU's own or above it ({native.cpu_level()}): the suite runs it")
    env = {**os.environ, native.SWITCH_ENV: level}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", *KERNEL_TESTS],
                         cwd=ROOT, env=env, capture_output=True, text=True)
    tail = run.stdout[-3000:]
    assert run.returncode == 0, tail
    # A level whose build failed would pass by skipping: its kernels must have run.
    assert "did not build" not in run.stdout and " passed" in tail, tail
