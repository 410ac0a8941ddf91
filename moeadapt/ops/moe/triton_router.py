"""The router's logit GEMMs on TF32 tensor cores without fp32 copies of the activations ("tf32" mode on CUDA).

cuBLAS takes both operands of a GEMM in one dtype. The router's "tf32" GEMM of a bf16 activation x [T, D] with
its fp32 weight W [E, D] therefore first wrote x in fp32 (twice x's bytes), and the backward's dx = g·W came out
in fp32 and was cast back to x's dtype: two activation-sized passes per MoE layer around two small GEMMs.
`mm` reads each operand in its own dtype, converts the tiles to fp32 in registers and stores the product in
the dtype asked for:
    logits = x·Wᵀ  (fp32),      dx = g·W  (x's dtype),
with TF32 dots: fp32 operands rounded to 10 mantissa bits, fp32 accumulation, as cuBLAS's TF32 GEMM (a bf16 x
is exact in TF32). The math is F.linear in fp32 (models/router.py `_mm`, which runs it off CUDA).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_lora import _interpreting

# GPU tiles (the interpreter uses 16-wide blocks). Rows of the activation per program, then the output columns
# and the reduction block, each capped by the operand's width.
ROUTER_TILES = dict(BM=64, BN=128, BK=64, num_warps=4, num_stages=3)


@triton.jit
def _mm_kernel(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm, s_cn,
               PREC: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """c[M, N] = a[M, K]·b[K, N]: tiles converted to fp32 in registers, dots in PREC, c stored in its own dtype."""
    rm = tl.program_id(0) * BM + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    m_ok, n_ok = rm < M, rn < N
    rm64 = rm.to(tl.int64)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, K, BK):
        ks = k0 + rk
        k_ok = ks < K
        a = tl.load(a_ptr + rm64[:, None] * s_am + ks[None, :] * s_ak, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_ptr + ks[:, None] * s_bk + rn[None, :] * s_bn, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision=PREC)
    tl.store(c_ptr + rm64[:, None] * s_cm + rn[None, :] * s_cn, acc.to(c_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _block(width: int, cap: int) -> int:
    return max(16, min(cap, triton.next_power_of_2(width)))


def mm(a_MK: torch.Tensor, b_KN: torch.Tensor, out_dtype: torch.dtype, precision: str = "tf32") -> torch.Tensor:
    """a·b [M, N] in out_dtype, any operand dtypes and strides (the kernel converts tiles to fp32); precision
    "tf32" (tensor cores) or "ieee" (full fp32)."""
    M, K = a_MK.shape
    N = b_KN.shape[1]
    if b_KN.shape[0] != K:
        raise ValueError(f"triton_router.mm: a {tuple(a_MK.shape)} and b {tuple(b_KN.shape)} do not chain")
    c = torch.empty(M, N, dtype=out_dtype, device=a_MK.device)
    if M == 0 or N == 0:
        return c
    if K == 0:
        return c.zero_()
    t = ROUTER_TILES
    if _interpreting():
        BM, BN, BK, launch = 16, _block(N, 16), _block(K, 16), {}
    else:
        BM, BN, BK = t["BM"], _block(N, t["BN"]), _block(K, t["BK"])
        launch = dict(num_warps=t["num_warps"], num_stages=t["num_stages"])
    grid = (triton.cdiv(M, BM), triton.cdiv(N, BN))
    _mm_kernel[grid](a_MK, b_KN, c, M, N, K, *a_MK.stride(), *b_KN.stride(), *c.stride(),
                     PREC=precision, BM=BM, BN=BN, BK=BK, **launch)
    return c
