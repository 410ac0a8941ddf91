"""moeadapt.ops.moe on CUDA: the Triton and torch._grouped_mm paths against the reference.

Skipped without CUDA. Sizes are moderate (thousands of rows, hundreds of columns) so tiling,
masking and empty experts are all exercised; bf16 is compared with an fp32 reference.
Run with TRITON_INTERPRET=0: tests/conftest.py defaults it to 1, which would interpret the kernels.
"""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch

from moeadapt.ops import moe as ops
from moeadapt.ops.moe import grouped_lora, grouped_mm, offsets_from_counts, permute, unpermute

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"


@pytest.fixture
def gen():
    seed = int(os.environ.get("MOE_TEST_SEED", random.randrange(2**31)))
    print(f"MOE_TEST_SEED={seed}")
    torch.manual_seed(seed)
    return torch.Generator(device=DEV).manual_seed(seed)


def _routing(T, K, E, zipf=False, drop=0.05):
    p = (1.0 / torch.arange(1, E + 1, device=DEV) ** 1.2) if zipf else torch.ones(E, device=DEV)
    p[E // 3] = 0  # one expert with no token
    ids = torch.multinomial(p.expand(T, E), K, replacement=False)
    ids[torch.rand(T, K, device=DEV) < drop] = -1
    return ids


def _lora_case(E, I, O, R):
    """Grouped-LoRA inputs, bf16: Zipf routing of 2048 tokens top-4 (one expert empty), rows x [N, I], A [E, I, R],
    B [E, R, O], a frozen base [E, O, I] and an output gradient [N, O]."""
    ids = _routing(2048, 4, E, zipf=True)
    counts = torch.bincount(ids[ids >= 0], minlength=E)
    N = int(counts.sum())
    x = torch.randn(N, I, device=DEV, dtype=torch.bfloat16)
    A = (torch.randn(E, I, R, device=DEV) / I**0.5).bfloat16()
    B = (torch.randn(E, R, O, device=DEV) / R**0.5).bfloat16()
    w_EOI = (torch.randn(E, O, I, device=DEV) / I**0.5).bfloat16()
    return counts, offsets_from_counts(counts), x, A, B, w_EOI, torch.randn(N, O, device=DEV, dtype=torch.bfloat16)


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("T,K,E,D,zipf", [(4096, 8, 64, 1024, False), (3000, 4, 200, 320, True), (1, 2, 4, 64, False)])
def test_permute_unpermute_gpu(gen, T, K, E, D, zipf):
    ids = _routing(T, K, E, zipf)
    x = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
    w = torch.rand(T, K, device=DEV)
    dy = torch.randn(T, D, device=DEV, dtype=torch.bfloat16)
    out = {}
    for be in ("triton", "reference"):
        xl, wl = x.clone().requires_grad_(True), w.clone().requires_grad_(True)
        xs, ri, counts = permute(xl, ids, E, backend=be)
        y = unpermute(xs.float().mul(1.5).to(xs.dtype), ri, wl, T, backend=be)
        (y.float() * dy.float()).sum().backward()
        out[be] = (xs, ri, counts, y, xl.grad, wl.grad)
    t, r = out["triton"], out["reference"]
    assert torch.equal(t[1], r[1]) and torch.equal(t[2], r[2]) and torch.equal(t[0], r[0])
    assert _rel(t[3], r[3]) < 1e-2 and _rel(t[4], r[4]) < 1e-2 and _rel(t[5], r[5]) < 1e-2


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("E,I,O,zipf,dtype", [(64, 1024, 2048, False, torch.bfloat16),
                                              (200, 256, 96, True, torch.bfloat16),
                                              (16, 128, 64, False, torch.float32)])
def test_grouped_mm_gpu(gen, backend, E, I, O, zipf, dtype):
    if backend == "torch" and dtype == torch.float32:
        pytest.skip("torch._grouped_mm is a bf16 path")
    ids = _routing(4096, 4, E, zipf)
    counts = torch.bincount(ids[ids >= 0], minlength=E)
    offs = offsets_from_counts(counts)
    N = int(counts.sum())
    x = torch.randn(N, I, device=DEV, dtype=dtype)
    w_EOI = (torch.randn(E, O, I, device=DEV) / I**0.5).to(dtype)
    dy = torch.randn(N, O, device=DEV, dtype=dtype)
    res = {}
    for be in (backend, "reference"):
        xl, wl = x.clone().requires_grad_(True), w_EOI.clone().requires_grad_(True)
        y = grouped_mm(xl, wl.transpose(1, 2), offs, backend=be)
        y.backward(dy)
        res[be] = (y, xl.grad, wl.grad)
    for a, b in zip(res[backend], res["reference"]):
        assert _rel(a, b) < 2e-2


@pytest.mark.parametrize("backend", ["triton", "torch"])
@pytest.mark.parametrize("with_base", [False, True])
def test_grouped_lora_gpu(gen, backend, with_base):
    E, I, O, R = 32, 512, 768, 16
    counts, offs, x, A, B, w_EOI, dy = _lora_case(E, I, O, R)
    w = w_EOI.transpose(1, 2) if with_base else None
    res = {}
    for be in (backend, "reference"):
        xl, Al, Bl = (t.clone().requires_grad_(True) for t in (x, A, B))
        y = grouped_lora(xl, Al, Bl, offs, 2.0, w_EIO=w, backend=be)
        y.backward(dy)
        res[be] = (y, xl.grad, Al.grad, Bl.grad)
    for a, b in zip(res[backend], res["reference"]):
        assert _rel(a, b) < 2e-2


def test_swiglu_gpu(gen):
    gu = torch.randn(5000, 2048, device=DEV, dtype=torch.bfloat16)
    da = torch.randn(5000, 1024, device=DEV, dtype=torch.bfloat16)
    res = {}
    for be in ("triton", "reference"):
        x = gu.clone().requires_grad_(True)
        a = ops.swiglu(x, backend=be)
        a.backward(da)
        res[be] = (a, x.grad)
    for a, b in zip(res["triton"], res["reference"]):
        assert _rel(a, b) < 1e-2


def test_swiglu_pair_gpu(gen):
    """The model's SwiGLU (separate w1 / w3 outputs, gate a strided view) against fp32 torch."""
    g = torch.randn(5000, 1040, device=DEV, dtype=torch.bfloat16)[:, :1024]
    u = torch.randn(5000, 1024, device=DEV, dtype=torch.bfloat16)
    da = torch.randn(5000, 1024, device=DEV, dtype=torch.bfloat16)
    gg, uu = g.clone().requires_grad_(True), u.clone().requires_grad_(True)
    a = ops.swiglu_pair(gg, uu, backend="triton")
    a.backward(da)
    g32, u32 = g.float().requires_grad_(True), u.float().requires_grad_(True)
    a32 = torch.nn.functional.silu(g32) * u32
    a32.backward(da.float())
    for x, y in ((a, a32), (gg.grad, g32.grad), (uu.grad, u32.grad)):
        assert _rel(x, y) < 1e-2


def test_auto_backends_gpu(gen):
    ids = _routing(1024, 4, 32)
    x = torch.randn(1024, 256, device=DEV, dtype=torch.bfloat16)
    xs, ri, counts = permute(x, ids, 32)
    offs = offsets_from_counts(counts)
    w = torch.randn(32, 256, 128, device=DEV, dtype=torch.bfloat16) / 16
    A = torch.randn(32, 256, 16, device=DEV, dtype=torch.bfloat16) / 16
    B = torch.randn(32, 16, 128, device=DEV, dtype=torch.bfloat16) / 4
    y = grouped_lora(xs, A, B, offs, 2.0, w_EIO=w)
    y_ref = grouped_lora(xs, A, B, offs, 2.0, w_EIO=w, backend="reference")
    assert _rel(y, y_ref) < 2e-2
    out = unpermute(ops.swiglu(torch.cat([y, y], 1)), ri, torch.rand(1024, 4, device=DEV), 1024)
    assert out.shape == (1024, 128) and torch.isfinite(out.float()).all()


@pytest.mark.parametrize("dx", ["cat", "split"])
@pytest.mark.parametrize("persistent", [True, False])
def test_grouped_lora_fused_gpu(gen, dx, persistent):
    """The fused backend (LoRA folded into torch._grouped_mm via [W | Bᵀ]) against an fp32 reference,
    bf16, Zipf routing with an empty expert; the frozen base columns of the buffer stay untouched."""
    from moeadapt.ops.moe import fused_lora

    E, I, O, R = 32, 512, 768, 16
    counts, offs, x, A, B, w_EOI, dy = _lora_case(E, I, O, R)
    w_cat = fused_lora.make_cat_buffer(w_EOI, R) if persistent else None
    w = w_cat[:, :, :I].transpose(1, 2) if persistent else w_EOI.transpose(1, 2)
    res = {}
    for be in ("fused", "reference"):
        xl, Al, Bl = (t.float().clone().requires_grad_(True) if be == "reference" else t.clone().requires_grad_(True)
                      for t in (x, A, B))
        wb = w.float() if be == "reference" else w
        y = grouped_lora(xl, Al, Bl, offs, 2.0, w_EIO=wb, backend=be, w_cat=w_cat if be == "fused" else None, dx=dx)
        y.backward(dy.to(y.dtype))
        res[be] = (y, xl.grad, Al.grad, Bl.grad)
    for a, b in zip(res["fused"], res["reference"]):
        assert _rel(a, b) < 2e-2
    empty = counts == 0
    assert res["fused"][2][empty].abs().max() == 0 and res["fused"][3][empty].abs().max() == 0
    if persistent:
        assert torch.equal(w_cat[:, :, :I], w_EOI)


def _experts_case(zipf):
    """Inputs of the LoRA'd SwiGLU experts checks: bf16, T = 2000 tokens, top-4 of 32 experts, L = 512, F = 384,
    r = 16 on packed gate/up ([E, 2F, L]) and down ([E, L, F]), the routing's permutation and an output grad."""
    from moeadapt.ops.moe import permutation

    T, K, E, L, Fh, R = 2000, 4, 32, 512, 384, 16
    ids = _routing(T, K, E, zipf=zipf)
    ri, counts = permutation(ids, E)
    bf = torch.bfloat16
    return SimpleNamespace(
        K=K, E=E, L=L, Fh=Fh, R=R, ids=ids, ri=ri, counts=counts, offs=offsets_from_counts(counts),
        z=torch.randn(T, L, device=DEV, dtype=bf),
        A1=(torch.randn(E, L, R, device=DEV) / L**0.5).to(bf), B1=(torch.randn(E, R, 2 * Fh, device=DEV) / R**0.5).to(bf),
        A2=(torch.randn(E, Fh, R, device=DEV) / Fh**0.5).to(bf), B2=(torch.randn(E, R, L, device=DEV) / R**0.5).to(bf),
        w1=(torch.randn(E, 2 * Fh, L, device=DEV) / L**0.5).to(bf),
        w2=(torch.randn(E, L, Fh, device=DEV) / Fh**0.5).to(bf),
        dy=torch.randn(len(ri), L, device=DEV, dtype=bf))


def _check_experts(c, run):
    """run(z, A1, B1, A2, B2) -> y (the bf16 kernels) against the unfolded fp32 reference (permute -> grouped_lora
    -> swiglu -> grouped_lora): y, dz (token order), dA, dB of both projections within 2%; the empty expert's
    adapter gradients exactly zero."""
    res = {}
    for be in ("kernel", "reference"):
        cast = (lambda t: t.float()) if be == "reference" else (lambda t: t)
        zz, a1, b1, a2, b2 = (cast(t).clone().requires_grad_(True) for t in (c.z, c.A1, c.B1, c.A2, c.B2))
        if be == "kernel":
            y = run(zz, a1, b1, a2, b2)
        else:
            xs, ri_ref, _ = permute(zz, c.ids, c.E, backend="reference")
            assert torch.equal(ri_ref, c.ri)
            gu = grouped_lora(xs, a1, b1, c.offs, 2.0, w_EIO=c.w1.float().transpose(1, 2), backend="reference")
            y = grouped_lora(ops.swiglu(gu, backend="reference"), a2, b2, c.offs, 2.0,
                             w_EIO=c.w2.float().transpose(1, 2), backend="reference")
        y.backward(c.dy.to(y.dtype))
        res[be] = (y, zz.grad, a1.grad, b1.grad, a2.grad, b2.grad)
    for a, b in zip(res["kernel"], res["reference"]):
        assert _rel(a, b) < 2e-2
    empty = c.counts == 0
    for g in res["kernel"][2:]:
        assert g[empty].abs().max() == 0


@pytest.mark.parametrize("dx", ["cat", "split"])
@pytest.mark.parametrize("zipf", [False, True])
def test_fold_io_gpu(gen, dx, zipf):
    """fused_lora's folded input passes (bf16): gate/up with the permute gather in its LoRA-in pass, down with SwiGLU in
    its LoRA-in pass and the SwiGLU backward in its dx epilogue, against the unfolded fp32 reference."""
    from moeadapt.ops.moe import fused_lora

    c = _experts_case(zipf)
    c1, c2 = fused_lora.make_cat_buffer(c.w1, c.R), fused_lora.make_cat_buffer(c.w2, c.R)

    def run(zz, a1, b1, a2, b2):
        gu = fused_lora.grouped_lora_fused_gather(zz, c.ri, c.K, a1, b1, c.offs, 2.0,
                                                  w_EIO=c1[:, :, :c.L].transpose(1, 2), w_cat=c1, dx=dx)
        return fused_lora.grouped_lora_fused_swiglu(gu, None, a2, b2, c.offs, 2.0,
                                                    w_EIO=c2[:, :, :c.Fh].transpose(1, 2), w_cat=c2, dx=dx)

    _check_experts(c, run)
    assert torch.equal(c1[:, :, :c.L], c.w1) and torch.equal(c2[:, :, :c.Fh], c.w2)


@pytest.mark.parametrize("dx,col_split,buf", [("cat", 1, False), ("split", 1, False), ("cat", 8, False),
                                              ("cat", 1, True)])
@pytest.mark.parametrize("zipf", [False, True])
def test_lean_lora_gpu(gen, monkeypatch, dx, col_split, buf, zipf):
    """lean_lora (bf16): gate/up base GEMM at native width with the LoRA terms in the gather / SwiGLU passes,
    against the unfolded fp32 reference; buf: the gate/up weight a view of a gate_up_buffer (_LeanCatFn)."""
    from moeadapt.ops.moe import fused_lora, lean_lora

    monkeypatch.setitem(lean_lora.LEAN_TILES, "swiglu_bwd", {**lean_lora.LEAN_TILES["swiglu_bwd"], "SPLIT": col_split})
    c = _experts_case(zipf)
    c2 = fused_lora.make_cat_buffer(c.w2, c.R)
    F = c.w1.shape[1] // 2
    wk = lean_lora.gate_up_buffer(c.w1[:, :F], c.w1[:, F:], c.R) if buf else None
    w_gu = wk[:, :2 * F] if buf else c.w1
    _check_experts(c, lambda zz, a1, b1, a2, b2: lean_lora.lean_lora_experts(
        zz, c.ri, c.K, c.offs, w_gu, a1, b1, 2.0, c2[:, :, :c.Fh].transpose(1, 2), a2, b2, 2.0, wcat_d=c2, dx=dx,
        wk_gu=wk))
    assert torch.equal(c2[:, :, :c.Fh], c.w2)
    if buf:
        assert torch.equal(wk[:, :2 * F], c.w1)


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_grouped_mm_and_lora_ignore_rows_past_offsets_gpu(gen, backend):
    """The EP exchange's padding rows (past offsets[-1], here NaN) reach no real output or weight gradient, on
    the compiled Triton kernels and torch._grouped_mm, bf16 against an fp32 reference on the real rows."""
    E, I, O, R, pad = 16, 256, 384, 16, 77
    counts, offs, x, A, B, w_EOI, dy = _lora_case(E, I, O, R)
    N = x.shape[0]
    x = torch.cat([x, torch.full((pad, I), float("nan"), device=DEV, dtype=x.dtype)])
    w = w_EOI.transpose(1, 2)
    for name in ("grouped_mm", "grouped_lora"):
        res = {}
        for be in (backend, "reference"):
            xl, Al, Bl, wl = (t.detach().clone() for t in (x, A, B, w))
            if be == "reference":
                xl, Al, Bl, wl = xl[:N].float(), Al.float(), Bl.float(), wl.float()
            for t in (xl, Al, Bl, wl):
                t.requires_grad_(True)
            y = (grouped_mm(xl, wl, offs, backend=be) if name == "grouped_mm"
                 else grouped_lora(xl, Al, Bl, offs, 2.0, w_EIO=wl, backend=be))
            y[:N].backward(dy.to(y.dtype))
            res[be] = [y[:N], xl.grad[:N], wl.grad] + ([Al.grad, Bl.grad] if name == "grouped_lora" else [])
        for a, b in zip(res[backend], res["reference"]):
            if a is None:  # a frozen base gets no gradient on this path
                continue
            assert torch.isfinite(a).all(), f"{name} {backend}: a padding row's NaN reached a real value"
            assert _rel(a, b) < 2e-2, name
