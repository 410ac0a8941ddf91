"""glm5_next (GLM-5.3-Flash) vision tower + projector alone against transformers' Glm5NextVisionModel on random
images: a tiny random checkpoint (shapes and weights from the `seed` fixture) passes at 1e-4 in float32; our copy
with one vision tensor perturbed FAILS naming the part; the RoPE row map and the SwiGLU clamp each matter; the
config reader names what it cannot map; the pixel layout is the processor's."""

import json
import random

import pytest
import torch
import transformers
from onboard_helpers import perturb

from moeadapt.models.vision import patchify
from moeadapt.onboard import OnboardError
from moeadapt.onboard import glm5_vision as g5
from moeadapt.onboard.glm5_vision import (
    glm5_next_pixel_values,
    glm5_next_vision_spec,
    validate_glm5_next_vision,
)


def tiny_glm5_next(out, seed: int, **vision):
    """A tiny Glm5NextForConditionalGeneration written by transformers, vision shapes and weights from `seed`
    (norms away from 1, a SwiGLU limit the activations reach)."""
    rnd = random.Random(seed)
    c = rnd.choice
    D, heads, lm = c([16, 32]), c([2, 4]), c([24, 48])
    vc = dict(depth=c([1, 2]), hidden_size=D, num_heads=heads, intermediate_size=c([24, 40]), patch_size=c([14, 16]),
              spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=lm, projection_intermediate_size=c([32, 56]),
              swiglu_limit=c([0.5, 1.0]), rms_norm_eps=c([1e-5, 1e-6]),
              rope_parameters={"rope_type": "axial", "rope_theta": c([100.0, 10000.0])})
    vc.update(vision)
    tc = dict(vocab_size=64, hidden_size=lm, intermediate_size=32, moe_intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=2, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg = transformers.Glm5NextConfig(vision_config=vc, text_config=tc, image_token_id=60)
    torch.manual_seed(seed)
    m = transformers.Glm5NextForConditionalGeneration(cfg).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.model.visual.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.2 * noise if "norm" in name and name.endswith("weight") else 0.2 * noise)
    m.save_pretrained(str(out))
    return out


def test_vision_tower_matches_transformers(seed, tmp_path):
    d = tiny_glm5_next(tmp_path / "ckpt", seed)
    v = validate_glm5_next_vision(d, seed=seed)
    print(v)
    assert v["passed"], v["where"]
    assert v["max_abs_diff"] <= 1e-4 and v["max_abs_out"] > 0.1
    assert len(v["grids"]) == 2 and v["grids"][0] != v["grids"][1]
    assert [p[0] for p in v["parts"]][0] == "patch embedding" and all(p[2] > 0.1 for p in v["parts"])
    spec = glm5_next_vision_spec(json.loads((d / "config.json").read_text()))
    assert spec.projector == "glm" and spec.qk_norm and spec.temporal_patch_size == 2 and spec.image_token_id == 60


def test_broken_copy_fails_naming_the_part(seed, tmp_path, monkeypatch):
    d = tiny_glm5_next(tmp_path / "ckpt", seed)
    last = glm5_next_vision_spec(json.loads((d / "config.json").read_text())).n_layers - 1
    for name, part in [(f"tower.blocks.{last}.fc3.weight", f"block {last}"),
                       ("tower.patch_embed.weight", "patch embedding"), ("projector.downsample.weight", "projector")]:
        v = validate_glm5_next_vision(d, seed=seed, tamper=perturb(name))
        assert not v["passed"] and v["first_bad_part"] == part, (name, v["where"])
        assert v["where"].startswith(f"the vision {part} is the first part to diverge")
    monkeypatch.setattr(g5, "_glm_rope_rows", lambda heads, head: torch.arange(heads * head))
    v = validate_glm5_next_vision(d, seed=seed)
    assert not v["passed"] and v["first_bad_part"] == "block 0", v["where"]


def test_swiglu_clamp_matters(seed, tmp_path):
    d = tiny_glm5_next(tmp_path / "ckpt", seed, swiglu_limit=0.25)

    def no_clamp(m):
        m.projector.limit = None
        for b in m.tower.blocks:
            b.spec = b.spec.model_copy(update={"swiglu_limit": None})
    v = validate_glm5_next_vision(d, seed=seed, tamper=no_clamp)
    assert not v["passed"] and v["first_bad_part"] == "block 0", v["where"]


def test_pixel_layout_is_the_processors(seed):
    """Our packed patches, repeated over the frames, are what Glm5NextImageProcessorPil.patchify writes."""
    from transformers.models.glm5_next.image_processing_pil_glm5_next import Glm5NextImageProcessorPil

    spec = glm5_next_vision_spec({"image_token_id": 5, "text_config": {"hidden_size": 24}, "vision_config": dict(
        depth=1, hidden_size=16, num_heads=2, intermediate_size=24, patch_size=14, out_hidden_size=24,
        projection_intermediate_size=32, temporal_patch_size=2, hidden_act="silu")})
    im = torch.randn(3, 56, 84)
    want, gh, gw = Glm5NextImageProcessorPil().patchify(im.numpy(), patch_size=14, merge_size=2, temporal_patch_size=2)
    assert (gh, gw) == (4, 6)
    torch.testing.assert_close(glm5_next_pixel_values(patchify(im, 14), spec), torch.from_numpy(want))


def test_config_reader_names_what_it_cannot_map():
    base = {"image_token_id": 5, "text_config": {"hidden_size": 24}, "vision_config": dict(
        depth=1, hidden_size=16, num_heads=2, intermediate_size=24, patch_size=14, out_hidden_size=24,
        projection_intermediate_size=32, hidden_act="silu", image_size=336)}
    assert glm5_next_vision_spec(base).n_layers == 1
    for change, needle in [({"hidden_act": "gelu"}, "hidden_act='gelu'"), ({"spatial_merge_size": 3}, "spatial_merge"),
                           ({"out_hidden_size": 32}, "out_hidden_size"), ({"window_size": 4}, "window_size"),
                           ({"rope_parameters": {"rope_type": "default"}}, "rope_parameters")]:
        bad = json.loads(json.dumps(base))
        bad["vision_config"].update(change)
        with pytest.raises(OnboardError, match=needle):
            glm5_next_vision_spec(bad)


def test_onboard_validate_covers_the_vision_tower(seed, tmp_path, monkeypatch, capsys):
    """`moeadapt onboard DIR --validate` on a glm5_next checkpoint: the text model as mapped, and the vision tower
    + projector alone; a broken vision name map fails the validation naming the part."""
    from moeadapt.cli import main

    d = tiny_glm5_next(tmp_path / "ckpt", seed)
    assert main(["onboard", str(d), "--validate"]) == 0
    out = capsys.readouterr().out
    assert "vision tower + projector alone" in out and "vision projector: max |Δh|" in out and "PASS" in out
    from moeadapt.onboard import _add_glm5_vision

    monkeypatch.setattr(g5, "_glm_rope_rows", lambda heads, head: torch.arange(heads * head))
    v = {"passed": True, "where": ""}  # what the text model's validation returned
    _add_glm5_vision(v, d, seed, None, False)
    assert not v["passed"] and v["where"].startswith("the vision block 0 is the first part to diverge")
