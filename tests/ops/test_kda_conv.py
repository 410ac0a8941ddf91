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


@needs_triton
def test_dx_only_op_registration(seed):
    """The frozen-weight backward's op passes the same checks, alone and as the forward op's backward."""
    from moeadapt.ops.kda.triton_conv import conv_silu_bwd_dx, conv_silu_fwd

    x = torch.randn(2, 9, 16, device=DEV, requires_grad=True)
    w = torch.randn(16, 1, 4, device=DEV)
    positions = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 0]] * 2, dtype=torch.int32, device=DEV)
    torch.library.opcheck(conv_silu_fwd, (x, w, positions))
    torch.library.opcheck(conv_silu_bwd_dx, (x.detach(), w, torch.randn(2, 9, 16, device=DEV), positions))


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


# ------------------------------------------------------------------ the backward without a weight gradient


def _starts_positions(T: int, starts: list[int]) -> torch.Tensor:
    """positions [T] of documents starting at `starts` (0 among them)."""
    t = torch.arange(T)
    first = torch.zeros(T, dtype=torch.bool)
    first[starts] = True
    return t - torch.where(first, t, 0).cummax(0).values


def _dx_reference(x64, w64, dy64, pos=None):
    """dx of the float64 reference with the weight a constant."""
    xr = x64.clone().requires_grad_()
    causal_conv_silu_reference(xr, w64, pos).backward(dy64)
    return xr.grad


@needs_triton
@pytest.mark.parametrize("impl", ["fused", "two_pass"])
@pytest.mark.parametrize("KW,docs", [(4, False), (4, True), (3, True), (5, True)])
def test_dx_only_matches_reference(seed, impl, KW, docs, B=2, T=70, C=80):
    """conv_silu_dx_launch against the float64 reference: T = 70 and C = 80 are not multiples of the fused tile
    (32 x 64) nor of the two-pass one (32 x 128). With documents: row 0 has starts at t = 0, inside a time block
    (5, 6: a one-token document), just before and after a block boundary (30, 33), at one (64) and two steps
    later (66); row 1 random ones. KW 5: "fused" takes the two-pass form (the fused kernel holds 4 taps)."""
    from moeadapt.ops.kda.triton_conv import conv_silu_dx_launch

    g = torch.Generator().manual_seed(seed)
    x64, dy64 = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, T, C, dtype=torch.float64)
    w64 = torch.randn(C, 1, KW, dtype=torch.float64) * 0.5
    pos = None
    if docs:
        pos = torch.stack([_starts_positions(T, [0, 5, 6, 30, 33, 64, 66]), _doc_positions(1, T, g)[0]])
        pos = pos.to(DEV, torch.int32).contiguous()
    dx = conv_silu_dx_launch(x64.float().to(DEV), w64.float().to(DEV), dy64.float().to(DEV), pos, impl)
    ref = _dx_reference(x64, w64, dy64, None if pos is None else pos.cpu())
    assert dx.dtype == torch.float32 and dx.shape == (B, T, C)
    assert _rel(dx, ref) < 1e-5
    if docs:  # the documents changed dx
        assert _rel(dx, _dx_reference(x64, w64, dy64)) > 1e-3


@needs_triton
@pytest.mark.parametrize("docs", [False, True])
def test_dx_only_is_not_within_tolerance_of_a_dropped_tap(seed, docs, B=1, T=45, C=24, KW=4):
    """The 1e-5 tolerance above tells the taps apart: the kernel's dx is within it of the reference and far from
    each reference with one tap of the weight zeroed (what dropping one x shift from pre and the matching dy shift
    from the transposed conv gives), for both dx-only forms."""
    from moeadapt.ops.kda.triton_conv import conv_silu_dx_launch

    x64, dy64 = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, T, C, dtype=torch.float64)
    w64 = torch.randn(C, 1, KW, dtype=torch.float64) * 0.5
    pos = _starts_positions(T, [0, 2, 20]).unsqueeze(0).to(torch.int32) if docs else None
    for impl in ("fused", "two_pass"):
        dx = conv_silu_dx_launch(x64.float().to(DEV), w64.float().to(DEV), dy64.float().to(DEV),
                                 None if pos is None else pos.to(DEV), impl)
        assert _rel(dx, _dx_reference(x64, w64, dy64, pos)) < 1e-5
        for k in range(KW):
            dropped = w64.clone()
            dropped[..., k] = 0
            assert _rel(dx, _dx_reference(x64, dropped, dy64, pos)) > 1e-2, (impl, k)


