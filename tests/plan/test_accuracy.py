"""Predicted vs measured peak memory of real training steps on CPU (live-storage accounting)."""

import pytest

from moeadapt.config import LoRASpec, ModelSpec
from moeadapt.plan.accuracy import measure_step, predict_step

SPEC = ModelSpec(name="micro", vocab_size=264, hidden_size=32, n_layers=4, kda_n_heads=2, kda_head_dim=8, n_heads=2,
                 q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                 index_n_heads=2, index_head_dim=8, index_topk=16, first_k_dense=1, intermediate_size=48,
                 n_routed_experts=4, n_experts_per_tok=2, n_shared_experts=1, moe_intermediate_size=16,
                 latent_dim=16, max_position_embeddings=256)


@pytest.mark.parametrize("seq,mb,rc,lora,tol", [
    (128, 2, "none", None, 0.10),
    (128, 2, "full", None, 0.15),
    (128, 2, "selective", None, 0.10),
    (128, 2, "none", 4, 0.15),
])
def test_predicted_peak_close_to_measured_on_cpu(seq, mb, rc, lora, tol):
    ls = LoRASpec(rank=lora) if lora else None
    meas = measure_step(SPEC, seq, mb, rc, ls)["peak"]
    pred = predict_step(SPEC, seq, mb, rc, ls)["total"]
    print(f"seq={seq} mb={mb} {rc} lora={lora}: measured {meas / 1e6:.2f} MB, predicted {pred / 1e6:.2f} MB, "
          f"error {100 * (pred / meas - 1):+.1f}%")
    assert abs(pred / meas - 1) < tol
