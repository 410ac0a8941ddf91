"""DCP storage that never unpickles: metadata as JSON, per-rank RNG state as safetensors.

Owns: `SafeWriter` / `SafeReader` (torch.distributed.checkpoint FileSystemWriter / FileSystemReader with the
metadata step replaced) and `save_rng` / `load_rng`. Stock DCP writes its `.metadata` with `pickle.dump` and
reads it with `pickle.load`, so a crafted `.metadata` runs code on resume. Here the metadata is
`metadata.json` (tensor names, dtypes, shapes, chunks and file offsets: plain data, parsed with strict
type checks). A checkpoint that holds only a pickled `.metadata` is refused, never read. Tensor payloads
stay DCP's `.distcp` files, which DCP reads with `torch.load(weights_only=True)`; byte (pickled object)
entries are refused at the metadata step because DCP would read them with `weights_only=False`.
Must not decide what is saved (parallel/checkpoint.py does).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.storage import WriteResult

from ..io import load_tensors, save_tensors

METADATA_FILE = "metadata.json"
PICKLED_METADATA_FILE = ".metadata"  # what stock DCP writes; never read
FORMAT = "moeadapt-dcp-json-1"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


class UnsafeCheckpointError(ValueError):
    """A checkpoint whose metadata cannot be read without running code (or is malformed)."""


def _ints(v: Any, what: str) -> list[int]:
    if not isinstance(v, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in v):
        raise UnsafeCheckpointError(f"{what} must be a list of integers")
    return v


def metadata_to_json(md: Metadata) -> dict:
    tensors, files = {}, []
    for fqn, m in md.state_dict_metadata.items():
        if not isinstance(m, TensorStorageMetadata):
            raise TypeError(f"state entry {fqn!r} is not a tensor; moeadapt checkpoints hold tensors only")
        tensors[fqn] = {"dtype": str(m.properties.dtype).removeprefix("torch."), "size": list(m.size),
                        "chunks": [[list(c.offsets), list(c.sizes)] for c in m.chunks]}
    for idx, info in (md.storage_data or {}).items():
        if info.transform_descriptors:
            raise TypeError("DCP stream transforms are not supported by the JSON metadata")
        files.append({"fqn": idx.fqn, "offset": list(idx.offset) if idx.offset is not None else None,
                      "index": idx.index, "file": info.relative_path, "start": info.offset, "length": info.length})
    mappings = {k: list(v) for k, v in (md.planner_data or {}).items()}
    return {"format": FORMAT, "version": md.version, "tensors": tensors, "storage": files, "mappings": mappings}


def metadata_from_json(d: Any, where: str) -> Metadata:
    """Rebuild DCP's Metadata from plain data; anything but the expected types is an error naming `where`."""
    try:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise UnsafeCheckpointError(f"not a {FORMAT} metadata file")
        sdm = {}
        for fqn, t in d["tensors"].items():
            if t["dtype"] not in _DTYPES:
                raise UnsafeCheckpointError(f"tensor {fqn!r} has unsupported dtype {t['dtype']!r}")
            chunks = [ChunkStorageMetadata(offsets=torch.Size(_ints(o, "chunk offsets")),
                                           sizes=torch.Size(_ints(s, "chunk sizes"))) for o, s in t["chunks"]]
            sdm[str(fqn)] = TensorStorageMetadata(properties=TensorProperties(dtype=_DTYPES[t["dtype"]]),
                                                  size=torch.Size(_ints(t["size"], "size")), chunks=chunks)
        storage = {}
        for e in d["storage"]:
            rel = e["file"]
            if not isinstance(rel, str) or os.path.isabs(rel) or ".." in Path(rel).parts:
                raise UnsafeCheckpointError(f"storage file {rel!r} lies outside the checkpoint directory")
            off = None if e["offset"] is None else torch.Size(_ints(e["offset"], "offset"))
            index = e["index"] if isinstance(e["index"], int) else None
            start, length = _ints([e["start"], e["length"]], "file start/length")
            storage[MetadataIndex(fqn=str(e["fqn"]), offset=off, index=index)] = _StorageInfo(rel, start, length)
        mappings = {str(k): tuple(v) for k, v in d["mappings"].items() if isinstance(v, list)
                    and all(isinstance(p, (str, int)) for p in v)}
        return Metadata(state_dict_metadata=sdm, planner_data=mappings, storage_data=storage,
                        storage_meta=StorageMeta(), version=d.get("version"))
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        msg = e.args[0] if isinstance(e, UnsafeCheckpointError) else f"malformed ({type(e).__name__}: {e})"
        raise UnsafeCheckpointError(f"{where}: {msg}; the checkpoint is corrupt - resume from an earlier "
                                    "step_* (point `latest` at it) or start a new output_dir") from None


class SafeWriter(FileSystemWriter):
    """FileSystemWriter whose `finish` writes metadata.json (temp file + rename) instead of a pickle."""

    def _get_metadata_path(self, rank: int | None = None) -> os.PathLike:
        return self.fs.concat_path(self.path, METADATA_FILE if rank is None else f"__{rank}_{METADATA_FILE}")

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        metadata.version = metadata.version or "1.0.0"
        metadata.storage_data = {wr.index: wr.storage_data for wrs in results for wr in wrs}
        final = Path(self._get_metadata_path())
        tmp = final.with_name(final.name + ".tmp")
        with open(tmp, "w") as f:
            json.dump(metadata_to_json(metadata), f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)


class SafeReader(FileSystemReader):
    """FileSystemReader that reads metadata.json and refuses a checkpoint that has only a pickled `.metadata`."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return read_safe_metadata(self.path, self.load_id)


def read_safe_metadata(path: str | os.PathLike, load_id: str | None = None) -> Metadata:
    path = Path(path)
    f = path / METADATA_FILE
    if not f.is_file():
        if (path / PICKLED_METADATA_FILE).is_file():
            raise UnsafeCheckpointError(
                f"{path} stores its DCP metadata as a pickle (.metadata), which can run code when read; moeadapt "
                f"only loads checkpoints with {METADATA_FILE} - resume from a checkpoint written by this version "
                "or start a new output_dir")
        raise FileNotFoundError(f"{path} has no {METADATA_FILE}; the save was interrupted - resume from an "
                                "earlier step_* or start a new output_dir")
    try:
        raw = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UnsafeCheckpointError(f"{f} is not valid JSON ({e}); the checkpoint is corrupt - resume from an "
                                    "earlier step_* or start a new output_dir") from None
    md = metadata_from_json(raw, str(f))
    md.storage_meta.load_id = load_id
    return md


def save_rng(path: str | Path) -> None:
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_tensors(rng, path)


def load_rng(path: str | Path) -> None:
    rng = load_tensors(path)
    if "cpu" not in rng or rng["cpu"].dtype != torch.uint8:
        raise ValueError(f"{path} holds no CPU RNG state; the checkpoint is corrupt")
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])
