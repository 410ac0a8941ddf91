"""The launch variants of the row-movement kernels (ops/moe/triton_permute.py: GatherLaunch, CombineLaunch,
scatter_rows) against float64 torch references, on shapes with partial row / token blocks, D not a multiple of
BLOCK_D and dropped choices; that the comparisons catch a broken index; and benchmarks/bench_permute.py's CPU
dry run (every variant the benchmark times, checked, with its broken rows flagged).

Triton only runs here under TRITON_INTERPRET=1 (tests/conftest.py sets it on CPU). Inputs are fresh random each
run; the seed is printed so a failure can be replayed with MOE_TEST_SEED=<seed>.
"""

from __future__ import annotations

import dataclasses
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
pytestmark = pytest.mark.skipif(not INTERPRET, reason="needs TRITON_INTERPRET=1")

if INTERPRET:
    from moeadapt.ops.moe import triton_permute as tp
    from moeadapt.ops.moe.triton_permute import CombineLaunch, GatherLaunch
else:  # the parametrize lists below are built at import: stand-ins that take the same keywords
    def GatherLaunch(**kw):  # noqa: N802
        return kw

    CombineLaunch = GatherLaunch

# T = 37 tokens, K = 3: M = 111 choices, N < M routed rows (drops): no block size divides N or T; D = 72: every
# BLOCK_D below leaves a partial chunk
T, K, E, D = 37, 3, 6, 72
GATHER = [
    GatherLaunch(),
    GatherLaunch(block_r=4, block_d=32),  # three chunks per row, the last 8 columns wide
    GatherLaunch(block_r=16, block_d=64, num_warps=8),
    GatherLaunch(block_r=1, block_d=128, num_warps=1),
    GatherLaunch(block_r=8, block_d=32, int32_index=True),
    GatherLaunch(block_r=4, block_d=32, evict_src="evict_last", evict_other="evict_first", evict_out="evict_first"),
]
SPLIT = [  # gather_rows on the 2-D grid (no `other`)
    GatherLaunch(block_r=8, block_d=32, split_d=True),
    GatherLaunch(block_r=32, block_d=16, split_d=True, int32_index=True),
    GatherLaunch(block_r=8, block_d=32, split_d=True, d_fast=True),
    GatherLaunch(block_r=4, block_d=64, split_d=True, d_fast=True, evict_src="evict_last", evict_out="evict_first"),
]
SCATTER = [
    GatherLaunch(),  # block_d 128 >= D: whole rows
    GatherLaunch(block_r=4, block_d=32),  # rows in chunks, re-read per choice
    GatherLaunch(block_r=8, block_d=128, unroll_k=True),
    GatherLaunch(block_r=2, block_d=32, unroll_k=True, int32_index=True),
    GatherLaunch(block_r=16, block_d=128, num_warps=8, int32_index=True, evict_other="evict_first",
                 evict_out="evict_first"),
]
COMBINE = [
    CombineLaunch(),
    CombineLaunch(block_t=8, block_d=32),
    CombineLaunch(block_t=4, block_d=32, d_fast=True),
    CombineLaunch(block_t=16, block_d=64, k_mode="unroll"),
    CombineLaunch(block_t=2, block_d=128, k_mode="unroll", d_fast=True, int32_index=True),
    CombineLaunch(block_t=4, block_d=32, k_mode="tile"),  # K = 3 in a tile of 4
    CombineLaunch(block_t=1, block_d=128, k_mode="tile", num_warps=8, int32_index=True, evict_src="evict_first"),
]


def _id(launch) -> str:
    """The fields a launch sets away from its class's defaults (the test id)."""
    if isinstance(launch, dict):
        return ",".join(f"{k}={v}" for k, v in launch.items()) or "default"
    default = type(launch)()
    return ",".join(f"{f.name}={getattr(launch, f.name)}" for f in dataclasses.fields(launch)
                    if getattr(launch, f.name) != getattr(default, f.name)) or "default"


