"""Resumable training: the draft's weights, the optimizer's moments, the random states and where the loop stood,
saved every N steps (safetensors + JSON, no pickle); a run started again on the same OUT resumes from the last one
and ends with the weights an uninterrupted run would have."""

from __future__ import annotations

import json
import random
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FOLDER = "checkpoint"
TENSORS, STATE = "state.safetensors", "state.json"


def save_checkpoint(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, rng: random.Random,
                    loop: dict) -> None:
    """`loop`: JSON-able state of the loop (step, the epoch's remaining windows, running sums, elapsed time…).
    Written to a temporary folder then renamed: a run killed while saving keeps the previous checkpoint."""
    tensors = {f"model.{k}": v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    opt_state = opt.state_dict()
    for i, state in opt_state["state"].items():
        for name, value in state.items():
            tensors[f"opt.{i}.{name}"] = torch.as_tensor(value).contiguous().cpu()
    tensors["rng.torch"] = torch.get_rng_state()
    if torch.cuda.is_available():
        tensors["rng.cuda"] = torch.cuda.get_rng_state()
    meta = {"loop": loop, "python_rng": _jsonable(rng.getstate()),
            "param_groups": opt_state["param_groups"]}
    tmp, final = out / (FOLDER + ".tmp"), out / FOLDER
    tmp.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(tmp / TENSORS))
    (tmp / STATE).write_text(json.dumps(meta))
    if final.exists():
        old = out / (FOLDER + ".old")
        final.rename(old)
        tmp.rename(final)
        for f in old.iterdir():
            f.unlink()
        old.rmdir()
    else:
        tmp.rename(final)


def load_checkpoint(out: Path, model: torch.nn.Module, opt: torch.optim.Optimizer, rng: random.Random) -> dict | None:
    """Restore the state save_checkpoint wrote to OUT → the loop's state, or None where there is none."""
    folder = out / FOLDER
    if not (folder / STATE).exists():
        return None
    tensors = load_file(str(folder / TENSORS))
    meta = json.loads((folder / STATE).read_text())
    device = next(model.parameters()).device
    model.load_state_dict({k[len("model."):]: v for k, v in tensors.items() if k.startswith("model.")})
    state: dict[int, dict] = {}
    for key, value in tensors.items():
        if key.startswith("opt."):
            _, i, name = key.split(".", 2)
            state.setdefault(int(i), {})[name] = value if name == "step" else value.to(device)
    opt.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    torch.set_rng_state(tensors["rng.torch"])
    if "rng.cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["rng.cuda"])
    rng.setstate(_tuples(meta["python_rng"]))
    return meta["loop"]


def _jsonable(x):
    return [_jsonable(v) for v in x] if isinstance(x, tuple) else x


def _tuples(x):
    return tuple(_tuples(v) for v in x) if isinstance(x, list) else x
