"""Triton indexer KL loss behind `indexer_kl_loss(backend="triton")`, fused with its backward.

Owns the two KL kernels and the custom op `moeadapt::indexer_kl_fwd` (loss and its unit-gradient terms; the
backward only scales them; `indexer_kl_fwd_fast` skips the op's dispatch in plain eager mode, ops/custom.py); the
math is `reference.indexer_kl_loss_reference`.

1. target kernel, one program per (query, KV head, head block), like the SFA
   forward: pass 1 gets each head's log-sum-exp over the selected keys, pass 2
   adds exp(s - lse) over the heads into p [B,T,K] (fp32 atomics across head
   blocks); p is then L1-normalised in PyTorch. No gradient.
2. indexer kernel, one program per query: pass 1 gathers the selected indexer
   keys, forms I = sum_j w_j relu(q_j . k) and the row's KL(p || softmax(I));
   pass 2 forms dI = softmax(I) - p and writes dq_idx, dw_idx and scatter-adds
   dk_idx (fp32 atomics). Gradients are computed in the forward for a unit
   upstream gradient and only scaled in the backward (as fused cross-entropy
   does), so nothing of size [T, K, DI] is ever stored.
"""

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ..custom import eager_or_op
from .triton_indexer import pad_head_dim
from .triton_sparse_attn import LOG2E, _common, _launch_args, _mm, _prep, use_ieee

TARGET_CONFIG = {"BLOCK_H": 64, "BLOCK_K": 32, "num_warps": 8, "num_stages": 1}


@triton.jit
def _kl_target_kernel(
    Q, K, IDX, P,
    sq_t, sq_h, sk_b, sk_t, sk_h, si_t, si_h, sp_t,
    T, G, TOPK, D, NHB, qk_scale,
    D1: tl.constexpr, D2: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) // NHB
    h0 = (tl.program_id(1) % NHB) * BLOCK_H
    b = row // T
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_h = offs_h < G
    heads = g * G + offs_h
    offs_d1 = tl.arange(0, D1)
    q_base = Q + row * sq_t + heads[:, None] * sq_h
    q1 = tl.load(q_base + offs_d1[None, :], mask=mask_h[:, None], other=0.0)
    if D2 > 0:
        offs_d2 = D1 + tl.arange(0, D2)
        q2 = tl.load(q_base + offs_d2[None, :], mask=mask_h[:, None] & (offs_d2[None, :] < D), other=0.0)
    kb_base = K + b * sk_b + g * sk_h
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    for phase in tl.static_range(2):
        for k0 in range(0, TOPK, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            idx = tl.load(IDX + row * si_t + g * si_h + offs_k, mask=offs_k < TOPK, other=-1)
            valid = idx >= 0
            rows = tl.where(valid, idx, 0).to(tl.int64)
            k1 = tl.load(kb_base + rows[:, None] * sk_t + offs_d1[None, :], mask=valid[:, None], other=0.0)
            s = _mm(q1, tl.trans(k1), IEEE)
            if D2 > 0:
                k2 = tl.load(kb_base + rows[:, None] * sk_t + offs_d2[None, :],
                             mask=valid[:, None] & (offs_d2[None, :] < D), other=0.0)
                s += _mm(q2, tl.trans(k2), IEEE)
            s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
            if phase == 0:
                m_new = tl.maximum(m_i, tl.max(s, 1))
                l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), 1)
                m_i = m_new
            else:
                lse2 = m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0))
                p = tl.where(mask_h[:, None], tl.exp2(s - lse2[:, None]), 0.0)
                tl.atomic_add(P + row * sp_t + offs_k, tl.sum(p, 0), mask=valid, sem="relaxed")


