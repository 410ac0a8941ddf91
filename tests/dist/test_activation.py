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
