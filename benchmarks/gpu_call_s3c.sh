#!/usr/bin/env bash
# Session 3 (2026-11-29), GPU call 4 (issue 5, then issue 4's GPU tests on the new defaults). Repo root, one H200,
# carry [".whl"]:  bash benchmarks/gpu_call_s3c.sh
set -u
. benchmarks/gpu_env.sh
step 60 gemm_widths python3 benchmarks/tune_fold.py --gemm
step 90 tune_fold2 python3 benchmarks/tune_fold.py --round2 --out "$out/fold_tiles2.json"
step 150 moe_lora3 python3 benchmarks/bench_moe.py --lora-only --cases 64x8,256x16,896x16 --routings 0 \
  --fold-tiles "$out/fold_tiles2.json" --out "$out/moe_lora3.jsonl"
step 100 moe_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py -k "fold or fused"
step 80 dsa_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_dsa_gpu.py
