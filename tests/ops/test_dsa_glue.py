"""The DSA layer's glue in Triton (ops/dsa/triton_glue.py: mha_inputs, gate_heads, rope_first) against the torch
functions of models/dsa_attn.py in float64, forward and every gradient, on fresh random small shapes (fp32 inputs:
the Triton interpreter on CPU); checks that the comparison catches a wrong rotation sign or a dk_pe without the
sum over heads; the ops through torch.library's checks (opcheck); and the DSA layer with GLUE_IMPL "triton"."""

import os
import random

import pytest
import torch

from moeadapt.models.common import rope_cos_sin
from moeadapt.models.dsa_attn import gate_heads, mha_inputs, rope_first

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"),
                                reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"
# fp32 kernels against float64: a few fp32 roundings (of values ~1; the head sum of dk_pe adds H of them)
TOL = 1e-5


def _glue():
    from moeadapt.ops.dsa import triton_glue

    return triton_glue


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|, 0 for empty tensors."""
    if not b.numel():
        return 0.0
    return float((a.detach().double() - b.detach()).abs().max() / b.detach().abs().max().clamp(min=1e-30))


def _tables(B, T, r, per_row, rng):
    """fp32 cos / sin [T, r/2], or [B, T, r/2] of packed documents (each row's positions restart at a random t)."""
    t = torch.arange(T)
    pos = torch.stack([torch.where(t >= s, t - s, t) for s in (rng.randrange(T) for _ in range(B))]) if per_row else t
    cos, sin = rope_cos_sin(pos, r, 1000.0)
    return cos.to(DEV), sin.to(DEV)


def _compare(fn, ref, leaves, others, tol=TOL):
    """Outputs and the leaves' gradients of fn(*leaves, *others) (fp32) against ref's in float64 for the same
    random cotangents: the largest relative error."""
    out = fn(*leaves, *others)
    out = out if isinstance(out, tuple) else (out,)
    dys = [torch.randn_like(o) for o in out]
    grads = torch.autograd.grad(out, leaves, dys)
    leaves64 = [t.detach().double().requires_grad_() for t in leaves]
    others64 = [t.double() if isinstance(t, torch.Tensor) else t for t in others]
    want = ref(*leaves64, *others64)
    want = want if isinstance(want, tuple) else (want,)
    want_grads = torch.autograd.grad(want, leaves64, [d.double() for d in dys])
    for a, b in zip(out, want):
        assert a.dtype == leaves[0].dtype and a.shape == b.shape and a.is_contiguous()
    for g, leaf in zip(grads, leaves):
        assert g.dtype == leaf.dtype and g.shape == leaf.shape
    return max(_err(a, b) for a, b in zip(out + grads, want + want_grads))


def _mha_case(seed, per_row, rotate, nope=None, r=None, H=None, T=None):
    """Leaves (q, kvb, k_pe) and the other arguments of mha_inputs at a random small shape; q and k_pe are
    strided views (k_pe a slice of the kv projection, as in the layer)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, T, H = rng.randint(1, 2), rng.randint(1, 9) if T is None else T, rng.choice([1, 3, 4]) if H is None else H
    nope = rng.choice([8, 12]) if nope is None else nope
    r = rng.choice([4, 8]) if r is None else r
    vd = rng.choice([4, 10])
    q = torch.randn(B, T, H, nope + r + 3, device=DEV)[..., 3:]
    kvb = torch.randn(B, T, H, nope + vd, device=DEV)
    k_pe = torch.randn(B, T, 5 + r, device=DEV)[..., 5:]
    cos, sin = _tables(B, T, r, per_row, rng)
    return [t.detach().requires_grad_() for t in (q, kvb, k_pe)], (cos, sin, nope, rotate)


@pytest.mark.parametrize("per_row,rotate", [(False, True), (True, True), (False, False)],
                         ids=["tables", "per_row_tables", "no_rotation"])
def test_mha_inputs_matches_float64(seed, per_row, rotate):
    leaves, others = _mha_case(seed, per_row, rotate)
    assert _compare(_glue().mha_inputs_triton, mha_inputs, leaves, others) < TOL


@pytest.mark.parametrize("nope,r", [(0, 8), (8, 0)], ids=["no_nope", "no_rope"])
def test_mha_inputs_edge_widths(seed, nope, r):
    """No key-only channels, or no rope channels (r = 0: the kernels copy, cos / sin unread)."""
    leaves, others = _mha_case(seed, False, True, nope=nope, r=r)
    assert _compare(_glue().mha_inputs_triton, mha_inputs, leaves, others) < TOL


def test_mha_inputs_check_catches_sign_and_head_sum(seed, monkeypatch):
    """The comparison above fails for a backward that rotates forward instead of back (the sign of sin), and for a
    dk_pe that takes one head's gradient instead of the sum over heads: each error is orders above TOL."""
    g = _glue()
    leaves, others = _mha_case(seed, False, True, H=3, T=6)  # positions 0..5: nonzero angles from t = 1
    impl = g._mha_inputs_bwd_impl

    def forward_rotation(dq_full, dk_full, dv, cos, sin, *rest):
        return impl(dq_full, dk_full, dv, cos, -sin, *rest)

    def one_head(dq_full, dk_full, dv, *rest):
        dq, dkvb, _ = impl(dq_full, dk_full, dv, *rest)
        return dq, dkvb, impl(dq_full[:, :, :1], dk_full[:, :, :1], dv[:, :, :1], *rest)[2]

    for wrong in (forward_rotation, one_head):
        monkeypatch.setattr(g, "mha_inputs_bwd_fast", wrong)
        fresh = [t.detach().clone().requires_grad_() for t in leaves]
        assert _compare(g.mha_inputs_triton, mha_inputs, fresh, others) > 1e3 * TOL, wrong.__name__
    monkeypatch.undo()
    assert _compare(g.mha_inputs_triton, mha_inputs, leaves, others) < TOL


@pytest.mark.parametrize("layout", ["flex", "contiguous"])
def test_gate_heads_matches_float64(seed, layout):
    """o as a transposed view of [B, H, T, V] (FlexAttention's output for [B, H, T, D] queries) or contiguous
    [B, T, H, V]; d o comes back in o's strides."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, T, H, V = rng.randint(1, 2), rng.randint(1, 40), rng.choice([1, 3, 4]), rng.choice([8, 12])
    if layout == "flex":
        o = torch.randn(B, H, T, V, device=DEV).transpose(1, 2).requires_grad_()
    else:
        o = torch.randn(B, T, H, V, device=DEV, requires_grad=True)
    gl = (torch.randn(B, T, H, device=DEV) * 3).requires_grad_()
    assert _compare(_glue().gate_heads_triton, gate_heads, [o, gl], ()) < TOL
    y = _glue().gate_heads_triton(o, gl)
    (d_o,) = torch.autograd.grad(y, o, torch.randn_like(y))
    assert d_o.stride() == o.stride()


@pytest.mark.parametrize("per_row,heads,r", [(False, True, 4), (True, True, 8), (True, False, 8), (False, False, 16),
                                             (False, True, 0)],
                         ids=["q_tables", "q_per_row", "k_per_row", "k_all_rope", "no_rope"])
def test_rope_first_matches_float64(seed, per_row, heads, r):
    """The indexer's q_idx [B, T, H, D] (heads) and k_idx [B, T, D], RoPE on the first r channels (all of them, or
    none)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, T, D = rng.randint(1, 2), rng.randint(1, 9), 16
    shape = (B, T, rng.choice([1, 3]), D) if heads else (B, T, D)
    x = torch.randn(*shape, device=DEV, requires_grad=True)
    cos, sin = _tables(B, T, r, per_row, rng)
    assert _compare(_glue().rope_first_triton, rope_first, [x], (cos, sin, r)) < TOL


