"""GPU: the multi-tensor AdamW kernel compiled (tests/ops/test_adamw_kernels.py runs it in Triton's interpreter),
fp32 and bf16 moments, fp32 and bf16 weights, the gradient norm, against the same references: the ops tests
themselves, with CUDA as the default device."""

import os

import pytest
import torch

from tests.ops import test_adamw_kernels as ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0"),
]


@pytest.fixture
def on_cuda():
    torch.set_default_device("cuda")
    yield
    torch.set_default_device(None)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_fp32_moments_compiled(on_cuda, seed, grad_dtype):
    ops.test_adamw_kernel_matches_reference(seed, grad_dtype, True)


@pytest.mark.parametrize("check", ["test_adamw_kernel_bf16_moments_match_reference",
                                   "test_bf16_moments_are_unbiased_where_round_to_nearest_is_not",
                                   "test_copy_adamw_bf16_moments"])
def test_bf16_moments_compiled(on_cuda, seed, check):
    getattr(ops, check)(seed)


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_bf16_weights_compiled(on_cuda, seed, moments):
    ops.test_adamw_kernel_bf16_weights_match_reference(seed, moments)


@pytest.mark.parametrize("check", ["test_bf16_weights_follow_updates_below_their_spacing",
                                   "test_copy_adamw_steps_bf16_weights_in_row_blocks",
                                   "test_grad_sq_sum_matches_reference"])
def test_bf16_weights_and_norm_compiled(on_cuda, seed, check):
    fn = getattr(ops, check)
    fn(seed, torch.bfloat16) if check == "test_grad_sq_sum_matches_reference" else fn(seed)
