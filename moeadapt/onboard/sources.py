"""Checkpoint sources a rank reads its shards from, one box of one tensor at a time.

Owns: `SafetensorsSource` (Hugging Face directories, single file or indexed shards, FP8 block-scaled weights,
and our own model directories, through `StreamingLoader.read_slice`), `DCPSource` (torch.distributed.checkpoint
directories written by a full-training run) and `open_source(path)`, which picks one. A source knows nothing
of ranks: `moeadapt.parallel.sharded_io.load_sharded` asks it for boxes (`read(name, global_shape, slices)`, the
shape of the `fill(name, global_shape, local_slices)` hook of the build path) and copies them into the shards.

Both check names and shapes against the model first (`check(shapes)`, from headers / metadata only) and fail
with one message naming the tensors; both count the bytes they read (`bytes_read`).
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from .families import OnboardError
from .loader import Slices, StreamingLoader, checkpoint_index
from .names import build_rules

BLOCK_BYTES = 64 * 2**20


def _is_adapter(name: str) -> bool:
    return ".lora_A" in name or ".lora_B" in name


def _listed(names: list[str]) -> str:
    return f"{sorted(names)[:8]}{' ...' if len(names) > 8 else ''}"


class SafetensorsSource:
    """A Hugging Face checkpoint directory (any onboarded family) or one of our model directories."""

    def __init__(self, path: str | Path, allow_unmapped: bool = False):
        from . import read_family_dir

        self.path = Path(path)
        self.fam = read_family_dir(self.path, allow_unmapped)
        self.loader = StreamingLoader(self.path, self.fam, build_rules(self.fam, checkpoint_index(self.path)),
                                      dtype=torch.float32)  # present names: a family saved two ways (aliases)

    @property
    def bytes_read(self) -> int:
        return self.loader.bytes_read

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        """`shapes`: our tensor name -> full (global) shape, adapters excluded. Raises OnboardError."""
        rules = {r.ours: r for r in self.loader.rules}
        unknown = [n for n in shapes if n not in rules]
        lacking = [n for n in rules if n not in shapes]
        if unknown or lacking:
            raise OnboardError(f"init_from {self.path} ({self.fam.model_type}) does not match the model: the model "
                               f"has {_listed(unknown)} that the checkpoint's config does not, and lacks "
                               f"{_listed(lacking)}; use the model config the checkpoint was made with")
        bad = [f"{n} has shape {tuple(shapes[n])} in the model but {rules[n].shape} in the checkpoint's config"
               for n in shapes if tuple(shapes[n]) != tuple(rules[n].shape)]
        if bad:
            raise OnboardError(f"init_from {self.path}: shape mismatch: {'; '.join(bad[:6])}; the checkpoint "
                               "belongs to another model config")
        self.loader.check()

    def read(self, name: str, global_shape: tuple[int, ...], slices: Slices) -> torch.Tensor | None:
        return self.loader.read_slice(name, slices)

    def as_fill(self, fallback=None):
        """This source as a `fill(name, global_shape, local_slices) -> tensor` for the build path's per-shard
        fill: checkpoint tensors are read, the rest (LoRA adapters, router counters, tensors absent by design
        with no stated init) come from `fallback` (e.g. the initialising fill). Call `check` first."""
        def fill(name: str, global_shape: tuple[int, ...], sl: Slices) -> torch.Tensor:
            t = self.read(name, global_shape, sl) if self.loader.rule(name) is not None else None
            if t is None:
                if fallback is None:
                    raise OnboardError(f"{name} is not in {self.path} and no fallback fill was given")
                return fallback(name, global_shape, sl)
            return t

        return fill

    def fill(self, items: list[tuple[str, tuple[int, ...], Slices, torch.Tensor]]) -> None:
        """Copy each box into its destination (a rank's local shard), in blocks of dim-0 rows of at most
        BLOCK_BYTES (one expert at least): the memory a load needs beyond the shards is one block."""
        for name, shape, sl, dst in items:
            if dst.numel() == 0:
                continue
            rows = sl[0].stop - sl[0].start
            per_row = max(1, dst[0].numel() * 4)  # fp32: what a dequantised FP8 block takes
            step = max(1, min(rows, BLOCK_BYTES // per_row))
            for a in range(0, rows, step):
                b = min(rows, a + step)
                t = self.read(name, shape, (slice(sl[0].start + a, sl[0].start + b), *sl[1:]))
                if t is None:
                    break
                dst[a:b].copy_(t.reshape(dst[a:b].shape))
                del t
        self.loader.close()


class DCPSource:
    """A torch.distributed.checkpoint directory of a full-training run (tensors "model.<our name>")."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        from ..parallel.safe_dcp import SafeReader  # metadata as JSON: a checkpoint never unpickles

        self.reader = SafeReader(str(self.path))
        self.meta = self.reader.read_metadata()
        self.bytes_read = 0

    def check(self, shapes: dict[str, tuple[int, ...]]) -> None:
        md = self.meta.state_dict_metadata
        have = {k[len("model."):]: v for k, v in md.items() if k.startswith("model.")}
        missing = [n for n in shapes if n not in have]
        extra = [n for n in have if n not in shapes and not _is_adapter(n)]
        if missing or extra:
            base = [n for n in have if not _is_adapter(n) and not n.endswith("expert_bias")]
            hint = (" (a LoRA run's checkpoint holds only its adapters: init_from needs a full-training checkpoint "
                    "or a model directory)" if missing and not base else "")
            raise OnboardError(f"init_from {self.path} (DCP) does not match the model: missing {_listed(missing)}, "
                               f"unexpected {_listed(extra)}{hint}")
        bad = [f"{n} has shape {tuple(shapes[n])} in the model but {tuple(have[n].size)} in the checkpoint"
               for n in shapes if isinstance(have[n], TensorStorageMetadata) and tuple(have[n].size) != tuple(shapes[n])]
        if bad:
            raise OnboardError(f"init_from {self.path}: shape mismatch: {'; '.join(bad[:6])}; the checkpoint "
                               "belongs to another model config")

    def as_fill(self, fallback=None):
        """As `SafetensorsSource.as_fill` (one small DCP read per tensor)."""
        def fill(name: str, global_shape: tuple[int, ...], sl: Slices) -> torch.Tensor:
            if f"model.{name}" in self.meta.state_dict_metadata:
                return self.read(name, global_shape, sl)
            if fallback is None:
                raise OnboardError(f"{name} is not in {self.path} and no fallback fill was given")
            return fallback(name, global_shape, sl)

        return fill

    def read(self, name: str, global_shape: tuple[int, ...], slices: Slices) -> torch.Tensor:
        box = torch.empty([s.stop - s.start for s in slices],
                          dtype=self.meta.state_dict_metadata[f"model.{name}"].properties.dtype)
        self.fill([(name, global_shape, slices, box)])
        return box

    def fill(self, items: list[tuple[str, tuple[int, ...], Slices, torch.Tensor]]) -> None:
        """One DCP read of every box, straight into the destinations (this rank only, no collectives)."""
        sd = {f"model.{n}": dst for n, _, _, dst in items if dst.numel()}
        offsets = {f"model.{n}": tuple(s.start for s in sl) for n, _, sl, dst in items if dst.numel()}
        planner = _BoxPlanner(offsets)
        dcp.load(sd, storage_reader=self.reader, planner=planner, no_dist=True)
        self.bytes_read += planner.bytes_planned


class _BoxPlanner(DefaultLoadPlanner):
    """Reads, for each plain destination tensor, the box of the saved tensor at its global offset."""

    def __init__(self, offsets: dict[str, tuple[int, ...]]):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.offsets, self.bytes_planned = offsets, 0

    def create_local_plan(self) -> LoadPlan:
        items = []
        for fqn, t in self.state_dict.items():
            chunk = ChunkStorageMetadata(offsets=torch.Size(self.offsets[fqn]), sizes=t.size())
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], [chunk])
        storage = self.metadata.storage_data or {}  # the saved chunks the items come from are read whole
        self.bytes_planned += sum(storage[k].length for k in {i.storage_index for i in items} if k in storage)
        self.plan = LoadPlan(items)
        return self.plan

    def lookup_tensor(self, index):
        return self.state_dict[index.fqn]


