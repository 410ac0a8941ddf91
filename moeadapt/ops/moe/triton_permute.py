"""Triton token permutation for MoE: expert-major sort without a full sort, and the weighted combine.

Owns the kernels behind `permute(..., backend="triton")` and `unpermute(..., backend="triton")`.

Index computation (no argsort): the T*K token choices are cut into blocks of BLOCK choices.
  1. `_rank_hist_kernel`: per block, each choice's rank among earlier choices of the same expert in
     that block (a BLOCK×BLOCK compare), and the block's histogram (written by the last choice of each
     expert in the block, so no atomics; deterministic).
  2. torch: counts = Σ_blocks hist; base[b, e] = start of expert e + choices of e in blocks < b
     (an exclusive cumsum over blocks).
  3. `_scatter_index_kernel`: destination row = base[b, e] + rank; row_index[dest] = t*K+k.
The result is stable in t*K+k within each expert, like a stable argsort.

Data movement (one program per tile of rows × hidden chunk, fp32 accumulation):
  - `_gather_rows_kernel`: out[n] = scale[m] · src[m // K] with m = row_index[n], optionally also
    dscale[m] = <src[m // K], other[n]>. Serves permute forward (no scale) and unpermute backward
    (scale = routing weight; dweights from the dot with y_sorted).
  - `_combine_rows_kernel`: out[t] = Σ_k w[t,k] · src[inv[t*K+k]] (skipping inv = -1). Serves
    unpermute forward (with weights) and permute backward (without). A gather-sum, so the backward
    "scatter" is deterministic and needs no atomics.

Shape suffixes: T tokens, K choices per token, M = T*K choices, N routed rows, E experts, D hidden,
B blocks of choices.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_BLOCK_CHOICES = 128


@triton.jit
def _rank_hist_kernel(ids_ptr, rank_ptr, hist_ptr, M, E, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    local = tl.arange(0, BLOCK)
    offs = pid * BLOCK + local
    in_range = offs < M
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    # bins: 0..E-1 experts, E dropped (-1), E+1 invalid id (caught by the caller)
    is_expert = (ids >= 0) & (ids < E)
    bins = tl.where(is_expert, ids, tl.where(ids == -1, E, E + 1))
    bins = tl.where(in_range, bins, E + 2)  # padding lanes match nothing real
    same = bins[:, None] == bins[None, :]
    earlier = local[None, :] < local[:, None]
    later = local[None, :] > local[:, None]
    rank = tl.sum((same & earlier).to(tl.int32), axis=1)
    n_later = tl.sum((same & later).to(tl.int32), axis=1)
    tl.store(rank_ptr + offs, rank, mask=in_range)
    # the last choice of each bin in this block writes the bin's count (unique addresses)
    tl.store(hist_ptr + pid * (E + 2) + bins, rank + 1, mask=in_range & (n_later == 0))


@triton.jit
def _scatter_index_kernel(ids_ptr, rank_ptr, base_ptr, row_index_ptr, M, E, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < M
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (ids >= 0) & (ids < E)
    rank = tl.load(rank_ptr + offs, mask=valid, other=0)
    base = tl.load(base_ptr + pid * E + ids, mask=valid, other=0)
    tl.store(row_index_ptr + base + rank, offs.to(tl.int64), mask=valid)


@triton.jit
def _gather_rows_kernel(
    src_ptr, row_index_ptr, out_ptr, scale_ptr, other_ptr, dscale_ptr,
    N, D, K,
    HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    m = tl.load(row_index_ptr + rows, mask=row_ok, other=0)
    src_rows = (m // K).to(tl.int64)
    rows64 = rows.to(tl.int64)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + m, mask=row_ok, other=0.0).to(tl.float32)
    dot = tl.zeros([BLOCK_R], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        mask = row_ok[:, None] & (cols[None, :] < D)
        v = tl.load(src_ptr + src_rows[:, None] * D + cols[None, :], mask=mask, other=0.0)
        if HAS_DOT:
            o = tl.load(other_ptr + rows64[:, None] * D + cols[None, :], mask=mask, other=0.0)
            dot += tl.sum(v.to(tl.float32) * o.to(tl.float32), axis=1)
        if HAS_SCALE:
            v = v.to(tl.float32) * scale[:, None]
        tl.store(out_ptr + rows64[:, None] * D + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=mask)
    if HAS_DOT:
        tl.store(dscale_ptr + m, dot.to(dscale_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _combine_rows_kernel(
    src_ptr, inv_ptr, w_ptr, out_ptr, T, D, K,
    HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
    for k in range(0, K):
        r = tl.load(inv_ptr + toks * K + k, mask=tok_ok, other=-1).to(tl.int64)
        ok = tok_ok & (r >= 0)
        v = tl.load(src_ptr + r[:, None] * D + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0)
        v = v.to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + toks * K + k, mask=ok, other=0.0).to(tl.float32)
            v = v * w[:, None]
        acc += v
    out_ptrs = out_ptr + toks.to(tl.int64)[:, None] * D + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & col_ok[None, :])


def _block_d(D: int) -> int:
    return min(triton.next_power_of_2(D), 1024)


def compute_permutation(
    expert_ids_TK: torch.Tensor, num_experts: int, num_routed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index of each expert-major row and tokens per expert, by histogram + prefix sum.

    One host sync (the number of routed rows N, which sizes the output, and the count of bad ids),
    none when the caller knows N (`num_routed`): then both are checked by device-side asserts.
    """
    ids_M = expert_ids_TK.reshape(-1).contiguous()
    M, E = ids_M.numel(), num_experts
    num_blocks = triton.cdiv(M, _BLOCK_CHOICES)
    rank_M = torch.empty(M, dtype=torch.int32, device=ids_M.device)
    hist_BE = torch.zeros(max(num_blocks, 1), E + 2, dtype=torch.int32, device=ids_M.device)
    if M > 0:
        _rank_hist_kernel[(num_blocks,)](ids_M, rank_M, hist_BE, M, E, BLOCK=_BLOCK_CHOICES)
    counts_all = hist_BE.sum(0)  # int64
    if num_routed is not None:
        n_routed, n_bad = num_routed, 0
        torch._assert_async(counts_all[E + 1] == 0, "expert ids outside [0, E) other than -1")
        torch._assert_async(counts_all[:E].sum() == num_routed, "num_routed differs from the routed choices")
    else:
        n_routed, n_bad = torch.stack([counts_all[:E].sum(), counts_all[E + 1]]).tolist()
    if n_bad:
        bad = ids_M[(ids_M < -1) | (ids_M >= E)][:5].tolist()
        raise ValueError(
            f"expert_ids_TK holds {n_bad} ids outside [0, {E}) other than -1 (e.g. {bad}); "
            f"ids must be expert indices or -1 for a dropped choice"
        )
    counts_E = counts_all[:E]
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    # the exclusive prefix over blocks along the last dim: CUDA's scan along a leading dim of [blocks, E] runs
    # E columns serially (~95 us at 512 x 64 on the H200)
    hist_EB = hist_BE[:, :E].t().to(torch.int64, memory_format=torch.contiguous_format)
    base_BE = (torch.cumsum(hist_EB, 1) - hist_EB + starts_E[:, None]).t().to(
        torch.int32, memory_format=torch.contiguous_format)
    row_index_N = torch.empty(n_routed, dtype=torch.int64, device=ids_M.device)
    if M > 0:
        _scatter_index_kernel[(num_blocks,)](ids_M, rank_M, base_BE, row_index_N, M, E, BLOCK=_BLOCK_CHOICES)
    return row_index_N, counts_E


