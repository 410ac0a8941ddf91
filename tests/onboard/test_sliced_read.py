"""Sliced reads (`StreamingLoader.read_slice`, onboard/sources.py): any box of any tensor equals the same box of
the whole-tensor load (name map, RoPE row order, expert stacking, size-1 reshapes, FP8 blocks crossing the box),
reads only about the box's bytes, and the checks fail with clear messages before anything is read."""

import json
import random
import shutil

import pytest
import torch
from onboard_helpers import read_cfg
from safetensors import safe_open
from safetensors.torch import save_file

from moeadapt.models.model import build_model, materialize
from moeadapt.onboard import OnboardError, onboard_model
from moeadapt.onboard.sources import open_source
from moeadapt.parallel.sharded_io import load_sharded


def _boxes(shape, rng, n=3):
    """Random boxes: dim-0 ranges (FSDP / EP shards) and a few with every dim partial."""
    out = []
    for k in range(n):
        sl = []
        for i, d in enumerate(shape):
            if i == 0 or k == n - 1:
                a = rng.randrange(d)
                sl.append(slice(a, rng.randrange(a, d) + 1))
            else:
                sl.append(slice(0, d))
        out.append(tuple(sl))
    return out


def _check_all_boxes(d, seed):
    ref, _ = onboard_model(d, dtype=torch.float32)
    src = open_source(d)
    state = {k: v for k, v in ref.state_dict().items() if not k.endswith("tokens_per_expert")}
    src.check({k: tuple(v.shape) for k, v in state.items()})
    rng = random.Random(seed)
    for name, full in state.items():
        for sl in _boxes(full.shape, rng):
            got = src.read(name, tuple(full.shape), sl)
            assert torch.equal(got.float(), full[sl]), f"{name} box {sl}"
    return src


def test_every_box_matches_the_whole_load(qwen_dir, dsv3_dir, seed):
    for d in (qwen_dir, dsv3_dir):
        _check_all_boxes(d, seed)


def test_boxes_of_qwen3_5_norm_offsets_and_fused_experts(tmp_path, seed):
    """Qwen3.5-MoE: the 1 + weight RMSNorms get their offset in a box too (the sharded load and merge-adapter read
    boxes), and boxes of experts stored fused (experts.gate_up_proj) are our gate / up parts."""
    from onboard_helpers import fused_copy, random_checkpoint

    d = random_checkpoint("qwen3_5_moe", tmp_path / "q", seed)
    src = _check_all_boxes(d, seed)
    assert src.loader.rule("layers.0.attn_norm.weight").offset == 1.0
    _check_all_boxes(fused_copy(d, tmp_path / "fused"), seed)


def test_rope_rows_and_stacked_experts_read_only_the_box(dsv3_dir):
    src = open_source(dsv3_dir)
    ref, _ = onboard_model(dsv3_dir, dtype=torch.float32)
    state = {k: v for k, v in ref.state_dict().items() if not k.endswith("tokens_per_expert")}
    src.check({k: tuple(v.shape) for k, v in state.items()})
    name = "layers.0.attn.wq_b.weight"  # rows permuted within each head (interleaved RoPE -> half-split)
    assert src.loader.rule(name).row_perm is not None
    head = 12  # qk_nope 8 + rope 4
    before = src.bytes_read
    got = src.read(name, tuple(state[name].shape), (slice(head + 9, head + 11), slice(0, 16)))
    assert torch.equal(got, state[name][head + 9:head + 11])
    assert src.bytes_read - before <= 4 * 16 * 4  # the rows' span inside one head, not the tensor
    name = "layers.1.ffn.experts.w2.weight"
    before = src.bytes_read
    got = src.read(name, tuple(state[name].shape), (slice(1, 3), slice(0, 32), slice(0, 16)))
    assert torch.equal(got, state[name][1:3])
    assert src.bytes_read - before == 2 * 32 * 16 * 4
    assert all(".experts.1." in n or ".experts.2." in n for n in src.loader.reads[-2:])


