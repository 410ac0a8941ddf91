"""Planner accuracy on one GPU: predicted vs measured peak memory of training steps of the `small` preset.

Run on a CUDA machine from the repository root:
    python benchmarks/plan_accuracy_gpu.py [--preset small] [--json out.json]
For each (seq_len, micro_batch, recompute, lora) setting it builds a fresh model (fp32 master weights, BF16
autocast, Triton kernels; LoRA: frozen BF16 base + fp32 adapters, as the trainer does), runs two AdamW steps and
reads `torch.cuda.max_memory_allocated` over the second (the optimizer state exists by then), and prints it next
to `moeadapt.plan.accuracy.predict_step` (single GPU: no FSDP / EP buffers, no allocator reserve). The step runs
as the trainer's does: autocast around the forward only, `return_logits=False` (measurements taken before
2026-11-29 12:50 used autocast over both steps and kept the logits: not comparable).
Target: |error| <= 10%. Each setting runs in a child process so one OOM does not end the sweep.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = [  # seq_len, micro_batch, recompute, lora rank (0 = full training)
    (2048, 1, "none", 0),
    (4096, 1, "selective", 0),
    (4096, 2, "full", 0),
    (4096, 1, "none", 16),
    (2048, 4, "selective", 16),
    (8192, 1, "full", 16),
]


def one(preset: str, seq: int, mb: int, rc: str, rank: int, device: str = "cuda") -> dict:
    import torch

    from moeadapt.config import LoRASpec, get_preset
    from moeadapt.plan.accuracy import measure_step, predict_step

    spec = get_preset(preset)
    lora = LoRASpec(rank=rank) if rank else None
    pred = predict_step(spec, seq, mb, rc, lora, device=device)
    try:
        meas = measure_step(spec, seq, mb, rc, lora, device=device)["peak"]
    except torch.OutOfMemoryError:
        meas = float("nan")
    return {"seq_len": seq, "micro_batch": mb, "recompute": rc, "lora_rank": rank, "measured_GiB": meas / 2**30,
            "predicted_GiB": pred["total"] / 2**30, "error_pct": 100 * (pred["total"] / meas - 1),
            "predicted_peak_phase": pred["peak_phase"],
            "predicted_terms_GiB": {k: v / 2**30 for k, v in pred.items()
                                    if k not in ("total", "params_total", "params_trainable", "tokens_per_gpu", "peak_phase")}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (use --preset tiny)")
    ap.add_argument("--scale", type=int, default=1, help="divide sequence lengths by this (dry runs)")
    ap.add_argument("--one", nargs=4, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lora-only", action="store_true", help="only the LoRA settings (the rows still owed a GPU check)")
    a = ap.parse_args()
    if a.one:
        seq, mb, rc, rank = a.one
        print(json.dumps(one(a.preset, int(seq), int(mb), rc, int(rank), a.device)))
        return
    import torch

    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}, preset {a.preset}")
    print(f"{'seq':>6} {'mb':>3} {'recompute':>10} {'lora':>5} {'measured GiB':>13} {'predicted GiB':>14} {'error':>8}")
    rows = []
    for seq, mb, rc, rank in SETTINGS:
        if a.lora_only and not rank:
            continue
        seq //= a.scale
        p = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--device", a.device, "--one", str(seq),
                            str(mb), rc, str(rank)], capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{seq:>6} {mb:>3} {rc:>10} {rank:>5}  failed: {p.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"{seq:>6} {mb:>3} {rc:>10} {rank:>5} {r['measured_GiB']:>13.2f} {r['predicted_GiB']:>14.2f} "
              f"{r['error_pct']:>+7.1f}%")
    errs = [abs(r["error_pct"]) for r in rows if r["error_pct"] == r["error_pct"]]
    if errs:
        print(f"max |error| {max(errs):.1f}% (target 10%)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