@triton.jit
def _kl_indexer_kernel(
    QI, KI, WI, IDX, P, LOSS, DQ, DK, DW,
    sq_r, sq_h, sk_b, sk_t, sw_r, si_r, sp_r, sdk_b,
    T, HI, TOPK,
    DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    b = row // T
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, DI)
    mask_h = offs_h < HI
    q = tl.load(QI + row * sq_r + offs_h[:, None] * sq_h + offs_d[None, :], mask=mask_h[:, None], other=0.0)
    w = tl.load(WI + row * sw_r + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    kbase = KI + b * sk_b
    # pass 1: log-sum-exp of I, sum p*I, sum p*log p, sum p
    m_i = -1.0e30
    l_i = 0.0
    pi = 0.0
    plogp = 0.0
    psum = 0.0
    for k0 in range(0, TOPK, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(IDX + row * si_r + offs_k, mask=offs_k < TOPK, other=-1)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        kt = tl.load(kbase + rows[:, None] * sk_t + offs_d[None, :], mask=valid[:, None], other=0.0)
        a = _mm(q, tl.trans(kt), IEEE)
        i_k = tl.sum(tl.maximum(a, 0.0) * w[:, None], 0)
        p = tl.load(P + row * sp_r + offs_k, mask=valid, other=0.0)
        i_m = tl.where(valid, i_k, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(i_m, 0))
        l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(i_m - m_new), 0)
        m_i = m_new
        pi += tl.sum(p * i_k, 0)
        plogp += tl.sum(tl.where(p > 0, p * tl.log(tl.where(p > 0, p, 1.0)), 0.0), 0)
        psum += tl.sum(p, 0)
    lse = m_i + tl.log(tl.where(l_i > 0, l_i, 1.0))
    tl.store(LOSS + row, plogp - pi + psum * lse)
    # pass 2: dI = psum * softmax(I) - p; dq, dw stored, dk scatter-added
    dq = tl.zeros([BLOCK_HI, DI], tl.float32)
    dw = tl.zeros([BLOCK_HI], tl.float32)
    for k0 in range(0, TOPK, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx = tl.load(IDX + row * si_r + offs_k, mask=offs_k < TOPK, other=-1)
        valid = idx >= 0
        rows = tl.where(valid, idx, 0).to(tl.int64)
        kt = tl.load(kbase + rows[:, None] * sk_t + offs_d[None, :], mask=valid[:, None], other=0.0)
        a = _mm(q, tl.trans(kt), IEEE)
        i_k = tl.sum(tl.maximum(a, 0.0) * w[:, None], 0)
        p = tl.load(P + row * sp_r + offs_k, mask=valid, other=0.0)
        d_i = psum * tl.exp(tl.where(valid, i_k - lse, float("-inf"))) - p
        dw += tl.sum(tl.maximum(a, 0.0) * d_i[None, :], 1)
        da = tl.where(a > 0, w[:, None] * d_i[None, :], 0.0)
        dq += _mm(da.to(kt.dtype), kt, IEEE)
        dk = _mm(tl.trans(da.to(q.dtype)), q, IEEE)
        tl.atomic_add(DK + b * sdk_b + rows[:, None] * DI + offs_d[None, :], dk, mask=valid[:, None], sem="relaxed")
    tl.store(DQ + row * (BLOCK_HI * DI) + offs_h[:, None] * DI + offs_d[None, :], dq)
    tl.store(DW + row * BLOCK_HI + offs_h, dw)


def kl_target_triton(q, k, indices, scale, cfg=None):
    """p [B,T,K] fp32: head-summed main-attention probabilities, L1-normalised."""
    cfg = cfg or TARGET_CONFIG
    B, T, HQ, HK, G, D, _, idx, si_h, d1, d2 = _common(q, k, k, indices)
    q, k, _, _ = _prep(q, k, k, d1)
    p = torch.zeros(idx.shape[0], idx.shape[1], idx.shape[-1], device=q.device, dtype=torch.float32)
    bh, nhb, grid = _launch_args(cfg, G, HK, B, T)
    _kl_target_kernel[grid](
        q, k, idx, p,
        q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), idx.stride(1), si_h, p.stride(1),
        T, G, idx.shape[-1], D, nhb, scale * LOG2E,
        D1=d1, D2=d2, BLOCK_H=bh, BLOCK_K=cfg["BLOCK_K"], IEEE=use_ieee(q),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return p / p.sum(-1, keepdim=True).clamp(min=1e-30)


def _indexer_kl_fwd_impl(q: Tensor, k: Tensor, indices: Tensor, q_idx: Tensor, k_idx: Tensor, w_idx: Tensor,
                         scale: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(loss fp32 scalar, then its gradients for a unit upstream gradient: dq_idx like q_idx, dk_idx fp32
    [B,Tk,DI], dw_idx like w_idx, all fp32) of the indexer KL loss; q, k get no gradient."""
    p = kl_target_triton(q, k, indices, scale)
    B, T, HI, DI = q_idx.shape
    bhi = max(16, triton.next_power_of_2(HI))
    qi = q_idx.reshape(B * T, HI, DI).contiguous()
    ki = k_idx.contiguous()
    wi = w_idx.reshape(B * T, HI).contiguous()
    idx = indices.contiguous()
    loss_r = torch.empty(B * T, device=q_idx.device, dtype=torch.float32)
    dq = torch.empty(B * T, bhi, DI, device=q_idx.device, dtype=torch.float32)
    dw = torch.empty(B * T, bhi, device=q_idx.device, dtype=torch.float32)
    dk = torch.zeros(B, k_idx.shape[1], DI, device=q_idx.device, dtype=torch.float32)  # Tk keys
    _kl_indexer_kernel[(B * T,)](
        qi, ki, wi, idx, p, loss_r, dq, dk, dw,
        qi.stride(0), qi.stride(1), ki.stride(0), ki.stride(1), wi.stride(0), idx.stride(1), p.stride(1),
        dk.stride(0), T, HI, idx.shape[-1],
        DI=DI, BLOCK_HI=bhi, BLOCK_K=32, IEEE=use_ieee(qi), num_warps=4,
    )
    n = (indices >= 0).any(-1).sum().clamp(min=1).float()
    return (loss_r.sum() / n, (dq[:, :HI] / n).reshape(q_idx.shape), dk / n,
            (dw[:, :HI] / n).reshape(w_idx.shape))


indexer_kl_fwd = torch.library.custom_op("moeadapt::indexer_kl_fwd", mutates_args=())(_indexer_kl_fwd_impl)


@indexer_kl_fwd.register_fake
def _(q, k, indices, q_idx, k_idx, w_idx, scale):
    def f32(*shape):
        return torch.empty(*shape, device=q_idx.device, dtype=torch.float32)

    return f32(()), f32(q_idx.shape), f32(k_idx.shape), f32(w_idx.shape)


def _kl_setup_context(ctx, inputs, output) -> None:
    _, _, _, q_idx, k_idx, w_idx, _ = inputs
    ctx.save_for_backward(*output[1:])
    ctx.dtypes = (q_idx.dtype, k_idx.dtype, w_idx.dtype)
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)


def _kl_backward(ctx, g, *_):
    if g is None:
        return (None,) * 7
    dq, dk, dw = ctx.saved_tensors
    dtq, dtk, dtw = ctx.dtypes
    return None, None, None, (dq * g).to(dtq), (dk * g).to(dtk), (dw * g).to(dtw), None


indexer_kl_fwd.register_autograd(_kl_backward, setup_context=_kl_setup_context)
# what indexer_kl_loss_triton calls: the op where traced, in eager an autograd.Function of the same functions
# (ops/custom.py)
indexer_kl_fwd_fast = eager_or_op(indexer_kl_fwd, _indexer_kl_fwd_impl, _kl_setup_context, _kl_backward)


def indexer_kl_loss_triton(q, k, indices, q_idx, k_idx, w_idx, scale=None):
    """Triton KL loss (fused forward + backward); same contract as `indexer_kl_loss_reference`."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if q.shape[-1] < 16:  # MMA needs K >= 16: zero channels change no dot product
        q, k = (F.pad(x, (0, 16 - x.shape[-1])) for x in (q, k))
    q_idx, k_idx = pad_head_dim(q_idx, k_idx)  # differentiable: grads are sliced back
    return indexer_kl_fwd_fast(q.detach(), k.detach(), indices, q_idx, k_idx, w_idx, scale)[0]
