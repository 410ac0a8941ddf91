"""KDAAttention: the Kimi Delta Attention layer (as in Kimi Linear) around `moeadapt.ops.kda.chunk_kda`.

q, k, v projections -> causal depthwise conv (k=4) + SiLU -> L2-normalised q, k (per head: inside the conv's
Triton passes where they run, ops/kda/short_conv.py's norm_dim; elsewhere inside the op, in its fp32 math);
beta = sigmoid(x W_b) (logits passed to the op); channel-wise gate
g = -exp(A_log[h]) * softplus(x W_f_a W_f_b + dt_bias) (computed inside the op from the raw projection), or
with spec.kda_gate_lower_bound b the lower-bounded g = b * sigmoid(exp(A_log[h]) * (x W_f_a W_f_b + dt_bias));
output: per-head RMSNorm gated by sigmoid(x W_g_a W_g_b), then o_proj. Owns only its own parameters.
The six projections of x (q, k, v, f_a, b, g_a) run as one autograd node (models/shared_input.py).
Under context parallelism (`cp` set by parallel/) the state crosses ranks through ops/kda/cp.py. With packed
documents (`docs`, models/documents.py) the convs and the state restart at every document start.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..config import ModelSpec
from .common import CausalConv1d, RMSNorm
from .documents import Documents, run_kda
from .shared_input import shared_input_linears


class KDAAttention(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        d, H, K = spec.hidden_size, spec.kda_n_heads, spec.kda_head_dim
        self.n_heads, self.head_dim = H, K
        self.q_proj = nn.Linear(d, H * K, bias=False)
        self.k_proj = nn.Linear(d, H * K, bias=False)
        self.v_proj = nn.Linear(d, H * K, bias=False)
        self.q_conv = CausalConv1d(H * K, spec.kda_conv_size)
        self.k_conv = CausalConv1d(H * K, spec.kda_conv_size)
        self.v_conv = CausalConv1d(H * K, spec.kda_conv_size)
        self.f_a = nn.Linear(d, K, bias=False)  # gate, low rank = head dim
        self.f_b = nn.Linear(K, H * K, bias=False)
        self.b_proj = nn.Linear(d, H, bias=False)
        self.A_log = nn.Parameter(torch.empty(H))
        self.dt_bias = nn.Parameter(torch.empty(H * K))
        self.g_a = nn.Linear(d, K, bias=False)  # output gate, low rank
        self.g_b = nn.Linear(K, H * K, bias=False)
        self.o_norm = RMSNorm(K, eps=spec.norm_eps)
        self.o_proj = nn.Linear(H * K, d, bias=False)
        self.gate_lower_bound = spec.kda_gate_lower_bound
        self.backend = "auto"
        self.cp = None  # an ops.cp_comm.CPLayout when parallel/ splits the sequence over a cp group

    @property
    def _x_projections(self) -> tuple[nn.Module, ...]:
        """The layers that read x (looked up at each call: LoRA injection replaces them)."""
        return self.q_proj, self.k_proj, self.v_proj, self.f_a, self.b_proj, self.g_a

    def reset_parameters(self) -> None:
        with torch.no_grad():
            if self.gate_lower_bound is not None:  # as fla / transformers initialise the lower-bounded gate
                self.A_log.zero_()
            else:
                self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.exp(torch.empty_like(self.dt_bias).uniform_(math.log(1e-3), math.log(1e-1)))
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))  # inverse softplus

    def forward(self, x_BTD: torch.Tensor, docs: Documents | None = None, **_) -> tuple[torch.Tensor, dict]:
        B, T, _ = x_BTD.shape
        H, K = self.n_heads, self.head_dim
        pos = None if docs is None else docs.position_ids
        # the six projections of x as one autograd node: one dx buffer, the LoRA adapters' products batched
        q, k, v, f, b, g = shared_input_linears(x_BTD, self._x_projections)
        # q and k L2-normalised per head by the convs' Triton passes where they run, else by chunk_kda
        fused = self.q_conv.fuses_norm(q, K) and self.k_conv.fuses_norm(k, K)
        q = self.q_conv(q, pos, norm_dim=K if fused else 0).view(B, T, H, K)
        k = self.k_conv(k, pos, norm_dim=K if fused else 0).view(B, T, H, K)
        v = self.v_conv(v, pos).view(B, T, H, K)
        g_raw = self.f_b(f).view(B, T, H, K)
        beta_logits = b.float()
        opts = dict(backend=self.backend, use_qk_l2norm=not fused, A_log=self.A_log, dt_bias=self.dt_bias,
                    beta_is_logits=True)
        if self.gate_lower_bound is not None:
            opts["gate_lower_bound"] = self.gate_lower_bound
        o = run_kda(q, k, v, g_raw, beta_logits, docs, self.cp, **opts)
        gate_logits = self.g_b(g).view(B, T, H, K)
        o = self.o_norm(o.to(x_BTD.dtype), gate=gate_logits)  # norm(o) * sigmoid(gate) in one pass
        return self.o_proj(o.reshape(B, T, H * K)), {}