def inverse_index(row_index_N: torch.Tensor, num_choices: int) -> torch.Tensor:
    """inv[t*K+k] = sorted row of that choice, -1 when dropped."""
    inv_M = torch.full((num_choices,), -1, dtype=torch.int32, device=row_index_N.device)
    inv_M[row_index_N] = torch.arange(len(row_index_N), dtype=torch.int32, device=row_index_N.device)
    return inv_M


def gather_rows(src_TD, row_index_N, K, scale_M=None, other_ND=None, out_dtype=None):
    """out[n] = scale[m]·src[m // K] (m = row_index[n]); with other, also dscale[m] = <src[m//K], other[n]>."""
    src_TD = src_TD.contiguous()
    N, D = len(row_index_N), src_TD.shape[1]
    out_ND = torch.empty(N, D, dtype=out_dtype or src_TD.dtype, device=src_TD.device)
    dscale_M = None
    if other_ND is not None:
        other_ND = other_ND.contiguous()
        dscale_M = torch.zeros_like(scale_M)
    if N > 0 and D > 0:
        BLOCK_D = _block_d(D)
        BLOCK_R = max(1, 4096 // BLOCK_D)
        _gather_rows_kernel[(triton.cdiv(N, BLOCK_R),)](
            src_TD, row_index_N, out_ND,
            scale_M if scale_M is not None else src_TD, other_ND if other_ND is not None else src_TD,
            dscale_M if dscale_M is not None else src_TD,
            N, D, K,
            HAS_SCALE=scale_M is not None, HAS_DOT=other_ND is not None, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D,
        )
    return out_ND, dscale_M


def combine_rows(src_ND, inv_M, K, weights_M=None, out_dtype=None):
    """out[t] = Σ_k w[t,k]·src[inv[t*K+k]] accumulated in fp32 (dropped choices skipped)."""
    src_ND = src_ND.contiguous()
    T, D = len(inv_M) // K, src_ND.shape[1]
    out_TD = torch.empty(T, D, dtype=out_dtype or src_ND.dtype, device=src_ND.device)
    if T > 0 and D > 0:
        BLOCK_D = min(_block_d(D), 256)
        BLOCK_T = max(1, 2048 // BLOCK_D)
        grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D))
        _combine_rows_kernel[grid](
            src_ND, inv_M, weights_M if weights_M is not None else src_ND, out_TD, T, D, K,
            HAS_W=weights_M is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
        )
    return out_TD


