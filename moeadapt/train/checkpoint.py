"""Single-process training checkpoints: safetensors + JSON, written atomically (temp dir, then rename).

A checkpoint holds what a resumed run needs to continue exactly: the trainable parameters (only the
adapters in a LoRA run) and the router biases, the optimizer state, the scheduler, the data position,
the RNG states and the step. `latest` names the newest one. (Multi-rank runs use DCP: parallel/.)
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

from ..io import atomic_dir, atomic_write_text, check_dtype_kind, load_tensors, save_tensors
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


_STEP_DIR = re.compile(r"step_(\d{7,})$")


def latest_checkpoint(root: str | Path) -> Path | None:
    """The directory `latest` names when it is a complete checkpoint, else the newest complete step_*."""
    c = resume_candidates(root)
    return c[0] if c else None


def is_complete(path: Path) -> bool:
    """A finished save: single-process (state.json + its safetensors) or DCP (meta.json + metadata)."""
    single = all((path / f).is_file() for f in ("state.json", "model.safetensors", "optimizer.safetensors"))
    dcp = (path / "meta.json").is_file() and ((path / "metadata.json").is_file() or (path / ".metadata").is_file())
    return path.is_dir() and (single or dcp)


def step_dirs(root: str | Path) -> list[Path]:
    """Complete step_* checkpoints under root, newest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)) and is_complete(p)]
    return [p for _, p in sorted(found, reverse=True)]


def resume_candidates(root: str | Path) -> list[Path]:
    """What to resume from, in order: the checkpoint `latest` names (when complete), then every complete
    step_* newest first. A missing or dangling `latest` therefore falls back to the newest complete step."""
    root = Path(root)
    out = []
    f = root / "latest"
    if f.is_file():
        try:
            p = root / f.read_text().strip()
        except (OSError, UnicodeDecodeError):
            p = None
        if p is not None and _STEP_DIR.match(p.name) and is_complete(p):
            out.append(p)
    out += [p for p in step_dirs(root) if p not in out]
    return out


def clean_partial_saves(root: str | Path) -> list[Path]:
    """Remove what interrupted saves leave (.step_N.tmp*, .step_N.old-*); returns the removed paths."""
    root = Path(root)
    if not root.is_dir():
        return []
    gone = [p for p in root.iterdir() if re.match(r"\.step_\d+\.(tmp|old)", p.name)]
    for p in gone:
        shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
    return gone


def prune_checkpoints(root: str | Path, keep: int) -> list[Path]:
    """Delete complete step_* beyond the newest `keep` (never the one `latest` names); returns them."""
    root = Path(root)
    named = resume_candidates(root)[:1]
    old = [p for p in step_dirs(root)[keep:] if p not in named]
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


def load_checkpoint(path: str | Path, model, optimizer, scheduler) -> tuple[int, dict]:
    """Restore in place; returns (step, sampler_state)."""
    path = Path(path)
    state_file = path / "state.json"
    if not state_file.is_file() and any((path / f).is_file() for f in ("metadata.json", ".metadata")):
        raise FileNotFoundError(f"{path} is a distributed (DCP) checkpoint written under torchrun; resume it with "
                                "`torchrun --nproc_per_node N -m moeadapt train ...` (any N)")
    if not state_file.is_file():
        raise FileNotFoundError(f"{path} is not a checkpoint (no state.json); was the save interrupted?")
    try:
        meta = json.loads(state_file.read_text())
        step, sampler, groups, scalars = int(meta["step"]), meta["sampler"], meta["param_groups"], meta["optimizer_scalars"]
        sched_state = meta["scheduler"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{state_file} is corrupt ({type(e).__name__}: {e}); resume from an earlier step_* "
                         "checkpoint") from None
    tensors = load_tensors(path / "model.safetensors")
    own = checkpoint_tensors(model)
    missing, extra = sorted(set(own) - set(tensors)), sorted(set(tensors) - set(own))
    if missing or extra:
        raise ValueError(f"checkpoint {path} does not fit this run: missing {missing[:6]}, unexpected {extra[:6]}; "
                         "resume with the same model and lora config")
    for k, v in tensors.items():
        if v.shape != own[k].shape:
            raise ValueError(f"checkpoint {path}: {k} has shape {tuple(v.shape)}, this run's is {tuple(own[k].shape)}; "
                             "resume with the model and lora config (e.g. lora.rank) the run was saved with, or "
                             "start a new output_dir")
        check_dtype_kind(k, v, own[k], str(path / "model.safetensors"))
        if v.is_floating_point() and not bool(torch.isfinite(v).all()):
            raise ValueError(f"checkpoint {path}: {k} holds NaN/Inf values; resume from an earlier step_* checkpoint")
    opt_t = load_tensors(path / "optimizer.safetensors")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    state: dict[int, dict] = {}
    for key, v in list(opt_t.items()) + list(scalars.items()):
        if key == "_empty":
            continue
        idx, k = key.split(".", 1)
        if not idx.isdigit() or int(idx) >= len(params):
            raise ValueError(f"{path / 'optimizer.safetensors'}: entry {key!r} names no parameter of this run "
                             f"({len(params)} trainable tensors); resume with the config the run was saved with")
        p = params[int(idx)]
        if torch.is_tensor(v) and v.dim() > 0 and v.shape != p.shape:
            raise ValueError(f"{path / 'optimizer.safetensors'}: {key} has shape {tuple(v.shape)}, its parameter "
                             f"has {tuple(p.shape)}; the optimizer state is corrupt or from another config - resume "
                             "from an earlier step_* or start a new output_dir")
        state.setdefault(int(idx), {})[k] = v
    # split and whole fp32 weights load into each other with nothing rounded away: fp32 weights resumed as split
    # ones (train.weight_dtype fp32_split, e.g. a run saved before it was the default) give the parameter its bf16
    # half and the optimizer the int16 low half; a split run resumed with fp32 weights joins its halves, as does a
    # weight a split run now keeps whole (the routers' weights: train/copies.py store_bf16)
    from ..ops.optim import join_fp32, split_fp32

    split = getattr(optimizer, "split_weights", False)
    lows, saved_lows = {}, {}
    for idx, st in state.items():  # a low half saved for a weight this run keeps whole (fp32) is joined into it
        if "weight_lo" in st and not (split and params[idx].dtype == torch.bfloat16):
            saved_lows[id(params[idx])] = st.pop("weight_lo")
    with torch.no_grad():
        for k, v in tensors.items():
            if split and own[k].dtype == torch.bfloat16 and v.dtype == torch.float32:
                hi, lows[own[k]] = split_fp32(v)
                own[k].copy_(hi)
            elif id(own[k]) in saved_lows and own[k].dtype == torch.float32 and v.dtype == torch.bfloat16:
                own[k].copy_(join_fp32(v, saved_lows[id(own[k])]))
            else:
                own[k].copy_(v)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
        scheduler.load_state_dict(sched_state)
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{state_file}: the optimizer / scheduler state does not fit this run ({e}); resume with "
                         "the config the run was saved with") from None
    if lows:
        optimizer.seed_low_halves(lows)
    rng = load_tensors(path / "rng.safetensors")
    if "cpu" not in rng or rng["cpu"].dtype != torch.uint8:
        raise ValueError(f"{path / 'rng.safetensors'} holds no CPU RNG state; the checkpoint is corrupt")
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
    return step, sampler
