"""Compiled CPU kernels (csrc/), one extension module per kernel level (LEVELS) built on first use by
PyTorch's extension loader where the CPU has AVX2 and a C++ compiler is installed; callers fall back to
PyTorch's own kernels otherwise. The vector kernels are written once on vec.h's 16-lane types and built for
AVX512 or AVX2; quantized.cpp and the AMX files exist on AVX512 alone.

- quantized.cpp: int4 (Q4_1) and int8 (Q8_0) weight × int8 activation products (the activations quantized
  per 32 as llama.cpp does), on VNNI up to 8 rows and AMX's int8 tiles above; integer sums, so every row
  gets the same bits at any row count; faster than PyTorch's int4 products and than bf16 activations on
  AMX at every row count a verify pass has. The int4 model's Q8_0 lm_head the same way (on AMX's bf16
  tiles its weights were unpacked to bf16 at every pass).
- bf16_amx.cpp: bf16 weight × bf16 activation products on AMX tiles, every row alike at any row count.
- bf16_dot.cpp: the same products without AMX (vdpbf16ps, or two FMAs a pair below AVX512), on the same layout,
  each output one chain of products in input order: every row alike at any row count, where oneDNN's bf16
  kernel was not (from 2 rows on, on a 1.5B model's shapes).
- f32_mm.cpp: fp32 (or fp16) weights stored transposed × fp32 activations, each output one chain of FMAs in
  input order, where PyTorch's matmul gave a row other bits from 5 rows on.
- attention.cpp: bf16 decode attention, one query row over exactly its keys, so rows score alike alone
  or in a verify pass or batch, faster than PyTorch's attention called row by row (its exact use).
- attention_amx.cpp: the same on AMX tiles (attention.cpp calls it where the CPU has AMX), the rows that
  read one key head together, so a verify pass costs little more than one row.
- layer_ops.cpp: RMSNorm (alone, with the residual sum before it, or of each q and k head), rotary embedding and
  SwiGLU's and GeGLU's products for bf16 rows, one call each where PyTorch dispatches several operations (its
  RMSNorm ~10).
- argmax.cpp: each row's first maximum in one pass over bf16 or fp32 logits (greedy decoding's token).
- sampling.cpp: under a request's temperature, top-k, top-p and min-p, an inverse-CDF draw over one row
  of logits, two passes and a sort of the likeliest tokens where PyTorch made ~10 operations over the
  vocabulary (sampled decoding, and the target's tokens that deterministic drafts are verified against).
- gdn.cpp: Gated DeltaNet's recurrence, a (row, value head) a task over a pass's tokens, the state read and written
  once a token where PyTorch made ~8 operations over it, each a fresh tensor.
- decoder.cpp: a whole decoder layer of native weights (GGUF blocks, int4, bf16) in one call, the same kernels
  in the same order, for every family's form (norms around attention and the MLP, q/k norms, GeGLU, windows,
  score scales and caps); every layer of a pass in one call, its parallel loops handed to one team of threads
  (team.h: a parallel region per kernel, ~150 a pass, cost more than handing loops to waiting threads).
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import torch

from speculant.errors import SpeculantError
from speculant.models import notice

log = logging.getLogger("speculant")

CSRC = Path(__file__).parent / "csrc"
SOURCES = ["quantized.cpp", "ggml_mm.cpp", "bf16_amx.cpp", "bf16_dot.cpp", "f32_mm.cpp", "attention.cpp",
           "attention_amx.cpp", "layer_ops.cpp", "argmax.cpp", "sampling.cpp", "moe.cpp", "gdn.cpp", "decoder.cpp"]
HEADERS = ["amx.h", "attention.h", "bf16.h", "kernels.h", "team.h", "tensor.h", "vec.h"]
# The binding unit (decoder.cpp: pybind11 and PyTorch's Python headers) compiles longest: first, so that it does
# not run alone at the end of the build.
BINDING = "decoder.cpp"
# CPU seconds to compile one level's module, every unit one after another (AMD EPYC Zen 5, GCC 12, 2026-12-03;
# kernels only on tensor.h: 362 s when every unit included torch/extension.h). The first run announces the
# build with this over the cores it gets.
BUILD_CPU_S = 95.0
# SPECULANT_NATIVE caps the kernel level: `on` (the best this CPU runs), `amx`, `avx512` (no AMX tiles, as on
# AMD Zen 4/5 or Sapphire Rapids told not to), `avxvnni` and `avx2` (vec.h's two-register form: Intel's
# consumer CPUs, AMD before Zen 4; with AVX-VNNI's dot products or without), or `off` (PyTorch's kernels
# everywhere): every level at or below the CPU's is testable on one machine.
SWITCH_ENV = "SPECULANT_NATIVE"
LEVELS = ("off", "avx2", "avxvnni", "avx512", "amx")  # lowest first
AVX2_FLAGS = ("avx2", "fma", "f16c")
AVX512_FLAGS = ("avx512f", "avx512bw", "avx512vl", "avx512_bf16", "avx512vbmi", "avx512_vnni")
AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")
# The flags each level needs of the CPU, and the compiler flags of its build. The compiler may use any
# instruction a build allows anywhere: a module loads only where all of them run. The amx level runs the
# avx512 build, whose AMX instructions appear in the *_amx.cpp kernels alone, called only where allowed.
NEEDED = {"avx2": AVX2_FLAGS, "avxvnni": (*AVX2_FLAGS, "avx_vnni"), "avx512": AVX512_FLAGS,
          "amx": (*AVX512_FLAGS, *AMX_FLAGS)}
AVX2_CFLAGS = ["-O3", "-mavx2", "-mfma", "-mf16c", "-fopenmp"]
CFLAGS = {"avx2": AVX2_CFLAGS, "avxvnni": [*AVX2_CFLAGS, "-mavxvnni"],
          "avx512": ["-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mavx512vbmi", "-mavx512vnni",
                     "-mamx-tile", "-mamx-bf16", "-mamx-int8", "-fopenmp"]}
BUILD_ERRORS: list[str] = []  # why kernels() fell back, for the test that each supported level builds
Transforms = tuple[float, int, float, float]  # a request's temperature, top_k, top_p, min_p


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as Linux lists them (empty where /proc/cpuinfo is not there)."""
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset()


