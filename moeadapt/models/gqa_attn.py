"""GQAAttention: plain causal grouped-query softmax attention ("gqa" layers), for onboarded families that use
it (qwen3_moe). Not part of the hybrid KDA/DSA design; it exists so such checkpoints map faithfully.

q/k/v projections (n_heads query heads, gqa_n_kv_heads shared key/value heads of gqa_head_dim), optional
per-head RMSNorm on q and k (Qwen3's qk-norm), half-split RoPE over the whole head dim or its first gqa_rope_dim
channels (its own tables: the model's cos/sin are sized for the MLA rope dim), causal SDPA, optionally the
output times sigmoid of a per-channel gate that q_proj also produces (Qwen3-Next), output projection. Owns only its own
parameters. Backend: torch SDPA on every device (flash / memory-efficient kernels on CUDA).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ModelSpec
from .common import RMSNorm, apply_rope, rope_cos_sin
from .documents import Documents


class GQAAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        d, H, HK, Dh = spec.hidden_size, spec.n_heads, spec.gqa_n_kv_heads, spec.gqa_head_dim
        self.n_heads, self.n_kv_heads, self.head_dim, self.theta = H, HK, Dh, spec.rope_theta
        self.rope_scaling = spec.rope_scaling
        self.out_gate = spec.gqa_output_gate
        self.rope_dim = spec.gqa_rope_dim or Dh
        self.q_proj = nn.Linear(d, H * Dh * (2 if self.out_gate else 1), bias=False)
        self.k_proj = nn.Linear(d, HK * Dh, bias=False)
        self.v_proj = nn.Linear(d, HK * Dh, bias=False)
        self.o_proj = nn.Linear(H * Dh, d, bias=False)
        self.norm_full = spec.gqa_qk_norm_full  # one RMSNorm over all heads' channels instead of per head
        self.q_norm = RMSNorm(H * Dh if self.norm_full else Dh, eps=spec.norm_eps) if spec.gqa_qk_norm else None
        self.k_norm = RMSNorm(HK * Dh if self.norm_full else Dh, eps=spec.norm_eps) if spec.gqa_qk_norm else None
        self.backend = "auto"  # SDPA picks its kernel; kept so set_backend() treats every layer alike

    def forward(self, x_BTD: torch.Tensor, docs: Documents | None = None, **_) -> tuple[torch.Tensor, dict]:
        B, T, _ = x_BTD.shape
        H, HK, Dh = self.n_heads, self.n_kv_heads, self.head_dim
        gate = None
        if self.out_gate:  # per head [q | gate]
            q_BTHK, gate = self.q_proj(x_BTD).view(B, T, H, 2 * Dh).chunk(2, dim=-1)
        else:
            q_BTHK = self.q_proj(x_BTD).view(B, T, H, Dh)
        k_BTHK = self.k_proj(x_BTD).view(B, T, HK, Dh)
        v_BTHK = self.v_proj(x_BTD).view(B, T, HK, Dh)
        if self.q_norm is not None and self.norm_full:
            q_BTHK = self.q_norm(q_BTHK.reshape(B, T, H * Dh)).view(B, T, H, Dh)
            k_BTHK = self.k_norm(k_BTHK.reshape(B, T, HK * Dh)).view(B, T, HK, Dh)
        elif self.q_norm is not None:
            q_BTHK, k_BTHK = self.q_norm(q_BTHK), self.k_norm(k_BTHK)
        rd = self.rope_dim
        pos = torch.arange(T, device=x_BTD.device) if docs is None else docs.position_ids
        cos, sin = rope_cos_sin(pos, rd, self.theta, self.rope_scaling)
        if rd == Dh:
            q_BTHK, k_BTHK = apply_rope(q_BTHK, cos, sin), apply_rope(k_BTHK, cos, sin)
        else:  # partial RoPE: the first rd channels rotate, the rest pass through
            q_BTHK = torch.cat([apply_rope(q_BTHK[..., :rd], cos, sin), q_BTHK[..., rd:]], dim=-1)
            k_BTHK = torch.cat([apply_rope(k_BTHK[..., :rd], cos, sin), k_BTHK[..., rd:]], dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q_BTHK, k_BTHK, v_BTHK))
        if HK != H:
            k, v = k.repeat_interleave(H // HK, dim=1), v.repeat_interleave(H // HK, dim=1)
        if docs is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=Dh ** -0.5)
        else:  # causal within each document
            same_BTT = docs.doc_ids[:, :, None] == docs.doc_ids[:, None, :]
            mask = (same_BTT & torch.ones(T, T, dtype=torch.bool, device=q.device).tril()).unsqueeze(1)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=Dh ** -0.5)
        o = o.transpose(1, 2).reshape(B, T, H * Dh)
        if gate is not None:
            o = o * torch.sigmoid(gate.reshape(B, T, H * Dh))
        return self.o_proj(o), {}
