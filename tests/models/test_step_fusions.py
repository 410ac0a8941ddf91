"""Fusions of the step's glue against what they replace and float64: several linear layers of one input as one
autograd node (models.shared_input: one dx buffer, the LoRA adapters' products batched) and the residual add
fused with the norm after it (models.common.add_rms_norm)."""

import pytest
import torch
from torch import nn

from moeadapt.lora.layers import LoRALinear
from moeadapt.models.common import SwiGLU, rope_cos_sin
from moeadapt.models.dsa_attn import DSAAttention
from moeadapt.models.kda_attn import KDAAttention
from moeadapt.models.model import build_model, materialize
from moeadapt.models.moe import LatentMoE
from moeadapt.models.shared_input import linear_lowrank, lowrank, shared_input_linears
from tests.conftest import micro_spec


def _members(d: int, frozen_lora: bool = True, base_dtype: torch.dtype = torch.bfloat16) -> list[nn.Module]:
    """A trainable fp32 Linear, one with a bias, and two LoRA layers (different ranks, one with a bias)."""
    ranks = [int(r) for r in torch.randint(2, 9, (2,))]
    mods = [nn.Linear(d, 24 + int(torch.randint(0, 8, ())), bias=False), nn.Linear(d, 5, bias=True)]
    for r, bias in zip(ranks, (False, True)):
        base = nn.Linear(d, 16 + int(torch.randint(0, 16, ())), bias=bias)
        if frozen_lora:
            base = base.to(base_dtype).requires_grad_(False)
        lin = LoRALinear(base, rank=r, alpha=2.0 * r)
        nn.init.normal_(lin.lora_B.weight, std=0.5)
        mods.append(lin)
    return mods


def _run(mods, x, dys, grouped: bool):
    x = x.detach().clone().requires_grad_(True)
    for p in (p for m in mods for p in m.parameters()):
        p.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = shared_input_linears(x, mods) if grouped else [m(x) for m in mods]
    loss = sum((y.float() * d.float()).sum() for y, d in zip(ys, dys) if d is not None)
    loss.backward()
    params = [p for m in mods for p in m.parameters() if p.requires_grad]
    return ys, x.grad, [p.grad for p in params], params


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30)).item()


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
def test_group_matches_layer_by_layer_and_float64(seed, x_dtype):
    d = 40 + int(torch.randint(0, 24, ()))
    mods = _members(d)
    x = torch.randn(2, 3 + int(torch.randint(0, 6, ())), d).to(x_dtype)
    dys = [torch.randn(*x.shape[:-1], m.out_features) for m in mods]
    ys, dx, grads, params = _run(mods, x, dys, grouped=True)
    assert "SharedInputLinears" in type(ys[0].grad_fn).__name__
    assert dx.dtype == x_dtype and all(g.dtype == p.dtype for g, p in zip(grads, params))
    ys1, dx1, grads1, _ = _run(mods, x, dys, grouped=False)
    assert "SharedInputLinears" not in type(ys1[0].grad_fn).__name__
    for a, b in zip([*ys, dx, *grads], [*ys1, dx1, *grads1]):
        assert a.shape == b.shape and _rel(a, b) < 1e-2
    # float64 from the same bf16-rounded operands
    xb = x.to(torch.bfloat16).double().reshape(-1, d)
    dx_ref = torch.zeros_like(xb)
    for m, y, dy in zip(mods, ys, dys):
        w = m.weight.detach().to(torch.bfloat16).double()
        dy64 = dy.to(torch.bfloat16).double().reshape(-1, w.shape[0])
        ref = xb @ w.T + (m.bias.detach().to(torch.bfloat16).double() if m.bias is not None else 0.0)
        dx_ref += dy64 @ w
        if isinstance(m, LoRALinear):
            a = m.lora_A.weight.detach().to(torch.bfloat16).double()
            b = m.lora_B.weight.detach().to(torch.bfloat16).double()
            ref = ref + m.scaling * (xb @ a.T) @ b.T
            dx_ref += m.scaling * (dy64 @ b) @ a
            assert _rel(m.lora_A.weight.grad, m.scaling * (dy64 @ b).T @ xb) < 2e-2
            assert _rel(m.lora_B.weight.grad, m.scaling * dy64.T @ (xb @ a.T)) < 2e-2
        else:
            assert _rel(m.weight.grad, dy64.T @ xb) < 2e-2
            if m.bias is not None:
                assert _rel(m.bias.grad, dy64.sum(0)) < 2e-2
        assert _rel(y.reshape(ref.shape), ref) < 1e-2
    assert _rel(dx.reshape(dx_ref.shape), dx_ref) < 1e-2


