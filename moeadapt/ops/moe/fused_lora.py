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
from .triton_grouped_mm import _cached_tile_map, grouped_wgrad

# Variants measured by benchmarks/bench_moe.py; module-level so the bench can switch them.
#   dx:    "cat"   = one GEMM against the whole wcat gives dy·Wᵀ and dy·Bᵀ together
#          "split" = GEMM on the base columns + a thin Triton pass for dy·Bᵀ, then dx += in place
#   wgrad: "torch" = torch._grouped_mm K-grouped (2d x 2d with offsets) for dA, dB
#          "triton"= our grouped_wgrad kernel
CONFIG = dict(dx="cat", wgrad="triton")  # H200 call 3: Triton dA/dB ("twg") fastest at every case


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
    x_ptr, a_ptr, xc_ptr, h_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    I, R, RW, scale,
    s_xn, s_xi, s_ae, s_ai, s_ar, s_cn, s_ci, s_hn, s_hr,
    COPY: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr,
):
    """h[rows] = scale·x[rows]·a[e] (width RW, zeros past R); with COPY also xc[rows] = x[rows]."""
    pid = tl.program_id(0)
    e = tl.load(tile_expert_ptr + pid)
    if e < 0:
        return
    row0 = tl.load(tile_row_ptr + pid)
    row_end = tl.load(offsets_ptr + e)
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < row_end
    rows64 = rows.to(tl.int64)
    rs = tl.arange(0, RP)
    r_ok = rs < R
    e64 = e.to(tl.int64)
    acc = tl.zeros([BM, RP], dtype=tl.float32)
    for k0 in range(0, I, BK):
        ks = k0 + tl.arange(0, BK)
        k_ok = ks < I
        m = row_ok[:, None] & k_ok[None, :]
        xt = tl.load(x_ptr + rows64[:, None] * s_xn + ks[None, :] * s_xi, mask=m, other=0.0)
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
def _lora_out_kernel(
    base_ptr, g_ptr, m_ptr, out_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    O, R, scale,
    s_bn, s_bo, s_gn, s_gr, s_me, s_mr, s_mo, s_on, s_oo,
    IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr,
):
    """out[rows] = base[rows] + scale·g[rows]·m[e]   (m: [R, O] per expert; out may alias base)."""
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:
        return
    row0 = tl.load(tile_row_ptr + pid_m)
    row_end = tl.load(offsets_ptr + e)
    rows = row0 + tl.arange(0, BM)
    row_ok = rows < row_end
    rows64 = rows.to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < O
    rs = tl.arange(0, RP)
    r_ok = rs < R
    g = tl.load(g_ptr + rows64[:, None] * s_gn + rs[None, :] * s_gr, mask=row_ok[:, None] & r_ok[None, :], other=0.0)
    mt = tl.load(m_ptr + e.to(tl.int64) * s_me + rs[:, None] * s_mr + cols[None, :] * s_mo,
                 mask=r_ok[:, None] & col_ok[None, :], other=0.0)
    if IEEE:
        acc = tl.dot(g, mt.to(g.dtype), input_precision="ieee")
    else:
        acc = tl.dot(g, mt.to(g.dtype))
    mask = row_ok[:, None] & col_ok[None, :]
    b = tl.load(base_ptr + rows64[:, None] * s_bn + cols[None, :] * s_bo, mask=mask, other=0.0)
    acc = b.to(tl.float32) + acc * scale
    tl.store(out_ptr + rows64[:, None] * s_on + cols[None, :] * s_oo, acc.to(out_ptr.dtype.element_ty), mask=mask)


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
        x_NI, a_EIR, xc, h_NW, expert_T, row_T, offsets_E, I, R, W, float(scale),
        x_NI.stride(0), x_NI.stride(1), *a_EIR.stride(), xc.stride(0), xc.stride(1), h_NW.stride(0), h_NW.stride(1),
        COPY=xc_NI is not None, IEEE=x_NI.dtype == torch.float32, BM=BM, BK=BK, RP=RP,
        **({} if _interpreting() else dict(num_warps=4, num_stages=3)),
    )


def lora_out(base_NO, g_NR, m_ERO, offsets_E, scale, out_NO):
    """out = base + scale·g·m_e per expert group (out may be base itself)."""
    N, O = base_NO.shape
    E, R, _ = m_ERO.shape
    if N == 0 or O == 0:
        return out_NO
    if not _use_triton(base_NO):
        rows = len(_rows_to_padded(offsets_E, N)[0])
        d = grouped_mm_reference(g_NR[:, :R], m_ERO.to(g_NR.dtype), offsets_E)[:rows]
        out_NO[:rows] = (base_NO[:rows].float() + d.float() * scale).to(out_NO.dtype)
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


