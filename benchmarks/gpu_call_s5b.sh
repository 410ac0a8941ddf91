#!/usr/bin/env bash
# Session 5, call 4 (2026-11-29): after the host-overhead cuts (tile map kernel, no router sync, fp32 adapters
# into lean_lora, K-grouped grads in fp32): GPU tests, then the model layer's overhead with bubbles, E=64 host profile.
set -u
. benchmarks/gpu_env.sh
step 150 gpu_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py tests/gpu/test_lora_gpu.py tests/gpu/test_model_gpu.py
step 200 moe_model_bubbles python3 benchmarks/bench_moe_model.py --rounds 3 --bubbles --out "$out/moe_model_bubbles.jsonl"
step 120 host_profile python3 benchmarks/bench_moe_model.py --cases 64x8 --rounds 1 --host-profile
