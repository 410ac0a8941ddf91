"""Benchmark the KDA layer's fused short causal conv + SiLU (`ops/kda/triton_conv.py`) at the step's shapes.

Usage (GPU): python3 benchmarks/bench_short_conv.py [--shapes 2,4096,2048 ...] [--kw 4] [--out R.json]
To compare two trees, run this file from each (PYTHONPATH set to the tree) in one device call.

Per shape (B, T, C; bf16 x and dy, fp32 w): the forward and the backward (`conv_silu_bwd`: dx and dw) timed
separately (triton.testing.do_bench, median), each with its effective bandwidth over the bytes it must move
(forward: read x, write y; backward: read x and dy, write dx), and the outputs against the fp32 reference
(`causal_conv_silu_reference` on upcast inputs) as relative L2 errors. --dry-run: CPU under TRITON_INTERPRET=1
at a tiny shape (tests this script). --bwd-launch BT,BC,WARPS,TIME_BLOCKS ...: also times the backward at these
launches of its first pass (`conv_silu_bwd_launch`; the defaults are the constants beside the kernel).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moeadapt.ops.kda.short_conv import causal_conv_silu_reference  # noqa: E402
from moeadapt.ops.kda.triton_conv import _conv_silu_bwd_impl, _conv_silu_fwd_impl  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().float(), b.detach().float()
    return float((a - b).norm() / b.norm().clamp(min=1e-30))


def run_shape(B: int, T: int, C: int, KW: int, dev: str, timed: bool, launches: list[str]) -> dict:
    g = torch.Generator(device="cpu").manual_seed(B * 1_000_003 + T * 31 + C)
    x = torch.randn(B, T, C, generator=g).to(dev, torch.bfloat16)
    w = (torch.randn(C, 1, KW, generator=g) * 0.5).to(dev)
    dy = torch.randn(B, T, C, generator=g).to(dev, torch.bfloat16)
    y = _conv_silu_fwd_impl(x, w)
    dx, dw = _conv_silu_bwd_impl(x, w, dy)
    xr, wr = x.float().requires_grad_(), w.clone().requires_grad_()
    yr = causal_conv_silu_reference(xr, wr)
    yr.backward(dy.float())
    row = {"shape": [B, T, C], "kw": KW, "rel_y": _rel(y, yr), "rel_dx": _rel(dx, xr.grad),
           "rel_dw": _rel(dw, wr.grad)}
    if timed:
        n = B * T * C * x.element_size()
        fwd = triton.testing.do_bench(lambda: _conv_silu_fwd_impl(x, w), return_mode="median")
        bwd = triton.testing.do_bench(lambda: _conv_silu_bwd_impl(x, w, dy), return_mode="median")
        row.update(fwd_ms=fwd, bwd_ms=bwd, fwd_gbs=2 * n / fwd / 1e6, bwd_gbs=3 * n / bwd / 1e6)
    for spec in launches:
        from moeadapt.ops.kda.triton_conv import conv_silu_bwd_launch

        launch = tuple(int(v) for v in spec.split(","))
        fn = functools.partial(conv_silu_bwd_launch, x, w, dy, None, *launch)
        ldx, ldw = fn()
        r = {"rel_dx": _rel(ldx, xr.grad), "rel_dw": _rel(ldw, wr.grad)}
        if timed:
            r["bwd_ms"] = triton.testing.do_bench(fn, return_mode="median")
        row.setdefault("bwd_launches", {})[spec] = r
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", nargs="*", default=["2,4096,2048", "1,32768,2048", "2,4096,4096"], help="B,T,C ...")
    p.add_argument("--kw", type=int, default=4)
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--bwd-launch", nargs="*", default=[], metavar="BT,BC,WARPS,TIME_BLOCKS")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    dev = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    shapes = [(2, 37, 130)] if args.dry_run else [tuple(int(v) for v in s.split(",")) for s in args.shapes]
    rows = []
    for B, T, C in shapes:
        r = run_shape(B, T, C, args.kw, dev, timed=dev == "cuda", launches=args.bwd_launch)
        rows.append(r)
        t = (f"  fwd {r['fwd_ms'] * 1e3:7.1f} us ({r['fwd_gbs']:5.0f} GB/s)  bwd {r['bwd_ms'] * 1e3:7.1f} us "
             f"({r['bwd_gbs']:5.0f} GB/s)") if "fwd_ms" in r else ""
        print(f"[{B}, {T}, {C}] KW {args.kw}{t}  rel y {r['rel_y']:.1e} dx {r['rel_dx']:.1e} dw {r['rel_dw']:.1e}",
              flush=True)
        for spec, lr in r.get("bwd_launches", {}).items():
            t = f"bwd {lr['bwd_ms'] * 1e3:7.1f} us" if "bwd_ms" in lr else ""
            print(f"    launch {spec}: {t}  rel dx {lr['rel_dx']:.1e} dw {lr['rel_dw']:.1e}", flush=True)
    if args.out:
        tmp = args.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(rows, f, indent=1)
        os.replace(tmp, args.out)


if __name__ == "__main__":
    main()
