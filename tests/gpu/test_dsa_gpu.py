"""GPU tests: Triton DSA kernels vs the PyTorch reference on CUDA (skipped without CUDA)."""

from __future__ import annotations

import os

import pytest
import torch

from moeadapt.ops.dsa import (
    indexer_kl_loss,
    indexer_scores_reference,
    lightning_indexer,
    sparse_attention,
)
from moeadapt.ops.dsa.triton_sparse_attn import DENSE_PDS_CONFIG

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
SEED = int.from_bytes(os.urandom(4), "little")
print(f"test_dsa_gpu seed={SEED}")


def _check_topk(idx, q_idx, k_idx, w_idx, topk, starts, rtol=1e-3):
    """Each row: right count, causal, unique, and every pick scores >= the k-th best (to rounding)."""
    T = q_idx.shape[1]
    sc = indexer_scores_reference(q_idx, k_idx, w_idx)[0]  # [T, T] fp32
    pos = torch.arange(T, device=sc.device)
    vis = (pos[None] <= pos[:, None]) & (pos[None] >= starts[:, None])
    sc = sc.masked_fill(~vis, float("-inf"))
    n = vis.sum(-1).clamp(max=topk)
    got = idx[0].long()
    ok = got >= 0
    assert torch.equal(ok.sum(-1), n)
    assert torch.all(torch.where(ok, vis.gather(1, got.clamp(min=0)), True))
    srt = torch.sort(torch.where(ok, got, T + pos[:, None] * 0 + torch.arange(topk, device=sc.device)), -1).values
    assert torch.all(srt[:, 1:] != srt[:, :-1])
    kth = sc.topk(topk, -1).values.gather(1, (n - 1)[:, None])
    picked = torch.where(ok, sc.gather(1, got.clamp(min=0)), float("inf"))
    tol = rtol * sc.masked_fill(~vis, 0).abs().amax(-1, keepdim=True)
    assert torch.all(picked >= kth - tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_indexer_gpu(dtype):
    g = torch.Generator(device="cuda").manual_seed(SEED)
    T, HI, DI, topk = 3000, 8, 64, 256
    cu = torch.tensor([0, 100, 1700, 3000], device="cuda", dtype=torch.int32)
    q_idx = torch.randn(1, T, HI, DI, device="cuda", generator=g).to(dtype)
    k_idx = torch.randn(1, T, DI, device="cuda", generator=g).to(dtype)
    w_idx = torch.randn(1, T, HI, device="cuda", generator=g).to(dtype)
    for c in (None, cu):
        idx = lightning_indexer(q_idx, k_idx, w_idx, topk, cu_seqlens=c)
        starts = torch.zeros(T, dtype=torch.long, device="cuda")
        if c is not None:
            for a in c[:-1].tolist():
                starts[a:] = a
        _check_topk(idx, q_idx, k_idx, w_idx, topk, starts)
        if dtype == torch.float32:
            ref = lightning_indexer(q_idx, k_idx, w_idx, topk, cu_seqlens=c, backend="reference")
            assert (idx == ref).float().mean() > 0.999


def _rand_indices(T, topk, g):
    r = torch.randint(0, 1 << 30, (1, T, topk), device="cuda", generator=g)
    idx = r % (torch.arange(T, device="cuda")[None, :, None] + 1)
    idx = torch.sort(idx, -1).values
    dup = torch.zeros_like(idx, dtype=torch.bool)
    dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
    return torch.where(dup, -1, idx).int()


_P1T = {"BLOCK_M": 64, "BLOCK_KEYS": 32, "num_warps": 4, "num_stages": 2}


@pytest.mark.parametrize("dtype,H,D,DV,shared,bwd,gluon", [
    (torch.float32, 8, 96, 64, False, None, True),
    (torch.bfloat16, 16, 576, 512, True, None, True),  # the dense pass 2 (the default at <= 32 heads)
    (torch.bfloat16, 16, 576, 512, True, {"DENSE": None}, True),  # the slot pass 2
    # the dense pass 2 zeroing only the tiles pass 1 may write (ZERO_TOUCHED; the buffer is NaN-poisoned)
    (torch.bfloat16, 16, 576, 512, True, {"DENSE": {**DENSE_PDS_CONFIG, "ZERO_TOUCHED": True}}, True),
    # pass 1 on dense tiles (P1_TILES: nothing zeroed, so a tile it leaves unwritten reads as NaN)
    (torch.bfloat16, 16, 576, 512, True, {"DENSE": {**DENSE_PDS_CONFIG, "P1_TILES": _P1T}}, True),
    (torch.bfloat16, 32, 576, 512, True, {"DENSE": {**DENSE_PDS_CONFIG, "P1_TILES": _P1T, "BYTES": 2**32}}, True),
    (torch.bfloat16, 32, 576, 512, True, None, True),
    (torch.bfloat16, 128, 576, 512, True, None, True),  # on sm_90: the Gluon forward and backward pass 1
    (torch.bfloat16, 128, 576, 512, True, None, False),  # the same shape on the Triton kernels
    (torch.bfloat16, 64, 576, 512, True, None, True),
    # the P/dS backward over several row chunks (256 rows, rounded to whole waves: 132 on an
    # H200, last chunk partial): same compiled kernels, ROW0 / NROWS vary
    (torch.bfloat16, 128, 576, 512, True, {"PDS_BYTES": 256 * 128 * 128 * 2 * 2}, True),
])
def test_sparse_attention_gpu(dtype, H, D, DV, shared, bwd, gluon, monkeypatch):
    from moeadapt.ops.dsa import triton_sparse_attn as tsa

    monkeypatch.setattr(tsa, "_POISON_PDS", True)  # a P / dS entry read before being written shows as NaN

    bwd_cfg = None if bwd is None else {**tsa.BWD_CONFIG, **bwd}
    g = torch.Generator(device="cuda").manual_seed(SEED)
    T, topk = 600, 128
    q = torch.randn(1, T, H, D, device="cuda", generator=g).to(dtype)
    kv = torch.randn(1, T, 1, D, device="cuda", generator=g).to(dtype)
    v0 = torch.randn(1, T, 1, DV, device="cuda", generator=g).to(dtype)
    do = torch.randn(1, T, H, DV, device="cuda", generator=g).to(dtype)
    idx = _rand_indices(T, topk, g)
    if dtype == torch.bfloat16 and shared and H % 64 == 0 and torch.cuda.get_device_capability() == (9, 0):
        # this case runs the Gluon forward and backward pass 1 (unless gluon=False)
        assert (tsa._gluon_module(q, kv, kv[..., :DV], idx, gluon) is not None) == gluon
    res = []
    # bf16: the reference's own dk (gather backward accumulates in bf16) is off by ~2%,
    # so both are compared with the reference run in fp32 on the same inputs
    runs = [("triton", dtype), ("reference", torch.float32)]
    for backend, dt in runs:
        qq, kk, vv = (x.to(dt).requires_grad_() for x in (q, kv, v0))
        v = kk[..., :DV] if shared else vv
        if backend == "triton":
            o = tsa.sparse_attention_triton(qq, kk, v, idx, gluon=gluon, bwd_cfg=bwd_cfg)
        else:
            o = sparse_attention(qq, kk, v, idx, backend=backend)
        grads = torch.autograd.grad(o, (qq, kk) if shared else (qq, kk, vv), do.to(dt))
        res.append((o, *grads))
    for a, b in zip(*res):
        if dtype == torch.float32:
            torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)
        else:  # bf16 rounding of P and dS: compare against the tensor's scale
            err = (a.float() - b).abs().max() / b.abs().max()
            assert err < 1.5e-2, f"relative max error {err:.3g}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("H", [16, 32])
