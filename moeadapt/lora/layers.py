"""LoRA layers: dense (`LoRALinear`) and grouped by expert (`GroupedLoRALinear`).

Both keep the base weight under its original name (`weight`), so base checkpoints load unchanged, and
add `lora_A` / `lora_B`. Dense: PEFT layout, lora_A.weight [r, in], lora_B.weight [out, r].
Grouped: lora_A [E, in, r], lora_B [E, r, out], computed by `moeadapt.ops.moe.grouped_lora` next to the
grouped GEMM; the per-expert delta-W is never formed in the forward.
B starts at zero, so an injected model computes exactly what the base did.

Grouped fast path (ops/moe/fused_lora.py): the layer keeps a private buffer `_wcat [E, out, in + R']`
(R' = rank rounded up to 8) and its frozen `weight` is a view of `_wcat[:, :, :in]`, so the base weight
is stored once (+R'/in, 1.6% at in=1024, r=16) and base + adapter run as one grouped GEMM per direction.
`weight`, `lora_A`, `lora_B` stay separate parameters (checkpoints and PEFT export see them as before).
The view is re-established after `.to()` / `to_empty()` (`_apply`); when something else owns the weight
(FSDP's sharded / gathered copies, a different compute dtype), forward falls back to the unfused path.
`forward_gather` / `forward_swiglu` (called by GroupedExperts / LocalDispatcher where ops/moe/path.py picks
the fused GEMM and every layer involved has a `fold_cat`) also fold the permute gather (w1, w3) and the
SwiGLU product (w2) into the LoRA-in pass.

bf16 compute copies (train/copies.py): inside `WeightCopies.lent` LoRALinear's lora_A / lora_B (nn.Linear) read
as their bf16 copies; a grouped layer's copies are lent to it (`lent`, read by `adapters` and by the lean
path), its lora_A / lora_B stay the fp32 parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..models.init import Rule
from ..models.moe import GroupedLinear
from ..models.shared_input import linear_lowrank, lowrank
from ..ops.moe import fused_lora, grouped_lora
from ..ops.moe.fused_lora import aliases_cat, make_cat_buffer


class LoRALinear(nn.Linear):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        dev = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=dev, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=dev, dtype=torch.float32)
        self.rank, self.scaling = rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora()

    def reset_lora(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def init_rules(self) -> dict[str, Rule]:
        """The adapter's init for the shard-local initialisation (models/init.py): reset_lora's distributions."""
        bound = 1.0 / math.sqrt(self.in_features)  # kaiming_uniform(a=sqrt(5)) on [r, in]
        return {"lora_A.weight": Rule("uniform", -bound, bound), "lora_B.weight": Rule("const", 0.0)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dev = x.device.type
        if torch.is_autocast_enabled(dev) and x.dtype != torch.float64 and self.shared_input_terms() is not None:
            return _FrozenLoRA.apply(x, self.weight, self.bias, self.lora_A.weight, self.lora_B.weight, self.scaling,
                                     torch.get_autocast_dtype(dev))
        y = F.linear(x, self.weight, self.bias)
        xa = self.dropout(x)
        if torch.is_autocast_enabled(xa.device.type):
            # The adapter's products run in the autocast dtype whatever x's dtype, so x is not cast to the fp32
            # adapter dtype (autocast would cast it straight back: two activation-sized copies forward, two
            # backward), and y + s (x A^T) B^T is one addmm (no separate scale and add passes over [tokens, out]).
            h = self.lora_A(xa)
            out = torch.addmm(y.reshape(-1, y.shape[-1]), h.reshape(-1, h.shape[-1]), self.lora_B.weight.t(),
                              alpha=self.scaling)
            return out.view(y.shape)
        xa = xa.to(self.lora_A.weight.dtype)
        return y + (self.lora_B(self.lora_A(xa)) * self.scaling).to(y.dtype)

    def shared_input_terms(self):
        """(weight, bias, (A, B, scaling)) where the adapter can run as one node with its frozen base (forward's
        `_FrozenLoRA` under autocast, or models.shared_input.shared_input_linears with the other layers of the same
        input): a frozen base, no dropout, no hook on lora_A / lora_B (the node does not call them); else None."""
        if not isinstance(self.dropout, nn.Identity) or self.weight.requires_grad:
            return None
        if self.lora_A._forward_hooks or self.lora_A._forward_pre_hooks or self.lora_B._forward_hooks \
                or self.lora_B._forward_pre_hooks:
            return None
        return self.weight, self.bias, (self.lora_A.weight, self.lora_B.weight, self.scaling)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, lora_rank={self.rank}, scaling={self.scaling:g}"


class _FrozenLoRA(torch.autograd.Function):
    """x W^T + b + s (x A^T) B^T for a frozen W under autocast, every product in the autocast dtype `dt`.

    What autograd would run for the composition, less two activation-sized passes per layer: the adapter's term
    is made first and the base GEMM adds into it (shared_input.linear_lowrank: no separate pass over the output),
    and in the backward W's share of dx is added by its GEMM into the adapter's share (dx = dh A, then
    dx += dy W as one addmm_) instead of being a tensor of its own and a separate add. Gradients: A and B in
    their own dtype (fp32 adapters, cast here; bf16 where train/copies.py lends their copies: the same bf16 GEMM
    outputs, not cast up), x in dt, none for W and b."""

    @staticmethod
    def forward(ctx, x, w, bias, a, b, s, dt):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dt)
        wc, ac, bc = w.to(dt), a.to(dt), b.to(dt)
        h = x2 @ ac.t()
        y = linear_lowrank(x2, wc, None if bias is None else bias.to(dt), h, bc, s)
        ctx.save_for_backward(x2, h, wc, ac, bc)
        ctx.s, ctx.x_dtype, ctx.ab_dtypes = s, x.dtype, (a.dtype, b.dtype)
        return y.view(*shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, h, wc, ac, bc = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1]).to(wc.dtype)
        dh = lowrank(dy2, bc.t(), ctx.s)  # s dy B
        dx = None
        if ctx.needs_input_grad[0]:
            dx = (dh @ ac).addmm_(dy2, wc)  # the rank-r share first, W's added in by its GEMM (linear_lowrank)
            dx = dx.view(*dy.shape[:-1], dx.shape[-1]).to(ctx.x_dtype)
        da = (dh.t() @ x2).to(ctx.ab_dtypes[0]) if ctx.needs_input_grad[3] else None
        db = lowrank(dy2.t(), h.t(), ctx.s).to(ctx.ab_dtypes[1]) if ctx.needs_input_grad[4] else None
        return dx, None, None, da, db, None, None


class GroupedLoRALinear(GroupedLinear):
    def __init__(self, base: GroupedLinear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.n_experts, self.in_features, self.out_features = base.n_experts, base.in_features, base.out_features
        self.weight = base.weight
        self.backend = base.backend
        E, dev = self.n_experts, base.weight.device
        self.lora_A = nn.Parameter(torch.empty(E, self.in_features, rank, device=dev, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(E, rank, self.out_features, device=dev, dtype=torch.float32))
        self.rank, self.scaling = rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self._wcat = None  # plain attribute, not a buffer: .to() must not copy it separately
        # "lora_A" / "lora_B" -> its bf16 compute copy while train/copies.py lends it (a tensor whose gradient goes
        # to the adapter), else absent. Lent here rather than put in the parameter's place: the lean path
        # (GroupedExperts.forward_lean) computes with the copies but returns fp32 gradients, to the adapters
        self.lent: dict[str, torch.Tensor] = {}
        self._attach_cat()
        self.reset_lora()

    @torch.no_grad()
    def _attach_cat(self) -> None:
        """Move the base weight into a [E, out, in + R'] buffer and make `weight` a view of it."""
        w = self.weight
        if aliases_cat(w.transpose(1, 2), self._wcat):
            return
        self._wcat = None
        if w.device.type == "meta" or not w.is_floating_point() or type(w.data) is not torch.Tensor:
            return
        wcat = make_cat_buffer(w.data, self.rank)
        w.data = wcat[:, :, : self.in_features]
        self._wcat = wcat

    def _apply(self, fn, recurse=True):
        out = super()._apply(fn, recurse)
        self._attach_cat()  # .to() / .cuda() / to_empty() gave the weight fresh storage
        return out

    @torch.no_grad()
    def cast_base_(self, dtype: torch.dtype) -> None:
        """Cast the frozen base weight to `dtype` keeping it a view of a (new) [W | B] buffer.

        Use this, not `weight.data = weight.data.to(dtype)`: that leaves the old buffer behind
        (until the next forward drops it) and the fused path off."""
        w = self.weight
        if w.dtype == dtype:
            return
        data = w.data.to(dtype)
        self._wcat = None
        w.data = data
        self._attach_cat()

    @torch.no_grad()
    def release_cat(self) -> None:
        """Give the base weight its own contiguous storage and drop the [W | Bᵀ] buffer (FSDP2 shards only
        contiguous parameters; the fused path then does not run for this layer)."""
        self._wcat = None
        self.weight.data = self.weight.data.contiguous()

    @torch.no_grad()
    def share_storage(self, view: torch.Tensor) -> None:
        """Make the frozen base weight `view`, part of a buffer another module owns (GroupedExperts' gate/up
        buffer, `gate_up_cat`), holding the same values, and drop this layer's own [W | Bᵀ] buffer: the weight
        stays stored once; this layer's folded passes then do not run. `.to()` and `cast_base_` give it its own
        buffer again."""
        if view.shape != self.weight.shape or view.dtype != self.weight.dtype:
            raise ValueError(f"share_storage: {tuple(view.shape)} {view.dtype} for a weight "
                             f"{tuple(self.weight.shape)} {self.weight.dtype}")
        self._wcat = None
        self.weight.data = view

    def cat_weight(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The concatenated buffer when `weight` is still its view in `dtype`, else None.

        A buffer the weight no longer aliases (someone replaced `weight.data`: a dtype cast, FSDP's
        sharding) is released here, so it cannot hold a second copy of the base weights."""
        wc = self._wcat
        if wc is None:
            return None
        if not aliases_cat(self.weight.transpose(1, 2), wc):
            self._wcat = None
            return None
        return wc if wc.dtype == dtype else None

    def fold_cat(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The [W | Bᵀ] buffer when this layer can take a folded input pass (no dropout, backend "auto" or
        "fused", frozen base that is still the buffer's view in `dtype`), else None."""
        if not isinstance(self.dropout, nn.Identity):
            return None
        if self.backend not in ("auto", "fused") or self.weight.requires_grad:
            return None
        return self.cat_weight(dtype)

    def adapters(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) in `dtype` for the products: the lent bf16 copies (`lent`), else lora_A / lora_B cast (autograd
        casts their gradients back)."""
        return tuple(self.lent[n] if n in self.lent and self.lent[n].dtype == dtype else getattr(self, n).to(dtype)
                     for n in ("lora_A", "lora_B"))

    def forward_gather(self, z_TI, row_index_N, K, offsets_E):
        """forward(z[row_index // K]) without the permuted copy (gate/up fold); dz in token order."""
        wc = self.fold_cat(z_TI.dtype)
        A, B = self.adapters(z_TI.dtype)
        return fused_lora.grouped_lora_fused_gather(z_TI, row_index_N, K, A, B, offsets_E, self.scaling,
                                                    w_EIO=self.weight.transpose(1, 2), w_cat=wc)

    def forward_swiglu(self, gate_NI, up_NI, offsets_E):
        """forward(silu(gate)·up) with the SwiGLU product formed inside the LoRA-in pass (down fold)."""
        wc = self.fold_cat(gate_NI.dtype)
        A, B = self.adapters(gate_NI.dtype)
        return fused_lora.grouped_lora_fused_swiglu(gate_NI, up_NI, A, B, offsets_E, self.scaling,
                                                    w_EIO=self.weight.transpose(1, 2), w_cat=wc)

    def reset_lora(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.lora_A, -bound, bound)
        nn.init.zeros_(self.lora_B)

    def init_rules(self) -> dict[str, Rule]:
        """The adapter's init for the shard-local initialisation (models/init.py): reset_lora's distributions."""
        bound = 1.0 / math.sqrt(self.in_features)
        return {"lora_A": Rule("uniform", -bound, bound), "lora_B": Rule("const", 0.0)}

    def forward(self, x_NI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        w_EIO = self.weight.transpose(1, 2).to(x_NI.dtype)
        A, B = self.adapters(x_NI.dtype)
        if isinstance(self.dropout, nn.Identity):  # fused base + adapter path
            wc = self.cat_weight(x_NI.dtype)
            if wc is not None and self.backend in ("auto", "fused"):
                return grouped_lora(x_NI, A, B, offsets_E, self.scaling, w_EIO=self.weight.transpose(1, 2),
                                    backend=self.backend, w_cat=wc)
            return grouped_lora(x_NI, A, B, offsets_E, self.scaling, w_EIO=w_EIO, backend=self.backend)
        base = super().forward(x_NI, offsets_E)
        return base + grouped_lora(self.dropout(x_NI), A, B, offsets_E, self.scaling, backend=self.backend)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """[E, out, in], the layout of `weight` (formed only for merging)."""
        return torch.einsum("eir,ero->eoi", self.lora_A, self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, {self.in_features}, {self.out_features}, lora_rank={self.rank}"