def test_rope_first_check_catches_sign(seed, monkeypatch):
    """A rope_first whose backward rotates forward again (inverse not flipped) fails the comparison."""
    g = _glue()
    torch.manual_seed(seed)
    x = torch.randn(2, 5, 3, 16, device=DEV, requires_grad=True)
    cos, sin = _tables(2, 5, 8, False, random.Random(seed))
    monkeypatch.setattr(g, "rope_first_bwd_fast", lambda dy, cos, sin, r, inverse: g._rope_first_impl(dy, cos, sin,
                                                                                                     r, False))
    assert _compare(g.rope_first_triton, rope_first, [x], (cos, sin, 8)) > 1e3 * TOL


def test_glue_rejects_mismatched_tables():
    g = _glue()
    q, kvb, k_pe = torch.zeros(1, 4, 2, 12), torch.zeros(1, 4, 2, 16), torch.zeros(1, 4, 4)
    cos = torch.zeros(5, 2)
    with pytest.raises(ValueError, match=r"cos / sin must be \[T, r/2\]"):
        g.mha_inputs_triton(q, kvb, k_pe, cos, cos, 8, True)
    with pytest.raises(ValueError, match="disagree"):
        g.mha_inputs_triton(q, kvb, k_pe, cos, cos, 6, True)


