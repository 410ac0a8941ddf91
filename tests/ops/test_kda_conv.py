"""moeadapt.ops.kda.causal_conv_silu (the KDA layer's short conv + SiLU) against a float64 reference.

The Triton backend runs on CPU only under TRITON_INTERPRET=1 (tests/conftest.py sets it without CUDA).
Fresh random inputs per test (seed printed by the `seed` fixture); odd lengths (T < KW, T not a multiple of
the time block), channel counts not a multiple of the channel block, strided inputs and expanded cotangents.
"""

from __future__ import annotations

import os

import pytest
import torch

from moeadapt.ops.kda.short_conv import causal_conv_silu, causal_conv_silu_reference

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
needs_triton = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1")
DEV = "cuda" if torch.cuda.is_available() and not INTERPRET else "cpu"  # where the Triton backend's inputs live


def _loop_reference(x, w):
    """The definition, one time step at a time, float64."""
    B, T, C = x.shape
    KW = w.shape[-1]
    y = torch.zeros(B, T, C, dtype=torch.float64)
    for t in range(T):
        for i in range(KW):
            s = t - (KW - 1) + i
            if s >= 0:
                y[:, t] += w[:, 0, i].double() * x[:, s].double()
    return torch.nn.functional.silu(y)


def _rel(a, b):
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def test_reference_is_the_definition(seed):
    x, w = torch.randn(2, 9, 5, dtype=torch.float64), torch.randn(5, 1, 4, dtype=torch.float64)
    assert _rel(causal_conv_silu_reference(x, w), _loop_reference(x, w)) < 1e-12


@needs_triton
@pytest.mark.parametrize("B,T,C,KW", [(2, 37, 48, 4), (1, 3, 200, 4), (2, 70, 130, 3), (1, 300, 40, 4), (2, 45, 24, 5)])
def test_triton_matches_reference_fwd_bwd(seed, B, T, C, KW):
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    x64 = torch.randn(B, T, C, dtype=torch.float64)
    w64 = torch.randn(C, 1, KW, dtype=torch.float64) * 0.5
    dy64 = torch.randn(B, T, C, dtype=torch.float64)
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    yr = causal_conv_silu_reference(xr, wr)
    yr.backward(dy64)
    x = x64.float().to(dev).requires_grad_()
    w = w64.float().to(dev).requires_grad_()
    y = causal_conv_silu(x, w, backend="triton")
    y.backward(dy64.float().to(dev))
    assert y.dtype == torch.float32 and y.shape == (B, T, C)
    assert _rel(y.cpu(), yr) < 1e-5
    assert _rel(x.grad.cpu(), xr.grad) < 1e-5
    assert _rel(w.grad.cpu(), wr.grad) < 1e-5


@needs_triton
def test_triton_strided_input_and_expanded_cotangents(seed):
    """x a channel slice of a wider projection (row stride != C); dy broadcast over batch and time (stride 0)
    and over channels (channel stride 0): each must give the reference's gradients."""
    B, T, C, KW = 2, 21, 40, 4
    base = torch.randn(B, T, 3 * C, dtype=torch.float64)
    w64 = torch.randn(C, 1, KW, dtype=torch.float64)
    for small in (torch.randn(1, 1, C, dtype=torch.float64), torch.randn(B, T, 1, dtype=torch.float64)):
        dy = small.expand(B, T, C)
        xr, wr = base[..., C:2 * C].clone().requires_grad_(), w64.clone().requires_grad_()
        causal_conv_silu_reference(xr, wr).backward(dy)
        wide = base.float().to(DEV).requires_grad_()
        w = w64.float().to(DEV).requires_grad_()
        x = wide[..., C:2 * C]
        assert x.stride(1) == 3 * C
        y = causal_conv_silu(x, w, backend="triton")
        assert _rel(y.detach(), causal_conv_silu_reference(xr.detach(), wr.detach())) < 1e-5
        y.backward(small.float().to(DEV).expand(B, T, C))
        assert _rel(wide.grad[..., C:2 * C], xr.grad) < 1e-5
        assert float(wide.grad[..., :C].abs().max()) == 0.0
        assert _rel(w.grad, wr.grad) < 1e-5


@needs_triton
def test_triton_bf16_storage(seed):
    B, T, C, KW = 2, 33, 64, 4
    x = torch.randn(B, T, C, device=DEV).bfloat16().requires_grad_()
    w = (torch.randn(C, 1, KW, device=DEV) * 0.5).requires_grad_()  # fp32 parameter, bf16 activations (autocast)
    dy = torch.randn(B, T, C, device=DEV).bfloat16()
    y = causal_conv_silu(x, w, backend="triton")
    y.backward(dy)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    causal_conv_silu_reference(xr, wr).backward(dy.double())
    assert y.dtype == torch.bfloat16 and x.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.float32
    assert _rel(y, causal_conv_silu_reference(xr, wr)) < 1e-2
    assert _rel(x.grad, xr.grad) < 1e-2
    assert _rel(w.grad, wr.grad) < 1e-2


