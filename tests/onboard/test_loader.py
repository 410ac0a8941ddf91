"""Name maps both ways, missing / leftover / shape errors, streaming EP-sliced loading, FP8 dequantisation."""

import json
import shutil

import pytest
import torch
from onboard_helpers import read_cfg, save_tiny
from safetensors import safe_open
from safetensors.torch import save_file

from moeadapt.config import ModelSpec
from moeadapt.models import build_model
from moeadapt.models.model import materialize
from moeadapt.onboard import (
    OnboardError,
    StreamingLoader,
    build_rules,
    dequant_fp8,
    onboard,
    onboard_model,
    peft_name_map,
    read_family,
    read_family_dir,
)


def _rewrite(src, dst, edit):
    """Copy a single-file checkpoint, editing its tensor dict."""
    shutil.copytree(src, dst)
    with safe_open(str(src / "model.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    edit(t)
    save_file(t, str(dst / "model.safetensors"))
    return dst


def test_every_tensor_maps(qwen_dir, dsv3_dir):
    for d in (qwen_dir, dsv3_dir):
        res = onboard(d)
        assert res["check"]["mapped"] == res["check"]["tensors"]
    absent = onboard(dsv3_dir)["check"]["absent_by_design"]
    assert absent and all("indexer" in v for v in absent.values())  # dense MLA: indexer only, nothing else
    q = onboard(qwen_dir)["check"]["absent_by_design"]
    assert set(q) == {"layers.0.ffn.router.expert_bias", "layers.1.ffn.router.expert_bias"}


def test_missing_leftover_and_shape_errors(qwen_dir, tmp_path):
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    d = _rewrite(qwen_dir, tmp_path / "missing", lambda t: t.pop(gone))
    with pytest.raises(OnboardError, match=gone.replace(".", r"\.")):
        onboard(d)
    d = _rewrite(qwen_dir, tmp_path / "extra", lambda t: t.update({"model.layers.0.self_attn.rogue.weight": torch.ones(2)}))
    with pytest.raises(OnboardError, match="rogue"):
        onboard(d)
    d = _rewrite(qwen_dir, tmp_path / "shape",
                 lambda t: t.update({"model.layers.0.self_attn.q_proj.weight": torch.ones(3, 32)}))
    with pytest.raises(OnboardError, match=r"q_proj.weight has shape \(3, 32\) but .* needs \(32, 32\)"):
        onboard(d)


def test_experts_stack_w1_gate_w3_up_w2_down(qwen_dir):
    m, _ = onboard_model(qwen_dir, dtype=torch.float32)
    with safe_open(str(qwen_dir / "model.safetensors"), "pt") as f:
        for ours, hf in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
            w = getattr(m.layers[1].ffn.experts, ours).weight
            assert torch.equal(w[2], f.get_tensor(f"model.layers.1.mlp.experts.2.{hf}.weight"))
    names = peft_name_map(qwen_dir)
    assert names["layers.1.ffn.experts.w1"] == "model.layers.1.mlp.experts.gate_proj"
    assert names["layers.0.attn.q_proj"] == "model.layers.0.self_attn.q_proj"


def _sharded_kimi_linear(tmp_path, E=8):
    """A hand-written kimi_linear checkpoint (Moonshot names) in 3 shards, from a random model of ours."""
    import transformers

    cfg = transformers.KimiLinearConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
        num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
        v_head_dim=8, num_experts=E, num_experts_per_token=2, linear_num_heads=2, linear_head_dim=8,
        layer_types=["linear_attention"] * 3 + ["full_attention"], mlp_layer_types=["dense"] + ["sparse"] * 3,
        model_max_length=128).to_dict()
    fam = read_family(cfg)
    ours = materialize(build_model(fam.spec, "meta"), "cpu", seed=1)
    state = ours.state_dict()
    hf = {}
    for r in build_rules(fam):
        if r.absent_ok:
            continue
        if r.stacked:
            for e, s in enumerate(r.sources):
                hf[s] = state[r.ours][e].clone()
        else:
            shp = (1, 1, -1, 1) if r.ours.endswith("A_log") else state[r.ours].shape
            hf[r.sources[0]] = state[r.ours].reshape(shp).clone()
    d = tmp_path / "kimi"
    d.mkdir()
    names = sorted(hf)
    wmap = {}
    for i in range(3):
        part = {n: hf[n] for n in names[i::3]}
        save_file(part, str(d / f"model-{i:05d}.safetensors"))
        wmap.update({n: f"model-{i:05d}.safetensors" for n in part})
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wmap}))
    (d / "config.json").write_text(json.dumps(cfg))
    return d, ours


