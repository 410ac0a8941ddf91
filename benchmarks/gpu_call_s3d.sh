#!/usr/bin/env bash
# Session 3 (2026-11-29), GPU call 5 (issue 5): grouped GEMMs on [W | Bᵀ] views, dx="split" variants.
# Repo root, one H200, carry [".whl"]:  bash benchmarks/gpu_call_s3d.sh
set -u
. benchmarks/gpu_env.sh
step 60 gemm_views python3 benchmarks/tune_fold.py --gemm
step 120 moe_lora4 python3 benchmarks/bench_moe.py --lora-only --cases 64x8,256x16 --routings 0 --out "$out/moe_lora4.jsonl"
