import math

import pytest
import torch

from moeadapt.models.router import Router, update_expert_bias
from tests.conftest import micro_spec


def router(**kw):
    spec = micro_spec(hidden_size=16, n_routed_experts=8, n_experts_per_tok=2, **kw)
    r = Router(spec).double()
    r.reset_parameters()
    with torch.no_grad():
        r.weight.normal_()
    return r


def test_gate_values_and_selection_bias(seed):
    r = router(routed_scaling_factor=2.0)
    x = torch.randn(50, 16, dtype=torch.float64)
    out = r(x)
    s = torch.sigmoid(x @ r.weight.T)
    top = s.topk(2, dim=-1)
    assert torch.equal(out.expert_ids_TK.sort(-1).values, top.indices.sort(-1).values)
    w = top.values / top.values.sum(-1, keepdim=True) * 2.0
    torch.testing.assert_close(out.weights_TK.double().sort(-1).values, w.sort(-1).values)
    # a large bias forces expert 3 into every selection but never changes gate values
    r.expert_bias[3] = 100.0
    out2 = r(x)
    assert (out2.expert_ids_TK == 3).any(-1).all()
    sel = out2.expert_ids_TK
    g = s.gather(1, sel)
    torch.testing.assert_close(out2.weights_TK.double(), g / g.sum(-1, keepdim=True) * 2.0)


def test_group_limited_routing(seed):
    r = router(n_group=4, topk_group=1)
    out = r(torch.randn(64, 16, dtype=torch.float64))
    groups = out.expert_ids_TK // 2
    assert (groups[:, 0] == groups[:, 1]).all()


def test_aux_losses_match_formula(seed):
    r = router(aux_loss_coef=0.5, seq_aux_loss_coef=0.25, z_loss_coef=0.1)
    B, S, E, K = 3, 10, 8, 2
    x = torch.randn(B * S, 16, dtype=torch.float64)
    out = r(x, batch_size=B)
    logits = x @ r.weight.T
    s = logits.sigmoid()
    p = s / s.sum(-1, keepdim=True)
    ids = out.expert_ids_TK
    f = torch.stack([(ids == e).sum() for e in range(E)]).double() / (B * S * K)
    torch.testing.assert_close(out.aux["aux_loss"], 0.5 * E * (f * p.mean(0)).sum())
    seq = []
    for b in range(B):
        ib, pb = ids[b * S:(b + 1) * S], p[b * S:(b + 1) * S]
        fb = torch.stack([(ib == e).sum() for e in range(E)]).double() / (S * K)
        seq.append(E * (fb * pb.mean(0)).sum())
    torch.testing.assert_close(out.aux["seq_aux_loss"], 0.25 * torch.stack(seq).mean())
    torch.testing.assert_close(out.aux["z_loss"], 0.1 * torch.logsumexp(logits, -1).pow(2).mean())


def skewed(r, T=64):
    x = torch.randn(T, 16, dtype=torch.float64)
    with torch.no_grad():
        r.weight[0] = x.mean(0) * 4  # expert 0 is popular
        r.weight[1] = x.mean(0) * 3
    return x


@pytest.mark.parametrize("policy", ["probs", "position", "reroute"])
def test_capacity_policies(seed, policy):
    r = router(capacity_factor=1.0, drop_policy=policy)
    x = skewed(r)
    T, K, E = 64, 2, 8
    cap = math.ceil(1.0 * T * K / E)
    free = router()
    free.load_state_dict(r.state_dict())
    base = free(x)
    out = r(x)
    ids, w = out.expert_ids_TK, out.weights_TK
    counts = torch.bincount(ids[ids >= 0], minlength=E)
    assert counts.max() <= cap and int(out.counts_E.sum()) == int((ids >= 0).sum())
    dropped = ids < 0
    assert (w[dropped] == 0).all()
    assert float(out.drop_rate) == pytest.approx(dropped.double().mean().item())
    kept = ~dropped & (ids == base.expert_ids_TK)
    # kept choices keep their original gate value: no renormalisation onto survivors
    torch.testing.assert_close(w[kept], base.weights_TK[kept])
    if policy in ("probs", "position"):
        assert ((ids == base.expert_ids_TK) | dropped).all()
        for e in range(E):
            chosen = base.expert_ids_TK == e
            if chosen.sum() <= cap:
                continue
            t_kept = (ids == e).nonzero()[:, 0]
            t_drop = (chosen & dropped).nonzero()[:, 0]
            if policy == "position":
                assert t_kept.max() < t_drop.min()
            else:
                assert base.weights_TK[ids == e].min() >= base.weights_TK[chosen & dropped].max()
    else:
        probs = router(capacity_factor=1.0, drop_policy="probs")
        probs.load_state_dict(r.state_dict())
        assert float(out.drop_rate) <= float(probs(x).drop_rate)
        # no token uses the same expert twice
        for t in range(T):
            v = ids[t][ids[t] >= 0]
            assert v.unique().numel() == v.numel()


