"""Architecture families: a Hugging Face `config.json` (or ours) -> `ModelSpec` + what the loader must know.

Owns: recognising `model_type`, reading every config field (each one is consumed, on a short harmless list,
or reported as not understood), and the per-family facts the name map and loader need (RoPE layout, MTP
layers to skip, FP8 block size). Must not touch tensors.

Families: deepseek_v3 and kimi_k2 (MLA + MoE; MLA is served by our DSA layer in dense mode: index_topk =
max_position_embeddings, so the sparse attention selects every causal key), deepseek_v32 (MLA + lightning
indexer = our DSA layer), glm_moe_dsa (GLM-5: deepseek_v32's layout with interleaved indexer RoPE and
shared-indexer layers), kimi_linear (KDA + NoPE MLA + MoE), qwen3_moe (GQA + MoE, served by the "gqa" layer
type), qwen3_next (Gated DeltaNet "gdn" + gated GQA), qwen3_5_moe (Qwen3.5-MoE's text model: qwen3_next with split
DeltaNet projections, under model.language_model.; vision tower skipped), minimax_m2 (GQA + sigmoid-routed MoE),
glm5_next's text model (GLM-5.3-Flash: KDA with a lower-bounded gate + NoPE MLA with a KPool indexer and
shared-indexer layers, clamped SwiGLU, hyper-connection residual streams; with its vision tower + projector,
mapped by glm5_vision.py, in front), kimi_k25 (MoonViT vision tower + 2 x 2 merger + MLP projector in front of a
deepseek_v3 text model; images only, no video), and our own format (config.json with a "moeadapt" key).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from pydantic import ValidationError

from ..config import ModelSpec
from ..config.load import format_validation_error


class OnboardError(ValueError):
    """A checkpoint that cannot be mapped; the message names what was not understood."""


# Fields that never change the math of the forward pass (tokens, bookkeeping, inference-only switches).
HARMLESS = {
    "architectures", "auto_map", "model_type", "transformers_version", "torch_dtype", "dtype", "use_cache",
    "bos_token_id", "eos_token_id", "pad_token_id", "_name_or_path", "name_or_path", "output_router_logits",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id", "problem_type",
    "is_encoder_decoder", "chunk_size_feed_forward", "tokenizer_class", "pretraining_tp", "ep_size",
    "initializer_range", "attention_dropout", "use_return_dict", "tie_encoder_decoder", "generation_config",
    "qk_head_dim", "head_dim_original", "task_specific_params", "quantization_config",
}


@dataclass
class Family:
    """The outcome of reading a config: the spec plus the facts the name map and the loader need."""

    model_type: str
    spec: ModelSpec
    raw: dict
    rope_interleave: bool = False  # MLA q_pe / k_pe rows laid out in interleaved pairs (DeepSeek)
    index_rope_interleave: bool = False  # the indexer's q / k rope rows interleaved as well (GLM-5)
    mtp_layers: int = 0  # extra multi-token-prediction layers after the last one (skipped, with a notice)
    fp8_block: tuple[int, int] | None = None  # block-quantised FP8 weights (weight_scale_inv)
    dense_mla: bool = False  # MLA without an indexer: DSA in dense mode, indexer not in the checkpoint
    notes: list[str] = field(default_factory=list)  # semantic differences worth a line in the report
    hf_class: str | None = None  # transformers class that implements the family (for --validate)
    norm_offset: float = 0.0  # RMSNorm weights stored as weight - offset (Qwen3-Next's 1 + weight norms)
    layer_limit: int | None = None  # a truncated view (validate --layers N): checkpoint layers >= N are skipped
    prefix: str = "model."  # the text model's tensor prefix ("model.language_model." in multimodal checkpoints)
    skip_prefixes: dict[str, str] = field(default_factory=dict)  # checkpoint-name prefix -> why it is not loaded


class _Reader:
    def __init__(self, cfg: dict, model_type: str):
        self.cfg, self.model_type = cfg, model_type
        self.used: set[str] = set()
        self.unsupported: list[str] = []
        self.children: list[_Reader] = []  # readers of nested configs (text_config), finished with this one

    def get(self, *keys: str, default: Any = None) -> Any:
        """The first present key among aliases."""
        for k in keys:
            self.used.update(keys)
            if k in self.cfg and self.cfg[k] is not None:
                return self.cfg[k]
        return default

    def need(self, *keys: str) -> Any:
        v = self.get(*keys)
        if v is None:
            raise OnboardError(f"{self.model_type} config lacks {keys[0]!r}; the config.json is incomplete")
        return v

    def expect(self, key: str, ok, why: str) -> None:
        """A field whose value we can only honour when `ok(value)`; else it is reported as unsupported."""
        self.used.add(key)
        if key in self.cfg and not ok(self.cfg[key]):
            self.unsupported.append(f"{key}={self.cfg[key]!r} ({why})")

    def finish(self, allow_unmapped: bool, notes: list[str]) -> None:
        left = sorted(k for k in self.cfg if k not in self.used and k not in HARMLESS)
        problems = [f"{k} (not understood)" for k in left] + self.unsupported
        for c in self.children:
            problems += [f"{c.model_type}.{k} (not understood)" for k in sorted(c.cfg) if k not in c.used
                         and k not in HARMLESS] + [f"{c.model_type}.{p}" for p in c.unsupported]
        if problems and not allow_unmapped:
            raise OnboardError(f"{self.model_type} config: {len(problems)} field(s) cannot be mapped onto ModelSpec: "
                               + "; ".join(problems) + ". Fix the config or pass --allow-unmapped to map the rest "
                               "anyway (the model will then differ from the original)")
        notes.extend(f"ignored: {p}" for p in problems)


_YARN_KEYS = {"type", "rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast",
              "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"}


def _rope(r: _Reader) -> tuple[float, dict | None]:
    """(rope_theta, YaRN parameters or None) from `rope_parameters` (transformers >= 5) or `rope_scaling`.
    Plain RoPE and YaRN are implemented; any other type (linear, dynamic, longrope, llama3, ...) or an unknown
    YaRN key is reported (an OnboardError unless --allow-unmapped)."""
    params = r.get("rope_parameters") or {}
    scaling = r.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", r.get("rope_theta", default=10000.0)))
    src = next((d for d in (params, scaling) if d.get("rope_type", d.get("type", "default")) not in ("default", None)),
               None)
    if src is None:
        return theta, None
    rt = src.get("rope_type", src.get("type"))
    if rt != "yarn":
        r.unsupported.append(f"rope scaling type {rt!r} (implemented: default, yarn)")
        return theta, None
    unknown = sorted(set(src) - _YARN_KEYS)
    if unknown:
        r.unsupported.append(f"YaRN rope scaling keys {unknown} (understood: {sorted(_YARN_KEYS)})")
    orig = src.get("original_max_position_embeddings")
    if not orig:
        r.unsupported.append("YaRN rope scaling without original_max_position_embeddings")
        return theta, None
    factor = src.get("factor") or r.need("max_position_embeddings") / orig  # transformers' fallback
    out = dict(type="yarn", factor=float(factor), original_max_position_embeddings=int(orig))
    for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor", "truncate"):
        if src.get(k) is not None:
            out[k] = src[k]
    return theta, out


def _silu(r: _Reader) -> None:
    r.expect("hidden_act", lambda v: v == "silu", "experts and dense FFN are SwiGLU")
    r.expect("attention_bias", lambda v: not v, "projections have no bias")
    r.expect("mlp_bias", lambda v: not v, "FFN projections have no bias")


def _mlp_types(r: _Reader, kw: dict) -> None:
    """transformers' per-layer "dense" / "sparse" list: only a dense prefix is supported."""
    mlp_types = r.get("mlp_layer_types")
    if mlp_types:
        k = next((i for i, t in enumerate(mlp_types) if t == "sparse"), len(mlp_types))
        if any(t != "sparse" for t in mlp_types[k:]):
            r.unsupported.append(f"mlp_layer_types={mlp_types} (dense layers only as a prefix are supported)")
        kw["first_k_dense"] = k


