#!/usr/bin/env bash
# Session 6, call 3 (2026-11-29): the full forward + backward check at T = 32768: is the P/dS backward's 270 ms in
# call 2's table (session 2's check: 222.6 ms at HQ = 128) a change in the code or in the context; pass 1 and pass 2
# alone; pass 2 masking its P/dS loads by pass 1's written extent.
set -u
. benchmarks/gpu_env.sh
step 400 dsa_check python3 benchmarks/bench_dsa.py --check --T 32768 --H 64 128 --out "$out/dsa_check.json"
