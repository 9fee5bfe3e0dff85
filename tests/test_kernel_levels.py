"""Each kernel level this CPU supports builds, loads and is the level in use when asked for: a build that
fails must fail here, not read as missing hardware in every test that skips without the kernels."""

import os
import shutil
import subprocess
import sys

import pytest

from speculant.models import native

LEVEL_PROBE = "from speculant.models import native; print(native.level())"


def test_the_native_module_builds_wherever_the_cpu_has_its_flags():
    if native.cpu_level() == "off":
        pytest.skip(native.off_reason())
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no C++ compiler on this machine")
    if native.requested_level() == "off":
        pytest.skip(f"{native.SWITCH_ENV}=off")
    assert native.kernels() is not None, native.off_reason()
    assert native.level() == min(native.cpu_level(), native.requested_level(), key=native.LEVELS.index)


@pytest.mark.parametrize("level", [pytest.param(lv, marks=pytest.mark.slow) if lv == "avxvnni" else lv
                                   for lv in native.LEVELS])  # avxvnni's build: test_lower_levels.py says why
def test_a_lower_level_can_be_forced(level):
    if native.LEVELS.index(level) > native.LEVELS.index(native.cpu_level()):
        pytest.skip(f"this CPU runs at most the {native.cpu_level()} level")
    if level != "off" and native.kernels() is None:
        pytest.skip(native.off_reason())
    env = {**os.environ, native.SWITCH_ENV: level}
    out = subprocess.run([sys.executable, "-c", LEVEL_PROBE], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == level


def test_an_unknown_level_is_refused_with_the_choices():
    env = {**os.environ, native.SWITCH_ENV: "avx9000"}
    out = subprocess.run([sys.executable, "-c", LEVEL_PROBE], env=env, capture_output=True, text=True)
    assert out.returncode != 0 and "choose one of on, amx, avx512, avxvnni, avx2, off" in out.stderr