def test_bias_update_sign_and_recentre():
    r = router(bias_update_rate=0.1)
    r.train()
    r.tokens_per_expert.copy_(torch.tensor([10, 0, 5, 5, 5, 5, 5, 5], dtype=torch.float32))
    update_expert_bias(r)
    b = r.expert_bias
    assert b[0] < b[2] < b[1] and abs(float(b.mean())) < 1e-6
    assert float(r.tokens_per_expert.sum()) == 0
    # a router that saw no token keeps its bias as it is (not re-centred either)
    r.expert_bias.copy_(torch.arange(8, dtype=torch.float32))
    update_expert_bias(r)
    assert torch.equal(r.expert_bias, torch.arange(8, dtype=torch.float32))


def test_expert_counts_matches_bincount():
    """expert_counts (no host sync) against bincount of the valid ids, with dropped (-1) choices."""
    from moeadapt.models.router import expert_counts

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    E = 13
    ids = torch.randint(-1, E, (97, 4), generator=g)
    want = torch.bincount(ids[ids >= 0], minlength=E)
    assert torch.equal(expert_counts(ids, E), want)
    assert expert_counts(torch.full((5, 2), -1), E).sum() == 0


@pytest.mark.parametrize("mode", ["fp32", "tf32", "bf16", "bf16x2"])
def test_router_logits_fp32_under_autocast(mode):
    """Under bf16 autocast the router's logits stay fp32 (autocast alone would give bf16), forward and backward
    against float64; bf16 mode within bf16 input rounding; no saved x for a frozen W."""
    from moeadapt.models.router import router_logits

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    x = torch.randn(33, 64, generator=g, requires_grad=True)
    w = torch.randn(12, 64, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.nn.functional.linear(x, w).dtype == torch.bfloat16  # what the router used to get
        out = router_logits(x, w, mode)
    assert out.dtype == torch.float32
    gout = torch.randn(out.shape, generator=g)
    out.backward(gout)
    x64, w64 = x.detach().double(), w.detach().double()
    # CPU has no TF32: tf32 runs as fp32 here, and so does bf16x2 (x is fp32, not exact in bf16)
    tol = 2e-2 if mode == "bf16" else 1e-5
    torch.testing.assert_close(out.double(), x64 @ w64.T, rtol=tol, atol=tol * 8)
    torch.testing.assert_close(x.grad.double(), gout.double() @ w64, rtol=tol, atol=tol * 8)
    # dW reads x as a bf16 copy except in fp32 mode (as autocast's linear saved it): entries ~ N(0, 33)
    tol_w, atol_w = (tol, tol * 8) if mode == "fp32" else (2e-2, 0.1)
    torch.testing.assert_close(w.grad.double(), gout.double().T @ x64, rtol=tol_w, atol=atol_w)
    assert x.grad.dtype == torch.float32 and w.grad.dtype == torch.float32


@pytest.mark.parametrize("w_trains", [True, False])
def test_router_logits_bf16x2(w_trains):
    """bf16x2 on a bf16 x: logits, dx and dW against float64 to the split's 16 mantissa bits (errors ~1e-4 of
    bf16 rounding's); the same GEMMs with W rounded to bf16 alone (the lo term dropped) miss that tolerance, and
    so does the "bf16" mode. Saves nothing activation-sized in fp32; x only when W trains."""
    from moeadapt.models.router import router_logits, split_bf16

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    T, D, E = int(torch.randint(20, 90, (1,), generator=g)), 96, 16
    x = torch.randn(T, D, generator=g).bfloat16().requires_grad_(True)
    w = (torch.randn(E, D, generator=g) * 0.05).requires_grad_(w_trains)
    gout = torch.randn(T, E, generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router_logits(x, w, "bf16x2")
    assert out.dtype == torch.float32 and type(out.grad_fn).__name__ == "_RouterLogitsBF16x2Backward"
    saved = [t for t in out.grad_fn.saved_tensors if t is not None]
    assert all(t.dtype == torch.bfloat16 for t in saved)
    assert any(t is x or t.data_ptr() == x.data_ptr() for t in saved) == w_trains
    out.backward(gout)
    x64, w64, g64 = x.detach().double(), w.detach().double(), gout.double()

    def rel(a, b):
        return float((a.detach().double() - b).norm() / b.norm())

    tol = 3e-5  # the split keeps W and g to 2^-16 (measured ~3e-6); W in bf16 alone gives ~2e-3
    assert rel(out, x64 @ w64.T) < tol
    assert x.grad.dtype == torch.bfloat16 and rel(x.grad, g64 @ w64) < 8e-3  # dx rounded once to bf16 (2^-9)
    if w_trains:
        assert w.grad.dtype == torch.float32 and rel(w.grad, g64.T @ x64) < tol
    else:
        assert w.grad is None
    # the check can fail: W's lo term dropped (W in bf16 alone), or the bf16 mode
    hi, lo = split_bf16(w.detach())
    assert rel(x64 @ hi.double().T, x64 @ w64.T) > 5 * tol
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert rel(router_logits(x.detach(), w.detach(), "bf16"), x64 @ w64.T) > 5 * tol
    # and hi + lo is W to 16 bits
    assert rel(hi.double() + lo.double(), w64) < 2 ** -15


def test_router_scores_fp32_under_autocast():
    r = router().float()
    x = torch.randn(40, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = r(x)
    assert out.weights_TK.dtype == torch.float32
    s = torch.sigmoid(x.double() @ r.weight.double().T)
    w = s.gather(1, out.expert_ids_TK)
    w = w / w.sum(-1, keepdim=True)
    torch.testing.assert_close(out.weights_TK.double(), w, rtol=1e-5, atol=1e-6)


def test_router_logits_frozen_weight_saves_no_input():
    from moeadapt.models.router import router_logits

    x = torch.randn(8, 16, requires_grad=True)
    w = torch.randn(4, 16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router_logits(x, w, "tf32")
    saved = out.grad_fn.saved_tensors
    assert all(t is None or t.shape == w.shape for t in saved)  # W only
    out.sum().backward()
    torch.testing.assert_close(x.grad, w.sum(0).expand(8, 16), rtol=1e-5, atol=1e-5)


def test_router_logits_bf16x2_any_leading_shape():
    """router_logits in bf16x2 mode takes x of any leading shape, as the other modes do: the same logits and
    gradients as the flattened call."""
    from moeadapt.models.router import router_logits

    x = torch.randn(2, 7, 32).bfloat16()
    w = torch.randn(6, 32) * 0.1
    g = torch.randn(2, 7, 6)
    outs = []
    for xx in (x.clone().requires_grad_(), x.reshape(14, 32).clone().requires_grad_()):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = router_logits(xx, w, "bf16x2")
        out.backward(g.reshape(out.shape))
        outs.append((out.reshape(14, 6), xx.grad.reshape(14, 32)))
    for a, b in zip(*outs):
        assert torch.equal(a, b)


def test_router_logits_bf16x2_falls_back_without_fp32_output_mm(monkeypatch):
    """Where torch.mm has no fp32 output for bf16 inputs (torch < 2.8, MM_FP32_OUT False) bf16x2 runs as tf32:
    the same fp32 logits, through the TF32 path's node."""
    from moeadapt.models import router

    x = torch.randn(9, 32).bfloat16()
    w = torch.randn(5, 32, requires_grad=True)
    monkeypatch.setattr(router, "MM_FP32_OUT", False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = router.router_logits(x, w, "bf16x2")
    assert type(out.grad_fn).__name__ == "_RouterLogitsBackward" and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), x.double() @ w.detach().double().T, rtol=1e-5, atol=1e-5)
