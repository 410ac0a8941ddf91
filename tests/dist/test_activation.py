"""Activation checkpointing (one process): selective recomputes no GEMM, full recomputes them, and neither
changes a gradient or the routed-token counts."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from _harness import batch, build, micro_spec
from torch.utils._python_dispatch import TorchDispatchMode

pytestmark = pytest.mark.dist


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_selective_keeps_gemms_and_full_recomputes_them():
    from moeadapt.parallel import apply_activation_checkpointing

    spec = micro_spec()
    x, y = batch(spec, 2, 32)
    ops, grads, tokens = {}, {}, {}
    for mode in ("none", "selective", "full"):
        model = build(spec, lora=False)
        apply_activation_checkpointing(model, mode)
        out = model(x, y, return_logits=False)
        with _CountOps() as c:
            (out.loss + out.aux_loss).backward()
        ops[mode] = c.counts
        grads[mode] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        tokens[mode] = [b.clone() for n, b in model.named_buffers() if n.endswith("tokens_per_expert")]
    gemm = {m: ops[m]["mm"] + ops[m]["bmm"] + ops[m]["addmm"] for m in ops}
    assert gemm["selective"] == gemm["none"] < gemm["full"], gemm
    assert ops["selective"]["rsqrt"] > ops["none"]["rsqrt"], "selective should recompute the norms"
    for mode in ("selective", "full"):
        for n, g in grads["none"].items():
            assert torch.equal(grads[mode][n], g), f"{mode}: grad {n} differs"
        for a, b in zip(tokens[mode], tokens["none"]):
            assert torch.equal(a, b), f"{mode}: the recompute counted routed tokens again"


@pytest.mark.parametrize("lora", [False, True])
def test_recompute_under_bf16_autocast_keeps_every_gradient(lora):
    """Under bf16 autocast (the GPU step's precision; CPU autocast here) the model runs the grouped projections
    (models/shared_input.py) and, with LoRA, the frozen-base adapter nodes, which add the adapter's term into a
    GEMM's output: selective recompute caches that GEMM's output and must not see it changed in place. Selective
    and full recompute give the no-recompute gradients."""
    from moeadapt.parallel import apply_activation_checkpointing

    spec = micro_spec(attn_output_gate=True)
    x, y = batch(spec, 2, 32)
    grads = {}
    for mode in ("none", "selective", "full"):
        model = build(spec, lora=lora)
        apply_activation_checkpointing(model, mode)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x, y, return_logits=False)
        (out.loss + out.aux_loss).backward()
        grads[mode] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert grads["none"]
    for mode in ("selective", "full"):
        assert grads[mode].keys() == grads["none"].keys(), mode
        for n, g in grads["none"].items():
            torch.testing.assert_close(grads[mode][n], g, rtol=1e-5, atol=1e-7, msg=f"{mode}: grad {n}")


def _host_copies(fn) -> int:
    """How many block inputs `fn`'s graph sends to host memory (_ToHost nodes)."""
    seen, todo, n = set(), [fn], 0
    while todo:
        f = todo.pop()
        if f is None or f in seen:
            continue
        seen.add(f)
        n += type(f).__name__ == "_ToHostBackward"
        todo += [g for g, _ in f.next_functions]
    return n


def test_offloaded_full_recompute_is_exact():
    from moeadapt.config import ParallelSpec
    from moeadapt.parallel import apply_activation_checkpointing

    spec = micro_spec()
    x, y = batch(spec, 2, 40)
    res = {}
    for offload in (False, True):
        model = build(spec, lora=False)  # (a frozen embedding's output needs no grad: no node to count)
        apply_activation_checkpointing(model, "full", offload=offload)
        out = model(x, y, return_logits=False)
        loss = out.loss + out.aux_loss
        res[offload] = (_host_copies(loss.grad_fn), float(loss.detach()))
        loss.backward()
        res[offload] += ({n: p.grad for n, p in model.named_parameters() if p.grad is not None},)
    assert res[False][0] == 0 and res[True][0] == spec.n_layers  # one host copy per block input
    assert res[True][1] == res[False][1]
    for n, g in res[False][2].items():
        assert torch.equal(res[True][2][n], g), f"offload: grad {n} differs"
    with pytest.raises(ValueError, match="offload_activations offloads the block inputs.*full"):
        apply_activation_checkpointing(build(spec, lora=False), "selective", offload=True)
    with pytest.raises(ValueError, match="set parallel.activation_checkpointing: full"):
        ParallelSpec(offload_activations=True)
    assert ParallelSpec(offload_activations=True, activation_checkpointing="full").offload_activations


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_recompute_reuses_the_forwards_top_k(monkeypatch, mode):
    """A fully recomputed DSA block takes the top-k its forward selected instead of running the indexer again
    (at 131k tokens the indexer is 42% of the step); selective recompute still runs it (SAC replays saved aten
    outputs in call order). The gradients equal those without checkpointing."""
    import moeadapt.models.dsa_attn as dsa_attn
    from moeadapt.parallel import apply_activation_checkpointing

    calls = []
    real = dsa_attn.lightning_indexer

    def counted(*a, **kw):
        out = real(*a, **kw)
        calls.append(out)
        return out

    monkeypatch.setattr(dsa_attn, "lightning_indexer", counted)
    spec = micro_spec()
    n_dsa = sum(isinstance(m, dsa_attn.DSAAttention) and m.index_from is None for m in build(spec, lora=False).modules())
    assert n_dsa > 0
    x, y = batch(spec, 2, 32)
    grads = {}
    for m in ("none", mode):
        calls.clear()
        model = build(spec, lora=True)
        apply_activation_checkpointing(model, m)
        out = model(x, y, return_logits=False)
        assert len(calls) == n_dsa
        (out.loss + out.aux_loss).backward()
        assert len(calls) == n_dsa * (2 if m == "selective" else 1), f"{m}: {len(calls)} indexer calls"
        grads[m] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    for n, g in grads["none"].items():
        assert torch.equal(grads[mode][n], g), f"{mode}: grad {n} differs"


def test_selective_recompute_keeps_the_indexers_selection(monkeypatch):
    """The Triton lightning indexer is an op selective checkpointing sees (moeadapt::lightning_indexer): the
    recompute replays its selection instead of running it again, once per DSA layer a step; the gradients are the
    no-recompute ones. (Triton interpreted on CPU; the DSA layers alone on the Triton backend.)"""
    import os

    from moeadapt.models.dsa_attn import DSAAttention
    from moeadapt.ops.dsa import triton_indexer
    from moeadapt.parallel import apply_activation_checkpointing

    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs CUDA or TRITON_INTERPRET=1")
    calls = []
    real = triton_indexer.lightning_indexer_triton
    monkeypatch.setattr(triton_indexer, "lightning_indexer_triton",
                        lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    spec = micro_spec(index_topk=8)
    x, y = batch(spec, 1, 24)
    grads, n_calls = {}, {}
    for mode in ("none", "selective"):
        model = build(spec, lora=False)
        dsa = [m for m in model.modules() if isinstance(m, DSAAttention)]
        for m in dsa:
            m.backend = "triton"
        apply_activation_checkpointing(model, mode)
        calls.clear()
        out = model(x, y, return_logits=False)
        (out.loss + out.aux_loss).backward()
        n_calls[mode] = len(calls)
        grads[mode] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert dsa and n_calls == {"none": len(dsa), "selective": len(dsa)}, n_calls
    for n, g in grads["none"].items():
        torch.testing.assert_close(grads["selective"][n], g, rtol=1e-5, atol=1e-7, msg=n)
