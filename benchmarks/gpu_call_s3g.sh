#!/usr/bin/env bash
# Session 3 (2026-11-29), GPU call 8 (issue 5): lean_lora backward with split columns; overhead, E = 64 twice.
# Repo root, one H200, carry [".whl"]:  bash benchmarks/gpu_call_s3g.sh
set -u
. benchmarks/gpu_env.sh
step 60 lean_test python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py -k lean
step 60 lean_tiles python3 benchmarks/tune_fold.py --lean --out "$out/lean_tiles.json"
for i in 1 2; do
  step 100 moe_e64_$i python3 benchmarks/bench_moe.py --lora-only --cases 64x8 --routings 0 --fold-tiles "$out/lean_tiles.json"
done
step 120 moe_e256_896 python3 benchmarks/bench_moe.py --lora-only --cases 256x16,896x16 --routings 0 \
  --fold-tiles "$out/lean_tiles.json"
