"""Clamped SwiGLU (swiglu_pair(limit=...), ModelSpec.swiglu_limit): silu(min(gate, l)) * clamp(up, -l, l) in float64
(values and gradients), every backend, and in the model's dense FFN, shared expert and routed experts."""

import random

import pytest
import torch
from pydantic import ValidationError

from moeadapt.models.model import build_model, materialize
from moeadapt.ops.moe import swiglu_pair
from tests.conftest import micro_spec


def test_values_and_gradients(seed):
    rnd = random.Random(seed)
    lim = rnd.choice([0.3, 1.0, 2.5])
    g = 2 * lim * torch.randn(rnd.choice([3, 17]), rnd.choice([4, 9]), dtype=torch.float64)
    u = 2 * lim * torch.randn(g.shape, dtype=torch.float64)
    g[0, 0], u[0, 1] = lim + 1.0, -lim - 1.0  # at least one entry of each side beyond the limit
    g, u = g.requires_grad_(), u.requires_grad_()
    got = swiglu_pair(g, u, backend="torch", limit=lim)
    gc, uc = torch.minimum(g, torch.tensor(lim, dtype=g.dtype)), torch.clamp(u, -lim, lim)
    want = gc / (1 + torch.exp(-gc)) * uc
    torch.testing.assert_close(got, want, rtol=1e-14, atol=1e-14)
    assert (g > lim).any() and (u.abs() > lim).any()  # the clamp bites
    dy = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad((got * dy).sum(), (g, u)), torch.autograd.grad((want * dy).sum(), (g, u))):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)
    for be in ("auto", "reference", "triton"):  # no fused clamped kernel: every backend runs torch's ops
        torch.testing.assert_close(swiglu_pair(g, u, backend=be, limit=lim), want, rtol=1e-14, atol=1e-14)
    with pytest.raises(ValueError, match="limit=0.0 must be > 0"):
        swiglu_pair(g, u, limit=0.0)


def test_model_ffns_are_clamped(seed):
    """Every FFN of the model (dense layer, shared expert, routed experts) changes with the limit, and a huge
    limit is the unclamped model."""
    spec = micro_spec(n_layers=2, layer_types=["kda", "kda"], first_k_dense=1, latent_dim=None)
    model = materialize(build_model(spec, "meta"), "cpu", dtype=torch.float64, seed=seed % 1000)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(20.0)  # pre-activations well past the limit
    ids = torch.randint(0, spec.vocab_size, (1, 7))
    base = model(ids).logits
    for lim in (1e9, 0.5):
        for m in model.modules():
            if hasattr(m, "limit"):
                m.limit = lim
        out = model(ids).logits
        assert torch.allclose(out, base) == (lim == 1e9)
    dense, moe = model.layers[0].ffn, model.layers[1].ffn
    x = torch.randn(5, spec.hidden_size, dtype=torch.float64)
    torch.testing.assert_close(dense(x), dense.w2(torch.nn.functional.silu(dense.w1(x).clamp(max=0.5))
                                                 * dense.w3(x).clamp(-0.5, 0.5)))
    assert moe.experts.limit == 0.5 and moe.shared.limit == 0.5


def test_spec_builds_clamped_ffns_and_checks_the_limit():
    model = build_model(micro_spec(swiglu_limit=7.0), "meta")
    assert {m.limit for m in model.modules() if hasattr(m, "limit")} == {7.0}
    with pytest.raises(ValidationError, match="swiglu_limit"):
        micro_spec(swiglu_limit=-1.0)
