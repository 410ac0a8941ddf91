"""Router and routing governance for the MoE layers.

Owns: fp32 scores (sigmoid or softmax), group-limited top-k, the selection-only bias for aux-loss-free
balancing (`expert_bias`, a buffer: it changes *which* experts are chosen, never the gate values), the
aux losses (global-batch, sequence-level, z-loss; each with its own coefficient, 0 = off), capacity and
drop policies, and per-step token counts (the `tokens_per_expert` buffer, summed over micro-batches
until `update_expert_bias` consumes it after the optimizer step).

Capacity (capacity_factor = None means dropless): each expert takes at most
ceil(capacity_factor * T * K / E) token-choices per micro-batch. Over-capacity choices are
  "probs":    dropped by lowest gate score first (the expert keeps its highest-scoring tokens),
  "position": dropped latest first (the expert keeps the earliest tokens),
  "reroute":  sent to the token's next-best expert that still has room (by selection score, never an
              expert the token already uses); if none has room after a few rounds, dropped.
A dropped choice contributes zero to the output and its weight is NOT renormalised onto the token's
other choices: the token simply gets less expert output (the residual stream carries it through).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import ModelSpec


def expert_counts(ids: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Choices per expert (int64 [E]); ids of -1 (dropped) are not counted. Unlike `torch.bincount` (which
    reads the largest id back to the host) and boolean indexing, this never waits for the GPU."""
    flat = ids.reshape(-1) + 1  # -1 -> bin 0, dropped
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    return counts[1:]


def _mm(a: torch.Tensor, b: torch.Tensor, mode: str) -> torch.Tensor:
    """a·b as an fp32 result: fp32 GEMM (TF32 off), TF32 tensor-core GEMM, or bf16 inputs with fp32 output."""
    if mode == "bf16":
        return mm_fp32_out(a.to(torch.bfloat16), b.to(torch.bfloat16))
    flag = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    try:
        return a.float() @ b.float()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = flag


# torch.mm's out_dtype (fp32 output from bf16 inputs, cuBLAS) arrived in torch 2.8; the project allows 2.6, where
# router_matmul "bf16x2" runs as "tf32"
MM_FP32_OUT = hasattr(torch.ops.aten.mm, "dtype")


