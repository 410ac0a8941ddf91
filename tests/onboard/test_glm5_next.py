"""glm5_next (GLM-5.3-Flash) text model: transformers' default config maps field by field; on a tiny random
checkpoint (shapes from a fresh, printed seed) each of the family's features is needed to match transformers
(the hyper-connections' Sinkhorn, the gate lower bound, the always-selected tail, the SwiGLU clamp), the
truncated model validates; the vision tower is mapped (test_glm5_vision.py validates it with the text model)."""

import dataclasses
import re

import pytest
import torch
import transformers
from onboard_helpers import fresh_seed, random_checkpoint, save_tiny

from moeadapt.cli import main
from moeadapt.models import build_model, count_parameters
from moeadapt.onboard import OnboardError, read_family, read_family_dir
from moeadapt.onboard.validate import validate_checkpoint


def _default_cfg() -> dict:
    """transformers' default glm5_next config, its vision tower ending in the text width (the defaults disagree:
    out_hidden_size 1536 vs hidden_size 4096, so transformers' own model cannot take an image with them)."""
    cfg = transformers.AutoConfig.for_model("glm5_next").to_dict()
    cfg["vision_config"]["out_hidden_size"] = cfg["text_config"]["hidden_size"]
    return cfg


def test_default_config_maps_every_field():
    raw = transformers.AutoConfig.for_model("glm5_next").to_dict()
    with pytest.raises(OnboardError, match=r"vision_config\.out_hidden_size=1536 \(the projector ends in the LM"):
        read_family(raw)
    fam = read_family(_default_cfg())
    s = fam.spec
    types = s.resolved_layer_types()
    assert len(types) == 45 and types[:4] == ["kda", "kda", "kda", "dsa"] and s.first_k_dense == 3
    assert (s.hc_mult, s.hc_sinkhorn_iters, s.index_kpool, s.index_kpool_select_tail) == (4, 20, 16, True)
    assert (s.kda_gate_lower_bound, s.swiglu_limit, s.qk_rope_head_dim, s.mla_rope) == (-5.0, 10.0, 0, False)
    assert (s.kda_n_heads, s.kda_head_dim, s.n_routed_experts, s.index_topk) == (64, 128, 288, 2048)
    assert s.mla_norm_eps == s.norm_eps == 1e-5 and s.index_norm_eps == 1e-6 and not s.attn_output_gate
    assert fam.prefix == "model.language_model." and fam.hf_class == "Glm5NextForConditionalGeneration"
    v = s.vision
    assert not fam.skip_prefixes and (v.n_layers, v.hidden_size, v.n_heads, v.temporal_patch_size) == (24, 1024, 16, 2)
    assert v.projector == "glm" and v.image_token_id == raw["image_token_id"] and v.swiglu_limit == 10.0


@pytest.mark.slow
def test_real_size_parameter_count_is_transformers():
    """Every parameter of transformers' text model (+ lm_head) and vision tower has its counterpart: the counts
    agree exactly."""
    from transformers.models.glm5_next import modeling_glm5_next as m

    s = read_family(_default_cfg()).spec
    cfg = transformers.AutoConfig.for_model("glm5_next")
    cfg.vision_config.out_hidden_size = cfg.text_config.hidden_size
    with torch.device("meta"):
        hf = [m.Glm5NextTextModel(cfg.text_config), m.Glm5NextVisionModel(cfg.vision_config)]
    want = sum(p.numel() for h in hf for p in h.parameters()) + cfg.text_config.vocab_size * s.hidden_size
    assert count_parameters(build_model(s, "meta"), s)["total"] == want  # 313.3e9


def test_text_config_fields_are_checked():
    """An unknown text_config field, and a 'shared' indexer layer with no full DSA layer just before it (which
    transformers refuses too), are named."""
    cfg = _default_cfg()
    cfg["text_config"]["frobnicate"] = 1
    with pytest.raises(OnboardError, match=r"text_config\.frobnicate \(not understood\)"):
        read_family(cfg)
    cfg["text_config"].pop("frobnicate")
    cfg["text_config"]["indexer_types"] = ["full"] * 7 + ["shared"] + ["full"] * 37  # layer 7 follows KDA layer 6
    with pytest.raises(OnboardError, match=r"shared DSA layers \[7\] do not follow a 'full' DSA layer"):
        read_family(cfg)


