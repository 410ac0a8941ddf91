"""The lower-bounded KDA gate (chunk_kda(gate_lower_bound=b), ModelSpec.kda_gate_lower_bound):
g = b * sigmoid(exp(A_log[h]) * (g_raw + dt_bias[h])), against the formula in float64 through the step-by-step
recurrence (values and gradients of every input), the chunked reference, the pre-formed-gate path the Triton /
fla backends take, the layer wiring, and the errors."""

import random

import pytest
import torch
from pydantic import ValidationError

from moeadapt.ops.kda import chunk_kda, naive_recurrent_kda
from moeadapt.ops.kda.reference import kda_gate
from tests.conftest import micro_spec


def _inputs(seed):
    rnd = random.Random(seed)
    B, T, H, K, V = rnd.choice([1, 2]), rnd.choice([5, 70]), rnd.choice([1, 2]), rnd.choice([4, 8]), rnd.choice([4, 8])
    b = rnd.choice([-5.0, -2.0, -0.5])
    d = torch.float64
    t = [torch.randn(B, T, H, K, dtype=d), torch.randn(B, T, H, K, dtype=d), torch.randn(B, T, H, V, dtype=d),
         torch.randn(B, T, H, K, dtype=d), torch.randn(B, T, H, dtype=d), 0.5 * torch.randn(H, dtype=d),
         0.5 * torch.randn(H * K, dtype=d)]
    return [x.requires_grad_() for x in t], b


def _formula(g_raw, A_log, dt_bias, b):
    H, K = g_raw.shape[-2:]
    return b * torch.sigmoid(torch.exp(A_log)[:, None] * (g_raw + dt_bias.view(H, K)))


def test_gate_formula(seed):
    (_, _, _, g, _, A, dt), b = _inputs(seed)
    got = kda_gate(g, A, dt, b)
    torch.testing.assert_close(got, _formula(g, A, dt, b), rtol=1e-14, atol=1e-14)
    assert (got < 0).all() and (got > b).all()


def test_values_and_gradients_match_the_formula(seed):
    (q, k, v, g, beta, A, dt), b = _inputs(seed)
    o1, s1 = chunk_kda(q, k, v, g, beta, A_log=A, dt_bias=dt, gate_lower_bound=b, use_qk_l2norm=True,
                       beta_is_logits=True, output_final_state=True, backend="reference")
    o2, s2 = naive_recurrent_kda(q, k, v, _formula(g, A, dt, b), beta, use_qk_l2norm=True, beta_is_logits=True,
                                 output_final_state=True)
    torch.testing.assert_close(o1, o2, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(s1, s2, rtol=1e-9, atol=1e-9)
    leaves = (q, k, v, g, beta, A, dt)
    do, ds = torch.randn_like(o1), torch.randn_like(s1)
    g1 = torch.autograd.grad((o1 * do).sum() + (s1 * ds).sum(), leaves)
    g2 = torch.autograd.grad((o2 * do).sum() + (s2 * ds).sum(), leaves)
    for name, a, c in zip("q k v g beta A_log dt_bias".split(), g1, g2):
        torch.testing.assert_close(a, c, rtol=1e-8, atol=1e-8, msg=name)


def test_kernel_backends_take_the_formed_gate(seed, monkeypatch):
    """"triton" / "fla" have no fused lower-bounded gate: chunk_kda forms g first and passes no A_log."""
    import moeadapt.ops.kda.triton_kda as tk

    (q, k, v, g, beta, A, dt), b = _inputs(seed)
    seen = {}

    def fake(q, k, v, g, beta, scale, h0, ofs, cu, **opts):
        seen.update(opts, g=g)
        return naive_recurrent_kda(q, k, v, g, beta, scale, h0, ofs, cu, **opts)

    monkeypatch.setattr(tk, "chunk_kda_triton", lambda *a, launch=None, **kw: fake(*a, **kw))
    o, _ = chunk_kda(q, k, v, g, beta, A_log=A, dt_bias=dt, gate_lower_bound=b, backend="triton")
    assert seen["A_log"] is None and seen["dt_bias"] is None
    torch.testing.assert_close(seen["g"], _formula(g, A, dt, b))
    ref, _ = chunk_kda(q, k, v, g, beta, A_log=A, dt_bias=dt, gate_lower_bound=b, backend="reference")
    torch.testing.assert_close(o, ref, rtol=1e-9, atol=1e-9)


def test_layer_uses_the_bound(seed):
    from moeadapt.models.kda_attn import KDAAttention

    spec = micro_spec(kda_gate_lower_bound=-3.0)
    layer = KDAAttention(spec).double()
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer.backend = "reference"
    x = torch.randn(2, 6, spec.hidden_size, dtype=torch.float64)
    y, _ = layer(x)
    layer.gate_lower_bound = None
    assert not torch.allclose(y, layer(x)[0])
    layer.gate_lower_bound = -3.0
    layer.reset_parameters()
    assert (layer.A_log == 0).all()  # fla / transformers start the bounded gate at A = 1


def test_errors():
    (q, k, v, g, beta, A, dt), _ = _inputs(0)
    with pytest.raises(ValueError, match="gate_lower_bound=-1.0 needs A_log"):
        chunk_kda(q, k, v, g, beta, gate_lower_bound=-1.0)
    with pytest.raises(ValueError, match="must be < 0"):
        chunk_kda(q, k, v, g, beta, A_log=A, dt_bias=dt, gate_lower_bound=0.5)
    with pytest.raises(ValidationError, match="kda_gate_lower_bound"):
        micro_spec(kda_gate_lower_bound=1.0)
