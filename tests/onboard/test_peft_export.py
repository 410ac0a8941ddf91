"""PEFT export of adapters trained on an onboarded DeepSeek checkpoint: checkpoint names and shapes, lora_B rows in
the checkpoint's (interleaved RoPE) order, so that W_ckpt + s * B @ A gives transformers the same logits as our
adapted model; and the adapter loads back into a fresh onboarded model."""

import json
import shutil

import pytest
import torch
import transformers
from onboard_helpers import present_targets, random_adapters, save_tiny

from moeadapt.config import LoRASpec
from moeadapt.io import load_tensors, save_tensors
from moeadapt.lora import export_peft, load_peft, lora_modules
from moeadapt.lora.peft import PREFIX
from moeadapt.onboard import onboard_model, peft_maps

IDS = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(1))
TARGETS = ["attn.wq", "attn.wq_b", "attn.wkv_a", "attn.wkv_b", "attn.wo", "experts.w1", "experts.w2", "experts.w3",
           "shared.w1", "ffn.w2"]


def _adapted(ckpt, seed=0):
    ours, _ = onboard_model(ckpt, dtype=torch.float32, device="cpu")
    ours.set_backend("reference")
    with torch.no_grad():
        base = ours(IDS).logits.float()
    lora = LoRASpec(rank=4, alpha=8.0, targets=present_targets(ours, TARGETS))
    g = torch.Generator().manual_seed(seed)
    random_adapters(ours, lora, g, 0.2)
    return ours.eval(), lora, base


def _merged_hf_logits(ckpt, adapter, tmp, ids):
    """Merge the exported adapter into the checkpoint's own tensors (names and row order as on disk) and run
    transformers on the result."""
    cfg = json.loads((adapter / "adapter_config.json").read_text())
    s = cfg["lora_alpha"] / cfg["r"]
    w = load_tensors(ckpt / "model.safetensors")
    ad = load_tensors(adapter / "adapter_model.safetensors")
    mods = {k[len(PREFIX):-len(".lora_A.weight")] for k in ad if k.endswith(".lora_A.weight")}
    for mod in mods:  # expert adapters are per expert (...mlp.experts.3.gate_proj), like the checkpoint's tensors
        A, B = ad[f"{PREFIX}{mod}.lora_A.weight"], ad[f"{PREFIX}{mod}.lora_B.weight"]
        W = w[mod + ".weight"]
        assert B.shape[0] == W.shape[0] and A.shape[1] == W.shape[1], (mod, A.shape, B.shape, W.shape)
        w[mod + ".weight"] = W + s * B @ A
    out = tmp / "merged"
    out.mkdir()
    shutil.copy(ckpt / "config.json", out / "config.json")
    save_tensors(w, out / "model.safetensors", metadata={"format": "pt"})
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").float().eval()
    with torch.no_grad():
        return hf(input_ids=ids).logits.float()


@pytest.mark.parametrize("q_lora_rank", [16, None])
def test_exported_deepseek_adapter_merges_into_the_checkpoint_exactly(tmp_path, q_lora_rank):
    ckpt = save_tiny("deepseek_v3", tmp_path / "ckpt", q_lora_rank=q_lora_rank)
    ours, lora, base = _adapted(ckpt)
    ids = IDS
    with torch.no_grad():
        ref = ours(ids).logits.float()
    maps = peft_maps(ckpt)
    q = "q_b_proj" if q_lora_rank else "q_proj"
    assert set(maps["row_perms"]) == {f"layers.{i}.attn.{'wq_b' if q_lora_rank else 'wq'}" for i in range(2)} | {
        f"layers.{i}.attn.wkv_a" for i in range(2)}
    adapter = export_peft(ours, lora, tmp_path / "adapter", name_map=maps["name_map"], row_perms=maps["row_perms"])
    keys = load_tensors(adapter / "adapter_model.safetensors")
    assert f"{PREFIX}model.layers.1.self_attn.{q}.lora_B.weight" in keys
    assert f"{PREFIX}model.layers.1.mlp.experts.3.gate_proj.lora_A.weight" in keys
    got = _merged_hf_logits(ckpt, adapter, tmp_path, ids)
    diff = (got - ref).abs().max().item()
    print(f"q_lora_rank={q_lora_rank}: max |logit diff| merged-into-checkpoint vs ours {diff:.2e}, "
          f"adapter's effect on the logits {(ref - base).abs().max().item():.2f}")
    assert diff < 1e-5 and (ref - base).abs().max() > 0.1

    # without the inverse row permutation the merged checkpoint is wrong: the test sees the RoPE row order
    bad = export_peft(ours, lora, tmp_path / "adapter_bad", name_map=maps["name_map"])
    (tmp_path / "merged").rename(tmp_path / "merged_good")
    assert (_merged_hf_logits(ckpt, bad, tmp_path, ids) - ref).abs().max().item() > 1e-3

    # and it loads back (names and row order read from adapter_config.json) into a fresh onboarded model
    fresh, _ = onboard_model(ckpt, dtype=torch.float32, device="cpu")
    load_peft(fresh, adapter)
    a, b = lora_modules(ours), lora_modules(fresh)
    assert set(a) == set(b)
    for n in a:
        for x, y in zip(a[n].parameters(), b[n].parameters()):
            assert torch.equal(x, y), n
