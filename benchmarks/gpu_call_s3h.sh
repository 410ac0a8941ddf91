#!/usr/bin/env bash
# Session 3 (2026-11-29), GPU call 9 (issue 5): LoRA overhead over frozen, medians of 5 interleaved rounds.
# Repo root, one H200, carry [".whl"]:  bash benchmarks/gpu_call_s3h.sh
set -u
. benchmarks/gpu_env.sh
step 240 moe_rounds python3 benchmarks/bench_moe.py --lora-only --rounds 5 --cases 64x8,256x16,896x16 --routings 0 \
  --lora-variants lora-triton,lora-fused-twg,lora-fused-fold,lora-lean,lora-lean-split --out "$out/moe_rounds.jsonl"
