"""DSA reference: plain PyTorch, differentiable, the specification and the CPU path.

Owns the math of DeepSeek Sparse Attention (DSA): the lightning indexer (top-k key
selection), sparse attention over the selected keys, and the indexer's KL loss.
Nothing here knows about Triton; `triton_*.py` must agree with these functions.

Shape legend (suffixes): B batch, T time, HI indexer heads, DI indexer dim,
HQ query heads, HK key/value heads, G = HQ // HK heads per group, D qk dim,
DV value dim, K top-k.

Index convention: an index is a position on the T axis of the same batch row,
so for a packed variable-length batch (B = 1, ``cu_seqlens``) it is the absolute
row in the packed sequence. A query selects keys of its own sequence only, causal
(s <= t). Selected indices are returned in ascending order, padded with -1 at the
end. Selection keeps the ``min(topk, n_visible)`` highest scores; of equal scores
the lower index wins, so the result is exact and deterministic.
"""

from __future__ import annotations

import torch

from ..host import to_device

__all__ = [
    "indexer_scores_reference",
    "lightning_indexer_reference",
    "sparse_attention_reference",
    "indexer_kl_loss_reference",
    "kpool_keys_reference",
    "kpool_indexer_reference",
]


def _seq_starts(T: int, cu_seqlens: torch.Tensor | None, device) -> torch.Tensor:
    """Start position of the sequence each row belongs to, [T] int64."""
    if cu_seqlens is None:
        return torch.zeros(T, dtype=torch.long, device=device)
    cu = to_device(cu_seqlens, device, torch.long)
    pos = torch.arange(T, device=device)
    seq = torch.searchsorted(cu[1:], pos, right=True)
    return cu[seq]


def indexer_scores_reference(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor) -> torch.Tensor:
    """Dense indexer scores I[b,t,s] = sum_j w[b,t,j] * relu(q[b,t,j] . k[b,s]), fp32 (fp64 kept), [B,Tq,Tk].

    Unmasked; callers apply causality. Memory O(Tq * HI * Tk): call on query blocks.
    """
    dt = torch.float64 if q_idx.dtype == torch.float64 else torch.float32
    s_BTHS = torch.einsum("bthd,bsd->bths", q_idx.to(dt), k_idx.to(dt)).relu()
    return torch.einsum("bths,bth->bts", s_BTHS, w_idx.to(dt))


