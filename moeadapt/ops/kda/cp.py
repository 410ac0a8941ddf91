"""KDA under context parallelism: one sequence split over the ranks of a cp group (layout: ops/cp_comm.py).

Math (per value head; `state_transition_reference` in reference.py spells it out). One step is affine in S:
  S_t = A_t S_{t-1} + beta_t k_t v_t^T,   A_t = (I - beta_t k_t k_t^T) diag(exp(g_t))   (K x K),
so a piece of the sequence maps its incoming state to  S_out = M S_in + S_loc  with M = A_T ... A_1 and S_loc
the piece's final state from a zero start. Both come from the existing chunked op: S_loc = chunk_kda(v) from
zeros, M = chunk_kda(v = 0) started from the identity (with v = 0 the update is S <- A_t S). Per piece that is
HV x K x (K + V) numbers, independent of the piece's length.

Forward: (1) every rank runs its pieces from zero: S_loc, M; (2) all ranks gather (S_loc, M) of every piece
and fold them in sequence order, S_in[p+1] = M[p] S_in[p] + S_loc[p] (zero where a document starts at the
piece boundary); (3) every rank reruns its pieces from their S_in for the outputs.
Backward mirrors it (`_FoldStates`): the autograd of step (3) gives each piece's dL/dS_in; ranks gather those
with the pieces' M (HV x K x (V + K) per piece) and run the reverse scan G[p] = d[p] + M[p]^T G[p+1]; a piece's carried-out state gets
G[p+1] and its transition G[p+1] S_in[p]^T, and autograd of step (1) takes them into q, k, v, g, beta.
Varlen: `cu_seqlens` gives the global document boundaries; a document may cross any piece boundary.
"""

from __future__ import annotations

import torch

from ..cp_comm import CPLayout, _all_gather
from ..host import host_tensor
from . import chunk_kda

__all__ = ["chunk_kda_cp"]


class _FoldStates(torch.autograd.Function):
    """(S_loc [J,B,HV,K,V], M [J,B,HV,K,K]) of this rank's pieces -> S_in [J,B,HV,K,V] of the same pieces.

    Saves only this rank's M and S_in (2 pieces, not 2 * cp): the backward gathers every piece's M again
    together with its dL/dS_in, one [HV, K, V + K] message per piece, the mirror of the forward."""

    @staticmethod
    def forward(ctx, S_loc, M, layout: CPLayout, fresh: tuple[bool, ...]):
        V = S_loc.shape[-1]
        g_RJ = _all_gather(torch.cat([S_loc, M], -1), layout)
        order = layout.piece_order()
        S_in = [torch.zeros_like(S_loc[0])]
        for p, (r, j) in enumerate(order[:-1]):  # S_in[p+1] = M[p] S_in[p] + S_loc[p]
            nxt = g_RJ[r, j, ..., V:] @ S_in[p] + g_RJ[r, j, ..., :V]
            S_in.append(torch.zeros_like(nxt) if fresh[p + 1] else nxt)
        out = torch.stack([S_in[p] for p in layout.pieces()])
        ctx.layout, ctx.fresh = layout, fresh
        ctx.save_for_backward(M, out)
        return out

    @staticmethod
    def backward(ctx, dS_in_J):
        layout, fresh = ctx.layout, ctx.fresh
        M_J, S_in_J = ctx.saved_tensors
        V = dS_in_J.shape[-1]
        g_RJ = _all_gather(torch.cat([dS_in_J, M_J], -1), layout)
        order = layout.piece_order()
        P = len(order)
        # G[p]: the loss's total gradient with respect to S_in[p], by the reverse scan G[p] = d[p] + M[p]^T G[p+1]
        G = [None] * P
        r, j = order[P - 1]
        G[P - 1] = g_RJ[r, j, ..., :V]
        for p in range(P - 2, -1, -1):
            r, j = order[p]
            d = g_RJ[r, j, ..., :V]
            G[p] = d if fresh[p + 1] else d + g_RJ[r, j, ..., V:].transpose(-1, -2) @ G[p + 1]
        dS, dM = [], []
        for j, p in enumerate(layout.pieces()):
            carried = p + 1 < P and not fresh[p + 1]
            dS.append(G[p + 1] if carried else torch.zeros_like(S_in_J[j]))
            dM.append(G[p + 1] @ S_in_J[j].transpose(-1, -2) if carried else torch.zeros_like(M_J[j]))
        return torch.stack(dS), torch.stack(dM), None, None


