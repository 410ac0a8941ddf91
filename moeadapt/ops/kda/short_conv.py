"""The KDA layer's short causal depthwise convolution + SiLU: the public `causal_conv_silu` and its reference.

y[b, t, c] = silu(sum_{i < KW} w[c, 0, i] * x[b, t - (KW - 1) + i, c]), zeros before t = 0 (conv1d with KW - 1
left padding, first T outputs). The reference is the torch composition the layer used before the fused kernel
(transpose, grouped conv1d, slice, transpose back, SiLU), differentiable by autograd; the Triton backend
(`triton_conv.py`) works on [B, T, C] with no transposes: one pass forward, two backward.

Shapes: x [B, T, C] (any strides), w [C, 1, KW] (nn.Conv1d's depthwise layout); y [B, T, C] in x's dtype.
`norm_dim` > 0 (KDA's q and k): y L2-normalised over each group of norm_dim channels (one head), `reference.l2norm`:
y / sqrt(sum(y^2) + L2_EPS). The reference normalises the stored SiLU output in fp32; the Triton backend normalises
its fp32 value in registers before the one store (triton_conv.py).
Packed documents: `positions` [B, T] (each token's position inside its document, models/documents.py) keep a
token's window inside its document: the input i steps back counts only where i <= positions[b, t].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .reference import l2norm, norm_fits_tile

BACKENDS = ("auto", "reference", "triton")


def causal_conv_silu_reference(x_BTC: torch.Tensor, w_C1K: torch.Tensor, positions_BT: torch.Tensor | None = None,
                               norm_dim: int = 0) -> torch.Tensor:
    T, KW = x_BTC.shape[1], w_C1K.shape[-1]
    if positions_BT is not None:
        y = F.silu(conv_with_history(F.pad(x_BTC, (0, 0, KW - 1, 0)), w_C1K.to(x_BTC.dtype), positions_BT))
    else:
        y = F.conv1d(x_BTC.transpose(1, 2), w_C1K.to(x_BTC.dtype), padding=KW - 1, groups=x_BTC.shape[-1])
        y = F.silu(y[..., :T].transpose(1, 2))
    return head_l2norm(y, norm_dim)


def head_l2norm(y_BTC: torch.Tensor, norm_dim: int) -> torch.Tensor:
    """y with each group of norm_dim channels L2-normalised (`reference.l2norm`, fp32 math or float64, in y's
    dtype); y itself for norm_dim = 0."""
    if not norm_dim:
        return y_BTC
    yf = y_BTC if y_BTC.dtype == torch.float64 else y_BTC.float()
    return l2norm(yf.unflatten(-1, (-1, norm_dim))).flatten(-2).to(y_BTC.dtype)


def conv_with_history(x_NTC: torch.Tensor, w_C1K: torch.Tensor, positions_NT: torch.Tensor | None) -> torch.Tensor:
    """The causal conv (no SiLU) of rows that carry their KW - 1 inputs of history in front (zeros, or the
    previous cp piece's tail): x [N, KW - 1 + T, C] -> [N, T, C]. With positions [N, T], the input i steps back
    counts only where i <= the output token's position (KW shifted multiply-adds)."""
    KW = w_C1K.shape[-1]
    n, T = KW - 1, x_NTC.shape[1] - (KW - 1)
    if positions_NT is None:
        return F.conv1d(x_NTC.transpose(1, 2), w_C1K, groups=x_NTC.shape[-1]).transpose(1, 2)
    y = x_NTC[:, n:] * w_C1K[:, 0, n]
    for i in range(1, KW):  # y[t] += w[n - i] x[t - i] inside the document
        seen = (positions_NT >= i).unsqueeze(-1).to(x_NTC.dtype)
        y = y + x_NTC[:, n - i:n - i + T] * w_C1K[:, 0, n - i] * seen
    return y


def runs_triton(x_BTC: torch.Tensor, backend: str = "auto") -> bool:
    """Whether causal_conv_silu runs the Triton passes for x (backend "triton", or "auto" on CUDA below float64):
    where a caller's norm is folded into them (KDA), and elsewhere better left to the consumer's own fp32 math."""
    return backend == "triton" or (backend == "auto" and x_BTC.device.type == "cuda" and x_BTC.dtype != torch.float64)


def fuses_head_norm(x_BTC: torch.Tensor, norm_dim: int, backend: str = "auto") -> bool:
    """Whether causal_conv_silu(..., norm_dim) normalises inside its Triton passes (a power-of-two head on the
    Triton backend), where it saves a pass over its output each way."""
    return runs_triton(x_BTC, backend) and norm_fits_tile(norm_dim)


def causal_conv_silu(x_BTC: torch.Tensor, w_C1K: torch.Tensor, backend: str = "auto",
                     positions: torch.Tensor | None = None, norm_dim: int = 0) -> torch.Tensor:
    """silu(causal depthwise conv) of x [B, T, C] with w [C, 1, KW]; backend "auto" (Triton on CUDA, reference
    elsewhere), "reference" or "triton" (CUDA, or CPU under TRITON_INTERPRET=1). positions [B, T] int: packed
    documents; norm_dim > 0: each group of norm_dim channels L2-normalised (the module docstring)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if x_BTC.dim() != 3 or w_C1K.dim() != 3 or w_C1K.shape[0] != x_BTC.shape[-1] or w_C1K.shape[1] != 1:
        raise ValueError(f"causal_conv_silu needs x [B, T, C] and w [C, 1, KW] with the same C, got x "
                         f"{list(x_BTC.shape)} and w {list(w_C1K.shape)}.")
    if positions is not None and (tuple(positions.shape) != tuple(x_BTC.shape[:2]) or positions.is_floating_point()):
        raise ValueError(f"positions must be an integer tensor [B, T] = {list(x_BTC.shape[:2])}, got "
                         f"{positions.dtype} {list(positions.shape)}.")
    if norm_dim < 0 or (norm_dim and x_BTC.shape[-1] % norm_dim):
        raise ValueError(f"norm_dim={norm_dim} must be 0 (no norm) or divide the {x_BTC.shape[-1]} channels.")
    if not runs_triton(x_BTC, backend):
        return causal_conv_silu_reference(x_BTC, w_C1K, positions, norm_dim)
    from .triton_conv import conv_silu_fwd_fast

    pos = None if positions is None else positions.to(torch.int32).contiguous()
    if norm_dim and not norm_fits_tile(norm_dim):  # a group that is not one channel tile: normalise apart
        return head_l2norm(conv_silu_fwd_fast(x_BTC, w_C1K, pos, 0), norm_dim)
    return conv_silu_fwd_fast(x_BTC, w_C1K, pos, norm_dim)
