"""Hyper-connections (models/hyper.py, ModelSpec.hc_mult): the mixing weights, the collapse and the merge against a
float64 per-token loop written from the formulas; gradients by finite differences; the model with hc_mult > 1
against the same loop around its own sublayers; hc_mult = 1 leaves the model as it was; bad options are refused."""

import random

import pytest
import torch
from pydantic import ValidationError

from moeadapt.models.common import rope_cos_sin
from moeadapt.models.hyper import HyperConnection, hc_weights, sinkhorn
from moeadapt.models.model import build_model, materialize
from tests.conftest import micro_spec


def _loop_reference(x, fn, base, scale, iters, eps, norm_eps):
    """(pre, post, comb) per token, float64, one token at a time."""
    B, T, N, D = x.shape
    pre, post, comb = (torch.zeros(B, T, N, dtype=torch.float64), torch.zeros(B, T, N, dtype=torch.float64),
                       torch.zeros(B, T, N, N, dtype=torch.float64))
    for b in range(B):
        for t in range(T):
            v = x[b, t].reshape(-1).double()
            v = v / torch.sqrt((v * v).mean() + norm_eps)
            a = fn.double() @ v
            pre[b, t] = 1 / (1 + torch.exp(-(a[:N] * scale[0] + base[:N]))) + eps
            post[b, t] = 2 / (1 + torch.exp(-(a[N:2 * N] * scale[1] + base[N:2 * N])))
            z = (a[2 * N:] * scale[2] + base[2 * N:]).reshape(N, N)
            m = torch.exp(z - z.max(1, keepdim=True).values)
            m = m / m.sum(1, keepdim=True) + eps
            for i in range(2 * iters - 1):  # columns first, then rows / columns alternately
                m = m / (m.sum(0, keepdim=True) + eps) if i % 2 == 0 else m / (m.sum(1, keepdim=True) + eps)
            comb[b, t] = m
    return pre, post, comb


def _draw(seed, small=False):
    rnd = random.Random(seed)
    N, D, B, T = rnd.choice([2, 3, 4]), rnd.choice([4, 8]), rnd.choice([1, 2]), rnd.choice([2, 4])
    if small:  # finite differences: one forward per input element
        N, D, B, T = rnd.choice([2, 3]), 4, 1, 2
    iters, eps, norm_eps = rnd.choice([1, 3, 20]), rnd.choice([1e-6, 1e-3]), rnd.choice([1e-6, 1e-5])
    x = torch.randn(B, T, N, D, dtype=torch.float64)
    fn = 0.3 * torch.randn((2 + N) * N, N * D, dtype=torch.float64)
    base, scale = 0.5 * torch.randn((2 + N) * N, dtype=torch.float64), 1 + 0.5 * torch.randn(3, dtype=torch.float64)
    return x, fn, base, scale, iters, eps, norm_eps


