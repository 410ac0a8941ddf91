"""Files that matter: atomic directory writes, model directories (config.json + safetensors).

Every write goes to a temporary sibling and is renamed into place, so a crash never leaves a half-written
checkpoint, adapter or result. Loading never unpickles: safetensors only.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
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


def read_json_object(f: Path, fix: str, error: type[Exception] = ValueError) -> dict:
    """A JSON file that must hold one object (a config or metadata file): one `error` naming the file and `fix`
    when it is not valid JSON or not an object."""
    try:
        d = json.loads(Path(f).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{f} is not valid JSON ({e}); {fix}") from None
    if not isinstance(d, dict):
        raise error(f"{f} holds a {type(d).__name__}, not a JSON object; {fix}")
    return d


def check_dtype_kind(name: str, got: torch.Tensor, want: torch.Tensor, source: str) -> None:
    """Floating weights may change precision on load; an integer or bool tensor where the model holds floats
    (or the reverse) is a broken or foreign file, never cast."""
    def kind(t):
        return ("floating" if t.is_floating_point() else "complex" if t.is_complex()
                else "bool" if t.dtype == torch.bool else "integer")
    if kind(got) != kind(want):
        raise ValueError(f"{source}: tensor {name} is {got.dtype} but the model holds {want.dtype} there; the file "
                         "is corrupt or was not written for this model - re-export it")


# -- sharded safetensors, written by many processes ----------------------------------------------------------
# A file is laid out from metadata alone (names, shapes, dtypes are the same on every rank), so one process
# writes the headers and sizes the files, then every process writes the bytes of the regions it holds with
# pwrite at their offsets: nobody ever holds more than its own shard, and no bytes travel between ranks.

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3", torch.float8_e5m2: "F8_E5M2"}


def _nbytes(shape: tuple[int, ...], dtype: torch.dtype) -> int:
    n = 1
    for d in shape:
        n *= d
    return n * torch.empty((), dtype=dtype).element_size()


def plan_shard_files(tensors: list[tuple[str, tuple[int, ...], torch.dtype]],
                     max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> dict[str, list[str]]:
    """File name -> tensor names, in order, each file <= max_shard_bytes (a larger tensor gets a file alone).
    One file is `model.safetensors`; more are `model-0000k-of-0000n.safetensors` (Hugging Face's names)."""
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes}; give a positive size such as 5e9 (5 GB)")
    groups: list[list[str]] = [[]]
    size = 0
    for name, shape, dtype in tensors:
        b = _nbytes(shape, dtype)
        if groups[-1] and size + b > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += b
    n = len(groups)
    if n == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{k + 1:05d}-of-{n:05d}.safetensors": g for k, g in enumerate(groups)}


def write_shard_headers(root: Path, files: dict[str, list[str]],
                        meta: dict[str, tuple[tuple[int, ...], torch.dtype]],
                        metadata: dict[str, str] | None = None) -> dict[str, tuple[str, int]]:
    """Write each file's safetensors header and size the file (its data still zeros); return
    tensor name -> (file, absolute byte offset of its data). `layout_shards` gives the same map without writing."""
    out = {}
    for fname, names in files.items():
        header, offsets = _header(names, meta, metadata)
        with open(root / fname, "wb") as f:
            f.write(header)
            f.truncate(len(header) + sum(_nbytes(*meta[n]) for n in names))
        out.update({n: (fname, o) for n, o in offsets.items()})
    return out


def layout_shards(files: dict[str, list[str]], meta: dict[str, tuple[tuple[int, ...], torch.dtype]],
                  metadata: dict[str, str] | None = None) -> dict[str, tuple[str, int]]:
    out = {}
    for fname, names in files.items():
        _, offsets = _header(names, meta, metadata)
        out.update({n: (fname, o) for n, o in offsets.items()})
    return out


def _header(names: list[str], meta: dict, metadata: dict | None) -> tuple[bytes, dict[str, int]]:
    h: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    pos = 0
    for n in names:
        shape, dtype = meta[n]
        if dtype not in ST_DTYPES:
            raise ValueError(f"tensor {n} has dtype {dtype}, which safetensors cannot store")
        b = _nbytes(shape, dtype)
        h[n] = {"dtype": ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [pos, pos + b]}
        pos += b
    js = json.dumps(h, separators=(",", ":")).encode()
    js += b" " * (-(len(js) + 8) % 8)  # data starts 8-byte aligned
    base = 8 + len(js)
    header = len(js).to_bytes(8, "little") + js
    starts, pos = {}, 0
    for n in names:
        starts[n] = base + pos
        pos += _nbytes(*meta[n])
    return header, starts


