"""Tests for moeadapt.ops.dsa against float64 brute force (dense masked [T, T] math).

Triton tests run when CUDA is present or under TRITON_INTERPRET=1 (tiny shapes).
"""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from moeadapt.ops.dsa import (
    indexer_kl_loss,
    indexer_scores_reference,
    lightning_indexer,
    sparse_attention,
    sparse_attention_reference,
)

SEED = int.from_bytes(os.urandom(4), "little")
print(f"test_dsa seed={SEED}")

RUN_TRITON = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture
def gen():
    return torch.Generator().manual_seed(SEED)


def _rand(gen, *shape, dtype=torch.float64):
    return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)


def _starts(T, cu_seqlens):
    st = np.zeros(T, dtype=np.int64)
    if cu_seqlens is not None:
        cu = cu_seqlens.tolist()
        for a, b in zip(cu[:-1], cu[1:]):
            st[a:b] = a
    return st


def brute_indexer(q_idx, k_idx, w_idx, topk, cu_seqlens=None):
    """Row-by-row exact top-k with (-score, index) lexicographic order."""
    B, T = q_idx.shape[:2]
    sc = indexer_scores_reference(q_idx.double(), k_idx.double(), w_idx.double()).numpy()
    st = _starts(T, cu_seqlens)
    out = np.full((B, T, topk), -1, dtype=np.int64)
    for b in range(B):
        for t in range(T):
            cand = np.arange(st[t], t + 1)
            s = sc[b, t, cand]
            order = np.lexsort((cand, -s))[:topk]
            picked = np.sort(cand[order])
            out[b, t, : len(picked)] = picked
    return torch.from_numpy(out)


def dense_sparse_attention(q, k, v, indices, scale=None):
    """Dense [T, T] softmax attention masked to the index set, float64."""
    B, T, HQ, D = q.shape
    HK = k.shape[2]
    G = HQ // HK
    scale = D**-0.5 if scale is None else scale
    idx = indices if indices.dim() == 4 else indices[:, :, None].expand(-1, -1, HK, -1)
    mask = torch.zeros(B, T, HK, T + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(idx < 0, T, idx).long(), True)
    mask = mask[..., :T].repeat_interleave(G, dim=2)  # [B,T,HQ,S]
    kk = k.repeat_interleave(G, dim=2)
    vv = v.repeat_interleave(G, dim=2)
    s = torch.einsum("bthd,bshd->bths", q, kk) * scale
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, -1).nan_to_num(0.0)
    return torch.einsum("bths,bshd->bthd", p, vv)


def dense_kl(q, k, indices, q_idx, k_idx, w_idx, scale=None):
    B, T, HQ, D = q.shape
    HK = k.shape[2]
    G = HQ // HK
    scale = D**-0.5 if scale is None else scale
    mask = torch.zeros(B, T, T + 1, dtype=torch.bool)
    mask.scatter_(-1, torch.where(indices < 0, T, indices).long(), True)
    mask = mask[..., :T]
    with torch.no_grad():
        s = torch.einsum("bthd,bshd->bths", q, k.repeat_interleave(G, dim=2)) * scale
        p = torch.softmax(s.masked_fill(~mask[:, :, None], float("-inf")), -1).nan_to_num(0.0).sum(2)
        p = p / p.sum(-1, keepdim=True)
    i = indexer_scores_reference(q_idx, k_idx, w_idx).masked_fill(~mask, float("-inf"))
    logq = torch.log_softmax(i, -1)
    kl = torch.where(mask & (p > 0), p * (torch.log(p) - logq), torch.zeros_like(p)).sum(-1)
    return kl.sum() / mask.any(-1).sum()


def _indexer_inputs(gen, B, T, HI, DI, dtype=torch.float64):
    return _rand(gen, B, T, HI, DI, dtype=dtype), _rand(gen, B, T, DI, dtype=dtype), _rand(gen, B, T, HI, dtype=dtype).abs()


@pytest.mark.parametrize("T,topk", [(5, 8), (37, 8), (64, 16)])
def test_indexer_matches_brute_force(gen, T, topk):
    q_idx, k_idx, w_idx = _indexer_inputs(gen, 2, T, 3, 8)
    got = lightning_indexer(q_idx, k_idx, w_idx, topk, backend="reference")
    assert got.dtype == torch.int32 and got.shape == (2, T, topk)
    assert torch.equal(got.long(), brute_indexer(q_idx, k_idx, w_idx, topk))


