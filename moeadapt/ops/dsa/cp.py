"""Gated DSA under context parallelism: this rank's queries attend over every rank's keys.

Only the key side crosses ranks: the MLA key rows (kv latent + RoPE part, kv_lora_rank + rope values per
token) and the indexer keys (index_head_dim values) are gathered once, as one [B, T, kvl + rope + DI] buffer
(~700 values per token for DeepSeek-V3.2 shapes, not the hidden state). Queries never move. Each local query
selects its top-k among all earlier keys of its document with `lightning_indexer(q_positions=...)` (no [T, T]
scores), sparse attention runs on the gathered keys, and the keys' gradients (dK/dV from attention, dk_idx
from the indexer KL loss) are reduce-scattered back to the ranks that own those tokens (`gather_pieces`).
Layout and collectives: ops/cp_comm.py. Knows nothing about models or meshes.
"""

from __future__ import annotations

import torch

from ..cp_comm import CPLayout, gather_pieces
from . import indexer_kl_loss, lightning_indexer, sparse_attention

__all__ = ["gather_sequence", "dsa_attention_cp"]


def gather_sequence(x_BT: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    """This rank's [B, T_local, ...] -> the whole sequence [B, T_local * size, ...] in global order.
    Differentiable: the gradient of every row is summed over ranks and returned to the rank that holds it."""
    B, T = x_BT.shape[:2]
    J = layout.pieces_per_rank
    if T % J:
        raise ValueError(f"this rank's {T} tokens do not split into its {J} cp pieces; the sequence length "
                         f"must be a multiple of {layout.n_pieces}")
    rest = x_BT.shape[2:]
    x_JB = x_BT.reshape(B, J, T // J, *rest).transpose(0, 1)
    all_PB = gather_pieces(x_JB, layout)  # [P, B, Tp, ...]
    return all_PB.transpose(0, 1).reshape(B, layout.n_pieces * (T // J), *rest)


def dsa_attention_cp(
    q: torch.Tensor,
    kv: torch.Tensor,
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    w_idx: torch.Tensor,
    topk: int,
    layout: CPLayout,
    dv: int,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    kl_loss: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """DSA's selection + sparse attention for this rank's queries of a sequence split over a cp group.

    Args (all this rank's tokens, layout.pieces() concatenated along T_local):
        q: [B, T_local, HQ, D] attention queries (MQA form for MLA).
        kv: [B, T_local, HK, D] key rows; the values are kv[..., :dv] (MLA: the latent).
        q_idx [B, T_local, HI, DI], k_idx [B, T_local, DI], w_idx [B, T_local, HI]: indexer inputs.
        cu_seqlens: GLOBAL document boundaries [N+1] of a packed batch (B = 1) of T_local * size tokens.
        kl_loss: also return the indexer KL loss of this rank's queries (their mean; every query has at least
            itself as a key, so equal local lengths make the mean over ranks the global mean).
    Returns:
        o [B, T_local, HQ, dv], indices [B, T_local, topk] (global positions, -1 padded), KL loss or None.
    Every rank of the group must call it with the same shapes (it runs collectives).
    """
    HK, D = kv.shape[2], kv.shape[3]
    T_global = q.shape[1] * layout.size
    if cu_seqlens is not None and (int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T_global):
        raise ValueError(f"cu_seqlens must hold the global boundaries, from 0 to the whole sequence's "
                         f"{T_global} tokens (cp={layout.size} x {q.shape[1]} local), got {cu_seqlens.tolist()}")
    keys = torch.cat([kv.reshape(*kv.shape[:2], HK * D), k_idx.to(kv.dtype)], -1)
    keys_g = gather_sequence(keys, layout)
    kv_g = keys_g[..., : HK * D].unflatten(-1, (HK, D))
    k_idx_g = keys_g[..., HK * D:].to(k_idx.dtype)
    q_pos = layout.local_positions(T_global, q.device)
    with torch.no_grad():
        indices = lightning_indexer(q_idx, k_idx_g.detach(), w_idx, topk, cu_seqlens, backend=backend,
                                    q_positions=q_pos)
    o = sparse_attention(q, kv_g, kv_g[..., :dv], indices, scale=scale, backend=backend)
    kl = None
    if kl_loss:
        kl = indexer_kl_loss(q.detach(), kv_g.detach(), indices, q_idx, k_idx_g, w_idx, scale=scale,
                             backend=backend)
    return o, indices, kl
