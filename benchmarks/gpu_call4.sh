#!/usr/bin/env bash
# GPU call 4 of 2026-11-29 (session 2), the last of the session's device time: the KDA kernels with
# tensor-core diagonal blocks against fla 0.6.0 in one process (fla's autotune choices for H = 16 come from
# call 2 via .fla_cache/, so only its best configs compile), the GPU correctness tests for KDA, DSA (P/dS fix)
# and the small-preset training step, and the planner's GPU accuracy. Repo root, H200, carry .whl and .fla_cache.
set -u
. benchmarks/gpu_env.sh
step 150 bench_kda python3 -u benchmarks/bench_kda.py --ours dot,token --fla-shapes 2 --time-limit 95 --profile
step 80 kda_tests python3 -m pytest -q -s -p no:cacheprovider -rf tests/gpu/test_kda_gpu.py
step 80 model_dsa_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_model_gpu.py tests/gpu/test_dsa_gpu.py
step 100 plan_accuracy python3 benchmarks/plan_accuracy_gpu.py --json "$out/plan_accuracy.json"