def test_indexer_varlen_and_blocks(gen):
    T = 50
    cu = torch.tensor([0, 7, 30, 31, 50], dtype=torch.int32)
    q_idx, k_idx, w_idx = _indexer_inputs(gen, 1, T, 2, 4)
    got = lightning_indexer(q_idx, k_idx, w_idx, 6, cu_seqlens=cu, backend="reference")
    assert torch.equal(got.long(), brute_indexer(q_idx, k_idx, w_idx, 6, cu))
    from moeadapt.ops.dsa.reference import lightning_indexer_reference

    small_blocks = lightning_indexer_reference(q_idx, k_idx, w_idx, 6, cu, block=7)
    assert torch.equal(small_blocks, got)


def test_indexer_exact_ties_lower_index_wins(gen):
    T, topk = 20, 4
    q_idx = torch.ones(1, T, 2, 4)
    k_idx = torch.ones(1, T, 4)
    k_idx[0, 9] = 2.0  # one clear winner; the rest tie
    w_idx = torch.ones(1, T, 2)
    got = lightning_indexer(q_idx, k_idx, w_idx, topk, backend="reference")
    assert got[0, 19].tolist() == [0, 1, 2, 9]
    assert got[0, 2].tolist() == [0, 1, 2, -1]
    assert torch.equal(got.long(), brute_indexer(q_idx, k_idx, w_idx, topk))


def _attn_inputs(gen, B, T, HQ, HK, D, DV, topk, per_head=False, dtype=torch.float64):
    q, k, v = _rand(gen, B, T, HQ, D, dtype=dtype), _rand(gen, B, T, HK, D, dtype=dtype), _rand(gen, B, T, HK, DV, dtype=dtype)
    # random causal index sets with -1 holes, ascending
    shape = (B, T, HK, topk) if per_head else (B, T, topk)
    r = torch.rand(*shape, generator=gen)
    t = torch.arange(T).view(1, T, *([1] * (len(shape) - 2)))
    idx = (r * (t + 1)).long()
    idx = torch.where(torch.rand(*shape, generator=gen) < 0.2, -1, idx)
    idx = torch.sort(torch.where(idx < 0, T, idx), -1).values
    # deduplicate: repeated keys would double-count in the dense comparison
    dup = torch.zeros_like(idx, dtype=torch.bool)
    dup[..., 1:] = idx[..., 1:] == idx[..., :-1]
    idx = torch.where(dup | (idx == T), -1, idx)
    return q, k, v, idx.to(torch.int32)


@pytest.mark.parametrize("per_head", [False, True])
def test_sparse_attention_values_and_grads(gen, per_head):
    q, k, v, idx = _attn_inputs(gen, 2, 23, 4, 2, 12, 8, 6, per_head)
    idx[0, 5] = -1  # a query with no key gives 0 and no NaN
    for x in (q, k, v):
        x.requires_grad_(True)
    do = _rand(gen, 2, 23, 4, 8)
    o = sparse_attention(q, k, v, idx, scale=0.3, backend="reference")
    o_ref = dense_sparse_attention(q, k, v, idx, scale=0.3)
    torch.testing.assert_close(o, o_ref)
    assert torch.all(o[0, 5] == 0)
    g = torch.autograd.grad(o, (q, k, v), do)
    g_ref = torch.autograd.grad(o_ref, (q, k, v), do)
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b)


def test_kl_loss_value_and_grads(gen):
    B, T, HQ, HK, D, HI, DI, topk = 2, 19, 4, 2, 8, 3, 6, 5
    q, k, _, _ = _attn_inputs(gen, B, T, HQ, HK, D, D, topk)
    q_idx, k_idx, w_idx = _indexer_inputs(gen, B, T, HI, DI)
    idx = lightning_indexer(q_idx, k_idx, w_idx, topk, backend="reference")
    for x in (q, k, q_idx, k_idx, w_idx):
        x.requires_grad_(True)
    loss = indexer_kl_loss(q, k, idx, q_idx, k_idx, w_idx, backend="reference")
    loss_ref = dense_kl(q, k, idx, q_idx, k_idx, w_idx)
    torch.testing.assert_close(loss.double(), loss_ref, rtol=1e-5, atol=1e-6)
    g = torch.autograd.grad(loss, (q_idx, k_idx, w_idx, q, k), allow_unused=True)
    g_ref = torch.autograd.grad(loss_ref, (q_idx, k_idx, w_idx))
    for a, b in zip(g[:3], g_ref):
        torch.testing.assert_close(a.double(), b, rtol=1e-5, atol=1e-6)
    assert g[3] is None and g[4] is None  # main attention gets no gradient


