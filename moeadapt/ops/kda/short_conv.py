"""The KDA layer's short causal depthwise convolution + SiLU: the public `causal_conv_silu` and its reference.

y[b, t, c] = silu(sum_{i < KW} w[c, 0, i] * x[b, t - (KW - 1) + i, c]), zeros before t = 0 (conv1d with KW - 1
left padding, first T outputs). The reference is the torch composition the layer used before the fused kernel
(transpose, grouped conv1d, slice, transpose back, SiLU), differentiable by autograd; the Triton backend
(`triton_conv.py`) is one pass each way on [B, T, C] with no transposes.

Shapes: x [B, T, C] (any strides), w [C, 1, KW] (nn.Conv1d's depthwise layout); y [B, T, C] in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "reference", "triton")


def causal_conv_silu_reference(x_BTC: torch.Tensor, w_C1K: torch.Tensor) -> torch.Tensor:
    T, KW = x_BTC.shape[1], w_C1K.shape[-1]
    y = F.conv1d(x_BTC.transpose(1, 2), w_C1K.to(x_BTC.dtype), padding=KW - 1, groups=x_BTC.shape[-1])
    return F.silu(y[..., :T].transpose(1, 2))


def causal_conv_silu(x_BTC: torch.Tensor, w_C1K: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """silu(causal depthwise conv) of x [B, T, C] with w [C, 1, KW]; backend "auto" (Triton on CUDA, reference
    elsewhere), "reference" or "triton" (CUDA, or CPU under TRITON_INTERPRET=1)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if x_BTC.dim() != 3 or w_C1K.dim() != 3 or w_C1K.shape[0] != x_BTC.shape[-1] or w_C1K.shape[1] != 1:
        raise ValueError(f"causal_conv_silu needs x [B, T, C] and w [C, 1, KW] with the same C, got x "
                         f"{list(x_BTC.shape)} and w {list(w_C1K.shape)}.")
    if backend == "reference" or (backend == "auto" and (x_BTC.device.type != "cuda" or x_BTC.dtype == torch.float64)):
        return causal_conv_silu_reference(x_BTC, w_C1K)
    from .triton_conv import conv_silu_fwd

    return conv_silu_fwd(x_BTC, w_C1K)