@needs_triton
@pytest.mark.parametrize("docs", [False, True])
def test_frozen_weight_backward_takes_dx_only(seed, monkeypatch, docs, B=2, T=37, C=48):
    """Through the autograd path with x requiring a gradient and w frozen: the backward runs the dx-only op, not
    the full backward, and its dx equals the full backward's (w requiring a gradient) on the same inputs."""
    from moeadapt.ops.kda import triton_conv

    g = torch.Generator().manual_seed(seed)
    x0, dy = torch.randn(B, T, C, device=DEV), torch.randn(B, T, C, device=DEV)
    w0 = torch.randn(C, 1, 4, device=DEV) * 0.5
    pos = _doc_positions(B, T, g).to(DEV) if docs else None
    x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
    causal_conv_silu(x, w, backend="triton", positions=pos).backward(dy)
    calls = []
    for name in ("conv_silu_bwd_fast", "conv_silu_bwd_dx_fast"):
        real = getattr(triton_conv, name)
        monkeypatch.setattr(triton_conv, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    xf = x0.clone().requires_grad_()
    causal_conv_silu(xf, w0, backend="triton", positions=pos).backward(dy)
    assert calls == ["conv_silu_bwd_dx_fast"]
    assert _rel(xf.grad, x.grad) < 1e-6


@needs_triton
def test_bf16_dpre_option(seed, B=2, T=45, C=72):
    """The full backward with dpre stored in bf16 (dpre_dtype): dx within bf16 accuracy of the float64 reference
    (rel 1e-2: bf16 inputs and dx, one more rounding of dpre); dw is taken from the fp32 dpre, so it equals the
    default's. Both dx-only forms with a bf16 dpre likewise."""
    from moeadapt.ops.kda.triton_conv import conv_silu_bwd_launch, conv_silu_dx_launch

    x = torch.randn(B, T, C, device=DEV).bfloat16()
    w = torch.randn(C, 1, 4, device=DEV) * 0.5
    dy = torch.randn(B, T, C, device=DEV).bfloat16()
    xr, wr = x.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    causal_conv_silu_reference(xr, wr).backward(dy.double().cpu())
    dx, dw = conv_silu_bwd_launch(x, w, dy, dpre_dtype=torch.bfloat16)
    dx32, dw32 = conv_silu_bwd_launch(x, w, dy)
    assert dx.dtype == torch.bfloat16 and dw.dtype == torch.float32
    assert _rel(dx, xr.grad) < 1e-2 and _rel(dw, wr.grad) < 1e-5
    torch.testing.assert_close(dw, dw32, rtol=1e-6, atol=1e-6)
    assert _rel(dx, dx32) < 1e-2
    for impl in ("fused", "two_pass"):
        assert _rel(conv_silu_dx_launch(x, w, dy, None, impl, dpre_dtype=torch.bfloat16), xr.grad) < 1e-2


# ------------------------------------------------------------------ the L2 norm per head (norm_dim: KDA's q and k)


@needs_triton
@pytest.mark.parametrize("frozen_w", [False, True])
@pytest.mark.parametrize("B,T,C,nd,docs", [(2, 37, 48, 16, False), (1, 70, 64, 32, True), (2, 45, 32, 8, True)])
def test_norm_matches_reference_fwd_bwd(seed, frozen_w, B, T, C, nd, docs):
    """causal_conv_silu(norm_dim=nd) by the Triton passes (the norm inside the forward's tile and the backward's
    first pass) against the float64 reference, conv + SiLU + `reference.l2norm` per head: output, dx and (w not
    frozen) dw; with frozen_w the dx-only op runs. Each output head has unit norm."""
    g = torch.Generator().manual_seed(seed)
    x64, dy64 = torch.randn(B, T, C, dtype=torch.float64), torch.randn(B, T, C, dtype=torch.float64)
    w64 = torch.randn(C, 1, 4, dtype=torch.float64) * 0.5
    pos = _doc_positions(B, T, g) if docs else None
    xr, wr = x64.clone().requires_grad_(), w64.clone().requires_grad_()
    yr = causal_conv_silu_reference(xr, wr, pos, norm_dim=nd)
    yr.backward(dy64)
    x = x64.float().to(DEV).requires_grad_()
    w = w64.float().to(DEV).requires_grad_(not frozen_w)
    y = causal_conv_silu(x, w, backend="triton", positions=None if pos is None else pos.to(DEV), norm_dim=nd)
    y.backward(dy64.float().to(DEV))
    assert y.shape == (B, T, C)
    torch.testing.assert_close(y.detach().double().cpu().unflatten(-1, (-1, nd)).norm(dim=-1),
                               torch.ones(B, T, C // nd, dtype=torch.float64), rtol=1e-4, atol=1e-4)
    assert _rel(y, yr) < 1e-5 and _rel(x.grad, xr.grad) < 1e-5
    if not frozen_w:
        assert _rel(w.grad, wr.grad) < 1e-5
    # the tolerance tells the norm's group apart, and the norm's backward from the plain conv's
    assert _rel(y, causal_conv_silu_reference(x64, w64, pos, norm_dim=nd // 2)) > 1e-2
    xp = x64.clone().requires_grad_()
    causal_conv_silu_reference(xp, w64, pos).backward(dy64)
    assert _rel(x.grad, xp.grad) > 1e-2


@needs_triton
def test_norm_launch_forms_agree(seed, B=2, T=45, C=64, nd=16):
    """Every backward form with the norm (the full backward, dx-only two-pass, and "fused", which takes the
    two-pass form with a norm) gives the reference's dx; bf16 inputs within bf16 accuracy."""
    from moeadapt.ops.kda.triton_conv import conv_silu_bwd_launch, conv_silu_dx_launch

    x = torch.randn(B, T, C, device=DEV).bfloat16()
    w = torch.randn(C, 1, 4, device=DEV) * 0.5
    dy = torch.randn(B, T, C, device=DEV).bfloat16()
    xr, wr = x.double().cpu().requires_grad_(), w.double().cpu().requires_grad_()
    causal_conv_silu_reference(xr, wr, norm_dim=nd).backward(dy.double().cpu())
    dx, dw = conv_silu_bwd_launch(x, w, dy, norm_dim=nd)
    assert _rel(dx, xr.grad) < 1e-2 and _rel(dw, wr.grad) < 1e-2
    for impl in ("fused", "two_pass"):
        assert _rel(conv_silu_dx_launch(x, w, dy, None, impl, norm_dim=nd), xr.grad) < 1e-2


def test_norm_dim_errors():
    with pytest.raises(ValueError, match="norm_dim=6 must be 0"):
        causal_conv_silu(torch.randn(1, 5, 16), torch.randn(16, 1, 4), norm_dim=6)
    from moeadapt.ops.kda.triton_conv import check_norm_dim

    with pytest.raises(ValueError, match="power of two"):
        check_norm_dim(48, 24)
    check_norm_dim(48, 16)


@needs_triton
def test_norm_op_registration(seed):
    from moeadapt.ops.kda.triton_conv import conv_silu_bwd, conv_silu_bwd_dx, conv_silu_fwd

    x = torch.randn(2, 9, 16, device=DEV, requires_grad=True)
    w = torch.randn(16, 1, 4, device=DEV, requires_grad=True)
    dy = torch.randn(2, 9, 16, device=DEV)
    torch.library.opcheck(conv_silu_fwd, (x, w, None, 8))
    torch.library.opcheck(conv_silu_bwd, (x.detach(), w.detach(), dy, None, 8))
    torch.library.opcheck(conv_silu_bwd_dx, (x.detach(), w.detach(), dy, None, 8))


@needs_triton
@pytest.mark.parametrize("docs", [False, True])
def test_kda_layer_with_the_norm_in_its_convs(seed, docs):
    """The KDA layer with its convs on the Triton backend (q's and k's L2 norm inside their passes, chunk_kda told
    not to normalise) against the same layer in float64 with the reference convs (the norm inside chunk_kda): the
    output and every gradient. With the reference convs the layer keeps the norm inside chunk_kda."""
    import copy

    from moeadapt.models.documents import Documents
    from moeadapt.models.kda_attn import KDAAttention
    from tests.conftest import micro_spec

    spec = micro_spec(kda_head_dim=16)
    layer = KDAAttention(spec)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    layer.reset_parameters()
    ref = copy.deepcopy(layer).double()
    for conv in (layer.q_conv, layer.k_conv, layer.v_conv):
        conv.backend = "triton"
    layer.backend = "reference"
    assert layer.q_conv.fuses_norm(torch.empty(1, 1, 32, device=DEV), 16)
    assert not ref.q_conv.fuses_norm(torch.empty(1, 1, 32, dtype=torch.float64), 16)
    layer = layer.to(DEV)
    B, T = 2, 21
    pos = _doc_positions(B, T, torch.Generator().manual_seed(seed)) if docs else None
    x64 = torch.randn(B, T, spec.hidden_size, dtype=torch.float64)
    dy64 = torch.randn(B, T, spec.hidden_size, dtype=torch.float64)
    x = x64.float().to(DEV).requires_grad_()
    y, _ = layer(x, docs=None if pos is None else Documents.from_position_ids(pos, T, device=DEV))
    y.backward(dy64.float().to(DEV))
    xr = x64.clone().requires_grad_()
    yr, _ = ref(xr, docs=None if pos is None else Documents.from_position_ids(pos, T))
    yr.backward(dy64)
    assert _rel(y, yr) < 1e-4 and _rel(x.grad, xr.grad) < 1e-4
    for (n, p), pr in zip(layer.named_parameters(), ref.parameters()):
        assert _rel(p.grad, pr.grad) < 1e-4, n
