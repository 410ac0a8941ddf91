"""Plain-PyTorch KDA (Kimi Delta Attention): the specification and the CPU path.

Owns: `naive_recurrent_kda` (step-by-step loop, *is* the math) and
`chunk_kda_reference` (chunk-64 WY/UT form, vectorised over batch, heads and
chunks, looping over chunks only for the state). Both are differentiable by
autograd and share one signature. Imports only torch.

Shapes (B batch, T time, H q/k heads, HV value heads = a multiple of H,
K key dim, V value dim, N sequences when `cu_seqlens` is given):
  q, k  [B,T,H,K]       value head hv reads q/k head hv // (HV // H)
  v     [B,T,HV,V]
  g     [B,T,HV,K]      log-space per-channel decay (<= 0), per value head
  beta  [B,T,HV]        write strength in (0, 1), per value head
  state [B,HV,K,V]      float32 (float64 if the inputs are float64); [N,HV,K,V] with cu_seqlens
Per step t and value head: S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;
o_t = scale * S^T q_t.

Fused options (every backend takes them): `use_qk_l2norm` L2-normalises q and k
over K; `A_log` [HV] (+ `dt_bias` [HV*K] or [HV,K]) turns the passed g into the raw
pre-activation of g = -exp(A_log[h]) * softplus(g + dt_bias[h]), or with
`gate_lower_bound` b < 0 of the lower-bounded gate g = b * sigmoid(exp(A_log[h]) * (g + dt_bias[h]))
(GLM-5.3-Flash; the decay per step stays >= exp(b)); `beta_is_logits` applies sigmoid to beta.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64
SUB = 16  # sub-chunk for the numerically safe intra-chunk decay products
L2_EPS = 1e-6


def norm_fits_tile(norm_dim: int) -> bool:
    """Whether an L2 norm over groups of norm_dim channels can run inside the short conv's Triton passes (a
    power of two: one channel tile per head; triton_conv.py). The layer (models/kda_attn.py) and the memory
    planner (plan/memory.py) ask the same."""
    return norm_dim > 0 and not norm_dim & (norm_dim - 1)


def l2norm(x: torch.Tensor, eps: float = L2_EPS) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the convention fla uses)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def kda_gate(g_raw: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None,
             lower_bound: float | None = None) -> torch.Tensor:
    """g = -exp(A_log[h]) * softplus(g_raw + dt_bias[h, :]) with g_raw [..., HV, K]; float32 or better.
    With `lower_bound` b (< 0): g = b * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h, :])), in (b, 0)."""
    HV, K = g_raw.shape[-2:]
    dt = g_raw.float() if g_raw.dtype != torch.float64 else g_raw
    if dt_bias is not None:
        dt = dt + dt_bias.reshape(HV, K).to(dt.dtype)
    a = torch.exp(A_log.to(dt.dtype)).reshape(HV, 1)
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * dt)
    return -a * F.softplus(dt)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias, beta_is_logits, gate_lower_bound=None):
    """Apply the fused options, cast to the compute dtype, scale q, expand q/k to value heads."""
    cdt = torch.float64 if q.dtype == torch.float64 else torch.float32
    H, K, HV = q.shape[2], q.shape[3], v.shape[2]
    scale = K**-0.5 if scale is None else scale
    q, k, v, beta = q.to(cdt), k.to(cdt), v.to(cdt), beta.to(cdt)
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    g = kda_gate(g, A_log, dt_bias, gate_lower_bound).to(cdt) if A_log is not None else g.to(cdt)
    if beta_is_logits:
        beta = torch.sigmoid(beta)
    if HV != H:
        q, k = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    return q * scale, k, v, g, beta, cdt


def _per_sequence(fn, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens):
    """Run `fn` on each [cu[i], cu[i+1]) slice of a batch-1 varlen input; concat outputs, stack states."""
    if cu_seqlens is None:
        return fn(q, k, v, g, beta, initial_state)
    bounds = cu_seqlens.tolist()
    outs, states = [], []
    for i in range(len(bounds) - 1):
        s = slice(bounds[i], bounds[i + 1])
        h0 = None if initial_state is None else initial_state[i : i + 1]
        o, hT = fn(q[:, s], k[:, s], v[:, s], g[:, s], beta[:, s], h0)
        outs.append(o)
        states.append(hT)
    return torch.cat(outs, 1), torch.cat(states, 0)


def naive_recurrent_kda(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    *, use_qk_l2norm=False, A_log=None, dt_bias=None, beta_is_logits=False, gate_lower_bound=None,
):
    """Step-by-step KDA; returns (o [B,T,HV,V] in v's dtype, final state [B|N,HV,K,V] or None)."""
    out_dtype = v.dtype
    q, k, v, g, beta, cdt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias, beta_is_logits,
                                      gate_lower_bound)

    def run(q, k, v, g, beta, h0):
        B, T, HV, K = k.shape
        S = q.new_zeros(B, HV, K, v.shape[-1]) if h0 is None else h0.to(cdt)
        o = []
        for t in range(T):
            S = S * g[:, t].exp()[..., None]
            kt = k[:, t]
            S = S + (beta[:, t, :, None, None] * kt[..., None]) * (v[:, t] - (S * kt[..., None]).sum(-2))[..., None, :]
            o.append((S * q[:, t, :, :, None]).sum(-2))
        return torch.stack(o, 1) if T else v.clone(), S

    o, S = _per_sequence(run, q, k, v, g, beta, initial_state, output_final_state, cu_seqlens)
    return o.to(out_dtype), (S if output_final_state else None)


