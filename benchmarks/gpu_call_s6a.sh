#!/usr/bin/env bash
# Session 6, call 1 (2026-11-29): first run of the warp-specialised Gluon SFA forward: GPU test vs the float64
# reference, then the forward check table at T = 32768 (old / skip_rev / dense Triton kernels and the Gluon one).
set -u
. benchmarks/gpu_env.sh
step 180 gluon_test python3 -m pytest -x -q -s tests/gpu/test_dsa_gpu.py -k gluon
rc=${PIPESTATUS[0]}
if grep -q "passed\|failed" "$out/gluon_test.log"; then
  step 300 dsa_fwd python3 benchmarks/bench_dsa.py --check --fwd-only --T 32768 --H 64 128 --out "$out/dsa_fwd.json"
else
  echo "gluon test did not finish (hang?): bench skipped"
fi
