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
Narrow members (at most NARROW_OUT outputs, no bias: KDA's gate projections f_a / g_a and its beta, DSA's gate)
join the adapters' GEMM: x is read once for all of them forward, and backward their dy W and the adapters' dh A
are one GEMM that writes dx first (K = the narrow widths plus the ranks); the wide members' GEMMs then add into
it. A GEMM of K <= 256 adding into an existing dx is memory-bound (it reads and writes all of dx for little math),
where a wide member's GEMM hides that read under its math.

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


def lowrank(h: torch.Tensor, b: torch.Tensor, s: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """s h b^T as one GEMM that only writes its output (into `out` when given): the scale in the GEMM's epilogue
    (alpha), and beta = 0, so the C operand (a 0-dim placeholder, never read) costs no pass."""
    c = torch.empty((), device=h.device, dtype=h.dtype)
    return torch.addmm(c, h, b.t(), beta=0, alpha=s, out=out)


def linear_lowrank(x2: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor, b: torch.Tensor,
                   s: float) -> torch.Tensor:
    """x2 w^T + bias + s h b^T ([rows, out]; h = x2 A^T, the adapter's rank-r product), all in x2's dtype.

    The rank-r product is made first and the base GEMM adds into it (addmm_ with beta = 1: cuBLAS reads C in its
    epilogue, under the GEMM's math). The other order, the base GEMM then a rank-r addmm_, reads and writes the
    whole [rows, out] output a second time for a product of K = r: memory-bound, about a third of the base GEMM's
    time at [8192, 2048]. Under a dispatch mode (selective activation checkpointing's caches each GEMM's output and
    refuses one changed in place) the base GEMM's sum is out of place (torch copies C first): the same values, so
    selective recompute's gradients equal the plain step's."""
    y = lowrank(h, b, s) if bias is None else torch.addmm(bias, h, b.t(), alpha=s)
    if _get_current_dispatch_mode() is not None:
        return torch.addmm(y, x2, w.t())
    return y.addmm_(x2, w.t())


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


# members with at most this many outputs (and no bias) run in one GEMM with the LoRA adapters' A (module docstring)
NARROW_OUT = 256


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
        bsc = [None if b is None else b.to(dt) for b in bs]
        r = [a.shape[0] for a in As]
        narrow = tuple(i for i in range(n) if bs[i] is None and ws[i].shape[0] <= NARROW_OUT)
        if na + len(narrow) < 2:
            narrow = ()  # one narrow member alone: its own GEMM, as a wide one
        # [A_1; ...; A_na; W_narrow...]: every adapter's x A^T and the narrow members' x W^T in one GEMM
        small = [a.to(dt) for a in As] + [wc[i] for i in narrow]
        w_small = (torch.cat(small) if len(small) > 1 else small[0]) if small else None
        hs = x2 @ w_small.t() if small else None  # [tokens, sum r + narrow widths]
        h = hs[:, :sum(r)] if na else None
        ys: list[torch.Tensor | None] = [None] * n
        o = sum(r)
        for i in narrow:
            ys[i] = hs[:, o:o + ws[i].shape[0]]
            o += ws[i].shape[0]
        bc = [b.to(dt) for b in Bs]
        j = o = 0
        for i in range(n):
            if lora[i]:
                hj = h[:, o:o + r[j]]
                if ys[i] is not None:  # narrow: its slice of hs plus its adapter's product (a small new tensor)
                    ys[i] = torch.addmm(ys[i], hj, bc[j].t(), alpha=scales[j])
                else:
                    ys[i] = linear_lowrank(x2, wc[i], bsc[i], hj, bc[j], scales[j])
                o += r[j]
                j += 1
        ys = [y if y is not None else x2 @ w.t() if b is None else torch.addmm(b, x2, w.t())
              for y, w, b in zip(ys, wc, bsc)]
        wide = [None if i in narrow else wc[i] for i in range(n)]  # narrow members' weights are rows of w_small
        ctx.save_for_backward(x2, h, w_small, *wide, *bc)
        ctx.meta = (shape, x.dtype, lora, scales, narrow, [ws[i].shape[0] for i in narrow], [w.dtype for w in ws],
                    [b is not None for b in bs], [(a.dtype, b.dtype) for a, b in zip(As, Bs)])
        return tuple(y.view(*shape[:-1], y.shape[-1]) for y in ys)

    @staticmethod
    def backward(ctx, *dys):
        shape, x_dtype, lora, scales, narrow, widths, w_dtypes, has_b, ab_dtypes = ctx.meta
        n, na = len(lora), len(scales)
        x2, h, w_small, *rest = ctx.saved_tensors
        wide, bc = rest[:n], rest[n:]
        dt = x2.dtype
        needs = ctx.needs_input_grad
        rows = x2.shape[0]
        # a member whose output took no part in the loss gives no gradient (None): it adds nothing
        dy2 = [None if d is None else d.reshape(rows, -1).to(dt) for d in dys]
        grads_w = []
        for i, d in enumerate(dy2):
            gw = gb = None
            if d is not None and needs[4 + 2 * i]:
                gw = (d.t() @ x2).to(w_dtypes[i])
            if d is not None and has_b[i] and needs[5 + 2 * i]:
                gb = d.sum(0).to(w_dtypes[i])
            grads_w += [gw, gb]
        grads_ab = [None] * (2 * na)
        r = [b.shape[1] for b in bc]
        R = sum(r)
        # [s_j (dy_j B_j)^T stacked; dy_narrow^T stacked]: the rows of w_small's GEMM's left operand, [K, tokens];
        # zeroed only if a member among them has no gradient (its rows are then not written)
        lora_members = [i for i in range(n) if lora[i]]
        unwritten = any(dy2[i] is None for i in (*lora_members, *narrow))
        dT = None
        if w_small is not None:
            dT = x2.new_zeros(w_small.shape[0], rows) if unwritten else x2.new_empty(w_small.shape[0], rows)
        o = R
        for i, width in zip(narrow, widths):  # (their rows serve dx alone)
            if dy2[i] is not None and needs[0]:
                dT[o:o + width].copy_(dy2[i].t())
            o += width
        j = o = 0
        members = []
        for i in lora_members:
            members.append((i, j, o))
            if dy2[i] is not None:
                lowrank(bc[j].t(), dy2[i], scales[j], out=dT[o:o + r[j]])  # s_j B_j^T dy_j^T
            o += r[j]
            j += 1
        dx = None
        if needs[0]:
            if dT is not None:  # the adapters' and narrow members' shares: one GEMM, made first (linear_lowrank)
                dx = dT.t() @ w_small
            for d, w in zip(dy2, wide):  # the wide members' shares added in by their GEMMs (beta = 1)
                if d is None or w is None:
                    continue
                if dx is None:
                    dx = d @ w
                else:
                    dx.addmm_(d, w)
        if na:
            base = 2 * n + 4
            da_cat = dT[:R] @ x2 if any(needs[base + 2 * j] for _, j, _ in members) else None
            for i, j, o in members:
                if dy2[i] is None:
                    continue
                if da_cat is not None and needs[base + 2 * j]:
                    grads_ab[2 * j] = da_cat[o:o + r[j]].to(ab_dtypes[j][0])
                if needs[base + 2 * j + 1]:
                    grads_ab[2 * j + 1] = lowrank(dy2[i].t(), h[:, o:o + r[j]].t(), scales[j]).to(ab_dtypes[j][1])
        if dx is not None:
            dx = dx.view(shape).to(x_dtype)
        return (dx, None, None, None, *grads_w, *grads_ab)