def test_validation_messages():
    q = torch.zeros(1, 4, 2, 8)
    with pytest.raises(ValueError, match="k_idx"):
        lightning_indexer(q, torch.zeros(1, 4, 7), torch.zeros(1, 4, 2), 2)
    with pytest.raises(ValueError, match="HQ = 2"):
        sparse_attention(q, torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 3, 8), torch.zeros(1, 4, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="indices"):
        sparse_attention(q, q[:, :, :1], q[:, :, :1], torch.zeros(1, 5, 2, dtype=torch.int32))
    with pytest.raises(ValueError, match="backend"):
        sparse_attention(q, q, q, torch.zeros(1, 4, 2, dtype=torch.int32), backend="cuda")


# ---------------------------------------------------------------- Triton (tiny shapes)

triton_only = pytest.mark.skipif(not RUN_TRITON, reason="needs CUDA or TRITON_INTERPRET=1")


def _check_selection(got, q_idx, k_idx, w_idx, topk, cu_seqlens=None, tol=1e-4):
    """got must equal brute force except where scores tie within tol."""
    exact = brute_indexer(q_idx.cpu(), k_idx.cpu(), w_idx.cpu(), topk, cu_seqlens)
    got = got.cpu().long()
    if torch.equal(got, exact):
        return
    sc = indexer_scores_reference(q_idx.cpu().double(), k_idx.cpu().double(), w_idx.cpu().double())
    for b, t in zip(*torch.nonzero((got != exact).any(-1), as_tuple=True)):
        g, e = got[b, t], exact[b, t]
        assert (g >= 0).sum() == (e >= 0).sum()
        sg = sc[b, t][g[g >= 0]].sort().values
        se = sc[b, t][e[e >= 0]].sort().values
        torch.testing.assert_close(sg, se, atol=tol, rtol=tol)


@triton_only
@pytest.mark.parametrize("T,topk,cu", [(40, 8, None), (13, 16, None), (45, 8, [0, 9, 10, 45])])
def test_triton_indexer(gen, T, topk, cu):
    cu_t = None if cu is None else torch.tensor(cu, dtype=torch.int32)
    B = 2 if cu is None else 1
    q_idx, k_idx, w_idx = _indexer_inputs(gen, B, T, 4, 32, torch.float32)
    args = [x.to(DEV) for x in (q_idx, k_idx, w_idx)]
    got = lightning_indexer(*args, topk, cu_seqlens=None if cu_t is None else cu_t.to(DEV), backend="triton")
    _check_selection(got, q_idx, k_idx, w_idx, topk, cu_t)


@triton_only
def test_triton_indexer_ties():
    T, topk = 40, 8
    q_idx = torch.ones(1, T, 2, 16, device=DEV)
    k_idx = torch.ones(1, T, 16, device=DEV)
    k_idx[0, 30] = 2.0
    w_idx = torch.ones(1, T, 2, device=DEV)
    got = lightning_indexer(q_idx, k_idx, w_idx, topk, backend="triton").cpu()
    assert got[0, 39].tolist() == [0, 1, 2, 3, 4, 5, 6, 30]
    assert torch.equal(got.long(), brute_indexer(q_idx.cpu(), k_idx.cpu(), w_idx.cpu(), topk))


@triton_only
def test_triton_indexer_scale_jumps_between_rows(gen):
    """The select's first histogram is a window around the previous row's k-th key: rows whose scores jump by
    up to 1e12 either way, rows of only negative (and zero) scores, and ties at zero must still select exactly
    what brute force selects (the k-th key then falls outside the window, into an end bin)."""
    from moeadapt.ops.dsa.triton_indexer import LI_CONFIG, lightning_indexer_triton

    T, topk = 96, 12
    q_idx = torch.randint(-2, 3, (1, T, 2, 16), generator=gen).float()
    k_idx = torch.randint(-3, 4, (1, T, 16), generator=gen).float()
    w_idx = torch.randint(1, 3, (1, T, 2), generator=gen).float()
    scale = 2.0 ** torch.randint(-40, 41, (1, T, 1), generator=gen).float()  # powers of two: scores stay exact
    sign = torch.where(torch.rand(1, T, 1, generator=gen) < 0.3, -1.0, 1.0)  # some rows: every score <= 0
    w_idx = w_idx * scale * sign
    cfg = dict(LI_CONFIG, BLOCK_S=16, BLOCK_R=16)
    got = lightning_indexer_triton(q_idx.to(DEV), k_idx.to(DEV), w_idx.to(DEV), topk, cfg=cfg)
    assert torch.equal(got.cpu().long(), brute_indexer(q_idx, k_idx, w_idx, topk))


