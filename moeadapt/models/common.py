"""Small building blocks shared by the model: RMSNorm, RoPE, SwiGLU MLP, causal depthwise conv.

Shape suffixes (legend used across models/): B batch, T time, D hidden, H heads, K/V head dims,
E experts, N expert-sorted token-choices, L latent width, F ffn width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import _get_current_dispatch_mode

from ..ops.cp_comm import predecessor_tails
from ..ops.kda.short_conv import causal_conv_silu, conv_with_history, fuses_head_norm, head_l2norm
from ..ops.moe import swiglu_pair
from .shared_input import shared_input_linears


def _acc(x: torch.Tensor) -> torch.Tensor:
    """At least fp32 for norms and rotations (bf16 inputs), and no downcast of float64 (tests)."""
    return x if x.dtype == torch.float64 else x.float()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.dtype,
             gate: torch.Tensor | None = None) -> torch.Tensor:
    """x / rms(x) * weight (fp32 math, or float64), times sigmoid(gate) when a gate is given, in dtype `out`."""
    xf = _acc(x)
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * weight.to(xf.dtype)
    if gate is not None:
        y = y * torch.sigmoid(gate.to(xf.dtype))
    return y.to(out)


_COMPILED: dict = {}


def compiled(fn):
    """fn through torch.compile with dynamic shapes, made once per function on first use. For the model's glue
    (norms, rotations, gates, casts): one fused kernel each way instead of a chain of elementwise passes, and with
    dynamic shapes every size the model meets (hidden, latent, head dims; training and evaluation batches)
    shares a handful of graphs rather than one per shape (Dynamo falls back to eager past its recompile limit)."""
    c = _COMPILED.get(fn)
    if c is None:
        c = _COMPILED[fn] = torch.compile(fn, dynamic=True)
    return c


def compiles(x: torch.Tensor) -> bool:
    """Whether glue on x runs compiled: on CUDA, and not inside a TorchDispatchMode (selective activation
    checkpointing's: the mode must see each op, which a compiled kernel hides)."""
    return x.is_cuda and _get_current_dispatch_mode() is None


def compiled_for(x: torch.Tensor, fn):
    """fn compiled where glue on x runs compiled (`compiles`), else fn itself: the same math either way."""
    return compiled(fn) if compiles(x) else fn


def _rms_norm_cuda(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.dtype,
                   gate: torch.Tensor | None) -> torch.Tensor:
    """rms_norm compiled: one fused kernel each way instead of ~6 elementwise / reduction passes (forward) and
    ~10 (backward). Inputs are flattened to [rows, dim]."""
    d = x.shape[-1]
    g2 = None if gate is None else gate.reshape(-1, d)
    return compiled(rms_norm)(x.reshape(-1, d), weight, eps, out, g2).view(x.shape)


def add_rms_norm(x: torch.Tensor, a: torch.Tensor, weight: torch.Tensor, eps: float,
                 out: torch.dtype, b: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + a (+ b), rms_norm of that sum): a residual add of one or two branch outputs (torch's type promotion:
    an fp32 stream plus a bf16 branch stays fp32) and the norm that reads the sum. Two branches add up first, as
    the MoE summed them before handing the block's output on, so eager results are bit for bit the same whether
    the add runs here or in the block (recompute modes, which keep it in the block, compare equal)."""
    s = x + a if b is None else x + (a + b)
    return s, rms_norm(s, weight, eps, out)


def _add_rms_norm_cuda(x, a, weight, eps, out, b=None):
    """add_rms_norm compiled: the add, the norm and (backward) the sum of the residual's and the norm's gradients
    with the branches' cast each as one kernel, instead of the adds, the norm and an add + a cast (flattened to
    [rows, dim], as _rms_norm_cuda)."""
    d = x.shape[-1]
    s, y = compiled(add_rms_norm)(x.reshape(-1, d), a.reshape(-1, d), weight, eps, out,
                                  None if b is None else b.reshape(-1, d))
    return s.view(x.shape), y.view(x.shape)


class RMSNorm(nn.Module):
    """RMSNorm in fp32 (or float64), optionally gated: norm(x) * weight * sigmoid(gate) (the KDA output gate).

    Under autocast an fp32 input (the residual stream) comes out in the autocast dtype: every GEMM after a norm
    casts its input anyway, so the cast happens once here instead of once per consuming projection (and its
    gradient is summed once); `autocast_output = False` keeps the input dtype. On CUDA the math runs through
    torch.compile (`compiled = False`: eager torch ops, as on CPU)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.autocast_output = True
        self.compiled = True

    def _out_dtype(self, x: torch.Tensor) -> torch.dtype:
        if self.autocast_output and x.dtype == torch.float32 and torch.is_autocast_enabled(x.device.type):
            return torch.get_autocast_dtype(x.device.type)
        return x.dtype

    def _compiles(self, x: torch.Tensor) -> bool:
        return self.compiled and compiles(x)

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> torch.Tensor:
        out = self._out_dtype(x)
        if self._compiles(x):
            return _rms_norm_cuda(x, self.weight, self.eps, out, gate)
        return rms_norm(x, self.weight, self.eps, out, gate)

    def after_add(self, x: torch.Tensor, *branch: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + sum(branch), self(x + sum(branch))) for a residual stream x and one or two branch outputs (the MoE's
        routed and shared experts' outputs may come unsummed): on CUDA one compiled pass each way
        (`add_rms_norm`). A module hook on this norm is honoured by running the two steps apart."""
        if (self._forward_hooks or self._forward_pre_hooks or len(branch) not in (1, 2)
                or any(a.shape != x.shape for a in branch)):
            s = x
            for a in branch:
                s = s + a
            return s, self(s)
        out = self._out_dtype(x)
        b = branch[1] if len(branch) == 2 else None
        if self._compiles(x):
            return _add_rms_norm_cuda(x, branch[0], self.weight, self.eps, out, b)
        return add_rms_norm(x, branch[0], self.weight, self.eps, out, b)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def yarn_mscale(scale: float, m: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 m ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0


def rope_inv_freq(dim: int, theta: float, scaling=None, device=None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin multiplier; `scaling`: a config.RopeScaling (YaRN) or None."""
    pos_freqs = theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    if scaling is None:
        return 1.0 / pos_freqs, 1.0
    f, orig = scaling.factor, scaling.original_max_position_embeddings

    def corr_dim(rotations: float) -> float:  # the dim index whose wavelength fits `rotations` times in orig
        return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = corr_dim(scaling.beta_fast), corr_dim(scaling.beta_slow)
    if scaling.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, device=device, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrap = 1 - ramp  # 1: keep the original frequency (fast dims), 0: interpolate by factor (slow dims)
    inv_freq = (1.0 / (f * pos_freqs)) * (1 - extrap) + (1.0 / pos_freqs) * extrap
    att = scaling.attention_factor
    if att is None:
        if scaling.mscale and scaling.mscale_all_dim:
            att = yarn_mscale(f, scaling.mscale) / yarn_mscale(f, scaling.mscale_all_dim)
        else:
            att = yarn_mscale(f)
    return inv_freq, float(att)


def rope_softmax_mscale(scaling) -> float:
    """Multiplier of the MLA softmax scale under YaRN (DeepSeek): mscale(factor, mscale_all_dim)^2 when set."""
    if scaling is None or not scaling.mscale_all_dim:
        return 1.0
    return yarn_mscale(scaling.factor, scaling.mscale_all_dim) ** 2


def rope_cos_sin(positions_T: torch.Tensor, dim: int, theta: float, scaling=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin tables [T, dim/2] for non-interleaved (half-split) rotary embeddings (YaRN when `scaling`);
    positions [B, T] (packed documents: per row) give tables [B, T, dim/2]."""
    inv_freq, att = rope_inv_freq(dim, theta, scaling, positions_T.device)
    ang = positions_T.float()[..., None] * inv_freq
    if att == 1.0:
        return ang.cos(), ang.sin()
    return ang.cos() * att, ang.sin() * att


def apply_rope(x: torch.Tensor, cos_TR: torch.Tensor, sin_TR: torch.Tensor) -> torch.Tensor:
    """Rotate the last dim of x [..., T, (heads,) R*2] with the half-split convention (not interleaved).
    x is [B, T, R*2] or [B, T, H, R*2]; cos / sin [T, R] (every row alike) or [B, T, R] (per row); R = 0 (no
    rope channels) returns x."""
    if x.shape[-1] == 0:
        return x
    x1, x2 = _acc(x).chunk(2, dim=-1)
    if x.dim() == 4:
        cos_TR, sin_TR = cos_TR[..., None, :], sin_TR[..., None, :]
    out = torch.cat([x1 * cos_TR - x2 * sin_TR, x1 * sin_TR + x2 * cos_TR], dim=-1)
    return out.to(x.dtype)


class SwiGLU(nn.Module):
    """Dense FFN (also the shared expert): w2(silu(w1 x) * w3 x) (clamped with `limit`); silu·mul through ops/moe swiglu_pair (one Triton
    pass each way on CUDA, keeping w1 x and w3 x for the backward; torch's ops on CPU)."""

    def __init__(self, dim: int, hidden: int, limit: float | None = None):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.limit = limit  # clamped SwiGLU (ModelSpec.swiglu_limit)
        self.backend = "auto"

    @property
    def _x_projections(self) -> tuple[nn.Module, ...]:
        """The layers that read x (looked up at each call: LoRA injection replaces them)."""
        return self.w1, self.w3

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(*shared_input_linears(x, self._x_projections))

    def down(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        """w2(silu(g) * u) for g = w1 x, u = w3 x computed by the caller (with other projections of x)."""
        a = swiglu_pair(g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1]), backend=self.backend,
                        limit=self.limit)
        return self.w2(a.view(g.shape))


class CausalConv1d(nn.Module):
    """Depthwise causal conv over time (kernel k, no bias) followed by SiLU, on [B, T, C]: ops.kda.causal_conv_silu
    (one Triton pass each way on CUDA, the torch conv1d composition on CPU or with backend "reference").

    Under context parallelism (`cp`, an ops.cp_comm.CPLayout set by parallel/), x holds this rank's pieces of
    the sequence and each piece starts from the previous piece's last k - 1 inputs instead of zeros (the torch
    conv1d composition over the pieces with their tails). With packed documents (`positions` [B, T], each
    token's position inside its document: models/documents.py) a token sees only its min(position, k - 1)
    predecessors, so the conv restarts at every document start, also across a cp piece boundary (there by k
    shifted multiply-adds in torch). `norm_dim` > 0 (KDA's q and k): the output L2-normalised over each group of
    norm_dim channels (one head), inside the Triton passes where they run."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.kernel = kernel
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))
        self.backend = "auto"
        self.cp = None

    def forward(self, x_BTC: torch.Tensor, positions: torch.Tensor | None = None, norm_dim: int = 0) -> torch.Tensor:
        n = self.kernel - 1
        if n == 0 or self.cp is None:
            return causal_conv_silu(x_BTC, self.weight, backend=self.backend, positions=positions, norm_dim=norm_dim)
        B, T, C = x_BTC.shape
        w = self.weight.to(x_BTC.dtype)
        J = self.cp.pieces_per_rank
        tails_JBNC = predecessor_tails(x_BTC, n, self.cp)
        x_NTC = torch.cat([tails_JBNC, x_BTC.view(B, J, T // J, C).transpose(0, 1)], 2).flatten(0, 1)
        pos_NT = None if positions is None else positions.view(B, J, T // J).transpose(0, 1).flatten(0, 1)
        y = conv_with_history(x_NTC, w, pos_NT)  # [J*B, T/J, C]
        return head_l2norm(F.silu(y.unflatten(0, (J, B)).transpose(0, 1).reshape(B, T, C)), norm_dim)

    def fuses_norm(self, x_BTC: torch.Tensor, norm_dim: int) -> bool:
        """Whether forward(x, norm_dim=norm_dim) normalises inside the conv's Triton passes (no cp split, a conv
        wider than 1, the Triton backend, a power-of-two head): a caller then has no norm pass of its own to
        run; elsewhere the norm would be one more pass, better left where the consumer does it in fp32."""
        return self.kernel > 1 and self.cp is None and fuses_head_norm(x_BTC, norm_dim, self.backend)

    def reset_parameters(self) -> None:
        nn.init.uniform_(self.weight, -(self.kernel ** -0.5), self.kernel ** -0.5)