def test_weights_collapse_merge_match_the_loop(seed):
    x, fn, base, scale, iters, eps, norm_eps = _draw(seed)
    pre, post, comb = hc_weights(x, fn, base, scale, iters, eps, norm_eps)
    rp, rq, rc = _loop_reference(x, fn, base, scale, iters, eps, norm_eps)
    torch.testing.assert_close(pre, rp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(post, rq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(comb, rc, rtol=1e-12, atol=1e-12)
    if iters == 20:  # Sinkhorn ends on a column normalisation: columns sum to 1 (up to the eps floors); the rows
        # approach 1 without reaching it in 20 iterations for every draw (up to 0.036 off), but never move away:
        # their error is no larger than after 3 iterations, and smaller in all
        torch.testing.assert_close(comb.sum(-2), torch.ones_like(comb.sum(-2)), rtol=0, atol=1e-4 + 2 * eps)
        comb3 = hc_weights(x, fn, base, scale, 3, eps, norm_eps)[2]
        err20, err3 = (comb.sum(-1) - 1).abs().sum(-1), (comb3.sum(-1) - 1).abs().sum(-1)
        assert bool((err20 <= err3 + 1e-9).all()) and (err20.sum() < err3.sum() or err3.sum() < 1e-6), (err20, err3)
    hc = HyperConnection(micro_spec(hc_mult=x.shape[2], hidden_size=x.shape[3], hc_sinkhorn_iters=iters, hc_eps=eps,
                                    norm_eps=norm_eps)).double()
    with torch.no_grad():
        hc.fn.copy_(fn), hc.base.copy_(base), hc.scale.copy_(scale)
    h, mix = hc(x)
    torch.testing.assert_close(h, (rp[..., None] * x).sum(2), rtol=1e-12, atol=1e-12)
    y = torch.randn(h.shape, dtype=torch.float64)
    want = torch.stack([rq[:, :, n, None] * y + sum(rc[:, :, m, n, None] * x[:, :, m] for m in range(x.shape[2]))
                        for n in range(x.shape[2])], 2)
    torch.testing.assert_close(hc.merge(y, x, mix), want, rtol=1e-12, atol=1e-12)


def test_gradients_match_finite_differences(seed):
    x, fn, base, scale, iters, eps, norm_eps = _draw(seed, small=True)
    args = [t.clone().requires_grad_() for t in (x, fn, base, scale)]

    def f(x, fn, base, scale):
        pre, post, comb = hc_weights(x, fn, base, scale, iters, eps, norm_eps)
        return (pre[..., None] * x).sum(2), post, comb

    assert torch.autograd.gradcheck(f, args, eps=1e-6, atol=1e-6)


def test_sinkhorn_one_iteration_normalises_columns_only():
    m = torch.rand(3, 3, dtype=torch.float64) + 0.1
    out = sinkhorn(m, 1, 0.0)
    torch.testing.assert_close(out.sum(0), torch.ones(3, dtype=torch.float64))
    assert not torch.allclose(out.sum(1), torch.ones(3, dtype=torch.float64))


def test_model_streams_match_the_loop_around_its_sublayers(seed):
    """The whole model with hc_mult streams equals, in float64, the streams carried by hand: N copies of the
    embedding, per sublayer collapse -> norm -> sublayer -> merge (by the loop's weights), mean -> norm -> head."""
    N = random.Random(seed).choice([2, 3])
    spec = micro_spec(n_layers=2, layer_types=["kda", "dsa"], first_k_dense=1, hc_mult=N, hc_sinkhorn_iters=4,
                      latent_dim=None, index_topk=4)
    model = materialize(build_model(spec, "meta"), "cpu", dtype=torch.float64, seed=seed % 1000)
    model.set_backend("reference")
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "_hc." in n:
                p.add_(0.3 * torch.randn_like(p))
    ids = torch.randint(0, spec.vocab_size, (2, 9))
    got = model(ids).logits
    x = model.embed(ids).unsqueeze(2).expand(-1, -1, N, -1)
    cos, sin = rope_cos_sin(torch.arange(9), spec.qk_rope_head_dim, spec.rope_theta)
    for blk in model.layers:
        for hc, norm, run in ((blk.attn_hc, blk.attn_norm, lambda h, b=blk: b.attn(h, cos=cos, sin=sin, shared={})[0]),
                              (blk.ffn_hc, blk.ffn_norm, lambda h, b=blk: b.ffn(h)[0] if b.is_moe else b.ffn(h))):
            pre, post, comb = _loop_reference(x, hc.fn, hc.base, hc.scale, hc.iters, hc.eps, hc.norm_eps)
            y = run(norm((pre[..., None] * x).sum(2)))
            x = post[..., None] * y[:, :, None] + torch.einsum("btmn,btmd->btnd", comb, x)
    want = model.lm_head(model.norm(x.mean(2)))
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in model.named_parameters() if "_hc." in n)


def test_hc_mult_one_is_the_plain_residual_model(seed):
    spec = micro_spec(n_layers=2, layer_types=["kda", "dsa"])
    assert spec.hc_mult == 1
    model = materialize(build_model(spec, "meta"), "cpu", seed=seed % 1000)
    assert not any("_hc" in n for n, _ in model.named_parameters())


@pytest.mark.parametrize("bad, needle", [(dict(hc_mult=0), "hc_mult"), (dict(hc_sinkhorn_iters=0), "hc_sinkhorn"),
                                         (dict(hc_eps=0.0), "hc_eps")])
def test_bad_options_are_refused(bad, needle):
    with pytest.raises(ValidationError, match=needle):
        micro_spec(**bad)