@triton_only
@pytest.mark.parametrize("HQ,HK,per_head", [(4, 1, False), (4, 2, True)])
def test_triton_sparse_attention(gen, HQ, HK, per_head):
    T, D, DV, topk = 40, 48, 32, 8
    q, k, v, idx = _attn_inputs(gen, 1, T, HQ, HK, D, DV, topk, per_head, dtype=torch.float32)
    do = _rand(gen, 1, T, HQ, DV, dtype=torch.float32)
    q, k, v, idx, do = (x.to(DEV) for x in (q, k, v, idx, do))
    outs = []
    for backend in ("triton", "reference"):
        qq, kk, vv = (x.clone().requires_grad_(True) for x in (q, k, v))
        o = sparse_attention(qq, kk, vv, idx, backend=backend)
        outs.append((o, *torch.autograd.grad(o, (qq, kk, vv), do)))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


@triton_only
def test_triton_sparse_attention_mla_shared_kv(gen):
    """MQA/MLA form: v is the leading DV channels of k (one latent); grads reach kv."""
    T, HQ, D, DV, topk = 40, 4, 48, 32, 8
    q, kv, _, idx = _attn_inputs(gen, 1, T, HQ, 1, D, DV, topk, dtype=torch.float32)
    do = _rand(gen, 1, T, HQ, DV, dtype=torch.float32)
    q, kv, idx, do = (x.to(DEV) for x in (q, kv, idx, do))
    outs = []
    for backend in ("triton", "reference"):
        qq, kk = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
        o = sparse_attention(qq, kk, kk[..., :DV], idx, scale=0.2, backend=backend)
        outs.append((o, *torch.autograd.grad(o, (qq, kk), do)))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


@triton_only
def test_triton_indexer_many_exact_ties(gen):
    """Small-integer scores: many exact ties straddling the k-th value, varlen."""
    T, topk = 70, 8
    cu = torch.tensor([0, 33, 70], dtype=torch.int32)
    q_idx = torch.randint(-2, 3, (1, T, 3, 16), generator=gen).float()
    k_idx = torch.randint(-1, 2, (1, T, 16), generator=gen).float()
    w_idx = torch.randint(-2, 3, (1, T, 3), generator=gen).float()
    got = lightning_indexer(q_idx.to(DEV), k_idx.to(DEV), w_idx.to(DEV), topk, cu_seqlens=cu.to(DEV), backend="triton")
    assert torch.equal(got.cpu().long(), brute_indexer(q_idx, k_idx, w_idx, topk, cu))


@triton_only
@pytest.mark.parametrize("T,topk,spread,block_q,predict", [(144, 30, 3, 1, False), (144, 30, 40, 4, False),
                                                           (100, 70, 2, 2, False), (144, 30, 3, 4, True),
                                                           (144, 30, 40, 1, True)])
def test_triton_indexer_candidates_over_many_tiles(gen, T, topk, spread, block_q, predict):
    """16-key tiles, so that the row, the candidate buffer (the keys sharing the k-th key's top byte) and the
    ties span many tiles: small-integer scores (exact in fp32 whatever the summation order; `spread` sets how
    many distinct values, hence how many candidates and ties) select exactly what brute force selects. Blocks
    of `block_q` query rows share each key tile; the documents' boundaries fall inside blocks. With `predict`,
    the rows' thresholds (from the previous row) leave too few, enough or (CAP = 48) too many candidates
    (the candidate select and the full-row fallback both run)."""
    from moeadapt.ops.dsa.triton_indexer import LI_CONFIG, lightning_indexer_triton

    cu = torch.tensor([0, 17, T - 40, T], dtype=torch.int32)
    q_idx = torch.randint(-2, 3, (1, T, 2, 16), generator=gen).float()
    k_idx = torch.randint(-spread, spread + 1, (1, T, 16), generator=gen).float()
    w_idx = torch.randint(-1, 3, (1, T, 2), generator=gen).float()
    cfg = dict(LI_CONFIG, BLOCK_S=16, BLOCK_R=16, BLOCK_Q=block_q, PREDICT=predict, CAP=48)
    got = lightning_indexer_triton(q_idx.to(DEV), k_idx.to(DEV), w_idx.to(DEV), topk, cu.to(DEV), cfg=cfg)
    assert torch.equal(got.cpu().long(), brute_indexer(q_idx, k_idx, w_idx, topk, cu))


