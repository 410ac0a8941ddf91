#!/usr/bin/env bash
# Session 6, call 7 (2026-11-29): P/dS pass-2 launch shapes (stages 2 / 4, key block 32, 4 warps) on the final
# default, in the T = 32768 check.
set -u
. benchmarks/gpu_env.sh
step 400 dsa_check python3 benchmarks/bench_dsa.py --check --T 32768 --H 64 128 --out "$out/dsa_check.json"
