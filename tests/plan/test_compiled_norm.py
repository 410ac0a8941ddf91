"""The planner's accounting of the GPU's compiled RMSNorm (models/common.py: torch.compile of rms_norm and
add_rms_norm on CUDA): what the compiled graph saves for its backward, measured here with inductor's CPU backend
(the same partitioner decides it on CUDA), against `plan.memory._norm(compiled=True)`: 1/rms only, besides the
norm's inputs (counted by their producers). The eager norm (CPU, selective recompute) saves more: the planner
keeps its itemisation there."""

import shutil

import pytest
import torch

from moeadapt.config import get_preset
from moeadapt.models.common import add_rms_norm, rms_norm
from moeadapt.plan import memory as M

needs_cc = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                              reason="inductor's CPU backend needs a C++ compiler")


def _saved_beyond_inputs(fn, *args):
    """Bytes the autograd graph of fn(*args) saves that are not the storage of one of its tensor arguments or
    outputs (the norm's input and the residual sum are counted by the planner where they are made)."""
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*args)
    outs = out if isinstance(out, tuple) else (out,)
    known = {t.untyped_storage().data_ptr() for t in (*args, *outs) if isinstance(t, torch.Tensor)}
    return sum(t.numel() * t.element_size() for t in saved if t.untyped_storage().data_ptr() not in known)


def _norm_bytes(width, trainable, src_fp32, compiled):
    acc = M._Acc(2)
    M._norm(acc, "n", width, trainable, src_fp32, compiled)
    return acc.none


@needs_cc
def test_compiled_norm_saves_what_the_planner_counts():
    R, d = int(torch.randint(64, 200, ())), 16 * int(torch.randint(4, 12, ()))
    w = torch.rand(d, requires_grad=True)
    x = torch.randn(R, d, requires_grad=True)  # the fp32 residual stream, trainable weight
    xb = torch.randn(R, d, dtype=torch.bfloat16, requires_grad=True)  # a bf16 GEMM output with a gate (KDA)
    gate = torch.randn(R, d, dtype=torch.bfloat16, requires_grad=True)
    a = torch.randn(R, d, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(rms_norm, dynamic=True)
    compiled_add = torch.compile(add_rms_norm, dynamic=True)
    cases = [
        (_saved_beyond_inputs(compiled, x, w, 1e-6, torch.bfloat16), _norm_bytes(d, True, True, True)),
        (_saved_beyond_inputs(compiled, xb, w, 1e-6, torch.bfloat16, gate), _norm_bytes(d, True, False, True)),
        (_saved_beyond_inputs(compiled_add, x, a, w, 1e-6, torch.bfloat16), _norm_bytes(d, True, True, True)),
    ]
    for got, planned in cases:
        assert got == R * planned, (got, R * planned)
    # the eager norm keeps its normalised rows (and an fp32 copy of a bf16 input): the compiled accounting
    # would miss them there
    eager = _saved_beyond_inputs(rms_norm, xb, w, 1e-6, torch.bfloat16, gate)
    assert eager > R * _norm_bytes(d, True, False, True) + R * d * 4


def test_planner_counts_compiled_norms_on_the_gpu_path_only():
    """GPU kernel path without selective recompute: no normalised copies or fp32 upcasts in a layer's itemisation;
    under selective recompute (eager norms inside its dispatch mode) and on CPU (act_bytes 4) they are there."""
    spec = get_preset("small")

    def names(**kw):
        acc = M._layer_acc(spec, 1, 4096, "kernel", kw.pop("act_bytes", 2), True, frozenset(), 0, 4096, **kw)
        return [n for n, b, _ in acc.items if b and (n.endswith(".normed") or n.endswith(".fp32_in"))]

    assert names() == []
    assert "attn_norm.normed" in names(selective=True) and "o_norm.fp32_in" in names(selective=True)
    assert "o_norm.normed" in names(act_bytes=4)