def _mla(r: _Reader) -> dict:
    r.expect("num_key_value_heads", lambda v: v == r.cfg.get("num_attention_heads"), "MLA has no KV-head groups")
    r.expect("head_dim", lambda v: v in (r.cfg.get("qk_rope_head_dim"), None), "transformers' rotary width = rope dim")
    # transformers (and the DeepSeek / Moonshot reference code) build q_a_layernorm / kv_a_layernorm with a fixed
    # epsilon of 1e-6, whatever rms_norm_eps says
    return dict(
        mla_norm_eps=1e-6,
        n_heads=r.need("num_attention_heads"), q_lora_rank=r.get("q_lora_rank"), kv_lora_rank=r.need("kv_lora_rank"),
        qk_nope_head_dim=r.need("qk_nope_head_dim"), qk_rope_head_dim=r.need("qk_rope_head_dim"),
        v_head_dim=r.need("v_head_dim"),
    )


def _moe(r: _Reader, n_layers: int) -> dict:
    E = r.get("n_routed_experts", "num_local_experts", "num_experts", default=0)
    r.expect("moe_layer_freq", lambda v: v == 1, "every layer after first_k_dense is MoE")
    r.expect("topk_method", lambda v: v in ("noaux_tc", "greedy", "group_limited_greedy"), "top-k methods")
    r.expect("seq_aux", lambda v: True, "")
    score = r.get("scoring_func", "moe_router_activation_func", default="sigmoid")
    if score not in ("sigmoid", "softmax"):
        r.unsupported.append(f"scoring_func={score!r} (sigmoid or softmax)")
        score = "sigmoid"
    n_sh = r.get("n_shared_experts", "num_shared_experts", default=0)
    inter = r.need("intermediate_size")
    return dict(
        first_k_dense=min(n_layers, r.get("first_k_dense_replace", default=0)), intermediate_size=inter,
        n_routed_experts=E, n_experts_per_tok=r.get("num_experts_per_tok", "num_experts_per_token", default=1),
        n_shared_experts=n_sh, moe_intermediate_size=r.need("moe_intermediate_size"), latent_dim=None,
        score_func=score, n_group=r.get("n_group", "num_expert_group", default=1) or 1,
        topk_group=r.get("topk_group", default=1) or 1,
        routed_scaling_factor=float(r.get("routed_scaling_factor", default=1.0)),
        norm_topk_prob=bool(r.get("norm_topk_prob", "moe_renormalize", default=True)),
        aux_loss_coef=0.0, seq_aux_loss_coef=float(r.get("aux_loss_alpha", default=0.0) or 0.0)
        if r.cfg.get("seq_aux") else 0.0,
        bias_update_rate=1e-3 if score == "sigmoid" else 0.0,
    )


