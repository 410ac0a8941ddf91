"""AdamW as torch.optim.AdamW computes it, written out: the spec of `triton_adamw.py`'s kernels.

One step on one tensor, in p's dtype (float64 in the tests):
    g  = grad / grad_scale                      (the gradient clip folded in: grad_scale = max(1, norm / max_norm))
    p  = p * (1 - lr * weight_decay)            (decoupled weight decay)
    m  = beta1 * m + (1 - beta1) * g
    v  = beta2 * v + (1 - beta2) * g^2
    p  = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
t is the step count after this step (1 on the first). A step with found_inf set changes nothing (torch's fused
AdamW's skip flag). The gradient norm the clip uses is sqrt(sum over tensors of sum(g^2)), summed in float32 or
wider whatever the gradients' dtype.

Moments kept in bf16 (`train.moment_dtype: bf16`): m and v are read as fp32, the step above runs in fp32 (the
weight's update uses the unrounded m and v), and m and v are stored stochastically rounded to bf16
(`stochastic_round_bf16`): rounded up in magnitude with probability equal to the fraction bf16 drops, so the
stored moment is the fp32 one in expectation. Round-to-nearest would lose v's small steps: with beta2 = 0.95
the update moves v by 5% of (g^2 - v), with 0.999 by 0.1%, under bf16's 0.4% spacing. The random bits are
deterministic (`moment_bits`): a hash of (seed, the tensor's index in its launch, the step count) and the
element's index.

Weights kept in bf16 (`train.weight_dtype: bf16`, full fine-tuning): no fp32 weight at all. The step reads the
bf16 weight as fp32, runs as above and stores the new weight stochastically rounded to bf16, with 16 more random
bits per element (`weight_bits`). An update smaller than half of bf16's spacing (lr x ~1 against a weight of
magnitude |w|: 0.4% of |w|), which round-to-nearest would drop every step, moves the weight in expectation.

Weights kept split (`train.weight_dtype: fp32_split`, full fine-tuning): the fp32 weight exactly, as two 16-bit
halves (`split_fp32`): hi, its bf16 rounding (to nearest, ties away from zero), is the parameter the matmuls
read, and lo = bits(w) - bits(hi), a signed 16-bit integer, sits in the optimizer's state. The step rebuilds the
fp32 weight (`join_fp32`), runs the update above in fp32 and splits the result again: the fp32 trajectory bit
for bit, with no separate bf16 copy (4 bytes a parameter for the weight, as fp32, and 2 fewer moved a step).
"""

from __future__ import annotations

import torch


def adamw_reference(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float,
                    grad_scale: float | None = None,
                    bits: torch.Tensor | None = None, p_bits: torch.Tensor | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p, m, v) after one AdamW step; the inputs are left as they are. step: the count after this step.
    bits (`moment_bits`, bf16 moments): m and v come back stochastically rounded to bf16 by them.
    p_bits (`weight_bits`, bf16 weights): p comes back stochastically rounded to bf16 by them."""
    b1, b2 = betas
    g = g.to(p.dtype)
    m, v = m.to(p.dtype), v.to(p.dtype)
    if grad_scale is not None:
        g = g / grad_scale
    p = p * (1 - lr * weight_decay)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    p = p - (lr / bc1) * m / (v.sqrt() / bc2 ** 0.5 + eps)
    if p_bits is not None:
        p = stochastic_round_bf16(p.float(), p_bits.view(p.shape))
    if bits is not None:
        m = stochastic_round_bf16(m.float(), bits.view(m.shape) & 0xFFFF)
        v = stochastic_round_bf16(v.float(), bits.view(v.shape) >> 16)
    return p, m, v


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A bijective 32-bit integer hash (Wellons' lowbias32) of int64 tensors holding uint32 values."""
    M = 0xFFFFFFFF
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & M
    x = x ^ (x >> 15)
    x = (x * 0x846CA68B) & M
    return x ^ (x >> 16)


def moment_bits(seed: int, tensor_index: int, step: int, numel: int) -> torch.Tensor:
    """The random bits of one tensor's bf16 moments at one step, int64 [numel]: the low 16 bits round m, the
    high 16 round v."""
    key = hash32(hash32(torch.tensor(tensor_index ^ (seed & 0x7FFFFFFF))) ^ step)
    return hash32(torch.arange(numel) ^ key)


def weight_bits(bits: torch.Tensor) -> torch.Tensor:
    """The 16 random bits that round a bf16 weight, from its element's `moment_bits`."""
    return hash32(bits) & 0xFFFF


def stochastic_round_bf16(x: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """fp32 x to bf16, rounded by 16 random bits r (int64 in [0, 2^16)): r is added to the 16 bits bf16 drops
    and they are cut, so |x| rounds up with probability (dropped bits) / 2^16."""
    bits = x.float().view(torch.int32).long() & 0xFFFFFFFF
    bits = ((bits + r) & 0xFFFF0000)
    return torch.where(bits >= 2**31, bits - 2**32, bits).int().view(torch.float32).to(torch.bfloat16)


def grad_norm_reference(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of a list of gradients, summed in float64."""
    return torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt()


def split_fp32(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 x -> (hi bf16, lo int16) with join_fp32(hi, lo) == x bit for bit: hi is x rounded to the nearest bf16
    (ties away from zero: 0x8000 added to x's bits, the low 16 cut), lo the difference of the two bit patterns,
    which lies in [-2^15, 2^15)."""
    bits = x.float().contiguous().view(torch.int32).long()
    hi = (bits + 0x8000) & ~0xFFFF  # int64: no wrap; the top bit is the sign bit of the int32 pattern
    lo = bits - hi
    hi16 = (hi >> 16) & 0xFFFF
    hi16 = torch.where(hi16 >= 2**15, hi16 - 2**16, hi16)
    return hi16.to(torch.int16).view(torch.bfloat16), lo.to(torch.int16)


def join_fp32(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32 weight of a (hi bf16, lo int16) pair (`split_fp32`): bits(hi) << 16, plus lo."""
    bits = (hi.contiguous().view(torch.int16).long() << 16) + lo.long()
    bits = bits & 0xFFFFFFFF
    return torch.where(bits >= 2**31, bits - 2**32, bits).int().view(torch.float32)
