#!/usr/bin/env bash
# Session 4 (2026-11-29), GPU call 4 (issue 5): the LoRA overhead the model's default gets (lean at E = 64 / 256,
# the Triton LoRA kernel at E = 896), all three bench_moe cases, 5 interleaved rounds, in three separate processes
# (this machine's run-to-run spread between processes is larger than within one), after the GPU tests.
# Repo root, one H200, carry [".whl"]:  bash benchmarks/gpu_call_s4d.sh
set -u
. benchmarks/gpu_env.sh
step 90 gpu_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py tests/gpu/test_lora_gpu.py -k "lean or lora"
for i in 1 2 3; do
  step 170 moe_rounds$i python3 benchmarks/bench_moe.py --lora-only --rounds 5 --routings 0 \
    --lora-variants lora-lean,lora-triton --out "$out/moe_rounds$i.jsonl"
done
