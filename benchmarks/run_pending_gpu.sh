#!/usr/bin/env bash
# The GPU checks owed after session 3 of 2026-11-29 (its device time ran out), in the order that unblocks the
# most, each under its own cap (about 5 minutes in all). Repo root, one H200:
#   device run, carry [".whl"], command: bash benchmarks/run_pending_gpu.sh
# .whl/ is git-ignored; fill it as benchmarks/gpu_env.sh says (fla-core and pydantic wheels for Python 3.12).
set -u
. benchmarks/gpu_env.sh
# 1. issue 7: the planner's LoRA rows with lean_lora (call 10 measured selective at 22.19 GiB before the planner's
#    lean GEMM-output term; the current prediction is 21.99 GiB) and the model-level lean test (threshold 6% since)
step 150 plan_accuracy python3 benchmarks/plan_accuracy_gpu.py --lora-only --json "$out/plan_accuracy.json"
step 90 lora_gpu python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_lora_gpu.py
# 2. issue 5: E = 64 overhead, medians of 5 interleaved rounds (call 9: lean +26.5%, target <= 25%)
step 150 moe_rounds python3 benchmarks/bench_moe.py --lora-only --rounds 5 --cases 64x8 --routings 0 \
  --lora-variants lora-fused-fold,lora-lean,lora-lean-split --out "$out/moe_rounds.jsonl"
