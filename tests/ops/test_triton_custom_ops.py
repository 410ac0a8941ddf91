"""The Triton KDA, sparse-attention, indexer and indexer-KL kernels as torch.library custom ops: torch.library's checks
(schema, fake tensors, autograd registration, AOT dispatch), selective activation checkpointing keeping their
forward outputs (each forward runs once per layer over forward + backward; full recompute runs it twice), and
torch.compile (aot_eager, fullgraph) through them giving the eager values. Their eager fast path (ops/custom.py):
a plain autograd.Function with the op's values where nothing traces, the op itself where something does.

Tiny shapes (one 64-token chunk): the Triton interpreter runs every program in Python on CPU.
"""

import dataclasses
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover
    HAVE_TRITON = False

pytestmark = pytest.mark.skipif(
    not (HAVE_TRITON and (torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1")),
    reason="Triton needs CUDA or TRITON_INTERPRET=1",
)
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _leaves(*xs):
    return [x.to(DEV).requires_grad_() for x in xs]


def _kda_inputs(T=8, cu=None, gate=False):
    """Op arguments of moeadapt::chunk_kda_fwd (B = 1, one head, K = V = 16) with leaves that need grad."""
    from moeadapt.ops.kda.triton_kda import LAUNCH

    q, v = torch.randn(1, T, 1, 16), torch.randn(1, T, 1, 16)
    k = F.normalize(torch.randn(1, T, 1, 16), dim=-1)
    g = torch.randn(1, T, 1, 16) if gate else -torch.rand(1, T, 1, 16)
    N = 1 if cu is None else len(cu) - 1
    q, k, v, g, beta, h0 = _leaves(q, k, v, g, torch.rand(1, T, 1), torch.randn(N, 1, 16, 16))
    A_log, dt_bias = _leaves(torch.randn(1) * 0.5, torch.randn(1, 16) * 0.5) if gate else (None, None)
    cu = None if cu is None else torch.tensor(cu, dtype=torch.int32, device=DEV)
    return q, k, v, g, beta, 0.25, h0, True, cu, A_log, dt_bias, LAUNCH.key


# varlen before a release only (its fake impl also runs in test_compile_through_chunk_kda[varlen])
@pytest.mark.parametrize("varlen", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["dense", "varlen"])
def test_kda_opcheck(seed, varlen):
    from moeadapt.ops.kda.triton_kda import chunk_kda_fwd

    args = _kda_inputs(cu=[0, 3, 8] if varlen else None, gate=varlen)
    torch.library.opcheck(chunk_kda_fwd, args)


def test_kda_launch_key_round_trips():
    """The launch travels to the ops as KDALaunch.key and comes back equal (a changed copy included)."""
    from moeadapt.ops.kda.triton_kda import LAUNCH, _launch_of

    changed = dataclasses.replace(LAUNCH, h_BV=16, h_split=False, dot_prec="ieee")
    assert _launch_of(LAUNCH.key) == LAUNCH and _launch_of(changed.key) == changed != LAUNCH
    assert changed.key != LAUNCH.key


def _attn_inputs(T=12, HQ=2, D=32, DV=16, topk=8, shared=False):
    """q, k, v (v = k[..., :DV] when shared: MLA's latent, D1 = 32 > DV is not shared), causal indices."""
    q, k = _leaves(torch.randn(1, T, HQ, D), torch.randn(1, T, 1, D))
    v = k[..., :DV] if shared else _leaves(torch.randn(1, T, 1, DV))[0]
    idx = torch.full((1, T, topk), -1, dtype=torch.int32)
    for t in range(T):
        sel = torch.randperm(t + 1)[:topk].sort().values
        idx[0, t, : sel.numel()] = sel.int()
    return q, k, v, idx.to(DEV)


@pytest.mark.parametrize("shared", [False, True], ids=["v", "v_is_k_latent"])
def test_sparse_attention_opcheck(seed, shared):
    from moeadapt.ops.dsa.triton_sparse_attn import sparse_attn_fwd

    q, k, v, idx = _attn_inputs(D=32 if shared else 48, DV=32 if shared else 16, shared=shared)
    torch.library.opcheck(sparse_attn_fwd, (q, k, None if shared else v, idx, 0.3, True, None, None))


def test_indexer_kl_opcheck(seed):
    from moeadapt.ops.dsa.triton_kl import indexer_kl_fwd

    q, k, _, idx = _attn_inputs(D=16)
    q_idx, k_idx, w_idx = _leaves(torch.randn(1, 12, 2, 16), torch.randn(1, 12, 16), torch.rand(1, 12, 2))
    torch.library.opcheck(indexer_kl_fwd, (q.detach(), k.detach(), idx, q_idx, k_idx, w_idx, 0.3))


def test_lightning_indexer_opcheck(seed):
    """moeadapt::lightning_indexer (no gradient: integer output) through torch.library's checks, and its
    selection equal to the reference's (random scores: no ties)."""
    from moeadapt.ops.dsa.reference import lightning_indexer_reference
    from moeadapt.ops.dsa.triton_indexer import lightning_indexer_op

    q_idx, k_idx, w_idx = (t.to(DEV) for t in (torch.randn(1, 12, 2, 16), torch.randn(1, 12, 16),
                                              torch.rand(1, 12, 2)))
    torch.library.opcheck(lightning_indexer_op, (q_idx, k_idx, w_idx, 4, None, None))
    got = lightning_indexer_op(q_idx, k_idx, w_idx, 4)
    want = lightning_indexer_reference(q_idx, k_idx, w_idx, 4)
    assert got.dtype == torch.int32 and torch.equal(got.sort(-1).values, want.to(got.dtype).sort(-1).values)


# ------------------------------------------------------------------ selective activation checkpointing


class _KDABlock(nn.Module):
    def __init__(self, C=16):
        super().__init__()
        self.proj = nn.Linear(C, 4 * C + 1)
        self.out = nn.Linear(C, C)

    def forward(self, x):
        from moeadapt.ops.kda.triton_kda import chunk_kda_triton

        B, T, C = x.shape
        q, k, v, g, beta = self.proj(x).split([C, C, C, C, 1], -1)
        o, _ = chunk_kda_triton(q[:, :, None], k[:, :, None], v[:, :, None], -F.softplus(g)[:, :, None],
                                torch.sigmoid(beta), use_qk_l2norm=True)
        return x + self.out(o.reshape(B, T, C))


class _DSABlock(nn.Module):
    """MLA form: one latent kv row per token, v its leading channels; plus the indexer KL loss."""

    def __init__(self, C=16, HQ=2, D=32):
        super().__init__()
        self.HQ, self.D = HQ, D
        self.q = nn.Linear(C, HQ * D)
        self.kv = nn.Linear(C, D + 16)  # 32 latent + 16 rope channels: D1 = 32 = DV, v = kv[..., :32]
        self.out = nn.Linear(HQ * 32, C)
        self.qi, self.ki, self.wi = nn.Linear(C, 2 * 16), nn.Linear(C, 16), nn.Linear(C, 2)

    def forward(self, x):
        from moeadapt.ops.dsa.triton_kl import indexer_kl_loss_triton
        from moeadapt.ops.dsa.triton_sparse_attn import sparse_attention_triton

        B, T, C = x.shape
        q = self.q(x).view(B, T, self.HQ, self.D)
        q = F.pad(q, (0, 16))  # D = 48 = 32 + 16 like kv
        kv = self.kv(x)[:, :, None]
        o = sparse_attention_triton(q, kv, kv[..., :32], self.idx, scale=0.3)
        q_idx, k_idx, w_idx = self.qi(x).view(B, T, 2, 16), self.ki(x), self.wi(x)
        self.kl = indexer_kl_loss_triton(q, kv, self.idx, q_idx, k_idx, w_idx, scale=0.3)
        return x + self.out(o.reshape(B, T, -1))


class _Net(nn.Module):
    def __init__(self, block, n=1):
        super().__init__()
        self.layers = nn.ModuleList([block() for _ in range(n)])

    def forward(self, x):
        for b in self.layers:
            x = b(x)
        return x


def _count_calls(monkeypatch, module, name):
    """Counts calls of module.name (a function the op's implementation calls once per forward)."""
    calls = [0]
    fn = getattr(module, name)

    def counted(*a, **k):
        calls[0] += 1
        return fn(*a, **k)

    monkeypatch.setattr(module, name, counted)
    return calls


def _run_modes(monkeypatch, make, counted, extra_loss=lambda m: 0.0):
    """{mode: (calls of each counted function, loss, grads)} for the same model and input under none / selective /
    full activation checkpointing."""
    from moeadapt.parallel import apply_activation_checkpointing

    state = make().state_dict()
    x = torch.randn(1, 12, 16, device=DEV)
    res = {}
    for mode in ("none", "selective", "full"):
        model = make().to(DEV)
        model.load_state_dict(state)
        apply_activation_checkpointing(model, mode)
        calls = [_count_calls(monkeypatch, mod, name) for mod, name in counted]
        xx = x.clone().requires_grad_()
        out = model(xx)
        loss = out.square().mean() + extra_loss(model)
        loss.backward()
        res[mode] = ([c[0] for c in calls], loss.detach(),
                     [xx.grad] + [p.grad for p in model.parameters()])
        monkeypatch.undo()
    return res


def _assert_same_as_none(res):
    for mode in ("selective", "full"):
        torch.testing.assert_close(res[mode][1], res["none"][1], rtol=1e-6, atol=1e-7)
        for i, (a, b) in enumerate(zip(res[mode][2], res["none"][2])):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=lambda m, i=i, mode=mode: f"{mode}, grad {i}: {m}")


def test_selective_keeps_the_kda_forward(seed, monkeypatch):
    """Selective recompute runs the KDA Triton forward once per layer over forward + backward (full: twice), and
    its loss and gradients equal the un-checkpointed run."""
    from moeadapt.ops.kda import triton_kda

    res = _run_modes(monkeypatch, lambda: _Net(_KDABlock), [(triton_kda, "_run_fwd_h")])
    assert {m: r[0] for m, r in res.items()} == {"none": [1], "selective": [1], "full": [2]}
    _assert_same_as_none(res)


def test_selective_keeps_the_sparse_attention_and_kl_forwards(seed, monkeypatch):
    from moeadapt.ops.dsa import triton_kl, triton_sparse_attn

    _, _, _, idx = _attn_inputs()

    def make():
        m = _Net(_DSABlock)
        m.layers[0].idx = idx
        return m

    res = _run_modes(monkeypatch, make, [(triton_sparse_attn, "sfa_forward"), (triton_kl, "kl_target_triton")],
                     extra_loss=lambda m: m.layers[0].kl)
    assert {m: r[0] for m, r in res.items()} == {"none": [1, 1], "selective": [1, 1], "full": [2, 2]}
    _assert_same_as_none(res)


# ------------------------------------------------------------------ torch.compile


def _compiled_matches_eager(fn, leaves):
    loss = fn(*leaves)
    ref = torch.autograd.grad(loss, leaves)
    torch._dynamo.reset()
    cf = torch.compile(fn, backend="aot_eager", fullgraph=True)
    loss_c = cf(*leaves)
    got = torch.autograd.grad(loss_c, leaves)
    torch.testing.assert_close(loss_c, loss, rtol=1e-6, atol=1e-6)
    for i, (a, b) in enumerate(zip(got, ref)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=lambda m, i=i: f"grad {i}: {m}")


@pytest.mark.parametrize("varlen", [False, True], ids=["dense", "varlen"])
def test_compile_through_chunk_kda(seed, varlen):
    """fullgraph aot_eager through chunk_kda_triton (the fake impls; varlen: a data-dependent chunk count)."""
    from moeadapt.ops.kda.triton_kda import chunk_kda_triton

    q, k, v, g, beta, _, h0, _, cu, A_log, dt_bias, _ = _kda_inputs(cu=[0, 5, 8] if varlen else None, gate=varlen)
    w = torch.randn(1, 8, 1, 16, device=DEV)

    def fn(*xs):
        o, ht = chunk_kda_triton(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu,
                                 A_log=xs[6] if varlen else None, dt_bias=xs[7] if varlen else None)
        return (o * w).sum() + ht.square().sum()

    _compiled_matches_eager(fn, [q, k, v, g, beta, h0] + ([A_log, dt_bias] if varlen else []))


def test_compile_through_sparse_attention(seed):
    from moeadapt.ops.dsa.triton_sparse_attn import sparse_attention_triton

    q, k, v, idx = _attn_inputs(D=48, DV=16)
    w = torch.randn(1, 12, 2, 16, device=DEV)

    def fn(q, k, v):
        return (sparse_attention_triton(q, k, v, idx, scale=0.3) * w).sum()

    _compiled_matches_eager(fn, [q, k, v])


# ------------------------------------------------------------------ MoE grouped GEMMs


def _moe_inputs(N=8, E=2, I=16, O=16, R=4):
    """x [N, I], base w as the model passes it (a transposed view of [E, O, I]), LoRA A, B, END offsets (every
    row owned: the kernels leave rows past offsets[-1] unwritten)."""
    x, w_EOI, A, B = _leaves(torch.randn(N, I), torch.randn(E, O, I), torch.randn(E, I, R), torch.randn(E, R, O))
    offsets = torch.tensor([3, N], dtype=torch.int32, device=DEV)
    return x, w_EOI, A, B, offsets


def test_grouped_mm_opchecks(seed):
    from moeadapt.ops.moe.triton_grouped_mm import grouped_lora_op, grouped_mm_op

    x, w_EOI, A, B, offsets = _moe_inputs()
    torch.library.opcheck(grouped_mm_op, (x, w_EOI.transpose(1, 2), offsets))
    torch.library.opcheck(grouped_lora_op, (x, A, B, offsets, 0.5, w_EOI.detach().transpose(1, 2)))
    torch.library.opcheck(grouped_lora_op, (x, A, B, offsets, 0.5, None))


class _MoEBlock(nn.Module):
    """x -> grouped_mm (trained base) -> grouped_lora (frozen base + adapter) over fixed expert groups."""

    def __init__(self, C=16, E=2, R=4):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(E, C, C) * 0.3)  # [E, O, I]
        self.w2 = nn.Parameter(torch.randn(E, C, C) * 0.3, requires_grad=False)
        self.A = nn.Parameter(torch.randn(E, C, R) * 0.3)
        self.B = nn.Parameter(torch.randn(E, R, C) * 0.3)

    def forward(self, x):
        from moeadapt.ops.moe.triton_grouped_mm import grouped_lora_triton, grouped_mm_triton

        B, T, C = x.shape
        offsets = torch.tensor([5, B * T], dtype=torch.int32, device=x.device)
        h = torch.tanh(grouped_mm_triton(x.reshape(B * T, C), self.w1.transpose(1, 2), offsets))
        y = grouped_lora_triton(h, self.A, self.B, offsets, 0.5, self.w2.transpose(1, 2))
        return x + y.view(B, T, C)


