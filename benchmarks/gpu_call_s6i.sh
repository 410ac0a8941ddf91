#!/usr/bin/env bash
# Session 6, call 9 (2026-11-29): the DSA GPU tests once more, with the assertion that the MLA bf16 cases run the
# Gluon kernels.
set -u
. benchmarks/gpu_env.sh
step 200 dsa_tests python3 -m pytest -x -q tests/gpu/test_dsa_gpu.py
