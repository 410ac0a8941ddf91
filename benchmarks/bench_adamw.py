"""The multi-tensor AdamW kernel (ops/optim/triton_adamw.py) alone: ms per step and the bandwidth it reaches, for
fp32 and bf16 moments, fp32 weights with their bf16 copy, bf16 weights and split fp32 weights (a bf16 half and
an int16 half: train.weight_dtype fp32_split), and each loop step `sub`, on one list of tensors shaped like full
fine-tuning's.

Usage: python3 benchmarks/bench_adamw.py [--params 1.0e9] [--subs 4096,2048,1024,512,256] [--warps 4,8]
                                        [--out FILE.json]

Bytes a parameter: the bf16 gradient (2) read, the weight and the two moments read and written, the bf16 copy of
an fp32 weight written (2): fp32 weight and moments 28, bf16 moments 20, bf16 weights and moments 14 (no copy),
bf16 weights with fp32 moments 22, split weights 26 (fp32 moments) or 18 (bf16). Every variant's result is
compared with the first's of its kind (the same arithmetic: equal bit for bit). First, a plain device-to-device
copy's bandwidth on the same card: the rate a memory-bound pass can reach there. Needs a GPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _tensors(n_params: int, moment_dtype: torch.dtype, weight_dtype: torch.dtype | str, device) -> dict:
    """~40 tensors of mixed sizes summing to about n_params (expert stacks, projections, norms); weight_dtype
    "split": bf16 weights with their int16 low halves ("lo")."""
    split = weight_dtype == "split"
    weight_dtype = torch.bfloat16 if split else weight_dtype
    g = torch.Generator().manual_seed(0)
    big = n_params // 48
    sizes = [big] * 40 + [int(x) for x in torch.randint(1, big // 8, (64,), generator=g)] + [2048] * 32
    out = {"p": [torch.randn(n, device=device).to(weight_dtype) for n in sizes],
           "g": [torch.randn(n, device=device).to(torch.bfloat16) for n in sizes],
           "m": [torch.zeros(n, device=device, dtype=moment_dtype) for n in sizes],
           "v": [torch.zeros(n, device=device, dtype=moment_dtype) for n in sizes],
           "step": [torch.ones((), device=device) for _ in sizes]}
    if weight_dtype == torch.float32:
        out["c"] = [torch.empty(n, device=device, dtype=torch.bfloat16) for n in sizes]
    if split:
        out["lo"] = [torch.randint(-2**15, 2**15, (n,), device=device, dtype=torch.int16) for n in sizes]
    return out


def _ms(fn, reps: int) -> float:
    ev = [torch.cuda.Event(enable_timing=True) for _ in range(reps + 1)]
    for i in range(reps):
        ev[i].record()
        fn()
    ev[-1].record()
    torch.cuda.synchronize()
    return sorted(ev[i].elapsed_time(ev[i + 1]) for i in range(reps))[reps // 2]


def main() -> None:
    from moeadapt.io import atomic_write_text
    from moeadapt.ops.optim import TensorBlocks, TensorTable, adamw_

    a = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    a.add_argument("--params", type=float, default=1.0e9)
    a.add_argument("--subs", default="4096,2048,1024,512,256")
    a.add_argument("--warps", default="4", help="comma list of num_warps to launch with (every sub with each)")
    a.add_argument("--reps", type=int, default=10)
    a.add_argument("--out", default=None)
    args = a.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_adamw needs a GPU")
    dev = torch.device("cuda")
    variants = [(int(s), int(w)) for w in args.warps.split(",") for s in args.subs.split(",")]  # (sub, warps)
    rows = []
    # the bandwidth a plain device-to-device copy reaches on this card: what a memory-bound pass can hope for
    src = torch.empty(int(args.params) * 2, dtype=torch.float32, device=dev)  # 8 B a parameter each way
    dst = torch.empty_like(src)
    dst.copy_(src)
    copy_ms = _ms(partial(dst.copy_, src), args.reps)
    copy_tb = 2 * src.numel() * 4 / copy_ms / 1e9
    print(f"device-to-device copy of {src.numel() * 4 / 1e9:.1f} GB: {copy_ms:.2f} ms, {copy_tb:.2f} TB/s", flush=True)
    del src, dst
    f32, b16 = torch.float32, torch.bfloat16
    kinds = ((f32, f32, 28), (b16, f32, 20), (f32, b16, 22), (b16, b16, 14), (f32, "split", 26), (b16, "split", 18))
    for mdt, wdt, nbytes in kinds:
        ts = _tensors(int(args.params), mdt, wdt, dev)
        n = sum(t.numel() for t in ts["p"])
        blocks = TensorBlocks([t.numel() for t in ts["p"]], dev)
        tabs = {k: TensorTable(v, dev, row_blocks=k in ("p", "c")) for k, v in ts.items()}
        start = {k: [t.clone() for t in ts[k]] for k in ("p", "m", "v", "lo") if k in ts}
        first = None
        for sub, warps in variants:
            for k in start:  # the same starting state for every variant
                for t, s in zip(ts[k], start[k]):
                    t.copy_(s)
            kw = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, seed=5, sub=sub, num_warps=warps)
            adamw_(tabs, blocks, **kw)  # compile, and the result every variant must give
            got = [torch.cat([t.view(-1).float()[:4096] for t in ts[k]]) for k in tabs
                   if k in ("p", "m", "v", "c", "lo")]
            same = None if first is None else all(torch.equal(x, y) for x, y in zip(got, first))
            first = first or got
            ms = _ms(partial(adamw_, tabs, blocks, **kw), args.reps)
            row = {"moments": str(mdt).split(".")[-1], "weights": str(wdt).split(".")[-1],  # "split" stays
                   "sub": sub, "num_warps": warps, "params": n, "ms": ms, "TB_per_s": n * nbytes / ms / 1e9,
                   "same_as_first": same}
            rows.append(row)
            print(f"weights {row['weights']:>8} moments {row['moments']:>8}  sub {sub:>5} warps {warps}: "
                  f"{ms:7.2f} ms  {row['TB_per_s']:.2f} TB/s"
                  + ("" if same is None else f"  same as the first: {same}"),
                  flush=True)
        del ts, tabs, start, first
        torch.cuda.empty_cache()
    if args.out:
        atomic_write_text(args.out, json.dumps({"gpu": torch.cuda.get_device_name(), "copy_TB_per_s": copy_tb,
                                                      "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
