#!/usr/bin/env bash
# Session 6, call 2 (2026-11-29): all DSA GPU tests (the Gluon forward in both schedules, the layer through the new
# default); the forward check (Triton variants, Gluon, Gluon with split buffer release); then the table with
# the Gluon forward as default: T = 8192 with the PyTorch composition (b) and SDPA (c), T = 32768 and 131072 ours only.
set -u
. benchmarks/gpu_env.sh
step 300 dsa_tests python3 -m pytest -x -q tests/gpu/test_dsa_gpu.py
if grep -q "passed" "$out/dsa_tests.log"; then
  step 200 dsa_fwd python3 benchmarks/bench_dsa.py --check --fwd-only --T 32768 --H 64 128 --out "$out/dsa_fwd.json"
  step 150 dsa_8k python3 benchmarks/bench_dsa.py --T 8192 --H 64 128 --out "$out/dsa_8k.json"
  step 200 dsa_big python3 benchmarks/bench_dsa.py --no-baselines --T 32768 131072 --H 64 128 --out "$out/dsa_big.json"
else
  echo "tests did not pass: benches skipped"
fi
