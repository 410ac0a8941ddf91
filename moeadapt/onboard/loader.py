"""Streaming checkpoint loading: shard by shard, only what the local rank owns, FP8 dequantised on the way.

Owns: the checkpoint index (tensor -> shard), the name/shape check against the rules (before any data is read:
shapes come from the safetensors headers), and an iterator that yields our tensors one at a time. Under expert
parallelism (ep ranks) a rank reads only its experts `[e0:e1)` (whole per-expert tensors for HF layouts, a
`get_slice` for our stacked layout); every non-expert tensor is read whole (FSDP shards it afterwards).
At most one shard is open at a time; the largest thing held is one stacked expert tensor being assembled.
DeepSeek FP8 weights (float8_e4m3fn + `<name>_scale_inv`, one fp32 scale per 128x128 block) come out as
`dtype` (bf16 by default).
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from .families import Family, OnboardError
from .names import Rule, ignorable


def checkpoint_index(path: str | Path) -> dict[str, str]:
    """Tensor name -> shard file name, from model.safetensors.index.json or a single model.safetensors."""
    path = Path(path)
    idx = path / "model.safetensors.index.json"
    if idx.is_file():
        return dict(json.loads(idx.read_text())["weight_map"])
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(str(single), "pt") as f:
            return {k: "model.safetensors" for k in f.keys()}
    raise OnboardError(f"{path} holds neither model.safetensors.index.json nor model.safetensors")


def dequant_fp8(w: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = (128, 128),
                dtype: torch.dtype = torch.bfloat16, offset: tuple[int, int] = (0, 0)) -> torch.Tensor:
    """DeepSeek block FP8: w_real[i, j] = w[i, j] * scale_inv[i // bm, j // bn] (edge blocks partial).

    `w` may be a slice of the full weight starting at row/column `offset`; `scale_inv` then holds the scale
    blocks from row block offset[0] // bm and column block offset[1] // bn on (`fp8_scale_slices`)."""
    bm, bn = block
    m, n = w.shape
    r, c = offset[0] % bm, offset[1] % bn
    s = scale_inv.float().repeat_interleave(bm, 0)[r:r + m].repeat_interleave(bn, 1)[:, c:c + n]
    return (w.float() * s).to(dtype)


def fp8_scale_slices(sl: tuple[slice, slice], block: tuple[int, int]) -> tuple[slice, slice]:
    """The scale_inv blocks that cover the weight slice `sl` (row and column slices with explicit bounds)."""
    (bm, bn), (rs, cs) = block, sl
    return slice(rs.start // bm, -(-rs.stop // bm)), slice(cs.start // bn, -(-cs.stop // bn))


Slices = tuple[slice, ...]


def _carry_slices(shape: tuple[int, ...], sl: Slices, src_shape: tuple[int, ...]) -> Slices:
    """Our slices on a checkpoint tensor whose shape equals ours up to size-1 dims (what `check` allows)."""
    if tuple(src_shape) == tuple(shape):
        return tuple(sl)
    big = iter([s for d, s in zip(shape, sl) if d != 1])
    return tuple(next(big) if d != 1 else slice(0, 1) for d in src_shape)


class _OpenShard:
    """At most one checkpoint file open. safe_open memory-maps the file, and the pages a read touches stay in
    this process's resident set until the map is closed: reopening after `budget` bytes keeps host memory
    during a load near the largest slice instead of growing with everything read from one file."""

    def __init__(self, root: Path, budget: int):
        self.root, self.budget = root, budget
        self.name, self.f, self.touched = None, None, 0

    def get(self, shard: str):
        if self.f is not None and (self.name != shard or self.touched > self.budget):
            self.close()
        if self.f is None:
            self.f = safe_open(str(self.root / shard), "pt")
            self.f.__enter__()
            self.name, self.touched = shard, 0
        return self.f

    def close(self) -> None:
        if self.f is not None:
            self.f.__exit__(None, None, None)
        self.name, self.f = None, None


def _is_expert(rule: Rule) -> bool:
    return ".ffn.experts." in rule.ours


def _squeezed(shape) -> list[int]:
    return [d for d in shape if d != 1]


class StreamingLoader:
    """`check()` validates names and shapes; iterating yields (our name, tensor) shard by shard."""

    def __init__(self, path: str | Path, fam: Family, rules: list[Rule], ep_rank: int = 0, ep: int = 1,
                 dtype: torch.dtype = torch.bfloat16):
        self.path, self.fam, self.rules, self.dtype = Path(path), fam, rules, dtype
        E = fam.spec.n_routed_experts
        if ep < 1 or (E and E % ep) or not 0 <= ep_rank < ep:
            raise OnboardError(f"ep={ep}, ep_rank={ep_rank} do not fit n_routed_experts={E}; ep must divide it")
        self.e0, self.e1 = (ep_rank * (E // ep), (ep_rank + 1) * (E // ep)) if E else (0, 0)
        self.index = checkpoint_index(self.path)
        self.reads: list[str] = []  # checkpoint tensors actually read, in order (tests look at this)
        self.ignored: dict[str, str] = {}
        self.src_shapes: dict[str, tuple[int, ...]] = {}  # checkpoint tensor -> shape, from the headers
        self.src_dtypes: dict[str, str] = {}  # checkpoint tensor -> safetensors dtype ("BF16", "F8_E4M3", ...)
        self.bytes_read = 0  # bytes of checkpoint data read by `read_slice` (scales included)
        self._by_ours = {r.ours: r for r in rules}
        self._open = _OpenShard(self.path, 64 * 2**20)

    # -- checks ----------------------------------------------------------------------------------------
    def _sources(self, r: Rule) -> list[str]:
        return r.sources[self.e0:self.e1] if r.stacked else r.sources

    def check(self) -> dict:
        """Every checkpoint tensor consumed or ignorable, every rule's source present (or absent by a stated
        reason), every shape right. Raises OnboardError naming the tensors; returns a summary."""
        used = {s for r in self.rules for s in r.sources}
        leftover, self.ignored = [], {}
        for name in self.index:
            if name in used:
                continue
            why = ignorable(self.fam, name)
            if why:
                self.ignored[name] = why
            else:
                leftover.append(name)
        missing = [f"{s} (-> {r.ours})" for r in self.rules if not r.absent_ok for s in r.sources if s not in self.index]
        errors = []
        if leftover:
            errors.append(f"{len(leftover)} checkpoint tensor(s) map to nothing in our model: {leftover[:10]}"
                          + (" ..." if len(leftover) > 10 else ""))
        if missing:
            errors.append(f"{len(missing)} tensor(s) our model needs are missing from the checkpoint: {missing[:10]}"
                          + (" ..." if len(missing) > 10 else ""))
        if not errors:
            errors += self._check_shapes()
        if errors:
            raise OnboardError(f"{self.path} ({self.fam.model_type}): " + "; ".join(errors))
        absent = {r.ours: r.absent_ok for r in self.rules if r.absent_ok and not any(s in self.index for s in r.sources)}
        return {"tensors": len(self.index), "mapped": len(used & set(self.index)), "ignored": dict(self.ignored),
                "absent_by_design": absent, "shards": len(set(self.index.values()))}

    def _check_shapes(self) -> list[str]:
        by_shard: dict[str, list[tuple[str, tuple, str]]] = defaultdict(list)
        for r in self.rules:
            want = r.src_shape()
            for s in r.sources:
                if s in self.index:
                    by_shard[self.index[s]].append((s, want, r.ours))
        bad = []
        for shard, items in by_shard.items():
            with safe_open(str(self.path / shard), "pt") as f:
                for s, want, ours in items:
                    sl = f.get_slice(s)
                    got = tuple(sl.get_shape())
                    self.src_shapes[s], self.src_dtypes[s] = got, sl.get_dtype()
                    if got != tuple(want) and _squeezed(got) != _squeezed(want):
                        bad.append(f"{s} has shape {got} but our {ours} needs {tuple(want)}")
        return [f"shape mismatch: {'; '.join(bad[:10])}"] if bad else []

    # -- reading ---------------------------------------------------------------------------------------
    def _read(self, f, shard: str, name: str, sl: slice | None = None) -> torch.Tensor:
        self.reads.append(name)
        t = f.get_slice(name)[sl] if sl is not None else f.get_tensor(name)
        if t.dtype == torch.float8_e4m3fn:
            sname = name + "_scale_inv"
            if sname not in self.index or not self.fam.fp8_block:
                raise OnboardError(f"{name} is float8_e4m3fn but {sname} / quantization_config is missing")
            if self.index[sname] == shard:
                scale = f.get_tensor(sname)
            else:
                with safe_open(str(self.path / self.index[sname]), "pt") as g:
                    scale = g.get_tensor(sname)
            return dequant_fp8(t, scale, self.fam.fp8_block, self.dtype)
        return t

    def _cast(self, r: Rule, t: torch.Tensor) -> torch.Tensor:
        keep32 = r.ours.endswith("expert_bias")
        return t.to(torch.float32 if keep32 else self.dtype) if t.is_floating_point() else t

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        plan: dict[str, list[tuple[Rule, int, str]]] = defaultdict(list)  # shard -> (rule, slot, source)
        for r in self.rules:
            for slot, s in enumerate(self._sources(r)):
                if s in self.index:
                    plan[self.index[s]].append((r, slot, s))
        pending: dict[str, tuple[torch.Tensor, int]] = {}  # stacked tensors being assembled
        for shard in sorted(plan):
            with safe_open(str(self.path / shard), "pt") as f:
                for r, slot, s in plan[shard]:
                    if r.stacked:
                        t = r.to_ours(self._read(f, shard, s))
                        buf, n = pending.get(r.ours) or (torch.empty(self.e1 - self.e0, *t.shape,
                                                                      dtype=self._cast(r, t).dtype), 0)
                        buf[slot] = self._cast(r, t)
                        if n + 1 == self.e1 - self.e0:
                            pending.pop(r.ours, None)
                            yield r.ours, buf
                        else:
                            pending[r.ours] = (buf, n + 1)
                    elif _is_expert(r):  # all experts in one tensor (ours, or fused in the checkpoint): a slice
                        yield r.ours, self._cast(r, r.take_part(self._read(f, shard, s, slice(self.e0, self.e1))))
                    else:
                        yield r.ours, self._cast(r, r.to_ours(self._read(f, shard, s)))
        if pending:
            raise OnboardError(f"stacked tensors left incomplete: {sorted(pending)}")

    # -- sliced reading (a rank's shard of one of our tensors) --------------------------------------------
    def rule(self, ours: str) -> Rule | None:
        return self._by_ours.get(ours)

    def read_slice(self, ours: str, sl: Slices) -> torch.Tensor | None:
        """The box `sl` (one slice per dim of our full shape) of our tensor `ours`, reading only that box from
        the checkpoint: name map, RoPE row order, expert stacking, fused-expert parts, norm offsets and FP8
        dequantisation applied to the box.
        A tensor absent by design comes back as its stated init (zeros), or None for "keep the model's own".
        The checkpoint's dtype is kept (FP8 comes out as float32): the caller's copy into the model casts.
        Call `check()` first (it reads the shapes from the headers)."""
        r = self._by_ours.get(ours)
        if r is None:
            raise OnboardError(f"{self.path}: our tensor {ours} has no rule in the {self.fam.model_type} name map")
        sl = tuple(slice(*s.indices(d)[:2]) for s, d in zip(sl, r.shape))
        box = tuple(s.stop - s.start for s in sl)
        if r.absent_ok and not any(s in self.index for s in r.sources):
            return torch.zeros(box, dtype=torch.float32) if r.init == "zeros" else None
        if any(n == 0 for n in box):
            return torch.empty(box)
        if r.stacked:  # dim 0 picks experts; each expert is its own checkpoint tensor
            return torch.stack([self._read_box(r.sources[e], r.shape[1:], sl[1:])
                                for e in range(sl[0].start, sl[0].stop)])
        if r.part is not None:  # our chunk of a fused tensor: the same box, moved along the chunk's dim
            d, i, _ = r.part
            at = i * r.shape[d]
            sl = tuple(slice(x.start + at, x.stop + at) if k == d else x for k, x in enumerate(sl))
            return self._read_box(r.sources[0], r.src_shape(), sl)
        if r.row_perm is not None:  # ours[i] = ckpt[perm[i]]: read the rows' span, then pick them
            rows = r.row_perm[sl[0]]
            lo, hi = int(rows.min()), int(rows.max()) + 1
            t = self._read_box(r.sources[0], r.shape, (slice(lo, hi), *sl[1:]))
            return t.index_select(0, rows - lo)
        t = self._read_box(r.sources[0], r.shape, sl)
        return t.float() + r.offset if r.offset else t  # RMSNorms stored as weight - 1 (Qwen3-Next / Qwen3.5)

    def _read_box(self, name: str, shape: tuple[int, ...], sl: Slices) -> torch.Tensor:
        """Box `sl` of checkpoint tensor `name` whose shape is ours (`shape`) up to size-1 dims."""
        src_shape = self.src_shapes.get(name)
        if src_shape is None:
            raise OnboardError(f"{self.path}: read_slice before check() (no header shape for {name})")
        src_sl = _carry_slices(shape, sl, src_shape)
        shard = self.index[name]
        f = self._open.get(shard)
        self.reads.append(name)
        t = f.get_slice(name)[src_sl]
        n = t.numel() * t.element_size()
        if t.dtype == torch.float8_e4m3fn:
            sname = name + "_scale_inv"
            if sname not in self.index or not self.fam.fp8_block or t.dim() != 2:
                raise OnboardError(f"{name} is float8_e4m3fn but {sname} / quantization_config is missing")
            g = self._open.get(self.index[sname]) if self.index[sname] != shard else f
            scale = g.get_slice(sname)[fp8_scale_slices(src_sl, self.fam.fp8_block)]
            n += scale.numel() * scale.element_size()
            t = dequant_fp8(t, scale, self.fam.fp8_block, torch.float32, (src_sl[0].start, src_sl[1].start))
        self.bytes_read += n
        self._open.touched += n
        return t.reshape(tuple(s.stop - s.start for s in sl))

    def close(self) -> None:
        self._open.close()


@torch.no_grad()
def load_into_model(model: torch.nn.Module, loader: StreamingLoader) -> dict:
    """Copy a checked loader's tensors into a materialised model (ep = 1: the model holds every expert).
    Absent-by-design tensors get their stated init. Returns the check summary."""
    summary = loader.check()
    if loader.e1 - loader.e0 != loader.fam.spec.n_routed_experts:
        raise OnboardError("load_into_model needs ep=1 (the model holds all experts); iterate the loader under EP")
    state = model.state_dict()
    for r in loader.rules:
        if r.absent_ok and r.init == "zeros" and not any(s in loader.index for s in r.sources):
            state[r.ours].zero_()
    for name, t in loader:
        state[name].copy_(t)
    return summary


class HFLayout:
    """Our tensors written under the checkpoint's names, shapes and row order (the inverse of `read_slice`),
    box by box: for `moeadapt.parallel.sharded_io.export_sharded(layout=...)`. A stacked expert tensor becomes
    its E per-expert tensors, a RoPE-permuted weight has its rows put back, size-1 dims come back; tensors
    absent by design are not written. `src_shapes` (checkpoint name -> shape, `StreamingLoader.src_shapes`
    after `check()`) gives the checkpoint's shapes; without it our shapes are used."""

    def __init__(self, rules: list[Rule], src_shapes: dict[str, tuple[int, ...]] | None = None):
        self.by_ours = {r.ours: r for r in rules if not r.absent_ok}
        self.src_shapes = src_shapes or {}

    def _shape(self, src: str, ours_shape: tuple[int, ...]) -> tuple[int, ...]:
        return tuple(self.src_shapes.get(src, ours_shape))

    def dests(self, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
        r = self.by_ours.get(name)
        if r is None:
            return []
        if r.stacked:
            return [(s, self._shape(s, tuple(shape[1:]))) for s in r.sources]
        if r.part is not None:
            return [(r.sources[0], self._shape(r.sources[0], r.src_shape()))]
        return [(r.sources[0], self._shape(r.sources[0], tuple(shape)))]

    def pieces(self, name: str, region, box: torch.Tensor):
        r = self.by_ours.get(name)
        if r is None:
            return
        off = region.offset
        if r.stacked:
            for i in range(box.shape[0]):
                src = r.sources[off[0] + i]
                dshape = self._shape(src, tuple(r.shape[1:]))
                yield src, _carry_offsets(tuple(r.shape[1:]), off[1:], dshape), box[i].reshape(
                    _carry_shape(tuple(r.shape[1:]), tuple(box.shape[1:]), dshape))
            return
        src = r.sources[0]
        if r.part is not None:  # our chunk of a fused checkpoint tensor: the box moves along the chunk's dim
            d, i, _ = r.part
            yield src, tuple(o + i * r.shape[d] if k == d else o for k, o in enumerate(off)), box
            return
        dshape = self._shape(src, tuple(r.shape))
        if r.offset:  # back to the checkpoint's weight - offset
            box = box - r.offset
        if r.row_perm is None:
            yield src, _carry_offsets(tuple(r.shape), off, dshape), box.reshape(
                _carry_shape(tuple(r.shape), tuple(box.shape), dshape))
            return
        rows = r.row_perm[off[0]:off[0] + box.shape[0]].tolist()  # our row i is checkpoint row perm[i]
        start = 0
        for i in range(1, len(rows) + 1):  # one piece per run of consecutive checkpoint rows
            if i == len(rows) or rows[i] != rows[i - 1] + 1:
                yield src, (rows[start], *off[1:]), box[start:i]
                start = i


def _carry_offsets(shape: tuple[int, ...], off: tuple[int, ...], dshape: tuple[int, ...]) -> tuple[int, ...]:
    if tuple(dshape) == tuple(shape):
        return tuple(off)
    big = iter([o for d, o in zip(shape, off) if d != 1])
    return tuple(next(big) if d != 1 else 0 for d in dshape)


def _carry_shape(shape: tuple[int, ...], box: tuple[int, ...], dshape: tuple[int, ...]) -> tuple[int, ...]:
    if tuple(dshape) == tuple(shape):
        return tuple(box)
    big = iter([b for d, b in zip(shape, box) if d != 1])
    return tuple(next(big) if d != 1 else 1 for d in dshape)
