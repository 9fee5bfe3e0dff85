"""bf16 only where the CPU runs it: on an AVX2-only CPU (AMD Zen 3: no AVX512BW, no AVX-NE-CONVERT), simulated
by its flags, PyTorch's oneDNN bf16 linear raises at its weight reorder, so with the native kernels off bf16
layers stay plain nn.Linear (PyTorch's reference product), `auto` takes float32 and an explicit bfloat16 says
in one line that it is slow."""

from __future__ import annotations

import pytest
import torch
from conftest import save_tiny

from speculant.config import SamplingParams
from speculant.engine import Engine
from speculant.models import loader, native
from speculant.models.kernels import PackedLinear, fast_bfloat16, inexact_reason
from speculant.models.loader import load_model, resolve_dtype

ZEN3_FLAGS = frozenset({"sse4_2", "avx", "avx2", "fma", "f16c", "bmi2", "sha_ni", "vaes", "vpclmulqdq"})
SLOW_LINE = "speculant: bfloat16 runs slowly here"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return save_tiny(tmp_path_factory.mktemp("bf16") / "m", seed=7)


@pytest.fixture
def zen3(monkeypatch):
    """This process as on a Zen 3 with the native kernels off (SPECULANT_NATIVE=off, or no compiler)."""
    monkeypatch.setattr(native, "cpu_flags", lambda: ZEN3_FLAGS)
    monkeypatch.setattr(native, "bf16_usable", lambda out_features, in_features: False)
    loader._say_slow_bfloat16.cache_clear()
    yield
    loader._say_slow_bfloat16.cache_clear()


def onednn_layers(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, PackedLinear) and m.kind == "onednn"]


def test_the_cpu_check_reads_its_flags(monkeypatch):
    for flags, runs in ((ZEN3_FLAGS, False), (ZEN3_FLAGS | {"avx512bw"}, True),
                        (ZEN3_FLAGS | {"avx_ne_convert"}, True), (ZEN3_FLAGS | {"amx_bf16"}, True)):
        monkeypatch.setattr(native, "cpu_flags", lambda flags=flags: flags)
        assert native.torch_bf16_linear() == runs, flags


def test_auto_is_float32_and_bf16_runs_on_the_reference_product(tiny, zen3, capsys):
    assert not fast_bfloat16(torch.device("cpu"))
    assert resolve_dtype("auto") == torch.float32 and SLOW_LINE not in capsys.readouterr().err
    target = load_model(tiny, dtype="bfloat16")
    target2 = load_model(tiny, dtype="bf16")
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith(SLOW_LINE)]
    assert len(lines) == 1 and "--dtype float32" in lines[0]
    assert onednn_layers(target.model) == onednn_layers(target2.model) == []
    assert type(target.model.lm_head) is torch.nn.Linear and target.model.lm_head.weight.dtype == torch.bfloat16
    assert "not row-exact" in inexact_reason(target.model, torch.device("cpu"))
    engine = Engine(target, None, 0, max_batch_size=2, max_model_len=32)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = engine.generate([engine.add_request([1, 5, 9], params), engine.add_request([1, 7], params)])
    assert [len(s.output_ids) for s in outs] == [6, 6]


def test_where_the_cpu_runs_onednn_bf16_it_is_used(tiny, monkeypatch, capsys):
    """The same with AVX512BW (this check's other side): oneDNN's packed kernel, no line."""
    if not torch.backends.mkldnn.is_available():
        pytest.skip("this PyTorch build has no oneDNN")
    if not native.torch_bf16_linear():
        pytest.skip("this CPU has no AVX512BW or AVX-NE-CONVERT: oneDNN's bf16 kernel does not run here")
    monkeypatch.setattr(native, "bf16_usable", lambda out_features, in_features: False)
    loader._say_slow_bfloat16.cache_clear()
    target = load_model(tiny, dtype="bfloat16")
    assert onednn_layers(target.model) and SLOW_LINE not in capsys.readouterr().err
