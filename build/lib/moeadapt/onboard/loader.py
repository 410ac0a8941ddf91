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
                dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """DeepSeek block FP8: w_real[i, j] = w[i, j] * scale_inv[i // bm, j // bn] (edge blocks partial)."""
    bm, bn = block
    m, n = w.shape
    s = scale_inv.float().repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
    return (w.float() * s).to(dtype)


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
            want = r.shape[1:] if r.stacked else r.shape
            for s in r.sources:
                if s in self.index:
                    by_shard[self.index[s]].append((s, want, r.ours))
        bad = []
        for shard, items in by_shard.items():
            with safe_open(str(self.path / shard), "pt") as f:
                for s, want, ours in items:
                    got = tuple(f.get_slice(s).get_shape())
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
                    elif _is_expert(r) and self.fam.model_type == "moeadapt":  # our stacked layout: a slice
                        yield r.ours, self._cast(r, self._read(f, shard, s, slice(self.e0, self.e1)))
                    else:
                        yield r.ours, self._cast(r, r.to_ours(self._read(f, shard, s)))
        if pending:
            raise OnboardError(f"stacked tensors left incomplete: {sorted(pending)}")


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
