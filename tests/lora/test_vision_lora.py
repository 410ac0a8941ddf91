"""LoRA on a vision-language model: frozen tower + projector by default, the switches, PEFT export / load of
whatever was trained (adapters on the tower / projector, a fully trained projector as modules_to_save)."""

from __future__ import annotations

import json

import pytest
import torch

from moeadapt.config import LoRASpec
from moeadapt.lora import export_peft, inject_lora, load_peft, lora_modules
from moeadapt.models.model import build_model, materialize
from moeadapt.models.vision import ImageBatch, patchify

VISION = dict(patch_size=14, hidden_size=16, n_layers=1, n_heads=2, intermediate_size=32)


def _model(micro, seed=0):
    spec = micro(vision=VISION)
    m = materialize(build_model(spec, "meta"), "cpu", seed=seed)
    m.set_backend("reference")
    return m


@pytest.fixture
def micro():
    from tests.conftest import micro_spec

    return micro_spec


def _batch():
    ids = torch.randint(0, 256, (2, 10))
    ids[0, 2:6] = 263
    ids[1, 1:5] = 263
    imgs = [torch.randn(3, 56, 56) for _ in range(2)]
    return ids, ImageBatch(torch.cat([patchify(i, 14) for i in imgs]), torch.tensor([[4, 4], [4, 4]]))


def _trainable(m):
    return {n for n, p in m.named_parameters() if p.requires_grad}


def test_defaults_freeze_tower_and_projector(micro):
    m = _model(micro)
    inject_lora(m, LoRASpec(rank=4))
    tr = _trainable(m)
    assert tr and all(".lora_" in n for n in tr)
    assert not any(n.startswith("vision.") for n in tr)
    # patterns that would match vision linears by suffix still adapt only the language model
    m2 = _model(micro)
    names = inject_lora(m2, LoRASpec(rank=4, targets=["*proj", "*fc1"]))
    assert names and not any(n.startswith("vision.") for n in names)


def test_switches_and_peft_roundtrip(micro, tmp_path, seed):
    spec = LoRASpec(rank=4, alpha=8, vision_tower="lora", projector="full")
    m = _model(micro)
    inject_lora(m, spec)
    tr = _trainable(m)
    assert {"vision.tower.blocks.0.attn.qkv.lora_A.weight", "vision.tower.blocks.0.fc2.lora_B.weight"} <= tr
    assert {"vision.projector.fc1.weight", "vision.projector.fc2.bias"} <= tr
    assert "vision.tower.patch_embed.weight" not in tr and "vision.merger.norm.weight" not in tr
    with torch.no_grad():  # make every trained tensor differ from the base
        for p in m.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
    ids, images = _batch()
    want = m(ids, images=images).logits
    out = export_peft(m, spec, tmp_path / "adapter")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["modules_to_save"] == ["vision.projector"]
    assert {"qkv", "proj", "fc1", "fc2"} <= set(cfg["target_modules"])
    fresh = _model(micro)
    load_peft(fresh, out)
    torch.testing.assert_close(fresh(ids, images=images).logits, want, rtol=1e-6, atol=1e-6)
    # projector adapters instead of full training
    m3 = _model(micro)
    inject_lora(m3, LoRASpec(rank=4, projector="lora"))
    assert any(n.startswith("vision.projector.") for n in lora_modules(m3))
    assert not any(n.startswith("vision.tower.") for n in lora_modules(m3))


def test_vision_switch_on_a_text_model_is_an_error(micro):
    m = materialize(build_model(micro(), "meta"), "cpu")
    with pytest.raises(ValueError, match="need a model with a vision tower"):
        inject_lora(m, LoRASpec(projector="full"))
