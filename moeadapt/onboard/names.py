"""Tensor name maps: every tensor of our model <-> the checkpoint tensor(s) it comes from, and back.

Owns: one `Rule` per tensor of our state dict (parameters and persistent buffers): its checkpoint source name
(or the E per-expert names stacked into our `[E, out, in]` tensor), an optional row permutation (DeepSeek's
interleaved RoPE rows -> our half-split layout) and an optional reshape. `reverse_module_map` gives the
module-name map PEFT export uses (ours -> checkpoint). Tensors our model has and the checkpoint cannot have
by construction (the indexer of a DSA layer serving indexer-less MLA, the router bias of a family without
one) are `absent_ok` rules with a stated reason and a stated init; nothing else may be missing.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch

from ..models.model import build_model
from .families import Family

_IDX = ("wq_idx", "wk_idx", "k_idx_norm", "w_idx", "kpool_gate", "kpool_ape")
_QWEN_NEXT = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")  # Qwen3-Next's names (linear_attn., shared_expert.)


@dataclass
class Rule:
    ours: str
    sources: list[str]  # one name, or E names (stacked on dim 0) when `stacked`
    shape: tuple[int, ...]  # our full shape
    stacked: bool = False
    row_perm: torch.Tensor | None = None  # ours[i] = ckpt[row_perm[i]] along dim 0 (never on stacked rules)
    absent_ok: str = ""  # why the checkpoint has no such tensor ("" = it must be there)
    init: str = "keep"  # for absent tensors: "zeros" or "keep" (the model's own init)
    offset: float = 0.0  # ours = ckpt + offset (RMSNorms stored as weight - 1, applied as 1 + weight)
    part: tuple[int, int, int] | None = None  # (dim, i, n): ours is chunk i of n equal chunks of the source on dim
    module: str = ""  # the checkpoint module name PEFT export uses, where the source name does not give it

    def src_shape(self) -> tuple[int, ...]:
        """The checkpoint tensor's shape this rule expects (one expert's for stacked rules)."""
        shape = list(self.shape[1:] if self.stacked else self.shape)
        if self.part is not None:
            shape[self.part[0]] *= self.part[2]
        return tuple(shape)

    def take_part(self, t: torch.Tensor) -> torch.Tensor:
        """Our chunk of a (possibly expert-sliced) source tensor; the tensor itself when the rule has no part."""
        if self.part is None:
            return t
        d, i, n = self.part
        return t.narrow(d, i * (t.shape[d] // n), t.shape[d] // n)

    def to_ours(self, t: torch.Tensor) -> torch.Tensor:
        t = self.take_part(t)
        if self.row_perm is not None:
            t = t.index_select(0, self.row_perm)
        if self.offset:
            t = t.float() + self.offset  # in float32: 1 + w rounded once, to the model's dtype
        return t.reshape(self.shape[1:] if self.stacked else self.shape)

    def from_ours(self, t: torch.Tensor, src_shape: tuple[int, ...]) -> torch.Tensor:
        if self.row_perm is not None:
            t = t.index_select(0, torch.argsort(self.row_perm))
        if self.offset:
            t = t - self.offset
        return t.reshape(src_shape)


def _rope_rows(heads: int, head: int, nope: int, rope: int, rope_first: bool = False) -> torch.Tensor:
    """Row order taking interleaved rope pairs (x0,x1),(x2,x3).. to half-split (x0,x2,..,x1,x3,..) per head;
    a head is [nope | rope], or [rope | the other head - rope channels] with rope_first."""
    within = torch.cat([torch.arange(0, rope, 2), torch.arange(1, rope, 2)])
    if rope_first:
        per = torch.cat([within, rope + torch.arange(head - rope)])
    else:
        per = torch.cat([torch.arange(nope), nope + within])
    return torch.cat([h * head + per for h in range(heads)])


def _hf_layer(fam: Family, i: int, ours: str) -> str | list[str] | None:
    """The checkpoint name of one of our per-layer tensors (`ours` is relative to `layers.i.`)."""
    p = f"{fam.prefix}layers.{i}."
    mt = fam.model_type
    moe = "block_sparse_moe." if mt in ("kimi_linear", "minimax_m2") else "mlp."
    fixed = {
        "attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight",
        # MLA (DSA layer)
        "attn.wq_a.weight": "self_attn.q_a_proj.weight", "attn.q_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn.wq_b.weight": "self_attn.q_b_proj.weight", "attn.wq.weight": "self_attn.q_proj.weight",
        "attn.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn.kv_norm.weight": "self_attn.kv_a_layernorm.weight", "attn.wkv_b.weight": "self_attn.kv_b_proj.weight",
        "attn.wo.weight": "self_attn.o_proj.weight",
        "attn.wq_idx.weight": "self_attn.indexer.wq_b.weight", "attn.wk_idx.weight": "self_attn.indexer.wk.weight",
        "attn.k_idx_norm.weight": "self_attn.indexer.k_norm.weight",
        "attn.k_idx_norm.bias": "self_attn.indexer.k_norm.bias",
        "attn.w_idx.weight": "self_attn.indexer.weights_proj.weight",
        "attn.kpool_gate.weight": "self_attn.indexer.index_kpool_compress_gate",
        "attn.kpool_ape": "self_attn.indexer.index_kpool_compress_ape",
        # hyper-connections (GLM-5.3-Flash writes them flat on the layer)
        "attn_hc.fn": "hc_attn_fn", "attn_hc.base": "hc_attn_base", "attn_hc.scale": "hc_attn_scale",
        "ffn_hc.fn": "hc_ffn_fn", "ffn_hc.base": "hc_ffn_base", "ffn_hc.scale": "hc_ffn_scale",
        # KDA (Kimi Linear) and GQA (Qwen3) share q/k/v/o names
        "attn.q_proj.weight": "self_attn.q_proj.weight", "attn.k_proj.weight": "self_attn.k_proj.weight",
        "attn.v_proj.weight": "self_attn.v_proj.weight", "attn.o_proj.weight": "self_attn.o_proj.weight",
        "attn.k_norm.weight": "self_attn.k_norm.weight",
        "attn.q_conv.weight": "self_attn.q_conv1d.weight", "attn.k_conv.weight": "self_attn.k_conv1d.weight",
        "attn.v_conv.weight": "self_attn.v_conv1d.weight", "attn.f_a.weight": "self_attn.f_a_proj.weight",
        "attn.f_b.weight": "self_attn.f_b_proj.weight", "attn.b_proj.weight": "self_attn.b_proj.weight",
        "attn.A_log": "self_attn.A_log", "attn.dt_bias": "self_attn.dt_bias",
        "attn.g_a.weight": "self_attn.g_a_proj.weight", "attn.g_b.weight": "self_attn.g_b_proj.weight",
        "attn.o_norm.weight": "self_attn.o_norm.weight",
        # FFN (transformers writes Kimi Linear's dense layers under block_sparse_moe. as well; see _alias)
        "ffn.w1.weight": moe + "gate_proj.weight", "ffn.w3.weight": moe + "up_proj.weight",
        "ffn.w2.weight": moe + "down_proj.weight",
        "ffn.router.weight": moe + "gate.weight", "ffn.router.expert_bias": moe + "gate.e_score_correction_bias",
        "ffn.shared.w1.weight": moe + "shared_experts.gate_proj.weight",
        "ffn.shared.w3.weight": moe + "shared_experts.up_proj.weight",
        "ffn.shared.w2.weight": moe + "shared_experts.down_proj.weight",
    }
    if ours == "attn.q_norm.weight" and fam.model_type in ("qwen3_moe", "minimax_m2", *_QWEN_NEXT):
        return p + "self_attn.q_norm.weight"
    if ours == "ffn.router.expert_bias" and mt == "minimax_m2":
        return p + moe + "e_score_correction_bias"
    if mt in _QWEN_NEXT:
        if fam.spec.resolved_layer_types()[i] == "gdn" and ours.startswith("attn."):
            return p + "linear_attn." + ours[len("attn."):]
        if ours.startswith("ffn.shared."):  # Qwen3-Next: one shared expert, singular name, with a gate
            return p + "mlp.shared_expert." + {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}[
                ours.split(".")[2]] + ".weight"
        if ours == "ffn.shared_gate.weight":
            return p + "mlp.shared_expert_gate.weight"
    if ours in fixed:
        return p + fixed[ours]
    if ours.startswith("ffn.experts.w"):
        w = ours.split(".")[2]
        proj = ({"w1": "w1", "w3": "w3", "w2": "w2"} if mt in ("kimi_linear", "minimax_m2")
                else {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"})[w]
        return [f"{p}{moe}experts.{e}.{proj}.weight" for e in range(fam.spec.n_routed_experts)]
    return None


def _vision_rope_rows(heads: int, head: int) -> torch.Tensor:
    """MoonViT's q / k rows -> ours, per head: its RoPE rotates interleaved pairs (4j, 4j+1) by the column and
    (4j+2, 4j+3) by the row, frequency j; ours rotates (j, j + Dh/4) by the row and (Dh/2 + j, 3 Dh/4 + j) by the
    column (tower.py). q and k permuted alike leave q . k unchanged."""
    j = torch.arange(head // 4)
    per = torch.cat([4 * j + 2, 4 * j + 3, 4 * j, 4 * j + 1])
    return torch.cat([h * head + per for h in range(heads)])


_KIMI_VISION = {  # ours (under vision.) -> Moonshot's names (the Kimi K2.5 checkpoints; transformers writes these)
    "tower.patch_embed.": "vision_tower.patch_embed.proj.", "tower.pos_embed": "vision_tower.patch_embed.pos_emb.weight",
    "tower.norm.": "vision_tower.encoder.final_layernorm.", "merger.norm.": "mm_projector.pre_norm.",
    "projector.fc1.": "mm_projector.proj.0.", "projector.fc2.": "mm_projector.proj.2.",
}
_KIMI_BLOCK = {"norm1.": "norm0.", "norm2.": "norm1.", "attn.qkv.": "wqkv.", "attn.proj.": "wo.", "fc1.": "mlp.fc0.",
               "fc2.": "mlp.fc1."}
# other spellings of the same tensors: transformers 5.24's save_pretrained (its load-time renames run backwards)
_KIMI_ALIASES = (("language_model.model.layers.", "language_model.model.blocks."),
                 ("vision_tower.patch_embed.proj.", "vision_tower.encoder.patch_embed.proj."),
                 ("mm_projector.pre_norm.", "model.mm_projector.pre_norm."))


def _kimi_k25_vision_rule(fam: Family, name: str, shape: tuple[int, ...]) -> Rule:
    """kimi_k25: the rule of one of our vision tensors (the text ones are deepseek_v3's under `language_model.`)."""
    rel = name[len("vision."):]
    for a, b in _KIMI_VISION.items():
        if rel.startswith(a):
            return Rule(name, [b + rel[len(a):]], shape)
    _, i, leaf = rel.split(".", 3)[1:]  # tower.blocks.<i>.<leaf>
    for a, b in _KIMI_BLOCK.items():
        if leaf.startswith(a):
            r = Rule(name, [f"vision_tower.encoder.blocks.{i}.{b}{leaf[len(a):]}"], shape)
            if a == "attn.qkv.":
                v = fam.spec.vision
                qk = _vision_rope_rows(v.n_heads, v.hidden_size // v.n_heads)
                r.row_perm = torch.cat([qk, v.hidden_size + qk, 2 * v.hidden_size + torch.arange(v.hidden_size)])
            return r
    raise KeyError(f"no checkpoint name for our tensor {name}; the kimi_k25 name map is incomplete")


def _alias(fam: Family, name: str) -> str | None:
    """The other spelling of a checkpoint name where a family is saved both ways: Kimi Linear's FFN lives under
    `block_sparse_moe.` as transformers writes it (dense layers included) and under `mlp.` in other writers."""
    if fam.model_type == "kimi_k25":
        for a, b in _KIMI_ALIASES:
            for x, y in ((a, b), (b, a)):
                if name.startswith(x):
                    return y + name[len(x):]
        return None
    if fam.model_type == "kimi_linear":
        for a, b in ((".block_sparse_moe.", ".mlp."), (".mlp.", ".block_sparse_moe.")):
            if a in name:
                return name.replace(a, b)
    return None


def build_rules(fam: Family, present: Collection[str] | None = None) -> list[Rule]:
    """One rule per tensor of our state dict (tokens_per_expert, a non-persistent counter, excluded).
    `present`: the checkpoint's tensor names; a source it lacks is replaced by its alias when that is present,
    and per-expert sources by the fused expert tensors where the checkpoint holds those (`_fused_experts`)."""
    rules = _build_rules(fam)
    if present is not None:
        have = set(present)
        for r in rules:
            alt = [_alias(fam, s) for s in r.sources]
            if any(s not in have for s in r.sources) and all(a is not None and a in have for a in alt):
                r.sources = alt  # type: ignore[assignment]
            _fused_experts(r, have)
    return rules


def _fused_experts(r: Rule, have: set[str]) -> None:
    """A routed-expert rule whose checkpoint holds the layer's experts fused, as transformers keeps them in memory
    (and Qwen3.5's release stores them): `experts.gate_up_proj` [E, 2I, D] (gate rows first, then up) and
    `experts.down_proj` [E, D, I], instead of one tensor per expert. The rule then reads its part of the fused
    tensor; PEFT export keeps the per-expert module name."""
    if not r.stacked or all(s in have for s in r.sources):
        return
    head, _, rest = r.sources[0].partition(".experts.0.")
    if not rest:
        return
    w = r.ours.split(".")[-2]  # w1 (gate), w3 (up), w2 (down)
    fused = f"{head}.experts.{'down_proj' if w == 'w2' else 'gate_up_proj'}"
    if fused not in have:
        return
    r.module = f"{head}.experts.{rest.rsplit('.', 1)[0]}"
    r.sources, r.stacked = [fused], False
    r.part = None if w == "w2" else (1, 0 if w == "w1" else 1, 2)


def _build_rules(fam: Family) -> list[Rule]:
    spec = fam.spec
    model = build_model(spec, "meta")
    rules = []
    for name, t in model.state_dict().items():
        if name.endswith("tokens_per_expert"):
            continue
        shape = tuple(t.shape)
        if fam.model_type == "moeadapt":
            rules.append(Rule(name, [name], shape))
            continue
        if fam.model_type == "kimi_k25" and name.startswith("vision."):
            rules.append(_kimi_k25_vision_rule(fam, name, shape))
            continue
        if fam.model_type == "glm5_next" and name.startswith("vision."):
            continue  # the tower's rules come all at once from glm5_vision.py (below)
        pre = fam.prefix
        top = {"embed.weight": f"{pre}embed_tokens.weight", "norm.weight": f"{pre}norm.weight",
               "lm_head.weight": "lm_head.weight"}
        if name in top:
            src = top[name]
            if name == "lm_head.weight" and spec.tie_word_embeddings:
                src = top["embed.weight"]
            rules.append(Rule(name, [src], shape, offset=fam.norm_offset if name == "norm.weight" else 0.0))
            continue
        _, i, rel = name.split(".", 2)
        src = _hf_layer(fam, int(i), rel)
        if src is None:
            raise KeyError(f"no checkpoint name for our tensor {name}; the {fam.model_type} name map is incomplete")
        r = Rule(name, src if isinstance(src, list) else [src], shape, stacked=isinstance(src, list))
        if rel.startswith("attn.") and rel.split(".")[1] in _IDX and fam.dense_mla:
            r.absent_ok = "indexer of a DSA layer in dense mode (index_topk >= max_position_embeddings): unused"
            r.init = "zeros"
        if fam.norm_offset and rel in ("attn_norm.weight", "ffn_norm.weight", "attn.q_norm.weight",
                                       "attn.k_norm.weight"):
            r.offset = fam.norm_offset
        if rel == "ffn.router.expert_bias" and fam.model_type in ("qwen3_moe", *_QWEN_NEXT):
            r.absent_ok, r.init = "the family routes without a selection bias (zero bias = identical routing)", \
                "zeros"
        if fam.index_rope_interleave and rel in ("attn.wq_idx.weight", "attn.wk_idx.weight",
                                                 "attn.k_idx_norm.weight", "attn.k_idx_norm.bias"):
            # the indexer's rope channels come first ([rope | pass]); the key LayerNorm's weight and bias follow
            # the key's channels (LayerNorm commutes with a channel permutation), scores are invariant to it
            DI, rope = spec.index_head_dim, spec.qk_rope_head_dim
            heads = spec.index_n_heads if rel == "attn.wq_idx.weight" else 1
            r.row_perm = _rope_rows(heads, DI, 0, rope, rope_first=True)
        if fam.rope_interleave:
            H, nope, rope = spec.n_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim
            if rel in ("attn.wq_b.weight", "attn.wq.weight"):
                r.row_perm = _rope_rows(H, nope + rope, nope, rope)
            elif rel == "attn.wkv_a.weight":
                r.row_perm = _rope_rows(1, spec.kv_lora_rank + rope, spec.kv_lora_rank, rope)
        rules.append(r)
    if fam.model_type == "glm5_next" and spec.vision is not None:  # the tower + projector under model.visual.
        from .glm5_vision import glm5_next_vision_rules  # it imports this module

        bias = (fam.raw.get("vision_config") or {}).get("attention_bias", True)
        rules += glm5_next_vision_rules(spec.vision, spec.hidden_size, bias, prefix="vision.")
    if fam.model_type == "kimi_k25":  # the deepseek_v3 text model lives under language_model.
        for r in rules:
            if not r.ours.startswith("vision."):
                r.sources = ["language_model." + s for s in r.sources]
    return rules


def ignorable(fam: Family, ckpt_name: str) -> str:
    """Why a checkpoint tensor no rule consumes may be skipped ("" = it may not)."""
    if ckpt_name.endswith("weight_scale_inv") and fam.fp8_block:
        return "fp8 block scale (consumed by dequantisation)"
    if ckpt_name.endswith("rotary_emb.inv_freq"):
        return "rotary table (recomputed)"
    for pre, why in fam.skip_prefixes.items():
        if ckpt_name.startswith(pre):
            return why
    if fam.model_type == "kimi_k25":  # its text model: deepseek_v3's names under language_model.
        ckpt_name = ckpt_name.removeprefix("language_model.").replace("model.blocks.", "model.layers.", 1)
    layers = f"{fam.prefix}layers."
    if (fam.mtp_layers or fam.layer_limit) and ckpt_name.startswith(layers):
        i = int(ckpt_name[len(layers):].split(".")[0])
        if fam.layer_limit is not None and i >= fam.layer_limit:
            return f"layer {i} is beyond the first {fam.layer_limit} layers being validated"
        if fam.spec.n_layers <= i < fam.spec.n_layers + fam.mtp_layers:
            return f"multi-token-prediction layer (num_nextn_predict_layers={fam.mtp_layers}); not trained here"
    return ""


def reverse_module_map(rules: list[Rule]) -> dict[str, str]:
    """Our module name -> checkpoint module name (what `export_peft(name_map=...)` takes). Grouped expert
    modules map to `...experts.<proj>` (PEFT export stacks them over experts, see lora/peft.py)."""
    out = {}
    for r in rules:
        if r.absent_ok or not r.ours.endswith(".weight"):
            continue
        if not (r.module or r.sources[0].endswith(".weight")):
            continue  # a bare parameter (the KPool gate) is no module of the checkpoint; fused experts name theirs
        mod = r.ours.rsplit(".", 1)[0]
        src = r.module or r.sources[0].rsplit(".", 1)[0]
        if r.stacked:  # model.layers.3.mlp.experts.0.gate_proj -> model.layers.3.mlp.experts.gate_proj
            head, _, proj = src.rpartition(".")
            src = head.rsplit(".", 1)[0] + "." + proj
        out[mod] = src
    return out


def reverse_row_perms(rules: list[Rule]) -> dict[str, torch.Tensor]:
    """Our module name -> the row permutation onboarding applied to its weight (ours = ckpt[perm]); PEFT export
    undoes it on lora_B (`export_peft(row_perms=...)`): DeepSeek's interleaved RoPE rows."""
    return {r.ours.rsplit(".", 1)[0]: r.row_perm for r in rules
            if r.row_perm is not None and r.ours.endswith(".weight") and not r.absent_ok}
