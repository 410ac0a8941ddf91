"""`models.stats.attention_flops`: the keys each DSA query attends to and scores, counted from the reference
indexers' own selections, and each kind's products assembled per layer."""

import random

import pytest
import torch

from moeadapt.config.presets import get_preset
from moeadapt.models.stats import _pairs, attention_flops, attention_flops_per_token
from moeadapt.ops.dsa.reference import kpool_indexer_reference, lightning_indexer_reference


def _selected_per_query(idx: torch.Tensor) -> float:
    return float((idx >= 0).sum(-1).double().mean())


@pytest.mark.parametrize("case", range(3))
def test_selected_keys_are_the_reference_indexers(case):
    """The mean number of keys a query attends to equals what the reference indexer selects, on random inputs
    and lengths on both sides of top-k (a count of min(topk, T) / 2, or of every causal pair, fails it)."""
    rng = random.Random(case)
    T, topk, HI, DI = rng.randint(20, 90), rng.choice([8, 16, 40]), 2, 8
    g = torch.Generator().manual_seed(case)
    q, k, w = torch.randn(1, T, HI, DI, generator=g), torch.randn(1, T, DI, generator=g), torch.rand(1, T, HI, generator=g)
    sel, idx_keys = _pairs(T, topk, 0, True)
    assert sel == pytest.approx(_selected_per_query(lightning_indexer_reference(q, k, w, topk)), rel=1e-12)
    assert idx_keys == pytest.approx((T + 1) / 2)  # query t scores its t + 1 visible keys


@pytest.mark.parametrize("tail", [True, False])
def test_kpool_selected_keys_are_the_reference_indexers(tail):
    """KPool: the selected tokens (whole blocks plus, with select_tail, the query's own partial block) as counted
    from kpool_indexer_reference's selections; the scored keys are the complete blocks each query sees."""
    g = torch.Generator().manual_seed(7)
    T, P, topk, HI, DI = 75, 4, 16, 2, 8
    q, k, w = torch.randn(1, T, HI, DI, generator=g), torch.randn(1, T, DI, generator=g), torch.rand(1, T, HI, generator=g)
    gate, ape = torch.randn(1, T, DI, generator=g), torch.randn(P, DI, generator=g)
    sel, idx_keys = _pairs(T, topk, P, tail)
    assert sel == pytest.approx(_selected_per_query(kpool_indexer_reference(q, k, w, gate, ape, topk, tail)), rel=1e-12)
    assert idx_keys == pytest.approx(sum((t + 1) // P for t in range(T)) / T)


def test_products_per_kind_and_the_training_total():
    """`small` at 4096: DSA 4 layers x 2 H (192 + 128) a selected key, the indexer 4 x 2 x 16 x 128 a visible key,
    KDA 12 layers x 16 heads x (6 K^2 + 4 C 2K); fwd + bwd = 3x all but the indexer (0.317 GFLOP a token, the
    "+attn" basis benchmarks/RESULTS.md states its MFU in)."""
    s = get_preset("small")
    T = 4096
    sel = (2048 * 2049 / 2 + 2048 * 2048) / T
    f = attention_flops(s, T)
    assert f["dsa"] == pytest.approx(4 * 2 * 16 * (192 + 128) * sel)
    assert f["indexer"] == pytest.approx(4 * 2 * 16 * 128 * (T + 1) / 2)
    assert f["kda"] == pytest.approx(12 * 16 * (6 * 128 * 128 + 4 * 64 * 256))
    assert f["gqa"] == f["gdn"] == 0
    total = attention_flops_per_token(s, T)
    assert total == pytest.approx(3 * (f["dsa"] + f["kda"]) + f["indexer"])
    assert total == pytest.approx(0.3167e9, rel=1e-3)
    # what the kernels compute: the absorbed form's wider channels, the MHA form's dense causal tiles
    ab, dense = attention_flops(s, T, dsa_form="absorbed"), attention_flops(s, T, dsa_form="mha_dense")
    assert ab["dsa"] == pytest.approx(f["dsa"] * (512 + 64 + 512) / (192 + 128))
    assert dense["dsa"] == pytest.approx(f["dsa"] * (T + 1) / 2 / sel)
    with pytest.raises(ValueError, match="dsa_form"):
        attention_flops(s, T, dsa_form="mla")


def test_shared_indexers_gqa_and_gdn_layers():
    """A DSA layer that reuses another's top-k scores nothing; GQA attends to every causal pair; GDN counts its
    value heads with their key / value dims."""
    kinds = ["dsa", "gqa", "gdn", "dsa", "kda"]
    s = get_preset("tiny", n_layers=5, layer_types=kinds, index_shared_layers=[3])
    T = 100
    f = attention_flops(s, T)
    one = attention_flops(get_preset("tiny", n_layers=5, layer_types=kinds), T)
    assert f["indexer"] == pytest.approx(one["indexer"] / 2) and f["dsa"] == one["dsa"]
    assert f["gqa"] == pytest.approx(2 * s.n_heads * 2 * s.gqa_head_dim * (T + 1) / 2)
    K, V = s.gdn_key_head_dim, s.gdn_value_head_dim
    assert f["gdn"] == pytest.approx(s.gdn_n_value_heads * (6 * K * V + 4 * 64 * (K + V)))
