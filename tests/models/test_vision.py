"""The vision encoder (models/vision/) against its float64 reference (values and gradients), packed vs one
image at a time, the attention backends against each other, and its input checks."""

from __future__ import annotations

import pytest
import torch

from moeadapt.config import VisionSpec
from moeadapt.models.vision import ImageBatch, VisionModel, packed_attention, patchify
from moeadapt.models.vision.reference import vision_reference

SIZES = [(28, 56), (56, 28), (28, 28), (56, 84)]  # pixels; patch 14 -> grids 2x4, 4x2, 2x2, 4x6


def _spec(**kw) -> VisionSpec:
    base = dict(patch_size=14, hidden_size=32, n_layers=2, n_heads=4, intermediate_size=48, rope_theta=100.0)
    base.update(kw)
    return VisionSpec(**base)


# MoonViT's layout options (Kimi K2.5): learned position table resampled bicubically (grids above, below and
# across its size), tanh GELU, the merger's own epsilon, Conv2d-shaped patch embedding
MOONVIT = dict(pos_embed_grid=(3, 5), mlp_act="gelu_tanh", merger_norm_eps=1e-2, patch_embed_conv=True,
               norm_eps=1e-5)


# GLM-5.3's (glm5_next): RMSNorms, q / k RMSNorm, clamped SwiGLU (a limit the random activations reach), Conv3d
# patch kernel over 2 frames, the downsample + SwiGLU projector
GLM = dict(norm="rmsnorm", qk_norm=True, mlp_act="swiglu", swiglu_limit=1.5, temporal_patch_size=2,
           patch_embed_conv=True, projector="glm", projector_hidden_size=40, norm_eps=1e-5)


def _model(spec, lm_hidden=24, dtype=torch.float64):
    m = VisionModel(spec, lm_hidden).to(dtype)
    with torch.no_grad():  # every parameter random (LayerNorm gains and biases too), so each one is checked
        for p in m.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.dim() > 1 else 0.5))
    return m


def _images(dtype=torch.float64):
    return [torch.randn(3, h, w, dtype=dtype) for h, w in SIZES]


