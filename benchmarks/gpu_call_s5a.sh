#!/usr/bin/env bash
# Session 5, call 1 (2026-11-29): the GPU tests of the MoE / LoRA paths (not re-run since session 4's refactors),
# then is the model's LatentMoE step bound by the host? (bench_moe_model.py --bubbles: enqueue vs kernel time)
set -u
. benchmarks/gpu_env.sh
step 150 gpu_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py tests/gpu/test_lora_gpu.py
step 200 moe_model_bubbles python3 benchmarks/bench_moe_model.py --rounds 3 --bubbles --out "$out/moe_model_bubbles.jsonl"
