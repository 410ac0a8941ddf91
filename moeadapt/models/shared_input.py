"""`shared_input_linears(x, mods)`: several linear layers of one input as one autograd node under autocast.

The math is that of the layers one after another, [m(x) for m in mods]:
    y_i = x W_i^T + b_i (+ s_i (x A_i^T) B_i^T for a LoRA layer with a frozen base),
    dx  = sum_i dy_i W_i (+ sum_i s_i (dy_i B_i) A_i),   dW_i = dy_i^T x,   db_i = sum_rows dy_i,
    dA_i = s_i (dy_i B_i)^T x,   dB_i = s_i dy_i^T (x A_i^T).
What changes is how many passes over activation-sized tensors it takes. Run layer by layer, autograd gives each
layer its own dx and adds them up (n - 1 adds of a [tokens, in] tensor: KDA's six projections of one input are five
adds per layer), and each LoRA adapter reads x in the forward and again for dA, and adds its own rank-r product
into dx. Here dx is one buffer that each weight's GEMM adds into (beta = 1), and the adapters of all LoRA members
run as one: x [A_1; ...; A_n]^T once forward, one rank-(n r) GEMM into dx, and one GEMM for every dA backward.

Members it takes: plain nn.Linear (trainable or frozen, fp32 weights cast to the autocast dtype as autocast would,
their gradients returned in the weight's dtype) and layers that offer `shared_input_terms()` (LoRALinear with a
frozen base and no dropout). Anything else (a hook on a member, a subclass, no autocast, float64 inputs) runs
layer by layer, which computes the same values. Inside train/copies.py's `lent` the trained weights and adapters
come as their bf16 copies: nothing to cast, and their gradients stay bf16 (each adapter's dA is then a row block
of the one dA GEMM's output).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules import module as _module
from torch.utils._python_dispatch import _get_current_dispatch_mode


def add_lowrank(y: torch.Tensor, h: torch.Tensor, b: torch.Tensor, s: float) -> torch.Tensor:
    """y + s h b^T: into y in place (no second activation-sized buffer), except under a dispatch mode. Selective
    activation checkpointing's mode caches the GEMM that made y for its recompute and refuses a cached tensor
    that was changed in place, so there the sum is a new tensor."""
    if _get_current_dispatch_mode() is not None:
        return torch.addmm(y, h, b.t(), alpha=s)
    return y.addmm_(h, b.t(), alpha=s)


def _terms(m: nn.Module):
    """(weight, bias, (A, B, scaling) or None) of a member the fused node can take, else None."""
    if m._forward_hooks or m._forward_pre_hooks:
        return None
    if type(m) is nn.Linear:
        return m.weight, m.bias, None
    get = getattr(m, "shared_input_terms", None)
    return get() if get is not None else None


def shared_input_linears(x: torch.Tensor, mods: Sequence[nn.Module]) -> list[torch.Tensor]:
    """[m(x) for m in mods], as one autograd node where every member and the context allow (module docstring)."""
    dev = x.device.type
    terms = None
    if (len(mods) > 1 and torch.is_autocast_enabled(dev) and x.dtype != torch.float64
            and not (_module._global_forward_hooks or _module._global_forward_pre_hooks)):
        terms = [_terms(m) for m in mods]
        if any(t is None for t in terms):
            terms = None
    if terms is None:
        return [m(x) for m in mods]
    flat, lora = [], []
    for w, b, ab in terms:
        flat += [w, b]
        lora.append(ab is not None)
    adapters = [ab for _, _, ab in terms if ab is not None]
    for a, b, _ in adapters:
        flat += [a, b]
    scales = tuple(s for _, _, s in adapters)
    return list(_SharedInputLinears.apply(x, torch.get_autocast_dtype(dev), tuple(lora), scales, *flat))


class _SharedInputLinears(torch.autograd.Function):
    """Forward and backward of `shared_input_linears` (module docstring). Inputs: x, the compute dtype, which
    members carry an adapter, the adapters' scalings, then (W_i, b_i) per member and (A_j, B_j) per adapter."""

    @staticmethod
    def forward(ctx, x, dt, lora, scales, *flat):
        n, na = len(lora), len(scales)
        ws, bs = flat[0:2 * n:2], flat[1:2 * n:2]
        As, Bs = flat[2 * n::2], flat[2 * n + 1::2]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(dt)
        wc = [w.to(dt) for w in ws]
        ys = [x2 @ w.t() if b is None else torch.addmm(b.to(dt), x2, w.t()) for w, b in zip(wc, bs)]
        a_cat = bc = h = None
        if na:
            r = [a.shape[0] for a in As]
            a_cat = torch.cat([a.to(dt) for a in As])  # [sum r, in]
            bc = [b.to(dt) for b in Bs]
            h = x2 @ a_cat.t()  # [tokens, sum r]: every adapter's x A^T in one GEMM
            j = o = 0
            for i in range(n):
                if lora[i]:
                    ys[i] = add_lowrank(ys[i], h[:, o:o + r[j]], bc[j], scales[j])
                    o += r[j]
                    j += 1
        ctx.save_for_backward(x2, h, a_cat, *wc, *(bc or ()))
        ctx.meta = (shape, x.dtype, lora, scales, [w.dtype for w in ws], [b is not None for b in bs],
                    [(a.dtype, b.dtype) for a, b in zip(As, Bs)])
        return tuple(y.view(*shape[:-1], y.shape[-1]) for y in ys)

    @staticmethod
    def backward(ctx, *dys):
        shape, x_dtype, lora, scales, w_dtypes, has_b, ab_dtypes = ctx.meta
        n, na = len(lora), len(scales)
        x2, h, a_cat, *rest = ctx.saved_tensors
        wc, bc = rest[:n], rest[n:]
        dt = x2.dtype
        needs = ctx.needs_input_grad
        rows = x2.shape[0]
        # a member whose output took no part in the loss gives no gradient (None): it adds nothing
        dy2 = [None if d is None else d.reshape(rows, -1).to(dt) for d in dys]
        dx = None
        if needs[0]:
            for d, w in zip(dy2, wc):
                if d is None:
                    continue
                if dx is None:
                    dx = d @ w
                else:
                    dx.addmm_(d, w)
        grads_w = []
        for i, d in enumerate(dy2):
            gw = gb = None
            if d is not None and needs[4 + 2 * i]:
                gw = (d.t() @ x2).to(w_dtypes[i])
            if d is not None and has_b[i] and needs[5 + 2 * i]:
                gb = d.sum(0).to(w_dtypes[i])
            grads_w += [gw, gb]
        grads_ab = [None] * (2 * na)
        if na:
            r = [b.shape[1] for b in bc]
            # (s_j dy_j B_j)^T stacked: rows of the adapters' [sum r, tokens]; zeroed only if an adapter member has
            # no gradient (its rows are then not written)
            unwritten = any(dy2[i] is None for i in range(n) if lora[i])
            dhT = x2.new_zeros(sum(r), rows) if unwritten else x2.new_empty(sum(r), rows)
            j = o = 0
            members = []
            for i in range(n):
                if lora[i]:
                    members.append((i, j, o))
                    if dy2[i] is not None:
                        torch.mm(bc[j].t(), dy2[i].t(), out=dhT[o:o + r[j]])
                        dhT[o:o + r[j]].mul_(scales[j])
                    o += r[j]
                    j += 1
            if needs[0]:
                if dx is None:
                    dx = dhT.t() @ a_cat
                else:
                    dx.addmm_(dhT.t(), a_cat)  # every adapter's share of dx: one rank-(sum r) GEMM
            base = 2 * n + 4
            da_cat = dhT @ x2 if any(needs[base + 2 * j] for _, j, _ in members) else None
            for i, j, o in members:
                if dy2[i] is None:
                    continue
                if da_cat is not None and needs[base + 2 * j]:
                    grads_ab[2 * j] = da_cat[o:o + r[j]].to(ab_dtypes[j][0])
                if needs[base + 2 * j + 1]:
                    grads_ab[2 * j + 1] = (dy2[i].t() @ h[:, o:o + r[j]]).mul_(scales[j]).to(ab_dtypes[j][1])
        if dx is not None:
            dx = dx.view(shape).to(x_dtype)
        return (dx, None, None, None, *grads_w, *grads_ab)