def state_transition_reference(k, g, beta):
    """The K x K map a span of steps applies to its incoming state: M = A_T ... A_1 with
    A_t = (I - beta_t k_t k_t^T) diag(exp(g_t)), per value head, so that the span's final state is
    M S_in + (final state from zero). k [B,T,HV,K] (heads expanded), g [B,T,HV,K], beta [B,T,HV];
    returns [B,HV,K,K]. A plain product of step matrices: the specification of the cp state exchange."""
    B, T, HV, K = k.shape
    eye = torch.eye(K, dtype=k.dtype, device=k.device)
    M = eye.expand(B, HV, K, K)
    for t in range(T):
        kt = k[:, t]
        A = (eye - beta[:, t, :, None, None] * kt[..., :, None] * kt[..., None, :]) * g[:, t].exp()[..., None, :]
        M = A @ M
    return M


def _intra_chunk(q, k, G, beta):
    """Within-chunk products for [..., C, K] chunks with G the in-chunk cumulative gate.

    Returns Akk [..., C, C] = beta_i sum_c k_ic k_jc exp(G_ic - G_jc) for j < i, and
    Aqk [..., C, C] = sum_c q_ic k_jc exp(G_ic - G_jc) for j <= i. Only exponents <= 0
    are ever taken: diagonal SUBxSUB blocks take exp(G_i - G_j) directly; off-diagonal
    blocks split it at r = G at the end of the previous sub-chunk (G_i <= r <= G_j).
    """
    *lead, C, K = k.shape
    ns = C // SUB
    kb, qb, Gb = (x.reshape(*lead, ns, SUB, K) for x in (k, q, G))
    # Diagonal blocks: [..., ns, SUB(i), SUB(j), K].
    idx = torch.arange(SUB, device=k.device)
    incl = idx[:, None] >= idx[None, :]
    dG = Gb[..., :, None, :] - Gb[..., None, :, :]
    kE = kb[..., None, :, :] * torch.where(incl[:, :, None], dG, float("-inf")).exp()  # k_j e^(G_i - G_j)
    kk_d = (kb[..., :, None, :] * kE).sum(-1) * (idx[:, None] > idx[None, :])
    qk_d = (qb[..., :, None, :] * kE).sum(-1)
    eye = torch.eye(ns, dtype=k.dtype, device=k.device)[:, None, :, None]  # block-diagonal placement
    kk = kk_d[..., :, :, None, :] * eye
    qk = qk_d[..., :, :, None, :] * eye
    if ns > 1:
        # Off-diagonal: row sub-chunk a >= 1 against all columns j < a*SUB.
        r = Gb[..., :-1, -1:, :]  # [..., ns-1, 1, K]
        row_e = (Gb[..., 1:, :, :] - r).exp()  # [..., ns-1, SUB, K]
        col_ok = (torch.arange(C, device=k.device)[None, :] < (torch.arange(1, ns, device=k.device)[:, None] * SUB))
        col_e = torch.where(col_ok[:, :, None], r - G[..., None, :, :], float("-inf")).exp()  # [..., ns-1, C, K]
        kcol = k[..., None, :, :] * col_e
        kk_o = (kb[..., 1:, :, :] * row_e) @ kcol.transpose(-1, -2)  # [..., ns-1, SUB, C]
        qk_o = (qb[..., 1:, :, :] * row_e) @ kcol.transpose(-1, -2)
        pad = kk_o.new_zeros(*lead, 1, SUB, C)
        kk = kk + torch.cat([pad, kk_o], -3).reshape(kk.shape)
        qk = qk + torch.cat([pad, qk_o], -3).reshape(qk.shape)
    kk = kk.reshape(*lead, C, C) * beta[..., :, None]
    return kk, qk.reshape(*lead, C, C)


