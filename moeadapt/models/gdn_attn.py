"""GatedDeltaNet ("gdn" layers): the Gated DeltaNet linear attention of Qwen3-Next / Qwen3.5, served by the KDA op.

Gated DeltaNet is KDA with one decay per head: the per-step state update S <- exp(g_t) S + beta_t k_t (v_t -
S^T k_t)^T with g_t a scalar per value head, so `moeadapt.ops.kda.chunk_kda` runs it with the gate broadcast over
the key channels (and grouped value heads: HV a multiple of the HK query/key heads, value head j reading key head
j // (HV / HK)). Projections as the checkpoints hold them (`spec.gdn_proj_layout`):
- "grouped" (Qwen3-Next): one fused projection per token for q, k, v and the output gate z, grouped per key head
  ([q_h | k_h | v of the head's value group | z of the group]), and one for beta / the decay input (b, a), grouped
  the same way;
- "split" (Qwen3.5): in_proj_qkv ([q of all heads | k of all heads | v of all heads]), in_proj_z, in_proj_b and
  in_proj_a, each head-major.
Then one causal depthwise conv (+ SiLU) over the concatenated q, k, v channels, decay g = -exp(A_log) * softplus(a + dt_bias),
L2-normalised q and k (inside the op), then a per-head RMSNorm of the output gated by SiLU(z), then out_proj.
Owns only its own parameters.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelSpec
from .common import CausalConv1d, _acc
from .documents import Documents, run_kda


class GatedRMSNorm(nn.Module):
    """RMSNorm over the last dim, times weight, times SiLU(gate) (the gate in fp32)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def init_rules(self) -> dict:
        from .init import Rule

        return {"weight": Rule("const", 1.0)}

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        xf = _acc(x)
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight.to(x.dtype)
        return (_acc(y) * F.silu(_acc(gate))).to(x.dtype)


class GatedDeltaNet(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        d = spec.hidden_size
        HK, HV, Dk, Dv = spec.gdn_n_key_heads, spec.gdn_n_value_heads, spec.gdn_key_head_dim, spec.gdn_value_head_dim
        self.HK, self.HV, self.Dk, self.Dv = HK, HV, Dk, Dv
        self.split = spec.gdn_proj_layout == "split"
        if self.split:
            self.in_proj_qkv = nn.Linear(d, 2 * HK * Dk + HV * Dv, bias=False)
            self.in_proj_z = nn.Linear(d, HV * Dv, bias=False)
            self.in_proj_b = nn.Linear(d, HV, bias=False)
            self.in_proj_a = nn.Linear(d, HV, bias=False)
        else:
            self.in_proj_qkvz = nn.Linear(d, 2 * HK * Dk + 2 * HV * Dv, bias=False)
            self.in_proj_ba = nn.Linear(d, 2 * HV, bias=False)
        self.conv1d = CausalConv1d(2 * HK * Dk + HV * Dv, spec.kda_conv_size)
        self.dt_bias = nn.Parameter(torch.empty(HV))
        self.A_log = nn.Parameter(torch.empty(HV))
        self.norm = GatedRMSNorm(Dv, spec.norm_eps)
        self.out_proj = nn.Linear(HV * Dv, d, bias=False)
        self.backend = "auto"

    def init_rules(self) -> dict:
        """models/init.py's rules for the decay parameters (KDA's, one per value head)."""
        from .init import Rule

        return {"A_log": Rule("log_uniform", 1.0, 16.0), "dt_bias": Rule("inv_softplus", 1e-3, 1e-1)}

    def reset_parameters(self) -> None:
        with torch.no_grad():
            nn.init.ones_(self.norm.weight)
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def forward(self, x_BTD: torch.Tensor, docs: Documents | None = None, **_) -> tuple[torch.Tensor, dict]:
        """docs: packed documents (models/documents.py): the conv and the state restart at each document start."""
        B, T, _ = x_BTD.shape
        HK, HV, Dk, Dv = self.HK, self.HV, self.Dk, self.Dv
        pos = None if docs is None else docs.position_ids
        if self.split:
            mixed = self.conv1d(self.in_proj_qkv(x_BTD), pos)
            z, b, a = self.in_proj_z(x_BTD), self.in_proj_b(x_BTD), self.in_proj_a(x_BTD)
        else:
            r = HV // HK
            qkvz = self.in_proj_qkvz(x_BTD).view(B, T, HK, 2 * Dk + 2 * r * Dv)
            q, k, v, z = torch.split(qkvz, [Dk, Dk, r * Dv, r * Dv], dim=-1)
            b, a = torch.split(self.in_proj_ba(x_BTD).view(B, T, HK, 2 * r), [r, r], dim=-1)
            mixed = self.conv1d(torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1),
                                pos)
        q, k, v = torch.split(mixed, [HK * Dk, HK * Dk, HV * Dv], dim=-1)
        q, k, v = q.view(B, T, HK, Dk), k.view(B, T, HK, Dk), v.reshape(B, T, HV, Dv)
        g_raw = a.reshape(B, T, HV, 1).expand(B, T, HV, Dk)  # one decay per head, broadcast over the key channels
        o = run_kda(q, k, v, g_raw, b.reshape(B, T, HV).float(), docs, backend=self.backend, use_qk_l2norm=True,
                    A_log=self.A_log, dt_bias=self.dt_bias[:, None].expand(HV, Dk), beta_is_logits=True)
        o = self.norm(o.to(x_BTD.dtype), z.reshape(B, T, HV, Dv))
        return self.out_proj(o.reshape(B, T, HV * Dv)), {}
