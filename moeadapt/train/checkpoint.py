"""Single-process training checkpoints: safetensors + JSON, written atomically (temp dir, then rename).

A checkpoint holds what a resumed run needs to continue exactly: the trainable parameters (only the
adapters in a LoRA run) and the router biases, the optimizer state, the scheduler, the data position,
the RNG states and the step. `latest` names the newest one. (Multi-rank runs use DCP: parallel/.)
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..io import atomic_dir, atomic_write_text, load_tensors, save_tensors
from ..models.model import checkpoint_tensors


def save_checkpoint(root: str | Path, step: int, model, optimizer, scheduler, sampler_state: dict) -> Path:
    root = Path(root)
    path = root / f"step_{step:07d}"
    opt = optimizer.state_dict()
    opt_tensors, opt_meta = {}, {}
    for idx, st in opt["state"].items():
        for k, v in st.items():
            if torch.is_tensor(v):
                opt_tensors[f"{idx}.{k}"] = v
            else:
                opt_meta[f"{idx}.{k}"] = v
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    with atomic_dir(path) as tmp:
        save_tensors(checkpoint_tensors(model), tmp / "model.safetensors")
        save_tensors(opt_tensors or {"_empty": torch.zeros(1)}, tmp / "optimizer.safetensors")
        save_tensors(rng, tmp / "rng.safetensors")
        (tmp / "state.json").write_text(json.dumps({
            "step": step, "scheduler": scheduler.state_dict(), "sampler": sampler_state,
            "param_groups": opt["param_groups"], "optimizer_scalars": opt_meta,
        }, indent=1, default=float))
    atomic_write_text(root / "latest", path.name)
    return path


def latest_checkpoint(root: str | Path) -> Path | None:
    root = Path(root)
    f = root / "latest"
    if not f.is_file():
        return None
    p = root / f.read_text().strip()
    return p if p.is_dir() else None


def load_checkpoint(path: str | Path, model, optimizer, scheduler) -> tuple[int, dict]:
    """Restore in place; returns (step, sampler_state)."""
    path = Path(path)
    state_file = path / "state.json"
    if not state_file.is_file() and (path / ".metadata").is_file():
        raise FileNotFoundError(f"{path} is a distributed (DCP) checkpoint written under torchrun; resume it with "
                                "`torchrun --nproc_per_node N -m moeadapt train ...` (any N)")
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no state.json); was the save interrupted?")
    meta = json.loads(state_file.read_text())
    tensors = load_tensors(path / "model.safetensors")
    own = checkpoint_tensors(model)
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or extra:
        raise ValueError(f"checkpoint {path} does not fit this run: missing {missing[:6]}, unexpected {extra[:6]}; "
                         "resume with the same model and lora config")
    with torch.no_grad():
        for k, v in tensors.items():
            own[k].copy_(v)
    opt_t = load_tensors(path / "optimizer.safetensors")
    state: dict[int, dict] = {}
    for key, v in list(opt_t.items()) + list(meta["optimizer_scalars"].items()):
        if key == "_empty":
            continue
        idx, k = key.split(".", 1)
        state.setdefault(int(idx), {})[k] = v
    optimizer.load_state_dict({"state": state, "param_groups": meta["param_groups"]})
    scheduler.load_state_dict(meta["scheduler"])
    rng = load_tensors(path / "rng.safetensors")
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return int(meta["step"]), meta["sampler"]
