"""Several GPUs of one host, NCCL: FSDP2 vs FSDP2 + EP, all-to-all overlap, skewed routing, DCP resharding.

One driver for the multi-GPU measurements; each part launches `torchrun` on the existing scripts, so what is
measured is the code users run:
- `train`:   `bench_train_small.py` at world W (every W in --worlds the host has): FSDP2 only (ep 1) vs
             FSDP2 + EP = W, the `small` preset and a wider variant (256 experts, top-8); tokens/s per GPU, MFU,
             peak memory per rank, first-step losses (compare across worlds at bf16 tolerance).
- `a2a`:     `bench_train_small.py --a2a-breakdown`: dispatch -> experts -> combine, a2a_chunks 1 vs 2 vs 4;
             hidden fraction = (comm + compute - total) / comm.
- `routing`: `moeadapt simulate-routing` under Zipf skew per EP degree: per-rank load p99 / max vs the mean
             (a model of the imbalance: the per-rank *wait* needs the profile of a real skewed run, not done here).
- `dcp`:     `moeadapt train` saves a DCP checkpoint at world W (ep W) and resumes it at world W/2 (ep W/2).
Each part prints its rows as JSON lines; `--out` appends them to a file.

Run on a host with N GPUs (the `nvidia-h200-x2/-x4/-x8` device kinds):
    python benchmarks/bench_multi_gpu.py --parts train,a2a,routing,dcp
Check the driver on CPU with gloo ranks and the tiny preset (what CI-sized machines can do):
    python benchmarks/bench_multi_gpu.py --cpu --worlds 2 --parts train,a2a,dcp
Context parallelism at 262,144 -> 1,048,576 tokens (issue: multi-GPU runs) is `moeadapt train` with
`parallel.cp: W`; it is not driven from here yet.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
WIDE = ["--override", "n_routed_experts=256", "--override", "n_experts_per_tok=8"]


def _torchrun(world: int, args: list[str], env: dict | None = None) -> str:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={world}", *args]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env={**os.environ, **(env or {})})
    if r.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}")
    return r.stdout


def _json_rows(text: str) -> list[dict]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def part_train(world: int, cpu: bool) -> list[dict]:
    small = ["--preset", "tiny", "--device", "cpu", "--seq-len", "128", "--micro-batch", "1", "--steps", "2",
             "--warmup", "1"] if cpu else []
    rows = []
    for name, extra in (("small", []), ("wide-256e-top8", WIDE)):
        for ep in sorted({1, world}):
            out = _torchrun(world, ["benchmarks/bench_train_small.py", "--ac", "none", "--ep", str(ep), *small, *extra])
            for r in _json_rows(out):
                r.update(variant=name, tokens_per_s_per_gpu=r["tokens_per_s"] / world)
                rows.append(r)
    return rows


def part_a2a(world: int, cpu: bool) -> list[dict]:
    size = ["--device", "cpu", "--tokens", "1024", "--latent", "128", "--ffn", "128", "--experts", str(8 * world),
            "--steps", "3", "--warmup", "1"] if cpu else []
    rows = []
    for chunks in (2, 4):  # each run times chunks 1 and N
        out = _torchrun(world, ["benchmarks/bench_train_small.py", "--a2a-breakdown", "--a2a-chunks", str(chunks),
                                *size])
        rows += [r for r in _json_rows(out) if r["chunks"] != 1 or chunks == 2]
    return rows


def part_routing(world: int, cpu: bool) -> list[dict]:
    rows = []
    for dist in ("uniform", "zipf:0.8", "zipf:1.2"):
        r = subprocess.run([sys.executable, "-m", "moeadapt", "simulate-routing", "--experts", "256", "--top-k", "8",
                            "--ep", str(world), "--tokens", "65536", "--latent", "1024", "--dist", dist, "--json"],
                           cwd=ROOT, capture_output=True, text=True)
        if r.returncode:
            raise RuntimeError(f"simulate-routing failed: {r.stderr[-2000:]}")
        rows += json.loads(r.stdout)  # one row per capacity factor / drop policy / placement
    return rows


def _dcp_config(tmp: Path, world: int, steps: int, cpu: bool) -> Path:
    cfg = {"model": "tiny", "train": {"steps": steps, "save_every": 2, "seq_len": 128, "micro_batch_size": 2,
                                      "log_every": 1, "eval_batches": 1, "output_dir": str(tmp / "run"),
                                      "device": "cpu" if cpu else "cuda", "resume": steps > 2},
           "data": {"train": "builtin:recall_qa", "format": "chat"},
           "parallel": {"dp_shard": world, "ep": world}}
    p = tmp / f"w{world}.yaml"
    p.write_text(json.dumps(cfg))  # JSON is YAML
    return p


def part_dcp(world: int, cpu: bool) -> list[dict]:
    if world < 2:
        return []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        _torchrun(world, ["-m", "moeadapt", "train", str(_dcp_config(tmp, world, 2, cpu))])
        half = world // 2
        _torchrun(half, ["-m", "moeadapt", "train", str(_dcp_config(tmp, half, 4, cpu))])
        recs = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
    resumed = [r for r in recs if r.get("kind") == "resume"]
    losses = [r["loss"] for r in recs if r.get("kind") == "train"]
    return [{"saved_world": world, "resumed_world": half, "resumed_at": resumed[-1]["step"] if resumed else None,
             "losses": losses}]


PARTS = {"train": part_train, "a2a": part_a2a, "routing": part_routing, "dcp": part_dcp}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--parts", default="train,a2a,routing,dcp")
    p.add_argument("--worlds", default=None, help="comma list (default: 2, 4, 8 up to the GPUs present)")
    p.add_argument("--cpu", action="store_true", help="gloo CPU ranks and the tiny preset (checks the driver)")
    p.add_argument("--out", default=None, help="append JSON rows here")
    args = p.parse_args()
    if args.worlds:
        worlds = [int(w) for w in args.worlds.split(",")]
    else:
        import torch

        n = torch.cuda.device_count()
        worlds = [w for w in (2, 4, 8) if w <= n] or [n]
    if not args.cpu and worlds == [0]:
        raise SystemExit("no GPU visible; run with --cpu --worlds 2 to check the driver on gloo CPU ranks")
    for part in args.parts.split(","):
        if part not in PARTS:
            raise SystemExit(f"unknown part {part!r}; choose from {', '.join(PARTS)}")
        for w in worlds:
            rows = PARTS[part](w, args.cpu)
            print(f"\n## {part}, world {w} ({'gloo CPU, tiny' if args.cpu else 'NCCL GPUs'})")
            for r in rows:
                print(json.dumps(r))
            if args.out:
                with open(args.out, "a") as f:
                    for r in rows:
                        f.write(json.dumps({"part": part, "world": w, **r}) + "\n")


if __name__ == "__main__":
    main()
