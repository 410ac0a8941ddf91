"""YaRN RoPE scaling (DeepSeek-V3 / V3.2 / Kimi K2 checkpoints): config -> ModelSpec.rope_scaling, and logits
equal to transformers' deepseek_v3 / deepseek_v32 with yarn rope parameters."""

import math

import pytest
import torch
import transformers

from moeadapt.cli import main
from moeadapt.config import RopeScaling
from moeadapt.models import common
from moeadapt.onboard import OnboardError, read_family
from moeadapt.onboard.validate import TOL, validate_family

# what DeepSeek-V3's config.json ships (the legacy key and "type")
DSV3_YARN = {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
             "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}


def _ds_cfg(cls=transformers.DeepseekV3Config, **yarn):
    cfg = cls().to_dict()
    cfg.pop("rope_parameters", None)
    cfg["rope_theta"] = 10000.0
    cfg["rope_scaling"] = {**DSV3_YARN, **yarn}
    return cfg


def test_deepseek_v3_rope_scaling_maps_to_spec():
    s = read_family(_ds_cfg()).spec
    assert s.rope_scaling == RopeScaling(factor=40, original_max_position_embeddings=4096, beta_fast=32, beta_slow=1,
                                         mscale=1.0, mscale_all_dim=1.0)
    # mscale = mscale_all_dim: cos/sin unscaled, softmax scale x (0.1 ln 40 + 1)^2
    inv, att = common.rope_inv_freq(64, 1e4, s.rope_scaling)
    assert att == 1.0 and abs(common.rope_softmax_mscale(s.rope_scaling) - (0.1 * math.log(40) + 1) ** 2) < 1e-12
    plain, _ = common.rope_inv_freq(64, 1e4)
    assert torch.equal(inv[:10], plain[:10]) and torch.allclose(inv[-5:], plain[-5:] / 40)  # fast kept, slow / 40


@pytest.mark.parametrize("rope_type", ["linear", "dynamic", "longrope", "llama3"])
def test_unknown_rope_scaling_type_is_a_clear_error(rope_type):
    cfg = _ds_cfg(type=rope_type)
    with pytest.raises(OnboardError, match=f"rope scaling type '{rope_type}' \\(implemented: default, yarn\\)"):
        read_family(cfg)


def test_unknown_yarn_key_is_reported():
    with pytest.raises(OnboardError, match="YaRN rope scaling keys \\['frobnicate'\\]"):
        read_family(_ds_cfg(frobnicate=1))


@pytest.mark.parametrize("cls,extra", [
    (transformers.DeepseekV3Config, {}),  # DeepSeek-V3's own values
    (transformers.DeepseekV3Config, {"mscale": 1.0, "mscale_all_dim": 0.707}),  # attention_factor != 1 too
    (transformers.DeepseekV32Config, {}),
])
def test_yarn_logits_match_transformers(cls, extra):
    fam = read_family(_ds_cfg(cls, **extra))
    v = validate_family(fam)
    print(v)
    assert v["tiny"]["rope"] == "yarn"
    assert v["passed"] and v["max_abs_diff"] <= TOL and v["max_abs_logit"] > 0.5


def test_validation_sees_the_yarn_softmax_scale(monkeypatch):
    """Dropping the mscale^2 of the MLA softmax scale makes the same comparison fail: the test exercises it."""
    monkeypatch.setattr("moeadapt.models.dsa_attn.rope_softmax_mscale", lambda scaling: 1.0)
    v = validate_family(read_family(_ds_cfg()))
    assert not v["passed"] and v["max_abs_diff"] > 100 * TOL


def test_cli_onboard_validate_on_a_saved_yarn_checkpoint(tmp_path, capsys):
    cfg = transformers.DeepseekV3Config(
        vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8, v_head_dim=8, n_group=1,
        topk_group=1, first_k_dense_replace=1, max_position_embeddings=256, num_nextn_predict_layers=0,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                         "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                         "mscale_all_dim": 1.0})
    transformers.DeepseekV3ForCausalLM(cfg).float().save_pretrained(str(tmp_path))
    fam = read_family(__import__("json").loads((tmp_path / "config.json").read_text()))
    assert fam.spec.rope_scaling is not None and fam.spec.rope_scaling.factor == 8.0
    assert main(["onboard", str(tmp_path), "--validate"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_qwen3_moe_yarn_logits_match_transformers():
    """Qwen3 YaRN (no mscales: cos/sin x (0.1 ln 4 + 1), no softmax change) through the gqa layer."""
    cfg = transformers.Qwen3MoeConfig().to_dict()
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                              "original_max_position_embeddings": 32768}
    fam = read_family(cfg)
    assert fam.spec.rope_scaling.factor == 4.0 and common.rope_inv_freq(8, 1e6, fam.spec.rope_scaling)[1] > 1.1
    v = validate_family(fam)
    assert v["tiny"]["rope"] == "yarn" and v["passed"] and v["max_abs_diff"] <= TOL