@pytest.fixture
def gen():
    seed = int(os.environ.get("MOE_TEST_SEED", random.randrange(2**31)))
    print(f"MOE_TEST_SEED={seed}")
    return torch.Generator().manual_seed(seed)


def _case(gen, drop=0.25):
    """Routing with dropped choices and an expert with no token; row_index, inv; fp32 src, weights, other rows."""
    ids = torch.rand(T, E - 1, generator=gen).topk(K, dim=1).indices  # expert E-1 gets no token
    ids[torch.rand(T, K, generator=gen) < drop] = -1
    routed = (ids >= 0).nonzero()
    if len(routed) % 2 == 0:  # N odd: no power-of-two block > 1 divides it, the last row block is partial
        ids[tuple(routed[0])] = -1
    ri, _ = tp.compute_permutation(ids, E)
    N = len(ri)
    assert N % 2 and N < T * K
    x = torch.randn(T, D, generator=gen)
    w = torch.rand(T * K, generator=gen)
    other = torch.randn(N, D, generator=gen)
    return ri, tp.inverse_index(ri, T * K), x, w, other


def _gather_ref(x, ri, w=None, other=None):
    """float64: out[n] = w[m]·x[m // K]; dscale[m] = <x[m // K], other[n]> (0 for dropped m)."""
    rows = x.double()[ri // K]
    out = rows * w.double()[ri, None] if w is not None else rows
    dscale = None
    if other is not None:
        dscale = torch.zeros(T * K, dtype=torch.float64)
        dscale[ri] = (rows * other.double()).sum(1)
    return out, dscale


def _combine_ref(src, ri, w=None):
    """float64: out[t] = Σ over routed rows n of token t of w[m]·src[n] (m = ri[n])."""
    contrib = src.double() * (w.double()[ri, None] if w is not None else 1.0)
    return torch.zeros(T, src.shape[1], dtype=torch.float64).index_add_(0, ri // K, contrib)


def _close(a, b, tol=1e-5):
    torch.testing.assert_close(a.double(), b.double(), rtol=tol, atol=tol)


@pytest.mark.parametrize("launch", GATHER + SPLIT, ids=_id)
def test_gather_rows_launch(gen, launch):
    ri, _, x, w, other = _case(gen)
    out, _ = tp.gather_rows(x, ri, K, launch=launch)
    assert torch.equal(out, x[ri // K])  # a copy: exact
    out, dscale = tp.gather_rows(x, ri, K, scale_M=w, launch=launch)
    ref, _ = _gather_ref(x, ri, w)
    _close(out, ref)
    assert dscale is None
    if not launch.split_d:
        out, dscale = tp.gather_rows(x, ri, K, scale_M=w, other_ND=other, launch=launch)
        ref, dref = _gather_ref(x, ri, w, other)
        _close(out, ref)
        _close(dscale, dref, 1e-4)
    # bf16 rows (the step's dtype): within a bf16 rounding of the product, and bit for bit the current launch's (the
    # interpreter's fp32 -> bf16 cast truncates where the GPU's rounds to nearest, so not torch's cast)
    xb, ob = x.bfloat16(), other.bfloat16()
    kw = dict(scale_M=w, other_ND=None if launch.split_d else ob)
    out, _ = tp.gather_rows(xb, ri, K, **kw, launch=launch)
    _close(out, _gather_ref(xb, ri, w)[0], 2**-7)
    assert torch.equal(out, tp.gather_rows(xb, ri, K, **kw)[0])


@pytest.mark.parametrize("launch", SCATTER, ids=_id)
def test_scatter_rows_launch(gen, launch):
    ri, inv, x, w, other = _case(gen)
    N = len(ri)
    out, dscale = tp.scatter_rows(x, inv, K, N, launch=launch)
    assert dscale is None and torch.equal(out, x[ri // K])
    out, dscale = tp.scatter_rows(x, inv, K, N, scale_M=w, other_ND=other, launch=launch)
    ref, dref = _gather_ref(x, ri, w, other)
    _close(out, ref)
    _close(dscale, dref, 1e-4)  # dropped choices: exactly 0
    assert torch.all(dscale[inv < 0] == 0)
    # the same rows as gather_rows' current launch, bit for bit
    g_out, _ = tp.gather_rows(x, ri, K, scale_M=w, other_ND=other)
    assert torch.equal(out, g_out)


@pytest.mark.parametrize("launch", COMBINE, ids=_id)
def test_combine_rows_launch(gen, launch):
    ri, inv, _, w, other = _case(gen)
    _close(tp.combine_rows(other, inv, K, launch=launch), _combine_ref(other, ri))
    _close(tp.combine_rows(other, inv, K, weights_M=w, launch=launch), _combine_ref(other, ri, w))
    out = tp.combine_rows(other.bfloat16(), inv, K, weights_M=w, launch=launch)
    assert out.dtype == torch.bfloat16
    _close(out, _combine_ref(other.bfloat16(), ri, w), 2**-7)


def test_broken_index_fails_the_comparison(gen):
    """An off-by-one in the source row (m // K + 1: row_index shifted by K) or in the inverse index fails the
    checks above, for every op."""
    ri, inv, x, w, other = _case(gen)
    M = T * K
    ri_bad = (ri + K) % M
    out, _ = tp.gather_rows(x, ri_bad, K, launch=GATHER[1])
    assert not torch.equal(out, x[ri // K])
    out, dscale = tp.gather_rows(x, ri_bad, K, scale_M=w, other_ND=other, launch=GATHER[1])
    ref, dref = _gather_ref(x, ri, w, other)
    with pytest.raises(AssertionError):
        _close(out, ref)
    inv_bad = torch.full_like(inv, -1)
    inv_bad[ri_bad] = inv[ri]  # each row now says it belongs to the next token's choice
    out, dscale = tp.scatter_rows(x, inv_bad, K, len(ri), scale_M=w, other_ND=other, launch=SCATTER[2])
    with pytest.raises(AssertionError):
        _close(out, ref)
    with pytest.raises(AssertionError):
        _close(dscale, dref, 1e-4)
    with pytest.raises(AssertionError):
        _close(tp.combine_rows(other, inv_bad, K, weights_M=w, launch=COMBINE[5]), _combine_ref(other, ri, w))


def test_launch_rejects_what_it_cannot_do(gen):
    ri, inv, x, w, other = _case(gen)
    with pytest.raises(ValueError, match="split_d"):
        tp.gather_rows(x, ri, K, scale_M=w, other_ND=other, launch=GatherLaunch(split_d=True))
    with pytest.raises(ValueError, match="split_d"):
        tp.gather_rows(x, ri, K, launch=GatherLaunch(d_fast=True))
    with pytest.raises(ValueError, match="unroll_k"):
        tp.gather_rows(x, ri, K, launch=GatherLaunch(unroll_k=True))
    with pytest.raises(ValueError, match="gather_rows only"):
        tp.scatter_rows(x, inv, K, len(ri), launch=GatherLaunch(split_d=True))
    with pytest.raises(ValueError, match="choices"):
        tp.scatter_rows(x, inv[:-1], K, len(ri))
    with pytest.raises(ValueError, match="evict_out"):
        GatherLaunch(evict_out="evict_normal")
    with pytest.raises(ValueError, match="k_mode"):
        CombineLaunch(k_mode="unrolled")
    # int32_index is taken only where every offset fits 32 bits
    assert tp._fits_int32(2**31 - 1, 5) and not tp._fits_int32(7, 2**31)


def _bench(*args):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(root))
    return subprocess.run([sys.executable, str(root / "benchmarks" / "bench_permute.py"), "--dry-run", *args],
                          env=env, capture_output=True, text=True, timeout=600)


def test_bench_permute_dry_run_quick():
    """The benchmark's --quick variants pass its own checks on CPU, and its broken rows are flagged."""
    r = _bench("--quick")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("broken:") == 4 and r.stdout.count("MISMATCH") == 4, r.stdout


@pytest.mark.slow
def test_bench_permute_dry_run_full():
    r = _bench()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert r.stdout.count("MISMATCH") == 4, r.stdout
