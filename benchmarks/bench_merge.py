"""Small-batch merging (issue 5): M micro-batches as one forward (experts see all their tokens in one grouped
GEMM) vs gradient accumulation over M separate forwards. Same math (tests/models/test_merge_microbatches.py);
this measures whether it is faster, and what it costs in peak memory.

    python benchmarks/bench_merge.py                       # GPU: small preset cut to 4 layers, bf16
    python benchmarks/bench_merge.py --device cpu --preset tiny --seq 128   # a dry run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from moeadapt.config import get_preset  # noqa: E402
from moeadapt.models.model import build_model, materialize  # noqa: E402


def step(model, xs, ys, merged: bool, amp: bool) -> None:
    M = len(xs)
    ctx = torch.autocast("cuda", dtype=torch.bfloat16) if amp else torch.autocast("cpu", enabled=False)
    with ctx:
        if merged:
            out = model(torch.cat(xs), torch.cat(ys), return_logits=False, micro_batches=M)
            (out.loss + out.aux_loss).backward()
        else:
            for x, y in zip(xs, ys):
                out = model(x, y, return_logits=False)
                ((out.loss + out.aux_loss) / M).backward()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=1, help="rows per micro-batch")
    ap.add_argument("--M", type=int, nargs="+", default=[2, 4, 8], help="micro-batches per optimizer step")
    ap.add_argument("--experts", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--reps", type=int, default=5)
    a = ap.parse_args()
    dev = torch.device(a.device)
    amp = dev.type == "cuda"
    print("| experts | M | tokens/micro-batch | sequential ms | merged ms | speed-up | peak GiB seq / merged |")
    print("|---:|---:|---:|---:|---:|---:|---|")
    for E in a.experts:
        spec = get_preset(a.preset, n_layers=a.layers, n_routed_experts=E,
                          n_experts_per_tok=min(get_preset(a.preset).n_experts_per_tok, E))
        model = materialize(build_model(spec, "meta"), dev, seed=0)
        for M in a.M:
            xs = [torch.randint(0, min(spec.vocab_size, 256), (a.micro, a.seq), device=dev) for _ in range(M)]
            ys = [torch.randint(0, min(spec.vocab_size, 256), (a.micro, a.seq), device=dev) for _ in range(M)]
            res = {}
            for merged in (False, True):
                step(model, xs, ys, merged, amp)  # warm-up (compiles kernels)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                ts = []
                for _ in range(a.reps):
                    model.zero_grad(set_to_none=True)
                    t0 = time.perf_counter()
                    step(model, xs, ys, merged, amp)
                    if dev.type == "cuda":
                        torch.cuda.synchronize()
                    ts.append(time.perf_counter() - t0)
                peak = torch.cuda.max_memory_allocated() / 2**30 if dev.type == "cuda" else float("nan")
                res[merged] = (sorted(ts)[len(ts) // 2] * 1e3, peak)
            (s, ps), (m, pm) = res[False], res[True]
            print(f"| {E} | {M} | {a.micro * a.seq} | {s:.1f} | {m:.1f} | {s / m:.2f}x | {ps:.1f} / {pm:.1f} |")


if __name__ == "__main__":
    main()