def test_streaming_ep_slice_reads_only_owned_experts(tmp_path):
    d, ours = _sharded_kimi_linear(tmp_path)
    fam = read_family_dir(d)
    assert fam.model_type == "kimi_linear"
    loader = StreamingLoader(d, fam, build_rules(fam), ep_rank=1, ep=4, dtype=torch.float32)
    loader.check()
    got = dict(iter(loader))
    expert_reads = [n for n in loader.reads if ".experts." in n]
    assert expert_reads and all(n.split(".experts.")[1].split(".")[0] in ("2", "3") for n in expert_reads)
    ref = ours.state_dict()
    assert got["layers.2.ffn.experts.w2.weight"].shape[0] == 2
    assert torch.equal(got["layers.2.ffn.experts.w2.weight"], ref["layers.2.ffn.experts.w2.weight"][2:4])
    assert torch.equal(got["layers.0.attn.A_log"], ref["layers.0.attn.A_log"])  # [1,1,H,1] -> [H]
    m, _ = onboard_model(d, dtype=torch.float32)  # ep = 1: every tensor round-trips exactly
    for k, v in m.state_dict().items():
        if "idx" not in k and "tokens_per_expert" not in k:
            assert torch.equal(v, ref[k]), k


def test_our_own_format_slices_stacked_experts(tmp_path):
    from moeadapt.io import save_model_dir

    spec = ModelSpec(vocab_size=64, hidden_size=32, n_layers=2, kda_n_heads=2, kda_head_dim=8, n_heads=2,
                     q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                     index_n_heads=2, index_head_dim=8, n_routed_experts=4, moe_intermediate_size=16, latent_dim=16)
    m = materialize(build_model(spec, "meta"), "cpu", seed=0)
    save_model_dir(m, spec.model_dump(), tmp_path / "ours")
    fam = read_family_dir(tmp_path / "ours")
    got = dict(StreamingLoader(tmp_path / "ours", fam, build_rules(fam), ep_rank=1, ep=2, dtype=torch.float32))
    assert torch.equal(got["layers.1.ffn.experts.w1.weight"], m.layers[1].ffn.experts.w1.weight[2:4])


def test_fp8_block_dequant_by_hand():
    torch.manual_seed(0)
    w = torch.randn(200, 300)
    bm = bn = 128
    nb = (-(-200 // bm), -(-300 // bn))
    pad = torch.zeros(nb[0] * bm, nb[1] * bn)
    pad[:200, :300] = w.abs()
    scale = pad.view(nb[0], bm, nb[1], bn).amax(dim=(1, 3)) / 448.0  # DeepSeek: block max maps to e4m3 max
    big = scale.repeat_interleave(bm, 0)[:200].repeat_interleave(bn, 1)[:, :300]
    q = (w / big).to(torch.float8_e4m3fn)
    deq = dequant_fp8(q, scale, (bm, bn), torch.float32)
    assert torch.equal(deq, q.float() * big)
    assert ((deq - w).abs() <= 0.0625 * w.abs() + 1e-5 * w.abs().max()).all()  # e4m3: 3 mantissa bits


def test_fp8_checkpoint_loads_as_bf16(dsv3_dir, tmp_path):
    name = "model.layers.1.mlp.experts.0.gate_proj.weight"

    def quantise(t):
        w = t[name].float()
        s = w.abs().amax().reshape(1, 1) / 448.0
        t[name] = (w / s).to(torch.float8_e4m3fn)
        t[name + "_scale_inv"] = s

    d = _rewrite(dsv3_dir, tmp_path / "fp8", quantise)
    cfg = read_cfg(d)
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128],
                                  "activation_scheme": "dynamic"}
    (d / "config.json").write_text(json.dumps(cfg))
    m, summary = onboard_model(d, dtype=torch.bfloat16)
    assert name + "_scale_inv" in summary["ignored"]
    with safe_open(str(dsv3_dir / "model.safetensors"), "pt") as f:
        ref = f.get_tensor(name)
    got = m.layers[1].ffn.experts.w1.weight[0]
    assert got.dtype == torch.bfloat16 and (got.float() - ref).abs().max() < 0.1 * ref.abs().max()


