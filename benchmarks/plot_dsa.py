"""Plot session 6's DSA results on the H200 (issue 4) from the logs bench_dsa.py wrote:

    python benchmarks/plot_dsa.py        # -> benchmarks/plots/dsa_s6.png

Left: where the layer's time goes (LI, SFA, SFAG as % of the layer, its ms above; the parts are timed on their own,
so a stack lands within ~1% of 100) at each shape, call 2 (the Gluon forward only) next to
call 8 (the final tree). Right: the T = 32768 forward and backward from call 8's check, Triton vs Gluon forward
and the backward steps A..E of RESULTS.md (A = session 2's code, E = the default).
"""

from __future__ import annotations

import argparse
import json
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LOGS = "benchmarks/logs/2026-11-29-s6"


def table(call: int) -> dict[tuple[int, int], dict]:
    """(T, HQ) -> the row bench_shape wrote (ms of LI, SFA, SFAG, layer)."""
    rows = {}
    for part in ("8k", "big"):
        with open(f"{LOGS}/call{call}_dsa_{part}.json") as f:
            for r in json.load(f)["rows"]:
                rows[(r["T"], r["H"])] = r
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/plots/dsa_s6.png")
    a = ap.parse_args()
    before, after = table(2), table(8)
    with open(f"{LOGS}/call8_dsa_check.json") as f:
        check = {r["H"]: r for r in json.load(f)["check"]["rows"]}
    with open(f"{LOGS}/call3_dsa_check.json") as f:  # A (session 2's code) last ran in call 3
        check3 = {r["H"]: r for r in json.load(f)["check"]["rows"]}

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 6))
    shapes = sorted(after)
    x = range(len(shapes))
    for off, rows, tag, alpha in ((-0.2, before, "call 2", 0.45), (0.2, after, "call 8", 1.0)):
        bottom = [0.0] * len(shapes)
        for part, color in (("li_ms", "tab:gray"), ("sfa_ms", "tab:blue"), ("sfag_ms", "tab:orange")):
            vals = [rows[s][part] / rows[s]["layer_ms"] * 100 for s in shapes]
            ax1.bar([i + off for i in x], vals, 0.38, bottom=bottom, color=color, alpha=alpha,
                    label=f"{part[:-3].upper()} ({tag})")
            bottom = [b + v for b, v in zip(bottom, vals)]
        for i, s in enumerate(shapes):
            ax1.text(i + off, bottom[i] + 1, f"{rows[s]['layer_ms']:.0f}\nms", ha="center", va="bottom", fontsize=7)
    ax1.set_xticks(list(x), [f"T={t // 1024}k\nHQ={h}" for t, h in shapes])
    ax1.set_ylim(0, 118)
    ax1.set_ylabel("% of the layer's forward + backward (total above each bar)")
    ax1.set_title("DSA layer on one H200: share of LI, SFA, SFAG (left bar call 2, right bar call 8)", fontsize=10)
    ax1.legend(fontsize=7, ncol=6, loc="upper center", bbox_to_anchor=(0.5, -0.13))

    names = [("SFA Triton", lambda h: check[h]["fwd_skip_rev"][0]), ("SFA Gluon", lambda h: check[h]["fwd_gluon_ws"][0]),
             ("SFAG A", lambda h: check3[h]["bwd_pds"][0]), ("SFAG D (8-warp pass 2)", lambda h: check[h]["bwd_p2_w8"][0]),
             ("SFAG E (default)", lambda h: check[h]["bwd_pds"][0])]
    for j, h in enumerate(sorted(check)):
        vals = [fn(h) for _, fn in names]
        ax2.bar([i + (j - 0.5) * 0.4 for i in range(len(names))], vals, 0.38, label=f"HQ = {h}",
                color=("tab:green", "tab:purple")[j])
        for i, v in enumerate(vals):
            ax2.text(i + (j - 0.5) * 0.4, v, f"{v:.0f}", ha="center", va="bottom", fontsize=7)
    ax2.set_xticks(range(len(names)), [n for n, _ in names], fontsize=8)
    ax2.set_ylabel("ms at T = 32768")
    ax2.set_title("T = 32768: forward and backward kernels (A: call 3, others: call 8)")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    tmp = a.out + ".tmp.png"
    fig.savefig(tmp, dpi=120)
    os.replace(tmp, a.out)  # atomic: a half-written plot never replaces a good one
    print(a.out)


if __name__ == "__main__":
    main()
