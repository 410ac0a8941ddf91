#!/usr/bin/env bash
# The GPU checks still owed after session 2 of 2026-11-29 (its device time ran out), in the order that unblocks
# the most, each under its own cap (about 6 minutes in all). Repo root, one H200:
#   device run, carry [".whl", ".fla_cache"], command: bash benchmarks/run_pending_gpu.sh
# .whl/ and .fla_cache/ are git-ignored. Fill .whl here first with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl fla-core==0.6.0 pydantic==2.14.4 pydantic_core==2.50.5 \
#     annotated-types==0.8.0 typing-inspection==0.4.5
# .fla_cache/fla_autotune.tgz holds fla's own autotune choices (H = 16) from session 2's call 2; this script
# ships back an extended one: copy $OUT/fla_autotune.tgz to .fla_cache/ for the next call.
set -u
. benchmarks/gpu_env.sh
# 1. issue 5: fused grouped LoRA with the gather / SwiGLU folds (fused_lora.CONFIG["fold_io"]) vs frozen
step 60 moe_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_moe_gpu.py -k "fold or fused"
step 120 moe_lora python3 benchmarks/bench_moe.py --lora-only --out "$out/lora.jsonl"
# 2. issue 7: the LoRA rows of the planner's GPU accuracy, after the frozen-cast fix (lora.cast_frozen_)
step 120 plan_accuracy python3 benchmarks/plan_accuracy_gpu.py --lora-only --json "$out/plan_accuracy.json"
# 3. issue 4: the sparse-attention GPU tests (bf16 HQ = 16 after the P/dS unwritten-slot fix)
step 60 dsa_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_dsa_gpu.py
# (Dropped in session 3: fla's H = 32 / 64 autotune on KDA shapes 3 and 4, more than 3 minutes each, for issue 3,
#  which is resolved; `bench_kda.py --shapes 8,4096,32,128 2,8192,64,128` runs it when device time allows.)
