#!/usr/bin/env bash
# Session 3 (2026-11-29), GPU call 3: SFA forward round 2 (issue 4) and the fold_io tile sweep + LoRA overhead
# with the tuned tiles (issue 5). Repo root, one H200, carry [".whl"]:  bash benchmarks/gpu_call_s3b.sh
set -u
. benchmarks/gpu_env.sh
step 200 dsa_fwd2 python3 benchmarks/bench_dsa.py --check --fwd-only --T 32768 --H 64 128 --out "$out/dsa_fwd2.json"
step 150 tune_fold python3 benchmarks/tune_fold.py --out "$out/fold_tiles.json"
step 150 moe_lora2 python3 benchmarks/bench_moe.py --lora-only --profile --cases 64x8,256x16 --routings 0 \
  --fold-tiles "$out/fold_tiles.json" --out "$out/moe_lora2.jsonl"
