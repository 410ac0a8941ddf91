"""`onboard --validate` on the checkpoint's own weights: tiny random checkpoints written by transformers (shapes and
weights from a fresh, printed seed) pass at 1e-4 in float32; a broken model of ours (one tensor perturbed, one
epsilon changed, the RoPE row map removed) FAILS naming the first diverging layer; `--layers N` validates the
first N blocks built from the same files."""

import pytest
import torch
import yaml
from onboard_helpers import fresh_seed, fused_copy, perturb, random_checkpoint

from moeadapt.cli import main
from moeadapt.onboard import names as names_mod
from moeadapt.onboard import onboard, read_family_dir
from moeadapt.onboard.validate import TOL, validate_checkpoint

FAMILIES = ["qwen3_moe", "deepseek_v3", "deepseek_v32", "kimi_linear", "glm_moe_dsa", "qwen3_next", "minimax_m2",
            "glm5_next", "qwen3_5_moe"]
LINEAR = ("kimi_linear", "qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")  # recurrent layers: short documents


@pytest.mark.parametrize("model_type", FAMILIES)
def test_checkpoint_validates_against_transformers(model_type, tmp_path):
    seed = fresh_seed()
    print(f"{model_type}: checkpoint seed {seed} (MOEADAPT_TEST_SEED={seed} replays it)")
    d = random_checkpoint(model_type, tmp_path / "ckpt", seed)
    v = onboard(d, validate=True, seq_len=24 if model_type in LINEAR else None, seed=seed)["validation"]
    print({k: v[k] for k in ("max_abs_diff", "max_abs_logit", "lengths", "per_layer")})
    assert v["passed"], v["where"]
    assert v["logit_rel_diff"] <= TOL and v["max_abs_logit"] > 0.1 and len(set(v["lengths"])) == 3
    fam = read_family_dir(d)
    if model_type in ("deepseek_v32", "glm_moe_dsa", "glm5_next"):  # the indexer really selects: every document but the shortest exceeds top-k
        assert sorted(v["lengths"])[1] > fam.spec.index_topk


def _perturb(layer: int, name: str):
    return perturb(f"layers.{layer}.{name}")


def _eps(layer: int, module: str, eps: float):
    def tamper(m):
        m.get_submodule(f"layers.{layer}.{module}").eps = eps
    return tamper


@pytest.mark.parametrize("model_type, tamper, layer", [
    ("deepseek_v3", _perturb(1, "attn.wkv_b.weight"), 1),
    ("deepseek_v3", _eps(1, "attn.kv_norm", 1e-1), 1),
    ("qwen3_moe", _eps(0, "ffn_norm", 1e-1), 0),
    ("glm5_next", _perturb(1, "ffn_hc.fn"), 1),  # a hyper-connection's mixing weights
    ("glm5_next", _eps(0, "attn.o_norm", 1e-1), 0),  # the KDA output norm
    # every other family: one tensor perturbed, one epsilon changed
    *[(f, _perturb(0, "attn_norm.weight"), 0) for f in ("deepseek_v32", "glm_moe_dsa", "kimi_linear", "qwen3_next",
                                                       "minimax_m2")],
    *[(f, _eps(0, "ffn_norm", 1e-1), 0) for f in ("deepseek_v32", "glm_moe_dsa", "kimi_linear", "qwen3_next",
                                                 "minimax_m2")],
])
def test_broken_model_fails_naming_the_layer(model_type, tamper, layer, tmp_path):
    seed = fresh_seed()
    print(f"seed {seed}")
    d = random_checkpoint(model_type, tmp_path / "ckpt", seed)
    v = validate_checkpoint(d, read_family_dir(d), tamper=tamper)
    assert not v["passed"] and v["first_bad_layer"] == layer, v
    assert v["where"].startswith(f"layer {layer} ")
    assert all(dh / max(1, h) <= TOL for dh, h in v["per_layer"][:layer])  # the layers before it still agree


@pytest.mark.parametrize("name", ["norm.weight", "lm_head.weight"])
def test_broken_head_fails_after_agreeing_blocks(name, tmp_path):
    """The logits are gated relative to max(1, max |logit|): a perturbed final norm or lm_head still FAILS, with
    every block agreeing and the message pointing past them."""
    seed = fresh_seed()
    print(f"seed {seed}")
    d = random_checkpoint("qwen3_moe", tmp_path / "ckpt", seed)
    v = validate_checkpoint(d, read_family_dir(d), tamper=perturb(name, 0.01))
    assert not v["passed"] and v["first_bad_layer"] is None, v
    assert v["logit_rel_diff"] > TOL and v["where"] == "the blocks agree; the final norm or lm_head diverges"