def test_features_each_matter(tmp_path, capsys):
    seed = fresh_seed()
    print(f"glm5_next checkpoint seed {seed} (MOEADAPT_TEST_SEED={seed} replays it)")
    d = random_checkpoint("glm5_next", tmp_path / "ckpt", seed)
    fam = read_family_dir(d)
    s = fam.spec
    dsa = s.resolved_layer_types().index("dsa")

    def fails_at(layer, **change):
        v = validate_checkpoint(d, dataclasses.replace(fam, spec=s.model_copy(update=change)), seed=seed)
        assert not v["passed"] and v["first_bad_layer"] == layer, (change, v["where"])

    fails_at(0, hc_sinkhorn_iters=1 if s.hc_sinkhorn_iters > 1 else 20)
    fails_at(0, kda_gate_lower_bound=None if s.kda_gate_lower_bound is not None else -5.0)
    fails_at(0, swiglu_limit=None)
    fails_at(dsa, index_kpool_select_tail=False)
    v = validate_checkpoint(d, fam, layers=dsa + 1, seed=seed)  # the first N blocks, built from the same files
    assert v["passed"] and v["layers"] == dsa + 1, v["where"]
    assert main(["onboard", str(d)]) == 0
    out = capsys.readouterr().out
    assert re.search(r"vision tower: [12] layers", out) and "kpool_indexer" in out  # random_checkpoint: depth 1 or 2


def test_mtp_layer_is_skipped_and_vision_tensors_mapped(tmp_path):
    """The checkpoint's extra multi-token-prediction layer (after the last layer, as GLM-5.3-Flash ships it) is
    skipped with its reason, the vision tower's tensors are mapped; any other stray tensor is still an error."""
    from safetensors.torch import load_file, save_file

    from moeadapt.onboard import onboard

    d = save_tiny("glm5_next", tmp_path / "ckpt")
    f = d / "model.safetensors"
    t = load_file(str(f))
    t["model.language_model.layers.4.shared_head.norm.weight"] = torch.ones(32)
    save_file(t, str(f), metadata={"format": "pt"})
    c = onboard(d)["check"]
    assert list(c["ignored"]) == ["model.language_model.layers.4.shared_head.norm.weight"]
    assert "multi-token-prediction" in c["ignored"]["model.language_model.layers.4.shared_head.norm.weight"]
    assert c["mapped"] == c["tensors"] - 1 and any(k.startswith("model.visual.") for k in t)
    t["model.language_model.stray.weight"] = torch.ones(2)
    save_file(t, str(f), metadata={"format": "pt"})
    with pytest.raises(OnboardError, match="map to nothing.*stray"):
        onboard(d)


def test_kpool_ties_are_aligned_but_a_wrong_indexer_fails(tmp_path):
    """2 indexer heads: many blocks score exactly 0 and torch.topk breaks those ties its own way; the validation
    accepts a different choice among equal block scores only, so an indexer with negated head weights FAILS."""
    seed = fresh_seed()
    print(f"seed {seed}")
    d = random_checkpoint("glm5_next", tmp_path / "ckpt", seed, index_n_heads=2)
    fam = read_family_dir(d)
    v = validate_checkpoint(d, fam, seed=seed)
    assert v["passed"], v["where"]
    assert v["tie_aligned"][1] > 0  # rows with a real choice of blocks were checked
    dsa = fam.spec.resolved_layer_types().index("dsa")

    def negate(m):
        with torch.no_grad():
            m.get_parameter(f"layers.{dsa}.attn.w_idx.weight").neg_()

    v = validate_checkpoint(d, fam, seed=seed, tamper=negate)
    assert not v["passed"] and v["first_bad_layer"] == dsa, v["where"]
