"""LatentMoE: router on the full hidden state, routed SwiGLU experts in a latent width, shared expert.

y = W_up * sum_i p_i E_i(norm(W_down h)) + shared(h)   (latent_dim = None: a plain DeepSeek-style MoE)

Owns: the expert weights (3-D, `[E, out, in]`, computed by one grouped GEMM over all experts through
`moeadapt.ops.moe`), the latent projections and the shared expert. Routing governance lives in router.py.
Expert parallelism is applied to this module from outside (parallel/) by swapping `dispatcher`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelSpec
from ..ops.moe import (
    expert_lora_path,
    gate_up_mm,
    grouped_mm,
    grouped_mm_backend,
    lean_lora,
    offsets_from_counts,
    paired,
    permutation,
    permute,
    swiglu,
    swiglu_pair,
    unpermute,
)
from .common import RMSNorm, SwiGLU
from .router import Router
from .shared_input import shared_input_linears


class GroupedLinear(nn.Module):
    """E linear maps `[E, out, in]` applied to expert-sorted rows: y[rows of e] = x[rows of e] @ W_e^T."""

    def __init__(self, n_experts: int, in_features: int, out_features: int):
        super().__init__()
        self.n_experts, self.in_features, self.out_features = n_experts, in_features, out_features
        self.weight = nn.Parameter(torch.empty(n_experts, out_features, in_features))
        self.backend = "auto"

    def forward(self, x_NI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        return grouped_mm(x_NI, self.weight.transpose(1, 2).to(x_NI.dtype), offsets_E, backend=self.backend)


EXPERT_LORA_PATHS = ("auto", "fold", "layers")


class GroupedExperts(nn.Module):
    """SwiGLU experts: w2(silu(w1 x) * w3 x) per expert, over expert-sorted rows.

    `lora_path` (LoRA'd experts only) limits the fused passes `expert_lora_path` may pick: "auto" (lean_lora
    where it runs, else the folded input passes of fused_lora, else each projection through grouped_lora),
    "fold" (never lean), "layers" (never lean nor folded: each projection on its own).
    `forward` accepts more rows than offsets[-1] (the EP exchange's padding, parallel/expert.py): they belong
    to no expert, no real row's output nor any weight gradient depends on them, and their own outputs are
    unspecified (zeros on the reference path, unwritten by the kernels)."""

    def __init__(self, n_experts: int, dim: int, hidden: int, limit: float | None = None):
        super().__init__()
        self.n_experts = n_experts
        self.limit = limit  # clamped SwiGLU (ModelSpec.swiglu_limit): the fused SwiGLU passes are not taken
        self.w1 = GroupedLinear(n_experts, dim, hidden)
        self.w3 = GroupedLinear(n_experts, dim, hidden)
        self.w2 = GroupedLinear(n_experts, hidden, dim)
        self.backend = "auto"  # the SwiGLU between them (the linears keep their own, e.g. a grouped-LoRA kernel)
        self.lora_path = "auto"
        self._gu_cat = None  # lean path: the buffer w1's and w3's frozen weights are views of (gate_up_cat)
        self._gu_pair = None  # trained bf16 weights: the buffer w1's and w3's weights are views of (pair_weights)

    def forward(self, x_NL: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        pair = self._gate_up_pair(x_NL)
        if pair is not None:  # gate and up as one GEMM each way (ops/moe/gate_up.py)
            h_N2F = gate_up_mm(x_NL, self.w1.weight, self.w3.weight, pair, offsets_E)
            return self.w2(swiglu(h_N2F, backend=self.backend), offsets_E)
        return self._down(self.w1(x_NL, offsets_E), self.w3(x_NL, offsets_E), offsets_E)

    def _gate_up_pair(self, x_NL: torch.Tensor) -> torch.Tensor | None:
        """The [E, 2F, L] buffer w1's and w3's weights are the row halves of, where the plain SwiGLU runs on
        torch's grouped GEMM: the bf16 copies train/copies.py lends a full fine-tuning step, or the weights'
        own storage (`pair_weights`); else None."""
        w1, w3 = self.w1, self.w3
        if self.limit is not None or hasattr(w1, "lora_A") or w1.weight.dtype != x_NL.dtype:
            return None
        if any(grouped_mm_backend(w.backend, x_NL.device) != "torch" for w in (w1, w3)):
            return None
        own = self._gu_pair
        if own is not None and lean_lora.is_gate_up_view(w1.weight, w3.weight, own, 0):
            return own
        return paired(w1.weight, w3.weight)

    @torch.no_grad()
    def pair_weights(self) -> bool:
        """Lay w1's and w3's weights out as the two row halves of one [E, 2F, L] buffer in their dtype (the
        Parameters kept, their data now views of it), so that `forward` runs gate and up as one GEMM each way
        (full fine-tuning with bf16 weights, train/copies.py `store_bf16`). False (nothing changed) for LoRA'd or
        clamped experts or weights of two shapes or dtypes. A later `.to()` or load that replaces the weights'
        storage ends the pairing (checked at each forward); loads that copy in place keep it."""
        w1, w3 = self.w1.weight, self.w3.weight
        if self.limit is not None or hasattr(self.w1, "lora_A") or w1.shape != w3.shape or w1.dtype != w3.dtype:
            return False
        E, F, L = w1.shape
        buf = torch.empty(E, 2 * F, L, dtype=w1.dtype, device=w1.device)
        buf[:, :F], buf[:, F:] = w1, w3
        w1.data, w3.data = buf[:, :F], buf[:, F:]
        self._gu_pair = buf
        return True

    def _down(self, g_NF, u_NF, offsets_E):
        if self.limit is None and self._folds((self.w2,), g_NF, g_NF.shape[0]):  # SwiGLU in w2's LoRA-in pass
            return self.w2.forward_swiglu(g_NF, u_NF, offsets_E)
        return self.w2(swiglu_pair(g_NF, u_NF, backend=self.backend, limit=self.limit), offsets_E)

    def path(self, z_TL: torch.Tensor, n_rows: int) -> str:
        """How the dispatcher runs the experts over n_rows routed copies of z: "lean" (forward_lean), "gather"
        (forward_gather: w1 / w3 read z through the permutation) or "permute" (forward on permuted rows)."""
        if self.lora_path not in EXPERT_LORA_PATHS:
            raise ValueError(f"GroupedExperts.lora_path={self.lora_path!r} is not one of {EXPERT_LORA_PATHS}")
        ws = (self.w1, self.w3, self.w2)
        if self.lora_path == "auto" and self.limit is None and self._lean_layers(z_TL):
            if expert_lora_path(n_rows / self.n_experts, cuda=z_TL.is_cuda, fused_buffer=True, lean_layers=True,
                                backend=_forced(ws)) == "lean":
                return "lean"
        return "gather" if self._folds(ws[:2], z_TL, n_rows) else "permute"

    def _lean_layers(self, z_TL: torch.Tensor) -> bool:
        """The layer facts lean_lora needs: w1, w3, w2 all grouped LoRA layers with a frozen base in z's dtype,
        no dropout, backend "auto" or "fused", w1 / w3 with one rank and scaling. w2's [W | Bᵀ] buffer is used
        when it owns one (one process); under FSDP2 (no buffer) lean_lora builds one for the forward GEMM."""
        w1, w3, w2 = self.w1, self.w3, self.w2
        if not all(hasattr(w, "lora_A") and isinstance(w.dropout, nn.Identity) for w in (w1, w3, w2)):
            return False
        if any(w.weight.requires_grad or w.weight.dtype != z_TL.dtype or w.backend not in ("auto", "fused")
               for w in (w1, w3, w2)):
            return False
        return w1.rank == w3.rank and w1.scaling == w3.scaling

    def _folds(self, layers, x: torch.Tensor, n_rows: int) -> bool:
        """Grouped LoRA layers that take fused_lora's folded input passes: each owns a usable [W | Bᵀ] buffer
        (lora/layers.py `fold_cat`) and expert_lora_path picks the fused GEMM for them."""
        if self.lora_path == "layers":
            return False
        if not all(getattr(w, "fold_cat", None) is not None and w.fold_cat(x.dtype) is not None for w in layers):
            return False
        return all(expert_lora_path(n_rows / self.n_experts, cuda=x.is_cuda, fused_buffer=True,
                                    backend=_forced((w,))) == "fused" for w in layers)

    def forward_lean(self, z_TL, row_index_N, K: int, offsets_E) -> torch.Tensor:
        """The experts over z[row_index // K] via lean_lora (path "lean"): no permuted copy, gate/up GEMMs
        at native width, the rank terms in the gather / SwiGLU passes."""
        w1, w3, w2 = self.w1, self.w3, self.w2
        # the adapters in their own dtype (fp32): lean_lora casts them, or computes with the bf16 copies
        # train/copies.py lends the layers, and returns their gradients in it (fp32 from its K-grouped kernels).
        # A_gate and A_up are one [E, I, 2R] operand: concatenated and cast here whether or not copies are lent
        A = torch.cat([w1.lora_A, w3.lora_A], 2)
        lent = [w.lent.get(n) for w, n in ((w1, "lora_B"), (w3, "lora_B"), (w2, "lora_A"), (w2, "lora_B"))]
        copies = None
        if all(c is not None and c.dtype == z_TL.dtype for c in lent):
            cBg, cBu, cAd, cBd = (c.detach() for c in lent)  # values only: the gradients go to the adapters
            copies = ((cBg, cBu), cAd, cBd)  # lean_lora_experts' layout: (B_gu, A_d, B_d)
        return lean_lora.lean_lora_experts(
            z_TL, row_index_N, K, offsets_E, (w1.weight, w3.weight), A, (w1.lora_B, w3.lora_B),
            w1.scaling, w2.weight.transpose(1, 2), w2.lora_A, w2.lora_B, w2.scaling,
            wcat_d=w2.cat_weight(z_TL.dtype), wk_gu=self.gate_up_cat(z_TL.dtype), copies=copies)

    @torch.no_grad()
    def gate_up_cat(self, dtype: torch.dtype) -> torch.Tensor | None:
        """The [E, 2F + RW, L] buffer that w1's and w3's frozen weights are views of (lean_lora.gate_up_buffer),
        made on first use: the lean path's backward then runs dx of gate/up with its LoRA term as one GEMM.

        Made only where both layers own their weight's storage in `dtype` (each still the view of its own
        [W | Bᵀ] buffer: one process, not FSDP2's sharded or gathered parameters); it takes the weights over
        (their own buffers are dropped, so the weights stay stored once). A buffer the weights are no longer
        views of (a cast, `.to()`, FSDP2's `release_cat`) is dropped here and, where the layers allow, made
        again. None: the lean path's two-GEMM backward."""
        w1, w3 = self.w1, self.w3
        F, RA = w1.out_features, w1.rank + w3.rank
        wk = self._gu_cat
        if wk is not None and wk.dtype == dtype and lean_lora.is_gate_up_view(w1.weight, w3.weight, wk, RA):
            return wk
        self._gu_cat = None
        if w1.cat_weight(dtype) is None or w3.cat_weight(dtype) is None or w1.weight.shape != w3.weight.shape:
            return None
        wk = lean_lora.gate_up_buffer(w1.weight, w3.weight, RA)
        w1.share_storage(wk[:, :F])
        w3.share_storage(wk[:, F:2 * F])
        self._gu_cat = wk
        return wk

    def release_cat(self) -> None:
        """Drop the gate/up buffer (FSDP2 shards contiguous parameters: parallelize gives w1 / w3 their own)."""
        self._gu_cat = None

    def forward_gather(self, z_TL, row_index_N, K: int, offsets_E) -> torch.Tensor:
        """forward(z[row_index // K]) without materialising the permuted rows (path "gather")."""
        g_NF = self.w1.forward_gather(z_TL, row_index_N, K, offsets_E)
        u_NF = self.w3.forward_gather(z_TL, row_index_N, K, offsets_E)
        return self._down(g_NF, u_NF, offsets_E)


def _forced(layers) -> str | None:
    """"fused" when every layer asks for backend "fused", else None (expert_lora_path's auto)."""
    return "fused" if all(w.backend == "fused" for w in layers) else None


class LocalDispatcher:
    """Single-rank dispatch: permute -> grouped experts -> unpermute. parallel/ swaps in an EP version.

    `dropless` (no capacity limit: every choice is routed, N = T*K) lets permute skip its host sync."""

    def __init__(self, dropless: bool = False):
        self.dropless = dropless

    def __call__(self, experts: GroupedExperts, z_TL, ids_TK, w_TK, n_experts: int, backend: str = "auto"):
        num_routed = ids_TK.numel() if self.dropless else None
        path = experts.path(z_TL, ids_TK.numel())
        over_z = {"lean": experts.forward_lean, "gather": experts.forward_gather}.get(path)
        if over_z is not None:  # the experts read z through the permutation: no permuted copy
            row_index_N, counts_E = permutation(ids_TK, n_experts, backend=backend, num_routed=num_routed)
            y_NL = over_z(z_TL, row_index_N, ids_TK.shape[1], offsets_from_counts(counts_E))
        else:
            z_NL, row_index_N, counts_E = permute(z_TL, ids_TK, n_experts, backend=backend, num_routed=num_routed)
            y_NL = experts(z_NL, offsets_from_counts(counts_E))
        return unpermute(y_NL, row_index_N, w_TK, z_TL.shape[0], backend=backend)


class LatentMoE(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        d, L = spec.hidden_size, spec.latent_dim or spec.hidden_size
        self.latent = spec.latent_dim is not None
        self.router = Router(spec)
        if self.latent:
            self.fc1_latent_proj = nn.Linear(d, L, bias=False)
            self.latent_norm = RMSNorm(L, eps=spec.norm_eps) if spec.latent_norm else None
            self.fc2_latent_proj = nn.Linear(L, d, bias=False)
        self.experts = GroupedExperts(spec.n_routed_experts, L, spec.moe_intermediate_size, spec.swiglu_limit)
        n_sh = spec.n_shared_experts
        self.shared = SwiGLU(d, n_sh * (spec.shared_intermediate_size or spec.moe_intermediate_size),
                             spec.swiglu_limit) if n_sh else None
        self.shared_gate = nn.Linear(d, 1, bias=False) if n_sh and spec.shared_expert_gate else None
        self.dispatcher = LocalDispatcher(dropless=spec.capacity_factor is None)
        self.backend = "auto"

    @property
    def _x_projections(self) -> tuple[nn.Module, ...]:
        """The linear layers that read the layer's input (looked up at each call: LoRA injection replaces them),
        in the order forward unpacks them: the latent projection, the shared expert's w1, w3, its gate."""
        mods = (self.fc1_latent_proj,) if self.latent else ()
        if self.shared is not None:
            mods += (self.shared.w1, self.shared.w3)
            if self.shared_gate is not None:
                mods += (self.shared_gate,)
        return mods

    def forward(self, h_BTD: torch.Tensor, parts: bool = False) -> tuple[torch.Tensor | tuple, dict]:
        """The routed experts' output plus the shared expert's, [B, T, D]; `parts`: the two unsummed, as a tuple
        (the block then adds both into its residual stream in one pass, RMSNorm.after_add)."""
        B, T, D = h_BTD.shape
        x_TD = h_BTD.reshape(B * T, D)
        r = self.router(x_TD, batch_size=B)
        # the projections of x (latent, shared expert's gate / up, its sigmoid gate) as one autograd node
        # (models/shared_input.py): one dx buffer for their gradients, the LoRA adapters' products batched
        outs = shared_input_linears(x_TD, self._x_projections)
        z_TL = x_TD
        if self.latent:
            z_TL = outs.pop(0)
            if self.latent_norm is not None:
                z_TL = self.latent_norm(z_TL)
        y_TL = self.dispatcher(self.experts, z_TL, r.expert_ids_TK, r.weights_TK, self.spec.n_routed_experts,
                               backend=self.backend)
        out_TD = self.fc2_latent_proj(y_TL) if self.latent else y_TL
        if self.shared is not None:
            sh_TD = self.shared.down(outs[0], outs[1])
            if self.shared_gate is not None:  # one sigmoid gate per token on the shared expert (Qwen3-Next)
                sh_TD = sh_TD * torch.sigmoid(outs[2])
        info = {"aux": r.aux, "moe": {"counts": r.counts_E.detach(), "drop_rate": r.drop_rate}}
        outs_TD = (out_TD,) if self.shared is None else (out_TD, sh_TD)
        if parts:
            return tuple(o.view(B, T, D) for o in outs_TD), info
        return sum(outs_TD[1:], outs_TD[0]).view(B, T, D), info
