"""parallel/expert.py's EPDispatcher on 2 gloo ranks: no host sync in a layer, and the backward all-to-alls
overlap expert compute (each is started before, and waited for after, another chunk's expert backward);
chunked and unchunked dispatch give the same outputs and gradients. (Values against the single-process run:
tests/dist/test_grads.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import spawn

pytestmark = pytest.mark.dist

E, L, K, T = 4, 8, 2, 12


class _Tag(torch.autograd.Function):
    """Identity; its backward logs `what` (the start or the end of a chunk's expert backward)."""

    @staticmethod
    def forward(ctx, x, log, what):
        ctx.log, ctx.what = log, what
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.log.append(ctx.what)
        return g, None, None


class _Experts(torch.nn.Module):
    """Stand-in for GroupedExperts: row r of expert e is scaled by w[e] (a chunk's call is logged); rows past
    offsets[-1] (the exchange's padding) belong to no expert and get 0."""

    def __init__(self, w, log):
        super().__init__()
        self.w, self.log, self.calls = torch.nn.Parameter(w.clone()), log, 0

    def forward(self, x, offsets):
        i, self.calls = self.calls, self.calls + 1
        counts = torch.diff(offsets, prepend=offsets.new_zeros(1)).long()
        x = _Tag.apply(x, self.log, ("expert_bwd_end", i))
        w = torch.cat([self.w, self.w.new_zeros(1, self.w.shape[1])])
        counts = torch.cat([counts, (x.shape[0] - offsets[-1:]).long()])
        y = x * torch.repeat_interleave(w, counts, dim=0)
        return _Tag.apply(y, self.log, ("expert_bwd_begin", i))


def _run(group, chunks, seed, log):
    from moeadapt.parallel import expert as ep_mod

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(seed + rank)
    z = torch.randn(T, L, generator=g, dtype=torch.float64).requires_grad_()
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    wexp = torch.randn(E // 2, L, generator=torch.Generator().manual_seed(seed + 100 + rank), dtype=torch.float64)
    experts = _Experts(wexp, log)
    timing: dict = {}
    y = ep_mod.EPDispatcher(group, chunks, timing=timing)(experts, z, ids, w, E, backend="reference")
    log.append(("forward_done", -1))
    y.backward(torch.ones_like(y) + torch.arange(T, dtype=y.dtype)[:, None])
    return y.detach(), z.grad, experts.w.grad, timing


def _order(rank, world, seed):
    from moeadapt.parallel import expert as ep_mod

    group = dist.new_group(list(range(world)))
    log: list = []
    start, wait, init = ep_mod._Exchange.start, ep_mod._Exchange.wait, ep_mod._Exchange.__init__
    made = []

    def init_(self, *a, **kw):
        init(self, *a, **kw)
        self.chunk = len(made)
        made.append(self)

    def start_(self, key, *a):
        log.append((f"start_{key}", self.chunk))
        return start(self, key, *a)

    def wait_(self, key):
        log.append((f"wait_{key}", self.chunk))
        return wait(self, key)

    ep_mod._Exchange.__init__, ep_mod._Exchange.start, ep_mod._Exchange.wait = init_, start_, wait_
    try:
        y2, gz2, gw2, timing = _run(group, 2, seed, log)
    finally:
        ep_mod._Exchange.__init__, ep_mod._Exchange.start, ep_mod._Exchange.wait = init, start, wait
    y1, gz1, gw1, _ = _run(group, 1, seed, [])
    assert torch.allclose(y2, y1, atol=1e-12) and torch.allclose(gz2, gz1, atol=1e-12), "chunks 2 vs 1 differ"
    assert torch.allclose(gw2, gw1, atol=1e-12), "expert gradients of chunks 2 vs 1 differ"
    assert gz2.abs().sum() > 0 and gw2.abs().sum() > 0
    assert timing["syncs"] == 0, f"{timing['syncs']} host syncs in one layer's forward"
    assert "bwd_wait_s" in timing, "no backward all-to-all was waited for through the dispatcher"
    bwd = log[log.index(("forward_done", -1)) + 1:]
    pos = {e: i for i, e in enumerate(bwd)}
    for c in (0, 1):
        for key in ("start_bwd_combine", "wait_bwd_combine", "start_bwd_dispatch", "wait_bwd_dispatch"):
            assert (key, c) in pos, f"{key} of chunk {c} missing from {bwd}"
    first, second = sorted((0, 1), key=lambda c: pos[("expert_bwd_begin", c)])
    # the output-gradient all-to-all of the chunk run second is in flight while the first one's experts run
    assert pos[("start_bwd_combine", second)] < pos[("expert_bwd_begin", first)], bwd
    assert pos[("wait_bwd_combine", second)] > pos[("expert_bwd_end", first)], bwd
    # the input-gradient all-to-all of the first is in flight while the second one's experts run
    assert pos[("start_bwd_dispatch", first)] < pos[("expert_bwd_begin", second)], bwd
    assert pos[("wait_bwd_dispatch", first)] > pos[("expert_bwd_end", second)], bwd


def test_backward_all_to_alls_overlap_expert_compute(seed):
    spawn(_order, 2, seed % 10_000)
