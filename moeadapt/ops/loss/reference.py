"""Plain-PyTorch linear + cross-entropy: the specification and the CPU path of `linear_cross_entropy`.

loss = sum_i weight_i * CE(h_i W^T, label_i), rows with label -100 contributing 0. The logits are made in the
dtype of h and W (bf16 under autocast) and the softmax runs in fp32, as the model's loss always has.
Shapes: h [N, D], w [V, D] (the LM head's weight), labels [N] int64 (-100 = no loss), weight [N] float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear_cross_entropy_reference(h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor,
                                   weight_N: torch.Tensor) -> torch.Tensor:
    logits = F.linear(h_ND, w_VD)
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    per_tok = F.cross_entropy(logits.to(acc), labels_N, ignore_index=-100, reduction="none")
    return (per_tok * weight_N.to(acc)).sum()