def test_sparse_attention_tiles_forward_gpu(dtype, H):
    """The dense-tile forward (DENSE_FWD_CONFIG, forced on at a sparse selection too) against the fp32 reference,
    with the default backward reading its lse; a query with no key gets 0."""
    from moeadapt.ops.dsa import triton_sparse_attn as tsa

    g = torch.Generator(device="cuda").manual_seed(SEED)
    T, topk, D, DV = 600, 128, 576, 512
    q = torch.randn(2, T, H, D, device="cuda", generator=g).to(dtype)
    kv = torch.randn(2, T, 1, D, device="cuda", generator=g).to(dtype)
    do = torch.randn(2, T, H, DV, device="cuda", generator=g).to(dtype)
    idx = torch.stack([_rand_indices(T, topk, g)[0] for _ in range(2)])
    idx[1, 9] = -1
    res = []
    for backend, dt in (("triton", dtype), ("reference", torch.float32)):
        qq, kk = (x.to(dt).requires_grad_() for x in (q, kv))
        if backend == "triton":
            small = {"BLOCK_M": 32, "BLOCK_KEYS": 32, "num_stages": 1} if dt == torch.float32 else {}
            o = tsa.sparse_attention_triton(qq, kk, kk[..., :DV], idx,
                                            fwd_cfg={**tsa.DENSE_FWD_CONFIG, "MIN_DENSITY": 0.0, **small})
        else:
            o = sparse_attention(qq, kk, kk[..., :DV], idx, backend=backend)
        res.append((o, *torch.autograd.grad(o, (qq, kk), do.to(dt))))
    assert torch.all(res[0][0][1, 9] == 0)
    for a, b in zip(*res):
        err = (a.float() - b).abs().max() / b.abs().max()
        assert err < (2e-4 if dtype == torch.float32 else 1.5e-2), f"relative max error {err:.3g}"


