#!/usr/bin/env bash
# Session 5, call 7 (2026-11-29): the final tree of issue 5's work: GPU tests (MoE, LoRA, model), the model's
# LatentMoE frozen vs LoRA with the default router (tf32) in two processes, then bench_moe.py's full comparison
# (ours vs torchtitan-style vs GEMM floor, LoRA) on uniform routing in one run.
set -u
. benchmarks/gpu_env.sh
step 200 gpu_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py tests/gpu/test_lora_gpu.py tests/gpu/test_model_gpu.py
for i in 1 2; do
  step 120 moe_model$i python3 benchmarks/bench_moe_model.py --rounds 5 --bubbles --out "$out/moe_model$i.jsonl"
done
step 240 bench_moe python3 benchmarks/bench_moe.py --no-loop --routings 0 --budget-s 200 --out "$out/bench_moe.jsonl"
