#!/usr/bin/env bash
# Session 6, call 5 (2026-11-29): the Gluon backward pass 1 (P and dS; 32-key blocks, Q and dO in shared memory,
# two consumers on alternate blocks): DSA GPU tests, then the check at T = 32768 (Gluon vs Triton pass 1, each alone).
set -u
. benchmarks/gpu_env.sh
step 300 dsa_tests python3 -m pytest -x -q tests/gpu/test_dsa_gpu.py
if grep -q "passed" "$out/dsa_tests.log" && ! grep -q "failed" "$out/dsa_tests.log"; then
  step 300 dsa_check python3 benchmarks/bench_dsa.py --check --T 32768 --H 64 128 --out "$out/dsa_check.json"
else
  echo "tests did not pass: check skipped"
fi
