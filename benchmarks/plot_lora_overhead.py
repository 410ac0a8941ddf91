"""Plot the grouped-LoRA overhead over the frozen layer, one point per process (issue 5):

    python benchmarks/plot_lora_overhead.py                      # session 5: the model layer before / after
    python benchmarks/plot_lora_overhead.py --session 4          # session 4's plot

A series is `label=glob` (--series, repeatable): every `.jsonl` file the glob matches gives its points, either
bench_moe.py's packed layer ("layer" scope, the default path: lean at E = 64 / 256, the Triton LoRA kernel at
E = 896; its `summary` rows) or bench_moe_model.py's model LatentMoE (`overhead_pct` rows). The dashed line is the
issue's 25% target.
"""

from __future__ import annotations

import argparse
import glob
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

DEFAULT = {64: "lora-lean", 256: "lora-lean", 896: "lora-triton"}
S4, S5 = "benchmarks/logs/2026-11-29-s4", "benchmarks/logs/2026-11-29-s5"
SESSIONS = {
    4: ("session 4", [f"bench_moe.py packed layer={S4}/call*_moe_rounds*.jsonl",
                      f"model LatentMoE (w1, w3, w2)={S4}/call7_moe_model*.jsonl"]),
    5: ("session 5", [f"model, session 4 (call 7)={S4}/call7_moe_model*.jsonl",
                      f"model, session 5 before the host cuts (call 1)={S5}/call1_moe_model*.jsonl",
                      f"model, after (calls 4, 5; router bf16 as before)={S5}/call[45]_moe_model[12_][!l]*",
                      f"model, final tree (call 8, router tf32)={S5}/call8_moe_model*.jsonl",
                      f"bench_moe.py packed layer (call 5)={S5}/call5_moe_rounds*.jsonl"]),
}


def points(pattern: str) -> dict[int, list[float]]:
    out: dict[int, list[float]] = {}
    for f in sorted(glob.glob(pattern)):
        if not f.endswith(".jsonl"):
            continue
        for line in open(f):
            d = json.loads(line)
            if d.get("summary") and d.get("scope") == "layer" and DEFAULT.get(d["E"]) in d:
                out.setdefault(d["E"], []).append(d[DEFAULT[d["E"]]])
            elif "overhead_pct" in d and d.get("lora_path") is not None:
                out.setdefault(d["E"], []).append(d["overhead_pct"])
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--session", type=int, default=5, choices=sorted(SESSIONS))
    ap.add_argument("--series", action="append", default=None, help="label=glob (replaces the session's series)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    title, series = SESSIONS[a.session]
    series = a.series or series
    out_path = a.out or f"benchmarks/plots/lora_overhead_s{a.session}.png"
    data = [(s.split("=", 1)[0], points(s.split("=", 1)[1])) for s in series]
    cases = sorted({E for _, d in data for E in d})
    fig, ax = plt.subplots(figsize=(8, 4.5))
    width = 0.7 / max(len(data), 1)
    for k, (label, d) in enumerate(data):
        for i, E in enumerate(cases):
            vals = d.get(E, [])
            ax.scatter([i + (k - (len(data) - 1) / 2) * width] * len(vals), vals, color=f"C{k}",
                       label=label if i == 0 or not any(E2 in d for E2 in cases[:i]) else None, alpha=0.8)
    ax.axhline(25, ls="--", color="gray", label="target 25%")
    ax.set_xticks(range(len(cases)), [f"E={E}" for E in cases])
    ax.set_ylabel("LoRA overhead over frozen, % (median of rounds)")
    ax.set_title(f"Grouped LoRA r=16, H200, one point per process (2026-11-29, {title})")
    ax.legend(fontsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    tmp = out_path + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, out_path)
    print(out_path)
    for label, d in data:
        print(f"  {label}: " + ", ".join(f"E={E} {d[E]}" for E in cases if E in d))


if __name__ == "__main__":
    main()
