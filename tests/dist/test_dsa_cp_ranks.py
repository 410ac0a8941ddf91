"""Gated DSA context parallelism (ops/dsa/cp.py) on 2 and 4 gloo ranks against the single-rank ops.

Every rank builds the same global float64 inputs, runs its queries over the gathered key side, and
back-propagates its part of one random cotangent plus its share of the indexer KL loss; the selected indices,
outputs, KL loss and the summed input gradients must equal the single-rank indexer / sparse attention / KL."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import spawn

pytestmark = pytest.mark.dist

TOL = 1e-10


def _check(rank, world, cases):
    from moeadapt.ops.cp_comm import CPLayout
    from moeadapt.ops.dsa import indexer_kl_loss, lightning_indexer, sparse_attention
    from moeadapt.ops.dsa.cp import dsa_attention_cp

    for seed, (B, T, HQ, D, DV, HI, DI, topk), balanced, cu in cases:
        what = f"world={world} B={B} T={T} topk={topk} balanced={balanced} cu={cu}"
        g = torch.Generator().manual_seed(seed)
        r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
        inp = dict(q=r(B, T, HQ, D), kv=r(B, T, 1, D), q_idx=r(B, T, HI, DI), k_idx=r(B, T, DI),
                   w_idx=r(B, T, HI))
        for x in inp.values():
            x.requires_grad_(True)
        do = r(B, T, HQ, DV)
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        idx_ref = lightning_indexer(inp["q_idx"], inp["k_idx"], inp["w_idx"], topk, cu_t, backend="reference")
        o_ref = sparse_attention(inp["q"], inp["kv"], inp["kv"][..., :DV], idx_ref, backend="reference")
        kl_ref = indexer_kl_loss(inp["q"], inp["kv"], idx_ref, inp["q_idx"], inp["k_idx"], inp["w_idx"],
                                 backend="reference")
        ref = torch.autograd.grad((o_ref * do).sum() + 3.0 * kl_ref, list(inp.values()))

        layout = CPLayout(dist.group.WORLD, rank, world, balanced)
        local = {n: layout.split(x) for n, x in inp.items()}
        o, idx, kl = dsa_attention_cp(**local, topk=topk, layout=layout, dv=DV, cu_seqlens=cu_t,
                                      backend="reference", kl_loss=True)
        assert torch.equal(idx, layout.split(idx_ref)), f"{what}: selected indices differ"
        err = (o - layout.split(o_ref)).abs().max().item()
        assert err < TOL * o_ref.abs().max().item(), f"{what}: output differs by {err:.2e}"
        kl_mean = kl.detach().clone()
        dist.all_reduce(kl_mean)
        assert abs(float(kl_mean) / world - float(kl_ref)) < TOL * float(kl_ref), f"{what}: KL loss"
        grads = torch.autograd.grad((o * layout.split(do)).sum() + 3.0 * kl / world, list(inp.values()))
        for name, gr, rf in zip(inp, grads, ref):
            gr = gr.clone()
            dist.all_reduce(gr)
            err = (gr - rf).abs().max().item()
            assert err < TOL * rf.abs().max().item(), f"{what}: d{name} differs by {err:.2e}"


SHAPE = (1, 72, 4, 12, 8, 2, 8, 6)  # B, T, HQ, D, DV, HI, DI, topk


def test_dsa_cp_two_ranks():
    spawn(_check, 2, [(1, SHAPE, True, None), (2, (2, 40, 2, 12, 8, 2, 8, 30), False, None),
                      (3, SHAPE, True, [0, 10, 17, 40, 72])])  # documents cross the 18-token pieces


@pytest.mark.slow  # the 4-rank model proof in CI is test_cp_grads.py::test_cp4_and_cp2_ep2
def test_dsa_cp_four_ranks():
    spawn(_check, 4, [(4, SHAPE, True, [0, 5, 30, 31, 72]), (5, SHAPE, False, None)])
