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
"""

from __future__ import annotations

import torch


def adamw_reference(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, step: int, lr: float,
                    betas: tuple[float, float], eps: float, weight_decay: float,
                    grad_scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p, m, v) after one AdamW step; the inputs are left as they are. step: the count after this step."""
    b1, b2 = betas
    g = g.to(p.dtype)
    if grad_scale is not None:
        g = g / grad_scale
    p = p * (1 - lr * weight_decay)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    bc1, bc2 = 1 - b1 ** step, 1 - b2 ** step
    p = p - (lr / bc1) * m / (v.sqrt() / bc2 ** 0.5 + eps)
    return p, m, v


def grad_norm_reference(grads: list[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm of a list of gradients, summed in float64."""
    return torch.stack([g.double().pow(2).sum() for g in grads]).sum().sqrt()
