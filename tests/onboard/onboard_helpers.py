"""Tiny transformers checkpoints for the onboarding tests (never downloads)."""

import json

import transformers


def tiny_cfg(model_type: str, **kw):
    """A tiny transformers config of a family (never downloads)."""
    if model_type == "qwen3_moe":
        base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=64)
        base.update(kw)
        return transformers.Qwen3MoeConfig(**base)
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                v_head_dim=8, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64,
                num_nextn_predict_layers=0)
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


def save_tiny(model_type: str, out, **kw):
    cfg = tiny_cfg(model_type, **kw)
    cls = transformers.Qwen3MoeForCausalLM if model_type == "qwen3_moe" else transformers.DeepseekV3ForCausalLM
    m = cls(cfg).float()
    m.save_pretrained(str(out))
    return out




def read_cfg(d):
    return json.loads((d / "config.json").read_text())
