#!/usr/bin/env bash
# The next GPU call after session 4 of 2026-11-29 (about 5 minutes). Repo root, one H200:
#   device run, carry [".whl"], command: bash benchmarks/run_pending_gpu.sh
# .whl/ is git-ignored; fill it as benchmarks/gpu_env.sh says (fla-core and pydantic wheels for Python 3.12).
set -u
. benchmarks/gpu_env.sh
# 1. the GPU tests of the MoE / LoRA paths (swiglu_pair, lean pair dx in one pass, model-level lean vs fp32)
step 120 gpu_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py tests/gpu/test_lora_gpu.py
# 2. issue 5: the model's own LatentMoE, frozen vs expert LoRA (session 4 call 7: 25.5-28.6%, target <= 25%), and
#    the packed bench layer (session 4: medians 23.4 / 23.9 / 15.7%), each in two processes
for i in 1 2; do
  step 150 moe_model$i python3 benchmarks/bench_moe_model.py --rounds 5 --out "$out/moe_model$i.jsonl"
  step 170 moe_rounds$i python3 benchmarks/bench_moe.py --lora-only --rounds 5 --routings 0 \
    --lora-variants lora-lean,lora-triton --out "$out/moe_rounds$i.jsonl"
done
