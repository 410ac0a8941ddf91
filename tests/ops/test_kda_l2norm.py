"""The fused L2 norm of KDA's q and k (ops/kda/triton_l2norm.py) against float64 `reference.l2norm`, forward and
backward, on fresh random shapes; and as the custom op torch.library checks (opcheck) and the eager fast path."""

import random

import pytest
import torch

from moeadapt.ops.kda import triton_l2norm as tl2
from moeadapt.ops.kda.reference import L2_EPS, l2norm

pytestmark = pytest.mark.skipif(not (torch.cuda.is_available() or __import__("os").environ.get("TRITON_INTERPRET")
                                     == "1"), reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _ref(x):
    x64 = x.detach().double().requires_grad_(True)
    return x64, l2norm(x64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_l2norm_qk_matches_float64(seed, dtype):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    B, T, H = rng.randint(1, 2), rng.randint(1, 70), rng.randint(1, 4)
    D = rng.choice([16, 48, 64, 128])
    Hk = rng.choice([H, 1])  # k may have fewer heads than q (the kernel takes each tensor's own rows)
    # rows of very different norms, one all-zero row: the eps keeps it finite
    q = (torch.randn(B, T, H, D, device=DEV) * torch.rand(B, T, H, 1, device=DEV) * 10).to(dtype)
    k = (torch.randn(B, T, Hk, D, device=DEV) * 3).to(dtype)
    q[0, 0, 0] = 0
    q.requires_grad_(True)
    k.requires_grad_(True)
    qn, kn = tl2.l2norm_qk(q, k)
    assert qn.dtype == dtype and kn.dtype == dtype and qn.shape == q.shape and kn.shape == k.shape
    q64, qr = _ref(q)
    k64, kr = _ref(k)
    out_tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: one rounding of values <= 1
    assert (qn.double() - qr).abs().max() < out_tol
    assert (kn.double() - kr).abs().max() < out_tol
    dqn, dkn = torch.randn_like(qn), torch.randn_like(kn)
    dq, dk = torch.autograd.grad((qn, kn), (q, k), (dqn, dkn))
    dq_r, dk_r = torch.autograd.grad((qr, kr), (q64, k64), (dqn.double(), dkn.double()))
    g_tol = 1e-5 if dtype == torch.float32 else 2e-2
    for got, ref in ((dq, dq_r), (dk, dk_r)):
        assert got.dtype == dtype
        err = (got.double() - ref).norm() / ref.norm()
        assert err < g_tol, err


def test_l2norm_qk_backward_fails_without_the_projection_term(seed, monkeypatch):
    """The check above can fail: a backward that drops the y sum(dy y) term (dx = r dy) is caught."""
    torch.manual_seed(seed)
    q = torch.randn(1, 9, 2, 32, device=DEV, requires_grad=True)
    k = torch.randn(1, 9, 2, 32, device=DEV, requires_grad=True)

    def wrong(q, k, rq, rk, dqn, dkn):
        return dqn * rq[..., None], dkn * rk[..., None]

    monkeypatch.setattr(tl2, "l2norm_qk_bwd_fast", wrong)
    qn, _ = tl2.l2norm_qk(q, k)
    dqn = torch.randn_like(qn)
    (dq,) = torch.autograd.grad(qn, q, dqn)
    q64, qr = _ref(q)
    (dq_r,) = torch.autograd.grad(qr, q64, dqn.double())
    assert (dq.double() - dq_r).norm() / dq_r.norm() > 0.1


def test_l2norm_qk_custom_op_checks_and_eager_path(seed):
    torch.manual_seed(seed)
    q = torch.randn(2, 5, 3, 16, device=DEV, requires_grad=True)
    k = torch.randn(2, 5, 3, 16, device=DEV, requires_grad=True)
    torch.library.opcheck(tl2.l2norm_qk_fwd, (q, k, L2_EPS))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        qn, kn = tl2.l2norm_qk(q, k)
        (qn.sum() + kn.square().sum()).backward()
    assert not {e.name for e in prof.events() if e.name.startswith("moeadapt::")}  # eager: no op dispatch
    assert qn.grad_fn.name().startswith("Eager_l2norm_qk")
    with pytest.raises(ValueError, match="share the last dim"):
        tl2.l2norm_qk(q, k[..., :8])
