#!/usr/bin/env bash
# RECORD of what ran: the session-4 options it uses (tune_fold --lean2 / --only, BT, down_lora_bwd, lean_bwd "cp",
# bench variants lora-lean-fd / -cp) were removed after measurement; they are in commit f665fda.
# Session 4 (2026-11-29), GPU call 2 (issue 5): lean_lora.down_lora_bwd (the down projection's dx GEMM unwidened,
# g_d and dB_d from one pass over dy): GPU tests, tile sweep with the GEMMs it replaces, E = 64 in 5 interleaved
# rounds (lean vs lean-fd), then a per-kernel profile of lean-fd at E = 64.
# Repo root, one H200, carry [".whl"]:  bash benchmarks/gpu_call_s4b.sh
set -u
. benchmarks/gpu_env.sh
step 60 lean_gpu python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py -k "lean"
step 90 tune_down python3 benchmarks/tune_fold.py --lean --only down_bwd --out "$out/down_tiles.json"
step 150 moe_rounds python3 benchmarks/bench_moe.py --lora-only --rounds 5 --cases 64x8 --routings 0 \
  --lora-variants lora-lean,lora-lean-fd --fold-tiles "$out/down_tiles.json" --out "$out/moe_rounds.jsonl"
step 120 moe_profile python3 benchmarks/bench_moe.py --lora-only --profile --cases 64x8 --routings 0 \
  --lora-variants lora-lean-fd --fold-tiles "$out/down_tiles.json"
