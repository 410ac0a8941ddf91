#!/usr/bin/env bash
# Session 3 (2026-11-29), GPU call 2: SFA forward variants (issue 4: > 300 TFLOP/s at T = 32768) and where the
# grouped-LoRA time goes at E = 64 (issue 5). Repo root, one H200, carry [".whl"]:
#   bash benchmarks/gpu_call_s3a.sh
set -u
. benchmarks/gpu_env.sh
step 300 dsa_fwd python3 benchmarks/bench_dsa.py --check --fwd-only --T 32768 --H 64 128 --out "$out/dsa_fwd.json"
step 120 moe_prof python3 benchmarks/bench_moe.py --lora-only --profile --cases 64x8 --routings 0 --out "$out/moe_prof.jsonl"