def test_selective_keeps_the_grouped_gemm_forwards(seed, monkeypatch):
    """Each grouped-GEMM launch of the forward (base, LoRA x A, LoRA base + adapter) runs once under selective
    recompute, twice under full; the backward's launches (dx of both, dh) are the same in every mode."""
    from moeadapt.ops.moe import triton_grouped_mm

    res = _run_modes(monkeypatch, lambda: _Net(_MoEBlock), [(triton_grouped_mm, "grouped_mm_fwd")])
    fwd, bwd = 3, 3  # forward: base, h = x A, y; backward: dx of the base, dh, dx of the LoRA layer
    assert {m: r[0] for m, r in res.items()} == {"none": [fwd + bwd], "selective": [fwd + bwd],
                                                  "full": [2 * fwd + bwd]}
    _assert_same_as_none(res)


def test_compile_through_grouped_gemms(seed):
    from moeadapt.ops.moe.triton_grouped_mm import grouped_lora_triton, grouped_mm_triton

    x, w_EOI, A, B, offsets = _moe_inputs()
    w2 = torch.randn(2, 16, 16, device=DEV)

    def fn(x, w, A, B):
        h = grouped_mm_triton(x, w.transpose(1, 2), offsets)
        return grouped_lora_triton(h, A, B, offsets, 0.5, w2.transpose(1, 2)).square().sum()

    _compiled_matches_eager(fn, [x, w_EOI, A, B])