def test_rope_row_map_is_what_makes_deepseek_match(monkeypatch, tmp_path, capsys):
    d = random_checkpoint("deepseek_v3", tmp_path / "ckpt", fresh_seed())
    monkeypatch.setattr(names_mod, "_rope_rows", lambda heads, head, nope, rope: torch.arange(heads * head))
    v = validate_checkpoint(d, read_family_dir(d))
    assert not v["passed"] and v["first_bad_layer"] == 0
    assert main(["onboard", str(d), "--validate"]) == 2  # the CLI: FAIL, one message naming the layer, exit 2
    out = capsys.readouterr()
    assert "FAIL" in out.out and "validation failed" in out.err and "layer 0 (dsa) is the first to diverge" in out.err


def test_first_layers_only_and_cli(tmp_path, capsys):
    seed = fresh_seed()
    print(f"seed {seed}")
    d = random_checkpoint("deepseek_v3", tmp_path / "ckpt", seed)
    fam = read_family_dir(d)
    v = validate_checkpoint(d, fam, layers=1)
    assert v["passed"] and v["layers"] == 1 and len(v["per_layer"]) == 1 and v["of_layers"] == fam.spec.n_layers
    out = tmp_path / "run.yaml"
    assert main(["onboard", str(d), "--validate", "--layers", "1", "--write-config", str(out)]) == 0
    text = capsys.readouterr().out
    assert "operator mapping" in text and "PASS" in text and f"1 of {fam.spec.n_layers} layers" in text
    assert yaml.safe_load(out.read_text())["train"]["init_from"]
    assert main(["onboard", str(d), "--validate", "--layers", "99"]) == 2  # one message, exit 2
    assert "--layers 99 is outside" in capsys.readouterr().err
    assert main(["onboard", str(tmp_path)]) == 2  # no config.json


def test_indexer_ties_are_aligned_but_a_wrong_indexer_fails(tmp_path):
    """4 indexer heads: many keys score exactly 0 and torch.topk breaks those ties its own way; the validation
    accepts a different choice among equal scores only, so a perturbed indexer key projection still FAILS."""
    seed = fresh_seed()
    print(f"seed {seed}")
    d = random_checkpoint("deepseek_v32", tmp_path / "ckpt", seed, index_n_heads=4)
    fam = read_family_dir(d)
    v = validate_checkpoint(d, fam)
    assert v["passed"], v["where"]
    assert v["tie_aligned"][1] > 0
    v = validate_checkpoint(d, fam, tamper=_perturb(0, "attn.wk_idx.weight"))
    assert not v["passed"] and v["first_bad_layer"] == 0, v["where"]


def test_glm5_shared_indexer_layers_and_interleaved_indexer_rope(tmp_path):
    """GLM-5 (glm_moe_dsa): 'shared' layers reuse the previous indexer's top-k (no indexer of their own), and
    the indexer's RoPE rows are interleaved: mapping them as half-split makes the validation fail."""
    import dataclasses

    seed = fresh_seed()
    print(f"seed {seed}")
    d = random_checkpoint("glm_moe_dsa", tmp_path / "ckpt", seed)
    fam = read_family_dir(d)
    shared = fam.spec.index_shared_layers
    assert shared and shared[-1] == fam.spec.n_layers - 1
    v = validate_checkpoint(d, dataclasses.replace(fam, index_rope_interleave=False))
    assert not v["passed"] and v["first_bad_layer"] == 0, v["where"]
    v = validate_checkpoint(d, fam, layers=2)  # the truncated models keep the shared layers below N
    assert v["passed"] and v["layers"] == 2, v["where"]


