"""One training loop for both kinds of draft, each defined by its objective.

- eagle: a one-layer head on the target's features (see speculant/proposers/eagle.py). Loss:
  feature regression (smooth L1) + 0.1 × KL to the target's top-k distribution (EAGLE's
  cross-entropy less the target's entropy, a constant). The full-vocabulary softmax through the
  frozen lm_head is the expensive part, so the KL uses a random fraction of positions. A second,
  unrolled pass feeds the head its own predicted features, as drafting does after the first token.
- draft_model: a small standalone Llama decoder with the target's tokenizer, its embedding
  initialised from the target's (projected onto the top principal directions), trained on the
  target's top-k distributions (KL).
"""

from __future__ import annotations

import json
import logging
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from speculant.models.llama import Transformer
from speculant.models.loader import LoadedModel
from speculant.models.model_config import ModelConfig
from speculant.proposers.eagle import EagleHead, draft_lm_head, head_config, save_eagle
from speculant.training.losses import top_k_kl

log = logging.getLogger("speculant")
KINDS = ("eagle", "eagle3", "draft_model")


@dataclass
class TrainConfig:
    kind: str = "eagle"
    epochs: float = 3.0
    max_minutes: float = 30.0  # the schedule ends at whichever comes first: epochs or this
    batch_size: int = 8
    window: int = 256
    lr: float = 1e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    val_fraction: float = 0.03
    log_every: int = 10
    eval_every: int = 100
    seed: int = 0
    # eagle
    kl_fraction: float = 0.25
    kl_weight: float = 0.1
    feature_noise: float = 0.1  # std of the noise on input features, relative to their RMS
    unroll: int = 2
    # eagle3: training-time-test steps (the head fed its own output for ttt_steps − 1 further drafts)
    ttt_steps: int = 3
    # Save a resumable checkpoint every N steps (0: never); a run on the same OUT resumes from the last one.
    checkpoint_every: int = 0
    # The head drafts from the target's N most frequent next tokens (0: all): a few thousand cover most of
    # the target's first choices, and a draft token's cost falls with N.
    draft_vocab: int = 2048
    # eagle3: the target's features of the recorded sequences are kept in memory (fp32) up to this size, so each
    # is read once, not once per epoch
    feature_cache_gb: float = 4.0
    # draft_model
    draft_dim: int = 256
    draft_layers: int = 3
    draft_heads: int = 4
    draft_kv_heads: int = 2
    draft_intermediate: int = 768


class WindowCache:
    """Training reads whole windows from position 0: attention needs only the window's own keys,
    so this cache stores nothing (and autograd sees no in-place writes)."""

    def __init__(self, batch: int, device: torch.device):
        self.lengths = torch.zeros(batch, dtype=torch.long, device=device)

    def check_capacity(self, end: int) -> None:
        """Nothing is stored: any window fits."""

    @staticmethod
    def index(slots, positions, span) -> None:
        return None

    @staticmethod
    def update(layer, at, k, v):
        return k, v


def frequent_next_tokens(data: dict[str, torch.Tensor], n: int, vocab_size: int) -> torch.Tensor | None:
    """The n tokens the target most often ranks first in the data, sorted by id (None: n covers all)."""
    if not n or n >= vocab_size:
        return None
    counts = torch.bincount(data["topk_ids"][:, 0].long(), minlength=vocab_size)
    return counts.topk(n).indices.sort().values


# -- objectives ---------------------------------------------------------------------------------


