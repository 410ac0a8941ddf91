"""Single-process parts of DSA context parallelism: the indexer over a subset of query rows (both backends)
and the errors for keys of another length."""

from __future__ import annotations

import pytest
import torch

from moeadapt.ops.dsa import lightning_indexer, sparse_attention

DEV = "cuda" if torch.cuda.is_available() else "cpu"  # Triton runs on CUDA tensors, or interpreted on CPU ones


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_indexer_query_positions_select_like_the_full_indexer(seed, backend):
    B, T, HI, DI, topk = 1, 80, 2, 16, 12
    q_idx, k_idx, w_idx = (torch.randn(B, T, HI, DI).to(DEV), torch.randn(B, T, DI).to(DEV),
                           torch.randn(B, T, HI).to(DEV))
    cu = torch.tensor([0, 7, 45, 80], dtype=torch.int32, device=DEV)
    full = lightning_indexer(q_idx, k_idx, w_idx, topk, cu, backend="reference")
    pos = torch.cat([torch.arange(20, 40), torch.arange(60, 80)]).to(DEV)  # a balanced cp rank's two pieces
    part = lightning_indexer(q_idx[:, pos], k_idx, w_idx[:, pos], topk, cu, backend=backend, q_positions=pos)
    assert torch.equal(part, full[:, pos])


def test_longer_keys_need_matching_shapes():
    q_idx, k_idx, w_idx = torch.randn(1, 8, 2, 16), torch.randn(1, 32, 16), torch.randn(1, 8, 2)
    with pytest.raises(ValueError, match=r"q_positions has shape \(4,\); expected \[Tq\] = \[8\]"):
        lightning_indexer(q_idx, k_idx, w_idx, 4, q_positions=torch.arange(4))
    with pytest.raises(ValueError, match="k_idx has shape"):
        lightning_indexer(q_idx, k_idx, w_idx, 4)  # without q_positions the key count must equal T
    q, k = torch.randn(1, 8, 2, 16), torch.randn(1, 32, 1, 16)
    with pytest.raises(ValueError, match=r"v has shape \(1, 8, 1, 16\); expected \[B, Tk, HK, DV\]"):
        sparse_attention(q, k, k[:, :8], torch.zeros(1, 8, 4, dtype=torch.int32))


def test_triton_ops_over_a_longer_key_sequence(seed):
    """Local queries over gathered keys (Tk > Tq): Triton sparse attention (values, dq, dk) and the indexer KL
    loss (value, grads) equal the reference; dk has the keys' length."""
    from moeadapt.ops.dsa import indexer_kl_loss

    B, T, HQ, D, DV, HI, DI, topk = 2, 48, 4, 32, 16, 2, 16, 8
    pos = torch.cat([torch.arange(12, 24), torch.arange(36, 48)]).to(DEV)

    def leaf(*shape):
        return torch.randn(*shape).to(DEV).requires_grad_(True)

    q, kv = leaf(B, len(pos), HQ, D), leaf(B, T, 1, D)
    q_idx, w_idx = leaf(B, len(pos), HI, DI), torch.randn(B, len(pos), HI).to(DEV)
    k_idx = leaf(B, T, DI)
    idx = lightning_indexer(q_idx.detach(), k_idx.detach(), w_idx, topk, backend="triton", q_positions=pos)
    do = torch.randn(B, len(pos), HQ, DV).to(DEV)
    res = {}
    for be in ("reference", "triton"):
        o = sparse_attention(q, kv, kv[..., :DV], idx, backend=be)
        kl = indexer_kl_loss(q, kv, idx, q_idx, k_idx, w_idx, backend=be)
        res[be] = (o, kl, *torch.autograd.grad((o * do).sum() + kl, [q, kv, q_idx, k_idx]))
    for name, a, b in zip(("o", "kl", "dq", "dkv", "dq_idx", "dk_idx"), res["triton"], res["reference"]):
        assert a.shape == b.shape, name
        err = (a - b).abs().max().item()
        assert err < 1e-4 * max(1.0, b.abs().max().item()), f"{name}: {err:.2e}"
    assert res["reference"][3][:, :12].abs().sum() > 0 and res["reference"][3][:, 24:36].abs().sum() > 0
