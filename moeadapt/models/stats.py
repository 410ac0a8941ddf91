"""Parameter counts by component, total and active per token (works on meta-device models), and the attention
FLOPs per token that a parameter count leaves out (MFU's "+ attention" basis, the planner's time model)."""

from __future__ import annotations

from functools import lru_cache

import torch
from torch import nn

from ..config import ModelSpec
from ..ops.dsa.flex_attn import selected_pairs
from ..ops.kda.reference import CHUNK


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


# ------------------------------------------------------------------ attention FLOPs
# 6 N per token counts the weights' products; attention's own products (scores against past tokens, the delta rule's
# state) come on top and grow with the sequence. `attention_flops` counts them per token of a seq_len-token causal
# sequence, forward only, by layer kind; a multiply-add is 2 FLOPs.
#   dsa:     each query head's products with its selected keys, in the MHA form that defines the model: q.k over
#            qk_nope + qk_rope channels, p.v over v_head_dim (query t selects min(index_topk, t + 1) keys; KPool:
#            its complete blocks' tokens plus its own block's tail). `dsa_form="absorbed"` counts the absorbed
#            kernels' products instead (kv_lora_rank + qk_rope channels, then kv_lora_rank: more at these widths),
#            `"mha_dense"` the MHA form's dense tiles, which cover every causal pair (ops/dsa/flex_attn.py).
#   indexer: the lightning indexer's scores, index_n_heads x index_head_dim against every visible key (KPool: every
#            complete block), in the DSA layers that run their own (not `index_shared_layers`).
#   kda / gdn: the chunked delta rule per value head with key / value dims K / V, chunk C: the state products
#            q S, k S and the update k^T u (6 K V), and the in-chunk products (4 C (K + V)).
#   gqa:     q.k and p.v over every causal pair, per query head.
# Not counted: the vision tower, the indexer's KL loss (index_loss_coef > 0), softmax / gating elementwise work.


@lru_cache(maxsize=256)
def _pairs(T: int, topk: int, block: int, tail: bool) -> tuple[float, float]:
    """(selected keys, indexer keys) per query, averaged over the T queries of a causal sequence. block = 0: the
    per-token indexer; else KPool over complete blocks of `block` tokens (plus the query's own tail)."""
    if not block:
        return selected_pairs(T, topk) / T, (T + 1) / 2
    n = torch.arange(1, T + 1, dtype=torch.float64)  # query t sees n = t + 1 tokens
    vis = torch.div(n, block, rounding_mode="floor")  # its complete blocks
    sel = torch.clamp(vis, max=topk // block) * block + ((n - vis * block) if tail else 0)
    return float(sel.mean()), float(vis.mean())


def attention_flops(spec: ModelSpec, seq_len: int, dsa_form: str = "model") -> dict[str, float]:
    """Forward FLOPs per token of the attention products, summed over the layers of each kind (keys "dsa",
    "indexer", "kda", "gdn", "gqa"; the table above). dsa_form: "model" (the selected keys in MHA form),
    "absorbed" or "mha_dense" (what those kernels compute)."""
    if dsa_form not in ("model", "absorbed", "mha_dense"):
        raise ValueError(f"dsa_form must be 'model', 'absorbed' or 'mha_dense', got {dsa_form!r}")
    T = seq_len
    types = spec.resolved_layer_types()
    sel, idx_keys = _pairs(T, spec.index_topk, spec.index_kpool or 0, spec.index_kpool_select_tail)
    qk, v = spec.qk_nope_head_dim + spec.qk_rope_head_dim, spec.v_head_dim
    if dsa_form == "absorbed":
        qk, v = spec.kv_lora_rank + spec.qk_rope_head_dim, spec.kv_lora_rank
    elif dsa_form == "mha_dense":
        sel = (T + 1) / 2
    dsa_layers = [i for i, k in enumerate(types) if k == "dsa"]
    own_indexer = [i for i in dsa_layers if i not in spec.index_shared_layers]

    def delta(heads: int, K: int, V: int) -> float:
        return heads * (6 * K * V + 4 * CHUNK * (K + V))

    return {
        "dsa": len(dsa_layers) * 2 * spec.n_heads * (qk + v) * sel,
        "indexer": len(own_indexer) * 2 * spec.index_n_heads * spec.index_head_dim * idx_keys,
        "kda": types.count("kda") * delta(spec.kda_n_heads, spec.kda_head_dim, spec.kda_head_dim),
        "gdn": types.count("gdn") * delta(spec.gdn_n_value_heads, spec.gdn_key_head_dim, spec.gdn_value_head_dim),
        "gqa": types.count("gqa") * 2 * spec.n_heads * 2 * spec.gqa_head_dim * (T + 1) / 2,
    }


def attention_flops_per_token(spec: ModelSpec, seq_len: int, dsa_form: str = "model", passes: int = 3) -> float:
    """Attention's FLOPs per trained token: `passes` x the forward of every kind but the indexer's (3: forward +
    backward; 4 with a full recompute), the indexer's once, since its scores take no gradient (they only choose
    the keys) and a recompute keeps its top-k. Add it to 6 N (flops_per_token) for the MFU that counts
    attention. dsa_form: as in `attention_flops`."""
    f = attention_flops(spec, seq_len, dsa_form)
    return passes * (f["dsa"] + f["kda"] + f["gdn"] + f["gqa"]) + f["indexer"]
