"""Grouped GEMMs and GroupedExperts given more rows than offsets[-1] (the EP exchange's padding rows, which
belong to no expert): the real rows' outputs and every gradient equal the float64 per-row reference on the
real rows alone, with NaN in the padding rows (so a padding row computed into anything real would show)."""

from __future__ import annotations

import os

import pytest
import torch

from moeadapt.ops.moe import grouped_lora, grouped_mm, offsets_from_counts

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1"))]


def _rows(seed, E, I, pad):
    g = torch.Generator().manual_seed(seed)
    counts = torch.randint(0, 6, (E,), generator=g)
    counts[0] = 0  # an empty expert too
    n = int(counts.sum())
    x = torch.randn(n + pad, I, generator=g)
    x[n:] = float("nan")
    return x, counts, n, g


def _expert_of(counts):
    return torch.repeat_interleave(torch.arange(len(counts)), counts)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grouped_mm_and_lora_ignore_rows_past_offsets(seed, backend):
    E, I, O, R = 3, 8, 16, 4
    x, counts, n, g = _rows(seed, E, I, pad=5)
    w = torch.randn(E, I, O, generator=g, requires_grad=True)
    A = torch.randn(E, I, R, generator=g, requires_grad=True)
    B = torch.randn(E, R, O, generator=g, requires_grad=True)
    gy = torch.randn(n, O, generator=g)
    e = _expert_of(counts)
    x.requires_grad_()
    offs = offsets_from_counts(counts)
    for name, fn, ref in (
        ("grouped_mm", lambda: grouped_mm(x, w, offs, backend=backend),
         lambda x64: torch.einsum("ni,nio->no", x64, w.double()[e])),
        ("grouped_lora", lambda: grouped_lora(x, A, B, offs, 0.5, w, backend=backend),
         lambda x64: torch.einsum("ni,nio->no", x64, w.double()[e])
         + 0.5 * torch.einsum("nr,nro->no", torch.einsum("ni,nir->nr", x64, A.double()[e]), B.double()[e])),
    ):
        for t in (x, w, A, B):
            t.grad = None
        y = fn()
        assert y.shape == (n + 5, O), name
        (y[:n] * gy).sum().backward()
        got = {"y": y[:n].detach(), "dx": x.grad[:n], "dw": w.grad}
        if name == "grouped_lora":
            got.update(dA=A.grad, dB=B.grad)
        x64 = x.detach()[:n].double().requires_grad_()
        for t in (w, A, B):
            t.grad = None
        y64 = ref(x64)
        (y64 * gy.double()).sum().backward()
        want = {"y": y64.detach(), "dx": x64.grad, "dw": w.grad}
        if name == "grouped_lora":
            want.update(dA=A.grad, dB=B.grad)
        for k, v in got.items():
            assert torch.isfinite(v).all(), f"{name} {backend}: {k} picked up a padding row's NaN"
            assert torch.allclose(v.double(), want[k].double(), atol=1e-4, rtol=1e-4), f"{name} {backend}: {k}"


@pytest.mark.parametrize("lora", [False, True])
def test_grouped_experts_ignore_rows_past_offsets(seed, lora):
    from moeadapt.lora.layers import GroupedLoRALinear
    from moeadapt.models.moe import GroupedExperts

    E, L, F = 3, 8, 12
    x, counts, n, g = _rows(seed, E, L, pad=7)
    torch.manual_seed(seed)
    ex = GroupedExperts(E, L, F)
    for lin in (ex.w1, ex.w2, ex.w3):
        torch.nn.init.normal_(lin.weight, std=0.3)
    if lora:
        for name in ("w1", "w2", "w3"):
            m = GroupedLoRALinear(getattr(ex, name), rank=2, alpha=4.0)
            torch.nn.init.normal_(m.lora_B, std=0.3)
            setattr(ex, name, m)
    ex.backend = "reference"
    for m in ex.modules():
        if hasattr(m, "backend"):
            m.backend = "reference"
    gy = torch.randn(n, L, generator=g)
    x.requires_grad_()
    y = ex(x, offsets_from_counts(counts))
    (y[:n] * gy).sum().backward()
    params = [p for p in ex.parameters() if p.requires_grad]
    got = [x.grad[:n]] + [p.grad for p in params]
    assert all(torch.isfinite(t).all() for t in got), "a padding row's NaN reached a real gradient"
    # the reference: float64, each real row through its own expert
    e = _expert_of(counts)
    x64 = x.detach()[:n].double().requires_grad_()
    for p in params:
        p.grad = None

    def lin(m, h):
        W = m.weight.double()[e]  # [n, out, in]
        out = torch.einsum("ni,noi->no", h, W)
        if hasattr(m, "lora_A"):
            out = out + m.scaling * torch.einsum("nr,nro->no", torch.einsum("ni,nir->nr", h, m.lora_A.double()[e]),
                                                 m.lora_B.double()[e])
        return out

    y64 = lin(ex.w2, torch.nn.functional.silu(lin(ex.w1, x64)) * lin(ex.w3, x64))
    (y64 * gy.double()).sum().backward()
    assert torch.allclose(y[:n].double(), y64, atol=1e-5, rtol=1e-5), "real rows' outputs"
    want = [x64.grad] + [p.grad for p in params]
    for a, b in zip(got, want):
        assert torch.allclose(a.double(), b.double(), atol=1e-5, rtol=1e-5), "a gradient differs"
