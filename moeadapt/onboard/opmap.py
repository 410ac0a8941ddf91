"""Operator mapping: which kernel serves each layer of an onboarded model, and every fallback with its reason.

Mirrors the backend rule of moeadapt.ops (`"auto"` = Triton on CUDA, the PyTorch reference elsewhere); must not
run any kernel.
"""

from __future__ import annotations

from ..config import ModelSpec
from ..ui import make_console


def _triton_ok() -> tuple[bool, str]:
    try:
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA device"
        import triton  # noqa: F401
    except ImportError:
        return False, "triton is not installed"
    return True, ""


def op_mapping(spec: ModelSpec, device: str = "auto") -> list[dict]:
    """One row per layer: attention type, attention ops and backend, FFN ops and backend, fallback reason."""
    ok, why = _triton_ok()
    if device == "cpu":
        ok, why = False, "device is CPU"
    backend = "triton" if ok else "reference"
    rows = []
    for i, t in enumerate(spec.resolved_layer_types()):
        moe = spec.is_moe_layer(i)
        fallback = [f"reference: {why}"] if not ok and (t != "gqa" or moe) else []
        if t == "kda":
            attn, be = "chunk_kda", backend
            if spec.kda_gate_lower_bound is not None and ok:
                fallback.append("lower-bounded gate formed by torch before the kernel (no fused form yet)")
        elif t == "gdn":
            attn, be = "chunk_kda (Gated DeltaNet: one decay per head, grouped value heads)", backend
        elif t == "dsa":
            attn, be = "lightning_indexer + sparse_attention (MQA on the kv latent)", backend
            if i in spec.index_shared_layers:
                src = max(j for j in range(i) if spec.resolved_layer_types()[j] == "dsa"
                          and j not in spec.index_shared_layers)
                attn = f"sparse_attention over layer {src}'s top-k (shared indexer; MQA on the kv latent)"
            elif spec.index_kpool:
                attn = f"kpool_indexer (blocks of {spec.index_kpool}) + sparse_attention (MQA on the kv latent)"
                if ok:
                    fallback.append("KPool indexer: reference (no fused kernel yet; selection only, no gradient)")
            if spec.index_topk >= spec.max_position_embeddings:
                attn = "sparse_attention, dense causal (index_topk >= context: MLA without indexer)"
                fallback.append("dense MLA via top-k = T selection: O(T^2) gather, fine below a few K tokens")
        else:
            attn, be = "scaled_dot_product_attention (GQA)", "torch-sdpa"
        if moe:
            ffn = f"router + permute + grouped_mm x3 ({spec.n_routed_experts} experts, top-{spec.n_experts_per_tok})"
        else:
            ffn = "dense SwiGLU (torch matmul)"
        if spec.swiglu_limit is not None:
            ffn += f", SwiGLU clamped at {spec.swiglu_limit:g}"
            if ok and moe:
                fallback.append("clamped SwiGLU: torch ops (no fused clamped kernel yet)")
        if spec.hc_mult > 1:
            ffn += f"; {spec.hc_mult} hyper-connection streams (torch)"
        rows.append({"layer": i, "attn": t, "attn_ops": attn, "attn_backend": be, "ffn": ffn,
                     "ffn_backend": backend if moe else "torch", "fallback": "; ".join(fallback)})
    return rows


def _runs(rows: list[dict]) -> list[tuple[str, dict]]:
    """Consecutive layers with the same mapping collapse into one row ('3-60')."""
    out: list[tuple[int, int, dict]] = []
    for r in rows:
        key = {k: v for k, v in r.items() if k != "layer"}
        if out and out[-1][2] == key and out[-1][1] == r["layer"] - 1:
            out[-1] = (out[-1][0], r["layer"], key)
        else:
            out.append((r["layer"], r["layer"], key))
    return [(f"{a}" if a == b else f"{a}-{b}", k) for a, b, k in out]


def print_op_mapping(rows: list[dict], notes: list[str] | None = None, console=None) -> None:
    from rich.table import Table

    console = console or make_console()
    t = Table(title="operator mapping")
    for c in ("layer", "attn", "attention ops", "backend", "ffn", "backend", "fallback / why"):
        t.add_column(c)
    for layers, r in _runs(rows):
        t.add_row(layers, r["attn"], r["attn_ops"], r["attn_backend"], r["ffn"], r["ffn_backend"],
                  r["fallback"] or "-")
    console.print(t)
    for n in notes or []:
        console.print(f"[yellow]note:[/] {n}")
