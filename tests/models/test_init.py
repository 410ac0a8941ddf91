"""models/init.py: shard-local initialisation gives the same global tensor however it is cut, with the
distributions the model documents."""

import math

import pytest
import torch
from torch import nn

from moeadapt.config import LoRASpec
from moeadapt.lora import inject_lora
from moeadapt.models import init as init_mod
from moeadapt.models.init import Rule, init_fill, init_rules, init_slice
from moeadapt.models.model import build_model
from tests.conftest import micro_spec


def _cuts(n: int, k: int, g: torch.Generator) -> list[int]:
    inner = sorted(torch.randperm(max(n - 1, 1), generator=g)[: k - 1].add(1).tolist()) if n > 1 else []
    return [0, *inner, n]


@pytest.mark.parametrize("shape", [(37, 5), (8, 3, 4), (300,), (1, 7)])
def test_any_cut_gives_the_same_tensor(shape, seed, monkeypatch):
    monkeypatch.setattr(init_mod, "BLOCK_NUMEL", 16)  # many blocks on small shapes: cuts cross block edges
    g = torch.Generator().manual_seed(seed)
    rule = Rule("normal", 0.5)
    full = init_slice(rule, seed, "w", shape, tuple(slice(0, n) for n in shape))
    assert full.shape == shape and full.std() > 0.1
    for k in (2, 3, 5):
        cuts = _cuts(shape[0], k, g)
        parts = [init_slice(rule, seed, "w", shape, (slice(a, b),)) for a, b in zip(cuts, cuts[1:])]
        assert torch.equal(torch.cat(parts), full), cuts
    if len(shape) > 1:  # a cut on another dim too: a sub-block of the same values
        part = init_slice(rule, seed, "w", shape, (slice(0, shape[0]), slice(1, shape[1])))
        assert torch.equal(part, full[:, 1:])
    other = init_slice(rule, seed, "w2", shape, (slice(0, shape[0]),))
    assert not torch.equal(other, full)  # keyed by name
    assert not torch.equal(init_slice(rule, seed + 1, "w", shape, (slice(0, shape[0]),)), full)  # and seed


def test_dtype_is_the_cast_of_the_fp32_draw(seed):
    rule = Rule("uniform", -1.0, 1.0)
    a = init_slice(rule, seed, "x", (64, 8), (slice(3, 40),))
    b = init_slice(rule, seed, "x", (64, 8), (slice(3, 40),), dtype=torch.bfloat16)
    assert b.dtype == torch.bfloat16 and torch.equal(b, a.to(torch.bfloat16))


def test_rules_follow_the_model_distributions(seed):
    spec = micro_spec(hidden_size=64, intermediate_size=96, moe_intermediate_size=64)
    m = build_model(spec, "meta")
    inject_lora(m, LoRASpec(rank=4, targets=["attn.q_proj", "experts.w1"]))
    rules, fill = init_rules(m), init_fill(m, seed)
    params = dict(m.named_parameters())
    std, L = spec.initializer_range, spec.n_layers

    def full(name):
        shape = tuple(params[name].shape)
        return fill(name, shape, tuple(slice(0, n) for n in shape)).double()

    w = full("embed.weight")  # 264 x 64 normal(0, std)
    assert abs(w.std().item() - std) < 0.05 * std and abs(w.mean().item()) < 0.05 * std
    wo = full("layers.0.attn.o_proj.weight")
    assert abs(wo.std().item() - std / math.sqrt(2 * L)) < 0.1 * std / math.sqrt(2 * L)
    e2 = full("layers.1.ffn.experts.w2.weight")
    assert abs(e2.std().item() - std / math.sqrt(2 * L)) < 0.1 * std / math.sqrt(2 * L)
    assert torch.equal(full("norm.weight"), torch.ones(64, dtype=torch.float64))
    a_log = full("layers.0.attn.A_log")
    assert a_log.exp().min() >= 1 and a_log.exp().max() <= 16
    dt = torch.nn.functional.softplus(full("layers.0.attn.dt_bias"))
    assert dt.min() >= 1e-3 * 0.999 and dt.max() <= 1e-1 * 1.001
    la = full("layers.0.attn.q_proj.lora_A.weight")
    assert la.abs().max() <= 1 / math.sqrt(64) and la.std() > 0
    assert full("layers.0.attn.q_proj.lora_B.weight").abs().sum() == 0
    ga = full("layers.1.ffn.experts.w1.lora_A")
    assert ga.abs().max() <= 1 / math.sqrt(ga.shape[1])
    assert rules["layers.1.ffn.router.expert_bias"] == Rule("const", 0.0)


def test_unknown_parameter_fails_clearly():
    m = build_model(micro_spec(), "meta")
    m.layers[0].extra = nn.Module()
    m.layers[0].extra.scale = nn.Parameter(torch.empty(3, device="meta"))
    with pytest.raises(TypeError, match=r"no init rule for \['layers.0.extra.scale'\]"):
        init_rules(m)


def test_tied_head_is_filled_under_both_names(seed):
    """A tied LM head (tie_word_embeddings) is one tensor with two names; the fill answers for either."""
    m = build_model(micro_spec(n_layers=1, tie_word_embeddings=True), "meta")
    fill = init_fill(m, seed)
    shape = tuple(m.embed.weight.shape)
    full = (slice(0, shape[0]), slice(0, shape[1]))
    assert fill("lm_head.weight", shape, full).dtype == m.embed.weight.dtype
    assert fill("embed.weight", shape, full).shape == shape
