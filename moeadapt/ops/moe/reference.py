"""Plain-PyTorch MoE operators: the specification and the CPU path.

Owns the math of token permutation, grouped matmul and grouped LoRA; every function is
differentiable by autograd and loops over no expert. The Triton kernels
(`triton_permute.py`, `triton_grouped_mm.py`) must agree with these functions.

Shape suffixes (torchtitan style):
  T tokens, K choices per token (top-k), E experts, N routed rows (non-dropped choices),
  D hidden width, I / O input / output width of a grouped matmul, R LoRA rank,
  C capacity (largest group, padded buffers only).
"""

from __future__ import annotations

import torch


def permute_reference(
    x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, num_experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sort token choices expert-major (stable in t*K+k); see `moeadapt.ops.moe.permute`."""
    row_index_N, counts_E = permutation_reference(expert_ids_TK, num_experts)
    x_sorted_ND = x_TD[row_index_N // expert_ids_TK.shape[1]]
    return x_sorted_ND, row_index_N, counts_E


def permutation_reference(expert_ids_TK: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(row_index_N, counts_E) of `permute_reference` without gathering any row."""
    ids_M = expert_ids_TK.reshape(-1)  # M = T*K token choices
    # dropped choices (-1) sort after every expert and are cut off below
    key_M = torch.where(ids_M < 0, torch.full_like(ids_M, num_experts), ids_M)
    order_M = torch.argsort(key_M, stable=True)
    counts_E = torch.bincount(ids_M[ids_M >= 0], minlength=num_experts)
    N = int(counts_E.sum())
    return order_M[:N], counts_E


def unpermute_reference(
    y_sorted_ND: torch.Tensor, row_index_N: torch.Tensor, weights_TK: torch.Tensor, num_tokens: int
) -> torch.Tensor:
    """Weighted sum of each token's expert rows in fp32; see `moeadapt.ops.moe.unpermute`."""
    K = weights_TK.shape[1]
    w_N = weights_TK.reshape(-1)[row_index_N].float()
    contrib_ND = y_sorted_ND.float() * w_N[:, None]
    y_TD = torch.zeros(num_tokens, y_sorted_ND.shape[1], dtype=torch.float32, device=y_sorted_ND.device)
    y_TD = y_TD.index_add(0, row_index_N // K, contrib_ND)
    return y_TD.to(y_sorted_ND.dtype)


def _rows_to_padded(offsets_E: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor, int]:
    """For each sorted row: its expert and its slot within that expert's padded block."""
    offsets_E = offsets_E.long()
    starts_E = torch.cat([offsets_E.new_zeros(1), offsets_E[:-1]])
    counts_E = offsets_E - starts_E
    expert_N = torch.repeat_interleave(torch.arange(len(counts_E), device=offsets_E.device), counts_E)
    expert_N = expert_N[:num_rows]
    slot_N = torch.arange(expert_N.shape[0], device=offsets_E.device) - starts_E[expert_N]
    capacity = int(counts_E.max()) if len(counts_E) else 0
    return expert_N, slot_N, capacity


def grouped_mm_reference(x_sorted_NI: torch.Tensor, w_EIO: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """y[rows of e] = x[rows of e] @ w[e], as one padded batched matmul (no loop over experts).

    Rows past offsets[-1] (if any) get zeros. Autograd gives dx and dw (and skips dw for a frozen w).
    """
    N, I = x_sorted_NI.shape
    E, _, O = w_EIO.shape
    expert_N, slot_N, C = _rows_to_padded(offsets_E, N)
    x_pad_ECI = x_sorted_NI.new_zeros(E, C, I).index_put((expert_N, slot_N), x_sorted_NI[: len(expert_N)])
    y_pad_ECO = torch.bmm(x_pad_ECI, w_EIO.to(x_sorted_NI.dtype))
    y_NO = y_pad_ECO[expert_N, slot_N]
    if len(expert_N) < N:  # rows past the last offset belong to no expert
        y_NO = torch.cat([y_NO, y_NO.new_zeros(N - len(expert_N), O)])
    return y_NO


def grouped_lora_reference(
    x_sorted_NI: torch.Tensor,
    A_EIR: torch.Tensor,
    B_ERO: torch.Tensor,
    offsets_E: torch.Tensor,
    scaling: float,
    w_EIO: torch.Tensor | None = None,
) -> torch.Tensor:
    """scaling·(x·A_e)·B_e per expert group (+ x·W_e when w is given); never forms ΔW = A·B."""
    h_NR = grouped_mm_reference(x_sorted_NI, A_EIR, offsets_E)
    y_NO = grouped_mm_reference(h_NR, B_ERO, offsets_E) * scaling
    if w_EIO is not None:
        y_NO = grouped_mm_reference(x_sorted_NI, w_EIO, offsets_E) + y_NO
    return y_NO
