#!/usr/bin/env bash
# Session 6, call 4 (2026-11-29): P/dS pass 2 grid order (chunk-major: the dk/dv atomics of one phase stay in L2) and
# channel chunk 64 (576 = 9 x 64, no half-empty last chunk), against the default (EXTENT), T = 32768.
set -u
. benchmarks/gpu_env.sh
step 400 dsa_check python3 benchmarks/bench_dsa.py --check --T 32768 --H 64 128 --out "$out/dsa_check.json"
