"""glm5_next (GLM-5.3-Flash) vision tower + projector alone against transformers' Glm5NextVisionModel on random
images: a tiny random checkpoint (shapes and weights from the `seed` fixture) passes at 1e-4 in float32; our copy
with one vision tensor perturbed FAILS naming the part; the RoPE row map and the SwiGLU clamp each matter; the
config reader names what it cannot map; the pixel layout is the processor's. The whole vision-language model
(tower + projector + text model) against Glm5NextForConditionalGeneration on image + text documents: onboard +
validate pass, a perturbed vision tensor or the removed RoPE row map fails naming the part, a LoRA step trains
with the tower frozen, the HF export gives the checkpoint's tensors back."""

import json
import random

import pytest
import torch
import transformers
from onboard_helpers import perturb, random_checkpoint

from moeadapt.models.vision import patchify
from moeadapt.onboard import OnboardError, onboard, read_family_dir
from moeadapt.onboard import glm5_vision as g5
from moeadapt.onboard.glm5_vision import (
    glm5_next_pixel_values,
    glm5_next_vision_spec,
    validate_glm5_next_vision,
)
from moeadapt.onboard.validate import TOL, validate_checkpoint


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


def _vl(tmp_path, seed, **kw):
    """A tiny random glm5_next vision-language checkpoint written by transformers (text and vision shapes and
    weights from `seed`)."""
    return random_checkpoint("glm5_next", tmp_path / "vl", seed, **kw)


def test_onboard_validate_with_images(seed, tmp_path):
    """The whole model (vision tower + projector + text model) against transformers'
    Glm5NextForConditionalGeneration on image + text documents: logits within 1e-4, every vision part compared
    and carrying image features, every checkpoint tensor mapped."""
    d = _vl(tmp_path, seed)
    cfg = json.loads((d / "config.json").read_text())
    res = onboard(d, validate=True, seed=seed)
    v, s = res["validation"], res["spec"]
    print({k: v[k] for k in ("max_abs_diff", "max_abs_diff_end_to_end", "max_abs_logit", "lengths", "vision_parts",
                             "per_layer")})
    assert v["passed"], v["where"]
    assert v["logit_rel_diff"] <= TOL and v["max_abs_logit"] > 0.1
    assert v["reference"].endswith("Glm5NextForConditionalGeneration")
    vc = cfg["vision_config"]
    assert [p[0] for p in v["vision_parts"]] == (["patch embedding"] + [f"block {i}" for i in range(vc["depth"])]
                                                 + ["final norm", "projector"])
    assert all(m > 0.02 for _, _, m in v["vision_parts"])  # every part really carried image features
    assert (s.vision.n_layers, s.vision.patch_size, s.vision.image_token_id) == (
        vc["depth"], vc["patch_size"], cfg["image_token_id"])
    # our tokens into our text model: float32 rounding of the towers, amplified by the KDA blocks (~5e-6 - 1e-4)
    assert v["max_abs_diff_end_to_end"] <= 10 * TOL
    c = res["check"]
    assert c["mapped"] == c["tensors"] and not c["ignored"]
    assert any(r.ours.startswith("vision.") and r.sources[0].startswith("model.visual.") for r in res["rules"])


