"""KPool indexer (ops.dsa.kpool_indexer, ModelSpec.index_kpool): the selection against a float64 brute force
written from the rule (one query at a time), pooled keys and their gradients, packed sequences, the DSA layer
wiring, and the argument / option errors."""

import random

import pytest
import torch
from pydantic import ValidationError

from moeadapt.models.model import build_model, materialize
from moeadapt.ops.dsa import kpool_indexer
from moeadapt.ops.dsa.reference import kpool_keys_reference
from tests.conftest import micro_spec


def _brute(q, k, w, gate, ape, topk, tail):
    """One sequence, one query at a time: the blocks ending at or before t, scored by pooled keys, the best
    topk // P kept (lower block on ties), their tokens, plus the query's own incomplete block when `tail`."""
    B, T, HI, DI = q.shape
    P = ape.shape[0]
    out = []
    for b in range(B):
        rows = []
        for t in range(T):
            scored = []
            for p in range((t + 1) // P):
                lg = gate[b, p * P:(p + 1) * P].double() + ape.double()
                key = (torch.softmax(lg, 0) * k[b, p * P:(p + 1) * P].double()).sum(0)
                s = sum(float(w[b, t, j]) * max(0.0, float(q[b, t, j].double() @ key)) for j in range(HI))
                scored.append((-s, p))
            picks = [p for _, p in sorted(scored)[:topk // P]]
            sel = [p * P + j for p in picks for j in range(P)]
            if tail:
                sel += list(range((t + 1) // P * P, t + 1))
            rows.append(sorted(sel))
        out.append(rows)
    return out


def _inputs(seed, T=None, B=None):
    rnd = random.Random(seed)
    P = rnd.choice([2, 3, 4])
    B, T = B or rnd.choice([1, 2]), T or rnd.choice([7, 12, 17])
    HI, DI, topk = rnd.choice([2, 4]), rnd.choice([4, 8]), P * rnd.choice([1, 2])
    q = torch.randn(B, T, HI, DI, dtype=torch.float64)
    k, gate = torch.randn(B, T, DI, dtype=torch.float64), torch.randn(B, T, DI, dtype=torch.float64)
    w, ape = torch.randn(B, T, HI, dtype=torch.float64), torch.randn(P, DI, dtype=torch.float64)
    return q, k, w, gate, ape, topk


@pytest.mark.parametrize("tail", [True, False])
def test_selection_matches_brute_force(seed, tail):
    q, k, w, gate, ape, topk = _inputs(seed)
    got = kpool_indexer(q, k, w, gate, ape, topk, select_tail=tail)
    P = ape.shape[0]
    assert got.dtype == torch.int32 and got.shape[-1] == topk + (P - 1 if tail else 0)
    want = _brute(q, k, w, gate, ape, topk, tail)
    for b in range(q.shape[0]):
        for t in range(q.shape[1]):
            row = got[b, t].tolist()
            n = len(want[b][t])
            assert row[:n] == want[b][t] and all(i == -1 for i in row[n:]), (b, t, row, want[b][t])


def test_packed_sequences_are_pooled_from_their_own_start(seed):
    q, k, w, gate, ape, topk = _inputs(seed, T=16, B=1)
    cut = random.Random(seed).choice([5, 7, 9])
    cu = torch.tensor([0, cut, 16])
    got = kpool_indexer(q, k, w, gate, ape, topk, cu_seqlens=cu)
    for s0, s1 in ((0, cut), (cut, 16)):
        alone = kpool_indexer(q[:, s0:s1], k[:, s0:s1], w[:, s0:s1], gate[:, s0:s1], ape, topk)
        torch.testing.assert_close(got[:, s0:s1], torch.where(alone >= 0, alone + s0, -1))


def test_pooled_keys_and_gradients(seed):
    q, k, w, gate, ape, topk = _inputs(seed, T=9)
    P = ape.shape[0]
    keys = kpool_keys_reference(k, gate, ape)
    assert keys.shape == (k.shape[0], 9 // P, k.shape[2])
    p0 = torch.softmax(gate[:, :P] + ape, dim=1)
    torch.testing.assert_close(keys[:, 0], (p0 * k[:, :P]).sum(1))
    args = [t[:, :2 * P].clone().requires_grad_() if t.dim() == 3 else t.clone().requires_grad_() for t in (k, gate)]
    args.append(ape.clone().requires_grad_())
    assert torch.autograd.gradcheck(kpool_keys_reference, args, eps=1e-6, atol=1e-6)


def test_dsa_layer_attends_to_the_selected_blocks(seed):
    """A KPool DSA layer's output is sparse attention over exactly kpool_indexer's selection (float64)."""
    spec = micro_spec(n_layers=2, layer_types=["dsa", "dsa"], index_shared_layers=[1], index_kpool=2, index_topk=4,
                      qk_rope_head_dim=0, mla_rope=False, first_k_dense=2)
    model = materialize(build_model(spec, "meta"), "cpu", dtype=torch.float64, seed=seed % 1000)
    model.set_backend("reference")
    attn = model.layers[0].attn
    assert attn.kpool == 2 and model.layers[1].attn.kpool is None  # the shared layer has no indexer
    x = torch.randn(1, 11, spec.hidden_size, dtype=torch.float64)
    cos = sin = torch.zeros(11, 0, dtype=torch.float64)
    shared: dict = {}
    out, _ = attn(x, cos=cos, sin=sin, shared=shared)
    q_idx, k_idx, w_idx = attn.indexer(x, attn._queries(x)[1], cos, sin)
    sel = kpool_indexer(q_idx, k_idx, w_idx, attn.kpool_gate(x), attn.kpool_ape, 4)
    torch.testing.assert_close(shared[(0, 0)], sel)
    attn.kpool = None  # the same layer with the per-token indexer selects differently (T = 11 > topk)
    plain, _ = attn(x, cos=cos, sin=sin, shared={})
    assert not torch.allclose(out, plain)


def test_argument_errors():
    q, k, w = torch.randn(1, 6, 2, 4), torch.randn(1, 6, 4), torch.randn(1, 6, 2)
    with pytest.raises(ValueError, match="not a multiple of the block size P=4"):
        kpool_indexer(q, k, w, torch.randn(1, 6, 4), torch.randn(4, 4), 6)
    with pytest.raises(ValueError, match="gate has shape"):
        kpool_indexer(q, k, w, torch.randn(1, 6, 3), torch.randn(2, 4), 4)
    with pytest.raises(ValueError, match="ape has shape"):
        kpool_indexer(q, k, w, torch.randn(1, 6, 4), torch.randn(2, 3), 4)


@pytest.mark.parametrize("bad, needle", [
    (dict(index_kpool=3, index_topk=8), "index_topk=8 is not a multiple of index_kpool=3"),
    (dict(index_kpool=2, index_topk=8, index_loss_coef=0.1), "KPool indexer .* does not implement"),
    (dict(index_kpool=0), "index_kpool"),
])
def test_spec_errors(bad, needle):
    with pytest.raises(ValidationError, match=needle):
        micro_spec(**bad)
