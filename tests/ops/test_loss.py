"""moeadapt.ops.loss.linear_cross_entropy: the chunked backend against F.cross_entropy in float64, values and
gradients of h and W, ignored labels, several chunks (a small CHUNK_ELEMENTS), a frozen head, and the model's
loss through it matching the logits path."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from moeadapt.ops.loss import chunked, linear_cross_entropy

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
CHUNKED = ["chunked", pytest.param("triton", marks=pytest.mark.skipif(
    not (INTERPRET or torch.cuda.is_available()), reason="needs TRITON_INTERPRET=1"))]


def _rel(a, b):
    return float((a.detach().double() - b.detach().double()).norm() / b.detach().double().norm().clamp(min=1e-30))


def _case(N=37, D=24, V=101, dtype=torch.float32):
    h = torch.randn(N, D, dtype=dtype)
    w = torch.randn(V, D, dtype=dtype) * 0.3
    labels = torch.randint(0, V, (N,))
    labels[torch.rand(N) < 0.25] = -100
    weight = torch.rand(N)
    return h, w, labels, weight


def _ref64(h, w, labels, weight):
    hr, wr = h.double().requires_grad_(), w.double().requires_grad_()
    per = F.cross_entropy(hr @ wr.t(), labels, ignore_index=-100, reduction="none")
    loss = (per * weight.double()).sum()
    loss.backward()
    return loss.detach(), hr.grad, wr.grad


@pytest.mark.parametrize("backend", CHUNKED)
@pytest.mark.parametrize("chunk_rows", [None, 5])  # one chunk; 5-row chunks with a ragged last one
@pytest.mark.parametrize("V", [101, 2500])  # one vocabulary block of the Triton kernel; three, the last ragged
def test_chunked_matches_float64(seed, monkeypatch, chunk_rows, backend, V):
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 1 << 26 if chunk_rows is None else V * chunk_rows)
    h, w, labels, weight = _case(V=V)
    loss_r, dh_r, dw_r = _ref64(h, w, labels, weight)
    hc, wc = h.clone().requires_grad_(), w.clone().requires_grad_()
    loss = linear_cross_entropy(hc, wc, labels, weight, backend=backend)
    (2.5 * loss).backward()  # a non-unit upstream gradient scales both
    assert abs(float(loss.detach()) - float(loss_r)) / abs(float(loss_r)) < 1e-5
    assert _rel(hc.grad, 2.5 * dh_r) < 1e-5 and _rel(wc.grad, 2.5 * dw_r) < 1e-5
    assert float(hc.grad[labels == -100].abs().max()) == 0.0  # ignored rows: no gradient


@pytest.mark.parametrize("backend", CHUNKED)
def test_chunked_bf16_and_frozen_head(seed, monkeypatch, backend):
    monkeypatch.setattr(chunked, "CHUNK_ELEMENTS", 101 * 8)
    h, w, labels, weight = _case()
    loss_r, dh_r, _ = _ref64(h.bfloat16().float(), w.bfloat16().float(), labels, weight)
    hb = h.bfloat16().requires_grad_()
    wb = w.bfloat16()  # frozen: no dW
    loss = linear_cross_entropy(hb, wb, labels, weight, backend=backend)
    loss.backward()
    assert hb.grad.dtype == torch.bfloat16 and wb.grad is None
    assert abs(float(loss.detach()) - float(loss_r)) / abs(float(loss_r)) < 1e-2
    assert _rel(hb.grad, dh_r) < 1e-2


@pytest.mark.parametrize("backend", CHUNKED)
def test_no_grad_gives_the_loss_only(seed, backend):
    h, w, labels, weight = _case()
    with torch.no_grad():
        loss = linear_cross_entropy(h.requires_grad_(), w, labels, weight, backend=backend)
    assert not loss.requires_grad
    assert abs(float(loss) - float(_ref64(h.detach(), w, labels, weight)[0])) < 1e-4


def test_model_loss_through_ops_loss_matches_logits_path(seed):
    from moeadapt.models.model import build_model, materialize
    from tests.conftest import micro_spec

    model = materialize(build_model(micro_spec(n_layers=2), "meta"), "cpu", seed=seed % 1000)
    x = torch.randint(0, 264, (4, 12))
    y = torch.randint(0, 264, (4, 12))
    y[0, :5] = -100
    for mb in (1, 2):
        model.set_backend("reference")
        ref = model(x, y, return_logits=True, micro_batches=mb).loss  # logits, then F.cross_entropy
        model.backend = "chunked"
        out = model(x, y, return_logits=False, micro_batches=mb)
        assert out.logits is None
        assert abs(float(out.loss) - float(ref)) < 1e-5 * abs(float(ref))


def test_bad_inputs_raise_one_message():
    h, w, labels, weight = _case()
    with pytest.raises(ValueError, match=r"h \[N, D\] and w \[V, D\] with the same D"):
        linear_cross_entropy(h, w[:, :5], labels, weight)
    with pytest.raises(ValueError, match=r"labels and weight must have shape \[N\]"):
        linear_cross_entropy(h, w, labels[:3], weight)
    with pytest.raises(ValueError, match="backend must be one of"):
        linear_cross_entropy(h, w, labels, weight, backend="fused")