# ------------------------------------------------------------------ eager fast path (ops/custom.py)


def _conv_inputs(frozen_w: bool = False, norm_dim: int = 0):
    """x, w, positions, norm_dim; with frozen_w the weight needs no gradient (the dx-only backward)."""
    x, w = _leaves(torch.randn(2, 9, 16), torch.randn(16, 1, 4))
    positions = torch.tensor([list(range(4)) + list(range(5))] * 2, dtype=torch.int32, device=DEV)  # 2 documents
    return x, (w.detach() if frozen_w else w), positions, norm_dim


def _fast_path_cases():
    """(fast callable, its custom op, the op's name, its arguments) per forward op, on fresh leaves."""
    from moeadapt.ops.dsa import triton_kl, triton_sparse_attn
    from moeadapt.ops.kda import triton_conv, triton_kda
    from moeadapt.ops.moe import triton_grouped_mm as gmm

    q, k, v, idx = _attn_inputs(D=48, DV=16)
    q_idx, k_idx, w_idx = _leaves(torch.randn(1, 12, 2, 16), torch.randn(1, 12, 16), torch.rand(1, 12, 2))
    x, w_EOI, A, B, offsets = _moe_inputs()
    return {
        "kda": (triton_kda.chunk_kda_fwd_fast, triton_kda.chunk_kda_fwd, "chunk_kda_fwd", _kda_inputs(gate=True)),
        "conv": (triton_conv.conv_silu_fwd_fast, triton_conv.conv_silu_fwd, "causal_conv_silu_fwd", _conv_inputs()),
        "conv_frozen_w": (triton_conv.conv_silu_fwd_fast, triton_conv.conv_silu_fwd, "causal_conv_silu_fwd",
                          _conv_inputs(frozen_w=True)),
        "conv_norm": (triton_conv.conv_silu_fwd_fast, triton_conv.conv_silu_fwd, "causal_conv_silu_fwd",
                      _conv_inputs(norm_dim=8)),
        "conv_norm_frozen_w": (triton_conv.conv_silu_fwd_fast, triton_conv.conv_silu_fwd, "causal_conv_silu_fwd",
                               _conv_inputs(frozen_w=True, norm_dim=8)),
        "sparse_attn": (triton_sparse_attn.sparse_attn_fwd_fast, triton_sparse_attn.sparse_attn_fwd, "sparse_attn_fwd",
                        (q, k, v, idx, 0.3, True, None, None)),
        "indexer_kl": (triton_kl.indexer_kl_fwd_fast, triton_kl.indexer_kl_fwd, "indexer_kl_fwd",
                       (q.detach(), k.detach(), idx, q_idx, k_idx, w_idx, 0.3)),
        "grouped_mm": (gmm.grouped_mm_fast, gmm.grouped_mm_op, "grouped_mm_fwd", (x, w_EOI.transpose(1, 2), offsets)),
        "grouped_lora": (gmm.grouped_lora_fast, gmm.grouped_lora_op, "grouped_lora_fwd",
                         (x, A, B, offsets, 0.5, w_EOI.transpose(1, 2))),
    }


