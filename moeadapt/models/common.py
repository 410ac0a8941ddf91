"""Small building blocks shared by the model: RMSNorm, RoPE, SwiGLU MLP, causal depthwise conv.

Shape suffixes (legend used across models/): B batch, T time, D hidden, H heads, K/V head dims,
E experts, N expert-sorted token-choices, L latent width, F ffn width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def _acc(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 for norms and rotations (bf16 inputs), and no downcast of float64 (tests)."""
    return x if x.dtype == torch.float64 else x.float()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = _acc(x)
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(xf.dtype)).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_cos_sin(positions_T: torch.Tensor, dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, dim/2] for non-interleaved (half-split) rotary embeddings."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions_T.device, dtype=torch.float32) / dim))
    ang = positions_T.float()[:, None] * inv_freq[None, :]
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of x [..., T, (heads,) R*2] with the half-split convention (not interleaved).
    x is [B, T, R*2] or [B, T, H, R*2]."""
    x1, x2 = _acc(x).chunk(2, dim=-1)
    if x.dim() == 4:
        cos_TR, sin_TR = cos_TR[:, None, :], sin_TR[:, None, :]
    out = torch.cat([x1 * cos_TR - x2 * sin_TR, x1 * sin_TR + x2 * cos_TR], dim=-1)
    return out.to(x.dtype)


class SwiGLU(nn.Module):
    """Dense FFN (also the shared expert): w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class CausalConv1d(nn.Module):
    """Depthwise causal conv over time (kernel k, no bias) followed by SiLU, on [B, T, C]."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))

    def forward(self, x_BTC: torch.Tensor) -> torch.Tensor:
        T = x_BTC.shape[1]
        y = F.conv1d(x_BTC.transpose(1, 2), self.weight.to(x_BTC.dtype), padding=self.kernel - 1,
                     groups=x_BTC.shape[-1])
        return F.silu(y[..., :T].transpose(1, 2))

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.weight, -(self.kernel ** -0.5), self.kernel ** -0.5)
