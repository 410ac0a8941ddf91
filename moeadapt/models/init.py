"""Deterministic initialisation that a shard can compute on its own: same seed, same *global* weights, at
every world size and expert-parallel degree.

Owns: the init rule of every parameter and buffer (`init_rules`) and `init_fill(model, seed)`, a fill
function (the contract of `parallel.shards.fill_shards`) that generates only the requested slice.

How a value is keyed: dim 0 of a tensor's global shape is cut into row blocks of `rows_per_block(shape)`
rows (at most BLOCK_NUMEL elements, at least one row); block b is drawn from its own generator seeded by
hash(seed, parameter name, b). A slice generates the blocks it overlaps and keeps its rows, so the values do
not depend on how the tensor is cut and no process draws more than one block beyond its slice. An expert
tensor [E, out, in] is one block per expert (or per a few experts when an expert is small).
Must not know about ranks or meshes (parallel/ passes the slices).

Rules (the distributions of HybridMoEModel.init_weights, which `materialize` still uses for unsharded
utility models; the trainer's build uses these, so its values differ from materialize's for the same seed): linear / grouped-expert / embedding /
router weights normal(0, initializer_range), output projections (o_proj, wo, w2) scaled by 1/sqrt(2 L); norms
ones (LayerNorm bias zeros); causal convolutions uniform(±kernel^-0.5); KDA A_log = log U(1, 16) and dt_bias
the inverse softplus of exp(U(log 1e-3, log 1e-1)); router buffers zeros. A module may declare its own rules
with `init_rules() -> {parameter name: Rule}` (the LoRA layers do: A uniform(±1/sqrt(in)), B zeros).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .common import CausalConv1d, RMSNorm
from .kda_attn import KDAAttention
from .moe import GroupedLinear
from .router import Router
from .vision.tower import ConvPatchEmbed, VisionTower

BLOCK_NUMEL = 1 << 20  # elements per random block: the most a shard draws beyond its own slice, per tensor

# fill(name, global_shape, local_slices) -> tensor of the slice's shape (any float dtype; it is cast on copy)
Fill = Callable[[str, tuple[int, ...], tuple[slice, ...]], torch.Tensor]


@dataclass(frozen=True)
class Rule:
    """kind: normal (a = std) | uniform [a, b) | const (a) | log_uniform (log U(a, b)) |
    inv_softplus (inverse softplus of exp(U(log a, log b)))."""

    kind: str
    a: float = 0.0
    b: float = 0.0

    @property
    def random(self) -> bool:
        return self.kind != "const"


def _out_proj(name: str) -> bool:
    return name.endswith(("o_proj", "wo", "w2"))


def init_rules(model: nn.Module) -> dict[str, Rule]:
    """Parameter and buffer name -> Rule, for every tensor of the model (tied weights once, by first name)."""
    spec = model.spec
    std = spec.initializer_range
    out_std = std / (2 * spec.n_layers) ** 0.5
    rules: dict[str, Rule] = {}
    for mn, m in model.named_modules():
        pre = f"{mn}." if mn else ""
        own: dict[str, Rule] = {}
        if isinstance(m, (nn.Linear, GroupedLinear)):
            own["weight"] = Rule("normal", out_std if _out_proj(mn) else std)
            if getattr(m, "bias", None) is not None:
                own["bias"] = Rule("const", 0.0)
        elif isinstance(m, nn.Embedding):
            own["weight"] = Rule("normal", std)
        elif isinstance(m, (nn.LayerNorm, RMSNorm)):
            own["weight"] = Rule("const", 1.0)
            if getattr(m, "bias", None) is not None:
                own["bias"] = Rule("const", 0.0)
        elif isinstance(m, ConvPatchEmbed):  # a vision tower's Conv2d-shaped patch embedding
            own.update(weight=Rule("normal", std), bias=Rule("const", 0.0))
        elif isinstance(m, VisionTower) and m.spec.pos_embed_grid is not None:  # learned position table
            own["pos_embed"] = Rule("normal", std)
        elif isinstance(m, CausalConv1d):
            own["weight"] = Rule("uniform", -(m.kernel ** -0.5), m.kernel ** -0.5)
        elif isinstance(m, KDAAttention):
            own["A_log"] = (Rule("const", 0.0) if m.gate_lower_bound is not None  # lower-bounded gate: A = 1
                            else Rule("log_uniform", 1.0, 16.0))
            own["dt_bias"] = Rule("inv_softplus", 1e-3, 1e-1)
        elif isinstance(m, Router):
            own.update(weight=Rule("normal", std), expert_bias=Rule("const", 0.0),
                       tokens_per_expert=Rule("const", 0.0))
        if hasattr(m, "init_rules"):
            own.update(m.init_rules())
        for k, r in own.items():
            rules.setdefault(pre + k, r)
    missing = [n for n, _ in list(model.named_parameters()) + list(model.named_buffers()) if n not in rules]
    if missing:
        raise TypeError(f"no init rule for {missing[:6]}; add one in moeadapt/models/init.py init_rules "
                        "(or give the module an `init_rules()` method)")
    return rules


def rows_per_block(shape: tuple[int, ...]) -> int:
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_NUMEL // max(row, 1))


def _key(seed: int, name: str, block: int) -> int:
    h = hashlib.blake2b(f"{seed}:{name}:{block}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 63) - 1)


def _draw(rule: Rule, shape: tuple[int, ...], g: torch.Generator | None, device: torch.device) -> torch.Tensor:
    if rule.kind == "const":
        return torch.full(shape, rule.a, dtype=torch.float32, device=device)
    x = torch.empty(shape, dtype=torch.float32, device=device)
    if rule.kind == "normal":
        return x.normal_(0.0, rule.a, generator=g)
    if rule.kind == "uniform":
        return x.uniform_(rule.a, rule.b, generator=g)
    if rule.kind == "log_uniform":
        return x.uniform_(rule.a, rule.b, generator=g).log_()
    if rule.kind == "inv_softplus":
        dt = x.uniform_(math.log(rule.a), math.log(rule.b), generator=g).exp_()
        return dt + torch.log(-torch.expm1(-dt))
    raise ValueError(f"unknown init rule kind {rule.kind!r}")


def init_slice(rule: Rule, seed: int, name: str, global_shape: tuple[int, ...], slices: tuple[slice, ...],
               device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """`global_shape[slices]` of tensor `name`, in `dtype`: the overlapped row blocks are drawn one at a time
    in fp32 and written into the result (the most alive at once: the result + one fp32 block)."""
    device = torch.device(device)
    shape = tuple(global_shape)
    slices = tuple(slices) + (slice(None),) * (len(shape) - len(slices))
    if not shape:  # a scalar is one block
        g = torch.Generator(device).manual_seed(_key(seed, name, 0)) if rule.random else None
        return _draw(rule, (), g, device).to(dtype)
    lo, hi, step = slices[0].indices(shape[0])
    if step != 1:
        raise ValueError(f"{name}: init slices must be contiguous on dim 0, got step {step}")
    rest = slices[1:]
    out = torch.empty(torch.empty(shape, device="meta")[slices].shape, dtype=dtype, device=device)
    rpb = rows_per_block(shape)
    for b in range(lo // rpb, -(-hi // rpb)):
        b_lo, b_hi = b * rpb, min((b + 1) * rpb, shape[0])
        g = torch.Generator(device).manual_seed(_key(seed, name, b)) if rule.random else None
        blk = _draw(rule, (b_hi - b_lo, *shape[1:]), g, device)
        r0, r1 = max(lo, b_lo), min(hi, b_hi)
        out[r0 - lo:r1 - lo].copy_(blk[(slice(r0 - b_lo, r1 - b_lo), *rest)])
    return out


def init_block_bytes(global_shape: tuple[int, ...]) -> int:
    """The fp32 bytes of one drawn block of a tensor of this shape (init's transient beyond the result)."""
    if not global_shape:
        return 4
    return 4 * min(rows_per_block(tuple(global_shape)), global_shape[0]) * math.prod(global_shape[1:])


def init_fill(model: nn.Module, seed: int = 0, device: torch.device | str = "cpu") -> Fill:
    """The initialising fill for `model` (build it on meta, LoRA injected; call before parallelizing or after):
    values drawn on `device` and returned in each tensor's dtype (a bf16 frozen base is written as bf16)."""
    rules = init_rules(model)
    dtypes = {n: t.dtype for n, t in list(model.named_parameters(remove_duplicate=False))  # tied: both names
              + list(model.named_buffers())}

    def fill(name: str, global_shape: tuple[int, ...], local_slices: tuple[slice, ...]) -> torch.Tensor:
        if name not in rules:
            raise KeyError(f"{name} is not a tensor of this model")
        return init_slice(rules[name], seed, name, global_shape, local_slices, device, dtypes[name])

    return fill
