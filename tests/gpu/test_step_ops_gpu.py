"""GPU tests for the step-level ops: the fused short conv + SiLU (ops/kda/triton_conv.py) compiled, the chunked
linear + cross-entropy (ops/loss) under autocast, and the model's loss/gradients with both on vs both off."""

import os

import pytest
import torch

from moeadapt.ops.kda.short_conv import causal_conv_silu, causal_conv_silu_reference
from moeadapt.ops.loss import linear_cross_entropy

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0"),
]


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm())


@pytest.mark.parametrize("B,T,C", [(2, 1000, 2048), (1, 4099, 384)])
def test_conv_compiled_matches_reference(seed, B, T, C):
    x = torch.randn(B, T, C, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(C, 1, 4, device="cuda") * 0.5).requires_grad_()
    dy = torch.randn(B, T, C, device="cuda").bfloat16()
    y = causal_conv_silu(x, w, backend="triton")
    y.backward(dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    yr = causal_conv_silu_reference(xr, wr)
    yr.backward(dy.double())
    assert _rel(y, yr) < 1e-2 and _rel(x.grad, xr.grad) < 1e-2 and _rel(w.grad, wr.grad) < 1e-2


@pytest.mark.parametrize("impl", ["fused", "two_pass"])
@pytest.mark.parametrize("B,T,C", [(2, 1000, 2048), (1, 4099, 384)])
def test_conv_dx_only_matches_reference(seed, impl, B, T, C):
    """The frozen-weight backward's two forms (compiled, bf16) against the float64 reference, with and without
    packed documents (starts every 37 tokens, so inside the time blocks)."""
    from moeadapt.ops.kda.triton_conv import conv_silu_dx_launch

    x = torch.randn(B, T, C, device="cuda").bfloat16()
    w = torch.randn(C, 1, 4, device="cuda") * 0.5
    dy = torch.randn(B, T, C, device="cuda").bfloat16()
    docs = (torch.arange(T, device="cuda") % 37).expand(B, T).to(torch.int32).contiguous()
    for pos in (None, docs):
        xr = x.detach().double().requires_grad_()
        causal_conv_silu_reference(xr, w.double(), pos).backward(dy.double())
        assert _rel(conv_silu_dx_launch(x, w, dy, pos, impl), xr.grad) < 1e-2


@pytest.mark.parametrize("frozen_w", [False, True])
@pytest.mark.parametrize("B,T,C,nd", [(2, 1000, 2048, 128), (1, 4099, 384, 64)])
def test_conv_with_head_norm_matches_reference(seed, frozen_w, B, T, C, nd):
    """The conv with KDA's per-head L2 norm inside its passes (norm_dim; bf16, compiled) against the float64
    reference (conv, SiLU, l2norm), with and without packed documents: y, dx and (w trained) dw."""
    x0 = torch.randn(B, T, C, device="cuda").bfloat16()
    w0 = torch.randn(C, 1, 4, device="cuda") * 0.5
    dy = torch.randn(B, T, C, device="cuda").bfloat16()
    docs = (torch.arange(T, device="cuda") % 37).expand(B, T).to(torch.int32).contiguous()
    for pos in (None, docs):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_(not frozen_w)
        y = causal_conv_silu(x, w, backend="triton", positions=pos, norm_dim=nd)
        y.backward(dy)
        xr, wr = x0.double().requires_grad_(), w0.double().requires_grad_()
        yr = causal_conv_silu_reference(xr, wr, pos, norm_dim=nd)
        yr.backward(dy.double())
        assert _rel(y, yr) < 1e-2 and _rel(x.grad, xr.grad) < 1e-2
        assert frozen_w or _rel(w.grad, wr.grad) < 1e-2


def test_chunked_loss_matches_reference_under_autocast(seed):
    N, D, V = 3000, 256, 5000
    h = torch.randn(N, D, device="cuda", requires_grad=True)
    w = (torch.randn(V, D, device="cuda") * 0.05).requires_grad_()
    lab = torch.randint(0, V, (N,), device="cuda")
    lab[::5] = -100
    wt = torch.rand(N, device="cuda")
    grads = {}
    for be in ("chunked", "reference"):
        h.grad = w.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy(h, w, lab, wt, backend=be)
        loss.backward()
        grads[be] = (loss.detach(), h.grad.clone(), w.grad.clone())
    (lc, hc, wc), (lr, hr, wr) = grads["chunked"], grads["reference"]
    assert abs(float(lc - lr)) < 1e-3 * abs(float(lr))
    assert _rel(hc, hr) < 2e-2 and _rel(wc, wr) < 2e-2


def test_model_levers_keep_loss_and_grads(seed):
    """Conv kernel, chunked loss, bf16 norm outputs and the compiled norm on vs off (every other kernel on its
    default both times), bf16 autocast: the loss agrees to bf16 rounding and the gradients, router weights left
    out (bf16 rounding flips some tokens' discrete top-k expert choice: tests/gpu/test_model_gpu.py), to within
    a few times the baseline's own run-to-run spread (the DSA / MoE backward kernels accumulate with atomics)."""
    from moeadapt.config import get_preset
    from moeadapt.models.common import CausalConv1d, RMSNorm
    from moeadapt.models.model import build_model, materialize

    spec = get_preset("small", n_layers=4, index_topk=256)
    model = materialize(build_model(spec, "meta"), "cuda", seed=seed % 1000)
    x = torch.randint(0, spec.vocab_size, (1, 1025), device="cuda")

    def run(on):
        model.set_backend("auto")
        model.backend = "auto" if on else "reference"
        for m in model.modules():
            if isinstance(m, RMSNorm):
                m.autocast_output = m.compiled = on
            if isinstance(m, CausalConv1d):
                m.backend = "auto" if on else "reference"
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x[:, :-1], x[:, 1:], return_logits=False)
        out.loss.backward()
        return float(out.loss), torch.cat([p.grad.float().flatten() for n, p in model.named_parameters()
                                           if p.grad is not None and ".router." not in n])

    (l0, g0), (_, g1), (l2, g2) = run(False), run(False), run(True)
    floor = _rel(g1, g0)
    print(f"loss {l0:.5f} / {l2:.5f}, rel grad floor {floor:.2e}, levers {_rel(g2, g0):.2e}")
    assert abs(l0 - l2) < 1e-2 * abs(l0)
    assert _rel(g2, g0) < max(5 * floor, 5e-2)


