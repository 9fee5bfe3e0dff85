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


def test_a_lock_left_by_a_killed_build_is_removed(tmp_path, monkeypatch):
    """PyTorch's build lock has no owner: one a killed build left would hang every later load. An old one goes,
    a fresh one (a build running in another process) stays."""
    from torch.utils import cpp_extension

    monkeypatch.setattr(cpp_extension, "_get_build_directory", lambda name, verbose: str(tmp_path / name))
    for name, age in (("old", native.STALE_LOCK_S + 60), ("fresh", 5)):
        (tmp_path / name).mkdir()
        lock = tmp_path / name / "lock"
        lock.touch()
        os.utime(lock, (lock.stat().st_atime - age, lock.stat().st_mtime - age))
        native.clear_stale_lock(name)
    assert not (tmp_path / "old" / "lock").exists() and (tmp_path / "fresh" / "lock").exists()
