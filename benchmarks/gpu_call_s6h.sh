#!/usr/bin/env bash
# Session 6, call 8 (2026-11-29): the final tree: DSA GPU tests; the table with every session-6 default
# (pass 2 now 4 warps); the T = 32768 check with pass-2 variants around the new default.
set -u
. benchmarks/gpu_env.sh
step 240 dsa_tests python3 -m pytest -x -q tests/gpu/test_dsa_gpu.py
step 150 dsa_8k python3 benchmarks/bench_dsa.py --T 8192 --H 64 128 --out "$out/dsa_8k.json"
step 200 dsa_big python3 benchmarks/bench_dsa.py --no-baselines --T 32768 131072 --H 64 128 --out "$out/dsa_big.json"
step 300 dsa_check python3 benchmarks/bench_dsa.py --check --T 32768 --H 64 128 --out "$out/dsa_check.json"
