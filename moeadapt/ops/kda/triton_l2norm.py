"""L2 normalisation of KDA's q and k over the head dim: one Triton pass each way, both tensors in one launch.

Owns the kernels behind `chunk_kda_triton(..., use_qk_l2norm=True)` and their registration as the torch.library
custom ops `moeadapt::l2norm_qk_fwd` / `_bwd` (`l2norm_qk_fwd_fast` skips the op's dispatch in plain eager mode,
ops/custom.py). The math is `reference.l2norm`, y = x / sqrt(sum(x^2) + eps) over the last dim, computed in fp32
and stored in x's dtype. The forward also writes each row's r = 1 / sqrt(sum(x^2) + eps) (fp32), so that the
backward, dx = r (dy - y sum(dy y)) with y = x r, reads x, r and dy only. The PyTorch composition it replaces ran
a cast, a square, a sum, an rsqrt, a product and a cast back per tensor, twice as many kernels backward, and saved
fp32 copies of q and k for its backward.

Shape suffixes: N rows (batch x time x heads), D the head dim (contiguous).
No `from __future__ import annotations` here: torch.library infers the op schemas from real annotations.
"""

import torch
import triton
import triton.language as tl

from ..custom import eager_or_op, impl_or_op
from .reference import L2_EPS

# Launch shape: 32 rows a program (a [2, 4096, 16, 128] tensor is 4096 programs per tensor), 4 warps.
BLOCK_R = 32
NUM_WARPS = 4