def _common(r: _Reader) -> dict:
    theta, yarn = _rope(r)
    return dict(
        vocab_size=r.need("vocab_size"), hidden_size=r.need("hidden_size"), n_layers=r.need("num_hidden_layers"),
        max_position_embeddings=r.need("max_position_embeddings", "model_max_length"), rope_theta=theta,
        rope_scaling=yarn, norm_eps=float(r.get("rms_norm_eps", default=1e-6)), tie_word_embeddings=bool(r.get("tie_word_embeddings")),
    )


def _deepseek(r: _Reader, fam: Family) -> dict:
    _silu(r)
    kw = _common(r)
    n = kw["n_layers"]
    kw.update(_mla(r))
    kw.update(_moe(r, n))
    fam.rope_interleave = bool(r.get("rope_interleave", default=True))
    fam.mtp_layers = int(r.get("num_nextn_predict_layers", "num_mtp_layers", default=0) or 0)
    _mlp_types(r, kw)
    kw.update(layer_types=["dsa"] * n, attn_output_gate=False)
    if r.model_type in ("deepseek_v32", "glm_moe_dsa"):
        r.expect("layer_types", lambda v: set(v) <= {"indexed_attention"}, "every layer is MLA + indexer")
        kw.update(index_n_heads=r.need("index_n_heads"), index_head_dim=r.need("index_head_dim"),
                  index_topk=r.need("index_topk"), index_norm_eps=1e-6)  # indexer.k_norm: LayerNorm(eps=1e-6)
        fam.hf_class = "DeepseekV32ForCausalLM"
    if r.model_type == "glm_moe_dsa":  # GLM-5: V3.2's layout, interleaved indexer RoPE, shared-indexer layers
        kinds = r.get("indexer_types") or ["full"] * n
        if set(kinds) - {"full", "shared"}:
            r.unsupported.append(f"indexer_types {sorted(set(kinds) - {'full', 'shared'})} (full or shared)")
        kw["index_shared_layers"] = [i for i, k in enumerate(kinds) if k == "shared"]
        fam.index_rope_interleave = True
        fam.hf_class = "GlmMoeDsaForCausalLM"
    elif r.model_type != "deepseek_v32":  # MLA without indexer: the sparse attention selects every causal key (dense), indexer minimal + unused
        fam.dense_mla = True
        kw.update(index_n_heads=1, index_head_dim=kw["qk_rope_head_dim"], index_topk=kw["max_position_embeddings"])
        fam.hf_class = "DeepseekV3ForCausalLM"
    return kw


def _kimi_linear(r: _Reader, fam: Family) -> dict:
    _silu(r)
    kw = _common(r)
    n = kw["n_layers"]
    kw.update(_mla(r))
    kw.update(_moe(r, n))
    lin = r.get("linear_attn_config") or {}
    if lin:  # Moonshot's layout: 1-based layer lists
        full = {i - 1 for i in lin.get("full_attn_layers", [])}
        types = ["dsa" if i in full else "kda" for i in range(n)]
        kw.update(kda_n_heads=lin["num_heads"], kda_head_dim=lin["head_dim"],
                  kda_conv_size=lin.get("short_conv_kernel_size", 4))
    else:  # transformers' layout
        lt = r.need("layer_types")
        types = ["dsa" if t == "full_attention" else "kda" for t in lt]
        kw.update(kda_n_heads=r.need("linear_num_heads"), kda_head_dim=r.need("linear_head_dim"),
                  kda_conv_size=r.get("linear_conv_kernel_dim", default=4))
    _mlp_types(r, kw)
    r.get("use_grouped_topk", "model_max_length", "num_nextn_predict_layers")
    # Kimi Linear's MLA layers are NoPE (transformers never rotates them; Moonshot's config says mla_use_nope)
    kw.update(layer_types=types, attn_output_gate=False, index_topk=kw["max_position_embeddings"],
              index_n_heads=1, index_head_dim=kw["qk_rope_head_dim"],
              mla_rope=not bool(r.get("mla_use_nope", default=True)))
    fam.dense_mla = True
    fam.hf_class = "KimiLinearForCausalLM"
    return kw


