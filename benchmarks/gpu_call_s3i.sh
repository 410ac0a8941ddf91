#!/usr/bin/env bash
# Session 3 (2026-11-29), GPU call 10: lean_lora in the model (issue 5) and the planner's LoRA rows with it (issue 7).
# Repo root, one H200, carry [".whl"]:  bash benchmarks/gpu_call_s3i.sh
set -u
. benchmarks/gpu_env.sh
step 90 lora_gpu python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_lora_gpu.py tests/gpu/test_moe_gpu.py -k "lean"
step 150 plan_accuracy python3 benchmarks/plan_accuracy_gpu.py --lora-only --json "$out/plan_accuracy.json"
