"""Plot the `small` training step's time run by run, from the run table in benchmarks/RESULTS.md.

Usage: python3 benchmarks/plot_step_history.py [--results benchmarks/RESULTS.md]
           [--out benchmarks/plots/step_history.png]

Reads the rows of "The step, run by run" (| run | date | GPU | change | LoRA ms/step | full FT ms/step |) and
plots, per mode, the default's step time after each run (the value after the cell's last arrow; a cell without
an arrow is one measurement; "–" is none; a row comparing an opt-in setting with the default keeps the default and
marks the opt-in time apart), one marker shape per GPU kind. Runs are on different machines, so only the ratios
inside a row are measurements; the line shows where the step stood. The dashed lines are the step times the
issue's targets imply: 35% MFU (152.7 ms, full FT) and 3x the transformers + peft peer for LoRA (132.2 ms
against the best peer run on an H100). The write is atomic (a temporary file renamed into place).
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

TARGETS = {"full FT": (152.7, "35% MFU"), "LoRA": (132.2, "3x the peer (H100)")}
_OPT_IN = re.compile(r"opt-in [^;|]*vs the default|default vs bf16")
_ROW = re.compile(r"^\| (\d+) \| (\d\d-\d\d) \| (H100|H200) \|(.*)\|([^|]*)\|([^|]*)\|\s*$")


_NUM = re.compile(r"\d+(?:\.\d+)?")


def _first_ms(cell: str) -> float | None:
    m = _NUM.search(cell)
    return float(m.group()) if m else None


def _last_ms(cell: str) -> float | None:
    """The step time a cell ends with: the number after its last arrow, else its first number; None for none."""
    return _first_ms(cell.split("→")[-1] if "→" in cell else cell.split("(")[0])


def read_runs(text: str) -> list[dict]:
    """One dict per run row: run, date, gpu, and the LoRA / full FT step times of the defaults after it (None: not
    run). A row that compares an opt-in setting with the default (its change says "opt-in ... vs the default" or
    "default vs bf16 ...") keeps the default's time (the cell's first number) and the opt-in one apart, in
    "<mode> opt-in"."""
    runs = []
    for line in text.splitlines():
        m = _ROW.match(line)
        if m:
            run, date, gpu, change, lora, full = m.groups()
            row = {"run": int(run), "date": date, "gpu": gpu}
            opt_in = bool(_OPT_IN.search(change))
            for mode, cell in (("LoRA", lora), ("full FT", full)):
                arrow = "→" in cell
                row[mode] = _first_ms(cell.split("(")[0]) if opt_in and arrow else _last_ms(cell)
                row[f"{mode} opt-in"] = _last_ms(cell) if opt_in and arrow else None
            runs.append(row)
    return runs


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--results", default=str(Path(__file__).with_name("RESULTS.md")))
    p.add_argument("--out", default=str(Path(__file__).parent / "plots" / "step_history.png"))
    a = p.parse_args()
    try:
        runs = read_runs(Path(a.results).read_text())
    except OSError as e:
        sys.exit(f"cannot read {a.results}: {e}")
    if not runs:
        sys.exit(f"{a.results}: no rows of the run table (| run | date | GPU | change | LoRA | full FT |) found")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4.8))
    for mode, colour in (("full FT", "tab:blue"), ("LoRA", "tab:green")):
        pts = [(r["run"], r[mode], r["gpu"]) for r in runs if r[mode] is not None]
        ax.plot([x for x, _, _ in pts], [y for _, y, _ in pts], color=colour, lw=1, alpha=0.6)
        for gpu, marker in (("H200", "s"), ("H100", "o")):
            sel = [(x, y) for x, y, g in pts if g == gpu]
            ax.scatter([x for x, _ in sel], [y for _, y in sel], color=colour, marker=marker,
                       label=f"{mode}, {gpu}", zorder=3)
        opt = [(r["run"], r[f"{mode} opt-in"]) for r in runs if r[f"{mode} opt-in"] is not None]
        if opt:
            ax.scatter([x for x, _ in opt], [y for _, y in opt], facecolors="none", edgecolors=colour, marker="D",
                       label=f"{mode}, opt-in bf16 moments / weights (that run's other side)", zorder=3)
        ms, what = TARGETS[mode]
        ax.axhline(ms, color=colour, ls="--", lw=1)
        ax.text(runs[0]["run"], ms, f" {mode} target: {what}, {ms} ms", color=colour, va="bottom", fontsize=8)
    ax.set_xlabel("run (benchmarks/RESULTS.md, the step run by run)")
    ax.set_ylabel("ms / step after the run's change (lower is better)")
    ax.set_title(f"small preset, seq 4096 x 2: the training step, runs {runs[0]['run']}-{runs[-1]['run']} "
                 f"({runs[0]['date']} to {runs[-1]['date']})")
    ax.set_ylim(0, None)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    tmp.replace(out)
    print(f"wrote {out} ({len(runs)} runs)")


if __name__ == "__main__":
    main()
