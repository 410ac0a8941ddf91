"""GPU: the multi-tensor AdamW kernel compiled (tests/ops/test_adamw_kernels.py runs it in Triton's interpreter),
fp32 and bf16 moments, against the same references: the ops tests themselves, with CUDA as the default device."""

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
