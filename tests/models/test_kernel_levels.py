"""Each kernel level this CPU supports builds, loads and is the level in use when asked for: a build that
fails must fail here, not read as missing hardware in every test that skips without the kernels."""

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest

from speculant.models import native, notice

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


# Holds native.build_lock(name) until its stdin closes; "build": with PyTorch's baton in the build folder as a
# build in progress has it.
HOLDER = """
import sys
from pathlib import Path
from speculant.models import native
with native.build_lock(sys.argv[1]):
    if sys.argv[2] == "build":
        (Path(sys.argv[3]) / "lock").touch()
    print("holding", flush=True)
    sys.stdin.read()
"""


@pytest.fixture
def fake_build(tmp_path, monkeypatch):
    """kernels() over an extension cache in tmp_path, with PyTorch's load replaced (it records whether the baton
    was there when called: PyTorch would wait on it)."""
    from torch.utils import cpp_extension

    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    quiet = notice.log.level  # an earlier test's --quiet may have raised it; setLevel also empties its cache
    notice.log.setLevel(logging.INFO)
    monkeypatch.setattr(native, "_allowed_level", lambda: "avx2")
    name = "speculant_native_avx2_test"
    monkeypatch.setattr(native, "module_name", lambda build: name)
    monkeypatch.setattr(native, "build_reason", lambda name: None)
    build_dir = Path(cpp_extension._get_build_directory(name, verbose=False))
    batons = []

    def load(*args, **kwargs):
        batons.append((build_dir / "lock").exists())
        return types.SimpleNamespace(set_amx=lambda on: None)

    monkeypatch.setattr(cpp_extension, "load", load)
    yield name, build_dir, batons
    notice.log.setLevel(quiet)


def holder(name: str, build_dir: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(Path(native.__file__).parents[2])}
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, name, mode, str(build_dir)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, env=env, text=True)
    assert proc.stdout.readline().strip() == "holding"
    return proc


def test_a_killed_build_never_blocks_the_next_load(fake_build, capsys):
    """A build killed (SIGKILL) while it held the lock and PyTorch's baton: the next load takes the lock at once,
    removes the baton before PyTorch would wait on it, and says nothing of waiting."""
    name, build_dir, batons = fake_build
    proc = holder(name, build_dir, "build")
    assert (build_dir / "lock").exists()
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert native.kernels.__wrapped__() is not None
    assert batons == [False] and not (build_dir / "lock").exists()
    assert "waiting" not in capsys.readouterr().err


def test_a_live_build_is_waited_for_and_named(fake_build, capsys):
    """A live process holding the lock: the load waits (PyTorch's load is not called), says for which process,
    and goes on once it lets go."""
    name, build_dir, batons = fake_build
    proc = holder(name, build_dir, "hold")
    loaded = threading.Thread(target=native.kernels.__wrapped__)
    loaded.start()
    err, deadline = "", time.monotonic() + 60
    while "waiting" not in err and time.monotonic() < deadline:
        time.sleep(0.05)
        err += capsys.readouterr().err
    assert f"native kernels: waiting for process {proc.pid}," in err and batons == []
    proc.stdin.close()
    proc.wait()
    loaded.join(60)
    assert not loaded.is_alive() and batons == [False]
