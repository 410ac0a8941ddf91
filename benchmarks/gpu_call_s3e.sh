#!/usr/bin/env bash
# Session 3 (2026-11-29), GPU call 6: lean_lora (issue 5) tiles + overhead, GPU test; planner LoRA rows with
# fold_io on (issue 7). Repo root, one H200, carry [".whl"]:  bash benchmarks/gpu_call_s3e.sh
set -u
. benchmarks/gpu_env.sh
step 60 lean_test python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py -k lean
step 60 lean_tiles python3 benchmarks/tune_fold.py --lean --out "$out/lean_tiles.json"
step 200 moe_lean python3 benchmarks/bench_moe.py --lora-only --profile --cases 64x8,256x16,896x16 --routings 0 \
  --fold-tiles "$out/lean_tiles.json" --out "$out/moe_lean.jsonl"
step 150 plan_accuracy python3 benchmarks/plan_accuracy_gpu.py --lora-only --json "$out/plan_accuracy.json"
