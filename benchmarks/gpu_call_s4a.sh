#!/usr/bin/env bash
# RECORD of what ran: the session-4 options it uses (tune_fold --lean2 / --only, BT, down_lora_bwd, lean_bwd "cp",
# bench variants lora-lean-fd / -cp) were removed after measurement; they are in commit f665fda.
# Session 4 (2026-11-29), GPU call 1 (issue 5): the lean SwiGLU backward at low-register tiles (sm_90 compile:
# 255 registers at the old best tile, 100-138 at these), then E = 64 in 5 interleaved rounds with the best tiles,
# then session 3's owed checks (the model-level lean test, the planner's LoRA rows with lean).
# Repo root, one H200, carry [".whl"]:  bash benchmarks/gpu_call_s4a.sh
set -u
. benchmarks/gpu_env.sh
step 60 lean_gpu python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py -k "lean"
step 120 tune_lean python3 benchmarks/tune_fold.py --lean --lean2 --out "$out/lean_tiles.json"
step 150 moe_rounds python3 benchmarks/bench_moe.py --lora-only --rounds 5 --cases 64x8 --routings 0 \
  --lora-variants lora-fused-fold,lora-lean --fold-tiles "$out/lean_tiles.json" --out "$out/moe_rounds.jsonl"
step 60 lora_gpu python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_lora_gpu.py
step 150 plan_accuracy python3 benchmarks/plan_accuracy_gpu.py --lora-only --json "$out/plan_accuracy.json"