@triton_only
def test_triton_kl_loss(gen):
    T, HQ, HK, D, HI, DI, topk = 40, 4, 1, 48, 3, 16, 8
    q, k, _, _ = _attn_inputs(gen, 1, T, HQ, HK, D, D, topk, dtype=torch.float32)
    q_idx, k_idx, w_idx = _indexer_inputs(gen, 1, T, HI, DI, torch.float32)
    idx = lightning_indexer(q_idx, k_idx, w_idx, topk, backend="reference")
    idx[0, 3] = -1  # a query without keys is left out of the mean
    q, k, idx, q_idx, k_idx, w_idx = (x.to(DEV) for x in (q, k, idx, q_idx, k_idx, w_idx))
    res = []
    for backend in ("triton", "reference"):
        xs = [x.clone().requires_grad_(True) for x in (q_idx, k_idx, w_idx)]
        loss = indexer_kl_loss(q, k, idx, *xs, scale=0.3, backend=backend)
        res.append((loss, *torch.autograd.grad(2.0 * loss, xs)))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@triton_only
@pytest.mark.parametrize("D,DV,DI", [(20, 16, 8), (12, 8, 24)])
def test_triton_tiny_head_dims(gen, D, DV, DI):
    """Dims below the MMA's 16 or not powers of two (the model's micro configs) are padded/masked."""
    T, HQ, HI, topk = 30, 2, 2, 8
    q, kv, v, _ = _attn_inputs(gen, 1, T, HQ, 1, D, DV, topk, dtype=torch.float32)
    q_idx, k_idx, w_idx = _indexer_inputs(gen, 1, T, HI, DI, torch.float32)
    do = _rand(gen, 1, T, HQ, DV, dtype=torch.float32)
    q, kv, v, q_idx, k_idx, w_idx, do = (x.to(DEV) for x in (q, kv, v, q_idx, k_idx, w_idx, do))
    idx = lightning_indexer(q_idx, k_idx, w_idx, topk, backend="triton")
    _check_selection(idx, q_idx, k_idx, w_idx, topk)
    res = []
    for backend in ("triton", "reference"):
        xs = [x.clone().requires_grad_(True) for x in (q, kv, v, q_idx, k_idx, w_idx)]
        o = sparse_attention(xs[0], xs[1], xs[2], idx, backend=backend)
        loss = indexer_kl_loss(xs[0], xs[1], idx, *xs[3:], backend=backend)
        res.append((o, loss, *torch.autograd.grad((o * do).sum() + loss, xs)))
    for a, b in zip(*res):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


