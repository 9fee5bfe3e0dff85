"""A first run says what it waits for: one line on stderr before a long wait (a kernel build, a GGUF repack, a
cost curve's measurement), none where the wait is short or --quiet is given; the kernels build from light
headers."""

from __future__ import annotations

import re
from types import SimpleNamespace

import pytest

from speculant.cli import build_parser
from speculant.models import native, notice


@pytest.fixture(autouse=True)
def loud():
    notice.set_quiet(False)
    yield
    notice.set_quiet(False)


def test_a_long_wait_gets_one_line_a_short_one_none(capsys):
    notice.announce("compiling something", 47.0)
    notice.announce("reading something small", 2.0)
    assert capsys.readouterr().err == "speculant: compiling something: about 45 s, once\n"
    notice.announce("building", 190)
    assert capsys.readouterr().err == "speculant: building: about 3 min, once\n"


def test_quiet_silences_the_line(capsys):
    notice.set_quiet(True)
    notice.announce("compiling something", 60)
    assert capsys.readouterr().err == "" and not notice.enabled()


@pytest.mark.parametrize("argv, quiet", [
    (["generate", "hi"], False), (["--quiet", "generate", "hi"], True), (["generate", "hi", "--quiet"], True),
    (["serve", "--quiet"], True), (["bench", "--quiet"], True),
])
def test_quiet_is_taken_before_or_after_the_command(argv, quiet):
    assert build_parser().parse_args(argv).quiet is quiet


def test_a_measurement_announces_the_rest_after_its_first_round(capsys, monkeypatch):
    clock = iter([0.0, 4.0])  # the first round of 3 ticks took 4 s: 5 rounds more take 20
    monkeypatch.setattr(notice.time, "perf_counter", lambda: next(clock))
    tick = notice.Countdown("measuring", rounds=6, per_round=3)
    for _ in range(18):
        tick()
    assert capsys.readouterr().err == "speculant: measuring: about 20 s, once\n"


def fake_load(calls):
    def load(name, sources, **kwargs):
        calls.append((name, [s.rsplit("/", 1)[-1] for s in sources]))
        return SimpleNamespace(set_amx=lambda allowed: None)
    return load


@pytest.mark.skipif(native.cpu_level() == "off", reason="this CPU runs no native kernel level")
def test_the_build_is_announced_where_it_is_not_cached(capsys, monkeypatch):
    import torch.utils.cpp_extension as ext

    calls = []
    monkeypatch.setattr(ext, "load", fake_load(calls))
    monkeypatch.setenv(native.SWITCH_ENV, "on")
    monkeypatch.setattr(native, "build_reason", lambda name: "first build")
    assert native.kernels.__wrapped__() is not None
    line = capsys.readouterr().err
    assert re.fullmatch(r"speculant: compiling the native CPU kernels \(\w+, first build\), cached for later runs: "
                        r"about \d+ (s|min), once\n", line), line
    # The binding unit, the longest to compile, starts first.
    assert calls[0][1][0] == native.BINDING and sorted(calls[0][1]) == sorted(native.SOURCES)
    monkeypatch.setattr(native, "build_reason", lambda name: None)
    native.kernels.__wrapped__()
    assert capsys.readouterr().err == ""


def test_build_estimate_follows_the_cores_and_the_other_work(monkeypatch):
    monkeypatch.setattr(native.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(native.os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    quiet = native.build_seconds()
    assert quiet == pytest.approx(native.BUILD_CPU_S / 2)  # three jobs on two idle cores
    monkeypatch.setattr(native.os, "getloadavg", lambda: (12.0, 12.0, 12.0))
    assert native.build_seconds() == pytest.approx(quiet * 3)  # other work at half weight: a third of the cores


def test_kernel_units_include_the_light_tensor_header():
    """torch/extension.h costs each unit ~30 s of compiling; only the binding unit needs PyTorch's Python side."""
    for path in sorted(native.CSRC.glob("*.[ch]*")):
        text = path.read_text()
        assert "<torch/extension.h>" not in text, f"{path.name}: include \"tensor.h\" (see its first lines)"
        if path.name != native.BINDING:
            assert "<torch/csrc/" not in text and "<pybind11/" not in text, path.name
    assert set(native.SOURCES) == {p.name for p in native.CSRC.glob("*.cpp")}
    assert set(native.HEADERS) == {p.name for p in native.CSRC.glob("*.h")}


def test_sources_are_staged_once_beside_their_build(tmp_path):
    """Every checkout of the same sources builds from one path: PyTorch's build file names the sources, and
    a path that changed would rebuild the module."""
    staged = native.stage_sources(tmp_path / "speculant_native_x.src")
    names = native.SOURCES + native.HEADERS
    assert sorted(p.name for p in staged.iterdir()) == sorted(names)
    assert all((staged / f).read_bytes() == (native.CSRC / f).read_bytes() for f in names)
    (staged / native.BINDING).write_text("// a later checkout's copy must not overwrite a staged build\n")
    assert native.stage_sources(staged) == staged
    assert (staged / native.BINDING).read_text().startswith("// a later")
    (staged / native.HEADERS[0]).unlink()  # a partial copy is staged again, whole
    native.stage_sources(staged)
    assert (staged / native.BINDING).read_bytes() == (native.CSRC / native.BINDING).read_bytes()