@pytest.mark.parametrize("branches", [1, 2])
def test_add_rms_norm_compiled_matches_eager_under_autocast(seed, branches):
    """RMSNorm.after_add on CUDA (torch.compile: the residual add of one or two branch outputs, the norm and their
    backward fused) against the same math as eager torch ops: the fp32 sum, the bf16 normed output and every
    gradient."""
    from moeadapt.models.common import RMSNorm

    norm = RMSNorm(2048).cuda()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 1000, 2048, device="cuda") * 3
    parts = [torch.randn(2, 1000, 2048, device="cuda").bfloat16() for _ in range(branches)]
    ds, dy = torch.randn_like(x), torch.randn_like(x)
    outs = []
    for compiled in (True, False):
        norm.compiled = compiled
        norm.weight.grad = None
        xx, pp = x.clone().requires_grad_(), [a.clone().requires_grad_() for a in parts]
        with torch.autocast("cuda", dtype=torch.bfloat16):
            s, y = norm.after_add(xx, *pp)
        ((s * ds).sum() + (y.float() * dy).sum()).backward()
        outs.append([s, y, xx.grad, *(a.grad for a in pp), norm.weight.grad])
    for g, w in zip(*outs):
        assert g.dtype == w.dtype and _rel(g, w) < 1e-2


@pytest.mark.parametrize("mode", ["bf16x2", "tf32"])
def test_router_logits_cuda(seed, mode):
    """The router's logits and gradients on CUDA under bf16 autocast (bf16x2: cuBLAS's fp32-out bf16 GEMMs; tf32)
    against float64: bf16x2 to its 16 split bits, closer than TF32's 10; W in bf16 alone misses bf16x2's bound."""
    from moeadapt.models.router import router_logits

    T, D, E = 8192, 2048, 64
    x = torch.randn(T, D, device="cuda").bfloat16().requires_grad_()
    w = (torch.randn(E, D, device="cuda") * 0.02).requires_grad_()
    g = torch.randn(T, E, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = router_logits(x, w, mode)
    out.backward(g)
    x64, w64, g64 = x.detach().double(), w.detach().double(), g.double()
    want = x64 @ w64.T
    tol = 3e-5 if mode == "bf16x2" else 2e-3
    assert out.dtype == torch.float32 and _rel(out, want) < tol
    assert x.grad.dtype == torch.bfloat16 and _rel(x.grad, g64 @ w64) < 8e-3
    assert w.grad.dtype == torch.float32 and _rel(w.grad, g64.T @ x64) < tol
    if mode == "bf16x2":
        assert _rel(x64 @ w64.bfloat16().double().T, want) > 5 * tol
