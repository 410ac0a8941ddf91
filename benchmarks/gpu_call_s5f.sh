#!/usr/bin/env bash
# Session 5, call 8 (2026-11-29): the model's LatentMoE frozen vs LoRA with the router's default GEMM (tf32),
# two processes (call 7 ran the fp32 router by mistake: the bench's --router-matmul default was fp32).
set -u
. benchmarks/gpu_env.sh
for i in 1 2; do
  step 120 moe_model$i python3 benchmarks/bench_moe_model.py --rounds 5 --bubbles --out "$out/moe_model$i.jsonl"
done
