"""A built kernel module is built again only when its sources, flags or compiler change: not by a run that finds
another ninja first on PATH, and a build killed midway is finished by the next load, once."""

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from speculant.models import native

ROOT = Path(__file__).parents[2]
LOAD = "from speculant.models import native; assert native.kernels() is not None, native.off_reason()"


def objects(build_dir: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in build_dir.glob("*.o")}


def build_dir_of_level() -> Path:
    from torch.utils.cpp_extension import _get_build_directory

    name = native.module_name(native.build_of(native.level()))
    return Path(_get_build_directory(name, verbose=False))


def load_in_new_process(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", LOAD], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=900)


@pytest.fixture
def built():
    if native.kernels() is None:
        pytest.skip(native.off_reason())
    return build_dir_of_level()


def test_a_load_with_another_ninja_first_on_path_rebuilds_nothing(built, tmp_path):
    """The run that rebuilt: the venv's speculant started with a PATH whose first ninja is another version."""
    other = shutil.which("ninja", path="/usr/bin:/bin:/usr/local/bin")
    fake = tmp_path / "ninja"  # where the system has none, a ninja that must never run
    fake.write_text("#!/bin/sh\necho 'the wrong ninja ran' >&2\nexit 1\n")
    fake.chmod(0o755)
    path_first = os.path.dirname(other) if other else str(tmp_path)
    before = objects(built)
    env = {**os.environ, "PATH": os.pathsep.join([path_first, "/usr/bin", "/bin"])}
    run = load_in_new_process(env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "compiling" not in run.stderr and objects(built) == before


def test_a_second_load_in_a_new_process_rebuilds_nothing(built):
    before = objects(built)
    run = load_in_new_process(dict(os.environ))
    assert run.returncode == 0 and "compiling" not in run.stderr, run.stderr[-2000:]
    assert objects(built) == before


@pytest.mark.slow
def test_a_killed_build_is_finished_by_the_next_load_once(tmp_path):
    """A real build into an empty cache, killed once its first units are compiled: the next load compiles only
    the units left (says so), and the one after compiles nothing."""
    if native.kernels() is None:
        pytest.skip(native.off_reason())
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path), "MAX_JOBS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", LOAD], cwd=ROOT, env=env, start_new_session=True,
                            stderr=subprocess.PIPE, text=True)
    # With TORCH_EXTENSIONS_DIR set, PyTorch builds in it directly: the module's folder is its name.
    build = tmp_path / native.module_name(native.build_of(native.level()))
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and len(list(build.glob("*.o"))) < 3 and proc.poll() is None:
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = objects(build)
    assert len(done) >= 2 and not list(build.glob("*.so"))
    run = load_in_new_process(env)
    assert run.returncode == 0, run.stderr[-2000:]
    assert "finishing a build that stopped" in run.stderr
    after = objects(build)
    # the units whose compile had finished (all but the one the kill cut) are kept
    assert sum(after[n] == t for n, t in done.items()) >= len(done) - 1 and len(after) == len(native.SOURCES)
    again = load_in_new_process(env)
    assert again.returncode == 0 and "compiling" not in again.stderr and objects(build) == after


def test_the_build_is_named_by_what_it_depends_on(monkeypatch):
    """Another compiler, another PyTorch or other sources name another build; the same inputs the same one."""
    name = native.module_name("avx2")
    assert native.module_name("avx2") == name and native.module_name("avx512") != name
    monkeypatch.setenv("CXX", "clang++")
    assert native.module_name("avx2") != name
    monkeypatch.delenv("CXX")
    monkeypatch.setattr(native.torch, "__version__", "0.0.0")
    assert native.module_name("avx2") != name
