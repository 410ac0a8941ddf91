"""GPU: the multi-tensor AdamW kernel compiled (tests/ops/test_adamw_kernels.py runs it in Triton's interpreter),
fp32 and bf16 moments, fp32, bf16 and split weights, the gradient norm, against the same references: the ops tests
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


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_split_weights_compiled(on_cuda, seed, moments):
    """Split weights take the compiled fp32 path's update bit for bit (FMA contraction included)."""
    ops.test_adamw_kernel_split_weights_are_the_fp32_weights(seed, moments)


def test_copy_adamw_split_weights_compiled(on_cuda, seed):
    ops.test_copy_adamw_split_weights_state_dict(seed)


@pytest.mark.parametrize("check", ["test_bf16_weights_follow_updates_below_their_spacing",
                                   "test_copy_adamw_steps_bf16_weights_in_row_blocks",
                                   "test_grad_sq_sum_matches_reference"])
def test_bf16_weights_and_norm_compiled(on_cuda, seed, check):
    fn = getattr(ops, check)
    fn(seed, torch.bfloat16) if check == "test_grad_sq_sum_matches_reference" else fn(seed)


@pytest.mark.parametrize("weights,moments", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                             (torch.bfloat16, torch.bfloat16)])
def test_warps_change_nothing(on_cuda, seed, weights, moments):
    """`adamw_(..., num_warps=)` is a launch choice (bench_adamw.py --warps): every element's update is its own, so
    8 warps store the same bits as the default 4, bf16 copies and stochastically rounded states included."""
    from moeadapt.ops.optim import TensorBlocks, adamw_

    sizes = ops._sizes()
    start = {"p": [torch.randn(n).to(weights) for n in sizes],
             "m": [(torch.randn(n) * 0.1).to(moments) for n in sizes],
             "v": [(torch.rand(n) * 0.01).to(moments) for n in sizes]}
    g = [torch.randn(n).to(torch.bfloat16) for n in sizes]
    steps = [torch.full((), float(s)) for s in (3, 1, 7, 2)]
    out = []
    for warps in (4, 8):
        ts = {k: [t.clone() for t in v] for k, v in start.items()}
        tabs = {k: ops._tables(v) for k, v in ts.items()} | {"g": ops._tables(g), "step": ops._tables(steps)}
        if weights == torch.float32:
            ts["c"] = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
            tabs["c"] = ops._tables(ts["c"])
        adamw_(tabs, TensorBlocks(sizes, g[0].device), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
               seed=11, num_warps=warps)
        out.append(ts)
    assert any(not torch.equal(a, b) for a, b in zip(out[0]["p"], start["p"]))  # the step moved the weights
    for k in out[0]:
        for a, b in zip(out[0][k], out[1][k]):
            assert torch.equal(a, b), f"{k} differs between 4 and 8 warps"