def torch_bf16_linear() -> bool:
    """Whether PyTorch's oneDNN runs bf16 linear layers on this CPU: it needs AVX512BW or AVX-NE-CONVERT (AMX-BF16
    CPUs have both); elsewhere (AMD Zen 3, AVX2 alone) its weight reorder raises. Tests patch it to be a Zen 3."""
    return bool({"avx512bw", "avx_ne_convert", "amx_bf16"} & cpu_flags())


@functools.cache
def source_digest() -> str:
    """A hash of the kernels' sources and headers: what they compute, and how fast."""
    return hashlib.sha256(b"".join((CSRC / f).read_bytes() for f in SOURCES + HEADERS)).hexdigest()[:12]


def module_name(build: str) -> str:
    """The extension's name: a hash of what its build depends on, the sources, the flags, the compiler named and
    the PyTorch whose headers and libraries it uses. Checkouts of other sources, or two virtual environments of
    one checkout, never share (or rebuild in turn, or race on) one build; nothing else names a new one."""
    parts = [source_digest(), *CFLAGS[build], os.environ.get("CXX", "c++"), torch.__version__,
             str(Path(torch.__file__).parent)]
    return f"speculant_native_{build}_{hashlib.sha256(chr(0).join(parts).encode()).hexdigest()[:12]}"


def requested_level() -> str:
    """The highest level SPECULANT_NATIVE allows (`on`: any)."""
    asked = os.environ.get(SWITCH_ENV, "on")
    if asked == "on":
        return LEVELS[-1]
    if asked not in LEVELS:
        raise SpeculantError(f"{SWITCH_ENV}={asked!r}: choose one of on, {', '.join(reversed(LEVELS))}")
    return asked


def cpu_level() -> str:
    """The highest level this CPU's flags run."""
    return max((lv for lv, needed in NEEDED.items() if all(f in cpu_flags() for f in needed)), key=LEVELS.index,
               default="off")


