"""YaRN RoPE scaling (DeepSeek-V3 / V3.2 / Kimi K2 checkpoints): config -> ModelSpec.rope_scaling, and logits
equal to transformers' deepseek_v3 / deepseek_v32 with yarn rope parameters."""

import math

import pytest
import torch
import transformers
from onboard_helpers import fresh_seed, random_checkpoint

from moeadapt.cli import main
from moeadapt.config import RopeScaling
from moeadapt.models import common
from moeadapt.onboard import OnboardError, read_family, read_family_dir
from moeadapt.onboard.validate import TOL, validate_checkpoint

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


def _yarn_ckpt(tmp_path, model_type, rope_theta=10000.0, **yarn):
    """A tiny random checkpoint with YaRN; original context 32 of 128 positions so the ramp splits the dims."""
    seed = fresh_seed()
    print(f"{model_type} seed {seed}")
    rope = {"rope_type": "yarn", "rope_theta": rope_theta, "factor": 8.0, "original_max_position_embeddings": 32,
            **yarn}
    return random_checkpoint(model_type, tmp_path / "ckpt", seed, rope_parameters=rope)


@pytest.mark.parametrize("model_type,extra", [
    ("deepseek_v3", {"beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0}),  # DeepSeek-V3's
    ("deepseek_v3", {"mscale": 1.0, "mscale_all_dim": 0.707}),  # attention_factor != 1 too
    ("deepseek_v32", {"mscale": 1.0, "mscale_all_dim": 1.0}),
    ("qwen3_moe", {}),  # no mscales: cos/sin x (0.1 ln 8 + 1), no softmax change, through the gqa layer
])
def test_yarn_logits_match_transformers(model_type, extra, tmp_path):
    d = _yarn_ckpt(tmp_path, model_type, **extra)
    fam = read_family_dir(d)
    assert fam.spec.rope_scaling is not None and fam.spec.rope_scaling.factor == 8.0
    v = validate_checkpoint(d, fam)
    assert v["passed"] and v["logit_rel_diff"] <= TOL and v["max_abs_logit"] > 0.1, v["where"]


def test_validation_sees_the_yarn_softmax_scale(monkeypatch, tmp_path):
    """Dropping the mscale^2 of the MLA softmax scale makes the same comparison fail: the test exercises it."""
    d = _yarn_ckpt(tmp_path, "deepseek_v3", mscale=1.0, mscale_all_dim=1.0)
    monkeypatch.setattr("moeadapt.models.dsa_attn.rope_softmax_mscale", lambda scaling: 1.0)
    v = validate_checkpoint(d, read_family_dir(d))
    assert not v["passed"] and v["first_bad_layer"] == 0


def test_cli_onboard_validate_on_a_saved_yarn_checkpoint(tmp_path, capsys):
    d = _yarn_ckpt(tmp_path, "deepseek_v3", mscale=1.0, mscale_all_dim=1.0)
    assert main(["onboard", str(d), "--validate"]) == 0
    assert "PASS" in capsys.readouterr().out


def test_qwen3_moe_yarn_maps():
    cfg = transformers.Qwen3MoeConfig().to_dict()
    cfg["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                              "original_max_position_embeddings": 32768}
    fam = read_family(cfg)
    assert fam.spec.rope_scaling.factor == 4.0 and common.rope_inv_freq(8, 1e6, fam.spec.rope_scaling)[1] > 1.1
