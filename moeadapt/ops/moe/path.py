"""The one decision of which grouped-LoRA path runs the routed experts; the model and the planner both call it.

Owns `expert_lora_path` and its thresholds. models/moe.py (GroupedExperts, LocalDispatcher), lora/layers.py
(through grouped_lora's "auto") and plan/memory.py (the saved set it models) call it with the facts they know;
nothing else decides. Imports nothing (pure arithmetic on what the caller passes).

Paths:
  "lean"    ops/moe/lean_lora.py: w1, w3, w2 all LoRA'd, gate/up GEMMs at native width, the rank terms in the
            gather / SwiGLU passes; wherever the fused GEMM would run and the layers allow it. It needs no
            persistent [W | Bᵀ] buffer (without one, w2's is built for the forward GEMM and the backward runs on
            the base weight), so it also runs under FSDP2.
  "fused"   ops/moe/fused_lora.py: base + LoRA as one grouped GEMM over the layer's own [W | Bᵀ] buffer.
  "triton"  the Triton grouped LoRA kernel (fewer than FUSED_MIN_ROWS rows per expert, or no buffer).
  "torch"   three torch._grouped_mm per projection (many rows and no buffer).
Off CUDA grouped_lora's "auto" runs the reference; "lean" / "fused" run there only when asked for.
On the H200 (benchmarks/bench_moe.py) the fused GEMM beat the Triton LoRA kernel from ~1024 rows per expert
and lost at 292 (FUSED_MIN_ROWS = 512 lies between); lean beat fused at every shape where both run.
"""

from __future__ import annotations

FUSED_MIN_ROWS = 512  # "auto": fused base+LoRA GEMM from this many rows per expert (with the buffer), else Triton
TRITON_LORA_MAX_ROWS = 1536  # "auto" without the fused buffer: Triton below this many rows per expert, else torch
LORA_BACKENDS = ("lean", "fused", "triton", "torch")


def expert_lora_path(rows_per_expert: float, *, cuda: bool, fused_buffer: bool, lean_layers: bool = False,
                     backend: str | None = None) -> str:
    """The grouped-LoRA path ("lean", "fused", "triton" or "torch"; LORA_BACKENDS) of one experts block.

    Args:
        rows_per_expert: routed rows / experts of the call (T·K / E for a dropless router).
        cuda: the rows are on a CUDA device ("auto" picks the fused GEMM only there).
        fused_buffer: the LoRA layer owns its [W | Bᵀ] buffer (one device; not under FSDP, whose sharded /
            gathered weight is no view of it).
        lean_layers: w1, w3 and w2 are all grouped LoRA layers that lean_lora can run (frozen base in the
            compute dtype, no dropout, w1 / w3 with one rank and scaling); lean needs no buffer.
        backend: a path the caller forces (a layer's backend "fused", the planner's `expert_lora`), or None
            for "auto". A forced "lean" without lean_layers runs (and saves) as the Triton kernel.
    """
    if backend is not None and backend not in LORA_BACKENDS:
        raise ValueError(f"expert LoRA backend={backend!r} is not one of {LORA_BACKENDS} (or None for auto)")
    be = backend
    if be is None:
        if cuda and (fused_buffer or lean_layers) and rows_per_expert >= FUSED_MIN_ROWS:
            be = "fused"
        else:
            be = "triton" if rows_per_expert < TRITON_LORA_MAX_ROWS else "torch"
    if be in ("lean", "fused") and lean_layers:
        return "lean"
    return "triton" if be == "lean" else be
