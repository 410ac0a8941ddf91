"""Built-in model presets. Parameter counts are checked on the meta device by `moeadapt info` and tests.

hybrid-2.8t — the dimensions and why:
  * trunk of the Kimi-K2 / DeepSeek-V3 family: hidden 7168, vocab 163840, MLA with 128 heads,
    q_lora_rank 1536, kv_lora_rank 512, nope/rope/v head dims 128/64/128;
  * 64 layers in the 3 KDA : 1 gated DSA pattern (48 KDA with 64 heads x 128, 16 DSA); first layer dense;
  * LatentMoE: 896 routed experts, 16 per token, plus one shared expert (width 4096) on the full hidden
    size. Tokens are projected to a latent width of 3584 (= hidden / 2) before dispatch, so all-to-all
    carries half the bytes; each expert is a SwiGLU of width 4608 in the latent space
    (3 x 3584 x 4608 = 49.5M parameters per expert, 44.4B per MoE layer);
  * lightning indexer 64 heads x 128, top-2048 keys per query; 1M-token context (RoPE theta 5e7).
  Total 2.82T parameters, ~77B active per token (both counted on meta by `moeadapt info --model hybrid-2.8t`).
"""

from __future__ import annotations

from .schema import ModelSpec

# The demo model: 4 layers (3 KDA + 1 gated DSA), LatentMoE with 8 experts, byte vocabulary.
_TINY = dict(
    name="tiny", vocab_size=264, hidden_size=128, n_layers=4, max_position_embeddings=2048,
    kda_n_heads=4, kda_head_dim=32,
    n_heads=4, q_lora_rank=64, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
    index_n_heads=4, index_head_dim=32, index_topk=64, index_loss_coef=0.01,
    first_k_dense=1, intermediate_size=384, n_routed_experts=8, n_experts_per_tok=2, n_shared_experts=1,
    moe_intermediate_size=128, latent_dim=64, score_func="sigmoid", routed_scaling_factor=1.0,
    bias_update_rate=1e-3,
)

_PRESETS: dict[str, dict] = {
    "tiny": _TINY,
    # `tiny` with a small vision tower (patch 14, 2 ViT blocks of width 64): the vision-language demo model.
    # Its language model is `tiny`'s, so the shipped tiny base loads into it (`init_from`); the tower starts
    # from random weights. 14 x 14-pixel patches, 2 x 2 merged: a 56 x 56 image is 4 tokens.
    "tiny-vl": dict(
        _TINY, name="tiny-vl",
        vision=dict(patch_size=14, hidden_size=64, n_layers=2, n_heads=4, intermediate_size=256,
                    image_token_id=263),
    ),
    # ~2B total / ~0.5B active: one GPU.
    "small": dict(
        name="small", vocab_size=32768, hidden_size=2048, n_layers=16, max_position_embeddings=32768,
        kda_n_heads=16, kda_head_dim=128,
        n_heads=16, q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        index_n_heads=16, index_head_dim=128, index_topk=2048,
        first_k_dense=1, intermediate_size=5632, n_routed_experts=64, n_experts_per_tok=8, n_shared_experts=1,
        moe_intermediate_size=768, latent_dim=1024, score_func="sigmoid", routed_scaling_factor=2.5,
    ),
    # Kimi Linear 48B-A3B: 27 layers, 3 KDA : 1 MLA (MLA layers served by our gated-DSA layer with the indexer
    # selecting all past tokens up to index_topk, output gate off).
    "kimi-linear-48b-a3b": dict(
        name="kimi-linear-48b-a3b", vocab_size=163840, hidden_size=2304, n_layers=27,
        layer_types=["dsa" if (i + 1) in (4, 8, 12, 16, 20, 24, 27) else "kda" for i in range(27)],
        max_position_embeddings=1048576, kda_n_heads=32, kda_head_dim=128,
        n_heads=32, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        index_n_heads=32, index_head_dim=128, index_topk=2048, attn_output_gate=False,
        first_k_dense=1, intermediate_size=9216, n_routed_experts=256, n_experts_per_tok=8, n_shared_experts=1,
        moe_intermediate_size=1024, latent_dim=None, score_func="sigmoid", routed_scaling_factor=2.446,
    ),
    # DeepSeek-V3.2: 61 MLA+DSA layers, 256 experts top-8 with group-limited routing (main model, no MTP).
    "deepseek-v3.2": dict(
        name="deepseek-v3.2", vocab_size=129280, hidden_size=7168, n_layers=61, layer_types=["dsa"] * 61,
        max_position_embeddings=163840, rope_theta=10000.0,
        rope_scaling=dict(type="yarn", factor=40.0, original_max_position_embeddings=4096, beta_fast=32.0,
                          beta_slow=1.0, mscale=1.0, mscale_all_dim=1.0),  # as its config.json ships it
        n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        index_n_heads=64, index_head_dim=128, index_topk=2048, attn_output_gate=False,
        first_k_dense=3, intermediate_size=18432, n_routed_experts=256, n_experts_per_tok=8, n_shared_experts=1,
        moe_intermediate_size=2048, latent_dim=None, score_func="sigmoid", n_group=8, topk_group=4,
        routed_scaling_factor=2.5,
    ),
    "hybrid-2.8t": dict(
        name="hybrid-2.8t", vocab_size=163840, hidden_size=7168, n_layers=64, dsa_every=4,
        max_position_embeddings=1048576, rope_theta=50_000_000.0,
        kda_n_heads=64, kda_head_dim=128,
        n_heads=128, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        index_n_heads=64, index_head_dim=128, index_topk=2048,
        first_k_dense=1, intermediate_size=18432, n_routed_experts=896, n_experts_per_tok=16, n_shared_experts=1,
        moe_intermediate_size=4608, latent_dim=3584, score_func="sigmoid", n_group=1, topk_group=1,
        routed_scaling_factor=2.5,
    ),
}
# the shared expert width: n_shared_experts x this (defaults to moe_intermediate_size)
_SHARED = {"hybrid-2.8t": 4096, "small": 1536}


def preset_names() -> list[str]:
    return list(_PRESETS)


def get_preset(name: str, /, **overrides) -> ModelSpec:
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; choose one of {preset_names()} or give a model directory")
    kw = dict(_PRESETS[name])
    if name in _SHARED:
        kw.setdefault("shared_intermediate_size", _SHARED[name])
    kw.update(overrides)
    return ModelSpec(**kw)