def test_image_documents_are_what_transformers_reads(seed):
    """The validation's documents: two images of different sizes, each image's placeholders (one per merged
    token) between the image start / end tokens, no random text token a placeholder or a video mark; the pixel
    values are the processor's layout of the same patches."""
    import types

    from moeadapt.config import VisionSpec
    from moeadapt.onboard.validate import _image_doc

    g = torch.Generator().manual_seed(seed)
    V = 64
    vs = VisionSpec(patch_size=14, hidden_size=16, n_heads=2, n_layers=1, image_token_id=V - 4, norm="rmsnorm",
                    qk_norm=True, mlp_act="swiglu", temporal_patch_size=2, patch_embed_conv=True, projector="glm")
    spec = types.SimpleNamespace(vision=vs, vocab_size=V)
    hf_cfg = types.SimpleNamespace(image_token_id=V - 4, video_token_id=V - 3, image_start_token_id=V - 2,
                                   image_end_token_id=V - 1, video_start_token_id=V - 6, video_end_token_id=V - 5)
    ids, hf, ours = _image_doc(spec, hf_cfg, 40, 2, g, "glm5_next")
    grids = ours.grid_hw.tolist()
    assert len(grids) == 2 and grids[0] != grids[1]
    assert hf["image_grid_thw"].tolist() == [[1, h, w] for h, w in grids]
    t = ids[0].tolist()
    assert t.count(V - 2) == t.count(V - 1) == 2 and V - 3 not in t and V - 6 not in t and V - 5 not in t
    starts = [i for i, x in enumerate(t) if x == V - 2]
    for (h, w), at in zip(grids, starts):
        n = h * w // 4
        assert t[at + 1:at + 1 + n] == [V - 4] * n and t[at + 1 + n] == V - 1
    assert t.count(V - 4) == ours.n_tokens
    torch.testing.assert_close(hf["pixel_values"], glm5_next_pixel_values(ours.pixel_values, vs))


def test_image_token_count_mismatch_is_named(seed):
    """The text model reads transformers' image tokens; a projector giving a different number of them is an error
    naming the merger / projector map."""
    from torch import nn

    from moeadapt.onboard.validate import _feed_tokens

    m = nn.Module()
    m.vision = nn.Module()
    m.vision.projector = nn.Identity()
    x = torch.randn(6, 8, generator=torch.Generator().manual_seed(seed))
    with _feed_tokens(m, x[:4] + 1):
        with pytest.raises(OnboardError, match=r"our projector gives \(6, 8\) image tokens, transformers \(4, 8\)"):
            m.vision.projector(x)
    with _feed_tokens(m, x + 1):
        torch.testing.assert_close(m.vision.projector(x), x + 1)
    torch.testing.assert_close(m.vision.projector(x), x)  # the hook is gone afterwards


def test_broken_vision_copy_fails_naming_the_part(seed, tmp_path):
    """Our copy with one vision tensor perturbed: FAIL, naming that part; the parts before it still agree."""
    d = _vl(tmp_path, seed)
    fam = read_family_dir(d)
    last = fam.spec.vision.n_layers - 1
    for name, part in [(f"vision.tower.blocks.{last}.fc3.weight", f"block {last}"),
                       ("vision.projector.downsample.weight", "projector")]:
        v = validate_checkpoint(d, fam, layers=1, seed=seed, tamper=perturb(name))  # the whole tower, 1 text block
        assert not v["passed"] and v["first_bad_part"] == part, (name, v["where"])
        assert v["where"].startswith(f"the vision {part} is the first part to diverge")
        labels = [p[0] for p in v["vision_parts"]]
        assert all(dh / max(1, h) <= TOL for _, dh, h in v["vision_parts"][:labels.index(part)])


def test_rope_row_map_is_what_makes_qk_match(seed, tmp_path, monkeypatch, capsys):
    """Without the q / k row permutation the first block diverges: the CLI says FAIL, names the part, exits 2."""
    from moeadapt.cli import main

    d = _vl(tmp_path, seed)
    monkeypatch.setattr(g5, "_glm_rope_rows", lambda heads, head: torch.arange(heads * head))
    assert main(["onboard", str(d), "--validate", "--layers", "1", "--seed", str(seed)]) == 2
    out = capsys.readouterr()
    assert "FAIL" in out.out and "vision projector: max |Δh|" in out.out and "validation failed" in out.err
    assert "the vision block 0 is the first part to diverge" in out.err


