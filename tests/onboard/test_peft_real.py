"""Adapters the real `peft` loads: finetune a few steps from a Hugging Face checkpoint -> export-adapter ->
`peft.PeftModel.from_pretrained` on the transformers model reproduces our logits with the adapter (pinned peft
0.21.2, which converts per-expert adapters onto transformers' fused experts), with no missing or unexpected keys;
adapter_config.json holds only fields peft knows; a dense-FFN adapter peft cannot place is a warning."""

import json
import warnings

import pytest
import torch
from onboard_helpers import (
    decisive_ids,
    fresh_seed,
    fused_copy,
    hf_model,
    present_targets,
    random_adapters,
    random_checkpoint,
)

peft = pytest.importorskip("peft")

from moeadapt import api  # noqa: E402
from moeadapt.config import build_run_config  # noqa: E402
from moeadapt.lora import load_peft  # noqa: E402
from moeadapt.onboard import model_spec_from_dir, onboard_model  # noqa: E402

TARGETS = {"qwen3_moe": ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "experts.w1", "experts.w2",
                         "experts.w3"],
           "deepseek_v3": ["attn.wq", "attn.wq_b", "attn.wkv_a", "attn.wkv_b", "attn.wo", "experts.w1", "experts.w2"],
           # KDA and NoPE MLA layers, routed experts in peft's target_parameters form, dense FFN and shared expert
           "kimi_linear": ["attn.q_proj", "attn.v_proj", "attn.o_proj", "attn.wq", "attn.wq_b", "attn.wkv_a",
                           "attn.wkv_b", "attn.wo", "experts.w1", "experts.w2", "experts.w3", "ffn.w1", "shared.w2"],
           "minimax_m2": ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj", "experts.w1", "experts.w2",
                          "experts.w3"],
           "qwen3_5_moe": ["attn.q_proj", "attn.o_proj", "attn.in_proj_qkv", "attn.in_proj_z", "attn.out_proj",
                           "experts.w1", "experts.w3", "experts.w2", "shared.w1", "shared.w2"],
           # peft converts its per-expert adapters and re-targets gate_proj / up_proj / down_proj: no shared expert
           "qwen3_next": ["attn.q_proj", "attn.o_proj", "attn.in_proj_qkvz", "attn.in_proj_ba", "attn.out_proj",
                          "experts.w1", "experts.w3", "experts.w2"]}
PEFT_FAMILIES = ["qwen3_moe", "deepseek_v3", "kimi_linear", "minimax_m2", "qwen3_5_moe"]
# the finetune-based check of the later families is slow (a hybrid model trained on CPU); the same export with
# random adapters runs for every family in test_random_adapter_loads_in_peft_with_our_logits
FINETUNE = ["qwen3_moe", "deepseek_v3", *(pytest.param(f, marks=pytest.mark.slow)
                                          for f in ("kimi_linear", "minimax_m2", "qwen3_5_moe"))]


def _finetune(ckpt, tmp_path, targets):
    cfg = build_run_config({
        "model": str(ckpt), "lora": {"rank": 4, "alpha": 8.0, "targets": present_targets(ckpt, targets)},
        "train": {"steps": 3, "lr": 0.05, "warmup_steps": 0, "micro_batch_size": 2, "seq_len": 16, "eval_batches": 1,
                  "init_from": str(ckpt), "output_dir": str(tmp_path / "ft"), "dtype": "fp32", "device": "cpu"},
        "data": {"train": "builtin:recall_qa", "eval_fraction": 0.01}}, from_dir=model_spec_from_dir)
    return api.train(cfg, quiet=True).output_dir


def _peft_logits(ckpt, adapter, ids):
    hf = hf_model(ckpt, dtype=torch.float32, attn_implementation="eager").eval()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pm = peft.PeftModel.from_pretrained(hf, str(adapter)).eval()
    msgs = [str(w.message) for w in caught if "adapter keys" in str(w.message) or "unexpected" in str(w.message)]
    with torch.no_grad():
        return pm(input_ids=ids).logits.float(), msgs


