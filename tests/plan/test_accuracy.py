"""Predicted vs measured peak memory of real training steps on CPU (live-storage accounting): micro, tiny and
gqa models with every recompute mode, with and without LoRA, on fresh random weights and tokens (a new seed
each run)."""

import random

import pytest

from moeadapt.config import LoRASpec, ModelSpec, get_preset
from moeadapt.plan.accuracy import measure_step, predict_step

SPEC = ModelSpec(name="micro", vocab_size=264, hidden_size=32, n_layers=4, kda_n_heads=2, kda_head_dim=8, n_heads=2,
                 q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                 index_n_heads=2, index_head_dim=8, index_topk=16, first_k_dense=1, intermediate_size=48,
                 n_routed_experts=4, n_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                 latent_dim=16, max_position_embeddings=256)

# the gqa layer type (qwen3_moe onboarding) on the same shapes: 4 GQA layers, 4 query heads on 1 KV head, plain MoE
GQA = ModelSpec(**SPEC.model_copy(update=dict(layer_types=["gqa"] * 4, gqa_n_kv_heads=1, gqa_head_dim=8, n_heads=4,
                                              latent_dim=None)).model_dump())
GQA_LORA = ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "experts.w1", "experts.w2", "experts.w3"]
ROWS = [  # model, seq, micro-batch, recompute, LoRA rank (0: full training)
    ("micro", 128, 2, "none", 0), ("micro", 64, 2, "none", 0), ("micro", 128, 2, "full", 0),
    ("micro", 128, 2, "none", 4), ("micro", 128, 2, "selective", 0), ("micro", 128, 2, "selective", 4),
    ("micro", 128, 2, "full", 4),
    ("tiny", 128, 2, "none", 0), ("tiny", 128, 2, "full", 0), ("tiny", 128, 2, "none", 4),
    ("tiny", 128, 2, "selective", 0), ("tiny", 128, 2, "selective", 4), ("tiny", 128, 2, "full", 4),
    ("gqa", 128, 2, "none", 0), ("gqa", 128, 2, "none", 4), ("gqa", 128, 2, "selective", 0),
    ("gqa", 128, 2, "selective", 4), ("gqa", 128, 2, "full", 0), ("gqa", 128, 2, "full", 4),
]


@pytest.mark.parametrize("model,seq,mb,rc,lora", ROWS)
def test_predicted_peak_within_10pct_of_measured_on_cpu(model, seq, mb, rc, lora):
    spec = {"micro": SPEC, "gqa": GQA}.get(model) or get_preset(model)
    ls = (LoRASpec(rank=lora, targets=GQA_LORA) if model == "gqa" else LoRASpec(rank=lora)) if lora else None
    seed = random.randrange(1 << 30)
    meas = measure_step(spec, seq, mb, rc, ls, seed=seed)["peak"]
    pred = predict_step(spec, seq, mb, rc, ls)
    err = pred["total"] / meas - 1
    print(f"{model} seq={seq} mb={mb} {rc} lora={lora} seed={seed}: measured {meas / 1e6:.2f} MB, predicted "
          f"{pred['total'] / 1e6:.2f} MB ({pred['peak_phase']}), error {100 * err:+.1f}%")
    assert abs(err) < 0.10, (seed, pred)
