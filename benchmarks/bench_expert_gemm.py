"""The experts' grouped GEMMs of full fine-tuning alone, at the `small` preset's shapes: torch._grouped_mm
(CUTLASS, what the step runs) for the forward and dx, and for the weight gradient against our Triton
weight-gradient kernel (ops/moe/triton_grouped_mm.py `grouped_wgrad`) at several launch configurations (our
Triton forward lost to CUTLASS by 1.15-1.3x at every shape: ops/moe/__init__.py). Which of the three runs
furthest from the GEMM rate, and does a Triton launch beat CUTLASS on the weight gradient?

Shapes (one MoE layer, seq 4096 x micro-batch 2 routed top-8 to 64 experts: N = 65,536 rows, ~1,024 an expert;
latent I = 1024, expert width F = 768):
  gate_up  fwd  [N, I] x [E, 2F, I]^T        dx  [N, 2F] x [E, 2F, I]      wgrad  dh^T x, as two [E, F, I] or one [E, 2F, I]
  down     fwd  [N, F] x [E, I, F]^T         dx  [N, I] x [E, I, F]        wgrad  dy^T a  [E, I, F]
Rows per expert: a uniform routing (multinomial counts) or a skewed one (--skew: counts proportional to
1 / (1 + e / 8), the busiest expert ~8x the quietest).

Every variant's output is compared with torch._grouped_mm's (relative Frobenius error, bf16 inputs, fp32
accumulation); a variant off by more than 1e-2 is reported as wrong, not timed.

Usage: python3 benchmarks/bench_expert_gemm.py [--rows 65536] [--experts 64] [--skew] [--out FILE.json]
Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench_adamw import _ms  # noqa: E402  (median of CUDA-event intervals; every variant runs once before)

# wgrad launches: (BI, BO, BK, num_warps, num_stages)
WGRAD = [(128, 128, 64, 8, 3), (128, 128, 128, 8, 3), (128, 256, 64, 8, 3), (256, 128, 64, 8, 3),
         (128, 128, 64, 4, 4), (128, 256, 64, 8, 4), (64, 256, 64, 8, 4)]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).norm() / want.float().norm().clamp_min(1e-30)).item()


def main() -> None:
    from moeadapt.io import atomic_write_text
    from moeadapt.ops.moe import triton_grouped_mm as tg

    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--rows", type=int, default=65536)
    a.add_argument("--experts", type=int, default=64)
    a.add_argument("--latent", type=int, default=1024)
    a.add_argument("--ffn", type=int, default=768)
    a.add_argument("--skew", action="store_true")
    a.add_argument("--reps", type=int, default=20)
    a.add_argument("--out", default=None)
    args = a.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_expert_gemm needs a GPU")
    dev, bf = torch.device("cuda"), torch.bfloat16
    N, E, I, F = args.rows, args.experts, args.latent, args.ffn
    g = torch.Generator().manual_seed(0)
    weights = 1.0 / (1.0 + torch.arange(E) / 8.0) if args.skew else torch.ones(E)
    counts = torch.bincount(torch.multinomial(weights, N, replacement=True, generator=g), minlength=E)
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    print(f"N {N}, E {E}, rows an expert {counts.min().item()}..{counts.max().item()}, I {I}, F {F}", flush=True)
    x = torch.randn(N, I, device=dev, dtype=bf)
    pair = torch.randn(E, 2 * F, I, device=dev, dtype=bf) / I ** 0.5
    dh = torch.randn(N, 2 * F, device=dev, dtype=bf)
    act = torch.randn(N, F, device=dev, dtype=bf)
    w2 = torch.randn(E, I, F, device=dev, dtype=bf) / F ** 0.5
    dy = torch.randn(N, I, device=dev, dtype=bf)
    gmm = partial(torch._grouped_mm, offs=offs)
    # (op, flops, torch's call, [(launch name, Triton call)])
    ops = []
    ops.append(("gate_up fwd", 2 * N * I * 2 * F, partial(gmm, x, pair.transpose(1, 2)), []))
    ops.append(("gate_up dx", 2 * N * I * 2 * F, partial(gmm, dh, pair), []))
    ops.append(("down fwd", 2 * N * I * F, partial(gmm, act, w2.transpose(1, 2)), []))
    ops.append(("down dx", 2 * N * I * F, partial(gmm, dy, w2), []))

    def wgrad_variants(xx, dd, like):
        out = []
        for BI, BO, BK, warps, stages in WGRAD:
            launch = dict(BI=BI, BO=BO, BK=BK, num_warps=warps, num_stages=stages)
            out.append((f"triton BI{BI} BO{BO} BK{BK} w{warps} s{stages}",
                        _model_layout(partial(tg.grouped_wgrad, xx, dd, offs, like, launch=launch))))
        return out

    # dW[e] = x_e^T dy_e in [E, in, out] = torch._grouped_mm(x^T, dy); the model's weights are [E, out, in]:
    # torch computes dy^T x ([E, out, in]) directly; Triton's kernel writes [E, in, out] into a transposed view
    like_pair = torch.empty(E, 2 * F, I, device=dev, dtype=bf).transpose(1, 2)
    like_half = torch.empty(E, F, I, device=dev, dtype=bf).transpose(1, 2)
    like_w2 = torch.empty(E, I, F, device=dev, dtype=bf).transpose(1, 2)
    dhc = dh.contiguous()
    ops.append(("gate_up wgrad, two [E, F, I]", 2 * N * I * 2 * F,
                lambda: (gmm(dhc[:, :F].t(), x), gmm(dhc[:, F:].t(), x)),
                [(n, _both(f, f2)) for (n, f), (_, f2) in
                 zip(wgrad_variants(x, dhc[:, :F], like_half), wgrad_variants(x, dhc[:, F:], like_half))]))
    ops.append(("gate_up wgrad, one [E, 2F, I]", 2 * N * I * 2 * F, partial(gmm, dhc.t(), x),
                wgrad_variants(x, dhc, like_pair)))
    ops.append(("down wgrad", 2 * N * I * F, partial(gmm, dy.t(), act), wgrad_variants(act, dy, like_w2)))

    rows = []
    for name, flops, ref_fn, variants in ops:
        want = ref_fn()
        ms = _ms(ref_fn, args.reps)
        rows.append({"op": name, "variant": "torch._grouped_mm", "ms": ms, "TFLOPs": flops / ms / 1e9})
        print(f"{name:32s} {'torch._grouped_mm':34s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
        for vname, fn in variants:
            try:
                got = fn()
            except Exception as e:  # a launch that does not fit (shared memory): reported, not fatal
                print(f"{name:32s} {vname:34s} failed: {type(e).__name__}: {str(e)[:80]}", flush=True)
                continue
            err = _err(torch.cat([t.reshape(-1) for t in got]) if isinstance(got, tuple) else got,
                       torch.cat([t.reshape(-1) for t in want]) if isinstance(want, tuple) else want)
            if err > 1e-2:
                print(f"{name:32s} {vname:34s} wrong: relative error {err:.2e}", flush=True)
                continue
            ms = _ms(fn, args.reps)
            rows.append({"op": name, "variant": vname, "ms": ms, "TFLOPs": flops / ms / 1e9, "rel_err": err})
            print(f"{name:32s} {vname:34s} {ms:7.3f} ms  {flops / ms / 1e9:6.0f} TFLOP/s", flush=True)
    if args.out:
        atomic_write_text(args.out, json.dumps({"gpu": torch.cuda.get_device_name(), "rows_per_expert":
                                                counts.tolist(), "rows": rows}, indent=1))


def _model_layout(fn):
    """grouped_wgrad's [E, in, out] result (a transposed view of the model's [E, out, in] layout) as [E, out, in]."""
    return lambda: fn().transpose(1, 2)


def _both(f, f2):
    return lambda: (f(), f2())


if __name__ == "__main__":
    main()
