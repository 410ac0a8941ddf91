#!/usr/bin/env bash
# GPU call 2 of 2026-11-29 (session 2): fla 0.6.0 timed in the same process as ours (fla first, so its
# long first-call autotune happens inside the cap; its choices are saved to the Triton cache and shipped
# back as fla_autotune.tgz for a later call), our reference for the >=5x ratio, and the GPU tests that
# call 1 did not reach. Run from the repo root on an H200 with carry [".whl"].
set -u
. benchmarks/gpu_env.sh
step 320 bench_kda python3 -u benchmarks/bench_kda.py --diag token --fla-first --no-ref
(cd /tmp/tc && find . -name '*.autotune.json' | tar -czf "$out/fla_autotune.tgz" -T -) ; ls -la "$out"/fla_autotune.tgz
step 90 kda_ref python3 -u benchmarks/bench_kda.py --diag token --no-fla --shapes 1,16384,16,128 8,4096,32,128
step 150 gpu_tests python3 -m pytest -q -p no:cacheprovider -rf tests/gpu/test_model_gpu.py tests/gpu/test_moe_gpu.py \
  "tests/gpu/test_kda_gpu.py::test_triton_vs_reference_gpu[chunk-1-2048-8-8-128-dtype2-None]" \
  "tests/gpu/test_kda_gpu.py::test_triton_vs_reference_gpu[token-1-2048-8-8-128-dtype2-None]"