@triton.jit
def _tile(row0, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """Rows [row0, row0 + BR) of an [N, D] tensor: (rows, their mask, the tile's mask, its element offsets)."""
    rows = row0 + tl.arange(0, BR)
    cols = tl.arange(0, BD)
    rm = rows < N
    return rows, rm, rm[:, None] & (cols < D)[None, :], rows.to(tl.int64)[:, None] * D + cols[None, :]


@triton.jit
def _fwd_rows(x, y, r, row0, N, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    rows, rm, m, off = _tile(row0, N, D, BD, BR)
    v = tl.load(x + off, mask=m, other=0.0).to(tl.float32)
    rs = 1.0 / tl.sqrt_rn(tl.sum(v * v, axis=1) + eps)
    tl.store(y + off, (v * rs[:, None]).to(y.dtype.element_ty), mask=m)
    tl.store(r + rows, rs, mask=rm)


@triton.jit
def _l2norm_fwd_kernel(x0, y0, r0, N0, x1, y1, r1, N1, eps, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    """Grid (row blocks, 2): axis 1 picks the tensor (q, k)."""
    row0 = tl.program_id(0) * BR
    if tl.program_id(1) == 0:
        _fwd_rows(x0, y0, r0, row0, N0, eps, D, BD, BR)
    else:
        _fwd_rows(x1, y1, r1, row0, N1, eps, D, BD, BR)


@triton.jit
def _bwd_rows(x, r, dy, dx, row0, N, D: tl.constexpr, BD: tl.constexpr, BR: tl.constexpr):
    rows, rm, m, off = _tile(row0, N, D, BD, BR)
    rs = tl.load(r + rows, mask=rm, other=0.0)
    y = tl.load(x + off, mask=m, other=0.0).to(tl.float32) * rs[:, None]
    g = tl.load(dy + off, mask=m, other=0.0).to(tl.float32)
    proj = tl.sum(g * y, axis=1)
    tl.store(dx + off, (rs[:, None] * (g - y * proj[:, None])).to(dx.dtype.element_ty), mask=m)


@triton.jit
def _l2norm_bwd_kernel(x0, r0, dy0, dx0, N0, x1, r1, dy1, dx1, N1, D: tl.constexpr, BD: tl.constexpr,
                       BR: tl.constexpr):
    row0 = tl.program_id(0) * BR
    if tl.program_id(1) == 0:
        _bwd_rows(x0, r0, dy0, dx0, row0, N0, D, BD, BR)
    else:
        _bwd_rows(x1, r1, dy1, dx1, row0, N1, D, BD, BR)


def _grid(q: torch.Tensor, k: torch.Tensor) -> tuple[int, int]:
    D = q.shape[-1]
    return (triton.cdiv(max(q.numel(), k.numel()) // D, BLOCK_R), 2)


def _l2norm_qk_fwd_impl(q: torch.Tensor, k: torch.Tensor,
                        eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q / |q|, k / |k|) over the last dim in q's / k's dtypes, and the per-row 1 / |x| (fp32, q's and k's shapes
    without the last dim) that the backward reads; |x| = sqrt(sum(x^2) + eps). q and k share the last dim."""
    q, k = q.contiguous(), k.contiguous()
    D = q.shape[-1]
    qn, kn = torch.empty_like(q), torch.empty_like(k)
    rq = torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32)
    rk = torch.empty(k.shape[:-1], device=k.device, dtype=torch.float32)
    if q.numel() or k.numel():
        _l2norm_fwd_kernel[_grid(q, k)](q, qn, rq, q.numel() // D, k, kn, rk, k.numel() // D, float(eps), D=D,
                                        BD=triton.next_power_of_2(D), BR=BLOCK_R, num_warps=NUM_WARPS)
    return qn, kn, rq, rk


l2norm_qk_fwd = torch.library.custom_op("moeadapt::l2norm_qk_fwd", mutates_args=())(_l2norm_qk_fwd_impl)


@l2norm_qk_fwd.register_fake
def _(q: torch.Tensor, k: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    return (torch.empty(q.shape, device=q.device, dtype=q.dtype), torch.empty(k.shape, device=k.device, dtype=k.dtype),
            torch.empty(q.shape[:-1], device=q.device, dtype=torch.float32),
            torch.empty(k.shape[:-1], device=k.device, dtype=torch.float32))


def _l2norm_qk_bwd_impl(q: torch.Tensor, k: torch.Tensor, rq: torch.Tensor, rk: torch.Tensor, dqn: torch.Tensor,
                        dkn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dk) of l2norm_qk_fwd for the output gradients dqn, dkn, in q's / k's dtypes."""
    q, k, dqn, dkn = q.contiguous(), k.contiguous(), dqn.contiguous(), dkn.contiguous()
    D = q.shape[-1]
    dq, dk = torch.empty_like(q), torch.empty_like(k)
    if q.numel() or k.numel():
        _l2norm_bwd_kernel[_grid(q, k)](q, rq, dqn, dq, q.numel() // D, k, rk, dkn, dk, k.numel() // D, D=D,
                                        BD=triton.next_power_of_2(D), BR=BLOCK_R, num_warps=NUM_WARPS)
    return dq, dk


l2norm_qk_bwd = torch.library.custom_op("moeadapt::l2norm_qk_bwd", mutates_args=())(_l2norm_qk_bwd_impl)
l2norm_qk_bwd_fast = impl_or_op(l2norm_qk_bwd, _l2norm_qk_bwd_impl)  # the implementation itself in eager


@l2norm_qk_bwd.register_fake
def _(q: torch.Tensor, k: torch.Tensor, rq: torch.Tensor, rk: torch.Tensor, dqn: torch.Tensor,
      dkn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(q.shape, device=q.device, dtype=q.dtype), torch.empty(k.shape, device=k.device, dtype=k.dtype)


def _setup_context(ctx, inputs, output) -> None:
    q, k, _eps = inputs
    _, _, rq, rk = output
    ctx.save_for_backward(q, k, rq, rk)
    ctx.mark_non_differentiable(rq, rk)


def _backward(ctx, dqn, dkn, _drq, _drk):
    q, k, rq, rk = ctx.saved_tensors
    dq, dk = l2norm_qk_bwd_fast(q, k, rq, rk, dqn, dkn)
    return (dq if ctx.needs_input_grad[0] else None), (dk if ctx.needs_input_grad[1] else None), None


l2norm_qk_fwd.register_autograd(_backward, setup_context=_setup_context)
# the op where traced, in eager an autograd.Function of the same functions (ops/custom.py)
l2norm_qk_fwd_fast = eager_or_op(l2norm_qk_fwd, _l2norm_qk_fwd_impl, _setup_context, _backward)


def l2norm_qk(q: torch.Tensor, k: torch.Tensor, eps: float = L2_EPS) -> tuple[torch.Tensor, torch.Tensor]:
    """`reference.l2norm` of q and of k (same last dim) by the Triton kernels, differentiable in both."""
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"l2norm_qk: q and k must share the last dim, got {tuple(q.shape)} and {tuple(k.shape)}")
    qn, kn, _, _ = l2norm_qk_fwd_fast(q, k, float(eps))
    return qn, kn