class EagleObjective(nn.Module):
    def __init__(self, target: LoadedModel, cfg: TrainConfig, feature_rms: float, vocab: torch.Tensor | None):
        super().__init__()
        self.cfg, self.target_model = cfg, target.model  # frozen: embeddings and lm_head are the target's
        self.model = EagleHead(head_config(target.config), vocab).float()
        self.lm_head = draft_lm_head(target.model, vocab)
        # full-vocabulary id → index in the draft vocabulary (-1 outside it)
        self.register_buffer("index", None if vocab is None else torch.full(
            (target.config.vocab_size,), -1, dtype=torch.long).index_copy_(0, vocab, torch.arange(len(vocab))))
        self.model.layer.load_state_dict(target.model.model.layers[-1].state_dict())
        self.model.norm.weight.data.copy_(target.model.model.norm.weight.float())
        self.noise = cfg.feature_noise * feature_rms

    def trainable(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def loss(self, batch: dict[str, torch.Tensor], train: bool = True) -> tuple[torch.Tensor, dict]:
        tokens, hidden, valid = batch["tokens"], batch["hidden"], batch["valid"]
        # Entry i reads (feature i, token i+1) and predicts feature i+1.
        embeds = self.target_model.embed(tokens[:, 1:]).float()
        target_features, mask = hidden[:, 1:], valid[:, 1:]
        features = hidden[:, :-1]
        if train and self.noise:
            features = features + self.noise * torch.randn_like(features)
        total, metrics = 0.0, {}
        for step in range(self.cfg.unroll):
            pred = self.model(embeds, features, WindowCache(len(tokens), tokens.device),
                              torch.arange(len(tokens), device=tokens.device))
            reg = F.smooth_l1_loss(pred[mask], target_features[mask])
            fraction = self.cfg.kl_fraction if train else 1.0
            pick = mask & (torch.rand(mask.shape, device=mask.device) < fraction)
            logits = self.lm_head(pred[pick]).float()
            top_ids = batch["topk_ids"][:, 1:][pick]
            draft_ids = top_ids if self.index is None else self.index[top_ids]
            kl = top_k_kl(logits, batch["topk_logprobs"][:, 1:][pick], draft_ids)
            total = total + reg + self.cfg.kl_weight * kl
            top1 = (logits.argmax(-1) == draft_ids[:, 0]).float().mean()
            n = step + 1
            metrics.update({f"reg{n}": reg.item(), f"kl{n}": kl.item(), f"top1_{n}": top1.item()})
            # Next pass: the head reads its own predictions, as when drafting token 2, 3, …
            features = torch.cat((hidden[:, :1], pred[:, :-1]), dim=1)
        return total / self.cfg.unroll, metrics

    def save(self, out: Path, target: LoadedModel, training: dict) -> None:
        save_eagle(self.model, out, target, training=training)


class DraftModelObjective(nn.Module):
    def __init__(self, target: LoadedModel, cfg: TrainConfig):
        super().__init__()
        self.cfg = cfg
        t = target.config
        self.hf_config = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": t.vocab_size,
            "hidden_size": cfg.draft_dim, "intermediate_size": cfg.draft_intermediate,
            "num_hidden_layers": cfg.draft_layers, "num_attention_heads": cfg.draft_heads,
            "num_key_value_heads": cfg.draft_kv_heads, "head_dim": cfg.draft_dim // cfg.draft_heads,
            "rms_norm_eps": t.norm_eps, "rope_theta": t.rope_theta,
            "max_position_embeddings": t.max_position_embeddings, "tie_word_embeddings": True,
            "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
            "bos_token_id": target.tokenizer.bos_id if target.tokenizer else None,
            "eos_token_id": target.eos_token_ids[0] if target.eos_token_ids else None,
            "torch_dtype": "bfloat16",
        }
        self.model = Transformer(ModelConfig.from_hf(self.hf_config))
        for p in self.model.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=0.02)
        # The target's embedding on its top principal directions: logits start near the
        # target's unigram-plus-bigram structure instead of noise.
        emb = target.model.model.embed_tokens.weight.float()
        U, S, _ = torch.linalg.svd(emb, full_matrices=False)
        self.model.model.embed_tokens.weight.data.copy_(U[:, :cfg.draft_dim] * S[:cfg.draft_dim])

    def trainable(self) -> list[nn.Parameter]:
        return list(self.model.parameters())

    def loss(self, batch: dict[str, torch.Tensor], train: bool = True) -> tuple[torch.Tensor, dict]:
        tokens, valid = batch["tokens"], batch["valid"]
        hidden = self.model(tokens, WindowCache(len(tokens), tokens.device),
                            torch.arange(len(tokens), device=tokens.device))
        logits = self.model.logits(hidden[valid])
        kl = top_k_kl(logits, batch["topk_logprobs"][valid], batch["topk_ids"][valid])
        top1 = (logits.argmax(-1) == batch["topk_ids"][valid][:, 0]).float().mean()
        return kl, {"kl1": kl.item(), "top1_1": top1.item()}

    def save(self, out: Path, target: LoadedModel, training: dict) -> None:
        """A Hugging Face folder (config.json, model.safetensors in bf16, the target's tokenizer)."""
        out.mkdir(parents=True, exist_ok=True)
        state = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in self.model.state_dict().items()
                 if k != "lm_head.weight"}  # tied to the embedding
        save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
        (out / "config.json").write_text(json.dumps(self.hf_config, indent=2))
        (out / "generation_config.json").write_text(json.dumps(
            {"bos_token_id": self.hf_config["bos_token_id"], "eos_token_id": target.eos_token_ids}, indent=2))
        source = tokenizer_folder(target)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            if (source / name).exists():
                shutil.copy(source / name, out / name)
        (out / "training.json").write_text(json.dumps(training, indent=2))


