"""Fused SwiGLU for the expert MLP: a = silu(g)·u, from the fused gate/up GEMM output [N, 2F] or from separate
gate and up tensors [N, F] (the model's w1 / w3).

Owns the kernels behind `swiglu(..., backend="triton")` and `swiglu_pair`. Forward reads gate and up once and
writes a; backward recomputes silu from the saved gate and up (saves 2F per row instead of autograd's 3F) and
writes d(gate), d(up) in one pass. Math in fp32, storage in the input dtype.

Shape suffixes: N rows, F expert hidden width (packed: gate = columns [0, F), up = [F, 2F)).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _swiglu_fwd_kernel(g_ptr, u_ptr, a_ptr, N, F, s_g, s_u, BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < N)[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + rows64 * s_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows64 * s_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    a = g * tl.sigmoid(g) * u
    tl.store(a_ptr + rows64 * F + cols[None, :], a.to(a_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(g_ptr, u_ptr, da_ptr, dg_ptr, du_ptr, N, F, s_g, s_u, s_dg, s_du,
                       BLOCK_R: tl.constexpr, BLOCK_F: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_F + tl.arange(0, BLOCK_F)
    mask = (rows < N)[:, None] & (cols < F)[None, :]
    rows64 = rows.to(tl.int64)[:, None]
    g = tl.load(g_ptr + rows64 * s_g + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rows64 * s_u + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    da = tl.load(da_ptr + rows64 * F + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    dg = da * u * sig * (1.0 + g * (1.0 - sig))
    du = da * silu
    tl.store(dg_ptr + rows64 * s_dg + cols[None, :], dg.to(dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + rows64 * s_du + cols[None, :], du.to(du_ptr.dtype.element_ty), mask=mask)


def _launch(kernel, N, F, *args):
    BLOCK_F = min(triton.next_power_of_2(max(F, 1)), 256)
    BLOCK_R = max(1, 2048 // BLOCK_F)
    if N > 0 and F > 0:
        kernel[(triton.cdiv(N, BLOCK_R), triton.cdiv(F, BLOCK_F))](*args, BLOCK_R=BLOCK_R, BLOCK_F=BLOCK_F)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with unit column stride (a view when it already has one)."""
    return t if t.stride(1) == 1 else t.contiguous()


class _SwiGLUFn(torch.autograd.Function):
    """a = silu(g)·u; packed (u None: g is [N, 2F]) or a pair of [N, F] tensors."""

    @staticmethod
    def forward(ctx, g, u):
        ctx.packed = u is None
        if ctx.packed:
            gu = g.contiguous()
            F = gu.shape[1] // 2
            g_NF, u_NF = gu[:, :F], gu[:, F:]
            ctx.save_for_backward(gu)
        else:
            g_NF, u_NF = _rows(g), _rows(u)
            ctx.save_for_backward(g_NF, u_NF)
        N, F = g_NF.shape
        a_NF = torch.empty(N, F, dtype=g_NF.dtype, device=g_NF.device)
        _launch(_swiglu_fwd_kernel, N, F, g_NF, u_NF, a_NF, N, F, g_NF.stride(0), u_NF.stride(0))
        return a_NF

    @staticmethod
    def backward(ctx, da_NF):
        if ctx.packed:
            (gu,) = ctx.saved_tensors
            F = gu.shape[1] // 2
            g_NF, u_NF = gu[:, :F], gu[:, F:]
            dgu = torch.empty_like(gu)
            dg_NF, du_NF = dgu[:, :F], dgu[:, F:]
        else:
            g_NF, u_NF = ctx.saved_tensors
            dg_NF, du_NF = torch.empty_like(g_NF), torch.empty_like(u_NF)
        N, F = g_NF.shape
        _launch(_swiglu_bwd_kernel, N, F, g_NF, u_NF, da_NF.contiguous(), dg_NF, du_NF, N, F,
                g_NF.stride(0), u_NF.stride(0), dg_NF.stride(0), du_NF.stride(0))
        return (dgu, None) if ctx.packed else (dg_NF, du_NF)


def swiglu_triton(gate_up_NF2: torch.Tensor) -> torch.Tensor:
    return _SwiGLUFn.apply(gate_up_NF2, None)


def swiglu_pair_triton(gate_NF: torch.Tensor, up_NF: torch.Tensor) -> torch.Tensor:
    return _SwiGLUFn.apply(gate_NF, up_NF)
