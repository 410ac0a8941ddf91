"""Benchmark the KDA layer's fused short causal conv + SiLU (`ops/kda/triton_conv.py`) at the step's shapes.

Usage (GPU): python3 benchmarks/bench_short_conv.py [--shapes 2,4096,2048 ...] [--kw 4] [--doc-len L] [--out R.json]
To compare two trees, run this file from each (PYTHONPATH set to the tree) in one device call.

Per shape (B, T, C; bf16 x and dy, fp32 w), one table of variants, each timed alone (triton.testing.do_bench,
median, L2 flushed between calls):
  fwd                  the forward (`_conv_silu_fwd_impl`)
  bwd full             the current backward, dx and dw (`conv_silu_bwd_launch` at its defaults: fp32 dpre): the
                       baseline of the ratio column
  bwd full, bf16 dpre  the same with dpre stored in x's dtype (dpre_dtype=bf16)
  dx fused BTxBC/W     the dx-only backward (frozen weight) in one kernel (`conv_silu_dx_launch(impl="fused")`) at
                       a few launches; the first is the default (FUSED_DX_*)
  dx two_pass          the dx-only backward as the two passes without weight-gradient work, fp32 / bf16 dpre
  bwd launch ...       --bwd-launch BT,BC,WARPS,TIME_BLOCKS ...: the full backward at these first-pass launches
Columns: µs per call, effective bandwidth over the bytes a variant must move (forward: read x, write y; every
backward: read x and dy, write dx; dw and any dpre buffer are extra traffic, not counted), the time ratio to
"bwd full", and, computed before any timing, each variant's dx (and dw where made) against "bwd full"'s as
relative L2 errors, flagged MISMATCH above CHECK_TOL (the run then exits 1). The baseline's own errors against the
fp32 torch reference are printed above its table. --doc-len L: packed documents of L tokens (positions), so the
HAS_POS kernels are the ones timed. --norm-dim D (KDA: the head dim, 128): a second table per shape, q's and k's
convs with their per-head L2 norm as the step runs them, the norm apart (the convs, then `triton_l2norm`'s one
launch for both, each way) against the norm inside the conv passes (norm_dim=D): forward, full backward, dx-only
backward; the fused rows' outputs checked against the apart rows'. --dry-run: CPU under TRITON_INTERPRET=1 at a tiny shape, checks only (tests
this script).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moeadapt.io import atomic_write_text  # noqa: E402
from moeadapt.ops.kda import triton_conv as tc  # noqa: E402
from moeadapt.ops.kda.short_conv import causal_conv_silu_reference  # noqa: E402

# the fused dx kernel's launches timed besides its default (BT, BC, warps); see FUSED_DX_* in triton_conv.py
FUSED_LAUNCHES = ((16, 128, 4), (32, 128, 8))
# a variant whose dx / dw / y is further than this (relative L2) from the current kernels' is flagged and the run
# exits 1: bf16 outputs differ by roundings (~4e-3 with a bf16 dpre), a dropped tap or shift by far more
CHECK_TOL = 1e-2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def _variants(x, w, dy, pos, launches: list[str]) -> list[tuple[str, str, Callable]]:
    """(name, kind, fn) per variant: kind "fwd" (returns y), "full" (returns dx, dw) or "dx" (returns dx)."""
    bf16 = torch.bfloat16
    out = [("fwd", "fwd", lambda: tc._conv_silu_fwd_impl(x, w, pos)),
           ("bwd full (fp32 dpre)", "full", lambda: tc.conv_silu_bwd_launch(x, w, dy, pos)),
           ("bwd full, bf16 dpre", "full", lambda: tc.conv_silu_bwd_launch(x, w, dy, pos, dpre_dtype=bf16))]
    fused = [(tc.FUSED_DX_BLOCK_T, tc.FUSED_DX_BLOCK_C, tc.FUSED_DX_NUM_WARPS)]
    fused += [lc for lc in FUSED_LAUNCHES if lc not in fused]
    for bt, bc, nw in fused:
        out.append((f"dx fused {bt}x{bc}/{nw}", "dx",
                    lambda bt=bt, bc=bc, nw=nw: tc.conv_silu_dx_launch(x, w, dy, pos, "fused", bt, bc, nw)))
    out.append(("dx two_pass, fp32 dpre", "dx", lambda: tc.conv_silu_dx_launch(x, w, dy, pos, "two_pass")))
    out.append(("dx two_pass, bf16 dpre", "dx",
                lambda: tc.conv_silu_dx_launch(x, w, dy, pos, "two_pass", dpre_dtype=bf16)))
    for spec in launches:
        launch = tuple(int(v) for v in spec.split(","))
        out.append((f"bwd launch {spec}", "full", lambda launch=launch: tc.conv_silu_bwd_launch(x, w, dy, pos, *launch)))
    return out


def _positions(B: int, T: int, doc_len: int, dev: str) -> torch.Tensor | None:
    """positions [B, T] int32 of documents of doc_len tokens (the second row shifted by doc_len // 3), or None."""
    if doc_len <= 0:
        return None
    t = torch.arange(T)
    rows = [t % doc_len, (t + doc_len // 3) % doc_len]
    return torch.stack([rows[b % 2] for b in range(B)]).to(dev, torch.int32).contiguous()


def run_shape(B: int, T: int, C: int, KW: int, dev: str, timed: bool, launches: list[str], doc_len: int) -> dict:
    g = torch.Generator(device="cpu").manual_seed(B * 1_000_003 + T * 31 + C)
    x = torch.randn(B, T, C, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(C, 1, KW, generator=g) * 0.5).to(dev)
    dy = torch.randn(B, T, C, generator=g).to(dev, torch.bfloat16)
    pos = _positions(B, T, doc_len, dev)
    # the baseline (current kernels) against the fp32 torch reference
    y = tc._conv_silu_fwd_impl(x, w, pos)
    dx0, dw0 = tc.conv_silu_bwd_launch(x, w, dy, pos)
    xr, wr = x.float().requires_grad_(), w.clone().requires_grad_()
    yr = causal_conv_silu_reference(xr, wr, pos)
    yr.backward(dy.float())
    row = {"shape": [B, T, C], "kw": KW, "doc_len": doc_len, "rel_y": _rel(y, yr), "rel_dx": _rel(dx0, xr.grad),
           "rel_dw": _rel(dw0, wr.grad), "variants": {}}
    del xr, wr, yr
    n = B * T * C * x.element_size()
    for name, kind, fn in _variants(x, w, dy, pos, launches):
        out = fn()  # checked before it is timed
        v = {"kind": kind}
        if kind == "fwd":
            v["rel_y_vs_current"] = _rel(out, y)
        else:
            v["rel_dx_vs_current"] = _rel(out[0] if kind == "full" else out, dx0)
            if kind == "full":
                v["rel_dw_vs_current"] = _rel(out[1], dw0)
        del out
        if timed:
            ms = triton.testing.do_bench(fn, return_mode="median")
            v.update(us=ms * 1e3, gbs=(2 if kind == "fwd" else 3) * n / ms / 1e6)
        row["variants"][name] = v
    if timed:
        base = row["variants"]["bwd full (fp32 dpre)"]["us"]
        for v in row["variants"].values():
            v["vs_full_bwd"] = v["us"] / base
    return row


def run_norm(B: int, T: int, C: int, KW: int, nd: int, dev: str, timed: bool) -> dict:
    """q's and k's convs + per-head L2 norm: apart (conv passes, then the norm's kernels) vs fused (norm_dim)."""
    from moeadapt.ops.kda import triton_l2norm as tn
    from moeadapt.ops.kda.reference import L2_EPS

    g = torch.Generator(device="cpu").manual_seed(B * 7 + T * 13 + C + nd)
    xq, xk, dq, dk = (torch.randn(B, T, C, generator=g).to(dev, torch.bfloat16) for _ in range(4))
    wq, wk = ((torch.randn(C, 1, KW, generator=g) * 0.5).to(dev) for _ in range(2))
    H = C // nd

    def heads(t):
        return t.view(B, T, H, nd)

    def fwd_apart():
        yq, yk = tc._conv_silu_fwd_impl(xq, wq), tc._conv_silu_fwd_impl(xk, wk)
        qn, kn, _, _ = tn._l2norm_qk_fwd_impl(heads(yq), heads(yk), L2_EPS)
        return qn.view(B, T, C), kn.view(B, T, C)

    def fwd_fused():
        return tc._conv_silu_fwd_impl(xq, wq, None, nd), tc._conv_silu_fwd_impl(xk, wk, None, nd)

    # the apart backward needs the conv outputs and the norm's 1 / |y| (saved by its forward in the step)
    yq, yk = tc._conv_silu_fwd_impl(xq, wq), tc._conv_silu_fwd_impl(xk, wk)
    _, _, rq, rk = tn._l2norm_qk_fwd_impl(heads(yq), heads(yk), L2_EPS)

    def bwd_apart(dx_only: bool):
        gq, gk = tn._l2norm_qk_bwd_impl(heads(yq), heads(yk), rq, rk, heads(dq), heads(dk))
        gq, gk = gq.view(B, T, C), gk.view(B, T, C)
        if dx_only:
            return tc.conv_silu_dx_launch(xq, wq, gq), tc.conv_silu_dx_launch(xk, wk, gk)
        return tc.conv_silu_bwd_launch(xq, wq, gq)[0], tc.conv_silu_bwd_launch(xk, wk, gk)[0]

    def bwd_fused(dx_only: bool):
        if dx_only:
            return (tc.conv_silu_dx_launch(xq, wq, dq, norm_dim=nd), tc.conv_silu_dx_launch(xk, wk, dk, norm_dim=nd))
        return tc.conv_silu_bwd_launch(xq, wq, dq, norm_dim=nd)[0], tc.conv_silu_bwd_launch(xk, wk, dk, norm_dim=nd)[0]

    pairs = [("fwd", fwd_apart, fwd_fused), ("bwd full (dx + dw)", lambda: bwd_apart(False), lambda: bwd_fused(False)),
             ("bwd dx only", lambda: bwd_apart(True), lambda: bwd_fused(True))]
    row = {"shape": [B, T, C], "norm_dim": nd, "pairs": {}}
    for name, apart, fused in pairs:
        a, f = apart(), fused()
        v = {"rel_vs_apart": max(_rel(f[0], a[0]), _rel(f[1], a[1]))}
        if timed:
            v["apart_us"] = triton.testing.do_bench(apart, return_mode="median") * 1e3
            v["fused_us"] = triton.testing.do_bench(fused, return_mode="median") * 1e3
            v["speedup"] = v["apart_us"] / v["fused_us"]
        row["pairs"][name] = v
    return row


def _print_norm(row: dict) -> None:
    B, T, C = row["shape"]
    print(f"[{B}, {T}, {C}] q and k, per-head L2 norm over {row['norm_dim']} channels: apart vs in the conv passes")
    print(f"  {'pass':<20} {'apart us':>9} {'fused us':>9} {'speedup':>8}  check (fused vs apart)")
    for name, v in row["pairs"].items():
        t = (f"{v['apart_us']:9.1f} {v['fused_us']:9.1f} {v['speedup']:7.2f}x" if "apart_us" in v
             else f"{'-':>9} {'-':>9} {'-':>8}")
        bad = "  MISMATCH" if v["rel_vs_apart"] > CHECK_TOL else ""
        print(f"  {name:<20} {t}  {v['rel_vs_apart']:.1e}{bad}", flush=True)


def _print(row: dict) -> None:
    B, T, C = row["shape"]
    docs = f", documents of {row['doc_len']}" if row["doc_len"] else ""
    print(f"[{B}, {T}, {C}] KW {row['kw']} bf16{docs}: current kernels vs the fp32 reference: rel y "
          f"{row['rel_y']:.1e} dx {row['rel_dx']:.1e} dw {row['rel_dw']:.1e}")
    print(f"  {'variant':<24} {'us':>8} {'GB/s':>6} {'/ full bwd':>10}  check vs current")
    for name, v in row["variants"].items():
        t = f"{v['us']:8.1f} {v['gbs']:6.0f} {v['vs_full_bwd']:10.2f}" if "us" in v else f"{'-':>8} {'-':>6} {'-':>10}"
        if v["kind"] == "fwd":
            chk = f"y {v['rel_y_vs_current']:.1e}"
        else:
            chk = f"dx {v['rel_dx_vs_current']:.1e}"
            if "rel_dw_vs_current" in v:
                chk += f" dw {v['rel_dw_vs_current']:.1e}"
        bad = any(k.startswith("rel_") and val > CHECK_TOL for k, val in v.items())
        print(f"  {name:<24} {t}  {chk}{'  MISMATCH' if bad else ''}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", default=["2,4096,2048", "1,32768,2048", "2,4096,4096"], help="B,T,C ...")
    p.add_argument("--kw", type=int, default=4)
    p.add_argument("--doc-len", type=int, default=0, help="packed documents of this many tokens (0: none)")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--bwd-launch", nargs="*", default=[], metavar="BT,BC,WARPS,TIME_BLOCKS")
    p.add_argument("--norm-dim", type=int, default=0, help="also time q / k with their per-head L2 norm (0: not)")
    p.add_argument("--norm-only", action="store_true", help="with --norm-dim: only the norm table")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    dev = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    shapes = [(2, 37, 130)] if args.dry_run else [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    if dev == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    rows, norm_rows = [], []
    for B, T, C in shapes:
        if not args.norm_only:
            row = run_shape(B, T, C, args.kw, dev, timed=dev == "cuda", launches=args.bwd_launch,
                            doc_len=args.doc_len)
            rows.append(row)
            _print(row)
        if args.norm_dim:
            if args.dry_run:  # the dry-run shape's 130 channels hold no power-of-two head
                B, T, C = 2, 37, 64
            norm_rows.append(run_norm(B, T, C, args.kw, 16 if args.dry_run else args.norm_dim, dev,
                                      timed=dev == "cuda"))
            _print_norm(norm_rows[-1])
    if args.out:
        atomic_write_text(args.out, json.dumps({"conv": rows, "norm": norm_rows}, indent=1))
    if any(k.startswith("rel_") and val > CHECK_TOL for r in rows for v in r["variants"].values()
           for k, val in v.items()) or any(v["rel_vs_apart"] > CHECK_TOL for r in norm_rows for v in r["pairs"].values()):
        sys.exit("a variant's outputs do not match the current kernels' (MISMATCH above)")


if __name__ == "__main__":
    main()