def kgmm(a_NI, b_NO, offsets_E, counts_E=None):
    """out[e] = a[rows of e]ᵀ·b[rows of e], [E, I, O] ("K-grouped"); zero for an empty expert."""
    E = len(offsets_E)
    if CONFIG["wgrad"] == "triton" and _use_triton(a_NI):
        like = torch.empty(E, a_NI.shape[1], b_NO.shape[1], dtype=a_NI.dtype, device=a_NI.device)
        return grouped_wgrad(a_NI, b_NO, offsets_E, like)
    if _torch_gmm_ok(a_NI):
        try:
            out = torch._grouped_mm(a_NI.t(), b_NO, offs=offsets_E)
            if counts_E is not None:  # do not trust the kernel to write empty groups
                out = torch.where((counts_E > 0)[:, None, None], out, out.new_zeros(()))
            return out
        except RuntimeError:
            if a_NI.is_cuda:
                raise
    N = a_NI.shape[0]
    expert_N, slot_N, C = _rows_to_padded(offsets_E, N)
    n = len(expert_N)
    a_pad = a_NI.new_zeros(E, C, a_NI.shape[1]).index_put((expert_N, slot_N), a_NI[:n])
    b_pad = b_NO.new_zeros(E, C, b_NO.shape[1]).index_put((expert_N, slot_N), b_NO[:n])
    return torch.bmm(a_pad.transpose(1, 2), b_pad)


# ---------------------------------------------------------------- autograd
def _counts(offsets_E):
    ends = offsets_E.long()
    return ends - torch.cat([ends.new_zeros(1), ends[:-1]])


class _FusedLoRAFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI, A_EIR, B_ERO, offsets_E, scaling, w_EIO, wcat_EOJ):
        N, I = x_NI.shape
        R = A_EIR.shape[2]
        J = wcat_EOJ.shape[2]
        with torch.no_grad():
            wcat_EOJ[:, :, I:I + R].copy_(B_ERO.transpose(1, 2))
        xcat_NJ = torch.empty(N, J, dtype=x_NI.dtype, device=x_NI.device)
        lora_in(x_NI, A_EIR, offsets_E, scaling, h_NW=xcat_NJ[:, I:], xc_NI=xcat_NJ[:, :I])
        y_NO = gmm(xcat_NJ, wcat_EOJ.transpose(1, 2), offsets_E)
        ctx.scaling, ctx.I, ctx.R = scaling, I, R
        ctx.w_dtype = w_EIO.dtype
        ctx.wcat = wcat_EOJ  # not saved_tensors: its B columns are rewritten below before use
        ctx.save_for_backward(xcat_NJ, A_EIR, B_ERO, offsets_E)
        return y_NO

    @staticmethod
    def backward(ctx, dy_NO):
        xcat_NJ, A_EIR, B_ERO, offsets_E = ctx.saved_tensors
        need_x, need_a, need_b, _, _, need_w, _ = ctx.needs_input_grad
        s, I, R, wcat = ctx.scaling, ctx.I, ctx.R, ctx.wcat
        dy_NO = dy_NO.contiguous().to(xcat_NJ.dtype)
        N = dy_NO.shape[0]
        counts_E = _counts(offsets_E)
        with torch.no_grad():
            wcat[:, :, I:I + R].copy_(B_ERO.transpose(1, 2))
        dx = dA = dB = dW = None
        if need_x or need_a:
            if CONFIG["dx"] == "cat":
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
                dA = (kgmm(xcat_NJ[:, :I], g_NR, offsets_E, counts_E) * s).to(A_EIR.dtype)
        if need_b:  # xcat holds s·h already
            dB = kgmm(xcat_NJ[:, I:I + R], dy_NO, offsets_E, counts_E).to(B_ERO.dtype)
        if need_w:
            dW = kgmm(xcat_NJ[:, :I], dy_NO, offsets_E, counts_E).to(ctx.w_dtype)
        return dx, dA, dB, None, None, dW, None


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
    wcat = torch.zeros(E, O, I + padded_rank(R), dtype=w_EOI.dtype, device=w_EOI.device)
    wcat[:, :, :I].copy_(w_EOI)
    return wcat


def grouped_lora_fused(x_sorted_NI, A_EIR, B_ERO, offsets_E, scaling, w_EIO, w_cat=None):
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
    return _FusedLoRAFn.apply(x_sorted_NI, A, B, offsets_E, float(scaling), w_EIO, w_cat)
