"""Streaming adapter merge (moeadapt/merge.py): block by block into sharded safetensors, in our format (moeadapt
loads it: the weights of `merge_lora` on the whole model) and under the checkpoint's names (transformers loads it
with the merged model's logits), RoPE-permuted rows and per-expert adapters included."""

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).parent / "onboard"))
from onboard_helpers import present_targets, random_checkpoint, save_tiny  # noqa: E402

from moeadapt.config import LoRASpec  # noqa: E402
from moeadapt.lora import export_peft, inject_lora, lora_modules, merge_lora  # noqa: E402
from moeadapt.merge import merge_adapter_streaming  # noqa: E402
from moeadapt.models.model import build_model  # noqa: E402
from moeadapt.onboard import onboard_model, peft_maps, read_family_dir  # noqa: E402
from moeadapt.onboard.sources import open_source  # noqa: E402
from moeadapt.parallel.sharded_io import load_sharded  # noqa: E402


def _adapted(ckpt: Path, adir: Path, seed: int):
    model, _ = onboard_model(ckpt, dtype=torch.float32)
    targets = present_targets(model, ["attn.wq_b", "attn.wkv_a", "attn.q_proj", "attn.o_proj",
                                      "experts.w1", "experts.w2"])
    lora = LoRASpec(rank=4, alpha=8.0, targets=targets)
    inject_lora(model, lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in lora_modules(model).values():
            b = m.lora_B.weight if hasattr(m.lora_B, "weight") else m.lora_B
            b.copy_(torch.randn(b.shape, generator=g) * 0.1)
    export_peft(model, lora, adir, base_model=str(ckpt), **peft_maps(ckpt))
    merge_lora(model)
    return model.eval()


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe", "kimi_linear", "minimax_m2", "qwen3_5_moe"])
def test_streaming_merge_matches_merge_lora(family, tmp_path, seed):
    import transformers

    if family in ("deepseek_v3", "qwen3_moe"):
        ckpt = save_tiny(family, tmp_path / family)
    else:  # shapes drawn from the seed; the multimodal qwen3_5_moe's vision tower is copied through by the hf layout
        ckpt = random_checkpoint(family, tmp_path / family, seed, vocab_size=96)
    merged = _adapted(ckpt, tmp_path / "adapter", seed)
    out = merge_adapter_streaming(ckpt, tmp_path / "adapter", tmp_path / "ours", max_shard_bytes=20_000)
    assert (out / "model.safetensors.index.json").is_file()
    ours = build_model(read_family_dir(out).spec, "meta").to_empty(device="cpu")
    load_sharded(ours, open_source(out))
    want = {k: v for k, v in merged.state_dict().items() if not k.endswith("tokens_per_expert")}
    for k, v in want.items():
        assert torch.allclose(ours.state_dict()[k], v, atol=1e-6, rtol=0), k
    hf = merge_adapter_streaming(ckpt, tmp_path / "adapter", tmp_path / "hf", layout="hf", max_shard_bytes=20_000)
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        got = transformers.AutoModelForCausalLM.from_pretrained(str(hf)).float().eval()(x).logits
        base = transformers.AutoModelForCausalLM.from_pretrained(str(ckpt)).float().eval()(x).logits
        merged.set_backend("reference")
        ref = merged(x).logits
    assert (got - ref).abs().max() < 1e-4, f"transformers on the merged export vs ours merged: {(got - ref).abs().max()}"
    assert (base - ref).abs().max() > 1e-3  # the adapter changed the model (the check above is not vacuous)


def test_merge_cli_and_bad_layout(tmp_path):
    import json

    from moeadapt.cli import main

    ckpt = save_tiny("qwen3_moe", tmp_path / "q")
    _adapted(ckpt, tmp_path / "adapter", 0)
    assert main(["merge-adapter", "--model", str(ckpt), "--adapter", str(tmp_path / "adapter"), "--out",
                 str(tmp_path / "hf"), "--format", "hf", "--max-shard-gb", "3e-5"]) == 0
    index = json.loads((tmp_path / "hf" / "model.safetensors.index.json").read_text())
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in index["weight_map"]  # the checkpoint's names
    assert len(set(index["weight_map"].values())) > 2
    with pytest.raises(ValueError, match="layout='gguf'; use 'ours'"):
        merge_adapter_streaming(ckpt, tmp_path / "adapter", tmp_path / "o", layout="gguf")
