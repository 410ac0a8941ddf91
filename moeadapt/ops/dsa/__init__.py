"""DeepSeek Sparse Attention operators: lightning indexer, sparse attention, indexer KL loss.

Owns `moeadapt/ops/dsa/`; the model layer (projections, RoPE, gating) lives in
`moeadapt/models/` and only calls the three public functions below.

Backends: ``"reference"`` (plain PyTorch, `reference.py`), ``"triton"`` (fused
kernels, `triton_*.py`), ``"auto"`` = Triton for CUDA tensors, reference elsewhere.
Index convention (all backends): an index is a position on the T axis of the
same batch row (for a packed varlen batch, B = 1, the absolute packed row);
selected indices come in ascending order, -1 padded at the end.
"""

from __future__ import annotations

import torch

from .reference import (
    indexer_kl_loss_reference,
    indexer_scores_reference,
    kpool_indexer_reference,
    lightning_indexer_reference,
    sparse_attention_reference,
)

__all__ = [
    "lightning_indexer",
    "kpool_indexer",
    "kpool_indexer_reference",
    "sparse_attention",
    "indexer_kl_loss",
    "lightning_indexer_reference",
    "sparse_attention_reference",
    "indexer_kl_loss_reference",
    "indexer_scores_reference",
]

_BACKENDS = ("auto", "reference", "triton")


def _backend(backend: str, x: torch.Tensor) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {_BACKENDS}")
    if backend == "auto":
        return "triton" if x.is_cuda else "reference"
    return backend


def _shape_err(name: str, t: torch.Tensor, expected: str) -> ValueError:
    return ValueError(f"{name} has shape {tuple(t.shape)}; expected {expected}")


def _check_indexer(q_idx, k_idx, w_idx, topk, cu_seqlens, q_positions=None, keys_may_differ=False) -> None:
    if q_idx.dim() != 4:
        raise _shape_err("q_idx", q_idx, "[B, T, HI, DI]")
    B, T, HI, DI = q_idx.shape
    if q_positions is not None or keys_may_differ:  # queries of a longer key sequence (context parallelism)
        if k_idx.dim() != 3 or k_idx.shape[0] != B or k_idx.shape[2] != DI:
            raise _shape_err("k_idx", k_idx, f"[B, Tk, DI] with B, DI = {(B, DI)}")
        if q_positions is not None and tuple(q_positions.shape) != (T,):
            raise _shape_err("q_positions", q_positions, f"[Tq] = [{T}]")
        T = k_idx.shape[1]
    elif tuple(k_idx.shape) != (B, T, DI):
        raise _shape_err("k_idx", k_idx, f"[B, T, DI] = {(B, T, DI)}")
    if tuple(w_idx.shape) != (B, q_idx.shape[1], HI):
        raise _shape_err("w_idx", w_idx, f"[B, T, HI] = {(B, q_idx.shape[1], HI)}")
    if not isinstance(topk, int) or topk < 1:
        raise ValueError(f"topk={topk!r} must be a positive int")
    if cu_seqlens is not None:
        if B != 1:
            raise ValueError(f"cu_seqlens needs a packed batch of B = 1, got B = {B}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D [N + 1], got {list(cu_seqlens.shape)}")
        # its values are checked where reading them is free: on the host (device boundaries would cost a sync)
        if cu_seqlens.device.type == "cpu" and (int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T):
            raise ValueError(f"cu_seqlens must start at 0 and end at T = {T}, got {cu_seqlens.tolist()}")