def test_kl_loss_gpu():
    g = torch.Generator(device="cuda").manual_seed(SEED)
    T, H, D, HI, DI, topk = 500, 16, 96, 8, 64, 64
    q = torch.randn(1, T, H, D, device="cuda", generator=g)
    k = torch.randn(1, T, 1, D, device="cuda", generator=g)
    q_idx = torch.randn(1, T, HI, DI, device="cuda", generator=g)
    k_idx = torch.randn(1, T, DI, device="cuda", generator=g)
    w_idx = torch.randn(1, T, HI, device="cuda", generator=g) * 0.1
    idx = lightning_indexer(q_idx, k_idx, w_idx, topk)
    res = []
    for backend in ("triton", "reference"):
        xs = [x.clone().requires_grad_() for x in (q_idx, k_idx, w_idx)]
        loss = indexer_kl_loss(q, k, idx, *xs, backend=backend)
        res.append((loss, *torch.autograd.grad(loss, xs)))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="the Gluon forward is written for sm_90")
@pytest.mark.parametrize("B,HQ,T,topk", [(1, 64, 700, 256), (1, 128, 333, 2048), (1, 64, 2200, 2048),
                                          (2, 128, 500, 512)])
def test_sparse_attention_gluon_forward(B, HQ, T, topk):
    """Warp-specialised Gluon forward (MLA shape) vs the float64 reference: -1 padded rows (t < topk),
    an odd number of key blocks, rows shorter than one block, shuffled slots with holes."""
    from moeadapt.ops.dsa import gluon_sparse_attn as gws
    from moeadapt.ops.dsa.reference import sparse_attention_reference

    g = torch.Generator(device="cuda").manual_seed(SEED)
    q = torch.randn(B, T, HQ, 576, device="cuda", generator=g).bfloat16()
    kv = torch.randn(B, T, 1, 576, device="cuda", generator=g).bfloat16()
    v = kv[..., :512]
    pos = torch.arange(T, device="cuda")
    # causal random picks: row t takes min(topk, t + 1) distinct keys <= t, ascending, -1 padded
    r = torch.rand(T, T, device="cuda", generator=g).masked_fill(pos[None] > pos[:, None], 2.0)
    pick = r.topk(min(topk, T), -1, largest=False).indices.sort(-1).values
    n = (pos + 1).clamp(max=topk)
    slot = torch.arange(pick.shape[1], device="cuda")
    idx = torch.where(slot[None] < n[:, None], pick, -1).int()
    if pick.shape[1] < topk:
        idx = torch.cat([idx, idx.new_full((T, topk - pick.shape[1]), -1)], 1)
    idx[T // 2, ::3] = -1  # holes inside a full row
    idx = torch.stack([idx, idx.roll(1, 0)] if B == 2 else [idx])[:, :, None, :]
    assert gws.supported(q, kv, v, idx)
    scale = 576**-0.5
    o, lse = gws.sfa_forward_ws(q, kv, idx, scale)
    ref, lse_ref = sparse_attention_reference(q.double(), kv.double(), v.double(), idx, scale, return_lse=True)
    err = (o.double() - ref).abs().max().item()
    assert err < 2e-2 * ref.abs().max().item(), err
    lse_err = (lse.double() - lse_ref.double()).abs().max().item()
    assert lse_err < 2e-2, lse_err
    # the Triton kernel of the same contract agrees too
    from moeadapt.ops.dsa import triton_sparse_attn as tsa

    o_t, _ = tsa.sfa_forward(q, kv, v, idx, scale, tsa.FWD_CONFIG)
    assert (o.float() - o_t.float()).abs().max().item() < 2e-2 * o_t.float().abs().max().item()


@pytest.mark.parametrize("H,D,DV", [(4, 192, 128), (2, 64, 64)])
def test_sparse_attention_flex_gpu(H, D, DV):
    """The MHA layout (one K/V head per query head) with a dense selection takes FlexAttention's dense tiles
    (ops/dsa/flex_attn.py) through sparse_attention: o and its gradients against the fp32 reference."""
    from moeadapt.ops.dsa import flex_attn as fa

    g = torch.Generator(device="cuda").manual_seed(SEED)
    B, T, topk = 2, 1024, 640
    qi = torch.randn(B, T, 4, 32, device="cuda", generator=g)
    ki = torch.randn(B, T, 32, device="cuda", generator=g)
    wi = torch.randn(B, T, 4, device="cuda", generator=g)
    idx = lightning_indexer(qi, ki, wi, topk, backend="reference")
    q, k = (torch.randn(B, T, H, D, device="cuda", generator=g) for _ in range(2))
    v = torch.randn(B, T, H, DV, device="cuda", generator=g)
    do = torch.randn(B, T, H, DV, device="cuda", generator=g)
    assert fa.dense_tiles_apply(q, k, idx)
    res = []
    for backend, dt in (("triton", torch.bfloat16), ("reference", torch.float32)):
        qq, kk, vv = (x.to(dt).requires_grad_() for x in (q, k, v))
        o = sparse_attention(qq, kk, vv, idx, scale=D**-0.5, backend=backend)
        res.append((o, *torch.autograd.grad(o, (qq, kk, vv), do.to(dt))))
    for a, b in zip(*res):
        err = (a.float() - b).abs().max() / b.abs().max()
        assert err < 1.5e-2, f"relative max error {err:.3g}"


@pytest.mark.parametrize("T,topk", [(256, 192), (1024, 128)])
def test_dsa_layer_mha_form_gpu(monkeypatch, T, topk):
    """On CUDA the DSA layer takes the MHA form by itself (with FLEX_CONFIG["MHA_FORM"]) at a dense selection and
    at a sparse one (top-128 of 1024: 0.23 of the causal pairs, 1.25x the absorbed FLOPs, over MHA_FORM_COST but
    under MHA_FORM_COST_FEW_HEADS at 4 heads), and matches the absorbed form under bf16 autocast: output and the
    input's gradient."""
    from moeadapt.models.common import rope_cos_sin
    from moeadapt.models.dsa_attn import DSAAttention
    from moeadapt.models.model import build_model, materialize
    from moeadapt.ops.dsa import flex_attn as fa
    from tests.conftest import micro_spec

    spec = micro_spec(attn_output_gate=True, n_heads=4, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                      v_head_dim=32, index_head_dim=32, index_topk=topk, max_position_embeddings=2048)
    model = materialize(build_model(spec), seed=SEED % 1000)
    layer = next(m for m in model.modules() if isinstance(m, DSAAttention)).cuda()
    monkeypatch.setitem(fa.FLEX_CONFIG, "MHA_FORM", True)
    assert layer._mha_form(T, True) and not layer._mha_form(T, False)
    x = torch.randn(2, T, spec.hidden_size, device="cuda")
    dy = torch.randn(2, T, spec.hidden_size, device="cuda")
    cos, sin = (t.cuda() for t in rope_cos_sin(torch.arange(T), spec.qk_rope_head_dim, spec.rope_theta))
    out = []
    for form in ("auto", "absorbed"):
        layer.form = form
        xx = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, _ = layer(xx, cos=cos, sin=sin)
        (y.float() * dy).sum().backward()
        out.append((y.float(), xx.grad))
    for a, b in zip(*out):  # bf16 through both forms (dx: ~2e-2 on CPU); a wrong form is off by O(1)
        err = (a - b).abs().max() / b.abs().max()
        assert err < 5e-2, f"relative max error {err:.3g}"


@pytest.mark.parametrize("per_row", [False, True])
def test_mha_inputs_and_gate_compiled_gpu(per_row):
    """The DSA layer's compiled glue (models/dsa_attn.py: mha_inputs, gate_heads) against the same functions run
    as eager torch ops in float64: outputs and the gradients of q, kvb, k_pe and the gate logits (bf16 inputs;
    per_row: packed documents' [B, T, r/2] cos / sin)."""
    from moeadapt.models.common import compiled, rope_cos_sin
    from moeadapt.models.dsa_attn import gate_heads, mha_inputs

    B, T, H, nope, r, vd = 2, 300, 4, 32, 16, 24
    q = torch.randn(B, T, H, nope + r, device="cuda").bfloat16().requires_grad_()
    kvb = torch.randn(B, T, H, nope + vd, device="cuda").bfloat16().requires_grad_()
    k_pe = torch.randn(B, T, r, device="cuda").bfloat16().requires_grad_()
    pos = torch.randint(0, T, (B, T)) if per_row else torch.arange(T)
    cos, sin = (t.cuda() for t in rope_cos_sin(pos, r, 10000.0))
    o = torch.randn(B, H, T, vd, device="cuda").bfloat16().transpose(1, 2).requires_grad_()  # flex's layout
    gl = torch.randn(B, T, H, device="cuda").bfloat16().requires_grad_()
    dys = [torch.randn(B, T, H, nope + r, device="cuda"), torch.randn(B, T, H, nope + r, device="cuda"),
           torch.randn(B, T, H, vd, device="cuda"), torch.randn(B, T, H * vd, device="cuda")]

    def run(fi, fg, leaves):
        outs = [*fi(*leaves[:3], *cs, nope, True), fg(*leaves[3:])]
        sum((y.double() * d.double()).sum() for y, d in zip(outs, dys)).backward()
        return outs, [t.grad for t in leaves]

    leaves = [q, kvb, k_pe, o, gl]
    cs = (cos, sin)
    got, dgot = run(compiled(mha_inputs), compiled(gate_heads), leaves)
    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    cs = (cos.double(), sin.double())
    want, dwant = run(mha_inputs, gate_heads, ref_leaves)
    for a, b in zip(got + dgot, want + dwant):
        assert a.dtype == torch.bfloat16 and a.shape == b.shape
        err = float((a.double() - b).norm() / b.norm())
        assert err < 8e-3, f"relative error {err:.3g}"
    assert all(t.is_contiguous() for t in got)


@pytest.mark.parametrize("per_row", [False, True])
def test_triton_glue_matches_compiled_gpu(per_row):
    """ops/dsa/triton_glue.py (GLUE_IMPL "triton") against the compiled torch functions (GLUE_IMPL "compile") and
    the torch functions in float64, bf16 at the `small` preset's shapes: mha_inputs (k_pe a slice of the kv
    projection), gate_heads (o in FlexAttention's layout and as a transposed view), rope_first on q_idx and k_idx;
    outputs and every gradient (per_row: packed documents' [B, T, r/2] cos / sin)."""
    from moeadapt.models.common import compiled, rope_cos_sin
    from moeadapt.models.dsa_attn import gate_heads, mha_inputs, rope_first
    from moeadapt.ops.dsa import triton_glue as tg

    g = torch.Generator(device="cuda").manual_seed(SEED)
    B, T, H, nope, r, vd, kvl = 2, 4096, 16, 128, 64, 128, 512

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=g).bfloat16()

    pos = torch.arange(T).repeat(B, 1) % torch.tensor([[T], [1000]]) if per_row else torch.arange(T)
    cos, sin = (t.cuda() for t in rope_cos_sin(pos, r, 10000.0))
    pieces = [  # (name, reference, Triton op, leaves, other arguments)
        ("mha_inputs", mha_inputs, tg.mha_inputs_triton,
         [rnd(B, T, H, nope + r), rnd(B, T, H, nope + vd), rnd(B, T, kvl + r)[..., kvl:]], (cos, sin, nope, True)),
        ("gate_heads flex", gate_heads, tg.gate_heads_triton, [rnd(B, T, H, vd), rnd(B, T, H)], ()),
        ("gate_heads o^T", gate_heads, tg.gate_heads_triton, [rnd(B, H, T, vd).transpose(1, 2), rnd(B, T, H)], ()),
        ("rope_first q_idx", rope_first, tg.rope_first_triton, [rnd(B, T, 16, 128)], (cos, sin, r)),
        ("rope_first k_idx", rope_first, tg.rope_first_triton, [rnd(B, T, 128)], (cos, sin, r)),
    ]
    for name, ref, op, leaves, others in pieces:
        leaves = [t.detach().requires_grad_() for t in leaves]

        def run(fn, xs, extra):
            out = fn(*xs, *extra)
            out = out if isinstance(out, tuple) else (out,)
            # the same bf16 cotangents for every run (seeded per output), in the output's dtype
            dys = [torch.randn(o.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(i))
                   .bfloat16().to(o.dtype) for i, o in enumerate(out)]
            return list(out) + list(torch.autograd.grad(out, xs, dys))

        got = run(op, leaves, others)
        comp = run(compiled(ref), leaves, others)
        leaves64 = [t.detach().double().requires_grad_() for t in leaves]
        want = run(ref, leaves64, [t.double() if isinstance(t, torch.Tensor) else t for t in others])
        for i, (a, c, w) in enumerate(zip(got, comp, want)):
            assert a.dtype == c.dtype and a.shape == c.shape == w.shape, (name, i)
            a, c, w = a.detach().double(), c.detach().double(), w.detach()
            err, err_c = float((a - w).norm() / w.norm()), float((c - w).norm() / w.norm())
            assert err < 8e-3, f"{name} tensor {i}: relative error {err:.3g} (compiled: {err_c:.3g})"
            assert float((a - c).abs().max() / w.abs().max()) < 2e-2, (name, i)
        assert all(t.is_contiguous() for t in got[:len(got) - len(leaves)]), name


