#!/usr/bin/env bash
# Session 5, call 6 (2026-11-29): the router's logit GEMM in fp32 under autocast (ModelSpec.router_matmul):
# GPU model tests, then the model layer frozen vs LoRA with router_matmul fp32 (default), tf32 and bf16.
set -u
. benchmarks/gpu_env.sh
step 150 gpu_model_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_model_gpu.py
for m in fp32 tf32 bf16; do
  step 150 moe_model_$m python3 benchmarks/bench_moe_model.py --rounds 3 --bubbles --router-matmul $m \
    --out "$out/moe_model_$m.jsonl"
done
