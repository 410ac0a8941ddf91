"""Parameter counts by component, total and active per token. Works on meta-device models."""

from __future__ import annotations

from torch import nn

from ..config import ModelSpec


def _component(name: str) -> str:
    if name.startswith("vision.projector."):
        return "vision_projector"
    if name.startswith("vision."):
        return "vision_tower"
    if name.startswith("embed"):
        return "embeddings"
    if name.startswith("lm_head"):
        return "lm_head"
    if name.startswith("norm"):
        return "norms"
    if ".attn." in name:
        layer = name.split(".")[1]
        return f"attn:{layer}"
    if ".ffn.experts." in name:
        return "moe.routed_experts"
    if ".ffn.router." in name:
        return "moe.router"
    if ".ffn.shared." in name:
        return "moe.shared_expert"
    if "latent_proj" in name or "latent_norm" in name:
        return "moe.latent_proj"
    if ".ffn." in name:
        return "dense_ffn"
    if "norm" in name:
        return "norms"
    return "other"


def count_parameters(model: nn.Module, spec: ModelSpec) -> dict:
    types = spec.resolved_layer_types()
    by: dict[str, int] = {}
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # tied weights count once
            continue
        seen.add(id(p))
        comp = _component(name)
        if comp.startswith("attn:"):
            is_idx = any(s in name for s in ("wq_idx", "wk_idx", "k_idx_norm", "w_idx"))
            comp = "dsa_indexer" if is_idx else f"attn_{types[int(comp[5:])]}"
        by[comp] = by.get(comp, 0) + p.numel()
    total = sum(by.values())
    routed = by.get("moe.routed_experts", 0)
    E, K = spec.n_routed_experts, spec.n_experts_per_tok
    vision = by.get("vision_tower", 0) + by.get("vision_projector", 0)  # runs on image patches, not per text token
    active = total - vision - (routed - routed * K // E if E else 0)
    return {"total": total, "active_per_token": active, "by_component": dict(sorted(by.items()))}