def build_of(level_: str) -> str:
    """The compiled module a level runs (amx and avx512 share one)."""
    return "avx512" if level_ == "amx" else level_


@functools.cache
def level() -> str:
    """The kernel level in use: the CPU's, capped by SPECULANT_NATIVE, `off` where the module did not build."""
    return "off" if kernels() is None else _allowed_level()


def _allowed_level() -> str:
    return min(cpu_level(), requested_level(), key=LEVELS.index)


@functools.cache
def kernels() -> ModuleType | None:
    """The compiled module of the level in use, or None where none can run or be built (then every caller
    uses PyTorch)."""
    allowed = _allowed_level()
    if allowed == "off":
        if requested_level() != "off":
            log.info("native kernels: PyTorch's instead (this CPU lacks %s)", ", ".join(_missing("avx2")))
        return None
    build = build_of(allowed)
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = module_name(build)
        with build_lock(name), own_ninja():
            why = build_reason(name)
            if why:
                notice.announce(f"compiling the native CPU kernels ({build}, {why}), cached for later runs",
                                build_seconds())
            sources = sorted(SOURCES, key=lambda s: s != BINDING)
            staged = stage_sources(Path(_get_build_directory(name, verbose=False)).with_name(f"{name}.src"))
            module = load(name, [str(staged / s) for s in sources], extra_cflags=CFLAGS[build],
                          extra_ldflags=["-fopenmp"])
    except Exception as e:  # no compiler, no ninja, a compiler without these flags: all mean the fallback
        BUILD_ERRORS.append(str(e))
        log.warning("native kernels: PyTorch's instead (they did not build: %s)", str(e).splitlines()[0][:200])
        return None
    module.set_amx(allowed == "amx")  # the C++ side asks CPUID; a lower level forced must reach it
    return module


def stage_sources(folder: Path) -> Path:
    """The sources copied beside their build, once: PyTorch's build file names each source's path, so two
    checkouts of the same sources (worktrees, virtual environments) would rebuild it for each other in turn."""
    if not all((folder / f).is_file() for f in SOURCES + HEADERS):
        tmp = folder.with_name(f"{folder.name}.{os.getpid()}")
        tmp.mkdir(parents=True, exist_ok=True)
        for f in SOURCES + HEADERS:
            shutil.copyfile(CSRC / f, tmp / f)
        shutil.rmtree(folder, ignore_errors=True)
        os.replace(tmp, folder)
    return folder


