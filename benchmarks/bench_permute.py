"""Benchmark the MoE row-movement kernels (`ops/moe/triton_permute.py`) at the training step's shapes, with launch
variants of each.

Usage (GPU): python3 benchmarks/bench_permute.py [--quick] [--shapes T,K,D,E ...] [--drop F] [--out R.json]
CPU check of every variant, no timing: python benchmarks/bench_permute.py --dry-run (TRITON_INTERPRET=1, a tiny
shape with dropped choices and partial blocks; tests/ops/test_permute_launch.py runs it).

The ops, as the `small` step runs them (models/moe.py: bf16 activations in the latent width D = latent_dim = 1024,
fp32 routing weights, K = 8, T = 8192 tokens, dropless so N = T*K = 65536):
  gather      permute forward (the "permute" expert path of full fine-tuning): gather_rows(z_TD, row_index, K)
  gather+dot  unpermute backward: gather_rows(dy_TD, row_index, K, scale_M=w, other_ND=y_sorted), i.e.
              dy_sorted = w·dy[m // K] and dw[m] = <dy[m // K], y_sorted[n]>
  combine+w   unpermute forward: combine_rows(y_sorted, inv, K, weights_M=w)
  combine     permute backward and the LoRA paths' dz (fused_lora._combine_copies): combine_rows(dx_sorted, inv, K)
The second default shape (T 4096, K 16, D 2048, E 896) is hybrid-2.8t-like routing at twice the step's width; it runs
the --quick variant lists (the full lists run at the first shape only: ~100 kernels to compile per shape).

Variants (names in the table; the launch fields are GatherLaunch / CombineLaunch's, the first row of each op is the
current launch, GATHER_LAUNCH / COMBINE_LAUNCH):
  loop rR dD wW     gather_rows' 1-D grid over row blocks of R rows, a loop over D in chunks of D columns, W warps
  split rR dD wW    gather_rows on a 2-D grid (row blocks x D chunks), no loop over D; "dfast": a 1-D grid with the
                    chunks of one row block on consecutive programs
  scatter tB wW     scatter_rows: token order from the inverse index, B src rows per program read once and written to
                    their K rows; "unroll": the K choices unrolled. "+inv": the time includes making the inverse index
                    from row_index (inverse_index, three torch launches); without it, it assumes inv made elsewhere
                    (unpermute's forward makes it; _scatter_index_kernel could write it for the permute)
  tB dD wW MODE     combine_rows on its 2-D grid of B tokens x D columns per program; MODE loop / unroll / tile
                    (CombineLaunch.k_mode), "dfast" as above
  +i32              int32_index: row and element offsets in 32 bits
  +eS/eO/eX:L|F     eviction hint evict_last (L) / evict_first (F) on the src load (S), the other load (O), the out
                    store (X)
Columns: us per call (triton.testing.do_bench, median; it flushes L2 between calls), GB/s over the op's minimal
bytes (each distinct src row read once, every output written once, indices and weights once: the same count for
every variant of an op), the time ratio to the current launch, and the check. Every variant's outputs are checked
against the current launch's before timing: exact for copies (gather's and gather+dot's rows), and within the fp32
accumulation bound for sums (dw: 2·D·2^-24·Σ_d|src·other|; combine: one bf16 ulp, 2^-7·|out|, plus
2·K·2^-24·Σ_k|w·src|). A "broken" row per op (row_index shifted by one token, or inv by one token) must be flagged:
it checks the check. Any mismatch of a real variant, or a broken row not flagged, makes the run exit 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from dataclasses import replace

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moeadapt.io import atomic_write_text  # noqa: E402
from moeadapt.ops.moe import triton_permute as tp  # noqa: E402

GL, CL = tp.GatherLaunch, tp.CombineLaunch
BF16 = torch.bfloat16
_TAG = {"evict_last": "L", "evict_first": "F"}

# (rows, block_d, warps) of gather_rows' loop launches, split launches (2-D grid), scatter_rows' (tokens, warps,
# unroll); the full list, then the --quick subset
GATHER_LOOP = [(1, 1024, 4), (2, 1024, 4), (8, 1024, 4), (4, 1024, 2), (4, 1024, 8), (8, 1024, 8), (16, 1024, 8),
               (8, 512, 4), (16, 256, 4)]
GATHER_SPLIT = [(4, 512, 4), (8, 256, 4), (16, 256, 4), (32, 128, 4), (16, 512, 8)]
SCATTER = [(1, 4, False), (2, 4, False), (4, 8, False), (1, 4, True), (2, 4, True), (4, 8, True)]
DOT_LOOP = [(1, 1024, 4), (2, 1024, 4), (2, 1024, 2), (4, 1024, 8), (8, 1024, 8), (8, 512, 4), (16, 256, 4)]
# (tokens, block_d, warps, k_mode) of combine_rows
COMBINE = [(4, 512, 4, "loop"), (2, 1024, 4, "loop"), (2, 1024, 8, "loop"), (1, 1024, 4, "loop"),
           (16, 128, 4, "loop"), (4, 256, 4, "loop"),
           (8, 256, 4, "unroll"), (4, 256, 4, "unroll"), (4, 512, 8, "unroll"), (2, 1024, 8, "unroll"),
           (1, 1024, 8, "tile"), (2, 512, 8, "tile"), (1, 512, 4, "tile"), (4, 256, 8, "tile")]
QUICK_GATHER_LOOP, QUICK_GATHER_SPLIT, QUICK_SCATTER = [(8, 1024, 8)], [(16, 256, 4)], [(2, 4, False), (2, 4, True)]
QUICK_DOT_LOOP = [(2, 1024, 4), (8, 1024, 8)]
QUICK_COMBINE = [(2, 1024, 8, "loop"), (4, 512, 8, "unroll"), (1, 1024, 8, "tile")]


def _gname(L: tp.GatherLaunch, scatter: bool = False) -> str:
    r, d = L.block_r, L.block_d
    if scatter:
        s = f"scatter t{r} w{L.num_warps}" + (" unroll" if L.unroll_k else "")
    else:
        s = f"{'split' if L.split_d else 'loop'} r{r} d{d} w{L.num_warps}" + (" dfast" if L.d_fast else "")
    return s + _flags(L)


def _cname(L: tp.CombineLaunch) -> str:
    return f"t{L.block_t} d{L.block_d} w{L.num_warps} {L.k_mode}" + (" dfast" if L.d_fast else "") + _flags(L)


def _flags(L) -> str:
    s = " +i32" if L.int32_index else ""
    for tag, field in (("S", "evict_src"), ("O", "evict_other"), ("X", "evict_out")):
        if getattr(L, field, ""):
            s += f" +e{tag}:{_TAG[getattr(L, field)]}"
    return s


def _evictions(L, fields: list[dict]) -> list:
    return [replace(L, **f) for f in fields]


def gather_launches(quick: bool, dot: bool, D: int) -> tuple[list[tp.GatherLaunch], list[tp.GatherLaunch]]:
    """(gather_rows launches, scatter_rows launches) of the op gather (dot False) or gather+dot."""
    cur = replace(tp.GATHER_LAUNCH, block_r=tp.GATHER_LAUNCH.blocks(D)[0], block_d=tp.GATHER_LAUNCH.blocks(D)[1])
    loops = (QUICK_DOT_LOOP if dot else QUICK_GATHER_LOOP) if quick else (DOT_LOOP if dot else GATHER_LOOP)
    g = [GL(block_r=r, block_d=d, num_warps=w) for r, d, w in loops]
    if not dot:
        splits = QUICK_GATHER_SPLIT if quick else GATHER_SPLIT
        g += [GL(block_r=r, block_d=d, num_warps=w, split_d=True) for r, d, w in splits]
        g += [GL(block_r=r, block_d=d, num_warps=w, split_d=True, d_fast=True) for r, d, w in splits[1:3]]
    hints = [dict(int32_index=True), dict(evict_src="evict_last"), dict(evict_out="evict_first"),
             dict(evict_src="evict_last", evict_out="evict_first"),
             dict(evict_src="evict_last", evict_out="evict_first", int32_index=True)]
    if dot:
        hints += [dict(evict_other="evict_first"),
                  dict(evict_src="evict_last", evict_other="evict_first", evict_out="evict_first", int32_index=True)]
    g += _evictions(cur, hints[-1:] if quick else hints)
    whole = triton.next_power_of_2(D)  # scatter_rows holds whole rows (each src row loaded once for its K stores)
    s = [GL(block_r=t, block_d=whole, num_warps=w, unroll_k=u) for t, w, u in (QUICK_SCATTER if quick else SCATTER)]
    shints = [dict(int32_index=True), dict(evict_out="evict_first")]
    if dot:
        shints += [dict(evict_other="evict_first"), dict(evict_other="evict_first", evict_out="evict_first")]
    shints.append(dict(shints[-1], int32_index=True))
    base = GL(block_r=2, block_d=whole, num_warps=4, unroll_k=dot)
    s += _evictions(base, shints[-1:] if quick else shints)
    return g, s


def combine_launches(quick: bool, D: int) -> list[tp.CombineLaunch]:
    out = [CL(block_t=t, block_d=d, num_warps=w, k_mode=m) for t, d, w, m in (QUICK_COMBINE if quick else COMBINE)]
    cur = replace(tp.COMBINE_LAUNCH, block_t=tp.COMBINE_LAUNCH.blocks(D)[0], block_d=tp.COMBINE_LAUNCH.blocks(D)[1])
    best_guess = CL(block_t=4, block_d=512, num_warps=8, k_mode="unroll")
    if not quick:
        out += [replace(cur, d_fast=True), CL(block_t=4, block_d=512, d_fast=True)]
        out += _evictions(cur, [dict(int32_index=True), dict(evict_src="evict_first"),
                                dict(evict_src="evict_first", int32_index=True)])
    out += [replace(best_guess, evict_src="evict_first", int32_index=True),
            replace(best_guess, d_fast=True, evict_src="evict_first", int32_index=True)]
    return out


def _routing(T: int, K: int, E: int, drop: float, dev: str, g: torch.Generator) -> torch.Tensor:
    """Distinct experts per token (the top-K of uniform scores), a fraction `drop` of the choices dropped (-1)."""
    ids = torch.rand(T, E, generator=g).topk(K, dim=1).indices
    if drop > 0:
        ids[torch.rand(T, K, generator=g) < drop] = -1
    return ids.to(dev)


class Op:
    """One op at one shape: its current output, its variants (name, fn, kind), its minimal bytes, the check."""

    def __init__(self, name: str, minimal_bytes: int, base: Callable, check: Callable):
        self.name, self.minimal_bytes, self.base, self.check = name, minimal_bytes, base, check
        self.variants: list[tuple[str, Callable, str]] = [("current", base, "real")]

    def add(self, name: str, fn: Callable, kind: str = "real"):
        self.variants.append((name, fn, kind))


def _dot_check(src_TD, ri, K, other_ND, M):
    """Elementwise tolerances of dw: 2·D·2^-24·Σ_d|src[m//K]·other[n]| (two fp32 sums of D exact products)."""
    D = src_TD.shape[1]
    S = torch.zeros(M, dtype=torch.float32, device=src_TD.device)
    for lo in range(0, len(ri), 8192):  # chunks: the [rows, D] fp32 products stay small
        sl = slice(lo, lo + 8192)
        S[ri[sl]] = (src_TD[ri[sl] // K].float() * other_ND[sl].float()).abs().sum(1)
    return 2 * D * 2.0**-24 * S


def _combine_tol(src_ND, ri, K, T, w_M):
    """Elementwise tolerances of combine: one bf16 ulp of the current output plus 2·K·2^-24·Σ_k|w·src|."""
    S = torch.zeros(T, src_ND.shape[1], dtype=torch.float32, device=src_ND.device)
    a = src_ND.float().abs()
    if w_M is not None:
        a = a * w_M[ri].abs()[:, None]
    S.index_add_(0, ri // K, a)
    return 2 * K * 2.0**-24 * S


def build_ops(T: int, K: int, D: int, E: int, drop: float, dev: str, quick: bool, seed: int = 0) -> list[Op]:
    g = torch.Generator().manual_seed(seed)
    ids_TK = _routing(T, K, E, drop, dev, g)
    ri, _ = tp.compute_permutation(ids_TK, E)
    N, M = len(ri), T * K
    inv = tp.inverse_index(ri, M)
    z = torch.randn(T, D, generator=g).to(dev, BF16)
    dy = torch.randn(T, D, generator=g).to(dev, BF16)
    y = torch.randn(N, D, generator=g).to(dev, BF16)
    w = torch.rand(T, K, generator=g).to(dev).reshape(-1)
    ri_bad = (ri + K) % M  # every row from the next token (the last from the first): an off-by-one in m // K
    inv_bad = inv.roll(K)  # every token combines the previous token's rows
    es = 2
    t_read = int((ids_TK >= 0).any(1).sum())  # distinct src rows the gathers must read
    ops = []

    def exact(ref):
        def check(out):
            bad = [i for i, (a, b) in enumerate(zip(out, ref)) if b is not None and not torch.equal(a, b)]
            return "exact" if not bad else f"MISMATCH (output {bad} differs)"
        return check

    # gather: permute forward
    ref = tp.gather_rows(z, ri, K)[:1]
    op = Op("gather", t_read * D * es + N * 8 + N * D * es, lambda: tp.gather_rows(z, ri, K)[:1], exact(ref))
    gl, sl = gather_launches(quick, False, D)
    for L in gl:
        op.add(_gname(L), lambda L=L: tp.gather_rows(z, ri, K, launch=L)[:1])
    for L in sl:
        op.add(_gname(L, True), lambda L=L: tp.scatter_rows(z, inv, K, N, launch=L)[:1])
    L = sl[1]
    op.add(_gname(L, True) + " +inv", lambda L=L: tp.scatter_rows(z, tp.inverse_index(ri, M), K, N, launch=L)[:1])
    op.add("broken: row_index + K", lambda: tp.gather_rows(z, ri_bad, K)[:1], "broken")
    ops.append(op)

    # gather+dot: unpermute backward
    out0, dw0 = tp.gather_rows(dy, ri, K, scale_M=w, other_ND=y, out_dtype=BF16)
    tol = _dot_check(dy, ri, K, y, M)

    def dot_check(res):
        out, dw = res
        msg = [] if torch.equal(out, out0) else ["rows differ"]
        err = (dw - dw0).abs()
        over = int((err > tol).sum())
        if over:
            msg.append(f"dw: {over} of {len(dw)} beyond the bound, max error {float(err.max()):.2e}")
        return f"exact rows, dw {float(err.max()):.1e}" if not msg else "MISMATCH (" + ", ".join(msg) + ")"

    op = Op("gather+dot", t_read * D * es + N * 8 + 2 * N * D * es + N * 4 + M * 4,
            lambda: tp.gather_rows(dy, ri, K, scale_M=w, other_ND=y, out_dtype=BF16), dot_check)
    gl, sl = gather_launches(quick, True, D)
    for L in gl:
        op.add(_gname(L), lambda L=L: tp.gather_rows(dy, ri, K, scale_M=w, other_ND=y, out_dtype=BF16, launch=L))
    for L in sl:
        op.add(_gname(L, True), lambda L=L: tp.scatter_rows(dy, inv, K, N, scale_M=w, other_ND=y, out_dtype=BF16,
                                                              launch=L))
    op.add("broken: row_index + K", lambda: tp.gather_rows(dy, ri_bad, K, scale_M=w, other_ND=y, out_dtype=BF16),
           "broken")
    ops.append(op)

    # combine+w (unpermute forward) and combine (permute backward)
    for name, wt in (("combine+w", w), ("combine", None)):
        c0 = tp.combine_rows(y, inv, K, weights_M=wt)
        ctol = 2.0**-7 * c0.float().abs() + _combine_tol(y, ri, K, T, wt)

        def comb_check(c, c0=c0, ctol=ctol):
            err = (c.float() - c0.float()).abs()
            over = int((err > ctol).sum())
            if not over:
                return "exact" if not bool(err.any()) else f"within the bound ({int((err > 0).sum())} differ)"
            return f"MISMATCH ({over} of {err.numel()} beyond the bound, max error {float(err.max()):.2e})"

        op = Op(name, N * D * es + M * 4 + T * D * es + (M * 4 if wt is not None else 0),
                lambda wt=wt: tp.combine_rows(y, inv, K, weights_M=wt), comb_check)
        for L in combine_launches(quick, D):
            op.add(_cname(L), lambda L=L, wt=wt: tp.combine_rows(y, inv, K, weights_M=wt, launch=L))
        op.add("broken: inv shifted one token", lambda wt=wt: tp.combine_rows(y, inv_bad, K, weights_M=wt), "broken")
        ops.append(op)
    return ops


def run_shape(T, K, D, E, drop, dev, quick, timed, warmup, rep) -> dict:
    ops = build_ops(T, K, D, E, drop, dev, quick)
    row = {"shape": dict(T=T, K=K, D=D, E=E, drop=drop), "ops": {}}
    for op in ops:
        res = []
        for name, fn, kind in op.variants:
            chk = op.check(fn())  # checked before it is timed
            r = {"variant": name, "kind": kind, "check": chk, "bad": chk.startswith("MISMATCH") != (kind == "broken")}
            if timed and kind == "real":
                ms = triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median")
                r.update(us=ms * 1e3, gbs=op.minimal_bytes / ms / 1e6)
            res.append(r)
        if timed:
            for r in res:
                if "us" in r:
                    r["x_current"] = r["us"] / res[0]["us"]
        row["ops"][op.name] = dict(minimal_mb=op.minimal_bytes / 1e6, variants=res)
        _print_op(row["shape"], op.name, row["ops"][op.name])
    return row


def _print_op(shape: dict, name: str, o: dict) -> None:
    s = shape
    print(f"\n{name}  T {s['T']} K {s['K']} D {s['D']} E {s['E']} drop {s['drop']}: minimal {o['minimal_mb']:.1f} MB")
    print(f"  {'variant':<46} {'us':>8} {'GB/s':>6} {'x cur':>6}  check")
    for r in o["variants"]:
        t = (f"{r['us']:8.1f} {r['gbs']:6.0f} {r['x_current']:6.3f}" if "us" in r else f"{'-':>8} {'-':>6} {'-':>6}")
        flag = "  <-- BAD" if r["bad"] else ""
        print(f"  {r['variant']:<46} {t}  {r['check']}{flag}", flush=True)
    timed = [r for r in o["variants"] if "us" in r and not r["bad"]]
    if timed:
        best = min(timed, key=lambda r: r["us"])
        print(f"  fastest: {best['variant']}  {best['us']:.1f} us, x{best['x_current']:.3f} of the current launch")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", default=None,
                   help="T,K,D,E ... (default: 8192,8,1024,64 and 4096,16,2048,896; --quick: the first)")
    p.add_argument("--drop", type=float, default=0.0, help="fraction of dropped choices (the step is dropless)")
    p.add_argument("--quick", action="store_true",
                   help="a few variants per op, one shape (unless --shapes), shorter timing")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, a tiny shape: checks only")
    a = p.parse_args(argv)
    dev = "cpu" if a.dry_run or not torch.cuda.is_available() else "cuda"
    if a.dry_run:
        shapes, drop = [(37, 3, 72, 5)], 0.2  # dropped choices, partial row / token blocks, D not a power of 2
    else:
        default = ["8192,8,1024,64"] + ([] if a.quick else ["4096,16,2048,896"])
        shapes, drop = [tuple(int(v) for v in s.split(",")) for s in (a.shapes or default)], a.drop
    warmup, rep = (5, 20) if a.quick else (10, 40)
    if dev == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    elif not a.dry_run:
        sys.exit("no CUDA device: use --dry-run for the CPU check")
    t0 = time.time()
    # the full variant lists at the first shape, the --quick lists at the others (each shape compiles its own kernels:
    # K divisible by 16 or not is part of Triton's specialization)
    rows = [run_shape(T, K, D, E, drop, dev, a.quick or i > 0, dev == "cuda", warmup, rep)
            for i, (T, K, D, E) in enumerate(shapes)]
    print(f"\n{time.time() - t0:.1f} s")
    if a.out:
        atomic_write_text(a.out, json.dumps(rows, indent=1))
    bad = [f"{op} / {r['variant']}" for row in rows for op, o in row["ops"].items() for r in o["variants"] if r["bad"]]
    if bad:
        sys.exit(f"{len(bad)} bad checks (a variant mismatched, or a broken row passed): {bad}")


if __name__ == "__main__":
    main()