def tokenizer_folder(target: LoadedModel) -> Path:
    source = Path(target.source)
    if source.is_file():
        from speculant.models.gguf import convert_gguf

        return convert_gguf(source)[0]
    return source


def make_objective(target: LoadedModel, cfg: TrainConfig, data: dict[str, torch.Tensor]) -> nn.Module:
    if cfg.kind == "eagle":
        rms = float(data["hidden"][:4096].float().pow(2).mean().sqrt())
        return EagleObjective(target, cfg, rms, frequent_next_tokens(data, cfg.draft_vocab, target.config.vocab_size))
    if cfg.kind == "eagle3":
        from speculant.training.eagle3 import Eagle3Objective

        return Eagle3Objective(target, cfg, frequent_next_tokens(data, cfg.draft_vocab, target.config.vocab_size), data)
    if cfg.kind == "draft_model":
        return DraftModelObjective(target, cfg)
    raise ValueError(f"unknown draft kind {cfg.kind!r}; choose one of {', '.join(KINDS)}")


# -- batches ------------------------------------------------------------------------------------


def split_windows(offsets: torch.Tensor, window: int, val_fraction: float,
                  seed: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(start, length) windows of at most `window` tokens, never across a sequence boundary;
    whole sequences go to validation so it measures text the draft has not read."""
    seqs = list(range(len(offsets) - 1))
    random.Random(seed).shuffle(seqs)
    n_val = max(1, int(len(seqs) * val_fraction)) if len(seqs) > 1 else 0
    train, val = [], []
    for i, s in enumerate(seqs):
        start, end = int(offsets[s]), int(offsets[s + 1])
        for w in range(start, end - 1, window):
            (val if i < n_val else train).append((w, min(window, end - w)))
    return train, val


def make_batch(data: dict[str, torch.Tensor], windows: list[tuple[int, int]],
               device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    B, T = len(windows), max(n for _, n in windows)
    batch = {
        "tokens": torch.zeros(B, T, dtype=torch.long),
        "hidden": torch.zeros(B, T, data["hidden"].shape[1]),
        "topk_logprobs": torch.zeros(B, T, data["topk_logprobs"].shape[1]),
        "topk_ids": torch.zeros(B, T, data["topk_ids"].shape[1], dtype=torch.long),
        "valid": torch.zeros(B, T, dtype=torch.bool),
        "starts": torch.tensor([start for start, _ in windows]),  # where each window is in the data
    }
    for b, (start, n) in enumerate(windows):
        batch["tokens"][b, :n] = data["tokens"][start:start + n]
        batch["hidden"][b, :n] = data["hidden"][start:start + n].float()
        batch["topk_logprobs"][b, :n] = data["topk_logprobs"][start:start + n].float()
        batch["topk_ids"][b, :n] = data["topk_ids"][start:start + n]
        batch["valid"][b, :n] = True
    return {k: v.to(device) for k, v in batch.items()}


# -- the loop -----------------------------------------------------------------------------------


def learning_rate(cfg: TrainConfig, step: int, progress: float) -> float:
    """Linear warm-up, then cosine decay to 10% over the run's progress (steps or time)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


@torch.no_grad()
def evaluate(objective: nn.Module, data: dict, windows: list[tuple[int, int]], batch_size: int,
             device: torch.device | str = "cpu") -> dict:
    objective.eval()
    sums: dict[str, float] = {}
    n = 0
    for i in range(0, len(windows), batch_size):
        loss, metrics = objective.loss(make_batch(data, windows[i:i + batch_size], device), train=False)
        for k, v in {"loss": loss.item(), **metrics}.items():
            sums[k] = sums.get(k, 0.0) + v
        n += 1
    objective.train()
    return {k: v / max(n, 1) for k, v in sums.items()}


def train(target: LoadedModel, data: dict[str, torch.Tensor], cfg: TrainConfig, out: Path,
          progress_bar: bool = True) -> dict:
    """Train a draft of kind cfg.kind on recorded data; save it to `out` with its loss curve."""
    from tqdm import tqdm

    from speculant.training.checkpoint import load_checkpoint, save_checkpoint

    torch.manual_seed(cfg.seed)
    out.mkdir(parents=True, exist_ok=True)
    objective = make_objective(target, cfg, data).to(target.model.device)  # on CUDA where the target is
    train_windows, val_windows = split_windows(data["offsets"], cfg.window, cfg.val_fraction, cfg.seed)
    steps_per_epoch = max(1, len(train_windows) // cfg.batch_size)
    total_steps = max(1, int(cfg.epochs * steps_per_epoch))
    opt = torch.optim.AdamW(objective.trainable(), lr=cfg.lr, betas=(0.9, 0.95),
                            weight_decay=cfg.weight_decay)
    rng = random.Random(cfg.seed)
    history: list[dict] = []
    order: list[tuple[int, int]] = []
    running: dict[str, float] = {}
    start, before = 0, 0.0  # a resumed run: the steps and seconds of the runs before it
    loop = load_checkpoint(out, objective.model, opt, rng) if cfg.checkpoint_every else None
    if loop is not None:
        start, before = loop["step"], loop["elapsed_s"]
        order, running, history = [tuple(w) for w in loop["order"]], loop["running"], loop["history"]
        log.info("resuming %s training from %s at step %d of %d", cfg.kind, out / "checkpoint", start, total_steps)
        # The log again as it stood at the checkpoint: rows written after it are written again.
        (out / "train_log.jsonl").write_text("".join(json.dumps(row) + "\n" for row in history))
    t0 = time.perf_counter() - before
    bar = tqdm(total=total_steps, initial=start, desc=f"train {cfg.kind}", unit="step", disable=not progress_bar)
    step = start - 1
    last: dict[str, float] = {}
    for step in range(start, total_steps):
        elapsed = time.perf_counter() - t0
        progress = max(step / total_steps, elapsed / (60 * cfg.max_minutes))
        if progress >= 1.0:
            break
        if len(order) < cfg.batch_size:
            order = train_windows[:]
            rng.shuffle(order)
        windows, order = order[:cfg.batch_size], order[cfg.batch_size:]
        for group in opt.param_groups:
            group["lr"] = learning_rate(cfg, step, progress)
        last = train_step(objective, opt, make_batch(data, windows, target.model.device))
        for k, v in last.items():
            running[k] = running.get(k, 0.0) + v
        bar.update(1)
        if (step + 1) % cfg.log_every == 0:
            row = {"step": step + 1, "time_s": round(time.perf_counter() - t0, 1),
                   "epoch": round((step + 1) / steps_per_epoch, 3),
                   **{k: v / cfg.log_every for k, v in running.items()}}
            running = {}
            if val_windows and (step + 1) % cfg.eval_every == 0:
                val = evaluate(objective, data, val_windows, cfg.batch_size, target.model.device)
                row.update({f"val_{k}": v for k, v in val.items()})
            bar.set_postfix(loss=f"{row['loss']:.3f}", top1=f"{row.get('top1_1', 0):.2f}")
            history.append(row)
            with open(out / "train_log.jsonl", "a") as f:
                f.write(json.dumps(row) + "\n")
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            save_checkpoint(out, objective.model, opt, rng, {
                "step": step + 1, "elapsed_s": time.perf_counter() - t0, "order": order, "running": running,
                "history": history})
    bar.close()
    final = {f"val_{k}": v for k, v in evaluate(objective, data, val_windows, cfg.batch_size,
                                                               target.model.device).items()} \
        if val_windows else {}
    summary = {"kind": cfg.kind, "steps": step + 1, "epochs": round((step + 1) / steps_per_epoch, 3),
               "wall_time_s": round(time.perf_counter() - t0, 1),
               "train_tokens": sum(n for _, n in train_windows), "val_tokens": sum(n for _, n in val_windows),
               "final_train_loss": history[-1]["loss"] if history else last.get("loss"), **final,
               "train_tokens_per_s": round(sum(n for _, n in train_windows) * (step + 1) / steps_per_epoch
                                           / max(time.perf_counter() - t0, 1e-9), 1),
               "config": asdict(cfg)}
    objective.save(out, target, summary)
    plot_loss(history, out / "loss.png", cfg.kind)
    return summary


def train_step(objective, opt: torch.optim.Optimizer, batch) -> dict[str, float]:
    """One optimizer step on a batch → its loss and metrics."""
    loss, metrics = objective.loss(batch)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(objective.trainable(), 1.0)
    opt.step()
    return {"loss": loss.item(), **metrics}


def plot_loss(history: list[dict], path: Path, title: str) -> None:
    if not history:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([h["step"] for h in history], [h["loss"] for h in history], label="train loss")
    val = [h for h in history if "val_loss" in h]
    if val:
        ax.plot([h["step"] for h in val], [h["val_loss"] for h in val], "o-", label="validation loss")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(f"speculant train-draft --kind {title}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
