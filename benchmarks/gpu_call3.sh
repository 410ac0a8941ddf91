#!/usr/bin/env bash
# GPU call 3 of 2026-11-29 (session 2): the new DSA backward / forward options and the fused grouped LoRA,
# each checked against the old kernels on the GPU and timed in the same run. Repo root, H200.
set -u
. benchmarks/gpu_env.sh
step 125 dsa_check python3 benchmarks/bench_dsa.py --check --T 32768 --H 64 128 --out "$out/dsa_check.json"
step 60 dsa_tests python3 -m pytest -q -x -p no:cacheprovider -rf tests/gpu/test_dsa_gpu.py
step 40 moe_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py -k fused
step 120 moe_lora python3 benchmarks/bench_moe.py --lora-only --out "$out/lora.jsonl"