# Launch configurations of triton_sparse_attn (its fwd_cfg / bwd_cfg arguments), each checked against float64
# on small blocks so that the loops run several key blocks, the causal ramp leaves whole blocks of -1 and the
# last block is partial.
_FWD_VARIANTS = {
    # every key block of the row (the walk for topk > MAX_SKIP_TOPK)
    "full_walk": {"BLOCK_H": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1},
    "skip_rev": {"BLOCK_H": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1, "SKIP": True, "REVERSE": True},
    # unmasked full blocks on dense rows (the default walk)
    "dense": {"BLOCK_H": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1, "SKIP": True, "REVERSE": True,
              "DENSE": True},
    # dense tiles (MLA layout only): 4 queries x 4 heads a tile, so T = 45 ends in a partial query block; 16-key
    # tiles from each block's smallest to its largest selected key, the last one partial
    "tiles": {"TILES": True, "AUTO": False, "MAX_HEADS": 32, "MASK_BYTES": 2**27, "MIN_DENSITY": 0.0, "BLOCK_M": 16,
              "BLOCK_KEYS": 16, "num_warps": 4, "num_stages": 1},
}
_BWD_SUB = {"BLOCK_H": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1, "SKIP": True, "REVERSE": True}
_BWD_VARIANTS = {
    # PDS_BYTES small enough that the rows go in several chunks (last one partial)
    "pds": {"SKIP": True, "REVERSE": True, "PDS_BYTES": 4 * 4 * 40 * 2 * 13,
            "PDS_CFG": {**_BWD_SUB, "IDX_AHEAD": True}, "APPLY_CFG": {**_BWD_SUB, "BLOCK_C": 16}},
    # every key block (no SKIP): pass 1 writes every slot
    "pds_c32": {"PDS_CFG": _BWD_SUB, "APPLY_CFG": {**_BWD_SUB, "BLOCK_C": 32, "IDX_AHEAD": True}},
    # different head blocks in the two passes (G = 20: 2 x 16 heads, then 1 x 32 with 12 masked); pass 2 one
    # channel chunk after the other (the order taken when dk does not fit the L2 cache)
    "pds_hmix": {"SKIP": True, "PDS_CFG": _BWD_SUB,
                 "APPLY_CFG": {**_BWD_SUB, "BLOCK_H": 32, "BLOCK_C": 16, "CHANNEL_MAJOR": True}},
    # pass 2's key block larger than pass 1's: with SKIP, pass 1 leaves slots past its last block unwritten;
    # pass 2 must bound its loads by pass 1's extent (the buffer is NaN-poisoned here, so a read beyond fails)
    "pds_kmix": {"SKIP": True, "PDS_CFG": _BWD_SUB, "APPLY_CFG": {**_BWD_SUB, "BLOCK_K": 32, "BLOCK_C": 16}},
    # the dense pass 2 (MLA layout only; the per-head layout takes the slot pass 2): 2-query x 16-key tiles, so T = 45
    # ends in a partial query block and a partial key block, segments of 3 query blocks (several atomic tiles
    # per key block), dk / dq channel chunks that end past D; only the tiles pass 1 may write zeroed (the buffer is
    # NaN-poisoned, so a flagged tile left unzeroed fails)
    "dense": {"SKIP": True, "REVERSE": True, "PDS_CFG": _BWD_SUB, "APPLY_CFG": {**_BWD_SUB, "BLOCK_C": 16},
              "DENSE": {"BYTES": 2**31, "MAX_HEADS": 32, "BLOCK_Q": 2, "BLOCK_KEYS": 16, "SEG": 3, "ZERO_TOUCHED": True,
                        "DK_CFG": {"BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
                        "DQ_CFG": {"BLOCK_C": 32, "num_warps": 4, "num_stages": 1}}},
    # the dense pass 2 with pass 1 on dense tiles: 8-query x 16-key buffer tiles (32 columns), each written by two
    # 16-column programs in two 8-key steps; nothing zeroed (the NaN-poisoned buffer fails a tile left unwritten)
    "dense_p1t": {"SKIP": True, "REVERSE": True, "PDS_CFG": _BWD_SUB, "APPLY_CFG": {**_BWD_SUB, "BLOCK_C": 16},
                  "DENSE": {"BYTES": 2**31, "MAX_HEADS": 32, "BLOCK_Q": 8, "BLOCK_KEYS": 16, "SEG": 3,
                            "ZERO_TOUCHED": True,
                            "P1_TILES": {"BLOCK_M": 16, "BLOCK_KEYS": 8, "num_warps": 4, "num_stages": 1},
                            "DK_CFG": {"BLOCK_C": 32, "num_warps": 4, "num_stages": 1},
                            "DQ_CFG": {"BLOCK_C": 32, "num_warps": 4, "num_stages": 1}}},
}


_SFA_VARIANTS = [("full_walk", "pds"), ("dense", "pds"), ("skip_rev", "pds"), ("full_walk", "pds_c32"),
                 ("dense", "pds_hmix"), ("skip_rev", "pds_kmix"), ("dense", "pds_kmix"), ("skip_rev", "dense"),
                 ("tiles", "dense"), ("tiles", "dense_p1t")]


# CI: a subset that runs every forward walk and every backward config on the MLA layout, and the multi-chunk pds
# on the per-head GQA layout too (20-36 s each interpreted); every pair on both layouts before a release
_SFA_CI = {("mla", "skip_rev", "pds"), ("mla", "full_walk", "pds_c32"), ("mla", "dense", "pds_hmix"),
           ("mla", "skip_rev", "pds_kmix"), ("gqa_per_head", "full_walk", "pds"), ("mla", "skip_rev", "dense"),
           ("mla", "tiles", "dense"), ("mla", "tiles", "dense_p1t")}


@triton_only
@pytest.mark.parametrize("layout,fwd,bwd", [
    (lay, f, b) if (lay, f, b) in _SFA_CI else pytest.param(lay, f, b, marks=pytest.mark.slow)
    for lay in ("gqa_per_head", "mla") for f, b in _SFA_VARIANTS if lay == "mla" or f != "tiles"])
def test_triton_sparse_attention_variants(gen, monkeypatch, fwd, bwd, layout):
    from moeadapt.ops.dsa import triton_sparse_attn as tsa

    monkeypatch.setattr(tsa, "_POISON_PDS", True)
    T, topk = 45, 40  # t < topk for most rows: trailing blocks entirely -1
    HQ, HK, D, DV, per_head = (4, 2, 40, 24, True) if layout == "gqa_per_head" else (4, 1, 48, 32, False)
    if bwd == "pds_hmix":
        HQ = 20 * HK
    q, k, v, idx = _attn_inputs(gen, 1, T, HQ, HK, D, DV, topk, per_head, dtype=torch.float32)
    q = q * 3.0  # sharper softmax: the running row maximum grows mid-row
    idx[0, 7] = -1  # a query with no key
    if fwd == "dense":  # every other row dense (valid slots first): DENSE's unmasked full blocks, then the tail
        key = torch.where(idx < 0, T, idx).sort(-1).values
        idx[:, ::2] = torch.where(key == T, -1, key)[:, ::2]
    do = _rand(gen, 1, T, HQ, DV, dtype=torch.float32)
    shared = layout == "mla"
    outs = []
    for backend in ("triton", "reference"):
        qq, kk, vv = (x.clone().to(DEV).requires_grad_(True) for x in (q, k, v))
        vin = kk[..., :DV] if shared else vv
        if backend == "triton":
            o = tsa.sparse_attention_triton(qq, kk, vin, idx.to(DEV), scale=0.25, fwd_cfg=_FWD_VARIANTS[fwd],
                                            bwd_cfg=_BWD_VARIANTS[bwd])
        else:
            o = sparse_attention(qq, kk, vin, idx.to(DEV), scale=0.25, backend=backend)
        outs.append((o, *torch.autograd.grad(o, (qq, kk) if shared else (qq, kk, vv), do.to(DEV))))
    assert torch.all(outs[0][0][0, 7] == 0)
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=3e-4, rtol=3e-4)


