"""Grouped LoRA folded into the base grouped GEMM: one base-sized GEMM per direction, no ΔW, no dW.

Owns `grouped_lora(..., backend="fused")`. Per expert e (math orientation, W_e [I, O], A_e [I, R],
B_e [R, O], s = scaling):  y = x·W_e + s·(x·A_e)·B_e.

The trick is a concatenation on the *input* side of the forward GEMM, which is the output side of
the backward GEMM, over one weight buffer `wcat [E, O, J]` (J = I + RW, RW = R rounded up to 8 so
every stride stays 16-byte aligned): columns [0, I) hold the frozen base weight (stored [E, out, in]
like the model's), columns [I, I+R) hold B_eᵀ, the rest zeros.

  forward   lora_in:   xcat = [x | s·x·A_e | 0]                (Triton: reads x once, writes xcat)
            gmm:       y    = xcat · wcat_eᵀ = x·W_e + s·h·B_e  (one torch._grouped_mm, K = I + RW)
  backward  gmm:       dxc  = dy · wcat_e = [dy·W_eᵀ | dy·B_eᵀ] (one torch._grouped_mm, N = I + RW)
            lora_out:  dx   = dxc[:, :I] + s·dxc[:, I:I+R]·A_eᵀ (Triton epilogue pass)
            dA_e = s·x_eᵀ·(dy·B_eᵀ)_e,  dB_e = (s·h_e)ᵀ·dy_e     (K-grouped GEMMs over the rows)
  and dW_e = x_eᵀ·dy_e only when the base weight requires grad.
`xcat` is the only activation saved (it replaces x; + RW/I wider). With dx="split" the backward
instead runs dx = dy·W_eᵀ on the base columns alone and g = dy·B_eᵀ by a thin Triton pass over dy
(an extra read of dy instead of the wider dx GEMM); the bench measures both.

Memory contract: `wcat` is *persistent* when the caller owns it (GroupedLoRALinear keeps its base
`weight` as a view of wcat[:, :, :I]; weight memory grows by RW/I, 1.6% at I=1024, R=16). The B
columns are rewritten from B (E·O·R elements) at every forward and again before the backward GEMM,
so interleaved forwards cannot leave a stale B. When `w_EIO` is not such a view, a temporary wcat is
built per call (a weight-sized copy held until backward): correct, but slower and heavier.

Folded input passes: `grouped_lora_fused_gather` reads the token-major rows through
permute's row index inside the LoRA-in pass (no permuted copy; dz comes back in token order through the combine
kernel), `grouped_lora_fused_swiglu` forms silu(gate)·up inside it (no SwiGLU output) and fuses the SwiGLU
backward into the dx epilogue. Both need a frozen base. Where all three expert projections carry LoRA the model
prefers lean_lora.py (ops/moe/path.py decides): the widened GEMM costs far more than its FLOPs on the H200 (a 1024-wide
grouped GEMM made 1040 wide runs 21-33% slower), so lean keeps gate/up's GEMM at native width.

Off CUDA the same structure runs with torch._grouped_mm on CPU (or the padded reference where it is
missing) and the two Triton passes under TRITON_INTERPRET=1 (or their torch twins).

Shape suffixes: N routed rows, I / O input / output width, E experts, R rank, RW padded rank,
J = I + RW.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .reference import _rows_to_padded, grouped_mm_reference
from .triton_grouped_mm import _cached_tile_map, _tile_rows, grouped_wgrad

# The backward's dy·[W_e | B_eᵀ] GEMM, an argument `dx` of the public functions here and in lean_lora.py:
#   "cat"   (default) one GEMM against the whole wcat gives dy·Wᵀ and dy·Bᵀ together;
#   "split" the GEMM on the base columns (a view of wcat) + a thin Triton pass for dy·Bᵀ.
# On the H200 neither wins everywhere (benchmarks/bench_moe.py): cat at E = 64, split at E = 256 / 896.
# dA / dB always run the Triton K-grouped kernel where Triton runs (faster than torch's K-grouped GEMM at every
# measured shape); torch's grouped GEMM (or the padded reference) elsewhere.
DX_MODES = ("cat", "split")


def check_dx(dx: str) -> str:
    if dx not in DX_MODES:
        raise ValueError(f"dx={dx!r} is not one of {DX_MODES}")
    return dx


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or _interpreting()


def padded_rank(R: int) -> int:
    """Rank columns kept in wcat / xcat: R rounded up to 8 (16-byte strides for 16-bit types)."""
    return (R + 7) // 8 * 8


# ---------------------------------------------------------------- Triton passes
@triton.jit
def _lora_in_kernel(
    x_ptr, u_ptr, idx_ptr, a_ptr, xc_ptr, h_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    I, R, RW, K, scale,
    s_xn, s_xi, s_un, s_ui, s_ae, s_ai, s_ar, s_cn, s_ci, s_hn, s_hr,
    COPY: tl.constexpr, GATHER: tl.constexpr, SWIGLU: tl.constexpr,
    IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr,
):
    """h[rows] = scale·x_n·a[e] (width RW, zeros past R); with COPY also xc[rows] = x_n, where x_n is
    x[n], or x[idx[n] // K] (GATHER: the permute gather), or silu(x[n])·u[n] (SWIGLU)."""
    pid = tl.program_id(0)
    e = tl.load(tile_expert_ptr + pid)
    if e < 0:
        return
    rows, row_ok = _tile_rows(pid, e, tile_row_ptr, offsets_ptr, BM)
    rows64 = rows.to(tl.int64)
    if GATHER:
        src64 = tl.load(idx_ptr + rows64, mask=row_ok, other=0).to(tl.int64) // K
    else:
        src64 = rows64
    rs = tl.arange(0, RP)
    r_ok = rs < R
    e64 = e.to(tl.int64)
    acc = tl.zeros([BM, RP], dtype=tl.float32)
    for k0 in range(0, I, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < I
        m = row_ok[:, None] & k_ok[None, :]
        xt = tl.load(x_ptr + src64[:, None] * s_xn + ks[None, :] * s_xi, mask=m, other=0.0)
        if SWIGLU:
            g = xt.to(tl.float32)
            u = tl.load(u_ptr + src64[:, None] * s_un + ks[None, :] * s_ui, mask=m, other=0.0).to(tl.float32)
            xt = (g * tl.sigmoid(g) * u).to(xc_ptr.dtype.element_ty)
        if COPY:
            tl.store(xc_ptr + rows64[:, None] * s_cn + ks[None, :] * s_ci, xt.to(xc_ptr.dtype.element_ty), mask=m)
        at = tl.load(a_ptr + e64 * s_ae + ks[:, None] * s_ai + rs[None, :] * s_ar,
                     mask=k_ok[:, None] & r_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(xt, at.to(xt.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(xt, at.to(xt.dtype), acc)
    acc = acc * scale
    tl.store(h_ptr + rows64[:, None] * s_hn + rs[None, :] * s_hr, acc.to(h_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (rs < RW)[None, :])


@triton.jit
def _rank_tile(g_ptr, m_ptr, r64, row_ok, e, cols, col_ok, R, s_gn, s_gr, s_me, s_mr, s_mo,
               IEEE: tl.constexpr, RP: tl.constexpr):
    """[BM, BN] fp32 g[rows, :R]·m[e][:R, cols], the rank-R term of a row tile (r64: rows as int64, [BM, 1])."""
    rs = tl.arange(0, RP)
    r_ok = rs < R
    g = tl.load(g_ptr + r64 * s_gn + rs[None, :] * s_gr, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    mt = tl.load(m_ptr + e.to(tl.int64) * s_me + rs[:, None] * s_mr + cols[None, :] * s_mo,
                 mask=r_ok[:, None] & col_ok[None, :], other=0.0)
    if IEEE:
        return tl.dot(g, mt.to(g.dtype), input_precision="ieee")
    return tl.dot(g, mt.to(g.dtype))


@triton.jit
def _lora_out_kernel(
    base_ptr, g_ptr, m_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    O, R, scale,
    s_bn, s_bo, s_gn, s_gr, s_me, s_mr, s_mo, s_on, s_oo,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr,
    base2_ptr=None, s_b2n=0, s_b2o=0, TWO: tl.constexpr = False,
):
    """out[rows] = base[rows] (+ base2[rows] when TWO) + scale·g[rows]·m[e]   (m: [R, O] per expert; out may
    alias base)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:
        return
    rows, row_ok = _tile_rows(pid_m, e, tile_row_ptr, offsets_ptr, BM)
    r64 = rows.to(tl.int64)[:, None]
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < O
    acc = _rank_tile(g_ptr, m_ptr, r64, row_ok, e, cols, col_ok, R, s_gn, s_gr, s_me, s_mr, s_mo, IEEE, RP)
    mask = row_ok[:, None] & col_ok[None, :]
    b = tl.load(base_ptr + r64 * s_bn + cols[None, :] * s_bo, mask=mask, other=0.0)
    acc = b.to(tl.float32) + acc * scale
    if TWO:
        acc += tl.load(base2_ptr + r64 * s_b2n + cols[None, :] * s_b2o, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + r64 * s_on + cols[None, :] * s_oo, acc.to(out_ptr.dtype.element_ty), mask=mask)


# GPU tiles of the folded input passes (the interpreter uses BM=16 and 32-wide blocks), from an H200 tile
# sweep (E=64, N=131072 rows): the first tiles (64 x 128, 4 warps) ran the SwiGLU-
# backward pass at 0.93 ms and the SwiGLU LoRA-in at 0.45 ms; these take 0.44 / 0.33 ms (gather LoRA-in 0.13 ms).
FOLD_TILES = {
    "in_gather": dict(BM=64, BK=128, num_warps=4, num_stages=3),
    "in_swiglu": dict(BM=128, BK=32, num_warps=8, num_stages=3),
    "swiglu_bwd": dict(BM=16, BN=128, num_warps=2, num_stages=2),
}


def _bm(N: int) -> int:
    return 16 if _interpreting() else 64


def lora_in(x_NI, a_EIR, offsets_E, scale, h_NW, xc_NI=None):
    """h_NW[:, :R] = scale·x·a_e, h_NW[:, R:] = 0; and xc_NI = x when given. Writes in place."""
    N, I = x_NI.shape
    E, _, R = a_EIR.shape
    W = h_NW.shape[1]
    if N == 0:
        return
    if not _use_triton(x_NI):
        rows = len(_rows_to_padded(offsets_E, N)[0])
        h = grouped_mm_reference(x_NI, a_EIR.to(x_NI.dtype), offsets_E)[:rows] * scale
        h_NW[:rows, :R] = h.to(h_NW.dtype)
        h_NW[:rows, R:] = 0
        if xc_NI is not None:
            xc_NI[:rows] = x_NI[:rows]
        return
    BM = _bm(N)
    expert_T, row_T = _cached_tile_map(offsets_E, N, BM)
    RP = max(16, triton.next_power_of_2(W))
    BK = 32 if _interpreting() else 128
    xc = xc_NI if xc_NI is not None else h_NW
    _lora_in_kernel[(len(expert_T),)](
        x_NI, x_NI, offsets_E, a_EIR, xc, h_NW, expert_T, row_T, offsets_E, I, R, W, 1, float(scale),
        x_NI.stride(0), x_NI.stride(1), 0, 0, *a_EIR.stride(), xc.stride(0), xc.stride(1),
        h_NW.stride(0), h_NW.stride(1),
        COPY=xc_NI is not None, GATHER=False, SWIGLU=False, IEEE=x_NI.dtype == torch.float32, BM=BM, BK=BK, RP=RP,
        **({} if _interpreting() else dict(num_warps=4, num_stages=3)),
    )


def lora_out(base_NO, g_NR, m_ERO, offsets_E, scale, out_NO, base2_NO=None):
    """out = base (+ base2) + scale·g·m_e per expert group (out may be base itself)."""
    N, O = base_NO.shape
    E, R, _ = m_ERO.shape
    if N == 0 or O == 0:
        return out_NO
    if not _use_triton(base_NO):
        rows = len(_rows_to_padded(offsets_E, N)[0])
        d = grouped_mm_reference(g_NR[:, :R], m_ERO.to(g_NR.dtype), offsets_E)[:rows].float() * scale
        if base2_NO is not None:
            d = d + base2_NO[:rows].float()
        out_NO[:rows] = (base_NO[:rows].float() + d).to(out_NO.dtype)
        return out_NO
    BM = _bm(N)
    expert_T, row_T = _cached_tile_map(offsets_E, N, BM)
    BN = 32 if _interpreting() else 128
    RP = max(16, triton.next_power_of_2(R))
    _lora_out_kernel[(triton.cdiv(O, BN), len(expert_T))](
        base_NO, g_NR, m_ERO, out_NO, expert_T, row_T, offsets_E, O, R, float(scale),
        base_NO.stride(0), base_NO.stride(1), g_NR.stride(0), g_NR.stride(1), *m_ERO.stride(),
        out_NO.stride(0), out_NO.stride(1),
        IEEE=base_NO.dtype == torch.float32, BM=BM, BN=BN, RP=RP,
        **({} if base2_NO is None else dict(base2_ptr=base2_NO, s_b2n=base2_NO.stride(0), s_b2o=base2_NO.stride(1),
                                            TWO=True)),
        **({} if _interpreting() else dict(num_warps=4, num_stages=2)),
    )
    return out_NO


# ---------------------------------------------------------------- grouped GEMMs
def _torch_gmm_ok(t: torch.Tensor) -> bool:
    if not hasattr(torch, "_grouped_mm"):
        return False
    if t.is_cuda:
        return t.dtype == torch.bfloat16
    return t.device.type == "cpu"


def gmm(x_NK, w_EKO, offsets_E):
    """y[rows of e] = x[rows of e]·w[e] (torch._grouped_mm where it runs, else the padded reference)."""
    if _torch_gmm_ok(x_NK):
        try:
            return torch._grouped_mm(x_NK, w_EKO, offs=offsets_E)
        except RuntimeError:
            if x_NK.is_cuda:
                raise
    return grouped_mm_reference(x_NK, w_EKO, offsets_E)


def kgmm(a_NI, b_NO, offsets_E, scale=1.0, out_dtype=None):
    """out[e] = scale·a[rows of e]ᵀ·b[rows of e], [E, I, O] ("K-grouped") in out_dtype (default a's dtype);
    zero for an empty expert. The Triton kernel accumulates in fp32 and rounds once into out_dtype (fp32 LoRA
    gradients straight from it, no cast); the torch forms round to a's dtype first."""
    E = len(offsets_E)
    out_dtype = out_dtype or a_NI.dtype
    if _use_triton(a_NI):
        out = torch.empty(E, a_NI.shape[1], b_NO.shape[1], dtype=out_dtype, device=a_NI.device)
        return grouped_wgrad(a_NI, b_NO, offsets_E, None, alpha=scale, out_EIO=out)
    out = None
    if _torch_gmm_ok(a_NI):
        try:
            out = torch._grouped_mm(a_NI.t(), b_NO, offs=offsets_E)
            # do not trust the kernel to write empty groups
            out = torch.where((_counts(offsets_E) > 0)[:, None, None], out, out.new_zeros(()))
        except RuntimeError:
            if a_NI.is_cuda:
                raise
    if out is None:
        N = a_NI.shape[0]
        expert_N, slot_N, C = _rows_to_padded(offsets_E, N)
        n = len(expert_N)
        a_pad = a_NI.new_zeros(E, C, a_NI.shape[1]).index_put((expert_N, slot_N), a_NI[:n])
        b_pad = b_NO.new_zeros(E, C, b_NO.shape[1]).index_put((expert_N, slot_N), b_NO[:n])
        out = torch.bmm(a_pad.transpose(1, 2), b_pad)
    if scale != 1.0:
        out = out * scale
    return out.to(out_dtype)


# ---------------------------------------------------------------- autograd
def _counts(offsets_E):
    ends = offsets_E.long()
    return ends - torch.cat([ends.new_zeros(1), ends[:-1]])


class _FusedLoRAFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI, A_EIR, B_ERO, offsets_E, scaling, w_EIO, wcat_EOJ, dx):
        N, I = x_NI.shape
        R = A_EIR.shape[2]
        J = wcat_EOJ.shape[2]
        with torch.no_grad():
            wcat_EOJ[:, :, I:I + R].copy_(B_ERO.transpose(1, 2))
        xcat_NJ = torch.empty(N, J, dtype=x_NI.dtype, device=x_NI.device)
        lora_in(x_NI, A_EIR, offsets_E, scaling, h_NW=xcat_NJ[:, I:], xc_NI=xcat_NJ[:, :I])
        y_NO = gmm(xcat_NJ, wcat_EOJ.transpose(1, 2), offsets_E)
        ctx.scaling, ctx.I, ctx.R, ctx.dx = scaling, I, R, dx
        ctx.w_dtype = w_EIO.dtype
        ctx.wcat = wcat_EOJ  # not saved_tensors: its B columns are rewritten below before use
        ctx.save_for_backward(xcat_NJ, A_EIR, B_ERO, offsets_E)
        return y_NO

    @staticmethod
    def backward(ctx, dy_NO):
        xcat_NJ, A_EIR, B_ERO, offsets_E = ctx.saved_tensors
        need_x, need_a, need_b, _, _, need_w = ctx.needs_input_grad[:6]
        s, I, R, wcat = ctx.scaling, ctx.I, ctx.R, ctx.wcat
        dy_NO = dy_NO.contiguous().to(xcat_NJ.dtype)
        N = dy_NO.shape[0]
        with torch.no_grad():
            wcat[:, :, I:I + R].copy_(B_ERO.transpose(1, 2))
        dx = dA = dB = dW = None
        if need_x or need_a:
            if ctx.dx == "cat":
                dxc_NJ = gmm(dy_NO, wcat, offsets_E)  # [dy·Wᵀ | dy·Bᵀ | 0]
                g_NR = dxc_NJ[:, I:I + R]
                if need_x:
                    dx = lora_out(dxc_NJ[:, :I], g_NR, A_EIR.transpose(1, 2), offsets_E, s,
                                  torch.empty(N, I, dtype=xcat_NJ.dtype, device=dy_NO.device))
            else:
                g_NR = torch.empty(N, padded_rank(R), dtype=xcat_NJ.dtype, device=dy_NO.device)
                lora_in(dy_NO, B_ERO.transpose(1, 2), offsets_E, 1.0, h_NW=g_NR)
                g_NR = g_NR[:, :R]
                if need_x:
                    dx = gmm(dy_NO, wcat[:, :, :I], offsets_E)
                    dx = lora_out(dx, g_NR, A_EIR.transpose(1, 2), offsets_E, s, dx)
            if need_a:
                dA = kgmm(xcat_NJ[:, :I], g_NR, offsets_E, s, A_EIR.dtype)
        if need_b:  # xcat holds s·h already
            dB = kgmm(xcat_NJ[:, I:I + R], dy_NO, offsets_E, 1.0, B_ERO.dtype)
        if need_w:
            dW = kgmm(xcat_NJ[:, :I], dy_NO, offsets_E, 1.0, ctx.w_dtype)
        return dx, dA, dB, None, None, dW, None, None


def aliases_cat(w_EIO: torch.Tensor, wcat_EOJ: torch.Tensor) -> bool:
    """True when w_EIO is exactly wcat[:, :, :I] seen as [E, I, O] (same memory, same strides)."""
    if wcat_EOJ is None or w_EIO.device != wcat_EOJ.device or w_EIO.dtype != wcat_EOJ.dtype:
        return False
    I = w_EIO.shape[1]
    view = wcat_EOJ[:, :, :I].transpose(1, 2)
    return w_EIO.shape == view.shape and w_EIO.data_ptr() == view.data_ptr() and w_EIO.stride() == view.stride()


def make_cat_buffer(w_EOI: torch.Tensor, R: int) -> torch.Tensor:
    """A fresh wcat [E, O, I + padded_rank(R)] holding w_EOI in its first I columns, zeros after."""
    E, O, I = w_EOI.shape
    wcat = torch.empty(E, O, I + padded_rank(R), dtype=w_EOI.dtype, device=w_EOI.device)
    wcat[:, :, :I].copy_(w_EOI)
    wcat[:, :, I:].zero_()  # (a whole-buffer fill first would write the weight-sized part twice)
    return wcat


def grouped_lora_fused(x_sorted_NI, A_EIR, B_ERO, offsets_E, scaling, w_EIO, w_cat=None, dx: str = "cat"):
    """grouped_lora(..., backend="fused"): base + LoRA as one grouped GEMM over [W | Bᵀ]; `dx` as DX_MODES."""
    check_dx(dx)
    R = A_EIR.shape[2]
    if w_cat is not None:
        if w_cat.shape[2] < w_EIO.shape[1] + R:
            raise ValueError(f"grouped_lora: w_cat {tuple(w_cat.shape)} has no room for rank {R}")
        if not aliases_cat(w_EIO, w_cat):
            raise ValueError("grouped_lora: w_EIO must be w_cat[:, :, :I].transpose(1, 2) (same memory)")
    else:  # per-call copy of the base weight: correct, not the fast path
        w_cat = make_cat_buffer(w_EIO.detach().transpose(1, 2).to(x_sorted_NI.dtype), R)
    if w_cat.dtype != x_sorted_NI.dtype:
        raise ValueError(f"grouped_lora: w_cat is {w_cat.dtype} but x is {x_sorted_NI.dtype}")
    A = A_EIR.to(x_sorted_NI.dtype)
    B = B_ERO.to(x_sorted_NI.dtype)
    return _FusedLoRAFn.apply(x_sorted_NI, A, B, offsets_E, float(scaling), w_EIO, w_cat, dx)


# ---------------------------------------------------------------- folded input passes
# The LoRA-in pass has to read every input row once anyway; these variants let it read the rows from
# where they already are instead of from a materialised copy (`_lora_in_kernel` with GATHER or SWIGLU):
#   gather  (gate/up): x[n] = z[row_index[n] // K]  (the permute gather: z_NL is never written)
#   swiglu  (down):    x[n] = silu(gate[n])·up[n]   (the SwiGLU product: h_NF is only written inside xcat)
# Backward: gather -> the usual dx epilogue, then the combine (Σ over the top-k copies, weights 1);
# swiglu -> one pass reading [dy·Wᵀ | dy·Bᵀ], A, gate and up, writing d(gate) and d(up).
@triton.jit
def _fold_swiglu_bwd_kernel(
    base_ptr, g_ptr, a_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    F, R, scale,
    s_bn, s_bf, s_gn, s_gr, s_ae, s_af, s_ar, s_xn, s_xf, s_un, s_uf, s_dn, s_df, s_en, s_ef,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr,
):
    """dh = base + scale·g·a[e]ᵀ, then the SwiGLU backward: d(gate) = dh·up·σ·(1 + gate·(1 − σ)),
    d(up) = dh·silu(gate)   (σ = sigmoid(gate); all in fp32, dh never stored)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:
        return
    rows, row_ok = _tile_rows(pid_m, e, tile_row_ptr, offsets_ptr, BM)
    r64 = rows.to(tl.int64)[:, None]
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < F
    dh = _rank_tile(g_ptr, a_ptr, r64, row_ok, e, cols, col_ok, R, s_gn, s_gr, s_ae, s_ar, s_af, IEEE, RP)
    mask = row_ok[:, None] & col_ok[None, :]
    c = cols[None, :]
    dh = tl.load(base_ptr + r64 * s_bn + c * s_bf, mask=mask, other=0.0).to(tl.float32) + dh * scale
    x = tl.load(gate_ptr + r64 * s_xn + c * s_xf, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + r64 * s_un + c * s_uf, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(x)
    dg = dh * u * sig * (1.0 + x * (1.0 - sig))
    du = dh * x * sig
    tl.store(dgate_ptr + r64 * s_dn + c * s_df, dg.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + r64 * s_en + c * s_ef, du.to(dup_ptr.dtype.element_ty), mask=mask)


def fold_in(x, a_EIR, offsets_E, scale, xcat_NJ, *, row_index_N=None, K=1, up_NI=None):
    """xcat[:, :I] = x_n, xcat[:, I:] = [scale·x_n·a_e | 0] for the sorted rows n, where x_n is
    x[row_index[n] // K] (gather; x = z_TI) or silu(x[n])·up[n] (swiglu; x = gate_NI)."""
    swiglu = up_NI is not None
    if (row_index_N is not None) == swiglu:
        raise ValueError("fold_in: give exactly one of row_index_N (gather) and up_NI (swiglu)")
    N, J = xcat_NJ.shape
    I = x.shape[1]
    E, _, R = a_EIR.shape
    W = J - I
    if N == 0:
        return
    if not _use_triton(x):
        if swiglu:
            rows_x = (torch.nn.functional.silu(x.float()) * up_NI.float()).to(xcat_NJ.dtype)
        else:
            rows_x = x[row_index_N // K].to(xcat_NJ.dtype)
        lora_in(rows_x, a_EIR, offsets_E, scale, h_NW=xcat_NJ[:, I:], xc_NI=xcat_NJ[:, :I])
        return
    tile = FOLD_TILES["in_swiglu" if swiglu else "in_gather"]
    BM = _bm(N) if _interpreting() else tile["BM"]
    expert_T, row_T = _cached_tile_map(offsets_E, N, BM)
    RP = max(16, triton.next_power_of_2(W))
    BK = 32 if _interpreting() else tile["BK"]
    u = up_NI if swiglu else x
    idx = row_index_N if not swiglu else offsets_E
    xc, h = xcat_NJ[:, :I], xcat_NJ[:, I:]
    _lora_in_kernel[(len(expert_T),)](
        x, u, idx, a_EIR, xc, h, expert_T, row_T, offsets_E, I, R, W, K, float(scale),
        x.stride(0), x.stride(1), u.stride(0), u.stride(1), *a_EIR.stride(), xc.stride(0), xc.stride(1),
        h.stride(0), h.stride(1),
        COPY=True, GATHER=not swiglu, SWIGLU=swiglu, IEEE=xcat_NJ.dtype == torch.float32, BM=BM, BK=BK, RP=RP,
        **({} if _interpreting() else dict(num_warps=tile["num_warps"], num_stages=tile["num_stages"])),
    )


def fold_swiglu_bwd(base_NF, g_NR, a_EFR, offsets_E, scale, gate_NF, up_NF, dgate_NF, dup_NF):
    """dh = base + scale·g·a_eᵀ per expert group; writes the SwiGLU backward of dh into dgate / dup."""
    N, F = gate_NF.shape
    R = a_EFR.shape[2]
    if N == 0 or F == 0:
        return
    if not _use_triton(base_NF):
        rows = len(_rows_to_padded(offsets_E, N)[0])
        d = grouped_mm_reference(g_NR[:rows, :R], a_EFR.transpose(1, 2).to(g_NR.dtype), offsets_E)
        dh = base_NF[:rows].float() + d.float() * scale
        x, u = gate_NF[:rows].float(), up_NF[:rows].float()
        sig = torch.sigmoid(x)
        dgate_NF[:rows] = (dh * u * sig * (1 + x * (1 - sig))).to(dgate_NF.dtype)
        dup_NF[:rows] = (dh * x * sig).to(dup_NF.dtype)
        return
    tile = FOLD_TILES["swiglu_bwd"]
    BM = _bm(N) if _interpreting() else tile["BM"]
    expert_T, row_T = _cached_tile_map(offsets_E, N, BM)
    BN = 32 if _interpreting() else tile["BN"]
    RP = max(16, triton.next_power_of_2(R))
    ts = (base_NF, g_NR, a_EFR, gate_NF, up_NF, dgate_NF, dup_NF)
    strides = [s for t in ts for s in t.stride()]
    _fold_swiglu_bwd_kernel[(triton.cdiv(F, BN), len(expert_T))](
        *ts, expert_T, row_T, offsets_E, F, R, float(scale), *strides,
        IEEE=base_NF.dtype == torch.float32, BM=BM, BN=BN, RP=RP,
        **({} if _interpreting() else dict(num_warps=tile["num_warps"], num_stages=tile["num_stages"])),
    )


def _dx_parts(dy_NO, wcat, B_ERO, offsets_E, I, R, need_x, dx):
    """(dy·W_eᵀ or None, dy·B_eᵀ [N, R]) by `dx`: one GEMM on [W | Bᵀ] ("cat"), or base GEMM + thin pass."""
    if dx == "cat":
        dxc_NJ = gmm(dy_NO, wcat, offsets_E)
        return dxc_NJ[:, :I], dxc_NJ[:, I:I + R]
    g_NW = torch.empty(dy_NO.shape[0], padded_rank(R), dtype=dy_NO.dtype, device=dy_NO.device)
    lora_in(dy_NO, B_ERO.transpose(1, 2).to(dy_NO.dtype), offsets_E, 1.0, h_NW=g_NW)
    return (gmm(dy_NO, wcat[:, :, :I], offsets_E) if need_x else None), g_NW[:, :R]


def _lora_wgrads(ctx, xcat_NJ, g_NR, dy_NO, offsets_E, need_a, need_b, A_dtype, B_dtype):
    I, R, s = ctx.I, ctx.R, ctx.scaling
    dA = kgmm(xcat_NJ[:, :I], g_NR, offsets_E, s, A_dtype) if need_a else None
    dB = kgmm(xcat_NJ[:, I:I + R], dy_NO, offsets_E, 1.0, B_dtype) if need_b else None
    return dA, dB


class _FoldGatherFn(torch.autograd.Function):
    """y = [z[row_index // K] | s·z[row_index // K]·A_e] · wcat_eᵀ; dz in token order."""

    @staticmethod
    def forward(ctx, z_TI, A_EIR, B_ERO, row_index_N, offsets_E, K, scaling, wcat_EOJ, dx):
        T, I = z_TI.shape
        N, R, J = row_index_N.shape[0], A_EIR.shape[2], wcat_EOJ.shape[2]
        with torch.no_grad():
            wcat_EOJ[:, :, I:I + R].copy_(B_ERO.transpose(1, 2))
        xcat_NJ = torch.empty(N, J, dtype=z_TI.dtype, device=z_TI.device)
        fold_in(z_TI, A_EIR, offsets_E, scaling, xcat_NJ, row_index_N=row_index_N, K=K)
        y_NO = gmm(xcat_NJ, wcat_EOJ.transpose(1, 2), offsets_E)
        ctx.scaling, ctx.I, ctx.R, ctx.K, ctx.T, ctx.dx = scaling, I, R, K, T, dx
        ctx.wcat = wcat_EOJ
        ctx.save_for_backward(xcat_NJ, A_EIR, B_ERO, row_index_N, offsets_E)
        return y_NO

    @staticmethod
    def backward(ctx, dy_NO):
        xcat_NJ, A_EIR, B_ERO, row_index_N, offsets_E = ctx.saved_tensors
        need_z, need_a, need_b = ctx.needs_input_grad[:3]
        s, I, R, wcat = ctx.scaling, ctx.I, ctx.R, ctx.wcat
        dy_NO = dy_NO.contiguous().to(xcat_NJ.dtype)
        N = dy_NO.shape[0]
        with torch.no_grad():
            wcat[:, :, I:I + R].copy_(B_ERO.transpose(1, 2))
        dz = g_NR = None
        if need_z or need_a:
            base_NI, g_NR = _dx_parts(dy_NO, wcat, B_ERO, offsets_E, I, R, need_z, ctx.dx)
            if need_z:
                dx_NI = lora_out(base_NI, g_NR, A_EIR.transpose(1, 2), offsets_E, s,
                                 torch.empty(N, I, dtype=xcat_NJ.dtype, device=dy_NO.device))
                dz = _combine_copies(dx_NI, row_index_N, ctx.K, ctx.T)
        dA, dB = _lora_wgrads(ctx, xcat_NJ, g_NR, dy_NO, offsets_E, need_a, need_b, A_EIR.dtype, B_ERO.dtype)
        return dz, dA, dB, None, None, None, None, None, None


def _combine_copies(dx_NI, row_index_N, K, T):
    """dz[t] = Σ_k dx[row of (t, k)] (fp32 accumulation; dropped choices add nothing)."""
    if _use_triton(dx_NI):
        from .triton_permute import combine_rows, inverse_index

        return combine_rows(dx_NI, inverse_index(row_index_N, T * K), K)
    out = torch.zeros(T, dx_NI.shape[1], dtype=torch.float32, device=dx_NI.device)
    return out.index_add_(0, row_index_N // K, dx_NI.float()).to(dx_NI.dtype)


class _FoldSwiGLUFn(torch.autograd.Function):
    """y = [h | s·h·A_e] · wcat_eᵀ with h = silu(gate)·up; packed: gate, up = gate_up[:, :F], [:, F:]."""

    @staticmethod
    def forward(ctx, gate, up, A_EIR, B_ERO, offsets_E, scaling, wcat_EOJ, dx):
        packed = up is None
        if packed:
            F = gate.shape[1] // 2
            gate_NF, up_NF = gate[:, :F], gate[:, F:]
        else:
            gate_NF, up_NF = gate, up
        N, F = gate_NF.shape
        R, J = A_EIR.shape[2], wcat_EOJ.shape[2]
        with torch.no_grad():
            wcat_EOJ[:, :, F:F + R].copy_(B_ERO.transpose(1, 2))
        xcat_NJ = torch.empty(N, J, dtype=gate.dtype, device=gate.device)
        fold_in(gate_NF, A_EIR, offsets_E, scaling, xcat_NJ, up_NI=up_NF)
        y_NO = gmm(xcat_NJ, wcat_EOJ.transpose(1, 2), offsets_E)
        ctx.scaling, ctx.I, ctx.R, ctx.packed, ctx.dx = scaling, F, R, packed, dx
        ctx.wcat = wcat_EOJ
        ctx.save_for_backward(xcat_NJ, A_EIR, B_ERO, offsets_E, gate, up)
        return y_NO

    @staticmethod
    def backward(ctx, dy_NO):
        xcat_NJ, A_EIR, B_ERO, offsets_E, gate, up = ctx.saved_tensors
        need_g, need_u, need_a, need_b = ctx.needs_input_grad[:4]
        s, F, R, wcat = ctx.scaling, ctx.I, ctx.R, ctx.wcat
        dy_NO = dy_NO.contiguous().to(xcat_NJ.dtype)
        with torch.no_grad():
            wcat[:, :, F:F + R].copy_(B_ERO.transpose(1, 2))
        need_x = need_g or need_u
        dg = du = g_NR = None
        if need_x or need_a:
            base_NF, g_NR = _dx_parts(dy_NO, wcat, B_ERO, offsets_E, F, R, need_x, ctx.dx)
            if need_x:
                if ctx.packed:
                    dg = torch.empty_like(gate)
                    gate_NF, up_NF, dgate, dup = gate[:, :F], gate[:, F:], dg[:, :F], dg[:, F:]
                else:
                    dg, du = torch.empty_like(gate), torch.empty_like(up)
                    gate_NF, up_NF, dgate, dup = gate, up, dg, du
                fold_swiglu_bwd(base_NF, g_NR, A_EIR, offsets_E, s, gate_NF, up_NF, dgate, dup)
        dA, dB = _lora_wgrads(ctx, xcat_NJ, g_NR, dy_NO, offsets_E, need_a, need_b, A_EIR.dtype, B_ERO.dtype)
        return dg, du, dA, dB, None, None, None, None


def _fold_cat(w_EIO, w_cat, R, dtype):
    if w_cat is not None:
        if w_cat.shape[2] < w_EIO.shape[1] + R:
            raise ValueError(f"grouped_lora: w_cat {tuple(w_cat.shape)} has no room for rank {R}")
        if not aliases_cat(w_EIO, w_cat):
            raise ValueError("grouped_lora: w_EIO must be w_cat[:, :, :I].transpose(1, 2) (same memory)")
    else:
        w_cat = make_cat_buffer(w_EIO.detach().transpose(1, 2).to(dtype), R)
    if w_cat.dtype != dtype:
        raise ValueError(f"grouped_lora: w_cat is {w_cat.dtype} but the activations are {dtype}")
    return w_cat


def grouped_lora_fused_gather(z_TI, row_index_N, K, A_EIR, B_ERO, offsets_E, scaling, w_EIO, w_cat=None,
                              dx: str = "cat"):
    """grouped_lora_fused(z[row_index // K], ...) without materialising the permuted rows.

    z_TI: [T, I] token-major input; row_index_N, K: permute's flat choice index of each sorted row and
    the top-k. Returns y_NO (sorted rows); the gradient of z comes back in token order (Σ over copies).
    The base weight is frozen here (no dW); `dx` as DX_MODES."""
    check_dx(dx)
    if w_EIO.requires_grad:
        raise ValueError("grouped_lora_fused_gather: the base weight must be frozen")
    if z_TI.shape[1] != w_EIO.shape[1]:
        raise ValueError(f"grouped_lora_fused_gather: z {tuple(z_TI.shape)} vs w_EIO {tuple(w_EIO.shape)}")
    w_cat = _fold_cat(w_EIO, w_cat, A_EIR.shape[2], z_TI.dtype)
    A, B = A_EIR.to(z_TI.dtype), B_ERO.to(z_TI.dtype)
    return _FoldGatherFn.apply(z_TI, A, B, row_index_N, offsets_E, int(K), float(scaling), w_cat, dx)


def grouped_lora_fused_swiglu(gate, up, A_EIR, B_ERO, offsets_E, scaling, w_EIO, w_cat=None, dx: str = "cat"):
    """grouped_lora_fused(silu(gate)·up, ...) without materialising the SwiGLU product.

    gate, up: [N, F] each, or up=None and gate = gate_up [N, 2F] (gate first); its gradient then comes
    back as one [N, 2F] tensor. The base weight is frozen here (no dW); `dx` as DX_MODES."""
    check_dx(dx)
    if w_EIO.requires_grad:
        raise ValueError("grouped_lora_fused_swiglu: the base weight must be frozen")
    F = gate.shape[1] // 2 if up is None else gate.shape[1]
    if (up is not None and up.shape != gate.shape) or F != w_EIO.shape[1]:
        raise ValueError(f"grouped_lora_fused_swiglu: gate {tuple(gate.shape)}, up "
                         f"{None if up is None else tuple(up.shape)} vs w_EIO {tuple(w_EIO.shape)}")
    w_cat = _fold_cat(w_EIO, w_cat, A_EIR.shape[2], gate.dtype)
    A, B = A_EIR.to(gate.dtype), B_ERO.to(gate.dtype)
    return _FoldSwiGLUFn.apply(gate, up, A, B, offsets_E, float(scaling), w_cat, dx)
