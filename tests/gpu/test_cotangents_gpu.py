"""GPU: expanded (stride-0) and strided cotangents through the compiled kernels' backward.

The KDA case is the call that lost the CUDA context in `_bwd_dh` when the final-state cotangent arrived
expanded: (B, T, H, D) = (1, 16384, 16, 128) bf16, zero initial state, `(o.float().sum() + ht.sum())`.
tests/ops/test_cotangents.py runs its per-op checks on CUDA (compiled kernels) when a GPU is visible.
"""

import os

import pytest
import torch
import torch.nn.functional as F

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0"),
]


def test_kda_sum_backward_at_the_crashing_shape():
    from moeadapt.ops.kda import chunk_kda

    torch.manual_seed(0)
    B, T, H, D = 1, 16384, 16, 128
    dev, dt = "cuda", torch.bfloat16
    q = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dt).requires_grad_()
    k = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dt).requires_grad_()
    v = torch.randn(B, T, H, D, device=dev).to(dt).requires_grad_()
    g = (-torch.rand(B, T, H, D, device=dev) * 0.1).requires_grad_()
    beta = torch.rand(B, T, H, device=dev).to(dt).requires_grad_()
    h0 = torch.zeros(B, H, D, D, device=dev)
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="triton")
    (o.float().sum() + ht.sum()).backward()
    torch.cuda.synchronize()
    # the same gradients from dense copies of the (constant) cotangents
    grads = [x.grad.clone() for x in (q, k, v, g, beta)]
    for x in (q, k, v, g, beta):
        x.grad = None
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="triton")
    torch.autograd.backward((o, ht), (torch.ones_like(o), torch.ones_like(ht)))
    for name, a, x in zip("q k v g beta".split(), grads, (q, k, v, g, beta)):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a.float(), x.grad.float(), rtol=2e-2, atol=1e-2, msg=name)  # atomics: order may differ

