"""The experts' gate and up projections as one grouped GEMM each way, for trained weights whose bf16 copies lie in
one buffer (train/copies.py pairs w1's and w3's copies as the two row halves of each expert's [2F, I]).

    h_N2F = [x W1_e^T | x W3_e^T]        one GEMM over the [E, 2F, I] buffer (N = 2F)
    dx    = dh W_e  (W_e = [W1_e; W3_e])  one GEMM with K = 2F: no second GEMM and no add of two [N, I] halves
    dW1_e = dh[:, :F]^T x,  dW3_e = dh[:, F:]^T x   (each [E, F, I], contiguous: the weights' own gradients)

The math is two `grouped_mm`s side by side (reference.py `grouped_mm_reference`); the tests compare against that.
"""

from __future__ import annotations

import torch

from .lean_lora import is_gate_up_view


class _GateUpMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_NI, w1_EFI, w3_EFI, pair_E2FI, offsets_E):
        ctx.save_for_backward(x_NI, pair_E2FI, offsets_E)
        return torch._grouped_mm(x_NI, pair_E2FI.transpose(1, 2), offs=offsets_E)

    @staticmethod
    def backward(ctx, dh_N2F):
        x_NI, pair_E2FI, offsets_E = ctx.saved_tensors
        F = pair_E2FI.shape[1] // 2
        dh_N2F = dh_N2F.contiguous()
        dx = torch._grouped_mm(dh_N2F, pair_E2FI, offs=offsets_E) if ctx.needs_input_grad[0] else None
        dw1 = torch._grouped_mm(dh_N2F[:, :F].t(), x_NI, offs=offsets_E) if ctx.needs_input_grad[1] else None
        dw3 = torch._grouped_mm(dh_N2F[:, F:].t(), x_NI, offs=offsets_E) if ctx.needs_input_grad[2] else None
        return dx, dw1, dw3, None, None


def paired(w1_EFI: torch.Tensor, w3_EFI: torch.Tensor) -> torch.Tensor | None:
    """The [E, 2F, I] buffer whose row halves w1 and w3 are (w1 rows [0, F), w3 rows [F, 2F) of each expert),
    or None where they are not laid out so."""
    base = w1_EFI._base
    if base is None or w3_EFI._base is not base or base.dim() != 3 or not base.is_contiguous():
        return None
    return base if is_gate_up_view(w1_EFI, w3_EFI, base, 0) else None  # the lean path's buffer with no rank rows


def gate_up_mm(x_NI: torch.Tensor, w1_EFI: torch.Tensor, w3_EFI: torch.Tensor, pair_E2FI: torch.Tensor,
               offsets_E: torch.Tensor) -> torch.Tensor:
    """[x W1_e^T | x W3_e^T] over expert-sorted rows, [N, 2F] (module docstring); w1 / w3 are the row halves of
    `pair_E2FI` (`paired`), which the GEMMs read, and their gradients are their own."""
    return _GateUpMM.apply(x_NI, w1_EFI, w3_EFI, pair_E2FI, offsets_E)
