"""Plot the grouped-LoRA overhead over the frozen layer per process (issue 5, session 4 logs):

    python benchmarks/plot_lora_overhead.py [--logs benchmarks/logs/2026-11-29-s4] [--out benchmarks/plots/lora_overhead_s4.png]

Points: bench_moe.py's packed layer ("layer" scope, the default path: lean at E = 64 / 256, the Triton LoRA kernel
at E = 896) from every `call*_moe_rounds*.jsonl`, and the model's own LatentMoE (bench_moe_model.py, the
fixed-gradient harness of call 7). The dashed line is the issue's 25% target.
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


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--logs", default="benchmarks/logs/2026-11-29-s4")
    ap.add_argument("--out", default="benchmarks/plots/lora_overhead_s4.png")
    a = ap.parse_args()
    packed, model = {}, {}
    for f in sorted(glob.glob(os.path.join(a.logs, "call*_moe_rounds*.jsonl"))):
        for line in open(f):
            d = json.loads(line)
            if d.get("summary") and d.get("scope") == "layer" and DEFAULT.get(d["E"]) in d:
                packed.setdefault(d["E"], []).append(d[DEFAULT[d["E"]]])
    for f in sorted(glob.glob(os.path.join(a.logs, "call7_moe_model*.jsonl"))):
        for line in open(f):
            d = json.loads(line)
            if "overhead_pct" in d:
                model.setdefault(d["E"], []).append(d["overhead_pct"])
    cases = sorted(set(packed) | set(model))
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, E in enumerate(cases):
        for dx, (vals, color, label) in enumerate(((packed.get(E, []), "tab:blue", "bench_moe.py packed layer"),
                                                   (model.get(E, []), "tab:orange", "model LatentMoE (w1, w3, w2)"))):
            x = [i + (dx - 0.5) * 0.3] * len(vals)
            ax.scatter(x, vals, color=color, label=label if i == 0 else None, alpha=0.8)
    ax.axhline(25, ls="--", color="gray", label="target 25%")
    ax.set_xticks(range(len(cases)), [f"E={E}" for E in cases])
    ax.set_ylabel("LoRA overhead over frozen, % (median of rounds)")
    ax.set_title("Grouped LoRA r=16, H200, one point per process (2026-11-29, session 4)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    tmp = a.out + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, a.out)
    print(a.out, {E: packed.get(E) for E in cases}, {E: model.get(E) for E in cases})


if __name__ == "__main__":
    main()