def test_dense_tile_forward_applies_only_where_it_pays():
    """DENSE_FWD_CONFIG's conditions: MLA (one KV head, v = k[..., :DV]), <= 32 query heads, the selected pairs
    >= MIN_DENSITY of the causal ones (seq 4096 with top-2048: 0.75; seq 8192: 0.44, where it lost on the GPU)."""
    from moeadapt.ops.dsa import triton_sparse_attn as tsa

    cfg = tsa.DENSE_FWD_CONFIG

    def applies(B=2, T=4096, HQ=16, HK=1, topk=2048, vk=True, dv=512):
        return tsa._tiles_apply(cfg, B, T, T, HQ, HK, topk, vk, dv, 512)
    assert applies() and applies(HQ=32) and applies(T=45, topk=40, B=1)
    assert not applies(T=8192) and not applies(HQ=64) and not applies(HQ=24) and not applies(HK=2)
    assert not applies(vk=False) and not applies(dv=256) and not applies(B=16, T=4096)  # mask over MASK_BYTES
    assert not tsa._tiles_apply(cfg, 2, 1024, 4096, 16, 1, 2048, True, 512, 512)  # context parallelism's local queries


@triton_only
def test_triton_dense_tile_forward_is_the_default_where_it_applies(gen, monkeypatch):
    """bf16 MLA inputs with a dense selection take the dense-tile forward (cfg=None); its o and lse match the
    gathering forward's; an explicit TILES cfg on a layout it cannot run names the conditions."""
    from moeadapt.ops.dsa import triton_sparse_attn as tsa

    calls = []
    real = tsa._forward_tiles
    monkeypatch.setattr(tsa, "_forward_tiles", lambda *a: calls.append(1) or real(*a))
    T, topk, HQ, D, DV = 37, 32, 8, 48, 32
    q, k, _, idx = _attn_inputs(gen, 2, T, HQ, 1, D, DV, topk, dtype=torch.bfloat16)
    q, k, idx = q.to(DEV), k.to(DEV), idx.to(DEV)
    o, lse = tsa.sfa_forward(q, k, None, idx, 0.2)
    assert calls == [1]
    o_ref, lse_ref = tsa.sfa_forward(q, k, None, idx, 0.2, cfg=tsa.FWD_CONFIG)
    assert calls == [1]
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(lse, lse_ref, atol=1e-3, rtol=1e-3)
    qg, kg, vg, idg = _attn_inputs(gen, 1, T, 4, 2, D, DV, topk, per_head=True, dtype=torch.float32)
    with pytest.raises(ValueError, match="dense-tile forward"):
        tsa.sfa_forward(qg.to(DEV), kg.to(DEV), vg.to(DEV), idg.to(DEV), 0.2, cfg=dict(tsa.DENSE_FWD_CONFIG))