@contextlib.contextmanager
def build_lock(name: str) -> Iterator[None]:
    """Our own lock around PyTorch's load of `name`: an flock on a file beside its build folder, which the kernel
    lets go when its owner dies, our pid written in it for whoever waits. Under it, PyTorch's build lock (a baton
    file with no owner to check, which every later load would wait on forever) can only be a killed build's."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        build_dir = Path(_get_build_directory(name, verbose=False))
        fd = os.open(build_dir.with_name(f"{name}.lock"), os.O_RDWR | os.O_CREAT, 0o644)
    except Exception:  # a PyTorch without the helper, a read-only cache: PyTorch's own lock alone
        fd = None
    if fd is None:
        yield
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            notice.log.info("native kernels: waiting for process %s, which is building or loading them (%s)",
                            holder, build_dir)
            fcntl.flock(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        baton = build_dir / "lock"
        if baton.exists():
            log.warning("native kernels: removing %s, left by a build that was killed", baton)
            baton.unlink(missing_ok=True)
        yield
    finally:
        os.close(fd)  # lets the flock go


@contextlib.contextmanager
def own_ninja() -> Iterator[None]:
    """The `ninja` package's binary first on PATH while PyTorch builds. Ninja versions keep their build log in
    formats the others discard (Debian's 1.11 reads 1.13's log as every command changed), so a run that found
    another ninja first (the venv's `speculant` started without the venv on PATH) rebuilt every unit, and the
    next run with the venv's rebuilt them again."""
    try:
        import ninja

        bin_dir = ninja.BIN_DIR
    except (ImportError, AttributeError):  # PyTorch then takes whichever ninja PATH has
        yield
        return
    old = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([bin_dir, old]) if old else bin_dir
    try:
        yield
    finally:
        os.environ["PATH"] = old


def build_reason(name: str) -> str | None:
    """Why loading `name` compiles, for the announcement, or None where its build is complete (a second to load):
    no build yet, or one that stopped before its module was linked (the next load finishes the units left)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        build_dir = Path(_get_build_directory(name, verbose=False))
    except Exception:  # a PyTorch without the helper: say nothing rather than guess
        return None
    if (build_dir / f"{name}.so").is_file():
        return None
    return "finishing a build that stopped" if (build_dir / ".ninja_log").is_file() else "first build"


def build_seconds() -> float:
    """About how long the build takes here: its CPU seconds over its share of the cores beside the other work
    running (the load average)."""
    try:
        cores, others = len(os.sched_getaffinity(0)), os.getloadavg()[0]
    except (AttributeError, OSError):
        cores, others = os.cpu_count() or 1, 0.0
    jobs = min(cores + 1, len(SOURCES))  # ninja's own choice on a few cores
    # The load average counts threads that wait as well as those that run: at half weight it matched the builds
    # measured (49 s at load 2.5, 217 s at load 13-33, on 2 cores).
    return BUILD_CPU_S / min(jobs, cores * jobs / (jobs + others / 2))


def _missing(level_: str) -> list[str]:
    return [f for f in NEEDED[level_] if f not in cpu_flags()]


def off_reason() -> str:
    """Why the native kernels do not run here, for a skipped test's message."""
    if requested_level() == "off":
        return f"{SWITCH_ENV}=off"
    if cpu_level() == "off":
        return f"this CPU lacks {', '.join(_missing('avx2'))}"
    return "the native kernels did not build: " + (BUILD_ERRORS[-1].splitlines()[0][:200] if BUILD_ERRORS else "?")


def tile_rows() -> int:
    """Rows ggml_mm takes at once (csrc/ggml_mm.cpp's kRows: AVX512's 32 registers hold 8, AVX2's 16 hold 5
    rows' 16-bit sums, 4 rows' int32 sums with VNNI): each such tile unpacks the weights again, so a pass
    costs by the tile."""
    return {"avx512": 8, "amx": 8, "avx2": 5}.get(level(), 4)


def amx() -> bool:
    """Whether the AMX kernels (bf16 weights; int4 and int8 ones above 8 rows) run here."""
    return level() == "amx"


def quantized_usable(out_features: int, in_features: int) -> bool:
    """Whether the kernels for int4 (Q4_1) and int8 (Q8_0) weights take this shape here: VNNI on AVX512,
    with AMX tiles above 8 rows where the CPU has them (below AVX512: PyTorch's int4 kernel)."""
    return out_features % 16 == 0 and in_features % 64 == 0 and build_of(level()) == "avx512"


def int4_layout(q: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q [N, K] in 0..15, scale and minimum [N, K/32] → the kernel's layout: per block of 16 outputs and
    group of 32 inputs, 4 vectors of 64 bytes, byte 4j + e of vector v = q[j][4v + e] | q[j][16 + 4v + e] << 4
    (quantized.cpp's Q4_1 unpack); scales and minimums as bf16 [N/16, K/32, 16]."""
    N, K = q.shape
    quads = q.view(N // 16, 16, K // 32, 2, 4, 4)  # block, output, group, half, vector, member
    packed = (quads[:, :, :, 0] | (quads[:, :, :, 1] << 4)).to(torch.uint8).permute(0, 2, 3, 1, 4).contiguous()

    def per_block(v: torch.Tensor) -> torch.Tensor:
        return v.view(N // 16, 16, K // 32).transpose(1, 2).contiguous().to(torch.bfloat16)

    return packed, per_block(scale), per_block(minimum)


def int4_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 → [M, N] bf16."""
    return kernels().int4_mm(x, packed, scale, minimum)


def ggml_mm(x: torch.Tensor, weights: list[torch.Tensor]) -> torch.Tensor:
    """x [M, K] bf16 → [M, N] bf16, the weights repacked from GGUF blocks (models/ggml.py), 7 tensors a part."""
    return kernels().ggml_mm(x, weights)


def int8_layout(q: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K] int8, scale [N, K/32] → the kernel's layout: per block of 16 outputs and group of 32 inputs,
    8 vectors of 64 bytes, byte 4j + e of vector v = q[j][4v + e] + 128 (unsigned, as VNNI and AMX's int8
    tiles read their weights); scales as bf16 [N/16, K/32, 16]."""
    N, K = q.shape
    quads = (q.to(torch.int16) + 128).to(torch.uint8).view(N // 16, 16, K // 32, 8, 4)  # block, output, group, v, e
    packed = quads.permute(0, 2, 3, 1, 4).reshape(N // 16, K // 32, 8, 64).contiguous()
    return packed, scale.view(N // 16, 16, K // 32).transpose(1, 2).contiguous().to(torch.bfloat16)


def int8_mm(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 → [M, N] bf16."""
    return kernels().int8_mm(x, packed, scale)


def bf16_usable(out_features: int, in_features: int) -> bool:
    """Whether bf16_mm takes this shape here: on AMX tiles (bf16_amx.cpp) or, without them, bf16_dot.cpp's
    vector kernel, at every level."""
    return out_features % 16 == 0 and in_features % 32 == 0 and level() != "off"


def bf16_layout(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] → bf16 [N/16, K/32, 16, 32]: per block of 16 outputs and group of 32 inputs, the AMX
    tile, row r holding each output's input pair (2r, 2r + 1)."""
    N, K = w.shape
    return w.to(torch.bfloat16).view(N // 16, 16, K // 32, 16, 2).permute(0, 2, 3, 1, 4).reshape(
        N // 16, K // 32, 16, 32).contiguous()


def bf16_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] bf16 → [M, N] bf16, on AMX tiles where they run, else on bf16_dot.cpp's kernel."""
    return kernels().bf16_mm(x, w)


def f32_usable() -> bool:
    return level() != "off"


def f32_mm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x [M, K] fp32, w [K, N] fp32 or fp16 (a weight stored transposed) → [M, N] fp32 (f32_mm.cpp)."""
    return kernels().f32_mm(x, w)


def attention_usable(head_dim: int) -> bool:
    return head_dim % 32 == 0 and head_dim <= 256 and kernels() is not None


def attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, n_keys: torch.Tensor,
              tree: torch.Tensor | None = None, window: int | None = None, scale: float | None = None,
              softcap: float | None = None) -> torch.Tensor:
    """q [B, T, Hq, D] (a strided view will do), keys/values [B, Hkv, S, D] bf16 or fp32, n_keys [B, T]: row (b, t)
    attends to the first n_keys[b, t] keys (a draft tree's, `tree`: see attention.Pass; with a sliding `window`, the
    last `window` positions of them) → [B, T, Hq, D], scaled by `scale` (default 1/√D, as scaled_dot_product_attention),
    each score s then softcap·tanh(s / softcap) where one is given (Gemma 2); on the AMX kernel where the CPU
    has AMX and no window applies."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return kernels().attention(q, keys, values, n_keys, scale, tree=tree, window=window or 0, softcap=softcap or 0.0)


def argmax_usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float32) and kernels() is not None


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., V] → each row's first maximum [...] (int64), as torch.argmax gives it."""
    return kernels().argmax_rows(x)


def sampling_usable(x: torch.Tensor) -> bool:
    """Whether sampling.cpp takes rows of these logits."""
    return argmax_usable(x)


def sample_row(row: torch.Tensor, transforms: Transforms, u: float) -> int:
    """The token an inverse-CDF draw u in [0, 1) lands on under the transforms (temperature > 0, top_k,
    top_p, min_p), row [V] contiguous."""
    temperature, top_k, top_p, min_p = transforms
    return kernels().sample_row(row, 1.0 / temperature, top_k, top_p, min_p, u)


def layer_ops_usable(x: torch.Tensor) -> bool:
    """Whether the fused layer operations take `x`: bf16 on CPU, no gradient wanted (they have none)."""
    return (x.dtype == torch.bfloat16 and x.device.type == "cpu" and not x.requires_grad
            and kernels() is not None)


def gdn_usable(x: torch.Tensor) -> bool:
    return x.device.type == "cpu" and kernels() is not None


def gdn_recurrence(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, g: torch.Tensor,
                   state: torch.Tensor, keep: torch.Tensor, tiled: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Gated DeltaNet over a pass (gdn.py's recurrence; q, k unnormalised): q, k [B, T, Hk, dk], v [B, T, Hv, dv],
    beta and the log-decay g [B, T, Hv], the rows' states [B, Hv, dk, dv], all fp32 → (out [B, T, Hv, dv], the
    states after each position keep [B, T] marks, in (b, t) order, each a tensor of its own)."""
    return kernels().gdn_recurrence(q, k, v, beta, g, state, keep, tiled)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return kernels().rms_norm(x, weight, eps)


def rope_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, n_heads: int) -> None:
    """Rotate, in place, the first n_heads heads of x [B, T, H, Dh] (contiguous) by cos and signed sin
    [B, T, 1, Dh] (see rope.rope_tables)."""
    kernels().rope_(x.flatten(0, 1), cos, sin, n_heads)


def add_rms_norm(x: torch.Tensor, y: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + y, rms_norm(x + y)) in one call, the sum rounded to bf16 as PyTorch's is."""
    return kernels().add_rms_norm(x, y, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2n] (gate, then up) → silu(gate) · up [..., n]."""
    return kernels().silu_mul(gate_up)


def gelu_tanh_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[..., 2n] (gate, then up) → gelu_tanh(gate) · up [..., n] (GeGLU), the product rounded once."""
    return kernels().gelu_tanh_mul(gate_up)


@dataclass(frozen=True)
class NativeLayer:
    """A decoder layer as decoder.cpp takes it: its tensors in groups (decoder.cpp's Layer: [input norm],
    [post-attention norm], the qkv, o, gate_up and down projections' weights, then [qkv bias], [q norm, k norm],
    [pre-MLP norm, post-MLP norm], [router], each [] where the layer has none; a routed layer's gate_up and down
    are [] too), its norms' eps, its form: (sliding window, 0 for none; the scores' scale, 0 for 1/√head_dim;
    their soft cap, 0 for none; GeGLU rather than SwiGLU; the local layers' own rotary tables; a routed layer's
    top k, 0 for a dense MLP; softmax over the top k logits alone, rather than the top k of the softmax; the
    top k's weights renormalised), and a routed layer's experts (moe.py's native Experts)."""
    groups: list[list[torch.Tensor]]
    eps: float
    form: tuple[int, float, float, bool, bool, int, bool, bool]
    experts: object | None = None


def decoder_stack(layers: list[NativeLayer], final_norm: torch.Tensor, n_heads: int, n_kv_heads: int,
                  embed_scale: float = 0.0):
    """Every decoder layer and the final norm in one native object (decoder.cpp's DecoderStack), `embed_scale`
    the factor its decode pass multiplies the embeddings by (0: none). Its forward(x, cos, sin, k_cache, v_cache,
    slots, n_keys, tree, capture, capture_at, local_cos, local_sin) is a pass over all of them, the whole KV
    cache [layers, rows, Hkv, L, Dh] given at once, and returns the final norm's output."""
    return kernels().DecoderStack([layer.groups for layer in layers], [layer.form for layer in layers],
                                  [layer.experts for layer in layers], final_norm, layers[0].eps, n_heads,
                                  n_kv_heads, embed_scale)


def decoder_layer(x: torch.Tensor, layer: NativeLayer, cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor, n_keys: torch.Tensor, n_heads: int,
                  n_kv_heads: int, tree: torch.Tensor | None = None) -> torch.Tensor:
    """One decoder layer (llama.Block) over x [B, T, D]: `layer` from Block.native_weights, cos and sin its
    rotary tables at the pass's rows, k_cache and v_cache one layer of the KV cache [rows, Hkv, L, Dh] (row b's
    keys go to row slots[b], position n_keys[b, t] − 1)."""
    return kernels().decoder_layer(x, layer.groups, layer.form, layer.eps, cos, sin, k_cache, v_cache, slots,
                                   n_keys, n_heads, n_kv_heads, tree, layer.experts)
