"""data/multimodal.py: both record conventions, placeholder expansion, assistant-only loss, pixel budget,
the packed patches against a direct computation, and one clear error (or a counted skip) per bad image."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

from moeadapt.config import DataSpec, VisionSpec
from moeadapt.data.multimodal import ImageError, build_mm_dataset, image_to_patches, resize_for_budget
from moeadapt.data.tokenizer import ByteTokenizer

VS = VisionSpec(patch_size=14, hidden_size=32, n_heads=4, image_token_id=263)
TOK = ByteTokenizer()


def _png(path, w, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    arr = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)
    Image.fromarray(arr.numpy()).save(path)
    return path


def _write(path, recs):
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def _hf(*imgs, q="Describe.", a="two cats"):
    return {"messages": [{"role": "user", "content": [*({"type": "image", "image": i} for i in imgs),
                                                      {"type": "text", "text": q}]},
                         {"role": "assistant", "content": a}]}


def test_resize_for_budget_bounds(seed):
    rng = random.Random(seed)
    for _ in range(400):
        h, w = rng.randint(5, 3000), rng.randint(5, 3000)
        if max(h, w) / min(h, w) > 50:
            continue
        lo = rng.choice([28 * 28, 56 * 56, 112 * 112])
        hi = lo * rng.choice([1, 4, 16, 64])
        H, W = resize_for_budget(h, w, 28, lo, hi)
        what = (h, w, lo, hi, H, W)
        assert H % 28 == 0 and W % 28 == 0 and H >= 28 and W >= 28, what
        rounded = max(28, round(h / 28) * 28) * max(28, round(w / 28) * 28)
        if rounded > hi:  # scaled down: within max_pixels (max wins over min) unless a side hit one tile
            assert H * W <= hi or min(H, W) == 28, what
        elif rounded < lo:  # scaled up
            assert H * W >= lo, what
        else:  # only rounded to the tile
            assert (H, W) == (max(28, round(h / 28) * 28), max(28, round(w / 28) * 28)), what
        if min(H, W) >= 4 * 28:
            assert abs((H / W) / (h / w) - 1) < 0.35, what  # aspect kept up to rounding
    assert resize_for_budget(100, 100, 28, 28 * 28, 10**9) == (112, 112)
    assert resize_for_budget(1024, 1024, 28, 28 * 28, 1024 * 1024) == (1008, 1008)
    with pytest.raises(ValueError, match="aspect ratio above 50"):
        resize_for_budget(10, 1000, 28, 1, 10**9)


def test_patches_match_a_direct_computation(tmp_path, seed):
    img = Image.open(_png(tmp_path / "a.png", 70, 40, seed)).convert("RGB")
    px, (gh, gw) = image_to_patches(img, VS, 28 * 28, 10**9)
    H, W = resize_for_budget(40, 70, 28, 28 * 28, 10**9)
    assert (gh, gw) == (H // 14, W // 14) and px.shape == (gh * gw, 3 * 14 * 14)
    x = torch.from_numpy(np.asarray(img.resize((W, H), Image.Resampling.BICUBIC))).double()
    x = ((x / 255 - 0.5) / 0.5).permute(2, 0, 1)
    # patch k of merged block (br, bc) = pixels of patch (2 br + k // 2, 2 bc + k % 2)
    k = 0
    for br in range(gh // 2):
        for bc in range(gw // 2):
            for j in range(4):
                r, c = 2 * br + j // 2, 2 * bc + j % 2
                want = x[:, 14 * r:14 * (r + 1), 14 * c:14 * (c + 1)].reshape(-1)
                torch.testing.assert_close(px[k].double(), want, rtol=0, atol=1e-6)
                k += 1


def test_both_conventions_several_images_assistant_only_loss(tmp_path):
    _png(tmp_path / "a.png", 56, 56)
    (tmp_path / "sub").mkdir()
    _png(tmp_path / "sub" / "b.png", 112, 56, 1)
    hf = _hf("a.png", "sub/b.png")
    swift = {"messages": [{"role": "user", "content": "<image><image>Describe."},
                          {"role": "assistant", "content": "two cats"}], "images": ["a.png", "sub/b.png"]}
    f = _write(tmp_path / "d.jsonl", [hf, swift])
    ds = build_mm_dataset(str(f), TOK, VS, 64, DataSpec(train=str(f), max_pixels=10**6))
    assert torch.equal(ds.inputs[0], ds.inputs[1]) and torch.equal(ds.labels[0], ds.labels[1])
    ids = ds.inputs[0].tolist()
    assert ids.count(263) == 4 + 8  # 56x56 -> 2x2 merged tokens, 112 wide x 56 high -> 2 x 4
    assert ids[:13] == [TOK.role_id("user")] + [263] * 12
    learned = [t for t in ds.labels[0].tolist() if t != -100]
    assert TOK.decode(learned) == "two cats<|end|>"
    ib = ds.image_batch([0, 1])
    assert ib.grid_hw.tolist() == [[4, 4], [4, 8]] * 2 and ib.n_tokens == 24
    assert [p.name for p in ds.images[0]] == ["a.png", "b.png"]


def _bad_cases(tmp_path):
    _png(tmp_path / "ok.png", 56, 56)
    good = (tmp_path / "ok.png").read_bytes()
    (tmp_path / "trunc.png").write_bytes(good[: len(good) // 2])
    (tmp_path / "text.png").write_text("not an image")
    return {"missing.png": "does not exist", "trunc.png": "cannot be decoded", "text.png": "cannot be decoded"}


@pytest.mark.parametrize("bad", ["missing.png", "trunc.png", "text.png"])
def test_bad_image_is_one_error_naming_file_and_line(tmp_path, bad):
    why = _bad_cases(tmp_path)[bad]
    f = _write(tmp_path / "d.jsonl", [_hf("ok.png"), _hf("ok.png", bad), _hf("ok.png")])
    with pytest.raises(ImageError, match=rf"d\.jsonl:2: image file .*{bad} {why}"):
        build_mm_dataset(str(f), TOK, VS, 64, DataSpec(train=str(f)))
    ds = build_mm_dataset(str(f), TOK, VS, 64, DataSpec(train=str(f), skip_bad_images=True))
    assert len(ds) == 2 and len(ds.skipped) == 1 and "d.jsonl:2" in ds.skipped[0]


def test_record_errors(tmp_path):
    _png(tmp_path / "ok.png", 56, 56)
    cases = [
        ({"messages": [{"role": "user", "content": "<image><image>x"}, {"role": "assistant", "content": "y"}],
          "images": ["ok.png"]}, "more <image> markers"),
        ({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}],
          "images": ["ok.png"]}, "more image"),
        (_hf("http://example.com/a.png"), "is a URL"),
        ({"messages": [{"role": "user", "content": [{"type": "video", "video": "v.mp4"}]}]}, "is not"),
        ({"text": "plain"}, "non-empty 'messages'"),
    ]
    for rec, msg in cases:
        f = _write(tmp_path / "d.jsonl", [rec])
        with pytest.raises(ValueError, match=msg):
            build_mm_dataset(str(f), TOK, VS, 64, DataSpec(train=str(f)))
    f = _write(tmp_path / "d.jsonl", [_hf("ok.png", q="x" * 80)])
    with pytest.raises(ValueError, match=r"d\.jsonl:1: the record is \d+ tokens \(4 of them image tokens\)"):
        build_mm_dataset(str(f), TOK, VS, 64, DataSpec(train=str(f)))