def _forward_backward(f, args, cotangents=None):
    """(outputs, input gradients, the moeadapt:: ops the dispatcher ran, cotangents) of f(*args) and a backward
    of its differentiable outputs with the given (or fresh random) cotangents."""
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        out = f(*args)
        out = out if isinstance(out, tuple) else (out,)
        diff = [o for o in out if o.requires_grad]
        cotangents = cotangents or [torch.randn_like(o) for o in diff]
        grads = torch.autograd.grad(diff, leaves, cotangents, allow_unused=True)
    ops = {e.name for e in prof.events() if e.name.startswith("moeadapt::")}
    return out, grads, ops, cotangents


@pytest.mark.parametrize("case", ["kda", "conv", "conv_frozen_w", "conv_norm", "conv_norm_frozen_w", "sparse_attn",
                                  "indexer_kl", "grouped_mm", "grouped_lora"])
def test_eager_fast_path_is_a_plain_function_with_the_ops_values(seed, case):
    """In plain eager mode the fast callable runs neither the forward op nor the backward op (the dispatcher
    records none) and its grad_fn is its plain autograd.Function's; its outputs and input gradients equal the
    custom op's on the same inputs (the op's own backward also runs the raw backward implementation in eager)."""
    fast, op, name, args = _fast_path_cases()[case]
    out, grads, ops, cot = _forward_backward(fast, args)
    node = out[0].grad_fn
    assert isinstance(node, torch.autograd.function.BackwardCFunction)
    assert type(node).__name__ == fast.Function.__name__ + "Backward"
    assert not ops, ops
    ref_out, ref_grads, ref_ops, _ = _forward_backward(op, args, cot)
    assert type(ref_out[0].grad_fn).__name__ != type(node).__name__
    assert ref_ops == {f"moeadapt::{name}"}, ref_ops  # the forward op; its backward calls the raw implementation
    # the same implementation on the same inputs; on a GPU fp32 atomics (sparse attention's dk, the KL's dk) may sum
    # in another order
    tol = dict(rtol=0, atol=0) if DEV == "cpu" else dict(rtol=1e-6, atol=1e-6)
    assert len(out) == len(ref_out) and any(g is not None for g in grads)
    for i, (a, b) in enumerate(zip(out, ref_out)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"output {i}: {m}")
    for i, (a, b) in enumerate(zip(grads, ref_grads)):
        assert (a is None) == (b is None), i
        if a is not None:
            torch.testing.assert_close(a, b, **tol, msg=lambda m, i=i: f"grad {i}: {m}")


