"""MoE operators: token permutation, grouped GEMM over experts, grouped LoRA, SwiGLU, weighted combine.

Owns the public MoE op functions and their backend choice; models/ (LatentMoE) calls them and
nothing here knows about modules, routers or ranks.

Shape suffixes (torchtitan style): T tokens, K choices per token (top-k), E experts,
N routed rows (non-dropped choices, expert-major), D hidden width, I / O input / output width
of a grouped matmul, R LoRA rank.

Backends: "reference" (plain PyTorch, autograd; the spec and the CPU path), "triton"
(triton_permute.py / triton_grouped_mm.py; on CPU only under TRITON_INTERPRET=1), "torch"
(torch._grouped_mm for the matmuls, reference for permutation), "fused" (grouped_lora only:
the LoRA folded into the base torch._grouped_mm through a concatenated weight buffer, fused_lora.py;
runs on CPU too) and "auto": on CUDA the fastest measured on the H200 (benchmarks/bench_moe.py), elsewhere
"reference". Which grouped-LoRA path the experts take is decided in one place, path.py `expert_lora_path`.
"""

from __future__ import annotations

import os

import torch

from .gate_up import gate_up_mm, paired
from .path import FUSED_MIN_ROWS, LORA_BACKENDS, TRITON_LORA_MAX_ROWS, expert_lora_path
from .reference import (
    grouped_lora_reference,
    grouped_mm_reference,
    permutation_reference,
    permute_reference,
    unpermute_reference,
)

__all__ = ["FUSED_MIN_ROWS", "LORA_BACKENDS", "TRITON_LORA_MAX_ROWS", "expert_lora_path", "gate_up_mm", "paired",
           "grouped_lora", "grouped_mm_backend",
           "grouped_mm", "offsets_from_counts", "permutation", "permute", "swiglu", "swiglu_pair", "unpermute"]

_BACKENDS = ("auto", "reference", "triton", "torch", "fused")
def _resolve(backend: str, device: torch.device, op: str, rows_per_expert: float = 0.0) -> str:
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {_BACKENDS}")
    if backend == "auto":
        if device.type != "cuda":
            return "reference"
        # H200, torch 2.11 / triton 3.6: Triton for permutation and SwiGLU; torch._grouped_mm (CUTLASS) beat
        # our Triton GEMM by 1.15-1.3x at every shape; grouped LoRA as path.py decides
        if op == "grouped_mm":
            return "torch"
        if op == "grouped_lora":
            return expert_lora_path(rows_per_expert, cuda=True, fused_buffer=False)
        return "triton"
    if backend == "fused" and op != "grouped_lora":
        raise ValueError("backend='fused' exists for grouped_lora only")
    if backend == "triton" and device.type != "cuda" and os.environ.get("TRITON_INTERPRET", "0") != "1":
        raise ValueError(f"backend='triton' needs CUDA tensors or TRITON_INTERPRET=1; got device {device}")
    if backend == "torch" and op in ("permute", "unpermute", "swiglu"):
        return "reference"  # plain torch ops are the torch path here
    return backend


def grouped_mm_backend(backend: str, device: torch.device) -> str:
    """The backend `grouped_mm(..., backend)` runs on `device`: "reference", "triton" or "torch"."""
    return _resolve(backend, device, "grouped_mm")


def offsets_from_counts(counts_E: torch.Tensor) -> torch.Tensor:
    """Cumulative END offsets (int32) of each expert's rows, as torch._grouped_mm's `offs`."""
    if counts_E.dim() != 1:
        raise ValueError(f"counts_E must be 1-D [E]; got shape {tuple(counts_E.shape)}")
    return torch.cumsum(counts_E, 0, dtype=torch.int32)


