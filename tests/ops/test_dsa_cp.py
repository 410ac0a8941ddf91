"""Single-process parts of DSA context parallelism: the indexer over a subset of query rows (both backends)
and the errors for keys of another length."""

from __future__ import annotations

import pytest
import torch

from moeadapt.ops.dsa import lightning_indexer, sparse_attention


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_indexer_query_positions_select_like_the_full_indexer(seed, backend):
    B, T, HI, DI, topk = 1, 80, 2, 16, 12
    q_idx, k_idx, w_idx = torch.randn(B, T, HI, DI), torch.randn(B, T, DI), torch.randn(B, T, HI)
    cu = torch.tensor([0, 7, 45, 80], dtype=torch.int32)
    full = lightning_indexer(q_idx, k_idx, w_idx, topk, cu, backend="reference")
    pos = torch.cat([torch.arange(20, 40), torch.arange(60, 80)])  # a balanced cp rank's two pieces
    part = lightning_indexer(q_idx[:, pos], k_idx, w_idx[:, pos], topk, cu, backend=backend, q_positions=pos)
    assert torch.equal(part, full[:, pos])


def test_longer_keys_need_matching_shapes():
    q_idx, k_idx, w_idx = torch.randn(1, 8, 2, 16), torch.randn(1, 32, 16), torch.randn(1, 8, 2)
    with pytest.raises(ValueError, match=r"q_positions has shape \(4,\); expected \[Tq\] = \[8\]"):
        lightning_indexer(q_idx, k_idx, w_idx, 4, q_positions=torch.arange(4))
    with pytest.raises(ValueError, match="k_idx has shape"):
        lightning_indexer(q_idx, k_idx, w_idx, 4)  # without q_positions the key count must equal T
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 32, 1, 16)
    idx = torch.zeros(1, 8, 4, dtype=torch.int32)
    with pytest.raises(ValueError, match="backend='reference' for now"):
        sparse_attention(q, k, k, idx, backend="triton")
    assert sparse_attention(q, k, k, idx, backend="reference").shape == (1, 8, 2, 16)