def test_mtp_layers_are_skipped_with_a_reason(tmp_path):
    d = save_tiny("deepseek_v3", tmp_path / "mtp")
    cfg = read_cfg(d)
    cfg["num_nextn_predict_layers"] = 1
    (d / "config.json").write_text(json.dumps(cfg))
    shutil.move(d / "model.safetensors", tmp_path / "orig.safetensors")
    with safe_open(str(tmp_path / "orig.safetensors"), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    t["model.layers.2.eh_proj.weight"] = torch.zeros(32, 64)
    save_file(t, str(d / "model.safetensors"))
    ign = onboard(d)["check"]["ignored"]
    assert "multi-token" in ign["model.layers.2.eh_proj.weight"]


def test_load_weights_into_a_built_model(qwen_dir):
    from moeadapt.onboard import load_weights, resolve_model

    m = materialize(build_model(resolve_model(str(qwen_dir)), "meta"), "cpu", dtype=torch.float32)
    load_weights(qwen_dir, m)
    with safe_open(str(qwen_dir / "model.safetensors"), "pt") as f:
        assert torch.equal(m.embed.weight, f.get_tensor("model.embed_tokens.weight"))


def test_rope_row_permutation_round_trips():
    import transformers

    fam = read_family(transformers.DeepseekV3Config(num_hidden_layers=2, first_k_dense_replace=1).to_dict())
    r = next(r for r in build_rules(fam) if r.ours == "layers.0.attn.wq_b.weight")
    t = torch.randn(r.shape)
    assert r.row_perm is not None and torch.equal(r.from_ours(r.to_ours(t), r.shape), t)
    # within one head: nope rows untouched, rope rows (x0,x1,x2,x3..) -> (x0,x2,..,x1,x3,..)
    nope = fam.spec.qk_nope_head_dim
    assert r.row_perm[:nope].tolist() == list(range(nope))
    assert r.row_perm[nope:nope + 3].tolist() == [nope, nope + 2, nope + 4]


def test_finetune_from_hf_directory(tmp_path):
    """`init_from` a Hugging Face checkpoint: the trainer streams + maps it and a LoRA fine-tune runs."""
    from onboard_helpers import save_tiny

    from moeadapt import api
    from moeadapt.config import build_run_config
    from moeadapt.onboard import model_spec_from_dir

    qwen_dir = save_tiny("qwen3_moe", tmp_path / "qwen", vocab_size=264)  # the byte tokenizer's vocabulary

    cfg = build_run_config({
        "model": str(qwen_dir), "lora": {"rank": 4, "targets": ["attn.q_proj", "experts.w1"]},
        "train": {"steps": 2, "micro_batch_size": 2, "seq_len": 16, "eval_batches": 1,
                  "init_from": str(qwen_dir), "output_dir": str(tmp_path / "ft")},
        "data": {"train": "builtin:recall_qa", "eval_fraction": 0.01}}, from_dir=model_spec_from_dir)
    r = api.train(cfg, quiet=True)
    assert (r.output_dir / "adapter" / "adapter_model.safetensors").is_file()
    import math
    assert math.isfinite(r.eval_after)