def test_unused_outputs_give_no_gradient(seed):
    """Members whose outputs the loss does not read get no gradient; dx is the used members' sum."""
    d = 32
    mods = _members(d)
    x = torch.randn(2, 5, d, dtype=torch.bfloat16)
    dys = [torch.randn(2, 5, m.out_features) for m in mods]
    dys[0] = dys[2] = None  # a plain Linear and a LoRA layer unused
    _, dx, grads, _ = _run(mods, x, dys, grouped=True)
    _, dx1, grads1, _ = _run(mods, x, dys, grouped=False)
    assert _rel(dx, dx1) < 1e-2
    assert mods[0].weight.grad is None and mods[2].lora_A.weight.grad is None and mods[2].lora_B.weight.grad is None
    assert mods[3].lora_A.weight.grad is not None and mods[1].weight.grad is not None


def test_falls_back_where_the_node_cannot_stand_in(seed):
    """No autocast, a hook on a member, a LoRA layer with a trainable base: the layers run one by one."""
    d = 24
    x = torch.randn(2, 3, d)
    ys = shared_input_linears(x, _members(d, base_dtype=torch.float32))
    assert all("SharedInputLinears" not in type(y.grad_fn).__name__ for y in ys)
    mods = _members(d)
    h = mods[1].register_forward_hook(lambda m, i, o: None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = shared_input_linears(x, mods)
    h.remove()
    assert all("SharedInputLinears" not in type(y.grad_fn).__name__ for y in ys)
    mods = _members(d, frozen_lora=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ys = shared_input_linears(x, mods)
    assert all("SharedInputLinears" not in type(y.grad_fn).__name__ for y in ys)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("mode", [False, True])
def test_linear_lowrank_against_float64(seed, bias, mode):
    """x W^T + b + s h B^T with the rank-r product made first and the base GEMM added into it (under a dispatch
    mode, selective recompute's, out of place: the same values). Against float64, and not within tolerance of the
    sum without the scale or without the base term (the check can fail)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    rows, d, out, r = 30 + int(torch.randint(0, 20, ())), 48, 40 + int(torch.randint(0, 9, ())), 8
    s = float(torch.rand(()) * 2 + 1.5)
    x = torch.randn(rows, d, dtype=torch.bfloat16)
    w, a, b = (torch.randn(*sh, dtype=torch.bfloat16) / d ** 0.5 for sh in ((out, d), (r, d), (out, r)))
    bi = torch.randn(out, dtype=torch.bfloat16) if bias else None
    h = x @ a.t()
    with Passthrough() if mode else torch.no_grad():
        y = linear_lowrank(x, w, bi, h, b, s)
        lr = lowrank(h, b, s)
    x64, w64, h64, b64 = (t.double() for t in (x, w, h, b))
    ref = x64 @ w64.T + s * h64 @ b64.T + (bi.double() if bias else 0.0)
    assert y.dtype == torch.bfloat16 and y.shape == (rows, out)
    assert _rel(y, ref) < 1e-2 and _rel(lr, s * h64 @ b64.T) < 1e-2
    assert _rel(y, ref - (s - 1) * h64 @ b64.T) > 3e-2 and _rel(y, ref - x64 @ w64.T) > 3e-2


@pytest.mark.parametrize("where", [("attn", 1), ("attn", 3), ("ffn", 2), ("ffn", 0)])
def test_layers_with_lora_match_their_layer_by_layer_forward(seed, where):
    """KDA (six projections of x grouped), DSA (three), the latent MoE (latent projection, shared expert's w1 / w3)
    and the dense SwiGLU (w1 / w3) under autocast with LoRA on every linear layer: the output, x's gradient and
    the grouped members' gradients as close to float64 as with the projections run one by one (the narrow members'
    GEMM merged with the adapters' rounds differently, so the two bf16 runs are not bit-equal; a missing or wrong
    term is off by O(1))."""
    import copy

    part, layer_id = where
    T = 12
    spec = micro_spec(attn_output_gate=True, index_topk=T)  # DSA selects every key: no top-k flip between runs
    model = materialize(build_model(spec), seed=seed % 1000)
    layer = getattr(model.layers[layer_id], part)
    assert isinstance(layer, {1: KDAAttention, 3: DSAAttention, 2: LatentMoE, 0: SwiGLU}[layer_id])
    for mod in list(layer.modules()):
        for name, base in list(mod.named_children()):
            if type(base) is nn.Linear:
                lin = LoRALinear(base.to(torch.bfloat16).requires_grad_(False), rank=4, alpha=8.0)
                nn.init.normal_(lin.lora_B.weight, std=0.3)
                setattr(mod, name, lin)
    layer.backend = "reference"
    members = layer._x_projections
    x = torch.randn(2, T, spec.hidden_size, dtype=torch.bfloat16)
    dy = torch.randn(2, T, spec.hidden_size)
    cos, sin = rope_cos_sin(torch.arange(T), spec.qk_rope_head_dim, spec.rope_theta)
    out = []
    for how in ("grouped", "one by one", "float64"):
        lay = copy.deepcopy(layer).double() if how == "float64" else layer
        xx = (x.double() if how == "float64" else x.clone()).requires_grad_(True)
        lay.zero_grad(set_to_none=True)
        # a forward hook on a member makes the layers run one by one
        hooks = [m.register_forward_hook(lambda m, i, o: None) for m in members] if how == "one by one" else []
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=how != "float64"):
            y = lay(xx, cos=cos, sin=sin) if part == "attn" else lay(xx)
        for h in hooks:
            h.remove()
        y = y[0] if isinstance(y, tuple) else y
        (y.double() * dy.double()).sum().backward()
        # what the grouped node computes: the layer's output, x's gradient and its members' adapter gradients
        # (the other parameters' gradients only carry its rounding onwards, through sums that cancel: KDA's
        # A_log, dt_bias and f_b)
        node = lay._x_projections if how == "float64" else members
        out.append([y.detach(), xx.grad] + [p.grad for m in node for p in m.parameters() if p.requires_grad])
        if how == "grouped":
            assert len(members) >= 2
            # every projection of x has adapter gradients (the DSA indexer's, trained by its KL loss only, may not)
            assert all(m.lora_A.weight.grad is not None for m in members)
    for a, b, ref in zip(*out):
        assert (a is None) == (b is None) == (ref is None)
        if a is not None:
            assert _rel(a, ref) <= 2 * _rel(b, ref) + 1.5e-2, (_rel(a, ref), _rel(b, ref))


@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_matches_the_add_then_the_norm(seed, x_dtype):
    """RMSNorm.after_add (the block's residual add fused with the FFN norm): the sum, the normed output and every
    gradient as `s = x + a; norm(s)`, eager and through a traced graph (the compiled path's autograd, on CPU by
    aot_eager), under autocast (an fp32 stream comes out bf16) and against float64."""
    from moeadapt.models import common

    d = 16 + int(torch.randint(0, 48, ()))
    norm = common.RMSNorm(d)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x = torch.randn(2, 5, d, dtype=x_dtype) * 3
    a = torch.randn(2, 5, d, dtype=torch.bfloat16)
    ds, dy = torch.randn(2, 5, d), torch.randn(2, 5, d)
    traced = torch.compile(common.add_rms_norm, backend="aot_eager", dynamic=True)

    def run(how):
        xx, aa = x.clone().requires_grad_(True), a.clone().requires_grad_(True)
        norm.weight.grad = None
        with torch.autocast("cpu", dtype=torch.bfloat16):
            if how == "apart":
                s = xx + aa
                y = norm(s)
            elif how == "fused":
                s, y = norm.after_add(xx, aa)
            else:
                s, y = traced(xx, aa, norm.weight, norm.eps, norm._out_dtype(xx))
        ((s.float() * ds).sum() + (y.float() * dy).sum()).backward()
        return [s, y, xx.grad, aa.grad, norm.weight.grad]

    want = run("apart")
    assert want[0].dtype == x_dtype and want[1].dtype == torch.bfloat16
    for how in ("fused", "traced"):
        got = run(how)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            torch.testing.assert_close(g.float(), w.float(), rtol=1e-2, atol=1e-2)
    # float64
    s64 = x.double() + a.double()
    y64 = s64 * torch.rsqrt(s64.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.detach().double()
    assert _rel(want[1], y64) < 1e-2 and _rel(want[0], s64) < 1e-2


def test_residual_add_moves_into_the_next_norm(seed, monkeypatch):
    """Each block hands its FFN output(s) (a MoE's routed and shared outputs unsummed) to the next block's attention
    norm, or the final norm, to add in the same pass: the loss and every gradient as with the adds inside the
    blocks (float64). A hook on a block keeps that block's add inside it (onboard --validate reads block outputs),
    and a checkpointed block receives no branch (its saved inputs stay the stream alone)."""
    import copy

    from moeadapt.models.model import Block
    from moeadapt.parallel.activation import apply_activation_checkpointing

    spec = micro_spec()
    model = materialize(build_model(spec), seed=seed % 1000, dtype=torch.float64)
    ids = torch.randint(0, spec.vocab_size, (2, 10))
    calls: list[tuple[int, bool]] = []
    forward = Block.forward

    def spy(self, *args, branch=(), defer=False, **kw):
        calls.append((len(branch), defer))
        return forward(self, *args, branch=branch, defer=defer, **kw)

    monkeypatch.setattr(Block, "forward", spy)

    def run(m, hooked=()):
        calls.clear()
        m.zero_grad(set_to_none=True)
        hs = [m.layers[i].register_forward_hook(lambda *_: None) for i in hooked]
        out = m(ids[:, :-1], labels=ids[:, 1:])
        for h in hs:
            h.remove()
        out.loss.backward()
        return out.loss.detach(), {n: p.grad for n, p in m.named_parameters() if p.grad is not None}, list(calls)

    moe = [b.is_moe for b in model.layers]
    loss, grads, seen = run(model)
    # block i receives block i-1's outputs: one from a dense FFN, two from a MoE with a shared expert
    assert seen == [(0, True)] + [(2 if moe[i - 1] else 1, True) for i in range(1, spec.n_layers)]
    loss1, grads1, seen1 = run(model, hooked=range(spec.n_layers))
    assert seen1 == [(0, False)] * spec.n_layers
    torch.testing.assert_close(loss, loss1, rtol=1e-12, atol=0)
    assert grads.keys() == grads1.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], grads1[n], rtol=1e-9, atol=1e-12, msg=n)
    _, _, seen2 = run(model, hooked=[1])
    assert seen2[1] == (2 if moe[0] else 1, False) and seen2[2] == (0, True)
    ac = copy.deepcopy(model)
    apply_activation_checkpointing(ac, "full")
    loss3, _, seen3 = run(ac)
    torch.testing.assert_close(loss3, loss, rtol=1e-12, atol=0)
    # (each checkpointed forward is seen twice: forward and recompute) only the last block hands its outputs on
    assert {c for c in seen3} == {(0, False), (0, True)} and seen3[spec.n_layers - 1] == (0, True)