@torch.no_grad()
def lightning_indexer_reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | None = None,
    block: int = 256,
    q_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k causal key indices per query, [B,Tq,topk] int32, ascending, -1 padded.

    q_idx [B,Tq,HI,DI], k_idx [B,T,DI], w_idx [B,Tq,HI]. `q_positions` [Tq]: the
    queries' positions among the T keys (context parallelism: local queries, gathered
    keys); default arange(T) with Tq = T. Queries are processed in blocks of
    ``block`` rows, so memory is O(block * HI * T), never O(T^2).
    """
    B, Tq, _, _ = q_idx.shape
    T = k_idx.shape[1]
    dev = q_idx.device
    key_pos = torch.arange(T, device=dev)
    q_pos = key_pos if q_positions is None else q_positions.to(device=dev, dtype=torch.long)
    starts_T = _seq_starts(T, cu_seqlens, dev)[q_pos]
    out_BTK = torch.full((B, Tq, topk), -1, dtype=torch.int32, device=dev)
    for t0 in range(0, Tq, block):
        t1 = min(Tq, t0 + block)
        scores_BQS = indexer_scores_reference(q_idx[:, t0:t1], k_idx, w_idx[:, t0:t1])
        qpos = q_pos[t0:t1, None]
        visible_QS = (key_pos[None] <= qpos) & (key_pos[None] >= starts_T[t0:t1, None])
        scores_BQS = scores_BQS.masked_fill(~visible_QS, float("-inf"))
        # Stable sort on descending score: of equal scores the lower index stays first.
        order_BQS = torch.sort(scores_BQS, dim=-1, descending=True, stable=True).indices
        k = min(topk, T)
        sel_BQK = order_BQS[..., :k]
        n_vis_Q = visible_QS.sum(-1).clamp(max=topk)  # number of real picks per row
        slot_K = torch.arange(k, device=dev)
        sel_BQK = torch.where(slot_K < n_vis_Q[:, None], sel_BQK, T)  # T sorts after all keys
        sel_BQK = sel_BQK.sort(dim=-1).values
        sel_BQK = torch.where(sel_BQK == T, -1, sel_BQK)
        out_BTK[:, t0:t1, :k] = sel_BQK.to(torch.int32)
    return out_BTK


def _gather_rows(x_BTHD: torch.Tensor, idx_BTHK: torch.Tensor) -> torch.Tensor:
    """x[b, idx[b,t,h,k], h] -> [B,T,H,K,D]; -1 entries read row 0 (mask them)."""
    B, _, H, _ = x_BTHD.shape
    b_ar = torch.arange(B, device=x_BTHD.device)[:, None, None, None]
    h_ar = torch.arange(H, device=x_BTHD.device)[None, None, :, None]
    return x_BTHD[b_ar, idx_BTHK.long().clamp(min=0), h_ar]


def _expand_indices(indices: torch.Tensor, HK: int) -> torch.Tensor:
    """[B,T,K] (shared by all KV heads) or [B,T,HK,K] -> [B,T,HK,K]."""
    if indices.dim() == 3:
        return indices[:, :, None, :].expand(-1, -1, HK, -1)
    return indices


def sparse_attention_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
    return_lse: bool = False,
):
    """Softmax attention of each query over its selected keys only.

    q [B,T,HQ,D], k [B,T,HK,D], v [B,T,HK,DV], indices [B,T,K] or [B,T,HK,K]
    (-1 = unused slot). Query head h uses KV head h // (HQ // HK). Returns o
    [B,T,HQ,DV] in q's dtype (and lse [B,T,HQ] fp32, natural log, -inf for a
    query with no key). Memory O(T * K * D) (gather), never O(T^2).
    """
    B, T, HQ, D = q.shape
    HK, DV = k.shape[2], v.shape[-1]
    G = HQ // HK
    scale = D**-0.5 if scale is None else scale
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    idx_BTHK = _expand_indices(indices, HK)
    valid_BTHK = idx_BTHK >= 0
    k_BTHKD = _gather_rows(k, idx_BTHK).to(dt)
    v_BTHKD = _gather_rows(v, idx_BTHK).to(dt)
    q_BTHGD = q.reshape(B, T, HK, G, D).to(dt)
    s_BTHGK = torch.einsum("bthgd,bthkd->bthgk", q_BTHGD, k_BTHKD) * scale
    s_BTHGK = s_BTHGK.masked_fill(~valid_BTHK[:, :, :, None, :], float("-inf"))
    lse_BTHG = torch.logsumexp(s_BTHGK, dim=-1)
    p_BTHGK = torch.exp(s_BTHGK - lse_BTHG.nan_to_num(neginf=0.0)[..., None])
    o = torch.einsum("bthgk,bthkd->bthgd", p_BTHGK, v_BTHKD).reshape(B, T, HQ, DV).to(q.dtype)
    if return_lse:
        return o, lse_BTHG.reshape(B, T, HQ).float()
    return o


@torch.no_grad()
def indexer_kl_target_reference(
    q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor, scale: float | None = None, block: int = 1024
) -> torch.Tensor:
    """Target p [B,T,K] fp32: main-attention probabilities over the selected keys,
    summed over all query heads and L1-normalised per query (0 at -1 slots).

    indices [B,T,K] shared by all KV heads. Query blocks bound memory to
    O(block * K * D).
    """
    B, T, HQ, D = q.shape
    HK = k.shape[2]
    G = HQ // HK
    scale = D**-0.5 if scale is None else scale
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = torch.zeros(indices.shape, dtype=torch.float32, device=q.device)
    b_ar = torch.arange(B, device=q.device)[:, None, None]
    for t0 in range(0, T, block):
        idx_BQK = indices[:, t0 : t0 + block].long()
        valid_BQK = idx_BQK >= 0
        k_BQKHD = k[b_ar, idx_BQK.clamp(min=0)].to(dt)
        q_BQHGD = q[:, t0 : t0 + block].reshape(B, -1, HK, G, D).to(dt)
        s = torch.einsum("bqhgd,bqkhd->bqhgk", q_BQHGD, k_BQKHD) * scale
        s = s.masked_fill(~valid_BQK[:, :, None, None, :], float("-inf"))
        p = torch.softmax(s, dim=-1).nan_to_num(0.0).sum(dim=(2, 3))
        p = p / p.sum(-1, keepdim=True).clamp(min=1e-30)
        out[:, t0 : t0 + block] = p.float()
    return out


def indexer_kl_loss_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    indices: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    scale: float | None = None,
) -> torch.Tensor:
    """KL(p || softmax(I)) over each query's selected keys, averaged over queries
    that have at least one selected key; a scalar fp32.

    p: `indexer_kl_target_reference(q, k, indices, scale)` (detached: the loss
    trains only the indexer, q and k get no gradient). I[t, s] =
    sum_j w[t,j] relu(q_idx[t,j] . k_idx[s]) at the selected s. Gradients flow to
    q_idx [B,T,HI,DI], k_idx [B,T,DI], w_idx [B,T,HI]. For the dense warm-up pass
    every causal key (e.g. indices from `lightning_indexer(..., topk=T)`).
    """
    p_BTK = indexer_kl_target_reference(q.detach(), k.detach(), indices, scale)
    B = q_idx.shape[0]
    dt = torch.float64 if q_idx.dtype == torch.float64 else torch.float32
    valid_BTK = indices >= 0
    b_ar = torch.arange(B, device=q_idx.device)[:, None, None]
    k_BTKD = k_idx[b_ar, indices.long().clamp(min=0)].to(dt)
    s_BTHK = torch.einsum("bthd,btkd->bthk", q_idx.to(dt), k_BTKD).relu()
    i_BTK = torch.einsum("bthk,bth->btk", s_BTHK, w_idx.to(dt))
    has_key_BT = valid_BTK.any(-1)
    i_BTK = i_BTK.masked_fill(~valid_BTK, float("-inf")).masked_fill(~has_key_BT[..., None], 0.0)
    logq_BTK = torch.log_softmax(i_BTK, dim=-1)
    p = p_BTK.to(dt)
    kl_BTK = torch.where(p > 0, p * (torch.log(p.clamp(min=1e-30)) - logq_BTK), torch.zeros_like(p))
    kl_BT = kl_BTK.sum(-1)
    return (kl_BT.sum() / has_key_BT.sum().clamp(min=1)).float()


def kpool_keys_reference(k_idx: torch.Tensor, gate: torch.Tensor, ape: torch.Tensor) -> torch.Tensor:
    """KPool block keys [B, T // P, DI]: each complete block of P = ape.shape[0] tokens pooled per channel,
    key[b, p, c] = sum_j softmax_j(gate[b, pP + j, c] + ape[j, c]) * k_idx[b, pP + j, c] (an incomplete last
    block is dropped). k_idx, gate [B, T, DI]; fp32 (fp64 kept); differentiable."""
    B, T, DI = k_idx.shape
    P = ape.shape[0]
    n = T // P
    dt = torch.float64 if k_idx.dtype == torch.float64 else torch.float32
    k_BNPD = k_idx[:, : n * P].to(dt).reshape(B, n, P, DI)
    logits_BNPD = gate[:, : n * P].to(dt).reshape(B, n, P, DI) + ape.to(dt)
    return (torch.softmax(logits_BNPD, dim=2) * k_BNPD).sum(2)


def _kpool_one(q_idx, k_idx, w_idx, gate, ape, topk, select_tail, block):
    """kpool_indexer_reference on one sequence (positions 0..T-1 of the given rows)."""
    B, T, _, _ = q_idx.shape
    P = ape.shape[0]
    dev = q_idx.device
    keys_BND = kpool_keys_reference(k_idx, gate, ape)
    n = keys_BND.shape[1]
    kp = min(topk // P, n)  # blocks selected per query
    width = topk + (P - 1 if select_tail else 0)
    out_BTW = torch.full((B, T, width), -1, dtype=torch.long, device=dev)
    blk = torch.arange(n, device=dev)
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        pos_Q = torch.arange(t0, t1, device=dev)
        n_vis_Q = (pos_Q + 1) // P  # complete blocks that end at or before the query
        parts = []
        if kp:
            scores_BQN = indexer_scores_reference(q_idx[:, t0:t1], keys_BND, w_idx[:, t0:t1])
            scores_BQN = scores_BQN.masked_fill(blk[None, None] >= n_vis_Q[None, :, None], float("-inf"))
            order_BQN = torch.sort(scores_BQN, dim=-1, descending=True, stable=True).indices[..., :kp]
            real = torch.arange(kp, device=dev)[None, None] < n_vis_Q.clamp(max=kp)[None, :, None]
            tok = order_BQN[..., None] * P + torch.arange(P, device=dev)  # [B, Q, kp, P]
            parts.append(torch.where(real[..., None], tok, -1).flatten(-2))
        if select_tail:  # the query's own incomplete block: tokens n_vis * P .. t
            tail_QJ = (n_vis_Q * P)[:, None] + torch.arange(P - 1, device=dev)
            parts.append(torch.where(tail_QJ <= pos_Q[:, None], tail_QJ, -1)[None].expand(B, -1, -1))
        if not parts:
            continue
        sel = torch.cat(parts, -1)
        sel = torch.where(sel < 0, T, sel).sort(-1).values  # ascending, the unused slots (T) last
        out_BTW[:, t0:t1, : sel.shape[-1]] = torch.where(sel == T, -1, sel)
    return out_BTW


@torch.no_grad()
def kpool_indexer_reference(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    topk: int,
    select_tail: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    block: int = 256,
) -> torch.Tensor:
    """KPool indexer (GLM-5.3-Flash): the lightning indexer over pooled block keys instead of token keys.

    Each sequence is cut into blocks of P = ape.shape[0] tokens from its start; a complete block's key is
    `kpool_keys_reference`. A query t scores the complete blocks that end at or before t,
    I[t, p] = sum_j w[t,j] relu(q_idx[t,j] . key[p]), keeps the min(topk // P, visible) best (equal scores:
    the lower block wins) and attends to all their tokens; with `select_tail` also to the tokens of its own
    incomplete block (n_vis * P .. t, so at most P - 1 of them). q_idx [B,T,HI,DI], k_idx and gate [B,T,DI],
    w_idx [B,T,HI] (scaled as for `lightning_indexer`), ape [P,DI].
    Returns [B, T, topk + (P - 1 if select_tail else 0)] int32 token positions, ascending, -1 padded."""
    T = q_idx.shape[1]
    if cu_seqlens is None:
        return _kpool_one(q_idx, k_idx, w_idx, gate, ape, topk, select_tail, block).to(torch.int32)
    bounds = cu_seqlens.tolist()
    outs = []
    for s0, s1 in zip(bounds[:-1], bounds[1:]):
        o = _kpool_one(q_idx[:, s0:s1], k_idx[:, s0:s1], w_idx[:, s0:s1], gate[:, s0:s1], ape, topk, select_tail,
                       block)
        outs.append(torch.where(o >= 0, o + s0, -1))
    out = torch.cat(outs, 1) if outs else q_idx.new_full((q_idx.shape[0], T, 0), -1, dtype=torch.long)
    return out.to(torch.int32)