def test_lora_step_on_the_checkpoint_keeps_vision_frozen(seed, tmp_path):
    """A LoRA training step initialised from the VL checkpoint on image + text data: the tower and projector are
    frozen by default (nothing of them trainable, no adapter on them), the language model's adapters train."""
    from moeadapt import api
    from moeadapt.config import build_run_config
    from moeadapt.data import shapes
    from moeadapt.onboard import model_spec_from_dir

    # the byte tokenizer's image placeholder (263); the video / span tokens beyond its 264 ids
    d = _vl(tmp_path, seed, vocab_size=272, image_token_id=263, image_start_token_id=264, image_end_token_id=265,
            video_token_id=266, video_start_token_id=267, video_end_token_id=268)
    shapes.write_split(tmp_path / "d", "train", 4, 1, turns=1)
    spec = model_spec_from_dir(d)
    assert spec.vision.image_token_id == 263
    cfg = build_run_config({
        "model": spec.model_dump(mode="json"), "lora": {"rank": 2, "alpha": 4},
        "train": dict(steps=1, lr=1e-2, warmup_steps=0, micro_batch_size=2, seq_len=64, log_every=1,
                      output_dir=str(tmp_path / "run"), init_from=str(d), seed=0, device="cpu", dtype="fp32",
                      save_every=1),
        "data": {"train": str(tmp_path / "d" / "train.jsonl")}})
    r = api.train(cfg, quiet=True)
    assert r.steps == 1 and torch.isfinite(torch.tensor(r.final_loss))
    from safetensors import safe_open

    with safe_open(str(r.output_dir / "adapter" / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert keys and not [k for k in keys if "vision" in k or "visual" in k]
    from moeadapt.config import LoRASpec
    from moeadapt.lora import inject_lora
    from moeadapt.models import build_model

    m = build_model(spec, "meta")
    inject_lora(m, LoRASpec(rank=2, alpha=4))
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n and not n.startswith("vision.") for n in trainable)


def test_hf_export_round_trips_the_vision_tensors(seed, tmp_path):
    """Our model written back in the checkpoint's format (merge-adapter --format hf): every tensor, the vision
    ones with their q / k rows and norm weights permuted back, equals the checkpoint's."""
    from safetensors.torch import load_file

    from moeadapt.onboard import onboard_model
    from moeadapt.onboard.export import save_hf_dir

    d = _vl(tmp_path, seed)
    ours, _ = onboard_model(d, dtype=torch.float32)
    out = save_hf_dir(ours, d, tmp_path / "back")
    want, got = load_file(str(d / "model.safetensors")), load_file(str(out / "model.safetensors"))
    assert set(got) == set(want) and any(k.startswith("model.visual.") for k in got)
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, bad[:5]
    q = want["model.visual.blocks.0.attn.qkv.weight"]
    assert not torch.equal(ours.get_parameter("vision.tower.blocks.0.attn.qkv.weight"), q)  # permuted in ours


def test_family_reader_reports_vision_fields(seed):
    """read_family on a glm5_next config: the VisionSpec attached; a vision field it cannot map is named with the
    rest of the config (or a note under --allow-unmapped); without a vision_config the model is text-only."""
    from onboard_helpers import _random_cfg

    from moeadapt.onboard import read_family

    cfg = _random_cfg("glm5_next", random.Random(seed)).to_dict()
    fam = read_family(cfg)
    assert fam.spec.vision is not None and fam.spec.vision.n_layers == cfg["vision_config"]["depth"]
    assert fam.spec.vision.image_token_id == cfg["image_token_id"] and not fam.skip_prefixes
    for change, needle in [({"window_size": 4}, r"vision_config\.window_size \(not understood\)"),
                           ({"hidden_act": "gelu"}, r"vision_config\.hidden_act='gelu' \(the MLPs are SwiGLU\)")]:
        bad = json.loads(json.dumps(cfg))
        bad["vision_config"].update(change)
        with pytest.raises(OnboardError, match=needle):
            read_family(bad)
        notes = read_family(bad, allow_unmapped=True).notes
        assert any(n.startswith("ignored: vision_config.") for n in notes), notes
    text_only = {k: v for k, v in cfg.items() if k != "vision_config"}
    assert read_family(text_only).spec.vision is None


def test_sliced_reads_match_the_whole_load(seed, tmp_path):
    """FSDP's boxes of the vision tensors (RoPE-permuted qkv rows, permuted q / k norm weights, the Conv3d patch
    kernel, the downsample kernel) equal the whole-tensor load."""
    from test_sliced_read import _check_all_boxes

    src = _check_all_boxes(_vl(tmp_path, seed), seed)
    assert src.loader.rule("vision.tower.blocks.0.attn.qkv.weight").row_perm is not None
    assert src.loader.rule("vision.tower.blocks.0.attn.q_norm.weight").row_perm is not None