def test_dsa_layer_triton_glue_gpu(monkeypatch):
    """The DSA layer in MHA form under bf16 autocast with GLUE_IMPL "triton" against "compile": output, the input's
    gradient and every parameter's gradient."""
    from moeadapt.models import dsa_attn
    from moeadapt.models.common import rope_cos_sin
    from moeadapt.models.model import build_model, materialize
    from moeadapt.ops.dsa import flex_attn as fa
    from tests.conftest import micro_spec

    spec = micro_spec(attn_output_gate=True, n_heads=4, kv_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=16,
                      v_head_dim=32, index_head_dim=32, index_topk=192, max_position_embeddings=512,
                      index_loss_coef=0.1)
    model = materialize(build_model(spec), seed=SEED % 1000)
    layer = next(m for m in model.modules() if isinstance(m, dsa_attn.DSAAttention)).cuda().train()
    T = 256
    monkeypatch.setitem(fa.FLEX_CONFIG, "MHA_FORM", True)
    assert layer._mha_form(T, True)
    x = torch.randn(2, T, spec.hidden_size, device="cuda")
    dy = torch.randn(2, T, spec.hidden_size, device="cuda")
    cos, sin = (t.cuda() for t in rope_cos_sin(torch.arange(T), spec.qk_rope_head_dim, spec.rope_theta))
    out = []
    for impl in ("compile", "triton"):
        monkeypatch.setattr(dsa_attn, "GLUE_IMPL", impl)
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, aux = layer(xx, cos=cos, sin=sin)
        ((y.float() * dy).sum() + aux["index_kl"]).backward()
        out.append([y.float(), xx.grad, aux["index_kl"]] + [p.grad for p in layer.parameters() if p.grad is not None])
    assert len(out[0]) == len(out[1])
    for a, b in zip(*out):  # the same bf16 math, rounded once (Triton) or as the compiled graph rounds
        err = float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())
        assert err < 2e-2, f"relative error {err:.3g}"