def mm_fp32_out(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a·b for bf16 a, b on bf16 tensor cores, summed and returned in fp32 (cuBLAS's `out_dtype`). On the CPU, or
    a torch without that output (< 2.8), the same math in fp32 ops: bf16 products are exact in fp32 (and TF32)."""
    with torch.autocast(a.device.type, enabled=False):  # (CPU autocast would run the fp32 matmul in bf16)
        if a.is_cuda and MM_FP32_OUT:
            return torch.mm(a, b, out_dtype=torch.float32)
        return a.float() @ b.float()


def split_bf16(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi, lo) in bf16 with hi + lo = t to 16 mantissa bits (t fp32): hi = bf16(t), lo = bf16(t - hi)."""
    hi = t.to(torch.bfloat16)
    return hi, (t - hi.float()).to(torch.bfloat16)


class _RouterLogits(torch.autograd.Function):
    """logits = x·Wᵀ in fp32 under CUDA autocast, which would otherwise run this linear in bf16 and round the
    logits to bf16 before the scores. Forward and backward GEMMs in `mode` (ModelSpec.router_matmul). Saved for
    the backward: W (dx), and x only when W trains (dW): as a bf16 copy, as autocast's linear would, except in
    "fp32" mode (x as given). Gradients return in x's and W's dtypes."""

    @staticmethod
    def forward(ctx, x_TD, w_ED, mode):
        ctx.mode, ctx.x_dtype = mode, x_TD.dtype
        need_w = ctx.needs_input_grad[1]
        x_bf = x_TD.to(torch.bfloat16) if mode == "bf16" or (need_w and mode != "fp32") else None  # cast once
        ctx.save_for_backward((x_TD if mode == "fp32" else x_bf) if need_w else None, w_ED)
        with torch.autocast(x_TD.device.type, enabled=False):
            return _mm(x_bf if mode == "bf16" else x_TD, w_ED.t(), mode)

    @staticmethod
    def backward(ctx, g_TE):
        x_keep, w_ED = ctx.saved_tensors
        dx = _mm(g_TE, w_ED, ctx.mode).to(ctx.x_dtype) if ctx.needs_input_grad[0] else None
        dw = _mm(g_TE.t(), x_keep, ctx.mode).to(w_ED.dtype) if ctx.needs_input_grad[1] else None
        return dx, dw, None


class _RouterLogitsBF16x2(torch.autograd.Function):
    """router_matmul "bf16x2": logits = x·Wᵀ for a bf16 x (exact in bf16: autocast's activations) on bf16 tensor
    cores, with the fp32 operands each split into two bf16 terms (split_bf16: 16 mantissa bits, TF32 keeps 10)
    and fp32 sums:
        logits = x·W_hiᵀ + x·W_loᵀ                     one GEMM: x · [W_hi; W_lo]ᵀ, fp32 out, halves added
        dx     = g_hi·W_hi + g_lo·W_hi + g_hi·W_lo     one GEMM: [g_hi | g_lo | g_hi] · [W_hi; W_hi; W_lo], in x's dtype
        dW     = g_hiᵀ·x + g_loᵀ·x                     one GEMM: [g_hi | g_lo]ᵀ · x, fp32 out, halves added
    (the dropped g_lo·W_lo term is 2⁻¹⁶ of the product). Nothing activation-sized in fp32: no fp32 copy of x in
    the forward nor of dx in the backward, which the "tf32" mode makes (a [tokens, hidden] cast each way).
    Saved: [W_hi; W_hi; W_lo] (bf16, [3E, D]) and x itself when W trains."""

    @staticmethod
    def forward(ctx, x_TD, w_ED):
        E = w_ED.shape[0]
        hi, lo = split_bf16(w_ED.float())
        w3 = torch.cat([hi, hi, lo])  # [3E, D]
        ctx.save_for_backward(x_TD if ctx.needs_input_grad[1] else None, w3)
        ctx.w_dtype = w_ED.dtype
        out = mm_fp32_out(x_TD, w3[E:].t())  # [T, 2E]
        return out[:, :E] + out[:, E:]

    @staticmethod
    def backward(ctx, g_TE):
        x_TD, w3 = ctx.saved_tensors
        E = g_TE.shape[1]
        g_hi, g_lo = split_bf16(g_TE.float())
        g3 = torch.cat([g_hi, g_lo, g_hi], 1)  # [T, 3E]
        dx = dw = None
        if ctx.needs_input_grad[0]:  # bf16 out, fp32 sums (cuBLAS's; on the CPU in fp32 ops)
            with torch.autocast(g3.device.type, enabled=False):
                dx = g3 @ w3 if g3.is_cuda else mm_fp32_out(g3, w3).to(torch.bfloat16)
        if ctx.needs_input_grad[1]:
            d2 = mm_fp32_out(g3[:, :2 * E].t(), x_TD)  # [2E, D]
            dw = (d2[:E] + d2[E:]).to(ctx.w_dtype)
        return dx, dw


def router_logits(x_TD: torch.Tensor, w_ED: torch.Tensor, mode: str) -> torch.Tensor:
    """fp32 (fp64 for fp64 input) router logits x·Wᵀ, also under autocast (see _RouterLogits and
    _RouterLogitsBF16x2; mode "bf16x2" with an x that is not bf16, or on torch < 2.8, runs as "tf32")."""
    if x_TD.dtype == torch.float64:
        return F.linear(x_TD, w_ED.double())
    if torch.is_autocast_enabled(x_TD.device.type):
        if mode == "bf16x2":
            if x_TD.dtype == torch.bfloat16 and MM_FP32_OUT:
                if x_TD.dim() == 2:
                    return _RouterLogitsBF16x2.apply(x_TD, w_ED)
                out = _RouterLogitsBF16x2.apply(x_TD.reshape(-1, x_TD.shape[-1]), w_ED)
                return out.view(*x_TD.shape[:-1], w_ED.shape[0])
            mode = "tf32"  # an fp32 or fp16 x is not exact in bf16 (or torch < 2.8): the TF32 GEMMs
        return _RouterLogits.apply(x_TD, w_ED, mode)
    return F.linear(x_TD.float(), w_ED.float())


@dataclass
class RouterOutput:
    expert_ids_TK: torch.Tensor  # int64, -1 = dropped by capacity
    weights_TK: torch.Tensor  # fp32 gate values (0 where dropped)
    counts_E: torch.Tensor  # tokens routed per expert (after capacity / rerouting)
    aux: dict[str, torch.Tensor] = field(default_factory=dict)  # weighted aux losses (each already x coef)
    drop_rate: float | torch.Tensor = 0.0


class Router(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        E = spec.n_routed_experts
        self.n_experts, self.top_k = E, spec.n_experts_per_tok
        self.weight = nn.Parameter(torch.empty(E, spec.hidden_size))
        self.register_buffer("expert_bias", torch.zeros(E, dtype=torch.float32), persistent=True)
        self.register_buffer("tokens_per_expert", torch.zeros(E, dtype=torch.float32), persistent=False)
        # parallel/ may set this to an all-reduce over the data-parallel ranks, which makes `aux_loss` a
        # true global-batch loss (f_e from every rank's tokens); the model never talks to other ranks itself.
        self.global_counts_reduce = None
        self.cp = None  # an ops.cp_comm.CPLayout under context parallelism (set by models.set_context_parallel)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, std=self.spec.initializer_range)
        self.expert_bias.zero_()
        self.tokens_per_expert.zero_()

    # -- selection ---------------------------------------------------------------------------------
    def _select_scores(self, scores_TE: torch.Tensor) -> torch.Tensor:
        sel = scores_TE + self.expert_bias
        G, tg = self.spec.n_group, self.spec.topk_group
        if G > 1:
            T, E = sel.shape
            grouped = sel.view(T, G, E // G)
            group_score = grouped.topk(min(2, E // G), dim=-1).values.sum(-1) if self.spec.score_func == "sigmoid" \
                else grouped.max(-1).values
            keep_TG = torch.zeros_like(group_score, dtype=torch.bool)
            keep_TG.scatter_(1, group_score.topk(tg, dim=-1).indices, True)
            sel = sel.masked_fill(~keep_TG.repeat_interleave(E // G, dim=1), float("-inf"))
        return sel

    def forward(self, x_TD: torch.Tensor, batch_size: int = 1) -> RouterOutput:
        spec, E, K = self.spec, self.n_experts, self.top_k
        T = x_TD.shape[0]
        acc = torch.float64 if x_TD.dtype == torch.float64 else torch.float32  # fp32 at least
        logits_TE = router_logits(x_TD, self.weight, spec.router_matmul)
        scores_TE = logits_TE.sigmoid() if spec.score_func == "sigmoid" else logits_TE.softmax(-1)
        with torch.no_grad():
            sel_TE = self._select_scores(scores_TE)
            ids_TK = sel_TE.topk(K, dim=-1).indices
        w_TK = scores_TE.gather(1, ids_TK)
        if spec.norm_topk_prob and K > 1:
            w_TK = w_TK / (w_TK.sum(-1, keepdim=True) + 1e-20)
        w_TK = w_TK * spec.routed_scaling_factor

        aux: dict[str, torch.Tensor] = {}
        probs_TE = scores_TE / scores_TE.sum(-1, keepdim=True) if spec.score_func == "sigmoid" else scores_TE
        if spec.aux_loss_coef > 0:  # global-batch: E * sum_e f_e * P_e, f from all ranks' tokens when reduced
            with torch.no_grad():
                c_E = expert_counts(ids_TK, E).to(acc)
                n = torch.full((1,), float(T * K), dtype=acc, device=c_E.device)
                if self.global_counts_reduce is not None:
                    self.global_counts_reduce(c_E)
                    self.global_counts_reduce(n)
                f_E = c_E / n
            aux["aux_loss"] = spec.aux_loss_coef * E * (f_E * probs_TE.mean(0)).sum()
        if spec.seq_aux_loss_coef > 0:  # the same per sequence, averaged over sequences
            S = T // batch_size
            one_hot = torch.zeros(batch_size, S, E, device=x_TD.device, dtype=acc)
            one_hot.scatter_(2, ids_TK.view(batch_size, S, K), 1.0)
            counts_BE, S_all = one_hot.sum(1), S
            if self.cp is not None and self.cp.size > 1:  # a sequence's tokens span the cp group: count them all
                dist.all_reduce(counts_BE, group=self.cp.group)
                S_all = S * self.cp.size
            f_BE = counts_BE / (S_all * K)
            aux["seq_aux_loss"] = spec.seq_aux_loss_coef * E * (f_BE * probs_TE.view(batch_size, S, E).mean(1)).sum(-1).mean()
        if spec.z_loss_coef > 0:
            aux["z_loss"] = spec.z_loss_coef * torch.logsumexp(logits_TE, dim=-1).pow(2).mean()

        drop_rate: float | torch.Tensor = 0.0
        if spec.capacity_factor is not None:
            ids_TK, w_TK = self._apply_capacity(ids_TK, w_TK, sel_TE, T)
            drop_rate = (ids_TK < 0).float().mean()
        counts_E = expert_counts(ids_TK, E)
        if self.training:
            self.tokens_per_expert += counts_E.float()
        return RouterOutput(ids_TK, w_TK, counts_E, aux, drop_rate)

    # -- capacity --------------------------------------------------------------------------------------
    def capacity(self, T: int) -> int:
        return max(1, math.ceil(self.spec.capacity_factor * T * self.top_k / self.n_experts))

    @torch.no_grad()
    def _keep_mask(self, ids_TK: torch.Tensor, priority_TK: torch.Tensor, room_E: torch.Tensor) -> torch.Tensor:
        """Among the valid choices, keep per expert the `room_E[e]` ones of highest priority."""
        E = self.n_experts
        flat_ids, flat_pri = ids_TK.flatten(), priority_TK.flatten()
        valid = flat_ids >= 0
        # sort by (expert, -priority); rank within expert = position - first position of that expert
        key = torch.where(valid, flat_ids, E).double() * 4.0 - flat_pri.double().clamp(-1, 1) * 1.0
        order = torch.argsort(key, stable=True)
        sorted_ids = torch.where(valid, flat_ids, E)[order]
        counts = expert_counts(sorted_ids, E + 1)
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(order.numel(), device=ids_TK.device) - starts[sorted_ids]
        room = torch.cat([room_E, room_E.new_zeros(1)])
        keep_sorted = rank < room[sorted_ids]
        keep = torch.empty_like(keep_sorted)
        keep[order] = keep_sorted
        return (keep & valid).view_as(ids_TK)

    def _priority(self, w_TK: torch.Tensor, T: int) -> torch.Tensor:
        """In [-1, 1], higher = kept first."""
        if self.spec.drop_policy == "position":
            pos = torch.arange(T, device=w_TK.device, dtype=torch.float64)[:, None].expand_as(w_TK)
            return 1.0 - 2.0 * pos / max(T, 1)
        return w_TK.detach().double() / (w_TK.detach().abs().max().double() + 1e-30)

    def _apply_capacity(self, ids_TK, w_TK, sel_TE, T):
        E, cap = self.n_experts, self.capacity(T)
        room_E = torch.full((E,), cap, device=ids_TK.device, dtype=torch.long)
        keep = self._keep_mask(ids_TK, self._priority(w_TK, T), room_E)
        if self.spec.drop_policy == "reroute":
            pri = self._priority(w_TK, T)
            tried_TE = torch.zeros_like(sel_TE, dtype=torch.bool).scatter_(1, ids_TK, True)
            for _ in range(4):  # each round moves at most one dropped choice per token
                dropped = ~keep
                room_E = cap - expert_counts(torch.where(keep, ids_TK, -1), E)
                cand_TE = sel_TE.masked_fill(tried_TE | (room_E <= 0)[None, :], float("-inf"))
                has_T = torch.isfinite(cand_TE.max(-1).values)
                first = dropped & (torch.cumsum(dropped.long(), dim=1) == 1) & has_T[:, None]
                if not first.any():
                    break
                best_T = cand_TE.argmax(-1)
                cand_ids = torch.where(first, best_T[:, None].expand_as(ids_TK), -1)
                got = self._keep_mask(cand_ids, pri, room_E.clamp(min=0))
                movers = first.any(1)
                tried_TE[movers, best_T[movers]] = True
                ids_TK = torch.where(got, cand_ids, ids_TK)  # a rerouted choice keeps its gate value
                keep = keep | got
        ids_TK = torch.where(keep, ids_TK, -1)
        w_TK = torch.where(keep, w_TK, torch.zeros_like(w_TK))
        return ids_TK, w_TK


def router_weight_ids(model: nn.Module) -> set[int]:
    """id() of every Router's weight: the weights bf16 training keeps fp32 (train/copies.py `store_bf16`; the
    planner counts them so, plan/memory.py)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, Router)}


@torch.no_grad()
def update_expert_bias(model: nn.Module, counts_reduce=None, apply: torch.Tensor | None = None) -> None:
    """Aux-loss-free balancing, after each optimizer step: bias += rate * sign(mean - count), re-centred; the
    counts are then zeroed. `apply` (a device bool) keeps every bias as it was where False: the step the counts
    came from was skipped on the device.

    `counts_reduce(t)` may all-reduce the per-expert counts across ranks (parallel/ passes one);
    the model itself never talks to other ranks. A router that saw no token keeps its bias; that choice is made
    on the device (torch.where), so the update never makes the host wait for the step's kernels. Routers of the
    same expert count and rate are updated together: one reduction and a few kernels for all of a model's MoE
    layers rather than a dozen launches (and a collective) per layer."""
    groups: dict[tuple, list[Router]] = {}
    for m in model.modules():
        if isinstance(m, Router):
            c = m.tokens_per_expert
            groups.setdefault((c.shape, c.dtype, c.device, m.spec.bias_update_rate), []).append(m)
    for (_, _, _, rate), routers in groups.items():
        c = torch.stack([m.tokens_per_expert for m in routers])  # [layers, E]
        if counts_reduce is not None:
            counts_reduce(c)
        if rate > 0:
            biases = [m.expert_bias for m in routers]
            old = torch.stack(biases)
            b = old + rate * torch.sign(c.mean(1, keepdim=True) - c).to(old.dtype)
            keep = c.sum(1, keepdim=True) > 0
            if apply is not None:
                keep = keep & apply
            new = torch.where(keep, b - b.mean(1, keepdim=True), old)
            torch._foreach_copy_(biases, list(new.unbind(0)))
        torch._foreach_zero_([m.tokens_per_expert for m in routers])
