"""Config mapping: every family, unknown types and fields, resolve_model on a Hugging Face directory."""

import json

import pytest
import transformers

from moeadapt.config import ConfigError
from moeadapt.models import build_model, count_parameters
from moeadapt.onboard import OnboardError, read_family, resolve_model


def test_unknown_model_type_lists_families():
    with pytest.raises(OnboardError, match=r"model_type='llama'.*qwen3_moe"):
        read_family({"model_type": "llama"})


def test_unknown_family_lists_its_unsupported_features():
    cfg = transformers.AutoConfig.for_model("glm5_next").to_dict() | {"model_type": "glm5_next_like"}
    with pytest.raises(OnboardError) as e:
        read_family(cfg)
    msg = str(e.value)
    assert "model_type='glm5_next_like' is not a known family" in msg
    assert "vision_config (a vision tower" in msg, msg
    for feat in ("hc_mult", "index_kpool", "swiglu_limit"):  # ModelSpec options now (glm5_next maps them)
        assert feat not in msg, (feat, msg)
    with pytest.raises(OnboardError, match="partial_rotary_factor=0.25 .*Gated DeltaNet|Gated DeltaNet.*partial"):
        read_family(transformers.AutoConfig.for_model("minimax_m2").to_dict() | {
            "model_type": "qwen3_next_like", "linear_num_value_heads": 32,
            "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.25}})


def test_unmapped_fields_are_named():
    cfg = transformers.Qwen3MoeConfig().to_dict()
    cfg["frobnicate_heads"] = 3
    cfg["use_sliding_window"] = True
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 4.0}
    with pytest.raises(OnboardError) as e:
        read_family(cfg)
    msg = str(e.value)
    assert "frobnicate_heads (not understood)" in msg and "use_sliding_window=True" in msg
    assert "rope scaling type 'dynamic' (implemented: default, yarn)" in msg
    fam = read_family(cfg, allow_unmapped=True)
    assert any("frobnicate_heads" in n for n in fam.notes)


def test_real_sized_families_map():
    ds = read_family(transformers.DeepseekV3Config().to_dict()).spec
    assert (ds.n_layers, ds.n_routed_experts, ds.first_k_dense, ds.n_group) == (61, 256, 3, 8)
    assert ds.index_topk >= ds.max_position_embeddings  # MLA without indexer = dense DSA
    total = count_parameters(build_model(ds, "meta"), ds)["total"]
    assert abs(total - 671e9) / 671e9 < 0.01, total  # DeepSeek-V3 main model (MTP layer excluded)
    v32 = read_family(transformers.DeepseekV32Config().to_dict()).spec
    assert (v32.index_n_heads, v32.index_topk) == (64, 2048)
    q = read_family(transformers.Qwen3MoeConfig().to_dict()).spec
    assert set(q.resolved_layer_types()) == {"gqa"} and q.score_func == "softmax" and q.n_shared_experts == 0
    klc = transformers.KimiLinearConfig().to_dict()
    kl = read_family(klc)
    assert kl.spec.resolved_layer_types().count("dsa") == klc["layer_types"].count("full_attention")
    assert not kl.spec.mla_rope and kl.spec.mla_norm_eps == 1e-6  # NoPE MLA, transformers' fixed latent-norm eps
    assert ds.mla_norm_eps == 1e-6 and ds.index_norm_eps == 1e-5 and v32.index_norm_eps == 1e-6
    k2 = transformers.DeepseekV3Config().to_dict() | {"model_type": "kimi_k2", "n_routed_experts": 384}
    assert read_family(k2).spec.n_routed_experts == 384


def test_moonshot_kimi_linear_layout():
    cfg = transformers.KimiLinearConfig(num_hidden_layers=4).to_dict()
    for k in ("layer_types", "linear_num_heads", "linear_head_dim", "linear_conv_kernel_dim"):
        cfg.pop(k)
    cfg["linear_attn_config"] = {"full_attn_layers": [4], "kda_layers": [1, 2, 3], "num_heads": 8, "head_dim": 64,
                                 "short_conv_kernel_size": 4}
    s = read_family(cfg).spec
    assert s.resolved_layer_types() == ["kda", "kda", "kda", "dsa"] and s.kda_n_heads == 8


def test_resolve_model_accepts_hf_dir(qwen_dir, tmp_path):
    spec = resolve_model(str(qwen_dir))
    assert spec.n_routed_experts == 4 and spec.resolved_layer_types() == ["gqa", "gqa"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "mamba"}))
    with pytest.raises(ConfigError, match="moeadapt onboard"):
        resolve_model(str(bad))


def test_index_shared_layers_are_checked():
    from moeadapt.config import ModelSpec

    base = dict(vocab_size=64, hidden_size=32, n_layers=4, layer_types=["kda", "dsa", "kda", "dsa"])
    assert ModelSpec(**base, index_shared_layers=[3]).index_shared_layers == [3]
    with pytest.raises(ValueError, match=r"index_shared_layers \[2\] are not DSA layers"):
        ModelSpec(**base, index_shared_layers=[2])
    with pytest.raises(ValueError, match="layer 1, the first DSA layer"):
        ModelSpec(**base, index_shared_layers=[1])


def test_qwen3_next_older_config_layout():
    """config.json files written before layer_types existed: full_attention_interval, partial RoPE by default."""
    cfg = transformers.Qwen3NextConfig(num_hidden_layers=8).to_dict()
    cfg.pop("layer_types")
    cfg["full_attention_interval"] = 4
    cfg["rope_parameters"].pop("partial_rotary_factor")
    s = read_family(cfg).spec
    assert s.resolved_layer_types() == (["gdn"] * 3 + ["gqa"]) * 2 and s.gqa_rope_dim == s.gqa_head_dim // 4