def _pack(imgs, patch=14):
    px = torch.cat([patchify(im, patch) for im in imgs])
    grid = torch.tensor([[im.shape[1] // patch, im.shape[2] // patch] for im in imgs])
    return ImageBatch(px, grid)


@pytest.mark.parametrize("backend, layout", [("sdpa", {}), ("reference", {}), ("sdpa", MOONVIT), ("sdpa", GLM)])
def test_packed_equals_float64_reference_values_and_grads(seed, backend, layout):
    spec = _spec(**layout)
    m = _model(spec)
    for mod in m.modules():
        if hasattr(mod, "backend"):
            mod.backend = backend
    imgs = [im.requires_grad_() for im in _images()]
    out = m(_pack(imgs))
    params = dict(m.named_parameters())
    ref = torch.cat([vision_reference(params, spec, im) for im in imgs])
    assert out.shape == ref.shape == (sum(h * w for h, w in SIZES) // (28 * 28), 24)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    w = torch.randn_like(out)
    g = torch.autograd.grad((out * w).sum(), [*params.values(), *imgs])
    gr = torch.autograd.grad((ref * w).sum(), [*params.values(), *imgs])
    for name, a, b in zip([*params, *(f"image{i}" for i in range(len(imgs)))], g, gr):
        assert b.abs().max() > 0, name
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=lambda s, n=name: f"grad {n}: {s}")


@pytest.mark.parametrize("layout", [{}, MOONVIT, GLM])
def test_packed_equals_one_at_a_time(seed, layout):
    spec = _spec(n_layers=3, **layout)
    m = _model(spec, dtype=torch.float32)
    imgs = _images(torch.float32)
    packed = m(_pack(imgs))
    alone = torch.cat([m(_pack([im])) for im in imgs])
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)
    # and the packing matters: a different neighbour order changes an image's tokens (positions are used)
    flipped = m(_pack([im.flip(-1) for im in imgs[:1]]))
    assert (flipped - alone[: flipped.shape[0]]).abs().max() > 1e-3


def test_attention_backends_agree(seed):
    cu = torch.tensor([0, 5, 17, 18, 30], dtype=torch.int32)
    q, k, v = (torch.randn(30, 3, 8, dtype=torch.float64) for _ in range(3))
    ref = packed_attention(q, k, v, cu, 12, "reference")
    torch.testing.assert_close(packed_attention(q, k, v, cu, 12, "sdpa"), ref, rtol=1e-12, atol=1e-12)
    # block-diagonal: changing image 2's keys leaves images 1, 3, 4 untouched
    k2 = k.clone()
    k2[5:17] += 1.0
    o2 = packed_attention(q, k2, v, cu, 12, "reference")
    assert torch.equal(o2[:5], ref[:5]) and torch.equal(o2[17:], ref[17:]) and not torch.equal(o2[5:17], ref[5:17])
    with pytest.raises(ValueError, match="needs CUDA"):
        packed_attention(q, k, v, cu, 12, "varlen")


def test_bad_inputs_are_one_clear_error():
    spec = _spec()
    m = _model(spec, dtype=torch.float32)
    with pytest.raises(ValueError, match="not a multiple of patch_size"):
        patchify(torch.zeros(3, 42, 28), 14)
    with pytest.raises(ValueError, match="multiples of merge_size"):
        m(ImageBatch(torch.zeros(3, 588), torch.tensor([[1, 3]])))
    with pytest.raises(ValueError, match=r"expected \[patches, 588\]"):
        m(ImageBatch(torch.zeros(4, 100), torch.tensor([[2, 2]])))
    with pytest.raises(ValueError, match="hold 8 patches but pixel_values has 4"):
        m(ImageBatch(torch.zeros(4, 588), torch.tensor([[2, 4]])))
    x = torch.zeros(1, 6, 24)
    ids = torch.tensor([[1, 263, 263, 2, 3, 4]])
    with pytest.raises(ValueError, match="give 1 tokens but the text holds 2"):
        m.embed_images(x, ids, ImageBatch(torch.zeros(4, 588), torch.tensor([[2, 2]])))
    with pytest.raises(ValueError, match="no images were given"):
        m.embed_images(x, ids, None)
    with pytest.raises(ValueError, match="multiple of 4"):
        VisionSpec(hidden_size=24, n_heads=4)
    with pytest.raises(ValueError, match="needs patch_embed_conv"):
        VisionSpec(temporal_patch_size=2)


def test_embed_images_fills_placeholders_in_order(seed):
    spec = _spec()
    m = _model(spec, dtype=torch.float32)
    imgs = _images(torch.float32)[:2]
    batch = _pack(imgs)
    assert batch.n_tokens == 4
    n = 6
    ids = torch.full((2, n), 5)
    ids[0, 1:1 + 2] = 263  # image 0 (2 tokens) in row 0, image 1 (2 tokens) in row 1
    ids[1, 3:5] = 263
    x = torch.randn(2, n, 24)
    y = m.embed_images(x, ids, batch)
    toks = m(batch)
    torch.testing.assert_close(y[0, 1:3], toks[:2])
    torch.testing.assert_close(y[1, 3:5], toks[2:4])
    keep = ids != 263
    assert torch.equal(y[keep], x[keep])


def test_model_replaces_placeholders_before_the_first_block(seed):
    from moeadapt.config import get_preset
    from moeadapt.models.model import build_model, materialize
    from moeadapt.models.stats import count_parameters
    from moeadapt.plan.memory import param_counts

    spec = get_preset("tiny-vl")
    meta = build_model(spec, "meta")
    c = count_parameters(meta, spec)
    assert c["by_component"]["vision_tower"] > 0 and c["by_component"]["vision_projector"] > 0
    assert param_counts(spec, None).total == c["total"]  # the planner counts the tower
    m = materialize(build_model(spec, "meta"), "cpu", seed=0)
    m.set_backend("reference")
    ids = torch.randint(0, 256, (2, 12))
    ids[0, 3:7] = spec.vision.image_token_id  # one 56 x 56 image = 4 tokens per row
    ids[1, 5:9] = spec.vision.image_token_id
    imgs = [torch.randn(3, 56, 56) for _ in range(2)]
    out = m(ids, images=_pack(imgs))
    alt = m(ids, images=_pack([imgs[0], torch.randn(3, 56, 56)]))
    d = (out.logits - alt.logits).abs().amax(-1)
    assert d[0].max() == 0  # row 0's image unchanged, causal model: row 0 identical
    assert d[1, :5].max() == 0 and d[1, 5:].min() > 0  # row 1: only from its first image token on
    assert m(torch.randint(0, 256, (1, 8))).logits.shape == (1, 8, spec.vocab_size)  # text-only batch
    text = materialize(build_model(get_preset("tiny"), "meta"), "cpu")
    with pytest.raises(ValueError, match="has no vision tower"):
        text(ids, images=_pack(imgs))


def test_position_table_resampling(seed):
    """The learned table: bicubic like F.interpolate (the reference's explicit kernel agrees), the table itself
    at its own size, and it matters: zeroing it changes every token."""
    import torch.nn.functional as F

    from moeadapt.models.vision.reference import resample_reference
    from moeadapt.models.vision.tower import patch_positions, resample_pos_embed

    table = torch.randn(5, 3, 8, dtype=torch.float64)
    for gh, gw in [(2, 8), (6, 2), (5, 3)]:
        want = F.interpolate(table.permute(2, 0, 1)[None], size=(gh, gw), mode="bicubic",
                             align_corners=False)[0].permute(1, 2, 0)
        torch.testing.assert_close(resample_reference(table, gh, gw), want, rtol=1e-12, atol=1e-12)
    grid = torch.tensor([[4, 2], [6, 6]])
    got = resample_pos_embed(table, grid)
    pos = patch_positions(grid)
    n0 = 8
    torch.testing.assert_close(got[:n0], resample_reference(table, 4, 2)[pos[:n0, 0], pos[:n0, 1]])
    torch.testing.assert_close(got[n0:], resample_reference(table, 6, 6)[pos[n0:, 0], pos[n0:, 1]])
    same = resample_pos_embed(table[:4, :2], grid[:1])
    assert torch.equal(same, table[:4, :2][pos[:n0, 0], pos[:n0, 1]])
    spec = _spec(**MOONVIT)
    m = _model(spec, dtype=torch.float32)
    batch = _pack(_images(torch.float32)[:2])
    out = m(batch)
    with torch.no_grad():
        m.tower.pos_embed.zero_()
    assert (m(batch) - out).abs().amax(-1).min() > 1e-4
    with pytest.raises(ValueError, match="two positive sizes"):
        VisionSpec(pos_embed_grid=(0, 4))


@pytest.mark.parametrize("layout", [MOONVIT, GLM])
def test_layout_options_have_init_rules(layout):
    """The trainer's scale-true init (models/init.py) covers the layout options' tensors."""
    from moeadapt.config import get_preset
    from moeadapt.models.init import init_rules
    from moeadapt.models.model import build_model

    base = get_preset("tiny-vl")
    spec = base.model_copy(update={"vision": VisionSpec(**{**base.vision.model_dump(), **layout})})
    rules = init_rules(build_model(spec, "meta"))
    if "pos_embed_grid" in layout:
        assert rules["vision.tower.pos_embed"].kind == "normal"
    assert rules["vision.tower.patch_embed.weight"].kind == "normal"
    assert rules["vision.tower.patch_embed.bias"].kind == "const"