def lightning_indexer(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    topk: int,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    q_positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Select the top-k causal keys of every query by the lightning indexer score.

    Args:
        q_idx: [B, T, HI, DI] indexer queries.
        k_idx: [B, T, DI] one shared indexer key per token.
        w_idx: [B, T, HI] per-head weights (already scaled by HI^-0.5 DI^-0.5).
        topk: keys kept per query; a query sees min(topk, keys visible to it).
        cu_seqlens: [N+1] int cumulative sequence lengths of a packed batch (B = 1).
        q_positions: [Tq] int positions of the query rows among k_idx's Tk keys, when the
            queries are a subset of a longer sequence (context parallelism: this rank's
            queries, every rank's keys); cu_seqlens then describes the Tk keys. Default:
            q_idx's rows are positions 0..T-1 of the keys.
    Returns:
        indices [B, T, topk] int32: ascending key positions, -1 padded. Score
        I[t,s] = sum_j w[t,j] relu(q_idx[t,j] . k_idx[s]) over s <= t in t's
        sequence; equal scores keep the lower index. No gradient.
    """
    _check_indexer(q_idx, k_idx, w_idx, topk, cu_seqlens, q_positions)
    if _backend(backend, q_idx) == "triton":
        from .triton_indexer import lightning_indexer_fast

        return lightning_indexer_fast(q_idx, k_idx, w_idx, topk, cu_seqlens, q_positions)
    return lightning_indexer_reference(q_idx, k_idx, w_idx, topk, cu_seqlens, q_positions=q_positions)


def kpool_indexer(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    topk: int,
    select_tail: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """Select whole blocks of keys per query by the lightning indexer score of pooled block keys (KPool).

    Args:
        q_idx, k_idx, w_idx, cu_seqlens: as for `lightning_indexer`.
        gate: [B, T, DI] per-token, per-channel pooling logits (x W_pool); ape: [P, DI] their offsets by the
            position inside a block; P = ape.shape[0] is the block size.
        topk: tokens selected per query in whole blocks (a multiple of P): topk // P blocks.
        select_tail: also select the query's own incomplete block.
    Returns:
        indices [B, T, topk + (P - 1 if select_tail else 0)] int32, ascending, -1 padded (see
        `reference.kpool_indexer_reference` for the exact rule). No gradient.
    Every backend runs the reference (there is no fused KPool kernel yet); it scores T / P block keys per
    query in query blocks, so memory stays O(256 * HI * T / P).
    """
    _check_indexer(q_idx, k_idx, w_idx, topk, cu_seqlens)
    _backend(backend, q_idx)
    B, T, _, DI = q_idx.shape
    if tuple(gate.shape) != (B, T, DI):
        raise _shape_err("gate", gate, f"[B, T, DI] = {(B, T, DI)}")
    if ape.dim() != 2 or ape.shape[1] != DI or ape.shape[0] < 1:
        raise _shape_err("ape", ape, f"[P, DI] with DI = {DI}")
    if topk % ape.shape[0]:
        raise ValueError(f"topk={topk} is not a multiple of the block size P={ape.shape[0]}; KPool selects whole "
                         "blocks")
    return kpool_indexer_reference(q_idx, k_idx, w_idx, gate, ape, topk, select_tail, cu_seqlens)


def _check_attention(q, k, v, indices) -> None:
    if q.dim() != 4:
        raise _shape_err("q", q, "[B, T, HQ, D]")
    B, T, HQ, D = q.shape
    if k.dim() != 4 or k.shape[0] != B or k.shape[3] != D:
        raise _shape_err("k", k, f"[B, Tk, HK, D] with B, D = {(B, D)}")
    Tk, HK = k.shape[1], k.shape[2]
    if HQ % HK != 0:
        raise ValueError(f"HQ = {HQ} query heads is not a multiple of HK = {HK} key heads")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, Tk, HK):
        raise _shape_err("v", v, f"[B, Tk, HK, DV] with B, Tk, HK = {(B, Tk, HK)}")
    if indices.dim() == 3:
        ok = tuple(indices.shape[:2]) == (B, T)
    else:
        ok = indices.dim() == 4 and tuple(indices.shape[:3]) == (B, T, HK)
    if not ok:
        raise _shape_err("indices", indices, f"[B, T, K] or [B, T, HK, K] with B, T, HK = {(B, T, HK)}")
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"indices has dtype {indices.dtype}; expected torch.int32 or torch.int64")


def sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    indices: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
    *,
    gluon: bool = True,
) -> torch.Tensor:
    """Softmax attention of each query over its selected keys only.

    Args:
        q: [B, T, HQ, D]; k: [B, Tk, HK, D]; v: [B, Tk, HK, DV]; HQ a multiple of HK; Tk = T
            except for queries of a longer key sequence (context parallelism: indices index k's Tk rows)
            (MLA runs it in MQA form: HK = 1, D = kv_lora_rank + rope, DV = kv_lora_rank; or in MHA form,
            HK = HQ, which on CUDA with a dense selection runs on dense tiles: flex_attn.py).
        indices: [B, T, K] shared by all KV heads, or [B, T, HK, K]; -1 = unused.
            All query heads of a KV group attend to that group's selected keys.
        scale: softmax scale, default D^-0.5.
        For MLA pass ``kv = cat([kv_latent, k_rope], -1)`` as k and the view
        ``kv[..., :DV]`` as v: the Triton kernels then read each row once and
        scatter dk and dv with one atomic (a separate v tensor also works).
        gluon: with the Triton backend, run the forward and backward pass 1 by the warp-specialised Gluon
            kernels where they apply (sm_90, bf16, the MLA shape); False keeps the Triton kernels.
    Returns:
        o [B, T, HQ, DV] in q's dtype; a query with no selected key gets 0.
        Differentiable in q, k, v (dk, dv scatter-added into the selected rows).
    """
    _check_attention(q, k, v, indices)
    if _backend(backend, q) == "triton":
        from .flex_attn import dense_tiles_apply, sparse_attention_flex

        if dense_tiles_apply(q, k, indices):  # MHA layout, dense selection: dense tiles
            return sparse_attention_flex(q, k, v, indices, scale)
        from .triton_sparse_attn import sparse_attention_triton

        return sparse_attention_triton(q, k, v, indices, scale, gluon=gluon)
    return sparse_attention_reference(q, k, v, indices, scale)


def indexer_kl_loss(
    q: torch.Tensor,
    k: torch.Tensor,
    indices: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    scale: float | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """KL loss that trains the indexer toward the main attention, a scalar fp32.

    Args:
        q: [B, T, HQ, D], k: [B, T, HK, D] main-attention queries and keys (detached
            inside: they get no gradient from this loss).
        indices: [B, T, K] selected keys (for the dense warm-up, every causal key).
        q_idx: [B, T, HI, DI], k_idx: [B, T, DI], w_idx: [B, T, HI] indexer inputs.
        scale: main-attention softmax scale, default D^-0.5.
    Returns:
        mean over queries with >= 1 key of KL(p || softmax(I)) over the selected
        keys, where p = sum over heads of the main softmax probabilities,
        L1-normalised. Gradients reach q_idx, k_idx and w_idx only.
    """
    _check_attention(q, k, k[..., :1], indices)
    if indices.dim() != 3:
        raise _shape_err("indices", indices, "[B, T, K] (one selection per token)")
    _check_indexer(q_idx, k_idx, w_idx, 1, None, keys_may_differ=True)
    if k_idx.shape[1] != k.shape[1]:
        raise _shape_err("k_idx", k_idx, f"[B, Tk, DI] with Tk = {k.shape[1]} as in k")
    if tuple(q_idx.shape[:2]) != tuple(q.shape[:2]):
        raise _shape_err("q_idx", q_idx, f"[B, T, HI, DI] with B, T = {tuple(q.shape[:2])}")
    if _backend(backend, q) == "triton":
        from .triton_kl import indexer_kl_loss_triton

        return indexer_kl_loss_triton(q, k, indices, q_idx, k_idx, w_idx, scale)
    return indexer_kl_loss_reference(q, k, indices, q_idx, k_idx, w_idx, scale)
