"""Every op's backward takes the cotangent autograd hands it, whatever its layout: expanded (stride 0, what
`.sum()` gives), strided (a slice of a wider tensor) or transposed. Each op's Triton backward (interpreted on
CPU, tiny shapes) must give the gradients that the same cotangent gives when contiguous, and those must match
the float64 reference of the op. A kernel that indexes the cotangent as dense reads past its storage (on a
GPU: an illegal memory access) or reads the wrong elements; both fail here.
"""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = pytest.mark.skipif(not (INTERPRET or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1 or CUDA")


def layouts(shape: tuple[int, ...], gen: torch.Generator, dtype=torch.float32) -> dict[str, torch.Tensor]:
    """Non-contiguous cotangents: random values transposed inside a wider buffer (no unit stride anywhere),
    and a constant expanded from one element (stride 0, what `.sum()` gives)."""
    nd = len(shape)
    rev = tuple(reversed(shape))
    wide = torch.randn(*rev[:-1], 2 * rev[-1], generator=gen, dtype=dtype)[..., ::2]
    strided = wide.permute(*reversed(range(nd)))
    expanded = torch.randn((), generator=gen, dtype=dtype).expand(shape)
    assert strided.shape == expanded.shape == torch.Size(shape)
    assert strided.numel() <= 1 or not (strided.is_contiguous() or expanded.is_contiguous())
    return {"strided": strided.to(DEV), "expanded": expanded.to(DEV)}


def check(fn, inputs: list[torch.Tensor], gen: torch.Generator, ref=None, tol: float = 1e-4) -> None:
    """For each layout of the outputs' cotangents, the op's grads equal the float64 reference `ref`'s for the
    same values (without `ref`: the op's own grads for a contiguous copy of the cotangents)."""
    leaves = [x.detach().clone().to(DEV).requires_grad_(x.requires_grad) for x in inputs]
    outs = fn(*leaves)
    outs = outs if isinstance(outs, tuple) else (outs,)
    diff = [x for x in leaves if x.requires_grad]
    per_out = [layouts(tuple(o.shape), gen, o.dtype) for o in outs]
    for kind in per_out[0]:
        cots = [p[kind] for p in per_out]
        got = torch.autograd.grad(outs, diff, cots, retain_graph=True)
        if ref is None:
            want = torch.autograd.grad(outs, diff, [c.contiguous() for c in cots], retain_graph=True)
        else:
            leaves64 = [x.detach().double().cpu().requires_grad_(x.requires_grad) for x in leaves]
            outs64 = ref(*leaves64)
            outs64 = outs64 if isinstance(outs64, tuple) else (outs64,)
            want = torch.autograd.grad(outs64, [x for x in leaves64 if x.requires_grad],
                                       [c.double().cpu() for c in cots])
        for i, (g, w) in enumerate(zip(got, want)):
            assert torch.isfinite(g).all(), f"{kind} cotangent: grad {i} not finite"
            torch.testing.assert_close(g.double().cpu(), w.double().cpu(), rtol=tol, atol=tol,
                                       msg=f"{kind} cotangent: grad {i}")


@pytest.fixture
def gen():
    s = int.from_bytes(os.urandom(4), "little")
    print(f"cotangent seed={s}")
    return torch.Generator().manual_seed(s)


@pytest.mark.slow  # ~45 s interpreted
def test_kda_output_and_final_state(gen):
    """The crashing call's shape of the problem: final state output, cotangents of o and the final state
    expanded (as `(o.sum() + ht.sum()).backward()` gives) or strided, and an expanded initial state."""
    import torch.nn.functional as F

    from moeadapt.ops.kda import chunk_kda, chunk_kda_reference

    B, T, H, K, V = 1, 20, 1, 16, 16
    q = torch.randn(B, T, H, K, generator=gen).requires_grad_()
    k = F.normalize(torch.randn(B, T, H, K, generator=gen), dim=-1).requires_grad_()
    v = torch.randn(B, T, H, V, generator=gen).requires_grad_()
    g = (-torch.rand(B, T, H, K, generator=gen)).requires_grad_()
    beta = torch.rand(B, T, H, generator=gen).requires_grad_()
    h0 = torch.randn(1, 1, 1, V, generator=gen).expand(B, H, K, V)  # stride 0 in three dims

    def run(*t, backend):
        fn = chunk_kda_reference if backend == "reference" else chunk_kda
        kw = {} if backend == "reference" else {"backend": backend}
        return fn(*t, initial_state=h0.to(t[0].device, t[0].dtype), output_final_state=True, **kw)

    check(lambda *t: run(*t, backend="triton"), [q, k, v, g, beta], gen, ref=lambda *t: run(*t, backend="reference"))


def test_sparse_attention(gen):
    from moeadapt.ops.dsa import sparse_attention

    B, T, HQ, HK, D, DV, topk = 1, 24, 4, 1, 32, 16, 8
    q, k, v = (torch.randn(B, T, h, d, generator=gen).requires_grad_() for h, d in ((HQ, D), (HK, D), (HK, DV)))
    r = torch.rand(B, T, topk, generator=gen)
    idx = (r * (torch.arange(T).view(1, T, 1) + 1)).long()
    idx = torch.sort(idx, -1).values
    dup = torch.zeros_like(idx, dtype=torch.bool)
    dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
    idx = torch.where(dup, -1, idx).to(torch.int32).to(DEV)
    check(lambda a, b, c: sparse_attention(a, b, c, idx, backend="triton"), [q, k, v], gen,
          ref=lambda a, b, c: sparse_attention(a, b, c, idx.cpu(), backend="reference"))


def test_indexer_kl_scalar_cotangent(gen):
    """The KL loss is a scalar: its cotangent can still be an expanded 0-dim view (it is used as a scale)."""
    from moeadapt.ops.dsa import indexer_kl_loss, lightning_indexer

    B, T, HQ, D, HI, DI, topk = 1, 24, 2, 32, 2, 16, 8
    q, k = torch.randn(B, T, HQ, D, generator=gen).to(DEV), torch.randn(B, T, 1, D, generator=gen).to(DEV)
    qi, ki, wi = (torch.randn(*s, generator=gen).to(DEV).requires_grad_() for s in ((B, T, HI, DI), (B, T, DI), (B, T, HI)))
    idx = lightning_indexer(qi.detach(), ki.detach(), wi.detach().abs(), topk, backend="reference")
    grads = []
    for backend in ("triton", "reference"):
        loss = indexer_kl_loss(q, k, idx, qi, ki, wi, backend=backend)
        grads.append(torch.autograd.grad(loss, (qi, ki, wi), torch.tensor([0.5, 3.0], device=DEV)[1]))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def _routing(gen, T=13, K=2, E=4):
    ids = torch.rand(T, E, generator=gen).topk(K, dim=1).indices
    ids[torch.rand(T, K, generator=gen) < 0.2] = -1
    return ids.to(DEV)


def test_permute_unpermute(gen):
    from moeadapt.ops.moe import permute, unpermute

    ids = _routing(gen)
    x = torch.randn(13, 24, generator=gen).requires_grad_()
    check(lambda t: permute(t, ids, 4, backend="triton")[0], [x], gen,
          ref=lambda t: permute(t, ids.cpu(), 4, backend="reference")[0])
    _, row_index, _ = permute(x.detach().to(DEV), ids, 4, backend="triton")
    y = torch.randn(row_index.numel(), 24, generator=gen).requires_grad_()
    w = torch.rand(13, 2, generator=gen).requires_grad_()
    check(lambda a, b: unpermute(a, row_index, b, 13, backend="triton"), [y, w], gen,
          ref=lambda a, b: unpermute(a, row_index.cpu(), b, 13, backend="reference"))


@pytest.mark.parametrize("op", ["grouped_mm", "grouped_lora", "fused_lora", "swiglu", "swiglu_pair"])
def test_grouped_ops(gen, op, monkeypatch):
    from moeadapt.ops.moe import (
        fused_lora,
        grouped_lora,
        grouped_mm,
        offsets_from_counts,
        swiglu,
        swiglu_pair,
    )

    counts = torch.tensor([5, 0, 7, 3])
    offsets = offsets_from_counts(counts).to(DEV)
    N, E, I, O, R = 15, 4, 16, 24, 4
    x = torch.randn(N, I, generator=gen).requires_grad_()
    w = (torch.randn(E, I, O, generator=gen) / 4).requires_grad_()
    A = (torch.randn(E, I, R, generator=gen) / 4).requires_grad_()
    Bm = (torch.randn(E, R, O, generator=gen) / 2).requires_grad_()
    w_frozen = (torch.randn(E, O, I, generator=gen) / 4).to(DEV)
    if op == "grouped_mm":
        check(lambda a, b: grouped_mm(a, b, offsets, backend="triton"), [x, w], gen,
              ref=lambda a, b: grouped_mm(a, b, offsets.cpu(), backend="reference"))
    elif op == "grouped_lora":
        check(lambda a, b, c: grouped_lora(a, b, c, offsets, 2.0, w_EIO=w_frozen.transpose(1, 2), backend="triton"),
              [x, A, Bm], gen, ref=lambda a, b, c: grouped_lora(a, b, c, offsets.cpu(), 2.0,
                                                                w_EIO=w_frozen.cpu().double().transpose(1, 2),
                                                                backend="reference"))
    elif op == "fused_lora":
        monkeypatch.setattr(fused_lora, "_use_triton", lambda t: True)
        check(lambda a, b, c: grouped_lora(a, b, c, offsets, 2.0, w_EIO=w_frozen.transpose(1, 2), backend="fused"),
              [x, A, Bm], gen, ref=lambda a, b, c: grouped_lora(a, b, c, offsets.cpu(), 2.0,
                                                                w_EIO=w_frozen.cpu().double().transpose(1, 2),
                                                                backend="reference"))
    elif op == "swiglu":
        gu = torch.randn(N, 2 * O, generator=gen).requires_grad_()
        check(lambda a: swiglu(a, backend="triton"), [gu], gen, ref=lambda a: swiglu(a, backend="reference"))
    else:
        g, u = (torch.randn(N, O, generator=gen).requires_grad_() for _ in range(2))
        check(lambda a, b: swiglu_pair(a, b, backend="triton"), [g, u], gen,
              ref=lambda a, b: swiglu_pair(a, b, backend="reference"))


def test_lean_lora_experts(gen, monkeypatch):
    """The LoRA'd expert block (gather + base GEMMs + SwiGLU + down projection) with its Triton passes."""
    from moeadapt.ops.moe import fused_lora, lean_lora, offsets_from_counts, permutation

    monkeypatch.setattr(fused_lora, "_use_triton", lambda t: True)
    monkeypatch.setattr(lean_lora, "_use_triton", lambda t: True)
    T, K, E, I, Fh, R, Rd = 13, 2, 4, 16, 24, 4, 4
    ids = _routing(gen, T, K, E)
    row_index, counts = permutation(ids, E, backend="triton")
    offsets = offsets_from_counts(counts)
    w_gu = (torch.randn(E, 2 * Fh, I, generator=gen) / 4).to(DEV)
    w_d = (torch.randn(E, I, Fh, generator=gen) / 5).to(DEV)
    wcat_d = fused_lora.make_cat_buffer(w_d, Rd)
    z = torch.randn(T, I, generator=gen).requires_grad_()
    A = (torch.randn(E, I, R, generator=gen) / 4).requires_grad_()
    B_gu = (torch.randn(E, R, 2 * Fh, generator=gen) / 2).requires_grad_()
    A_d = (torch.randn(E, Fh, Rd, generator=gen) / 5).requires_grad_()
    B_d = (torch.randn(E, Rd, I, generator=gen) / 2).requires_grad_()
    check(lambda *t: lean_lora.lean_lora_experts(t[0], row_index, K, offsets, w_gu, t[1], t[2], 2.0,
                                                 wcat_d[:, :, :Fh].transpose(1, 2), t[3], t[4], 0.5, wcat_d=wcat_d),
          [z, A, B_gu, A_d, B_d], gen)