# ------------------------------------------------------------------ torch.library's checks


def test_mha_inputs_opcheck(seed):
    g = _glue()
    leaves, (cos, sin, nope, rotate) = _mha_case(seed, True, True)
    torch.library.opcheck(g.mha_inputs_fwd, (*leaves, cos, sin, nope, rotate))
    q_full, k_full, v = g.mha_inputs_fwd(*(t.detach() for t in leaves), cos, sin, nope, rotate)
    torch.library.opcheck(g.mha_inputs_bwd, (torch.randn_like(q_full), torch.randn_like(k_full), torch.randn_like(v),
                                             cos, sin, nope, rotate, torch.float32, torch.float32))


def test_gate_heads_opcheck(seed):
    g = _glue()
    torch.manual_seed(seed)
    o = torch.randn(2, 3, 5, 8, device=DEV).transpose(1, 2).requires_grad_()
    gl = torch.randn(2, 5, 3, device=DEV, requires_grad=True)
    torch.library.opcheck(g.gate_heads_fwd, (o, gl))
    torch.library.opcheck(g.gate_heads_bwd, (o.detach(), gl.detach(), torch.randn(2, 5, 24, device=DEV)))


def test_rope_first_opcheck(seed):
    g = _glue()
    torch.manual_seed(seed)
    x = torch.randn(2, 5, 3, 16, device=DEV, requires_grad=True)
    cos, sin = _tables(2, 5, 8, True, random.Random(seed))
    torch.library.opcheck(g.rope_first_op, (x, cos, sin, 8, False))


# ------------------------------------------------------------------ the layer


def test_layer_with_triton_glue_matches(monkeypatch):
    """The DSA layer in MHA form with an output gate, its glue through the Triton ops (forced on CPU) against the
    torch functions: output, the input's and every parameter's gradient, and the indexer's KL loss (fp32)."""
    from moeadapt.models import dsa_attn
    from moeadapt.models.model import build_model, materialize
    from tests.conftest import micro_spec

    spec = micro_spec(attn_output_gate=True, index_loss_coef=0.1)
    model = materialize(build_model(spec), seed=3)
    layer = next(m for m in model.modules() if isinstance(m, dsa_attn.DSAAttention)).to(DEV)
    layer.train()
    layer.form = "mha"
    B, T = 2, 12
    x = torch.randn(B, T, spec.hidden_size, device=DEV)
    dy = torch.randn(B, T, spec.hidden_size, device=DEV)
    cos, sin = (t.to(DEV) for t in rope_cos_sin(torch.arange(T), spec.qk_rope_head_dim, spec.rope_theta))
    calls = []

    def run(triton: bool):
        monkeypatch.setattr(dsa_attn, "_triton_glue", lambda t: calls.append(t.shape) or triton)
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        y, aux = layer(xx, cos=cos, sin=sin)
        ((y * dy).sum() + aux["index_kl"]).backward()
        return [y, xx.grad, aux["index_kl"]] + [p.grad for p in layer.parameters()]

    want, got = run(False), run(True)
    assert len(calls) == 6  # rope_first (applied to q_idx and k_idx), mha_inputs and gate_heads per forward
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
