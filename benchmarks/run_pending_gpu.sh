#!/usr/bin/env bash
# The GPU checks still owed after 2026-11-29 (device time ran out), in the order that unblocks the most,
# each with its own time cap so one slow step cannot eat the others. Run from the repo root on an H200:
#   device run, carry [".whl"] (fla_core 0.6.0 + pydantic wheels), command: bash benchmarks/run_pending_gpu.sh
# About 11 minutes in all; logs go to $OUT (or ./gpu_logs). .whl/ is git-ignored; fill it here first with
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_17_x86_64 -d .whl fla-core==0.6.0 pydantic==2.14.4 pydantic_core==2.50.5 \
#     annotated-types==0.8.0 typing-inspection==0.4.5
set -u
out=${OUT:-gpu_logs}; mkdir -p "$out"
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/fla_core-*.whl .whl/pydantic-*.whl \
  .whl/pydantic_core-*.whl .whl/annotated_types-*.whl .whl/typing_inspection-*.whl 2>&1 | tail -1
export PYTHONPATH=/tmp/site:$PWD TRITON_INTERPRET=0 PYTHONUNBUFFERED=1
step() { local cap=$1 name=$2; shift 2; echo "== $name (cap ${cap}s)"; timeout "$cap" "$@" 2>&1 | tee "$out/$name.log" | tail -25; }
# 1. every GPU test: kernels vs reference (KDA gradients never checked on GPU; model step now fp32)
step 120 gpu_tests python3 -m pytest -q -p no:cacheprovider tests/gpu
# 2. KDA: chunk vs token-parallel diagonal blocks, against fla 0.6.0 in the same run (issue 3)
step 270 bench_kda python3 -u benchmarks/bench_kda.py --diag both
# 3. small-batch merging: merged vs accumulated micro-batches (issue 5: does it help?)
step 70 bench_merge python3 benchmarks/bench_merge.py --M 2 4 8 --experts 64 256
# 4. planner accuracy on the small preset (issue 7, target within 10%)
step 100 plan_accuracy python3 benchmarks/plan_accuracy_gpu.py --json "$out/plan_accuracy.json"
