"""KDA context parallelism (ops/kda/cp.py) on 2 and 4 gloo ranks against the single-rank op.

Every rank builds the same global float64 inputs, runs its pieces of the sequence under the cp layout, and
back-propagates its part of one random cotangent; the summed input gradients and the gathered outputs must
equal the chunked reference (itself tested against the recurrence) on the whole sequence (values and gradients)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _harness import spawn

pytestmark = pytest.mark.dist

TOL = 1e-10


def _inputs(seed, B, T, H, HV, K, V, fused):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    inp = dict(q=r(B, T, H, K), k=r(B, T, H, K), v=r(B, T, HV, V))
    if fused:
        inp.update(g=r(B, T, HV, K), beta=r(B, T, HV), A_log=r(HV) * 0.5, dt_bias=r(HV * K) * 0.5)
        opts = dict(use_qk_l2norm=True, beta_is_logits=True)
    else:
        inp["k"] = F.normalize(inp["k"], dim=-1)
        inp.update(g=-torch.rand(B, T, HV, K, generator=g, dtype=torch.float64) * 0.3,
                   beta=torch.rand(B, T, HV, generator=g, dtype=torch.float64))
        opts = {}
    for x in inp.values():
        x.requires_grad_(True)
    return inp, opts, r(B, T, HV, V)


def _check(rank, world, cases):
    from moeadapt.ops.cp_comm import CPLayout
    from moeadapt.ops.kda import chunk_kda_reference
    from moeadapt.ops.kda.cp import chunk_kda_cp

    for seed, (B, T, H, HV, K, V), fused, balanced, cu in cases:
        what = f"world={world} B={B} T={T} H={H} HV={HV} fused={fused} balanced={balanced} cu={cu}"
        cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
        inp, opts, do = _inputs(seed, B, T, H, HV, K, V, fused)
        o_ref, _ = chunk_kda_reference(**inp, cu_seqlens=cu_t, **opts)
        ref = torch.autograd.grad((o_ref * do).sum(), list(inp.values()))
        layout = CPLayout(dist.group.WORLD, rank, world, balanced)
        tensors = {n: x for n, x in inp.items() if n not in ("A_log", "dt_bias")}
        local = {n: layout.split(x) for n, x in tensors.items()}
        o = chunk_kda_cp(**local, layout=layout, cu_seqlens=cu_t, backend="reference",
                         A_log=inp.get("A_log"), dt_bias=inp.get("dt_bias"), **opts)
        grads = torch.autograd.grad((o * layout.split(do)).sum(), list(inp.values()))
        err = (o - layout.split(o_ref)).abs().max().item()
        assert err < TOL * o_ref.abs().max().item(), f"{what}: output differs by {err:.2e}"
        for name, gr, rf in zip(inp, grads, ref):
            gr = gr.clone()
            dist.all_reduce(gr)
            err = (gr - rf).abs().max().item()
            assert err < TOL * rf.abs().max().item(), f"{what}: d{name} differs by {err:.2e}"


CASES_2 = [  # seed, (B, T, H, HV, K, V), fused, balanced, global cu_seqlens
    (1, (2, 148, 2, 2, 8, 4), False, True, None),  # 4 pieces of 37: shorter than a chunk
    (2, (1, 280, 1, 2, 8, 8), True, True, [0, 30, 69, 140, 141, 280]),  # GVA; documents cross every boundary
    (3, (1, 268, 2, 2, 8, 8), False, False, [0, 134, 200, 268]),  # contiguous; a document starts at a piece
]
CASES_4 = [
    (4, (1, 200, 1, 2, 8, 4), True, True, [0, 3, 47, 50, 51, 99, 150, 200]),  # 8 pieces of 25
    (5, (2, 136, 2, 2, 8, 8), False, False, None),
]


def test_kda_cp_two_ranks():
    spawn(_check, 2, CASES_2)


@pytest.mark.slow  # the 4-rank model proof in CI is test_cp_grads.py::test_cp4_and_cp2_ep2
def test_kda_cp_four_ranks():
    spawn(_check, 4, CASES_4)
