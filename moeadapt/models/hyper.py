"""Hyper-connections (manifold-constrained, mHC, as in GLM-5.3-Flash): N = spec.hc_mult residual streams.

Owns one sublayer's (attention's or the FFN's) mixing weights: `fn` [(2 + N) N, N D], `base` [(2 + N) N] and
`scale` [3]. Per token, from the N streams x [N, D] flattened and RMS-normalised without a weight (eps =
spec.norm_eps), in fp32 (fp64 kept):
    [a_pre | a_post | a_comb] = norm(x) fnᵀ
    pre  = sigmoid(a_pre scale_0 + base_pre) + eps                       [N]
    post = 2 sigmoid(a_post scale_1 + base_post)                         [N]
    comb = Sinkhorn(softmax_rows(a_comb scale_2 + base_comb) + eps)      [N, N], doubly stochastic
with Sinkhorn = normalise the columns, then (iters - 1) times the rows and the columns (each divided by its
sum + eps). The sublayer reads the collapsed stream sum_n pre_n x_n; its output y [D] goes back as
    x'_n = post_n y + sum_m comb[m, n] x_m.
The model expands the embedding into N copies before the first block and takes the mean of the streams before
the final norm (models/model.py). Touches nothing outside its own parameters.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelSpec


def sinkhorn(m: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """Columns, then (iters - 1) x (rows, columns) of [..., N, N] divided by their sums + eps."""
    m = m / (m.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        m = m / (m.sum(-1, keepdim=True) + eps)
        m = m / (m.sum(-2, keepdim=True) + eps)
    return m


def hc_weights(x_BTND: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, iters: int,
               eps: float, norm_eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pre [B,T,N], post [B,T,N], comb [B,T,N,N]) in fp32 (fp64 for fp64 input); see the module docstring."""
    B, T, N, D = x_BTND.shape
    dt = torch.float64 if x_BTND.dtype == torch.float64 else torch.float32
    with torch.autocast(x_BTND.device.type, enabled=False):
        flat = x_BTND.reshape(B, T, N * D).to(dt)
        flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + norm_eps)
        a = F.linear(flat, fn.to(dt))
        a_pre, a_post, a_comb = a.split([N, N, N * N], dim=-1)
        b_pre, b_post, b_comb = base.to(dt).split([N, N, N * N])
        s = scale.to(dt)
        pre = torch.sigmoid(a_pre * s[0] + b_pre) + eps
        post = 2 * torch.sigmoid(a_post * s[1] + b_post)
        comb = torch.softmax((a_comb * s[2] + b_comb).view(B, T, N, N), dim=-1) + eps
        return pre, post, sinkhorn(comb, iters, eps)


class HyperConnection(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        N, d = spec.hc_mult, spec.hidden_size
        self.n, self.iters, self.eps, self.norm_eps = N, spec.hc_sinkhorn_iters, spec.hc_eps, spec.norm_eps
        self.fn = nn.Parameter(torch.empty((2 + N) * N, N * d))
        self.base = nn.Parameter(torch.empty((2 + N) * N))
        self.scale = nn.Parameter(torch.empty(3))
        self.std = spec.initializer_range

    def reset_parameters(self) -> None:
        nn.init.normal_(self.fn, std=self.std)
        nn.init.zeros_(self.base)
        nn.init.ones_(self.scale)

    def init_rules(self) -> dict:
        from .init import Rule

        return {"fn": Rule("normal", self.std), "base": Rule("const", 0.0), "scale": Rule("const", 1.0)}

    def forward(self, x_BTND: torch.Tensor) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """The sublayer's input sum_n pre_n x_n [B,T,D] (x's dtype) and the (post, comb) that `merge` takes."""
        pre, post, comb = hc_weights(x_BTND, self.fn, self.base, self.scale, self.iters, self.eps, self.norm_eps)
        h_BTD = (pre.unsqueeze(-1) * x_BTND).sum(2).to(x_BTND.dtype)
        return h_BTD, (post, comb)

    @staticmethod
    def merge(y_BTD: torch.Tensor, x_BTND: torch.Tensor, weights: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The new streams x'_n = post_n y + sum_m comb[m, n] x_m, [B,T,N,D] in x's dtype."""
        post, comb = weights
        dt = x_BTND.dtype
        return post.to(dt).unsqueeze(-1) * y_BTD.to(dt).unsqueeze(-2) + comb.to(dt).transpose(-1, -2) @ x_BTND