@needs_triton
def test_custom_op_registration(seed):
    """The op passes torch.library's checks (schema, fake tensor, autograd registration): what torch.compile
    and selective activation checkpointing rely on."""
    from moeadapt.ops.kda.triton_conv import conv_silu_fwd

    x = torch.randn(2, 9, 16, device=DEV, requires_grad=True)
    w = torch.randn(16, 1, 4, device=DEV, requires_grad=True)
    torch.library.opcheck(conv_silu_fwd, (x, w))


def test_bad_shapes_raise_one_message():
    with pytest.raises(ValueError, match=r"x \[B, T, C\] and w \[C, 1, KW\]"):
        causal_conv_silu(torch.randn(2, 5, 8), torch.randn(6, 1, 4))
    with pytest.raises(ValueError, match="backend must be one of"):
        causal_conv_silu(torch.randn(2, 5, 8), torch.randn(8, 1, 4), backend="cuda")


@needs_triton
def test_selective_checkpoint_sees_the_op(seed):
    """Under selective activation checkpointing the policy is asked about moeadapt::causal_conv_silu_fwd itself
    (one op, recomputed), and the gradients equal the un-checkpointed ones."""
    from torch.utils.checkpoint import checkpoint, create_selective_checkpoint_contexts

    from moeadapt.parallel.activation import _selective_policy

    seen = []

    def policy(ctx, op, *a, **k):
        seen.append(op)
        return _selective_policy(ctx, op, *a, **k)

    x = torch.randn(2, 13, 24, device=DEV, requires_grad=True)
    w = torch.randn(24, 1, 4, device=DEV, requires_grad=True)
    proj = torch.randn(24, 24, device=DEV, requires_grad=True)

    def f(x, w, proj):
        return causal_conv_silu(x @ proj, w, backend="triton").square().sum()

    f(x, w, proj).backward()
    ref = [t.grad.clone() for t in (x, w, proj)]
    for t in (x, w, proj):
        t.grad = None
    checkpoint(f, x, w, proj, use_reentrant=False,
               context_fn=lambda: create_selective_checkpoint_contexts(policy)).backward()
    assert torch.ops.moeadapt.causal_conv_silu_fwd.default in seen
    for t, r in zip((x, w, proj), ref):
        assert _rel(t.grad, r) < 1e-6


def _doc_positions(B: int, T: int, g: torch.Generator) -> torch.Tensor:
    """position_ids [B, T] of random packed documents (one-token ones included)."""
    starts = torch.rand(B, T, generator=g) < 0.25
    starts[:, 0] = True
    t = torch.arange(T).expand(B, T)
    return t - torch.where(starts, t, 0).cummax(1).values


def test_positions_reference_is_each_document_alone(seed):
    g = torch.Generator().manual_seed(seed)
    x, w = torch.randn(2, 23, 5, dtype=torch.float64), torch.randn(5, 1, 4, dtype=torch.float64)
    pos = _doc_positions(2, 23, g)
    y = causal_conv_silu_reference(x, w, pos)
    for b in range(2):
        starts = (pos[b] == 0).nonzero()[:, 0].tolist() + [23]
        for s, e in zip(starts, starts[1:]):
            assert _rel(y[b:b + 1, s:e], _loop_reference(x[b:b + 1, s:e], w)) < 1e-12
    with pytest.raises(ValueError, match="positions must be an integer tensor"):
        causal_conv_silu(x, w, positions=pos.double())


@needs_triton
@pytest.mark.parametrize("T,KW", [(37, 4), (150, 4), (41, 5)])
def test_triton_positions_match_reference_fwd_bwd(seed, T, KW, B=2, C=48):
    """Packed documents: the fused kernels' document reset equals the reference's, values and gradients."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(seed)
    x64, dy64 = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, T, C, dtype=torch.float64)
    w64 = torch.randn(C, 1, KW, dtype=torch.float64) * 0.5
    pos = _doc_positions(B, T, g)
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    causal_conv_silu_reference(xr, wr, pos).backward(dy64)
    x, w = x64.float().to(dev).requires_grad_(), w64.float().to(dev).requires_grad_()
    y = causal_conv_silu(x, w, backend="triton", positions=pos.to(dev))
    y.backward(dy64.float().to(dev))
    assert _rel(y.cpu(), causal_conv_silu_reference(x64, w64, pos)) < 1e-5
    assert _rel(x.grad.cpu(), xr.grad) < 1e-5 and _rel(w.grad.cpu(), wr.grad) < 1e-5
    assert _rel(y.cpu(), causal_conv_silu_reference(x64, w64)) > 1e-3  # the reset changed the output
