"""KDA (Kimi Delta Attention) operator: the public `chunk_kda` and its backends.

Owns the argument contract and validation; the math lives in `reference.py`
(PyTorch, CPU path and spec) and the kernels in `triton_kda.py`. Imports only
torch/triton (fla optionally, for backend="fla").
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..host import to_device
from .reference import chunk_kda_reference, kda_gate, naive_recurrent_kda

if TYPE_CHECKING:
    from .triton_kda import KDALaunch

__all__ = ["chunk_kda", "chunk_kda_reference", "naive_recurrent_kda"]

BACKENDS = ("auto", "reference", "recurrent", "triton", "fla")


def _check(name: str, x: torch.Tensor | None, shape: tuple, what: str) -> None:
    if x is not None and tuple(x.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {what} = {list(shape)}, got {list(x.shape)}.")


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, backend):
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if q.dim() != 4:
        raise ValueError(f"q must have shape [B,T,H,K], got {list(q.shape)}.")
    B, T, H, K = q.shape
    _check("k", k, (B, T, H, K), "[B,T,H,K] like q")
    if v.dim() != 4 or tuple(v.shape[:2]) != (B, T):
        raise ValueError(f"v must have shape [B,T,HV,V] with B,T = {B},{T} as in q, got {list(v.shape)}.")
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"v's head count HV={HV} must be a multiple of q/k's H={H}.")
    _check("g", g, (B, T, HV, K), "[B,T,HV,K]")
    _check("beta", beta, (B, T, HV), "[B,T,HV]")
    N = B
    if cu_seqlens is not None:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2 or cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise ValueError(f"cu_seqlens must be a 1-D int32/int64 tensor [N+1], got {cu_seqlens.dtype} {list(cu_seqlens.shape)}.")
        if B != 1:
            raise ValueError(f"cu_seqlens requires batch size 1 (sequences packed along T), got B={B}.")
        if cu_seqlens.device.type == "cpu" and (int(cu_seqlens[0]) != 0 or int(cu_seqlens[-1]) != T):
            raise ValueError(f"cu_seqlens must start at 0 and end at T={T}, got {cu_seqlens.tolist()}.")
        N = cu_seqlens.numel() - 1
    _check("initial_state", initial_state, (N, HV, K, V), "[N,HV,K,V]")
    if A_log is not None:
        _check("A_log", A_log, (HV,), "[HV]")
        if dt_bias is not None and dt_bias.numel() != HV * K:
            raise ValueError(f"dt_bias must have shape [HV*K] or [HV,K] = [{HV * K}] or [{HV},{K}], got {list(dt_bias.shape)}.")
    elif dt_bias is not None:
        raise ValueError("dt_bias is only used with A_log; pass A_log [HV] too or fold dt_bias into g.")


def chunk_kda(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    use_qk_l2norm: bool = False,
    A_log: torch.Tensor | None = None,
    dt_bias: torch.Tensor | None = None,
    beta_is_logits: bool = False,
    gate_lower_bound: float | None = None,
    launch: KDALaunch | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, chunked (64) form.

    Per step t and value head: S <- diag(exp(g_t)) S;  S <- S + beta_t k_t (v_t - S^T k_t)^T;
    o_t = scale * S^T q_t.

    Args:
        q: queries [B,T,H,K].
        k: keys [B,T,H,K] (L2-normalised by the caller, or pass use_qk_l2norm=True).
        v: values [B,T,HV,V]; HV a multiple of H, value head hv uses q/k head hv // (HV//H).
        g: log-space per-channel decay [B,T,HV,K], <= 0 (or the raw gate input when A_log is given).
        beta: write strength [B,T,HV] in (0,1) (or logits when beta_is_logits=True).
        scale: multiplies q; default K**-0.5.
        initial_state: [N,HV,K,V] state before the first step (N = B, or the number of
            sequences with cu_seqlens); float32 recommended. None means zeros.
        output_final_state: also return the final state [N,HV,K,V] (float32).
        cu_seqlens: int32/int64 [N+1] boundaries of independent sequences packed along T (B must be 1).
        backend: "auto" (triton on CUDA tensors, reference elsewhere), "reference" (chunked
            PyTorch), "recurrent" (step-by-step PyTorch), "triton" (K, V in 16/32/64/128; runs on
            CPU only under TRITON_INTERPRET=1), or "fla" (fla.ops.kda.chunk_kda).
        use_qk_l2norm: L2-normalise q and k over K inside the op.
        A_log: [HV]; if given, g is the raw pre-activation and the decay is
            g = -exp(A_log[h]) * softplus(g + dt_bias[h]).
        dt_bias: [HV*K] or [HV,K] bias of the gate (only with A_log).
        beta_is_logits: beta holds logits; sigmoid is applied inside.
        gate_lower_bound: b < 0 (only with A_log): the lower-bounded gate
            g = b * sigmoid(exp(A_log[h]) * (g + dt_bias[h])) instead of the softplus one. The reference
            and recurrent backends apply it inside; for "triton" / "fla" the gate is formed first by
            PyTorch (reference.kda_gate, differentiable) and the kernel takes the decay as plain g.
        launch: the Triton kernels' launch parameters (triton_kda.KDALaunch; None: triton_kda.LAUNCH, the
            measured defaults); only with backend "triton" / "auto" on CUDA.

    Returns:
        o [B,T,HV,V] in v's dtype, and the final state [N,HV,K,V] (float32) or None.
    """
    _validate(q, k, v, g, beta, initial_state, cu_seqlens, A_log, dt_bias, backend)
    if gate_lower_bound is not None and (A_log is None or not gate_lower_bound < 0):
        raise ValueError(f"gate_lower_bound={gate_lower_bound} needs A_log (the gate is formed inside the op) "
                         "and must be < 0; pass A_log [HV] and a negative bound, or None")
    if backend == "auto":
        backend = "triton" if q.is_cuda else "reference"
    if gate_lower_bound is not None and backend in ("triton", "fla"):  # no fused lower-bounded gate yet
        g, A_log, dt_bias, gate_lower_bound = kda_gate(g, A_log, dt_bias, gate_lower_bound), None, None, None
    opts = dict(use_qk_l2norm=use_qk_l2norm, A_log=A_log, dt_bias=dt_bias, beta_is_logits=beta_is_logits)
    if gate_lower_bound is not None:
        opts["gate_lower_bound"] = gate_lower_bound
    args = (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    if launch is not None and backend != "triton":
        raise ValueError(f"launch= configures the Triton kernels; backend {backend!r} does not run them.")
    if backend == "reference":
        return chunk_kda_reference(*args, **opts)
    if backend == "recurrent":
        return naive_recurrent_kda(*args, **opts)
    if backend == "triton":
        from .triton_kda import LAUNCH, chunk_kda_triton

        return chunk_kda_triton(*args, **opts, launch=launch or LAUNCH)
    try:
        from fla.ops.kda import chunk_kda as fla_chunk_kda
    except ImportError as e:
        raise ImportError("backend='fla' needs flash-linear-attention: pip install fla-core (or use backend='triton').") from e
    return fla_chunk_kda(
        q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
        cu_seqlens=None if cu_seqlens is None else to_device(cu_seqlens, q.device, torch.long),
        use_qk_l2norm_in_kernel=use_qk_l2norm,
        use_gate_in_kernel=A_log is not None,
        use_beta_sigmoid_in_kernel=beta_is_logits, A_log=A_log,
        dt_bias=None if dt_bias is None else dt_bias.reshape(-1),
    )
