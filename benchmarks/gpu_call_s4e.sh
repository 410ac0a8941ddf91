#!/usr/bin/env bash
# Session 4 (2026-11-29), GPU call 5 (issue 5): the model's own LatentMoE (separate w1 / w3, now with the fused
# swiglu_pair and lean's one-pass pair dx) frozen vs LoRA at bench_moe's shapes, two processes; the GPU tests;
# the planner's full-training rows (its SwiGLU term changed from 3F to 2F saved per row on the kernel path).
# Repo root, one H200, carry [".whl"]:  bash benchmarks/gpu_call_s4e.sh
set -u
. benchmarks/gpu_env.sh
step 120 gpu_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py tests/gpu/test_lora_gpu.py
for i in 1 2; do
  step 150 moe_model$i python3 benchmarks/bench_moe_model.py --rounds 5 --out "$out/moe_model$i.jsonl"
done
step 200 plan_accuracy python3 benchmarks/plan_accuracy_gpu.py --json "$out/plan_accuracy.json"