def _quantise_fp8(src_dir, dst, names, block=(8, 8)):
    shutil.copytree(src_dir, dst)
    with safe_open(str(src_dir / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    bm, bn = block
    for name in names:
        w = t[name].float()
        m, n = w.shape
        nb = (-(-m // bm), -(-n // bn))
        pad = torch.zeros(nb[0] * bm, nb[1] * bn)
        pad[:m, :n] = w.abs()
        s = pad.view(nb[0], bm, nb[1], bn).amax(dim=(1, 3)).clamp(min=1e-8) / 448.0
        big = s.repeat_interleave(bm, 0)[:m].repeat_interleave(bn, 1)[:, :n]
        t[name] = (w / big).to(torch.float8_e4m3fn)
        t[name + "_scale_inv"] = s
    save_file(t, str(dst / "model.safetensors"))
    cfg = read_cfg(dst)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(block),
                                  "activation_scheme": "dynamic"}
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_fp8_boxes_dequantise_with_their_blocks(dsv3_dir, tmp_path, seed):
    # 8x8 blocks on 16..48-row weights: boxes start and end inside blocks; q_b_proj also has the RoPE rows
    names = ["model.layers.1.mlp.experts.2.down_proj.weight", "model.layers.0.self_attn.q_b_proj.weight",
             "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.0.mlp.gate_proj.weight"]
    d = _quantise_fp8(dsv3_dir, tmp_path / "fp8", names)
    src = _check_all_boxes(d, seed)
    assert any(n in names for n in src.loader.reads)


def test_sharded_load_of_our_own_directory(qwen_dir, tmp_path):
    from moeadapt.parallel.sharded_io import export_sharded

    ref, _ = onboard_model(qwen_dir, dtype=torch.float32)
    out = export_sharded(ref, tmp_path / "ours", {"moeadapt": ref.spec.model_dump(mode="json")},
                         max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").is_file()
    m = materialize(build_model(ref.spec, "meta"), "cpu", seed=1)
    info = load_sharded(m, open_source(out))
    assert all(torch.equal(v, m.state_dict()[k]) for k, v in ref.state_dict().items())
    assert info["bytes_read"] == info["local_bytes"]


def test_wrong_model_or_checkpoint_fails_before_reading(qwen_dir, tmp_path):
    from moeadapt.config import ModelSpec

    spec = open_source(qwen_dir).fam.spec
    other = ModelSpec(**{**spec.model_dump(), "moe_intermediate_size": spec.moe_intermediate_size * 2})
    m = build_model(other, "meta").to_empty(device="cpu")
    src = open_source(qwen_dir)
    with pytest.raises(OnboardError, match=r"mismatch: layers\.0\.ffn\.experts\.w1\.weight has shape \(4, 32, 32\) in the m"):
        load_sharded(m, src)
    assert src.bytes_read == 0
    fewer = ModelSpec(**{**spec.model_dump(), "n_layers": 1, "layer_types": spec.layer_types[:1]})
    with pytest.raises(OnboardError, match="lacks.*layers.1"):
        load_sharded(build_model(fewer, "meta").to_empty(device="cpu"), open_source(qwen_dir))
    # a checkpoint tensor with the wrong shape: the existing header check names it
    shutil.copytree(qwen_dir, tmp_path / "bad")
    with safe_open(str(qwen_dir / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    t["model.layers.0.self_attn.o_proj.weight"] = t["model.layers.0.self_attn.o_proj.weight"][:, :-1].contiguous()
    save_file(t, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(OnboardError, match="o_proj.weight has shape"):
        load_sharded(build_model(spec, "meta").to_empty(device="cpu"), open_source(tmp_path / "bad"))
    with pytest.raises(OnboardError, match="neither a model directory"):
        open_source(tmp_path)


def test_source_as_a_build_path_fill(qwen_dir):
    """`as_fill`: checkpoint tensors from the checkpoint, adapters and counters from the fallback fill."""
    from moeadapt.config import LoRASpec
    from moeadapt.lora import inject_lora

    ref, _ = onboard_model(qwen_dir, dtype=torch.float32)
    m = build_model(ref.spec, "meta")
    inject_lora(m, LoRASpec(rank=2, targets=["attn.q_proj"]))
    m.to_empty(device="cpu")
    src = open_source(qwen_dir)
    src.check({k: tuple(v.shape) for k, v in ref.state_dict().items() if not k.endswith("tokens_per_expert")})
    asked = []

    def fallback(name, shape, sl):
        asked.append(name)
        return torch.full([s.stop - s.start for s in sl], 0.5)

    fill = src.as_fill(fallback)
    with torch.no_grad():
        for name, t in list(m.named_parameters()) + list(m.named_buffers()):
            t.copy_(fill(name, tuple(t.shape), tuple(slice(0, n) for n in t.shape)))
    want = ref.state_dict()
    assert all(torch.equal(m.state_dict()[k], v) for k, v in want.items() if not k.endswith("tokens_per_expert"))
    assert asked and all(".lora_" in n or n.endswith("tokens_per_expert") for n in asked), asked
    with pytest.raises(OnboardError, match="no fallback fill"):
        src.as_fill()("layers.0.attn.q_proj.lora_A.weight", (2, 32), (slice(0, 2), slice(0, 32)))


def test_fill_in_small_row_blocks_is_exact(dsv3_dir, monkeypatch):
    """The load copies each shard in dim-0 blocks (RoPE-permuted rows and stacked experts split across blocks)."""
    from moeadapt.onboard import sources

    monkeypatch.setattr(sources, "BLOCK_BYTES", 200)  # a few rows (or one expert) per block
    ref, _ = onboard_model(dsv3_dir, dtype=torch.float32)
    m = build_model(ref.spec, "meta").to_empty(device="cpu")
    src = open_source(dsv3_dir)
    load_sharded(m, src)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in ref.state_dict().items())
    assert len(src.loader.reads) > 2 * len(src.loader.index)  # many blocks were read