def test_traced():
    """traced(): False for plain tensors and parameters (non-tensors ignored); True under a dispatch mode (SAC's,
    FakeTensorMode, FlopCounterMode, any TorchDispatchMode), inside a torch.func transform, for meta tensors, for
    tensor subclasses (a FakeTensor outside its mode) and for torch.func wrappers."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from moeadapt.ops.custom import traced

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    x = torch.randn(3)
    assert not traced(x, nn.Parameter(torch.randn(2)), None, 0.5, "key", True)
    assert not traced()
    for mode in (FakeTensorMode(), FlopCounterMode(display=False), Passthrough()):
        with mode:
            assert traced(x), type(mode).__name__
    assert traced(x, torch.empty(2, device="meta"))
    with FakeTensorMode() as fake:
        f = fake.from_tensor(x)
    assert traced(f)
    seen, leaked = [], []
    torch.func.grad(lambda t: (seen.append(traced(t)), leaked.append(t), t.sum())[2])(x)
    assert seen == [True]
    assert traced(leaked[0])  # a dead torch.func wrapper: it looks like a plain tensor


def test_fast_path_defers_to_the_op_where_traced():
    """Under a dispatch mode the fast callable is the custom op (the mode sees it, the fake impl runs under
    FakeTensorMode); meta inputs go to the fake impl; every argument must be given, positionally."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from moeadapt.ops.moe.triton_grouped_mm import grouped_mm_fast

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    x, w_EOI, _, _, offsets = _moe_inputs()
    with Recorder() as rec:
        y = grouped_mm_fast(x, w_EOI.transpose(1, 2), offsets)
    assert torch.ops.moeadapt.grouped_mm_fwd.default in rec.ops
    assert type(y.grad_fn).__name__ != grouped_mm_fast.Function.__name__ + "Backward"
    fake = FakeTensorMode()
    fx, fw, fo = (fake.from_tensor(t) for t in (x.detach(), w_EOI.detach(), offsets))
    with fake:
        assert grouped_mm_fast(fx, fw.transpose(1, 2), fo).shape == (8, 16)
    meta = grouped_mm_fast(x.detach().to("meta"), w_EOI.detach().to("meta").transpose(1, 2), offsets.to("meta"))
    assert meta.is_meta and meta.shape == (8, 16)
    with pytest.raises(TypeError, match="positionally"):
        grouped_mm_fast(x, w_EOI.transpose(1, 2))


def test_fast_path_without_gradients_runs_the_implementation_alone(seed):
    """No gradient asked for (no_grad, or no input needing one): the implementation runs alone, no op, no node."""
    from moeadapt.ops.moe.triton_grouped_mm import grouped_mm_fast, grouped_mm_op

    x, w_EOI, _, _, offsets = _moe_inputs()
    args = (x, w_EOI.transpose(1, 2), offsets)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.no_grad():
            y = grouped_mm_fast(*args)
        y_frozen = grouped_mm_fast(*(a.detach() for a in args))  # grad mode on, no input needs a gradient
    ref = grouped_mm_op(*args).detach()
    names = {e.name for e in prof.events()}
    assert grouped_mm_fast.Function.__name__ not in names and not any(n.startswith("moeadapt::") for n in names)
    assert y.grad_fn is None and y_frozen.grad_fn is None
    torch.testing.assert_close(y, ref, rtol=0, atol=0)
    torch.testing.assert_close(y_frozen, ref, rtol=0, atol=0)