def _qwen3_moe(r: _Reader, fam: Family) -> dict:
    _silu(r)
    kw = _common(r)
    n = kw["n_layers"]
    r.expect("use_sliding_window", lambda v: not v, "sliding-window attention is not implemented")
    r.get("sliding_window", "max_window_layers")
    r.expect("decoder_sparse_step", lambda v: v == 1, "MoE on every layer after the dense prefix")
    dense = sorted(r.get("mlp_only_layers", default=[]) or [])
    if dense != list(range(len(dense))):
        r.unsupported.append(f"mlp_only_layers={dense} (dense layers only as a prefix are supported)")
    H = r.need("num_attention_heads")
    hd = r.get("head_dim", default=kw["hidden_size"] // H)
    kw.update(
        layer_types=["gqa"] * n, n_heads=H, gqa_n_kv_heads=r.need("num_key_value_heads"), gqa_head_dim=hd,
        gqa_qk_norm=True, first_k_dense=len(dense), intermediate_size=r.need("intermediate_size"),
        n_routed_experts=r.need("num_experts", "num_local_experts"), n_experts_per_tok=r.need("num_experts_per_tok"),
        n_shared_experts=0, moe_intermediate_size=r.need("moe_intermediate_size"), latent_dim=None,
        score_func="softmax", norm_topk_prob=bool(r.get("norm_topk_prob", default=False)),
        routed_scaling_factor=1.0, bias_update_rate=0.0,
        aux_loss_coef=float(r.get("router_aux_loss_coef", default=0.0)),
        # the MLA / indexer fields are unused by gqa layers; keep them small and valid
        qk_rope_head_dim=min(16, hd - hd % 2), index_head_dim=max(16, hd), index_topk=kw["max_position_embeddings"],
    )
    fam.hf_class = "Qwen3MoeForCausalLM"
    return kw


def _qwen3_next(r: _Reader, fam: Family) -> dict:
    """Qwen3-Next: Gated DeltaNet ("gdn") layers and gated full attention with partial RoPE ("gqa"), a
    softmax-routed MoE with a sigmoid-gated shared expert. Its RMSNorms (all but the DeltaNet output norm) scale by
    1 + weight: the name map adds the 1 (names.py)."""
    kw = _qwen3_moe(r, fam)
    _gated_hybrid(r, fam, kw)
    fam.hf_class = "Qwen3NextForCausalLM"
    return kw


def _gated_hybrid(r: _Reader, fam: Family, kw: dict) -> None:
    """What Qwen3-Next and Qwen3.5 share: the gdn / gated-gqa layer pattern, partial RoPE, the Gated DeltaNet
    shapes, the sigmoid-gated shared expert and the 1 + weight RMSNorms."""
    every = int(r.get("full_attention_interval", default=4))  # older config.json files: no layer_types
    types = r.get("layer_types") or ["full_attention" if (i + 1) % every == 0 else "linear_attention"
                                     for i in range(kw["n_layers"])]
    bad = sorted(set(types) - {"linear_attention", "full_attention"})
    if bad:
        r.unsupported.append(f"layer_types {bad} (linear_attention or full_attention)")
    params = r.get("rope_parameters") or {}
    # transformers' default for configs that do not say: a quarter of the head dim rotates
    factor = float(params.get("partial_rotary_factor", r.get("partial_rotary_factor", default=0.25)))
    hd = kw["gqa_head_dim"]
    kw.update(
        layer_types=["gdn" if t == "linear_attention" else "gqa" for t in types],
        gqa_output_gate=True, gqa_rope_dim=int(hd * factor) if factor != 1.0 else None,
        gdn_n_key_heads=r.need("linear_num_key_heads"), gdn_n_value_heads=r.need("linear_num_value_heads"),
        gdn_key_head_dim=r.need("linear_key_head_dim"), gdn_value_head_dim=r.need("linear_value_head_dim"),
        kda_conv_size=r.get("linear_conv_kernel_dim", default=4),
    )
    sh = r.get("shared_expert_intermediate_size", default=0)
    if sh:
        kw.update(n_shared_experts=1, shared_intermediate_size=sh, shared_expert_gate=True)
    fam.norm_offset = 1.0


# the top level of a Qwen3.5 multimodal config.json: the text model lives under text_config
_QWEN35_TOP = ("text_config", "vision_config", "image_token_id", "video_token_id", "vision_start_token_id",
               "vision_end_token_id", "tie_word_embeddings")


def _qwen3_5_moe(r: _Reader, fam: Family) -> dict:
    """Qwen3.5-MoE, the text model (model_type qwen3_5_moe: the multimodal checkpoint, text under text_config and
    its weights under model.language_model.; or qwen3_5_moe_text, a text-only checkpoint under model.).
    Qwen3-Next's architecture with: the Gated DeltaNet input projections split per kind (in_proj_qkv / _z / _b /
    _a, head-major: gdn_proj_layout="split"); a router that always renormalises its top-k; no dense FFN at all
    (no intermediate_size); multimodal RoPE (mrope_section), which for text positions (the same position on the
    t / h / w axes) is plain partial RoPE. The vision tower (model.visual.*) and the multi-token-prediction
    layers (mtp.*) are skipped with a notice."""
    t = r
    if r.cfg.get("text_config") is not None:
        r.get(*_QWEN35_TOP)
        t = _Reader(dict(r.cfg["text_config"]), f"{r.model_type} text_config")
        if r.cfg.get("tie_word_embeddings") is not None:  # the multimodal model ties by its top-level flag
            t.cfg["tie_word_embeddings"] = r.cfg["tie_word_embeddings"]
        fam.prefix = "model.language_model."
        if r.cfg.get("vision_config"):
            fam.skip_prefixes["model.visual."] = "vision tower (not mapped: moeadapt onboards the text model)"
            fam.notes.append("vision tower (model.visual.*) not mapped: the text model only (text-only input)")
    _silu(t)
    kw = _common(t)
    n = kw["n_layers"]
    H = t.need("num_attention_heads")
    hd = t.get("head_dim", default=kw["hidden_size"] // H)
    t.expect("attn_output_gate", lambda v: bool(v), "full attention is always output-gated")
    t.expect("decoder_sparse_step", lambda v: v == 1, "MoE on every layer")
    t.expect("mlp_only_layers", lambda v: not v, "every layer is MoE")
    t.expect("norm_topk_prob", lambda v: v in (None, True), "the Qwen3.5 router always renormalises its top-k")
    t.get("mamba_ssm_dtype")  # the recurrent state's dtype at inference; ours is float32
    params = t.get("rope_parameters") or {}
    if params.get("mrope_section"):
        fam.notes.append(f"multimodal RoPE (mrope_section={params['mrope_section']}) served as plain partial RoPE: "
                         "exact for text positions")
    mtp = int(t.get("mtp_num_hidden_layers", default=0) or 0)
    t.get("mtp_use_dedicated_embeddings")
    if mtp:
        fam.skip_prefixes["mtp."] = f"multi-token-prediction layers (mtp_num_hidden_layers={mtp}); not trained here"
    kw.update(
        layer_types=["gqa"] * n, n_heads=H, gqa_n_kv_heads=t.need("num_key_value_heads"), gqa_head_dim=hd,
        gqa_qk_norm=True, first_k_dense=0, n_routed_experts=t.need("num_experts"),
        n_experts_per_tok=t.need("num_experts_per_tok"), n_shared_experts=0,
        moe_intermediate_size=t.need("moe_intermediate_size"), latent_dim=None, score_func="softmax",
        norm_topk_prob=True, routed_scaling_factor=1.0, bias_update_rate=0.0,
        aux_loss_coef=float(t.get("router_aux_loss_coef", default=0.0)),
        qk_rope_head_dim=min(16, hd - hd % 2), index_head_dim=max(16, hd), index_topk=kw["max_position_embeddings"],
        gdn_proj_layout="split",
    )
    _gated_hybrid(t, fam, kw)
    if t is not r:
        left = sorted(k for k in t.cfg if k not in t.used and k not in HARMLESS)
        r.unsupported += [f"text_config.{k} (not understood)" for k in left] + [f"text_config.{p}" for p in t.unsupported]
    fam.hf_class = "Qwen3_5MoeForCausalLM"
    return kw


def _minimax_m2(r: _Reader, fam: Family) -> dict:
    """MiniMax-M2: GQA with one q / k RMSNorm over all heads and partial RoPE; every layer a sigmoid-routed MoE
    (selection bias, top-k normalised, no shared expert)."""
    _silu(r)
    kw = _common(r)
    n = kw["n_layers"]
    H = r.need("num_attention_heads")
    hd = r.get("head_dim", default=kw["hidden_size"] // H)
    params = r.get("rope_parameters") or {}
    rd = r.get("rotary_dim")
    factor = params.get("partial_rotary_factor", rd / hd if rd else 1.0)
    r.expect("router_jitter_noise", lambda v: not v, "router jitter noise is not implemented")
    inter = r.need("intermediate_size")
    kw.update(
        layer_types=["gqa"] * n, n_heads=H, gqa_n_kv_heads=r.need("num_key_value_heads"), gqa_head_dim=hd,
        gqa_qk_norm=bool(r.get("use_qk_norm", default=True)), gqa_qk_norm_full=True,
        gqa_rope_dim=int(hd * factor) if factor != 1.0 else None, first_k_dense=0, intermediate_size=inter,
        n_routed_experts=r.need("num_local_experts"), n_experts_per_tok=r.need("num_experts_per_tok"),
        n_shared_experts=0, moe_intermediate_size=inter, latent_dim=None, score_func="sigmoid",
        norm_topk_prob=True, routed_scaling_factor=1.0, bias_update_rate=1e-3,
        aux_loss_coef=float(r.get("router_aux_loss_coef", default=0.0)),
        qk_rope_head_dim=min(16, hd - hd % 2), index_head_dim=max(16, hd), index_topk=kw["max_position_embeddings"],
    )
    fam.hf_class = "MiniMaxM2ForCausalLM"
    return kw


def _sub_reader(r: _Reader, key: str) -> _Reader:
    """A reader over a nested config (text_config / vision_config), finished with `r` (its leftovers reported)."""
    sub = r.need(key)
    if not isinstance(sub, dict):
        raise OnboardError(f"{r.model_type} config: {key} is not an object; the config.json is incomplete")
    child = _Reader(sub, key)
    r.children.append(child)
    return child


def _kimi_k25(r: _Reader, fam: Family) -> dict:
    """Kimi K2.5: MoonViT (learned bicubic-resampled position table + 2-D RoPE on interleaved pairs, which the
    name map permutes onto our layout; tanh-GELU MLPs; LayerNorm eps 1e-5), a 2 x 2 merger (LayerNorm per patch)
    and a GELU MLP projector (4 D -> 4 D -> hidden) in front of a deepseek_v3 text model. Images only: video
    placeholders and the temporal position table are not used."""
    from ..config import VisionSpec

    t = _sub_reader(r, "text_config")
    kw = _deepseek(t, fam)
    kw["tie_word_embeddings"] = bool(r.get("tie_word_embeddings", default=True))  # the composite model's flag
    v = _sub_reader(r, "vision_config")
    D, H = v.need("hidden_size"), v.need("num_attention_heads")
    act = v.get("hidden_act", default="gelu_pytorch_tanh")
    if act not in ("gelu_pytorch_tanh", "gelu_new", "gelu"):
        v.unsupported.append(f"hidden_act={act!r} (gelu or its tanh approximation)")
    v.expect("merge_kernel_size", lambda x: list(x) == [2, 2], "the merger joins 2 x 2 patches")
    v.expect("head_dim", lambda x: x == D // H, "attention heads of hidden_size / num_attention_heads")
    gh, gw = v.need("pos_emb_height"), v.need("pos_emb_width")
    if gh != gw:  # transformers indexes the table as square (vision_utils: num_grid_per_side = pos_emb_height)
        v.unsupported.append(f"pos_emb_height={gh} != pos_emb_width={gw} (a square position table)")
    v.get("pos_emb_time")  # the temporal table of video clips; single-frame images add nothing
    vp = v.get("rope_parameters") or {}
    if vp.get("rope_type", "axial") != "axial" or set(vp) - {"rope_type", "rope_theta"}:
        v.unsupported.append(f"rope_parameters={vp} (axial 2-D RoPE)")
    size = dict(patch_size=v.need("patch_size"), n_layers=v.need("num_hidden_layers"),
                intermediate_size=v.need("intermediate_size"))
    r.expect("projection_hidden_size", lambda x: x in (None, D), "the merger's LayerNorm runs over one patch")
    r.get("video_token_id", "vision_start_token_id", "vision_end_token_id")  # text tokens / video only
    fam.notes.append("kimi_k25: images only (video clips and their temporal position table are not used)")
    try:
        kw["vision"] = VisionSpec(
            **size, hidden_size=D, n_heads=H, projector_hidden_size=4 * D,
            rope_theta=float(vp.get("rope_theta", 10000.0)), norm_eps=1e-5,  # MoonViT's LayerNorms: fixed 1e-5
            merger_norm_eps=float(r.get("projection_layer_norm_eps", default=1e-5)),
            image_token_id=r.need("image_token_id"), pos_embed_grid=(gh, gw),
            mlp_act="gelu" if act == "gelu" else "gelu_tanh", patch_embed_conv=True)
    except ValidationError as e:
        raise OnboardError(format_validation_error(e, "kimi_k25 vision_config -> VisionSpec")) from None
    fam.hf_class = "Kimi_K25ForConditionalGeneration"
    return kw


def _glm5_next(r: _Reader, fam: Family) -> dict:
    """GLM-5.3-Flash (transformers' glm5_next), text model: 3 KDA (lower-bounded gate) : 1 DSA over NoPE MLA
    (no rope channels) with a KPool indexer that always selects the query's own incomplete block, 'shared'
    indexer layers, clamped SwiGLU everywhere, hc_mult hyper-connection residual streams. The fields live in
    `text_config` (or at the top level of a flat config). With a `vision_config`, the vision tower + projector
    (glm5_vision.py: its VisionSpec and its `model.visual.*` name map) sit in front of the text model; images
    only: video clips (their placeholder spans, the frames of the patch kernel beyond one image) are not used."""
    top, top_r = r.cfg, r
    tie = None
    # the multimodal wrapper's fields: placeholder token ids (the image one is the VisionSpec's; video unused)
    r.used.update({"text_config", "vision_config", "image_token_id", "video_token_id", "image_start_token_id",
                   "image_end_token_id", "video_start_token_id", "video_end_token_id"})
    if isinstance(top.get("text_config"), dict):
        r.used.add("tie_word_embeddings")
        tie = bool(top.get("tie_word_embeddings"))  # transformers ties lm_head by the outer config
        sub = _Reader(top["text_config"], "text_config")
        r.children.append(sub)
        r = sub
    vision = None
    if top.get("vision_config"):
        from .glm5_vision import read_glm5_next_vision  # it imports this module: read here, not at import

        vision = read_glm5_next_vision(top_r)
        fam.notes.append("glm5_next: images only (video clips and their placeholder spans are not used)")
    _silu(r)
    kw = _common(r)
    if tie is not None:
        kw["tie_word_embeddings"] = tie
    n = kw["n_layers"]
    kw.update(_mla(r))
    r.expect("qk_rope_head_dim", lambda v: v == 0, "GLM-5.3-Flash's MLA is NoPE")
    kw.update(mla_norm_eps=kw["norm_eps"], mla_rope=False)  # q_a / kv_a layernorms use rms_norm_eps here
    kw.update(_moe(r, n))
    _mlp_types(r, kw)
    lt = r.get("layer_types") or ["indexed_attention" if i % 4 == 3 else "linear_attention" for i in range(n)]
    bad = sorted(set(lt) - {"linear_attention", "indexed_attention", "full_attention"})
    if bad:
        r.unsupported.append(f"layer_types {bad} (linear_attention or indexed_attention)")
    types = ["kda" if t == "linear_attention" else "dsa" for t in lt]
    kinds = r.get("indexer_types") or ["full"] * n
    if set(kinds) - {"full", "shared"}:
        r.unsupported.append(f"indexer_types {sorted(set(kinds) - {'full', 'shared'})} (full or shared)")
    shared = [i for i, k in enumerate(kinds) if k == "shared" and types[i] == "dsa"]
    # transformers hands a shared layer the top-k of the layer just before it, which must run its own indexer
    orphans = [i for i in shared if i == 0 or types[i - 1] != "dsa" or kinds[i - 1] != "full"]
    if orphans:
        r.unsupported.append(f"indexer_types: shared DSA layers {orphans} do not follow a 'full' DSA layer "
                             "(transformers refuses them too)")
    # transformers' defaults where the config.json leaves a field out; Moonshot-style linear_attn_config wins
    lin = r.get("linear_attn_config") or {}
    r.used.add("linear_lower_bound")
    lb = lin.get("gate_lower_bound", r.cfg.get("linear_lower_bound", -5.0))  # null: the softplus gate
    if lb is None and lin.get("safe_gate", False):
        lb = -5.0
    r.get("router_aux_loss_coef")  # a training-time weight; our aux_loss_coef stays 0 as for DeepSeek
    kw.update(
        layer_types=types, attn_output_gate=False, index_shared_layers=shared,
        kda_n_heads=lin.get("num_heads") or r.get("linear_num_heads", default=64),
        kda_head_dim=lin.get("head_dim") or r.get("linear_head_dim", default=128),
        kda_conv_size=lin.get("short_conv_kernel_size") or r.get("linear_conv_kernel_dim", default=4),
        kda_gate_lower_bound=float(lb) if lb is not None else None,
        index_n_heads=r.need("index_n_heads"), index_head_dim=r.need("index_head_dim"),
        index_topk=r.need("index_topk"), index_norm_eps=1e-6,  # indexer.k_norm: LayerNorm(eps=1e-6)
        index_kpool=int(r.get("index_kpool", default=16)),
        index_kpool_select_tail=bool(r.get("index_kpool_always_select_tail", default=True)),
        swiglu_limit=float(r.get("swiglu_limit", default=10.0)),
        hc_mult=int(r.get("hc_mult", default=4)), hc_sinkhorn_iters=int(r.get("hc_sinkhorn_iters", default=20)),
        hc_eps=float(r.get("hc_eps", default=1e-6)),
    )
    if not kw["index_kpool_select_tail"]:
        fam.notes.append("index_kpool_always_select_tail=false: a query before its first complete block selects no "
                         "key; moeadapt gives it zero attention output where transformers' eager attention "
                         "averages every position of the sequence (future ones included), so --validate differs "
                         "there")
    if vision is not None:
        kw["vision"] = vision
    fam.prefix = "model.language_model."
    fam.hf_class = "Glm5NextForConditionalGeneration"
    # transformers skips the multi-token-prediction layer GLM-5.3-Flash ships after the last one (layers.45.*)
    # whether or not the config names it; so do we
    fam.mtp_layers = max(1, int(r.get("num_nextn_predict_layers", default=0) or 0))
    return kw


_FAMILIES = {"deepseek_v3": _deepseek, "kimi_k2": _deepseek, "deepseek_v32": _deepseek, "glm_moe_dsa": _deepseek,
             "kimi_linear": _kimi_linear, "qwen3_moe": _qwen3_moe, "qwen3_next": _qwen3_next,
             "qwen3_5_moe": _qwen3_5_moe, "qwen3_5_moe_text": _qwen3_5_moe, "minimax_m2": _minimax_m2,
             "glm5_next": _glm5_next, "kimi_k25": _kimi_k25}


# Config fields of architectures we do not implement -> what they are (for the unknown-family message). Features
# that are ModelSpec options now (hyper-connections, the KPool indexer, shared-indexer layers, the lower-bounded
# KDA gate, the clamped SwiGLU: GLM-5.3-Flash) are no longer listed: an unknown family using them lacks a mapping only
_FEATURES = {
    "linear_num_value_heads": "Gated DeltaNet linear attention (one decay per head, grouped value heads)",
    "linear_key_head_dim": "Gated DeltaNet linear attention",
    "shared_expert_intermediate_size": "sigmoid-gated shared expert",
    "partial_rotary_factor": "partial RoPE (a fraction of the head dim rotated)",
    "use_sliding_window": "sliding-window attention",
    "sliding_window": "sliding-window attention",
    "vision_config": "a vision tower (multimodal model)",
    "audio_config": "an audio tower",
    "router_jitter_noise": "router jitter noise",
    "use_qk_norm": "q/k RMSNorm",
    "attn_logit_softcapping": "attention logit soft-capping",
    "final_logit_softcapping": "final logit soft-capping",
    "num_nextn_predict_layers": "multi-token-prediction layers",
}


def unsupported_features(cfg: dict) -> list[str]:
    """The features of a config (and of its text_config) that moeadapt does not implement, named."""
    out: list[str] = []
    for where, d in (("", cfg), ("text_config.", cfg.get("text_config") or {})):
        for k, what in _FEATURES.items():
            v = d.get(k)
            if v in (None, False, 0) or (isinstance(v, dict) and not v):
                continue
            item = f"{where}{k} ({what})"
            if item not in out:
                out.append(item)
        rope = d.get("rope_parameters") or {}
        if isinstance(rope, dict) and rope.get("partial_rotary_factor", 1.0) != 1.0:
            out.append(f"{where}rope_parameters.partial_rotary_factor={rope['partial_rotary_factor']} (partial RoPE)")
        types = set(d.get("layer_types") or [])
        odd = sorted(t for t in types if t not in ("linear_attention", "full_attention", "indexed_attention"))
        if odd:
            out.append(f"{where}layer_types {odd} (attention kinds moeadapt does not have)")
    return out


def family_names() -> list[str]:
    return [*_FAMILIES, "moeadapt"]


def read_family(cfg: dict, name: str = "", allow_unmapped: bool = False) -> Family:
    """Map a parsed config.json onto a Family (spec + loader facts). Raises OnboardError naming every
    field that was not understood or cannot be honoured."""
    if "moeadapt" in cfg:
        try:
            spec = ModelSpec(**cfg["moeadapt"])
        except ValidationError as e:
            raise OnboardError(format_validation_error(e, "config.json moeadapt")) from None
        return Family("moeadapt", spec, cfg)
    mt = cfg.get("model_type")
    if mt not in _FAMILIES:
        feats = unsupported_features(cfg)
        raise OnboardError(f"model_type={mt!r} is not a known family; moeadapt onboards {family_names()}"
                           + (f". Its config uses features moeadapt does not implement: {'; '.join(feats)}"
                              if feats else ""))
    fam = Family(mt, None, cfg)  # type: ignore[arg-type]
    r = _Reader(cfg, mt)
    kw = _FAMILIES[mt](r, fam)
    qc = cfg.get("quantization_config")
    if qc:
        if qc.get("quant_method") != "fp8" or qc.get("fmt", "e4m3") != "e4m3":
            r.unsupported.append(f"quantization_config={qc} (only DeepSeek block FP8 e4m3 is dequantised)")
        else:
            fam.fp8_block = tuple(qc.get("weight_block_size", (128, 128)))
    r.finish(allow_unmapped, fam.notes)
    kw["name"] = name or cfg.get("_name_or_path") or mt
    kw["index_loss_coef"] = 0.0
    try:
        fam.spec = ModelSpec(**kw)
    except ValidationError as e:
        raise OnboardError(format_validation_error(e, f"{mt} -> ModelSpec")) from None
    return fam


def truncated(fam: Family, n_layers: int) -> Family:
    """The first `n_layers` blocks of a family (embeddings, final norm and head kept): what `validate --layers N`
    builds; the checkpoint's later layers are skipped by the loader (names.ignorable)."""
    s = fam.spec
    if not 1 <= n_layers <= s.n_layers:
        raise OnboardError(f"--layers {n_layers} is outside 1..{s.n_layers} (the checkpoint's num_hidden_layers)")
    if n_layers == s.n_layers:
        return fam
    d = s.model_dump()
    d.update(n_layers=n_layers, layer_types=s.resolved_layer_types()[:n_layers],
             first_k_dense=min(s.first_k_dense, n_layers),
             index_shared_layers=[i for i in s.index_shared_layers if i < n_layers])
    return replace(fam, spec=ModelSpec(**d), layer_limit=n_layers, notes=list(fam.notes))
