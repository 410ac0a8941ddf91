#!/usr/bin/env bash
# Session 6, call 6 (2026-11-29): the small preset's training step on fused kernels vs the reference (the DSA layers
# run HQ = 16: Triton forward, P/dS with EXTENT and 64-channel pass-2 chunks); the check at T = 32768 with pass 2's
# atomics replaced by stores (probe); then the table with every session-6 default.
set -u
. benchmarks/gpu_env.sh
step 240 model_test python3 -m pytest -x -q tests/gpu/test_model_gpu.py
step 300 dsa_check python3 benchmarks/bench_dsa.py --check --T 32768 --H 64 128 --out "$out/dsa_check.json"
step 150 dsa_8k python3 benchmarks/bench_dsa.py --T 8192 --H 64 128 --out "$out/dsa_8k.json"
step 200 dsa_big python3 benchmarks/bench_dsa.py --no-baselines --T 32768 131072 --H 64 128 --out "$out/dsa_big.json"
