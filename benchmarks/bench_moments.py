"""Training with AdamW's moments in fp32 and in bf16 (`train.moment_dtype`), same config, seed and data: do the
loss curves agree? One `moeadapt train` run per moment dtype (on a GPU: bf16 moments are CopyAdamW's), the train
loss of every step and the evals compared.

Usage: python3 benchmarks/bench_moments.py CONFIG [--set KEY=VALUE ...] [--out DIR] [--timeout S]
e.g.   python3 benchmarks/bench_moments.py moeadapt/assets/tiny_pretrain.yaml --out /tmp/m

Prints per run: mean train loss over the last tenth of the steps, each eval loss, steady-state tokens/s; then the
largest gap between the two runs' losses smoothed over 10 steps. With --out, writes moments.json and moments.png
(the two loss curves and their smoothed difference), each atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

DTYPES = ("fp32", "bf16")


def _run(config: str, dtype: str, sets: list[str], out_dir: Path, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "moeadapt", "train", config, "--set", f"train.moment_dtype={dtype}",
           f"train.output_dir={out_dir}", "train.log_every=1", *sets]
    print(f"== {dtype}: {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.run(cmd, timeout=timeout).returncode
    if rc:
        sys.exit(f"the {dtype} run exited {rc}")
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    summary = json.loads((out_dir / "summary.json").read_text())
    return {"loss": {r["step"]: r["loss"] for r in rows if r.get("kind") == "train" and "loss" in r},
            "eval": {r["step"]: r["eval_loss"] for r in rows if r.get("kind") == "eval"},
            "tokens_per_s_steady": summary.get("tokens_per_s_steady")}


def _smooth(xs: list[float], k: int = 10) -> list[float]:
    return [sum(xs[max(0, i - k + 1):i + 1]) / len(xs[max(0, i - k + 1):i + 1]) for i in range(len(xs))]


def _plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1])
    for d in DTYPES:
        steps = sorted(res[d]["loss"])
        a.plot(steps, _smooth([res[d]["loss"][s] for s in steps]), label=f"{d} moments")
    a.set_ylabel("train loss (10-step mean)")
    a.legend()
    a.set_title(res["title"])
    steps = res["steps"]
    b.plot(steps, res["gap"], color="k")
    b.axhline(0, color="grey", lw=0.5)
    b.set_ylabel("bf16 - fp32")
    b.set_xlabel("step")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides, both runs")
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=int, default=600, help="seconds one run may take")
    args = p.parse_args()
    from moeadapt.io import atomic_write_text

    res = {"config": args.config, "set": args.set}
    with tempfile.TemporaryDirectory() as tmp:
        for d in DTYPES:
            res[d] = _run(args.config, d, args.set, Path(tmp) / d, args.timeout)
    steps = sorted(set(res["fp32"]["loss"]) & set(res["bf16"]["loss"]))
    if not steps:
        sys.exit("the runs logged no common train step")
    gap = [b - a for a, b in zip(_smooth([res["fp32"]["loss"][s] for s in steps]),
                                 _smooth([res["bf16"]["loss"][s] for s in steps]))]
    res.update(steps=steps, gap=gap, max_abs_gap=max(abs(g) for g in gap),
               title=f"{Path(args.config).name} {' '.join(args.set)}: AdamW moments fp32 vs bf16")
    tail = max(1, len(steps) // 10)
    print(f"{'moments':>8} | last {tail} steps' mean loss | evals | tokens/s (steady)")
    for d in DTYPES:
        last = sum(res[d]["loss"][s] for s in steps[-tail:]) / tail
        ev = ", ".join(f"{k}: {v:.4f}" for k, v in sorted(res[d]["eval"].items()))
        print(f"{d:>8} | {last:.4f} | {ev} | {res[d]['tokens_per_s_steady']}")
    print(f"largest |bf16 - fp32| of the 10-step mean loss: {res['max_abs_gap']:.4f}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "moments.json", json.dumps(res, indent=1))
        _plot(res, out / "moments.png")


if __name__ == "__main__":
    main()