def write_region(fd: int, data_start: int, global_shape: tuple[int, ...], offset: tuple[int, ...],
                 piece: torch.Tensor) -> int:
    """pwrite `piece` (a box of the tensor at `offset`) into a row-major tensor stored at `data_start`.
    The box is split into contiguous byte runs (one run when only dim 0 is partial). Returns bytes written."""
    piece = piece.detach().contiguous().cpu()
    if piece.numel() == 0:
        return 0
    shape = tuple(piece.shape)
    if len(shape) != len(global_shape) or any(o + s > g for o, s, g in zip(offset, shape, global_shape)):
        raise ValueError(f"region at {offset} of shape {shape} does not fit a tensor of shape {global_shape}")
    isz = piece.element_size()
    strides = [1] * len(global_shape)
    for d in range(len(global_shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * global_shape[d + 1]
    k = 0  # dims after k are whole: each index over dims [0, k) is one contiguous run
    for d in range(len(shape)):
        if shape[d] != global_shape[d]:
            k = d
    run = 1
    for s in shape[k:]:
        run *= s
    buf = piece.view(torch.uint8).numpy().reshape(-1)
    written = 0
    for j, idx in enumerate(itertools.product(*(range(s) for s in shape[:k]))):
        lin = sum((o + i) * st for o, i, st in zip(offset, idx, strides)) + offset[k] * strides[k]
        mv = memoryview(buf[j * run * isz:(j + 1) * run * isz])
        pos = data_start + lin * isz
        while mv:  # pwrite may write less than asked
            n = os.pwrite(fd, mv, pos)
            mv, pos, written = mv[n:], pos + n, written + n
    return written


def write_shard_index(root: Path, files: dict[str, list[str]], meta: dict) -> None:
    """model.safetensors.index.json (only when there is more than one file, as Hugging Face does)."""
    if len(files) == 1:
        return
    total = sum(_nbytes(*meta[n]) for names in files.values() for n in names)
    wm = {n: f for f, names in files.items() for n in names}
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": wm}, indent=2))


def _dist():
    import torch.distributed as dist

    return dist if dist.is_available() and dist.is_initialized() else None


def write_sharded_dir(path: str | Path, tensors: list[tuple[str, tuple[int, ...], torch.dtype]], config: dict,
                      write: Callable[[Callable[[str, tuple[int, ...], torch.Tensor], None]], None],
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, extra_files: dict[str, str] | None = None) -> Path:
    """A model directory of sharded safetensors written by every process of the job (or by one).

    `tensors` (the same list on every rank) fixes the files; rank 0 writes their headers into `.<name>.tmp`;
    then `write(emit)` runs on every rank and calls `emit(name, offset, box)` for each box that rank owns
    (pwrite at its place: boxes never travel between ranks); after a barrier rank 0 writes the index,
    config.json and `extra_files`, and renames the directory into place. Collective under torch.distributed."""
    dist = _dist()
    rank = dist.get_rank() if dist else 0
    final = Path(path)
    tmp = final.parent / f".{final.name}.tmp"
    meta = {n: (tuple(s), d) for n, s, d in tensors}
    files = plan_shard_files(list(tensors), max_shard_bytes)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        where = write_shard_headers(tmp, files, meta)
    else:
        where = layout_shards(files, meta)
    if dist:
        dist.barrier()
    fds: dict[str, int] = {}

    def emit(name: str, offset: tuple[int, ...], box: torch.Tensor) -> None:
        fname, start = where[name]
        if fname not in fds:
            fds[fname] = os.open(tmp / fname, os.O_WRONLY)
        write_region(fds[fname], start, meta[name][0], tuple(offset), box.to(meta[name][1]))

    try:
        write(emit)
        for fd in fds.values():
            os.fsync(fd)
    finally:
        for fd in fds.values():
            os.close(fd)
    if dist:
        dist.barrier()  # every box is on disk before the rename makes the directory visible
    if rank == 0:
        write_shard_index(tmp, files, meta)
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        for fname, text in (extra_files or {}).items():
            (tmp / fname).write_text(text)
        replace_dir(tmp, final)
    if dist:
        dist.barrier()
    return final