@pytest.mark.parametrize("model_type", FINETUNE)
def test_finetuned_adapter_loads_in_peft_with_our_logits(model_type, tmp_path):
    seed = fresh_seed()
    print(f"{model_type} seed {seed}")
    ckpt = random_checkpoint(model_type, tmp_path / "ckpt", seed, vocab_size=264)  # the byte tokenizer's vocab
    run = _finetune(ckpt, tmp_path, TARGETS[model_type])
    out = api.export_adapter(run, tmp_path / "peft")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert set(cfg) <= set(peft.LoraConfig().to_dict()) | {"peft_type"}, set(cfg) - set(peft.LoraConfig().to_dict())
    ours, _ = onboard_model(ckpt, dtype=torch.float32)
    ids = torch.randint(0, 264, (2, 20), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        base = ours(ids).logits.float()
        load_peft(ours, out)
        ref = ours.eval()(ids).logits.float()
    got, msgs = _peft_logits(ckpt, out, ids)
    diff = (got - ref).abs().max().item()
    effect = (ref - base).abs().max().item()
    print(f"peft vs ours + adapter: {diff:.2e}; adapter's effect on the logits {effect:.3f}; warnings {msgs}")
    assert not msgs, msgs  # no missing / unexpected adapter keys
    assert effect > 1e-3 and diff <= 1e-4


@pytest.mark.parametrize("model_type", [*PEFT_FAMILIES, "qwen3_next"])
def test_random_adapter_loads_in_peft_with_our_logits(model_type, tmp_path):
    """Random adapters on every target of the family (per-expert or target_parameters experts, dense FFN, shared
    expert where present) -> export -> peft reproduces our logits (which the adapters change by far more than the
    tolerance), with no missing / unexpected keys."""
    import warnings as w

    from moeadapt.config import LoRASpec
    from moeadapt.lora import export_peft
    from moeadapt.onboard import peft_maps

    seed = fresh_seed()
    print(f"{model_type} seed {seed}")
    ckpt = random_checkpoint(model_type, tmp_path / "ckpt", seed)
    ours, _ = onboard_model(ckpt, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    lora = LoRASpec(rank=2, alpha=4.0, targets=present_targets(ours, TARGETS[model_type]))
    random_adapters(ours, lora, g, 0.1)
    ids = decisive_ids(ours.eval(), (2, 16), 64, g)  # no near-tie for float32 rounding to flip an expert on
    with torch.no_grad():
        base = onboard_model(ckpt, dtype=torch.float32)[0].eval()(ids).logits.float()
    with w.catch_warnings(record=True) as caught:
        w.simplefilter("always")
        out = export_peft(ours, lora, tmp_path / "adapter", **peft_maps(ckpt))
    assert not [str(x.message) for x in caught if "cannot be represented" in str(x.message)]
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert set(cfg) <= set(peft.LoraConfig().to_dict()) | {"peft_type"}, set(cfg) - set(peft.LoraConfig().to_dict())
    with torch.no_grad():
        ref = ours.eval()(ids).logits.float()
    got, msgs = _peft_logits(ckpt, out, ids)
    diff, effect = (got - ref).abs().max().item(), (ref - base).abs().max().item()
    layout = json.loads((out / "moeadapt_adapter.json").read_text())["expert_layout"]
    scale = ref.abs().max().item()
    print(f"peft vs ours + adapter: {diff:.2e}; adapter's effect {effect:.3f}; expert layout {layout}; "
          f"max |logit| {scale:.2f}")
    assert not msgs, msgs
    # fp32 through two implementations: within 3e-5 of the logits' scale (1.8e-5 seen: qwen3_next seed 1077979699,
    # max |logit| 5.5, effect 7.7; an absolute 1e-4 failed there); a wrong adapter moves them by its effect, ~1-8
    assert effect > 1e-2 and diff <= 3e-5 * max(1.0, scale)
    assert layout == ("peft_fused" if model_type in ("kimi_linear", "qwen3_5_moe") else "per_expert")


def test_dense_ffn_adapter_is_a_warning_and_kept_for_us(tmp_path):
    from moeadapt.config import LoRASpec
    from moeadapt.lora import export_peft, lora_modules
    from moeadapt.onboard import peft_maps

    ckpt = random_checkpoint("deepseek_v3", tmp_path / "ckpt", fresh_seed(), first_k_dense_replace=1)
    ours, _ = onboard_model(ckpt, dtype=torch.float32)
    lora = LoRASpec(rank=2, targets=["attn.wo", "ffn.w1", "shared.w2", "experts.w3"])
    random_adapters(ours, lora)
    with pytest.warns(UserWarning, match=r"cannot be represented for peft .*mlp\.gate_proj"):
        out = export_peft(ours, lora, tmp_path / "a", **peft_maps(ckpt))
    side = json.loads((out / "moeadapt_adapter.json").read_text())
    assert any("shared_experts.down_proj" in m for m in side["not_in_peft"])
    assert side["zero_filled"]  # experts.w3 (up) alone: a zero gate partner for peft's fused gate_up_proj
    fresh, _ = onboard_model(ckpt, dtype=torch.float32)
    load_peft(fresh, out)  # the whole adapter comes back (the side file included, the zero partners left out)
    a, b = lora_modules(ours), lora_modules(fresh)
    assert set(a) == set(b) and all(torch.equal(x, y) for n in a for x, y in zip(a[n].parameters(), b[n].parameters()))
    _, msgs = _peft_logits(ckpt, out, torch.zeros(1, 4, dtype=torch.long))
    assert not msgs, msgs


def test_target_without_a_checkpoint_module_is_a_warning(tmp_path):
    """Kimi Linear's MLA has no indexer (our DSA layer serves it in dense mode): an adapter on it cannot be
    represented for peft; it is named in a warning, kept for moeadapt, and peft loads the rest with no unexpected
    keys and our logits (the indexer is unused). Targets peft would match too widely by leaf name (the KDA layers'
    o_proj, not MLA's; the dense FFN's gate_proj, not the shared expert's) are given by their full names in the
    transformers model (block_sparse_moe. -> mlp.)."""
    from moeadapt.config import LoRASpec
    from moeadapt.lora import export_peft, lora_modules
    from moeadapt.onboard import peft_maps

    seed = fresh_seed()
    print(f"seed {seed}")
    ckpt = random_checkpoint("kimi_linear", tmp_path / "ckpt", seed,
                             mlp_layer_types=lambda c: ["dense"] + ["sparse"] * (c.num_hidden_layers - 1))
    ours, _ = onboard_model(ckpt, dtype=torch.float32)
    with torch.no_grad():
        ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))
        base = ours(ids).logits.float()
    lora = LoRASpec(rank=2, targets=["attn.wq_idx", "attn.o_proj", "attn.f_a", "experts.w2", "ffn.w1"])
    # an adapter's scale (N(0, 1) factors blow the hidden states up ~100x and transformers' float32 KDA with them)
    random_adapters(ours, lora, torch.Generator().manual_seed(seed), 0.1)
    with pytest.warns(UserWarning, match=r"the checkpoint has no such module \(\['layers\.\d+\.attn\.wq_idx"):
        out = export_peft(ours, lora, tmp_path / "a", **peft_maps(ckpt))
    side = json.loads((out / "moeadapt_adapter.json").read_text())
    assert side["not_in_peft"] and all(m.endswith("attn.wq_idx") for m in side["not_in_peft"])
    targets = json.loads((out / "adapter_config.json").read_text())["target_modules"]
    assert "model.layers.0.mlp.gate_proj" in targets and "f_a_proj" in targets and "o_proj" not in targets
    fresh, _ = onboard_model(ckpt, dtype=torch.float32)
    load_peft(fresh, out)
    a, b = lora_modules(ours), lora_modules(fresh)
    assert set(a) == set(b) and all(torch.equal(x, y) for n in a for x, y in zip(a[n].parameters(), b[n].parameters()))
    got, msgs = _peft_logits(ckpt, out, ids)
    assert not msgs, msgs
    with torch.no_grad():
        ref = ours.eval()(ids).logits.float()
    assert (ref - base).abs().max() > 1e-2, "the adapter must change the logits for the comparison to mean anything"
    assert (got - ref).abs().max() <= 1e-4, (got - ref).abs().max()