@triton_only
def test_triton_pds_backward_falls_back_when_shared_memory_is_short(gen, monkeypatch):
    """A P/dS pass whose config does not fit the device (OutOfResources at launch) reruns with
    the fallback config; the gradients stay exact."""
    import triton

    from moeadapt.ops.dsa import triton_sparse_attn as tsa

    small = {"BLOCK_H": 16, "BLOCK_K": 16, "num_warps": 4, "num_stages": 1}
    bwd_cfg = {"SKIP": True, "PDS_CFG": {**small, "BLOCK_K": 32}, "APPLY_CFG": {**small, "BLOCK_C": 32}}
    monkeypatch.setattr(tsa, "PDS_FALLBACK", small)
    monkeypatch.setattr(tsa, "APPLY_FALLBACK", {**small, "BLOCK_C": 16})
    monkeypatch.setattr(tsa, "_fallen_back", {})
    launch = tsa._launch

    def short_smem(kernel, grid, *args, **meta):
        if meta["BLOCK_K"] == 32 or meta.get("BLOCK_C") == 32:  # the configured ones "do not fit"
            raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
        launch(kernel, grid, *args, **meta)

    monkeypatch.setattr(tsa, "_launch", short_smem)
    T, HQ, D, DV, topk = 30, 4, 48, 32, 24
    q, kv, _, idx = _attn_inputs(gen, 1, T, HQ, 1, D, DV, topk, dtype=torch.float32)
    do = _rand(gen, 1, T, HQ, DV, dtype=torch.float32)
    q, kv, idx, do = (x.to(DEV) for x in (q, kv, idx, do))
    outs = []
    for backend in ("triton", "reference"):
        qq, kk = q.clone().requires_grad_(True), kv.clone().requires_grad_(True)
        if backend == "triton":
            o = tsa.sparse_attention_triton(qq, kk, kk[..., :DV], idx, bwd_cfg=bwd_cfg)
            with pytest.warns(UserWarning, match="does not fit"):
                outs.append(torch.autograd.grad(o, (qq, kk), do))
        else:
            o = sparse_attention(qq, kk, kk[..., :DV], idx, backend=backend)
            outs.append(torch.autograd.grad(o, (qq, kk), do))
    assert len(tsa._fallen_back) == 2
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, atol=2e-4, rtol=2e-4)


def _tile_selection(gen, B, T, topk, empty_row):
    """Causal selections of T queries: query t takes every key up to topk of them, else topk random keys of its
    past (itself included); `empty_row` selects nothing. At T = 384, topk = 320 the block (1, 0) is full, the
    diagonal and last-row blocks partial, (0, 1) empty (with `empty_row` >= 256)."""
    idx = torch.full((B, T, topk), -1, dtype=torch.int64)
    for b in range(B):
        for t in range(T):
            keys = torch.arange(t + 1) if t < topk else torch.randperm(t + 1, generator=gen)[:topk].sort().values
            idx[b, t, : len(keys)] = keys
    idx[:, empty_row] = -1
    return idx


@triton_only
@pytest.mark.parametrize("D,DV,full", [(192, 64, True), (64, 32, False)])
def test_tile_attention_matches_reference(gen, D, DV, full):
    """ops/dsa/triton_tile_attn.py (the MHA form's dense tiles without FlexAttention's head-dim padding: D = 192
    as 128 + 64 channels) against the float64 reference: o, dq, dk, dv on fp32 inputs, a query that selects
    nothing included (o = 0, no gradient); with and without full blocks. Dropping the full blocks from the lists
    (their pairs then unseen) fails the same check."""
    from moeadapt.ops.dsa import flex_attn as fa
    from moeadapt.ops.dsa.triton_tile_attn import tile_attention

    B, T, H, topk = 1, 384, 2, 320
    idx = _tile_selection(gen, B, T, topk, empty_row=int(torch.randint(256, T, (1,), generator=gen)))
    q, k = (_rand(gen, B, T, H, D) for _ in range(2))
    v, do = (_rand(gen, B, T, H, DV) for _ in range(2))
    scale = D ** -0.5
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o_ref = sparse_attention_reference(*leaves, idx, scale)
    ref = [o_ref, *torch.autograd.grad(o_ref, leaves, do)]
    tiles = fa.selection_tiles(idx.to(DEV), T, T, full_blocks=full)
    if full:
        assert int(tiles.kv_full_num.sum()) > 0 and int(tiles.kv_num.sum()) > 0  # both kinds of tile are walked

    def run(tl_):
        xs = [x.float().to(DEV).requires_grad_() for x in (q, k, v)]
        o = tile_attention(*xs, tl_, scale)
        return [o, *torch.autograd.grad(o, xs, do.float().to(DEV))]

    def err(got):
        return max(((a.double().cpu() - b).abs().max() / b.abs().max()).item() for a, b in zip(got, ref))

    assert err(run(tiles)) < 1e-4
    if full:
        broken = tiles._replace(kv_full_num=torch.zeros_like(tiles.kv_full_num),
                                q_full_num=torch.zeros_like(tiles.q_full_num))
        assert err(run(broken)) > 1e-2