def test_qwen3_next_features_each_matter(tmp_path):
    """Qwen3-Next: the 1 + weight RMSNorms, the sigmoid-gated shared expert and partial RoPE are each needed."""
    import dataclasses

    seed = fresh_seed()
    print(f"seed {seed}")
    d = random_checkpoint("qwen3_next", tmp_path / "ckpt", seed)
    fam = read_family_dir(d)
    s = fam.spec
    assert "gdn" in s.resolved_layer_types() and s.gqa_output_gate and s.shared_expert_gate and s.gqa_rope_dim
    v = validate_checkpoint(d, dataclasses.replace(fam, norm_offset=0.0), seq_len=16)
    assert not v["passed"] and v["first_bad_layer"] == 0
    gqa = s.resolved_layer_types().index("gqa")
    no_partial = dataclasses.replace(fam, spec=s.model_copy(update={"gqa_rope_dim": None}))
    v = validate_checkpoint(d, no_partial, seq_len=16)
    assert not v["passed"] and v["first_bad_layer"] == gqa, v["where"]


def test_qwen3_5_moe_text_layout_and_broken_copies(tmp_path):
    """Qwen3.5-MoE: the text-only checkpoint (model_type qwen3_5_moe_text, weights under model.) validates too; the
    multimodal one skips its vision tower by name; a perturbed split DeltaNet projection and a changed q-norm
    epsilon each FAIL at their layer."""
    seed = fresh_seed()
    print(f"seed {seed}")
    d = random_checkpoint("qwen3_5_moe_text", tmp_path / "text", seed)
    v = validate_checkpoint(d, read_family_dir(d), seq_len=16, seed=seed)
    assert v["passed"] and v["logit_rel_diff"] <= TOL, v["where"]
    d = random_checkpoint("qwen3_5_moe", tmp_path / "mm", seed)
    out = onboard(d)
    assert out["check"]["ignored"] and all(k.startswith("model.visual.") for k in out["check"]["ignored"])
    assert any("vision tower" in n for n in out["notes"])
    fam = read_family_dir(d)
    assert fam.spec.gdn_proj_layout == "split" and fam.spec.resolved_layer_types()[0] == "gdn"
    v = validate_checkpoint(d, fam, seq_len=16, tamper=_perturb(0, "attn.in_proj_qkv.weight"))
    assert not v["passed"] and v["first_bad_layer"] == 0, v["where"]
    gqa = fam.spec.resolved_layer_types().index("gqa")
    v = validate_checkpoint(d, fam, seq_len=16, tamper=_eps(gqa, "attn.q_norm", 1e-1))
    assert not v["passed"] and v["first_bad_layer"] == gqa, v["where"]
    assert v["where"].startswith(f"layer {gqa} (gqa)")


def test_fused_expert_checkpoint_validates_and_reads_by_box(tmp_path, monkeypatch):
    """A checkpoint holding the experts fused (experts.gate_up_proj / experts.down_proj, as Qwen3.5 is released)
    maps, validates, and a box of our up projection read from it equals that part of the fused tensor; with up
    read from gate's half it FAILS at the first layer."""
    from safetensors import safe_open

    from moeadapt.onboard import StreamingLoader, build_rules, checkpoint_index, peft_maps

    seed = fresh_seed()
    print(f"seed {seed}")
    per_expert = random_checkpoint("qwen3_5_moe", tmp_path / "ckpt", seed)
    d = fused_copy(per_expert, tmp_path / "fused")
    assert peft_maps(d)["name_map"] == peft_maps(per_expert)["name_map"]  # adapters keep the per-expert names
    fam = read_family_dir(d)
    v = validate_checkpoint(d, fam, seq_len=12, seed=seed)
    assert v["passed"] and v["logit_rel_diff"] <= TOL, v["where"]
    rules = build_rules(fam, checkpoint_index(d))
    up = next(r for r in rules if r.ours == "layers.0.ffn.experts.w3.weight")
    assert up.sources == ["model.language_model.layers.0.mlp.experts.gate_up_proj"] and up.part == (1, 1, 2)
    loader = StreamingLoader(d, fam, rules, dtype=torch.float32)
    loader.check()
    E, inter, _ = up.shape
    box = loader.read_slice(up.ours, (slice(1, E), slice(2, inter), slice(None)))
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        want = f.get_tensor(up.sources[0])[1:, inter + 2:]
    assert torch.equal(box, want)
    fused = names_mod._fused_experts

    def gate_half_for_up(r, have):
        fused(r, have)
        if r.part is not None:
            r.part = (r.part[0], 0, r.part[2])
    monkeypatch.setattr(names_mod, "_fused_experts", gate_half_for_up)
    v = validate_checkpoint(d, fam, layers=1, seq_len=12, seed=seed)
    assert not v["passed"] and v["first_bad_layer"] == 0, v["where"]
