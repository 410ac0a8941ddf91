"""Plot where the training step's GPU time goes: CUDA time by kernel family, one stacked bar per run.

Usage: python3 benchmarks/plot_step.py --out benchmarks/plots/step_families.png \\
           "LoRA=lora.json" "full FT=full.json" [--target "full FT=153.3:35% MFU" ...] [--title TEXT]

Each run is LABEL=PATH, where PATH is a result of `bench_vs_transformers.py --child ours:MODE --result PATH
--profile` (its `profile.families_ms`, `step_s`, `tokens_per_s`). A bar stacks the families (largest first, the
same colour per family across bars) and is labelled with the run's ms/step and tokens/s. --target LABEL=MS:TEXT
draws a dashed line over that bar at the step time a target needs (e.g. the step that 35% MFU implies); a label
may hold "=", a PATH or TEXT may not. The
write is atomic (a temporary file renamed into place).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _load(spec: str) -> tuple[str, dict]:
    label, _, path = spec.rpartition("=")
    if not path:
        sys.exit(f"run {spec!r}: expected LABEL=PATH")
    try:
        r = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        sys.exit(f"run {label!r}: cannot read {path}: {e}")
    if not (r.get("profile") or {}).get("families_ms"):
        sys.exit(f"run {label!r}: {path} has no profile.families_ms (run the bench with --profile)")
    return label, r


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("runs", nargs="+", metavar="LABEL=PATH")
    p.add_argument("--target", action="append", default=[], metavar="LABEL=MS:TEXT")
    p.add_argument("--title", default="CUDA time by kernel family in one profiled step")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    runs = [_load(s) for s in args.runs]
    targets = {}
    for t in args.target:
        label, _, rest = t.rpartition("=")
        ms, _, text = rest.partition(":")
        try:
            targets[label] = (float(ms), text)
        except ValueError:
            sys.exit(f"--target {t!r}: expected LABEL=MS:TEXT with MS a number")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    totals: dict[str, float] = {}
    for _, r in runs:
        for f, ms in r["profile"]["families_ms"].items():
            totals[f] = totals.get(f, 0.0) + ms
    fams = sorted(totals, key=lambda f: -totals[f])
    colors = {f: plt.get_cmap("tab20")(i % 20) for i, f in enumerate(fams)}
    fig, ax = plt.subplots(figsize=(3.4 + 1.6 * len(runs), 5))
    for i, (label, r) in enumerate(runs):
        bottom = 0.0
        for f in fams:
            ms = r["profile"]["families_ms"].get(f, 0.0)
            ax.bar(i, ms, 0.6, bottom=bottom, color=colors[f], label=f if i == 0 else None)
            if ms >= 8:
                ax.text(i, bottom + ms / 2, f"{f} {ms:.0f}", ha="center", va="center", fontsize=7)
            bottom += ms
        ax.text(i, bottom + 3, f"{r['step_s'] * 1e3:.1f} ms/step\n{r['tokens_per_s']:,.0f} tok/s", ha="center",
                va="bottom", fontsize=8)
        if label in targets:
            ms, text = targets[label]
            ax.hlines(ms, i - 0.4, i + 0.4, colors="k", linestyles="--")
            ax.text(i + 0.42, ms, f"{text}\n{ms:.0f} ms", va="center", fontsize=7)
    ax.set_xticks(range(len(runs)), [label for label, _ in runs])
    ax.set_xlim(-0.6, len(runs) - 0.4 + (0.5 if targets else 0))
    ax.set_ylabel("CUDA ms per step (profiled step)")
    ax.set_ylim(0, max(r["profile"]["total_ms"] for _, r in runs) * 1.18)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_title(args.title, fontsize=9)
    fig.tight_layout()
    out = Path(args.out)
    tmp = out.with_name(f".{out.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)
    print(f"plot: {out}")


if __name__ == "__main__":
    main()
