"""GPU tests for moeadapt.ops.kda: Triton kernels vs the chunked reference at realistic shapes."""

import os

import pytest
import torch
import torch.nn.functional as F

from moeadapt.ops.kda import chunk_kda

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    # tests/conftest.py defaults TRITON_INTERPRET to 1; compiled kernels need TRITON_INTERPRET=0
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0"),
]


def rel(a, b):
    return ((a.double() - b.double()).abs().max() / (b.double().abs().max() + 1e-12)).item()


def inputs(B, T, H, HV, D, dtype, N):
    dev = "cuda"
    q = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dtype)
    k = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(dtype)
    v = torch.randn(B, T, HV, D, device=dev).to(dtype)
    A_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16))
    dt_bias = torch.log(torch.expm1(torch.empty(HV * D, device=dev).uniform_(1e-3, 0.1)))
    g = torch.randn(B, T, HV, D, device=dev) * 0.5
    g = -A_log.exp()[:, None] * F.softplus(g + dt_bias.view(HV, D))
    beta = torch.rand(B, T, HV, device=dev).to(dtype)
    h0 = torch.randn(N, HV, D, D, device=dev) * 0.1
    return [x.requires_grad_() for x in (q, k, v, g, beta, h0)]


CASES = [  # B, T, H, HV, D, dtype, cu, decay multiplier (20: strong decay within every 16-row sub-chunk)
    (2, 1000, 4, 4, 128, torch.bfloat16, None, 1.0),
    (1, 777, 2, 4, 64, torch.float32, [0, 100, 164, 600, 777], 1.0),
    (1, 2048, 2, 2, 128, torch.float32, None, 1.0),
    (1, 1000, 2, 2, 128, torch.bfloat16, None, 20.0),
]


@pytest.mark.parametrize("B, T, H, HV, D, dtype, cu, decay", CASES)
def test_triton_vs_reference_gpu(seed, B, T, H, HV, D, dtype, cu, decay):
    """The Triton kernels at their launch defaults against the float64 reference."""
    cu = None if cu is None else torch.tensor(cu, device="cuda", dtype=torch.int32)
    N = B if cu is None else cu.numel() - 1
    args = inputs(B, T, H, HV, D, dtype, N)
    with torch.no_grad():
        args[3].mul_(decay)
    outs = {}
    # one set of float32 cotangents shared by both backends (randn_like in bf16 and float64 would differ)
    do32 = torch.randn(B, T, HV, D, device="cuda")
    dht32 = torch.randn(N, HV, D, D, device="cuda")
    for backend in ("triton", "reference"):
        xs = [x.detach().clone().requires_grad_() for x in args]
        if backend == "reference":
            xs = [x.detach().double().requires_grad_() for x in xs]
        q, k, v, g, beta, h0 = xs
        o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, backend=backend)
        do, dht = do32.to(o.dtype), dht32.to(ht.dtype)
        ((o * do).sum() + (ht * dht).sum()).backward()
        outs[backend] = [o, ht] + [x.grad for x in xs]
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-3  # a wrong term gives O(1)
    names = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    errs = {n: rel(a, b) for n, a, b in zip(names, outs["triton"], outs["reference"])}
    print(f"\nKDA B={B} T={T} H={H} HV={HV} D={D} {dtype} cu={cu is not None} decay x{decay}: "
          + " ".join(f"{n}={e:.1e}" for n, e in errs.items()), flush=True)
    assert all(e < tol for e in errs.values()), errs