def _chunk_dense(q, k, v, g, beta, h0):
    """Chunked KDA for one dense batch [B,T,HV,*] (q already scaled, heads expanded)."""
    B, T, HV, K = k.shape
    V = v.shape[-1]
    NC = -(-T // CHUNK)
    pad = NC * CHUNK - T
    if pad:  # padded steps have g = k = beta = 0: the state passes through unchanged
        q, k, v, g = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v, g))
        beta = F.pad(beta, (0, 0, 0, pad))
    # [B,HV,NC,C,*]
    q, k, v, g = (x.reshape(B, NC, CHUNK, HV, -1).permute(0, 3, 1, 2, 4).contiguous() for x in (q, k, v, g))
    beta = beta.reshape(B, NC, CHUNK, HV).permute(0, 3, 1, 2).contiguous()
    G = g.cumsum(-2)
    Akk, Aqk = _intra_chunk(q, k, G, beta)
    # (I + Akk) [w | u] = beta * [k exp(G) | v]  (UT form of the WY representation)
    rhs = beta[..., None] * torch.cat([k * G.exp(), v], -1)
    wu = torch.linalg.solve_triangular(Akk, rhs, upper=False, unitriangular=True)
    w, u = wu[..., :K], wu[..., K:]
    qg = q * G.exp()
    Glast = G[..., -1:, :]  # [B,HV,NC,1,K]
    kdec = k * (Glast - G).exp()
    S = q.new_zeros(B, HV, K, V) if h0 is None else h0
    outs = []
    for n in range(NC):
        d = u[:, :, n] - w[:, :, n] @ S  # v_new: beta*(v - S_hat^T k) for every step of the chunk
        outs.append(qg[:, :, n] @ S + Aqk[:, :, n] @ d)
        S = S * Glast[:, :, n, 0, :, None].exp() + kdec[:, :, n].transpose(-1, -2) @ d
    o = torch.stack(outs, 2).permute(0, 2, 3, 1, 4).reshape(B, NC * CHUNK, HV, V)
    return o[:, :T], S


def chunk_kda_reference(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    *, use_qk_l2norm=False, A_log=None, dt_bias=None, beta_is_logits=False, gate_lower_bound=None,
):
    """Chunked (64) KDA in the WY/UT form; same contract as `naive_recurrent_kda`."""
    out_dtype = v.dtype
    q, k, v, g, beta, cdt = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, A_log, dt_bias, beta_is_logits,
                                      gate_lower_bound)
    h0 = None if initial_state is None else initial_state.to(cdt)
    o, S = _per_sequence(_chunk_dense, q, k, v, g, beta, h0, output_final_state, cu_seqlens)
    return o.to(out_dtype), (S if output_final_state else None)
