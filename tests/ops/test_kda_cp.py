"""The single-process parts of KDA context parallelism: the transition operator and the layout's errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeadapt.ops.cp_comm import CPLayout
from moeadapt.ops.kda import chunk_kda, naive_recurrent_kda
from moeadapt.ops.kda.cp import chunk_kda_cp
from moeadapt.ops.kda.reference import state_transition_reference


def _inputs(B, T, HV, K, V):
    k = F.normalize(torch.randn(B, T, HV, K, dtype=torch.float64), dim=-1)
    return (torch.randn(B, T, HV, K, dtype=torch.float64), k, torch.randn(B, T, HV, V, dtype=torch.float64),
            -torch.rand(B, T, HV, K, dtype=torch.float64), torch.rand(B, T, HV, dtype=torch.float64))


def test_transition_is_the_chunked_op_started_from_identity(seed):
    B, T, HV, K, V = 2, 70, 2, 8, 4
    q, k, v, g, beta = _inputs(B, T, HV, K, V)
    M_ref = state_transition_reference(k, g, beta)
    eye = torch.eye(K, dtype=torch.float64).expand(B, HV, K, K)
    _, M = chunk_kda(q, k, torch.zeros(B, T, HV, K, dtype=torch.float64), g, beta, initial_state=eye,
                     output_final_state=True, backend="reference")
    assert (M - M_ref).abs().max() < 1e-12
    # the affine law the exchange rests on: final(S_in) = M S_in + final(0)
    S_in = torch.randn(B, HV, K, V, dtype=torch.float64)
    _, S1 = naive_recurrent_kda(q, k, v, g, beta, initial_state=S_in, output_final_state=True)
    _, S0 = naive_recurrent_kda(q, k, v, g, beta, output_final_state=True)
    assert (S1 - (M_ref @ S_in + S0)).abs().max() < 1e-12


def test_single_rank_layout_equals_the_op(seed):
    q, k, v, g, beta = _inputs(1, 90, 2, 8, 4)
    cu = torch.tensor([0, 20, 61, 90])
    o_ref, _ = chunk_kda(q, k, v, g, beta, cu_seqlens=cu, backend="reference")
    for balanced in (False, True):  # balanced with one rank: pieces 0 and 1, the boundary at 45 folds locally
        o = chunk_kda_cp(q, k, v, g, beta, CPLayout(None, 0, 1, balanced), cu_seqlens=cu, backend="reference")
        assert (o - o_ref).abs().max() < 1e-12


def test_layout_length_errors_name_the_numbers():
    with pytest.raises(ValueError, match=r"sequence length 102 does not split over cp=2 into 4 pieces.*"
                                         r"multiple of 4 \(e.g. 100 or 104\)"):
        CPLayout(None, 0, 2).check_length(102)
    assert CPLayout(None, 0, 2).check_length(512, chunk=64) == 128
    with pytest.raises(ValueError, match=r"multiple of 256 \(e.g. 256 or 512\)"):
        CPLayout(None, 0, 2).check_length(300, chunk=64)
    with pytest.raises(ValueError, match="cp rank 2 is not in a cp group of size 2"):
        CPLayout(None, 2, 2)
    q, k, v, g, beta = _inputs(1, 90, 2, 8, 4)
    with pytest.raises(ValueError, match="global boundaries"):
        chunk_kda_cp(q, k, v, g, beta, CPLayout(None, 0, 1), cu_seqlens=torch.tensor([0, 45]))


@pytest.mark.slow
def test_triton_backend_runs_the_cp_passes(seed):
    """The Triton kernels (interpreted on CPU) take the cp passes: identity initial states (V = K) and the
    folded state; values and gradients equal the reference on one rank's two pieces."""
    B, T, HV, K, V = 1, 40, 1, 16, 16
    q, k, v, g, beta = (x.float().requires_grad_(True) for x in _inputs(B, T, HV, K, V))
    cu = torch.tensor([0, 13, 40])
    do = torch.randn(B, T, HV, V)
    res = {}
    for be in ("reference", "triton"):
        o = chunk_kda_cp(q, k, v, g, beta, CPLayout(None, 0, 1), cu_seqlens=cu, backend=be)
        res[be] = (o, *torch.autograd.grad((o * do).sum(), [q, k, v, g, beta]))
    for name, a, b in zip(("o", "dq", "dk", "dv", "dg", "dbeta"), res["triton"], res["reference"]):
        err = (a - b).abs().max().item()
        assert err < 1e-3 * max(1.0, b.abs().max().item()), f"{name}: {err:.2e}"