class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, row_index_N, K):
        ctx.K, ctx.T = K, x_TD.shape[0]
        ctx.save_for_backward(row_index_N)
        x_sorted_ND, _ = gather_rows(x_TD, row_index_N, K)
        return x_sorted_ND

    @staticmethod
    def backward(ctx, dx_sorted_ND):
        (row_index_N,) = ctx.saved_tensors
        inv_M = inverse_index(row_index_N, ctx.T * ctx.K)
        return combine_rows(dx_sorted_ND, inv_M, ctx.K), None, None


class _UnpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted_ND, row_index_N, weights_TK, num_tokens):
        T, K = weights_TK.shape
        w_M = weights_TK.reshape(-1).contiguous()
        inv_M = inverse_index(row_index_N, T * K)
        ctx.save_for_backward(y_sorted_ND, row_index_N, w_M)
        ctx.K, ctx.w_shape, ctx.w_dtype = K, weights_TK.shape, weights_TK.dtype
        return combine_rows(y_sorted_ND, inv_M, K, weights_M=w_M)

    @staticmethod
    def backward(ctx, dy_TD):
        y_sorted_ND, row_index_N, w_M = ctx.saved_tensors
        need_dy, _, need_dw, _ = ctx.needs_input_grad
        dy_sorted_ND, dw_M = gather_rows(
            dy_TD, row_index_N, ctx.K, scale_M=w_M,
            other_ND=y_sorted_ND if need_dw else None, out_dtype=y_sorted_ND.dtype,
        )
        dw_TK = dw_M.view(ctx.w_shape).to(ctx.w_dtype) if need_dw else None
        return (dy_sorted_ND if need_dy else None), None, dw_TK, None


def permute_triton(x_TD, expert_ids_TK, num_experts, num_routed=None):
    row_index_N, counts_E = compute_permutation(expert_ids_TK, num_experts, num_routed)
    x_sorted_ND = _PermuteFn.apply(x_TD, row_index_N, expert_ids_TK.shape[1])
    return x_sorted_ND, row_index_N, counts_E


def unpermute_triton(y_sorted_ND, row_index_N, weights_TK, num_tokens):
    return _UnpermuteFn.apply(y_sorted_ND, row_index_N, weights_TK, num_tokens)
