"""Files that matter: atomic directory writes, model directories (config.json + safetensors).

Every write goes to a temporary sibling and is renamed into place, so a crash never leaves a half-written
checkpoint, adapter or result. Loading never unpickles: safetensors only.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file


def _normal_permissions(root: Path) -> None:
    """mkdtemp makes 0700 dirs (and some writers 0600 files): give the result the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(root, 0o777 & ~umask)
    for p in root.rglob("*"):
        os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~umask)


def replace_dir(tmp: Path, final: Path) -> None:
    """Make the finished directory `tmp` visible as `final` (replacing an old one) by renames."""
    _normal_permissions(tmp)
    old = None
    if final.exists():
        old = final.with_name(f".{final.name}.old-{os.getpid()}")
        os.replace(final, old)
    os.replace(tmp, final)
    if old is not None:
        if old.is_dir():
            shutil.rmtree(old, ignore_errors=True)
        else:
            old.unlink()


@contextlib.contextmanager
def atomic_dir(final: str | Path) -> Iterator[Path]:
    """Yield a temporary directory; on success it replaces `final` in one rename."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        yield tmp
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes 0600 files: give the usual mode, like every other output
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def save_tensors(tensors: dict[str, torch.Tensor], path: str | Path, metadata: dict | None = None) -> None:
    # safetensors refuses shared storage and non-contiguous tensors: store clean copies
    clean = {k: v.detach().contiguous().cpu().clone() for k, v in tensors.items()}
    save_file(clean, str(path), metadata=metadata)


def load_tensors(path: str | Path) -> dict[str, torch.Tensor]:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError) as e:
        raise ValueError(f"{path} is not a readable safetensors file ({e}); it may be truncated or corrupt - "
                         "re-download or re-export it") from None


def save_model_dir(model: torch.nn.Module, spec_dict: dict, path: str | Path, extra: dict | None = None,
                   dtype: torch.dtype | None = None) -> Path:
    """config.json ({"moeadapt": ModelSpec}) + model.safetensors, written atomically."""
    state = {k: v for k, v in model.state_dict().items() if not k.endswith("tokens_per_expert")}
    if dtype is not None:
        state = {k: (v.to(dtype) if v.is_floating_point() and not k.endswith("expert_bias") else v)
                 for k, v in state.items()}
    with atomic_dir(path) as tmp:
        save_tensors(state, tmp / "model.safetensors")
        (tmp / "config.json").write_text(json.dumps({"moeadapt": spec_dict, **(extra or {})}, indent=2))
    return Path(path)


def load_state_into(model: torch.nn.Module, state: dict[str, torch.Tensor], source: str,
                    allow_missing: tuple[str, ...] = ()) -> None:
    """Strict load by name with errors naming the tensors and shapes."""
    own = {k: v for k, v in model.state_dict().items() if not k.endswith("tokens_per_expert")}
    missing = [k for k in own if k not in state and not any(s in k for s in allow_missing)]
    extra = [k for k in state if k not in own]
    if missing or extra:
        raise ValueError(f"{source} does not match the model: missing {missing[:8]}{'...' if len(missing) > 8 else ''}"
                         f", unexpected {extra[:8]}{'...' if len(extra) > 8 else ''}; was it saved from another "
                         "model config?")
    for k, v in state.items():
        if own[k].shape != v.shape:
            raise ValueError(f"{source}: tensor {k} has shape {tuple(v.shape)}, the model expects "
                             f"{tuple(own[k].shape)}; the checkpoint belongs to another model config")
        check_dtype_kind(k, v, own[k], source)
    model.load_state_dict(state, strict=False)


def check_dtype_kind(name: str, got: torch.Tensor, want: torch.Tensor, source: str) -> None:
    """Floating weights may change precision on load; an integer or bool tensor where the model holds floats
    (or the reverse) is a broken or foreign file, never cast."""
    def kind(t):
        return ("floating" if t.is_floating_point() else "complex" if t.is_complex()
                else "bool" if t.dtype == torch.bool else "integer")
    if kind(got) != kind(want):
        raise ValueError(f"{source}: tensor {name} is {got.dtype} but the model holds {want.dtype} there; the file "
                         "is corrupt or was not written for this model - re-export it")