def permute(
    x_TD: torch.Tensor, expert_ids_TK: torch.Tensor, num_experts: int, backend: str = "auto",
    num_routed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gather token rows into expert-major order.

    Args:
        x_TD: [T, D] token activations.
        expert_ids_TK: [T, K] integer expert of each choice, in [0, E), or -1 for a dropped choice.
        num_experts: E.
    Returns:
        x_sorted_ND: [N, D] rows of expert 0, then expert 1, ...; stable in t*K+k within an expert.
        row_index_N: [N] int64, the flat choice index t*K+k of each sorted row.
        counts_E: [E] int64 rows per expert (N = counts_E.sum() = non-dropped choices).
    Differentiable w.r.t. x_TD. One host sync (N sizes the output), unless the caller passes
    `num_routed` = N (e.g. T*K for a dropless router): then none on the Triton path; the id range and
    N are checked on the device (torch._assert_async, raised at the next sync).
    """
    if x_TD.dim() != 2 or expert_ids_TK.dim() != 2 or x_TD.shape[0] != expert_ids_TK.shape[0]:
        raise ValueError(
            f"permute needs x_TD [T, D] and expert_ids_TK [T, K] with the same T; "
            f"got {tuple(x_TD.shape)} and {tuple(expert_ids_TK.shape)}"
        )
    if expert_ids_TK.dtype.is_floating_point or expert_ids_TK.dtype == torch.bool:
        raise ValueError(f"expert_ids_TK must be an integer tensor; got {expert_ids_TK.dtype}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1; got {num_experts}")
    if expert_ids_TK.device != x_TD.device:
        raise ValueError(f"x_TD is on {x_TD.device} but expert_ids_TK on {expert_ids_TK.device}")
    be = _resolve(backend, x_TD.device, "permute")
    if be == "triton":
        from .triton_permute import permute_triton

        return permute_triton(x_TD, expert_ids_TK, num_experts, num_routed)
    _check_ids_reference(expert_ids_TK, num_experts)
    out = permute_reference(x_TD, expert_ids_TK.long(), num_experts)
    if num_routed is not None and out[0].shape[0] != num_routed:
        raise ValueError(f"num_routed={num_routed} but the ids route {out[0].shape[0]} choices")
    return out


def _check_ids_reference(expert_ids_TK: torch.Tensor, num_experts: int) -> None:
    if expert_ids_TK.numel():
        lo, hi = int(expert_ids_TK.min()), int(expert_ids_TK.max())
        if lo < -1 or hi >= num_experts:
            raise ValueError(
                f"expert_ids_TK holds ids in [{lo}, {hi}]; ids must be in [0, {num_experts}) or -1 (dropped)"
            )


def permutation(
    expert_ids_TK: torch.Tensor, num_experts: int, backend: str = "auto", num_routed: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`permute`'s (row_index_N, counts_E) without gathering rows: for consumers that read the
    token-major rows through row_index themselves (fused_lora.grouped_lora_fused_gather).
    Same order, same host-sync rule as `permute`."""
    if expert_ids_TK.dim() != 2 or expert_ids_TK.dtype.is_floating_point or expert_ids_TK.dtype == torch.bool:
        raise ValueError(f"expert_ids_TK must be an integer [T, K] tensor; got {expert_ids_TK.dtype} "
                         f"{tuple(expert_ids_TK.shape)}")
    if num_experts < 1:
        raise ValueError(f"num_experts must be >= 1; got {num_experts}")
    be = _resolve(backend, expert_ids_TK.device, "permute")
    if be == "triton":
        from .triton_permute import compute_permutation

        return compute_permutation(expert_ids_TK, num_experts, num_routed)
    _check_ids_reference(expert_ids_TK, num_experts)
    out = permutation_reference(expert_ids_TK.long(), num_experts)
    if num_routed is not None and out[0].shape[0] != num_routed:
        raise ValueError(f"num_routed={num_routed} but the ids route {out[0].shape[0]} choices")
    return out


def unpermute(
    y_sorted_ND: torch.Tensor,
    row_index_N: torch.Tensor,
    weights_TK: torch.Tensor,
    num_tokens: int,
    backend: str = "auto",
) -> torch.Tensor:
    """Weighted combine of the expert rows back to tokens.

    y_TD[t] = Σ_k weights_TK[t, k] · y_sorted_ND[row of (t, k)], accumulated in fp32 and
    returned in y's dtype; dropped choices (absent from row_index_N) contribute 0.

    Args:
        y_sorted_ND: [N, D] expert outputs in permute's order.
        row_index_N: [N] int64 from permute.
        weights_TK: [T, K] routing weights (T = num_tokens).
    Returns: y_TD [T, D]. Differentiable w.r.t. y_sorted_ND and weights_TK.
    """
    if y_sorted_ND.dim() != 2 or row_index_N.dim() != 1 or row_index_N.shape[0] != y_sorted_ND.shape[0]:
        raise ValueError(
            f"unpermute needs y_sorted_ND [N, D] and row_index_N [N]; "
            f"got {tuple(y_sorted_ND.shape)} and {tuple(row_index_N.shape)}"
        )
    if weights_TK.dim() != 2 or weights_TK.shape[0] != num_tokens:
        raise ValueError(f"weights_TK must be [num_tokens={num_tokens}, K]; got {tuple(weights_TK.shape)}")
    if row_index_N.dtype != torch.int64:
        raise ValueError(f"row_index_N must be int64 (as permute returns it); got {row_index_N.dtype}")
    be = _resolve(backend, y_sorted_ND.device, "unpermute")
    if be == "triton":
        from .triton_permute import unpermute_triton

        return unpermute_triton(y_sorted_ND, row_index_N, weights_TK, num_tokens)
    return unpermute_reference(y_sorted_ND, row_index_N, weights_TK, num_tokens)


def _check_grouped(x_NI: torch.Tensor, w_EIO: torch.Tensor, offsets_E: torch.Tensor, name: str) -> None:
    if x_NI.dim() != 2 or w_EIO.dim() != 3 or x_NI.shape[1] != w_EIO.shape[1]:
        raise ValueError(
            f"{name} needs x [N, I] and w [E, I, O] with the same I; got {tuple(x_NI.shape)} and {tuple(w_EIO.shape)}"
        )
    if offsets_E.dim() != 1 or offsets_E.shape[0] != w_EIO.shape[0]:
        raise ValueError(f"{name}: offsets_E must be [E={w_EIO.shape[0]}]; got {tuple(offsets_E.shape)}")
    if offsets_E.dtype != torch.int32:
        raise ValueError(f"{name}: offsets_E must be int32 (use offsets_from_counts); got {offsets_E.dtype}")
    if offsets_E.device != x_NI.device or w_EIO.device != x_NI.device:
        raise ValueError(f"{name}: x, w and offsets must share a device; got {x_NI.device}, {w_EIO.device}, "
                         f"{offsets_E.device}")


def grouped_mm(x_sorted_NI: torch.Tensor, w_EIO: torch.Tensor, offsets_E: torch.Tensor, backend: str = "auto"):
    """y[rows of e] = x[rows of e] @ w_EIO[e] for every expert in one call.

    Args:
        x_sorted_NI: [N, I] expert-major rows.
        w_EIO: [E, I, O] (may be a transposed view of an [E, O, I] parameter).
        offsets_E: [E] int32 cumulative END offsets: expert e owns rows [offsets[e-1], offsets[e]).
            Rows past offsets[-1] belong to no expert (they never reach y's other rows nor dW); their outputs
            are zeros on the reference path and left unwritten by the kernels.
    Returns: y_NO [N, O]. Differentiable w.r.t. x and w; dW is skipped when w is frozen.
    """
    _check_grouped(x_sorted_NI, w_EIO, offsets_E, "grouped_mm")
    be = _resolve(backend, x_sorted_NI.device, "grouped_mm")
    if be == "triton":
        from .triton_grouped_mm import grouped_mm_triton

        return grouped_mm_triton(x_sorted_NI, w_EIO, offsets_E)
    if be == "torch":
        return torch._grouped_mm(x_sorted_NI, w_EIO, offs=offsets_E)
    return grouped_mm_reference(x_sorted_NI, w_EIO, offsets_E)


def grouped_lora(
    x_sorted_NI: torch.Tensor,
    A_EIR: torch.Tensor,
    B_ERO: torch.Tensor,
    offsets_E: torch.Tensor,
    scaling: float,
    w_EIO: torch.Tensor | None = None,
    backend: str = "auto",
    *,
    w_cat: torch.Tensor | None = None,
    dx: str = "cat",
) -> torch.Tensor:
    """Per-expert LoRA: y = scaling·(x·A_e)·B_e, plus x·W_e when w_EIO is given (fused base+LoRA).

    Args:
        x_sorted_NI: [N, I] expert-major rows; A_EIR: [E, I, R]; B_ERO: [E, R, O];
        offsets_E: [E] int32 END offsets; scaling: alpha / r; w_EIO: optional [E, I, O] base weight.
        w_cat: optional persistent [E, O, I + R'] buffer (R' >= R, a multiple of 8) whose first I
            columns ARE the base weight (w_EIO == w_cat[:, :, :I].transpose(1, 2), same memory);
            the "fused" backend writes B_eᵀ into its next R columns and runs base + LoRA as one
            grouped GEMM (fused_lora.py). "auto" picks "fused" on CUDA when it is given (path.py).
        dx: the fused backward's dy·[W | Bᵀ] GEMM, "cat" (one GEMM) or "split" (fused_lora.DX_MODES).
    Returns: y_NO [N, O]. Never forms ΔW = A·B. Backward gives dx, dA, dB (and dW only when W
    requires grad).
    """
    _check_grouped(x_sorted_NI, A_EIR, offsets_E, "grouped_lora")
    if B_ERO.dim() != 3 or B_ERO.shape[:2] != (A_EIR.shape[0], A_EIR.shape[2]):
        raise ValueError(f"grouped_lora: B_ERO must be [E, R, O] matching A_EIR {tuple(A_EIR.shape)}; "
                         f"got {tuple(B_ERO.shape)}")
    if w_EIO is not None and (w_EIO.dim() != 3 or w_EIO.shape != (A_EIR.shape[0], A_EIR.shape[1], B_ERO.shape[2])):
        raise ValueError(f"grouped_lora: w_EIO must be [E, I, O] = {(A_EIR.shape[0], A_EIR.shape[1], B_ERO.shape[2])}; "
                         f"got {tuple(w_EIO.shape)}")
    rows_per_expert = x_sorted_NI.shape[0] / max(A_EIR.shape[0], 1)
    if (backend == "auto" and w_cat is not None and w_EIO is not None and x_sorted_NI.is_cuda
            and expert_lora_path(rows_per_expert, cuda=True, fused_buffer=True) == "fused"):
        backend = "fused"
    be = _resolve(backend, x_sorted_NI.device, "grouped_lora", rows_per_expert)
    if be == "fused":
        if w_EIO is None:  # LoRA alone (the dropout path): nothing to fuse into
            be = _resolve("auto", x_sorted_NI.device, "grouped_lora", rows_per_expert)
        else:
            from .fused_lora import grouped_lora_fused

            return grouped_lora_fused(x_sorted_NI, A_EIR, B_ERO, offsets_E, scaling, w_EIO, w_cat=w_cat, dx=dx)
    if be == "triton":
        from .triton_grouped_mm import grouped_lora_triton

        return grouped_lora_triton(x_sorted_NI, A_EIR, B_ERO, offsets_E, scaling, w_EIO)
    if be == "torch":
        # the scaling on the rank-wide h, not on the [N, O] product: one [N, O] pass less each way
        h_NR = torch._grouped_mm(x_sorted_NI, A_EIR, offs=offsets_E) * scaling
        y_NO = torch._grouped_mm(h_NR, B_ERO, offs=offsets_E)
        return y_NO if w_EIO is None else torch._grouped_mm(x_sorted_NI, w_EIO, offs=offsets_E) + y_NO
    return grouped_lora_reference(x_sorted_NI, A_EIR, B_ERO, offsets_E, scaling, w_EIO)


def swiglu(gate_up_NF2: torch.Tensor, backend: str = "auto") -> torch.Tensor:
    """a_NF = silu(gate) · up for the fused gate/up GEMM output [N, 2F] (gate = first F columns).

    The Triton path reads gate/up once, saves only gate/up for backward and recomputes silu.
    """
    if gate_up_NF2.dim() != 2 or gate_up_NF2.shape[1] % 2:
        raise ValueError(f"swiglu needs gate_up [N, 2F]; got {tuple(gate_up_NF2.shape)}")
    if _resolve(backend, gate_up_NF2.device, "swiglu") == "triton":
        from .triton_swiglu import swiglu_triton

        return swiglu_triton(gate_up_NF2)
    g_NF, u_NF = gate_up_NF2.chunk(2, dim=-1)
    return torch.nn.functional.silu(g_NF) * u_NF


def swiglu_pair(gate_NF: torch.Tensor, up_NF: torch.Tensor, backend: str = "auto",
                limit: float | None = None) -> torch.Tensor:
    """a_NF = silu(gate) · up for separate gate and up tensors [N, F] (the model's w1 and w3 outputs); the Triton
    path as `swiglu`'s (one pass each way, silu recomputed in the backward).

    limit: the clamped SwiGLU (GLM-5.3-Flash) silu(min(gate, limit)) · clamp(up, -limit, limit); every backend
    runs it with torch's ops (no fused clamped kernel yet)."""
    if gate_NF.dim() != 2 or gate_NF.shape != up_NF.shape:
        raise ValueError(f"swiglu_pair needs gate and up of one shape [N, F]; got {tuple(gate_NF.shape)} and "
                         f"{tuple(up_NF.shape)}")
    if limit is not None:
        if not limit > 0:
            raise ValueError(f"swiglu_pair limit={limit} must be > 0 (or None for the unclamped SwiGLU)")
        _resolve(backend, gate_NF.device, "swiglu")
        return torch.nn.functional.silu(gate_NF.clamp(max=limit)) * up_NF.clamp(-limit, limit)
    if _resolve(backend, gate_NF.device, "swiglu") == "triton":
        from .triton_swiglu import swiglu_pair_triton

        return swiglu_pair_triton(gate_NF, up_NF)
    return torch.nn.functional.silu(gate_NF) * up_NF