def is_dcp_dir(p: str | Path) -> bool:
    """A torch.distributed.checkpoint directory (ours: metadata.json; stock DCP: a pickled .metadata)."""
    from ..parallel.safe_dcp import METADATA_FILE, PICKLED_METADATA_FILE

    return (Path(p) / METADATA_FILE).is_file() or (Path(p) / PICKLED_METADATA_FILE).is_file()


def source_has(source, prefix: str) -> bool:
    """Whether the checkpoint behind `source` holds any tensor whose (our) name starts with `prefix`."""
    if isinstance(source, SafetensorsSource):
        return any(r.ours.startswith(prefix) for r in source.loader.rules)
    return any(n.startswith("model." + prefix) for n in source.meta.state_dict_metadata)


def open_source(path: str | Path, allow_unmapped: bool = False) -> SafetensorsSource | DCPSource:
    """The source for an `init_from` directory: DCP (has `metadata.json`; a pickled `.metadata` alone is
    refused by the reader, never read) or safetensors (has config.json)."""
    p = Path(path)
    if is_dcp_dir(p):
        return DCPSource(p)
    if (p / "config.json").is_file():
        return SafetensorsSource(p, allow_unmapped)
    raise OnboardError(f"init_from {p} is neither a model directory (config.json + safetensors) nor a DCP "
                       "checkpoint (metadata.json); give a Hugging Face / `moeadapt train` model directory or a "
                       "full-training checkpoints/step_N directory")
