"""Training with the optimizer's state in lower precision, same config, seed and data: do the loss curves agree?
One `moeadapt train` run per variant (on a GPU: bf16 moments and bf16 weights are CopyAdamW's), the train loss of
every step and the evals compared against the fp32 run.

Variants (`--variants`, comma list; the first is the baseline):
  fp32     fp32 weights (bf16 copies for the matmuls) and fp32 AdamW moments
  bf16m    train.moment_dtype bf16: the moments stochastically rounded
  bf16w    train.weight_dtype bf16: the weights themselves bf16, stochastically rounded, no fp32 weight
  bf16wm   both
  split    train.weight_dtype fp32_split: fp32 weights kept as a bf16 half (the matmuls' operand) + an int16 half;
           the default (auto) where it runs
  splitm   split weights and bf16 moments

Usage: python3 benchmarks/bench_precision.py CONFIG [--variants fp32,bf16m,bf16wm] [--set KEY=VALUE ...]
                                             [--out DIR] [--timeout S]
e.g.   python3 benchmarks/bench_precision.py moeadapt/assets/tiny_pretrain.yaml --out /tmp/m

Prints per run: mean train loss over the last tenth of the steps, each eval loss, steady-state tokens/s; then,
per variant, the largest gap to the baseline's loss smoothed over 10 steps. With --out, writes precision.json and
precision.png (the loss curves and their smoothed differences to the baseline), each atomically.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = {"fp32": ["train.weight_dtype=fp32"], "bf16m": ["train.moment_dtype=bf16", "train.weight_dtype=fp32"],
            "bf16w": ["train.weight_dtype=bf16"],
            "bf16wm": ["train.moment_dtype=bf16", "train.weight_dtype=bf16"],
            "split": ["train.weight_dtype=fp32_split"],
            "splitm": ["train.moment_dtype=bf16", "train.weight_dtype=fp32_split"]}
LABELS = {"fp32": "fp32 weights + moments", "bf16m": "bf16 moments", "bf16w": "bf16 weights",
          "bf16wm": "bf16 weights + moments", "split": "split fp32 weights",
          "splitm": "split fp32 weights + bf16 moments"}


def _run(config: str, variant: str, sets: list[str], out_dir: Path, timeout: int) -> dict:
    cmd = [sys.executable, "-m", "moeadapt", "train", config, "--set", *VARIANTS[variant],
           f"train.output_dir={out_dir}", "train.log_every=1", *sets]
    print(f"== {variant}: {' '.join(cmd[1:])}", flush=True)
    rc = subprocess.run(cmd, timeout=timeout).returncode
    if rc:
        sys.exit(f"the {variant} run exited {rc}")
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

    names = res["variants"]
    color = {d: f"C{i}" for i, d in enumerate(names)}  # a variant's colour in both panels
    fig, (a, b) = plt.subplots(2, 1, figsize=(8, 6), sharex=True, height_ratios=[3, 1])
    for d in names:
        steps = sorted(res[d]["loss"])
        a.plot(steps, _smooth([res[d]["loss"][s] for s in steps]), label=LABELS[d], color=color[d])
    a.set_ylabel("train loss (10-step mean)")
    a.legend()
    a.set_title("\n".join(textwrap.wrap(res["title"], 90)), fontsize=9)
    for d in names[1:]:
        b.plot(res["steps"], res["gap"][d], label=LABELS[d], color=color[d])
    b.axhline(0, color="grey", lw=0.5)
    b.set_ylabel(f"minus {names[0]}")
    b.set_xlabel("step")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, path)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("config")
    p.add_argument("--variants", default="fp32,bf16m,bf16wm")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="more config overrides, every run")
    p.add_argument("--out", default=None)
    p.add_argument("--timeout", type=int, default=600, help="seconds one run may take")
    args = p.parse_args()
    from moeadapt.io import atomic_write_text

    names = args.variants.split(",")
    if len(names) < 2 or set(names) - set(VARIANTS):
        sys.exit(f"--variants {args.variants!r}: two or more of {', '.join(VARIANTS)}")
    res = {"config": args.config, "set": args.set, "variants": names}
    with tempfile.TemporaryDirectory() as tmp:
        for d in names:
            res[d] = _run(args.config, d, args.set, Path(tmp) / d, args.timeout)
    steps = sorted(set.intersection(*(set(res[d]["loss"]) for d in names)))
    if not steps:
        sys.exit("the runs logged no common train step")
    base = _smooth([res[names[0]]["loss"][s] for s in steps])
    gap = {d: [b - a for a, b in zip(base, _smooth([res[d]["loss"][s] for s in steps]))] for d in names[1:]}
    res.update(steps=steps, gap=gap, max_abs_gap={d: max(abs(g) for g in gap[d]) for d in gap},
               title=f"{Path(args.config).name} {' '.join(args.set)}: optimizer state precision")
    tail = max(1, len(steps) // 10)
    print(f"{'variant':>8} | last {tail} steps' mean loss | evals | tokens/s (steady) | largest |gap| to {names[0]}")
    for d in names:
        last = sum(res[d]["loss"][s] for s in steps[-tail:]) / tail
        ev = ", ".join(f"{k}: {v:.4f}" for k, v in sorted(res[d]["eval"].items()))
        g = f"{res['max_abs_gap'][d]:.4f}" if d in gap else "-"
        print(f"{d:>8} | {last:.4f} | {ev} | {res[d]['tokens_per_s_steady']} | {g}")
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "precision.json", json.dumps(res, indent=1))
        _plot(res, out / "precision.png")


if __name__ == "__main__":
    main()
