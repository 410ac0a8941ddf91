"""The language-model loss: linear (LM head) + cross-entropy, `linear_cross_entropy`, and its backends.

Owns the argument contract; the math lives in `reference.py` (logits, then F.cross_entropy: the CPU path and
spec) and the memory-lean version in `chunked.py` (row chunks, gradients made in the forward, no [N x V] fp32
logits), whose per-chunk softmax and gradient run in `triton_ce.py`'s kernel (backend "triton", the CUDA
default) or in torch ops (backend "chunked"). Under autocast, h and W are cast once to the autocast dtype here
(the LM head's GEMMs run in bf16 as nn.Linear's would); the softmax is fp32 either way.
"""

from __future__ import annotations

import torch

from .chunked import linear_cross_entropy_chunked
from .reference import linear_cross_entropy_reference

__all__ = ["linear_cross_entropy", "linear_cross_entropy_reference", "linear_cross_entropy_chunked"]

BACKENDS = ("auto", "reference", "chunked", "triton")


def linear_cross_entropy(h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor,
                         weight_N: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """sum_i weight_i * cross_entropy(h_i W^T, label_i), label -100 contributing 0.

    h [N, D] hidden states, w [V, D] LM-head weight, labels [N] int64, weight [N] float (e.g. 1 / valid count
    for a mean). backend: "auto" ("triton" on CUDA, reference elsewhere), "reference", "chunked" (row chunks,
    torch ops) or "triton" (row chunks, each chunk's softmax and gradient in one Triton kernel)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}.")
    if h_ND.dim() != 2 or w_VD.dim() != 2 or h_ND.shape[1] != w_VD.shape[1]:
        raise ValueError(f"linear_cross_entropy needs h [N, D] and w [V, D] with the same D, got h "
                         f"{list(h_ND.shape)} and w {list(w_VD.shape)}.")
    if labels_N.shape != (h_ND.shape[0],) or weight_N.shape != (h_ND.shape[0],):
        raise ValueError(f"labels and weight must have shape [N] = [{h_ND.shape[0]}], got {list(labels_N.shape)} "
                         f"and {list(weight_N.shape)}.")
    dev = h_ND.device.type
    if torch.is_autocast_enabled(dev) and h_ND.dtype != torch.float64:
        dt = torch.get_autocast_dtype(dev)
        h_ND, w_VD = h_ND.to(dt), w_VD.to(dt)
    if backend == "reference" or (backend == "auto" and dev != "cuda"):
        return linear_cross_entropy_reference(h_ND, w_VD, labels_N, weight_N)
    with torch.autocast(dev, enabled=False):
        return linear_cross_entropy_chunked(h_ND, w_VD, labels_N, weight_N, use_triton=backend != "chunked")