@pytest.mark.parametrize("model_type", [*PEFT_FAMILIES[:-1], pytest.param("qwen3_5_moe", marks=pytest.mark.slow),
                                        "qwen3_5_moe:fused"])  # fused: the parts, the vision tower copied through
def test_merge_adapter_hf_format_loads_in_transformers(model_type, tmp_path):
    from safetensors import safe_open

    from moeadapt.cli import main
    from moeadapt.config import LoRASpec
    from moeadapt.lora import export_peft
    from moeadapt.onboard import peft_maps

    seed = fresh_seed()
    print(f"{model_type} seed {seed}")
    model_type, _, fused = model_type.partition(":")
    ckpt = random_checkpoint(model_type, tmp_path / "ckpt", seed)
    if fused:  # experts stored fused (experts.gate_up_proj / down_proj): written back fused from our two parts
        ckpt = fused_copy(ckpt, tmp_path / "fused")
    ours, _ = onboard_model(ckpt, dtype=torch.float32)
    targets = TARGETS[model_type] + ["ffn.w1", "shared.w3"]  # dense FFN / shared expert too: merged by us
    lora = LoRASpec(rank=2, alpha=4.0, targets=present_targets(ours, targets))
    g = torch.Generator().manual_seed(seed)
    random_adapters(ours, lora, g, 0.1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dense-FFN adapters peft cannot place (kept in the side file)
        adapter = export_peft(ours, lora, tmp_path / "adapter", **peft_maps(ckpt))
    out = tmp_path / "merged"
    assert main(["merge-adapter", "--model", str(ckpt), "--adapter", str(adapter), "--out", str(out),
                 "--format", "hf"]) == 0
    with safe_open(str(ckpt / "model.safetensors"), "pt") as a, safe_open(str(out / "model.safetensors"), "pt") as b:
        assert set(a.keys()) == set(b.keys())  # the checkpoint's own names, nothing more or less
        assert all(a.get_slice(k).get_shape() == b.get_slice(k).get_shape() for k in a.keys())
    assert json.loads((out / "config.json").read_text()) == json.loads((ckpt / "config.json").read_text())
    # a token whose k-th and (k+1)-th experts score within the merge's float32 rounding would route differently
    # in the two models: ids drawn clear of such ties
    ids = decisive_ids(ours.double().eval(), (2, 20), 64, g)
    # float64 on both sides (transformers' Gated DeltaNet still runs in float32 inside: ~1e-5 there, up to 1.1e-4 at
    # max |logit| 5.4 on qwen3_5_moe seed 196290659, hence a bound relative to the logits' scale); a wrong name,
    # row or part is far above it.
    # A vision tower comes through the merge unchanged: the multimodal model loads it
    hf = hf_model(out, attn_implementation="eager", experts_implementation="eager").double().eval()
    with torch.no_grad():
        ref = ours.double().eval()(ids).logits
        got = hf(input_ids=ids).logits
    diff = (got - ref).abs().max().item()
    print(f"transformers on the merged checkpoint vs ours + adapter: {diff:.2e} (max |logit| {ref.abs().max():.1f})")
    assert diff <= 1e-4 * max(1.0, ref.abs().max().item())


def test_decisive_ids_refuses_a_model_whose_routing_is_all_ties(tmp_path):
    """The ids helper the merge test relies on measures the routing margin it promises: with every expert's
    router row equal (all scores tied) no draw is clear, and it says so instead of returning ids."""
    from onboard_helpers import routing_margin

    from moeadapt.models.router import Router

    ckpt = random_checkpoint("qwen3_moe", tmp_path / "ckpt", fresh_seed())
    ours, _ = onboard_model(ckpt, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    assert routing_margin(ours.double(), decisive_ids(ours.double(), (2, 8), 64, g)) > 1e-4
    with torch.no_grad():
        for m in ours.modules():
            if isinstance(m, Router):
                m.weight.copy_(m.weight[:1].expand_as(m.weight))
                m.expert_bias.zero_()
    with pytest.raises(AssertionError, match="clear of a tie"):
        decisive_ids(ours.double(), (2, 8), 64, g)
