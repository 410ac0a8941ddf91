#!/usr/bin/env bash
# RECORD of what ran: the session-4 options it uses (tune_fold --lean2 / --only, BT, down_lora_bwd, lean_bwd "cp",
# bench variants lora-lean-fd / -cp) were removed after measurement; they are in commit f665fda.
# Session 4 (2026-11-29), GPU call 3 (issue 5): the column-parallel lean SwiGLU backward that accumulates dB_g,
# dB_u, dA_d itself (lean_lora.swiglu_lora_bwd_cp): GPU tests, tile sweep against row-parallel + 3 K-grouped GEMMs,
# E = 64 in 5 interleaved rounds, three processes (run-to-run spread), then the model-level lean test.
# Repo root, one H200, carry [".whl"]:  bash benchmarks/gpu_call_s4c.sh
set -u
. benchmarks/gpu_env.sh
step 60 lean_gpu python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py -k "lean"
step 120 tune_cp python3 benchmarks/tune_fold.py --lean --only swiglu_bwd_w --out "$out/cp_tiles.json"
for i in 1 2 3; do
  step 100 moe_rounds$i python3 benchmarks/bench_moe.py --lora-only --rounds 5 --cases 64x8 --routings 0 \
    --lora-variants lora-lean,lora-lean-cp,lora-lean-cp-fd --fold-tiles "$out/cp_tiles.json" \
    --out "$out/moe_rounds$i.jsonl"
done
step 60 lora_gpu python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_lora_gpu.py
