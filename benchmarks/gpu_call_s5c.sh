#!/usr/bin/env bash
# Session 5, call 5 (2026-11-29): issue 5's LoRA overhead after the host-overhead cuts, more processes:
# the model's own LatentMoE (two processes), lean forced at E=896 (is auto's choice still right?), and the packed
# bench layer (two processes).
set -u
. benchmarks/gpu_env.sh
for i in 1 2; do
  step 150 moe_model$i python3 benchmarks/bench_moe_model.py --rounds 5 --bubbles --out "$out/moe_model$i.jsonl"
done
step 100 moe_model_lean896 python3 benchmarks/bench_moe_model.py --rounds 5 --cases 896x16 --lora-backend fused \
  --out "$out/moe_model_lean896.jsonl"
for i in 1 2; do
  step 170 moe_rounds$i python3 benchmarks/bench_moe.py --lora-only --rounds 5 --routings 0 \
    --lora-variants lora-lean,lora-triton --out "$out/moe_rounds$i.jsonl"
done