def _segments(cu_seqlens: torch.Tensor, layout: CPLayout, Tp: int):
    """Local segments of this rank's pieces for a global packed sequence.

    Returns (local cu_seqlens [N_loc+1] int64, first segment of each local piece, last segment of each local
    piece, whether each local piece holds exactly one segment, fresh flag of every global piece)."""
    cu = [int(c) for c in cu_seqlens.tolist()]
    bounds = set(cu)
    fresh = tuple(p * Tp in bounds for p in range(layout.n_pieces))
    local_cu, first, last, single = [0], [], [], []
    for j, p in enumerate(layout.pieces()):
        lo = p * Tp
        inner = [b - lo for b in cu if lo < b < lo + Tp]
        first.append(len(local_cu) - 1)
        local_cu += [j * Tp + b for b in inner] + [(j + 1) * Tp]
        last.append(len(local_cu) - 2)
        single.append(not inner)
    return torch.tensor(local_cu, dtype=torch.long), first, last, single, fresh


def chunk_kda_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    layout: CPLayout,
    scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    **opts,
) -> torch.Tensor:
    """`chunk_kda` on this rank's part of a sequence split over a cp group; returns o [B,T_local,HV,V].

    q, k [B,T_local,H,K], v [B,T_local,HV,V], g [B,T_local,HV,K], beta [B,T_local,HV]: this rank's pieces
    (layout.pieces()) concatenated in order, each T_local / pieces_per_rank tokens. cu_seqlens: the GLOBAL
    boundaries [N+1] of a packed batch (B = 1) of T_local * layout.size tokens, or None. `opts` are
    chunk_kda's fused options (use_qk_l2norm, A_log, dt_bias, beta_is_logits). The initial state is zero
    and no final state is returned (the sequence's last state lives on the rank holding the last piece).
    Every rank of the group must call it with the same shapes (it runs collectives).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    J = layout.pieces_per_rank
    if T % J:
        raise ValueError(f"this rank's {T} tokens do not split into its {J} cp pieces; the sequence length "
                         f"must be a multiple of {layout.n_pieces}")
    Tp = T // J
    run = dict(scale=scale, backend=backend, **opts)
    zeros_v = v.new_zeros(B, T, HV, K)
    sdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    eye = torch.eye(K, dtype=sdt, device=q.device)
    if cu_seqlens is None:  # each piece of each row is one sequence: stack the pieces along the batch
        fresh = (True,) + (False,) * (layout.n_pieces - 1)

        def rows(x):  # [B, J*Tp, ...] -> [J*B, Tp, ...], piece-major
            return x.reshape(B, J, Tp, *x.shape[2:]).transpose(0, 1).reshape(J * B, Tp, *x.shape[2:])

        qr, kr, vr, gr, br, zr = (rows(x) for x in (q, k, v, g, beta, zeros_v))
        _, S_loc = chunk_kda(qr, kr, vr, gr, br, output_final_state=True, **run)
        _, M = chunk_kda(qr, kr, zr, gr, br, initial_state=eye.expand(J * B, HV, K, K).contiguous(),
                         output_final_state=True, **run)
        S_in = _FoldStates.apply(S_loc.view(J, B, HV, K, V), M.view(J, B, HV, K, K), layout, fresh)
        o, _ = chunk_kda(qr, kr, vr, gr, br, initial_state=S_in.reshape(J * B, HV, K, V), **run)
        return o.reshape(J, B, Tp, HV, V).transpose(0, 1).reshape(B, T, HV, V)
    if B != 1:
        raise ValueError(f"cu_seqlens requires batch size 1 (sequences packed along T), got B={B}.")
    if int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T * layout.size:
        raise ValueError(f"cu_seqlens must hold the global boundaries, from 0 to the whole sequence's "
                         f"{T * layout.size} tokens (cp={layout.size} x {T} local), got {cu_seqlens.tolist()}")
    cu, first, last, single, fresh = _segments(cu_seqlens, layout, Tp)
    N = cu.numel() - 1
    _, S_seg = chunk_kda(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu, **run)
    _, M_seg = chunk_kda(q, k, zeros_v, g, beta, initial_state=eye.expand(N, HV, K, K).contiguous(),
                         output_final_state=True, cu_seqlens=cu, **run)
    keep = host_tensor(single, q.device, sdt).view(J, 1, 1, 1, 1)
    S_in = _FoldStates.apply(S_seg[last].unsqueeze(1), M_seg[first].unsqueeze(1) * keep, layout, fresh)
    h0 = S_in.new_zeros(N, HV, K, V).index_copy(0, host_tensor(first, q.device), S_in[:, 0])
    o, _ = chunk_kda(q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **run)
    return o
