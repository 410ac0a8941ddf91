"""Triton sparse attention (SFA forward, SFAG backward) behind `sparse_attention(backend="triton")`.

Owns the fused kernels and their registration as the torch.library custom ops `moeadapt::sparse_attn_fwd` / `_bwd`
(register_fake, register_autograd: selective activation checkpointing keeps the forward's o and lse, torch.compile
traces one op each way; `sparse_attn_fwd_fast` skips the op's dispatch in plain eager mode, ops/custom.py); the
math is `reference.sparse_attention_reference`.

Forward: one program per (query, KV head, block of BLOCK_H query heads). It
walks the query's selected keys BLOCK_K at a time, gathers those K/V rows once
for all heads of the group (the query heads are the M dimension of the MMA), runs
an online softmax in base 2 and saves lse (natural log) for the backward.
The qk dimension is split into a power-of-two main part D1 and a tail D2
(576 = 512 + 64), so nothing is padded to 1024. Default walk (FWD_CONFIG): SKIP the
all-(-1) key blocks of the causal ramp, REVERSE (full rows first), DENSE (a row whose
valid slots come first, as the indexer writes them, runs its full key blocks without
masks, then the masked tail); SKIP (and so DENSE) is off for topk > MAX_SKIP_TOPK.

On sm_90 with bf16 MLA shapes the forward and backward pass 1 run the warp-specialised Gluon kernels of
gluon_sparse_attn.py instead (same contract; `gluon=False` keeps everything here).

Forward on dense tiles (DENSE_FWD_CONFIG: MLA, a power of two <= 32 query heads, the selected pairs >= 0.7 of the
causal ones, e.g. the `small` preset's seq 4096 with top-2048). With few heads per key the gathering forward's
MMA has only HQ rows. `_sfa_fwd_tiles_kernel` makes the (query, head) pairs of BLOCK_M / HQ queries the MMA's M
instead and walks contiguous key tiles from the block's smallest to its largest selected key, masking each
pair's unselected keys with a byte mask that `_mark_selected_kernel` writes from the indices. It computes the
masked pairs too, so it pays only where the selection is dense (H200, B = 2, T = 4096, 16 heads: 2.86 vs 3.19
ms; at T = 8192, density 0.44, it lost 5.4 vs 3.7 ms).

Backward: two passes per chunk of rows. Pass 1 (`_sfa_bwd_pds_kernel`, shaped like the forward) recomputes
P from lse and dS = P (dO V^T - delta) * scale and stores both in q's dtype ([rows, HQ, TOPK], at most
PDS_BYTES at a time, 1 GiB by default). Pass 2 (`_sfa_bwd_from_pds_kernel`) runs per (query, head block,
128-channel chunk; 64 at 64-head blocks): dq[:, c] = dS K_sel[:, c] and dk[sel, c] += dS^T q[:, c]
(+ P^T dO[:, c] for dv), fp32 atomics for dk/dv; it reads the P/dS slots pass 1 wrote (a scalar bound per
row). Pass 2 runs row-major (the channel chunks of a row together: its P/dS tiles come from L2) or, once dk
outgrows L2 at long T, channel-major (all rows of one chunk, then the next: the atomics hit one chunk's
slice of dk); `_channel_major` weighs the two. No product is computed twice and every accumulator is small
([BLOCK_H, 128] fp32). dq is deterministic; dk/dv (atomics) are not (summation order). When v is the leading DV = D1 channels of k
(MLA's shared latent: ``v = kv[..., :DV]``), each row is read once and dv is folded into dk's buffer; dv
is then returned as None, which leaves the shared base's gradient unchanged.

Dense pass 2 (DENSE_PDS_CONFIG: one KV head with v = k[..., :DV], a power of two <= 32 query heads, P and dS of
all rows within 2 GiB, e.g. the `small` preset's B = 2, T = 4096, 16 heads). There the slot pass 2 is bound by
writing one 576-channel fp32 dk row per selected (query, key) pair. Instead pass 1 writes P and dS at their
keys' places in a zeroed [B, Tk, T, HQ] buffer and flags each (query block, key block) tile it touched; dk is
then a dense MMA per key block over the flagged tiles (the (query, head) pairs as the MMA's K, summed before one
atomic tile per program) and dq one over contiguous K tiles. It relies on a row's indices being distinct (the
index convention: ascending, -1 padded). At 64 heads it loses (the slot pass 2's MMA already has K = 64).
With DENSE_PDS_CONFIG["P1_TILES"] pass 1 runs on dense tiles too (`_sfa_bwd_pds_tiles_kernel`, shaped like the
dense-tile forward below): it writes every tile of its query block's selected-key range whole, so nothing is
zeroed. It is off until it has been timed on a GPU.

The launch configurations (FWD_CONFIG, BWD_CONFIG) are read-only constants; the forward and backward take a
changed copy as an argument (`sparse_attention_triton(..., fwd_cfg=, bwd_cfg=)`). Measured on the H200 with
benchmarks/bench_dsa.py; variants that lost there (forward flags, a fused one-pass backward, split dq /
dk-dv passes, a per-slot validity mask in pass 2) were removed.
"""

import functools
import json
import math
import os
import warnings

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor

from ..custom import eager_or_op, impl_or_op

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
# The Triton 3.9 interpreter computes bf16/fp16 tl.dot wrongly; under it every product runs in fp32.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def use_ieee(x: torch.Tensor) -> bool:
    return x.dtype == torch.float32 or INTERPRET


@triton.jit
def _mm(a, b, IEEE: tl.constexpr, acc=None):
    """a @ b (+ acc, accumulated in place by the MMA); IEEE: fp32 operands, exact fp32 products."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _scatter_add(ptr, val, mask):
    """fp32 atomic add into the dk / dv buffers."""
    tl.atomic_add(ptr, val, mask=mask, sem="relaxed")


@triton.jit
def _row_of_program(BT, REVERSE: tl.constexpr):
    """Row (b * T + t) of this program; REVERSE runs the last rows first: with causal
    indices those are the full ones (topk keys), so the short early rows fill the tail."""
    pid = tl.program_id(0).to(tl.int64)
    if REVERSE:
        return BT - 1 - pid
    return pid


@triton.jit
def _slot_span(idx_row_ptr, TOPK, SKIP: tl.constexpr, TOPK_P2: tl.constexpr):
    """Slots [0, span) hold every valid index of the row (span = last valid slot + 1).
    SKIP=False walks all TOPK slots; SKIP=True reads the row once (TOPK_P2 >= TOPK ints)
    so key blocks that are all -1 (the causal ramp t < topk) are never visited."""
    if SKIP:
        offs = tl.arange(0, TOPK_P2)
        ix = tl.load(idx_row_ptr + offs, mask=offs < TOPK, other=-1)
        return tl.max(tl.where(ix >= 0, offs + 1, 0), 0)
    return TOPK


@triton.jit
def _idx_block(idx_row_ptr, k0, TOPK, BLOCK_K: tl.constexpr):
    """Index slots [k0, k0 + BLOCK_K) of a row; -1 past TOPK."""
    offs = k0 + tl.arange(0, BLOCK_K)
    return tl.load(idx_row_ptr + offs, mask=offs < TOPK, other=-1)


@triton.jit
def _idx_walk(idx_row_ptr, k0, idx_next, TOPK, BLOCK_K: tl.constexpr, IDX_AHEAD: tl.constexpr):
    """(this block's index slots, the carried next ones). IDX_AHEAD (single-stage loops): the block loaded one
    iteration early is used and the next one loads during this block; idx_next starts as block 0's slots."""
    if IDX_AHEAD:
        return idx_next, _idx_block(idx_row_ptr, k0 + BLOCK_K, TOPK, BLOCK_K)
    return _idx_block(idx_row_ptr, k0, TOPK, BLOCK_K), idx_next


@triton.jit
def _key_rows(idx, I64: tl.constexpr):
    """(valid, key rows) of a block of indices: -1 slots point at row 0, for the caller to mask."""
    valid = idx >= 0
    rows = tl.where(valid, idx, 0)
    if I64:
        rows = rows.to(tl.int64)
    return valid, rows


@triton.jit
def _slot_count(idx_row_ptr, TOPK, TOPK_P2: tl.constexpr):
    """(span, number of valid slots) of an index row; span as in _slot_span(SKIP=True)."""
    offs = tl.arange(0, TOPK_P2)
    ix = tl.load(idx_row_ptr + offs, mask=offs < TOPK, other=-1)
    return tl.max(tl.where(ix >= 0, offs + 1, 0), 0), tl.sum((ix >= 0).to(tl.int32), 0)


@triton.jit
def _sfa_fwd_block(
    q1, q2, kb_base, vb_base, idx_ptr, k0, m_i, l_i, acc, sk_t, sv_t, TOPK, D, DV, qk_scale,
    D1: tl.constexpr, D2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_K: tl.constexpr,
    V_FROM_K: tl.constexpr, IEEE: tl.constexpr, I64: tl.constexpr, MASKED: tl.constexpr,
):
    """One key block of the online softmax: gather BLOCK_K selected rows, S = q k^T, update
    (m_i, l_i, acc). MASKED=False: every slot of the block is known valid (no -1 handling)."""
    offs_d1 = tl.arange(0, D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    if MASKED:
        valid, rows = _key_rows(_idx_block(idx_ptr, k0, TOPK, BLOCK_K), I64)
        k1 = tl.load(kb_base + rows[:, None] * sk_t + offs_d1[None, :], mask=valid[:, None], other=0.0)
    else:
        rows = tl.load(idx_ptr + k0 + tl.arange(0, BLOCK_K))
        if I64:
            rows = rows.to(tl.int64)
        k1 = tl.load(kb_base + rows[:, None] * sk_t + offs_d1[None, :])
    s = _mm(q1, tl.trans(k1), IEEE)
    if D2 > 0:
        offs_d2 = D1 + tl.arange(0, D2)
        if MASKED:
            k2 = tl.load(kb_base + rows[:, None] * sk_t + offs_d2[None, :],
                         mask=valid[:, None] & (offs_d2[None, :] < D), other=0.0)
        else:
            k2 = tl.load(kb_base + rows[:, None] * sk_t + offs_d2[None, :], mask=offs_d2[None, :] < D, other=0.0)
        s += _mm(q2, tl.trans(k2), IEEE)
    if MASKED:
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    else:
        s = s * qk_scale
    if V_FROM_K:
        v = k1
    elif MASKED:
        v = tl.load(vb_base + rows[:, None] * sv_t + offs_dv[None, :],
                    mask=valid[:, None] & (offs_dv[None, :] < DV), other=0.0)
    else:
        v = tl.load(vb_base + rows[:, None] * sv_t + offs_dv[None, :], mask=offs_dv[None, :] < DV, other=0.0)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = _mm(p.to(v.dtype), v, IEEE, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _sfa_fwd_kernel(
    Q, K, V, IDX, O, LSE,
    sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, si_t, si_h, so_t, so_h, sl_t,
    T, G, TOPK, D, DV, NHB, qk_scale,
    D1: tl.constexpr, D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    V_FROM_K: tl.constexpr, IEEE: tl.constexpr, I64: tl.constexpr,
    SKIP: tl.constexpr = False, REVERSE: tl.constexpr = False, TOPK_P2: tl.constexpr = 16,
    DENSE: tl.constexpr = False,
):
    row = _row_of_program(tl.num_programs(0), REVERSE)  # b * T + t
    hb = tl.program_id(1)
    g = hb // NHB
    h0 = (hb % NHB) * BLOCK_H
    b = row // T
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_h = offs_h < G
    heads = g * G + offs_h
    offs_d1 = tl.arange(0, D1)
    q_base = Q + row * sq_t + heads[:, None] * sq_h
    q1 = tl.load(q_base + offs_d1[None, :], mask=mask_h[:, None], other=0.0)
    if D2 > 0:
        offs_d2 = D1 + tl.arange(0, D2)
        q2 = tl.load(q_base + offs_d2[None, :], mask=mask_h[:, None] & (offs_d2[None, :] < D), other=0.0)
    else:
        q2 = q1
    offs_dv = tl.arange(0, BLOCK_DV)
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_DV], tl.float32)
    kb_base = K + b * sk_b + g * sk_h
    vb_base = V + b * sv_b + g * sv_h
    idx_ptr = IDX + row * si_t + g * si_h
    if DENSE:  # rows whose valid slots are exactly [0, span): unmasked full blocks, then the masked tail
        span, n_valid = _slot_count(idx_ptr, TOPK, TOPK_P2)
        full_end = tl.where(n_valid == span, (span // BLOCK_K) * BLOCK_K, 0)
        for k0 in tl.range(0, full_end, BLOCK_K):
            m_i, l_i, acc = _sfa_fwd_block(
                q1, q2, kb_base, vb_base, idx_ptr, k0, m_i, l_i, acc, sk_t, sv_t, TOPK, D, DV, qk_scale,
                D1, D2, BLOCK_DV, BLOCK_K, V_FROM_K, IEEE, I64, False)
        for k0 in range(full_end, span, BLOCK_K):
            m_i, l_i, acc = _sfa_fwd_block(
                q1, q2, kb_base, vb_base, idx_ptr, k0, m_i, l_i, acc, sk_t, sv_t, TOPK, D, DV, qk_scale,
                D1, D2, BLOCK_DV, BLOCK_K, V_FROM_K, IEEE, I64, True)
    else:
        span = _slot_span(idx_ptr, TOPK, SKIP, TOPK_P2)
        for k0 in tl.range(0, span, BLOCK_K):
            m_i, l_i, acc = _sfa_fwd_block(
                q1, q2, kb_base, vb_base, idx_ptr, k0, m_i, l_i, acc, sk_t, sv_t, TOPK, D, DV, qk_scale,
                D1, D2, BLOCK_DV, BLOCK_K, V_FROM_K, IEEE, I64, True)
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    o_ptr = O + row * so_t + heads[:, None] * so_h + offs_dv[None, :]
    tl.store(o_ptr, o.to(O.dtype.element_ty), mask=mask_h[:, None] & (offs_dv[None, :] < DV))
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + row * sl_t + heads, lse, mask=mask_h)


@triton.jit
def _mark_selected_kernel(IDX, SEL, LO, HI, si_t, ssel_t, TOPK, TK, BLOCK_I: tl.constexpr):
    """Per query row (program b * T + t): SEL[row, key] = 1 for each selected key (SEL zeroed by the caller), and
    the row's smallest / largest selected key in LO / HI (2^31 - 1 / -1 when it selects none). An index outside
    [0, TK) is not a key (never written outside the row)."""
    row = tl.program_id(0).to(tl.int64)
    lo = TOPK * 0 + 2147483647
    hi = TOPK * 0 - 1
    for i0 in range(0, TOPK, BLOCK_I):
        offs = i0 + tl.arange(0, BLOCK_I)
        ix = tl.load(IDX + row * si_t + offs, mask=offs < TOPK, other=-1).to(tl.int32)  # int32 or int64 indices
        ok = (ix >= 0) & (ix < TK)
        tl.store(SEL + row * ssel_t + tl.where(ok, ix, 0), tl.full([BLOCK_I], 1, tl.uint8), mask=ok)
        hi = tl.maximum(hi, tl.max(tl.where(ok, ix, -1)))
        lo = tl.minimum(lo, tl.min(tl.where(ok, ix, 2147483647)))
    tl.store(LO + row, lo)
    tl.store(HI + row, hi)


@triton.jit
def _tile_q(Q, b, col, row_ok, T, D, HQ: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr):
    """The dense-tile kernels' query rows: q[b] as [T * HQ, D] rows `col` (a tile's (query, head) pairs), split
    into the D1 and D2 channel parts (q2 = q1 when D2 = 0, unused)."""
    q_b = Q + b * T * HQ * D
    offs_d1 = tl.arange(0, D1)
    q1 = tl.load(q_b + col[:, None] * D + offs_d1[None, :], mask=row_ok[:, None], other=0.0)
    q2 = q1
    if D2 > 0:
        offs_d2 = D1 + tl.arange(0, D2)
        q2 = tl.load(q_b + col[:, None] * D + offs_d2[None, :], mask=row_ok[:, None] & (offs_d2[None, :] < D),
                     other=0.0)
    return q1, q2


@triton.jit
def _tile_scores(q1, q2, k_b, sel_rows, keys, row_ok, sk_t, TK, D, D1: tl.constexpr, D2: tl.constexpr,
                 IEEE: tl.constexpr):
    """One contiguous key tile of the dense-tile kernels: (its first D1 channels k1 [keys, D1], the unscaled scores
    S = q k^T [rows, keys] fp32, which pairs are selected [rows, keys] from the byte mask rows `sel_rows`)."""
    key_ok = keys < TK
    offs_d1 = tl.arange(0, D1)
    k1 = tl.load(k_b + keys[:, None] * sk_t + offs_d1[None, :], mask=key_ok[:, None], other=0.0)
    s = _mm(q1, tl.trans(k1), IEEE)
    if D2 > 0:
        offs_d2 = D1 + tl.arange(0, D2)
        k2 = tl.load(k_b + keys[:, None] * sk_t + offs_d2[None, :], mask=key_ok[:, None] & (offs_d2[None, :] < D),
                     other=0.0)
        s = _mm(q2, tl.trans(k2), IEEE, s)
    sel = tl.load(sel_rows + keys[None, :], mask=row_ok[:, None] & key_ok[None, :], other=0) != 0
    return k1, s, sel


@triton.jit
def _sfa_fwd_tiles_kernel(
    Q, K, SEL, LO, HI, O, LSE,
    sk_b, sk_t, ssel_t, T, TK, D, DV, NQB, qk_scale,
    HQ: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KEYS: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Forward on dense tiles (one KV head, v = k[..., :DV]): per (block of BLOCK_M / HQ queries, batch row) the
    MMA's M is the block's (query, head) pairs, which share every key, and the keys are walked as contiguous
    BLOCK_KEYS tiles from the block's smallest to its largest selected key; a pair's unselected keys are masked
    by SEL ([B * T, TK] bytes). It does the tile's unselected pairs too, so it pays where the selection is dense
    (DENSE_FWD_CONFIG), and needs no gather. q, o are [B * T * HQ, D / DV] rows, lse [B * T * HQ]."""
    qb = NQB - 1 - tl.program_id(0)  # the last (widest) query blocks first
    b = tl.program_id(1).to(tl.int64)
    col = qb * BLOCK_M + tl.arange(0, BLOCK_M)  # t * HQ + h
    t = col // HQ
    row_ok = t < T
    brow = b * T + tl.where(row_ok, t, 0)  # b * T + t
    lo = tl.min(tl.load(LO + brow, mask=row_ok, other=2147483647))
    hi = tl.max(tl.load(HI + brow, mask=row_ok, other=-1))
    q1, q2 = _tile_q(Q, b, col, row_ok, T, D, HQ, D1, D2)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D1], tl.float32)
    k_b = K + b * sk_b
    sel_rows = SEL + brow[:, None] * ssel_t
    for kb in tl.range(lo // BLOCK_KEYS, hi // BLOCK_KEYS + 1):  # no selected key (hi = -1): no iteration
        k1, s, sel = _tile_scores(q1, q2, k_b, sel_rows, kb * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS), row_ok,
                                  sk_t, TK, D, D1, D2, IEEE)
        s = tl.where(sel, s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = _mm(p.to(k1.dtype), k1, IEEE, acc * alpha[:, None])  # v = k[..., :DV], DV = D1
        m_i = m_new
    has = l_i > 0
    o = acc / tl.where(has, l_i, 1.0)[:, None]
    tl.store(O + b * T * HQ * DV + col[:, None] * DV + tl.arange(0, D1)[None, :], o.to(O.dtype.element_ty),
             mask=row_ok[:, None])
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * 0.6931471805599453, float("-inf"))
    tl.store(LSE + b * T * HQ + col, lse, mask=row_ok)


@triton.jit(do_not_specialize=["ROW0", "NROWS"])
def _sfa_bwd_pds_kernel(
    Q, K, V, IDX, O, DO, LSE, P_, DS_,
    sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, si_t, si_h, so_t, so_h, sl_t, sp_t, sp_h,
    T, G, TOPK, D, DV, NHB, ROW0, NROWS, qk_scale, scale,
    FLAGS, spd_row, spd_key, NQB, NKB,
    D1: tl.constexpr, D2: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    V_FROM_K: tl.constexpr, IEEE: tl.constexpr, I64: tl.constexpr,
    SKIP: tl.constexpr, REVERSE: tl.constexpr, TOPK_P2: tl.constexpr, IDX_AHEAD: tl.constexpr,
    DENSE_OUT: tl.constexpr = False, FQ: tl.constexpr = 1, FK: tl.constexpr = 1, EVEN_H: tl.constexpr = False,
):
    """Backward pass 1 of the P/dS path: per (query, head block) recompute P from lse and
    dS = P (dO V^T - delta) * scale over the selected keys and store both ([rows, HQ, TOPK],
    q's dtype) for this chunk of rows. No accumulator: registers hold only [BLOCK_H, BLOCK_K] tiles.
    Grid (HK * NHB, rows): the head blocks of one query run next to each other (same key rows).
    DENSE_OUT (one KV head): P and dS go to their key's place instead of their slot's ([B, Tk, T, HQ] with
    strides spd_row (batch) and spd_key, zeroed by the caller; a row's indices are distinct), and
    FLAGS[b, t // FQ, key // FK] = 1 marks the (query block, key block) tiles that hold a selected pair, for the
    dense pass 2 to skip the others."""
    local = tl.program_id(1).to(tl.int64)
    if REVERSE:
        local = NROWS - 1 - local
    row = ROW0 + local
    g = tl.program_id(0) // NHB
    h0 = (tl.program_id(0) % NHB) * BLOCK_H
    b = row // T
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_h = offs_h < G
    heads = g * G + offs_h
    offs_d1 = tl.arange(0, D1)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_dv = offs_dv < DV
    q_base = Q + row * sq_t + heads[:, None] * sq_h
    q1 = tl.load(q_base + offs_d1[None, :], mask=mask_h[:, None], other=0.0)
    if D2 > 0:
        offs_d2 = D1 + tl.arange(0, D2)
        mask_d2 = offs_d2 < D
        q2 = tl.load(q_base + offs_d2[None, :], mask=mask_h[:, None] & mask_d2[None, :], other=0.0)
    do = tl.load(DO + row * so_t + heads[:, None] * so_h + offs_dv[None, :],
                 mask=mask_h[:, None] & mask_dv[None, :], other=0.0)
    o = tl.load(O + row * so_t + heads[:, None] * so_h + offs_dv[None, :],
                mask=mask_h[:, None] & mask_dv[None, :], other=0.0)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)
    lse2 = tl.load(LSE + row * sl_t + heads, mask=mask_h, other=0.0) * 1.4426950408889634
    kb_base = K + b * sk_b + g * sk_h
    vb_base = V + b * sv_b + g * sv_h
    p_base = P_ + local * sp_t + heads[:, None] * sp_h
    ds_base = DS_ + local * sp_t + heads[:, None] * sp_h
    idx_row = IDX + row * si_t + g * si_h
    span = _slot_span(idx_row, TOPK, SKIP, TOPK_P2)
    idx_next = _idx_block(idx_row, 0, TOPK, BLOCK_K)  # used only with IDX_AHEAD
    for k0 in range(0, span, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx, idx_next = _idx_walk(idx_row, k0, idx_next, TOPK, BLOCK_K, IDX_AHEAD)
        valid, rows = _key_rows(idx, I64)
        k1 = tl.load(kb_base + rows[:, None] * sk_t + offs_d1[None, :], mask=valid[:, None], other=0.0)
        s = _mm(q1, tl.trans(k1), IEEE)
        if D2 > 0:
            k2 = tl.load(kb_base + rows[:, None] * sk_t + offs_d2[None, :],
                         mask=valid[:, None] & mask_d2[None, :], other=0.0)
            s = _mm(q2, tl.trans(k2), IEEE, s)
        p = tl.exp2(s * qk_scale - lse2[:, None])
        p = tl.where(valid[None, :] & mask_h[:, None], p, 0.0)
        if V_FROM_K:
            v = k1
        else:
            v = tl.load(vb_base + rows[:, None] * sv_t + offs_dv[None, :],
                        mask=valid[:, None] & mask_dv[None, :], other=0.0)
        dp = _mm(do, tl.trans(v), IEEE)
        ds = p * (dp - delta[:, None]) * scale
        if DENSE_OUT:
            # [keys, heads] tiles: a (query, key) pair's heads are contiguous in the dense layout (vector stores)
            t = row - b * T
            dptr = b * spd_row + rows[:, None] * spd_key + t * G + heads[None, :]
            st_mask = valid[:, None] & (mask_h[None, :] | EVEN_H)  # EVEN_H: no head mask (vector stores)
            tl.store(P_ + dptr, tl.trans(p).to(P_.dtype.element_ty), mask=st_mask)
            tl.store(DS_ + dptr, tl.trans(ds).to(DS_.dtype.element_ty), mask=st_mask)
            tl.store(FLAGS + ((b * NQB + t // FQ) * NKB + rows // FK), 1, mask=valid)
        else:
            st_mask = mask_h[:, None] & (offs_k < TOPK)[None, :]
            tl.store(p_base + offs_k[None, :], p.to(P_.dtype.element_ty), mask=st_mask)
            tl.store(ds_base + offs_k[None, :], ds.to(DS_.dtype.element_ty), mask=st_mask)


@triton.jit
def _sfa_bwd_pds_tiles_kernel(
    Q, K, O, DO, LSE, SEL, LO, HI, P_, DS_, FLAGS,
    sk_b, sk_t, ssel_t, spd_b, spd_key, T, TK, D, NQB, NKB, qk_scale, scale,
    HQ: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_KEYS: tl.constexpr,
    FQ: tl.constexpr, FK: tl.constexpr, IEEE: tl.constexpr,
):
    """Pass 1 of the dense backward on dense tiles (one KV head, v = k[..., :DV], DV = D1): per (BLOCK_M of the
    (query, head) columns, batch row) P = exp(S - lse) on the selected pairs (0 elsewhere) and
    dS = P (dO V^T - delta) * scale over contiguous BLOCK_KEYS key tiles, stored as [keys, columns] tiles of the
    dense buffers ([B, Tk, T * HQ] padded to whole FQ-query x FK-key tiles). It walks every key tile from the
    smallest to the largest selected key of its FQ-query block, so each tile the dense pass 2 may read is written
    whole (the buffers need no zeroing), and flags the tiles that hold a selected pair. BLOCK_M divides FQ * HQ,
    BLOCK_KEYS divides FK."""
    pid = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    col = pid * BLOCK_M + tl.arange(0, BLOCK_M)  # t * HQ + h, < NQB * FQ * HQ (the padded width)
    t = col // HQ
    row_ok = t < T
    brow = b * T + tl.where(row_ok, t, 0)
    qb = (pid * BLOCK_M) // (FQ * HQ)  # the dense buffers' query block
    tq = qb * FQ + tl.arange(0, FQ)
    lo = tl.min(tl.load(LO + b * T + tq, mask=tq < T, other=2147483647))
    hi = tl.max(tl.load(HI + b * T + tq, mask=tq < T, other=-1))
    q1, q2 = _tile_q(Q, b, col, row_ok, T, D, HQ, D1, D2)
    o_off = b * T * HQ * D1 + col[:, None] * D1 + tl.arange(0, D1)[None, :]
    do = tl.load(DO + o_off, mask=row_ok[:, None], other=0.0)
    delta = tl.sum(do.to(tl.float32) * tl.load(O + o_off, mask=row_ok[:, None], other=0.0).to(tl.float32), 1)
    lse2 = tl.load(LSE + b * T * HQ + col, mask=row_ok, other=0.0) * 1.4426950408889634
    k_b = K + b * sk_b
    sel_rows = SEL + brow[:, None] * ssel_t
    for k0 in range((lo // FK) * FK, (hi // FK + 1) * FK, BLOCK_KEYS):  # no selected key: no iteration
        keys = k0 + tl.arange(0, BLOCK_KEYS)
        k1, s, sel = _tile_scores(q1, q2, k_b, sel_rows, keys, row_ok, sk_t, TK, D, D1, D2, IEEE)
        p = tl.where(sel, tl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        ds = p * (_mm(do, tl.trans(k1), IEEE) - delta[:, None]) * scale
        off = b * spd_b + keys[:, None].to(tl.int64) * spd_key + col[None, :]  # inside the padded buffers
        tl.store(P_ + off, tl.trans(p).to(P_.dtype.element_ty))
        tl.store(DS_ + off, tl.trans(ds).to(DS_.dtype.element_ty))
        if tl.max(sel.to(tl.int32)) > 0:
            tl.store(FLAGS + (b * NQB + qb) * NKB + k0 // FK, 1)


@triton.jit(do_not_specialize=["ROW0", "NROWS"])
def _sfa_bwd_from_pds_kernel(
    Q, K, IDX, DO, P_, DS_, DQ, DK, DV_,
    sq_t, sq_h, sk_b, sk_t, sk_h, si_t, si_h, so_t, so_h, sp_t, sp_h,
    sdk_b, sdk_t, sdk_h, sdv_b, sdv_t, sdv_h,
    T, G, TOPK, D, DV, NHB, NC, ROW0, NROWS,
    BLOCK_C: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
    V_FROM_K: tl.constexpr, IEEE: tl.constexpr, I64: tl.constexpr,
    SKIP: tl.constexpr, REVERSE: tl.constexpr, TOPK_P2: tl.constexpr, IDX_AHEAD: tl.constexpr,
    EXTENT_BK: tl.constexpr, CHANNEL_MAJOR: tl.constexpr,
):
    """Backward pass 2 of the P/dS path: per (query, head block, chunk of BLOCK_C channels)
    dq[:, c] = dS K_sel[:, c] (accumulator [BLOCK_H, BLOCK_C]) and dk[sel, c] += dS^T q[:, c],
    dv[sel, c] += P^T dO[:, c] (one fp32 atomic per element when v = k[..., :DV]).
    Reads P and dS from pass 1; nothing is recomputed, every operand tile is small.
    Grid (HK * NHB * NC, rows): the channel chunks of one query run next to each other, so
    its P / dS tiles are read from L2 after the first chunk. CHANNEL_MAJOR, grid (rows, HK * NHB * NC):
    every row of one channel chunk runs before the next chunk, so the atomics hit one chunk's slice of
    dk (keys x BLOCK_C fp32) instead of all of it; each chunk then reads the P / dS tiles again."""
    if CHANNEL_MAJOR:
        local = tl.program_id(0).to(tl.int64)
        pid1 = tl.program_id(1)
    else:
        local = tl.program_id(1).to(tl.int64)
        pid1 = tl.program_id(0)
    if REVERSE:
        local = NROWS - 1 - local
    row = ROW0 + local
    c = pid1 % NC
    g = pid1 // (NC * NHB)
    h0 = ((pid1 // NC) % NHB) * BLOCK_H
    b = row // T
    offs_h = h0 + tl.arange(0, BLOCK_H)
    mask_h = offs_h < G
    heads = g * G + offs_h
    offs_c = c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_ck = offs_c < D
    mask_cv = offs_c < DV
    qc = tl.load(Q + row * sq_t + heads[:, None] * sq_h + offs_c[None, :],
                 mask=mask_h[:, None] & mask_ck[None, :], other=0.0)
    doc = tl.load(DO + row * so_t + heads[:, None] * so_h + offs_c[None, :],
                  mask=mask_h[:, None] & mask_cv[None, :], other=0.0)
    dq = tl.zeros([BLOCK_H, BLOCK_C], tl.float32)
    kb_base = K + b * sk_b + g * sk_h
    dkb_base = DK + b * sdk_b + g * sdk_h
    dvb_base = DV_ + b * sdv_b + g * sdv_h
    p_base = P_ + local * sp_t + heads[:, None] * sp_h
    ds_base = DS_ + local * sp_t + heads[:, None] * sp_h
    idx_row = IDX + row * si_t + g * si_h
    span = _slot_span(idx_row, TOPK, SKIP, TOPK_P2)
    idx_next = _idx_block(idx_row, 0, TOPK, BLOCK_K)  # used only with IDX_AHEAD
    for k0 in range(0, span, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        idx, idx_next = _idx_walk(idx_row, k0, idx_next, TOPK, BLOCK_K, IDX_AHEAD)
        valid, rows = _key_rows(idx, I64)
        # only slots pass 1 wrote: with SKIP it stops at its own BLOCK_K multiple past the row's last
        # valid slot, so a larger BLOCK_K here would read unwritten (garbage, possibly NaN) entries; the
        # bound [0, its last block's end) is a scalar per row (a per-slot validity mask tied every load to
        # the index load and was 15-21% slower)
        ld_mask = mask_h[:, None] & (offs_k < tl.minimum(TOPK, tl.cdiv(span, EXTENT_BK) * EXTENT_BK))[None, :]
        p = tl.load(p_base + offs_k[None, :], mask=ld_mask, other=0.0)
        ds = tl.load(ds_base + offs_k[None, :], mask=ld_mask, other=0.0)
        kc = tl.load(kb_base + rows[:, None] * sk_t + offs_c[None, :], mask=valid[:, None] & mask_ck[None, :],
                     other=0.0)
        dq = _mm(ds, kc, IEEE, dq)
        if V_FROM_K:
            dkv = _mm(tl.trans(p), doc, IEEE)
            dkv = _mm(tl.trans(ds), qc, IEEE, dkv)
            _scatter_add(dkb_base + rows[:, None] * sdk_t + offs_c[None, :], dkv,
                         valid[:, None] & mask_ck[None, :])
        else:
            dk = _mm(tl.trans(ds), qc, IEEE)
            _scatter_add(dkb_base + rows[:, None] * sdk_t + offs_c[None, :], dk,
                         valid[:, None] & mask_ck[None, :])
            dv = _mm(tl.trans(p), doc, IEEE)
            _scatter_add(dvb_base + rows[:, None] * sdv_t + offs_c[None, :], dv,
                         valid[:, None] & mask_cv[None, :])
    tl.store(DQ + row * sq_t + heads[:, None] * sq_h + offs_c[None, :], dq.to(DQ.dtype.element_ty),
             mask=mask_h[:, None] & mask_ck[None, :])


@triton.jit
def _sfa_bwd_dense_dk_kernel(
    Q, DO, P_, DS_, FLAGS, DK,
    spd_b, spd_key, sdk_b, sdk_t,
    T, TK, D, DV, NQB, NKB, NC, SEG,
    HQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KEYS: tl.constexpr, BLOCK_C: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Dense pass 2, dk (one KV head, v = k[..., :DV]): per (key block, channel chunk, segment of SEG query
    blocks, batch row) dk[keys, c] += dS^T q[:, c] + P^T dO[:, c] over the flagged (query block, key block)
    tiles of pass 1's dense P / dS ([B, Tk, T * HQ] zero-padded to whole tiles: a tile is a 2-D block, each
    key's row contiguous, loaded without masks). The MMA's K is the tile's BLOCK_Q x HQ (query, head) pairs,
    so the pairs sharing a key are summed in registers and each program adds its [BLOCK_KEYS, BLOCK_C] tile
    to dk once (the slot pass 2 adds one row per selected pair). q and dO are read as [T * HQ, D] rows (contiguous). Offsets are int32 within a batch row and formed
    per tile from the loop's query block (nothing tile-sized stays live across the loop). Grid (NKB * NC,
    segments, B): the channel chunks of a key block run side by side and share its P / dS tiles through L2."""
    pid = tl.program_id(0)
    c = pid % NC
    kb = pid // NC
    seg = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    M: tl.constexpr = BLOCK_Q * HQ
    p_b = P_ + b * spd_b
    ds_b = DS_ + b * spd_b
    q_b = Q + b * T * HQ * D
    do_b = DO + b * T * HQ * DV
    keys = kb * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
    mask_key = keys < TK
    offs_c = c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_ck = offs_c < D
    mask_cv = offs_c < DV
    j = tl.arange(0, M)
    acc = tl.zeros([BLOCK_KEYS, BLOCK_C], tl.float32)
    touched = 0
    for qb in range(seg * SEG, tl.minimum(seg * SEG + SEG, NQB)):
        if tl.load(FLAGS + (b * NQB + qb) * NKB + kb) != 0:
            touched += 1
            col = qb * M + j  # t * HQ + h
            mask_col = col < T * HQ
            pd = keys[:, None] * spd_key + col[None, :]  # inside the zero-padded buffer: no mask
            qc = tl.load(q_b + col[:, None] * D + offs_c[None, :], mask=mask_col[:, None] & mask_ck[None, :],
                         other=0.0)
            acc = _mm(tl.load(ds_b + pd), qc, IEEE, acc)
            if c * BLOCK_C < DV:
                doc = tl.load(do_b + col[:, None] * DV + offs_c[None, :], mask=mask_col[:, None] & mask_cv[None, :],
                              other=0.0)
                acc = _mm(tl.load(p_b + pd), doc, IEEE, acc)
    if touched > 0:
        _scatter_add(DK + b * sdk_b + keys[:, None] * sdk_t + offs_c[None, :], acc,
                     mask_key[:, None] & mask_ck[None, :])


@triton.jit
def _sfa_bwd_dense_dq_kernel(
    K, DS_, FLAGS, DQ,
    sk_b, sk_t, spd_b, spd_key,
    T, TK, D, NQB, NKB, NC,
    HQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KEYS: tl.constexpr, BLOCK_C: tl.constexpr,
    IEEE: tl.constexpr,
):
    """Dense pass 2, dq: per (query block, channel chunk, batch row) dq[:, c] = dS K[:, c] over the flagged key
    blocks: dS as a transposed [BLOCK_Q x HQ, BLOCK_KEYS] tile, K as contiguous key tiles (no gather);
    accumulator [BLOCK_Q x HQ, BLOCK_C] fp32, stored once."""
    pid = tl.program_id(0)
    c = pid % NC
    qb = pid // NC
    b = tl.program_id(1).to(tl.int64)
    M: tl.constexpr = BLOCK_Q * HQ
    ds_b = DS_ + b * spd_b
    k_b = K + b * sk_b
    col = qb * M + tl.arange(0, M)
    mask_col = col < T * HQ
    offs_c = c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_ck = offs_c < D
    acc = tl.zeros([M, BLOCK_C], tl.float32)
    for kb in range(0, NKB):
        if tl.load(FLAGS + (b * NQB + qb) * NKB + kb) != 0:
            keys = kb * BLOCK_KEYS + tl.arange(0, BLOCK_KEYS)
            mask_key = keys < TK
            ds = tl.load(ds_b + keys[None, :] * spd_key + col[:, None])  # inside the zero-padded buffer
            kc = tl.load(k_b + keys[:, None] * sk_t + offs_c[None, :], mask=mask_key[:, None] & mask_ck[None, :],
                         other=0.0)
            acc = _mm(ds, kc, IEEE, acc)
    tl.store(DQ + b * T * HQ * D + col[:, None] * D + offs_c[None, :], acc.to(DQ.dtype.element_ty),
             mask=mask_col[:, None] & mask_ck[None, :])


@triton.jit
def _zero_touched_tiles_kernel(
    IDX, P_, DS_, si_t, spd_b, spd_key, T, TOPK,
    HQ: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_KEYS: tl.constexpr, BLOCK_I: tl.constexpr,
):
    """Zero the tiles of the dense P / dS buffers that pass 1 may write into, before it runs: per (query block,
    batch row), the key blocks from the block's smallest to its largest selected key. That range holds every
    tile pass 1 flags (a superset: a key block inside it that no row selects is zeroed but never read), and
    with causal selections it leaves the upper triangle (about half the buffer) unwritten. Grid (NQB, B)."""
    qb = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    lo = TOPK * 0 + 2147483647
    hi = TOPK * 0 - 1
    for r in range(BLOCK_Q):
        t = qb * BLOCK_Q + r
        if t < T:
            for i0 in range(0, TOPK, BLOCK_I):
                offs = i0 + tl.arange(0, BLOCK_I)
                ix = tl.load(IDX + (b * T + t) * si_t + offs, mask=offs < TOPK, other=-1)
                hi = tl.maximum(hi, tl.max(ix))
                lo = tl.minimum(lo, tl.min(tl.where(ix >= 0, ix, 2147483647)))
    M: tl.constexpr = BLOCK_Q * HQ
    cols = qb * M + tl.arange(0, M)
    keys = tl.arange(0, BLOCK_KEYS)
    zero = tl.zeros([BLOCK_KEYS, M], P_.dtype.element_ty)
    for kb in range(lo // BLOCK_KEYS, hi // BLOCK_KEYS + 1):  # no valid key (hi = -1): no iteration
        off = b * spd_b + (kb * BLOCK_KEYS + keys)[:, None].to(tl.int64) * spd_key + cols[None, :]
        tl.store(P_ + off, zero)
        tl.store(DS_ + off, zero)


# Launch configuration, from the sweeps of benchmarks/bench_dsa.py on an H200 (read-only: pass a changed copy).
# Forward: BLOCK_H 64 query heads as the MMA's M (wgmma), 64-key blocks, 8 warps, 2 stages; DENSE took it from
# 291-295 to 294-297 TFLOP/s at T = 32768 (the Gluon kernel replaces it where it applies).
FWD_CONFIG = {"BLOCK_H": 64, "BLOCK_K": 64, "num_warps": 8, "num_stages": 2, "SKIP": True, "REVERSE": True,
              "DENSE": True}
# Forward on dense tiles (`_sfa_fwd_tiles_kernel`): one KV head with v = k[..., :DV] (MLA), a power-of-two number
# of query heads up to MAX_HEADS (BLOCK_M / HQ queries a tile share its keys: the MMA's M is 64 even at 16 heads,
# where the gathering forward's is 16), the selection mask ([B * T, Tk] bytes) within MASK_BYTES, and the selected
# pairs at least MIN_DENSITY of the causal ones (a tile computes its unselected pairs too). AUTO: the default
# forward (cfg=None) takes it where it applies; an explicit cfg with TILES always does.
DENSE_FWD_CONFIG = {"TILES": True, "AUTO": True, "MAX_HEADS": 32, "MASK_BYTES": 2**27, "MIN_DENSITY": 0.7,
                    "BLOCK_M": 64, "BLOCK_KEYS": 64, "num_warps": 8, "num_stages": 2}
# Dense pass 2 (one KV head, v = k[..., :DV], P and dS for all rows within BYTES): pass 1 writes P / dS at their
# key's place in [B * T, Tk, HQ] and flags the touched (BLOCK_Q queries, BLOCK_KEYS keys) tiles; dk sums over a
# tile's (query, head) pairs in the MMA (programs of SEG query blocks, one atomic tile each), dq reads K as
# contiguous tiles. It replaces the slot pass 2, whose one dk row per selected pair bounds it at few heads.
# ZERO_TOUCHED: zero only the tiles pass 1 may write (`_zero_touched_tiles_kernel`, about half the 2 GiB buffer at
# seq 4096 x 2) instead of the whole buffer: on an H100 the `small` step's fills drop by 2.6 ms and the DSA family
# grows by 1.6 ms (LoRA step 176.9 -> 176.0 ms, full FT 219.4 -> 218.9, benchmarks/RESULTS.md run 10).
# P1_TILES (a launch config, or None: the gathering pass 1): pass 1 on dense tiles, `_sfa_bwd_pds_tiles_kernel`
# (BLOCK_M (query, head) columns x BLOCK_KEYS keys), which writes every tile it walks whole, so nothing is zeroed.
# Off until it has run on a GPU (the interpreter test runs it; tests/gpu/test_dsa_gpu.py has a case).
DENSE_PDS_CONFIG = {"BYTES": 2**31, "MAX_HEADS": 32, "BLOCK_Q": 8, "BLOCK_KEYS": 64, "SEG": 16, "ZERO_TOUCHED": True,
                    "P1_TILES": None,
                    "DK_CFG": {"BLOCK_C": 128, "num_warps": 4, "num_stages": 1},
                    "DQ_CFG": {"BLOCK_C": 128, "num_warps": 8, "num_stages": 1}}
# Backward: pass 1 stores P and dS (bf16, <= PDS_BYTES of rows at a time); pass 2 reads them back per
# 128-channel chunk (64 at 64-head blocks: 576 = 9 x 64, -8% at HQ = 64; at 128-head blocks they lose 20%).
# Pass 1 at head blocks of 16 / 32 (the Gluon pass 1 needs 64): 64-key blocks, 2.34 / 4.89 ms vs 3.08 / 9.66 with
# 32 (B = 2, T = 4096, HQ = 16 / 32: the whole backward 1.06x / 1.27x). Pass 2 with BLOCK_H = 128 (64 when G = 64):
# half the atomics and K reads of 64; 4 warps 197.9 / 108.9 ms vs 205.0 / 133.6 with 8 (T = 32768, HQ = 128 / 64;
# at 128 heads it spills 248 B and is still the fastest).
BWD_CONFIG = {
    "SKIP": True, "REVERSE": True, "PDS_BYTES": 2**30,
    "PDS_CFG": {"BLOCK_H": 64, "BLOCK_K": 32, "BLOCK_K_H32": 64, "num_warps": 4, "num_stages": 2},
    "APPLY_CFG": {"BLOCK_H": 128, "BLOCK_K": 64, "BLOCK_C": 128, "BLOCK_C_H64": 64, "num_warps": 4, "num_stages": 3,
                  "CHANNEL_MAJOR": "auto"},
    "DENSE": DENSE_PDS_CONFIG,
}
_POISON_PDS = False  # tests set True: fill the P/dS buffer with NaN before pass 1
MAX_SKIP_TOPK = 8192  # SKIP reads the index row into registers: cap its length


def _split_d(D: int) -> tuple[int, int]:
    """D = D1 (largest power of two, >= 16) + tail padded to a power of two >= 16 (masked)."""
    d1 = 1 << (D.bit_length() - 1)
    rest = D - d1
    return d1, (max(16, triton.next_power_of_2(rest)) if rest else 0)


def _v_from_k(k: torch.Tensor, v: torch.Tensor, d1: int) -> bool:
    return (
        v.shape[-1] == d1 and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
        and k.stride(-1) == 1 and k.requires_grad == v.requires_grad
    )


def _prep(q, k, v, d1, v_from_k=None):
    """Unit-stride last dims; v = k[..., :D1] (read once, dv folded into dk) when v is None or v_from_k, or with
    v_from_k=None when v is detected as that view."""
    q = q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    if v is None or v_from_k:
        return q, k, k[..., :d1], True
    vk = _v_from_k(k, v, d1) if v_from_k is None else False
    v = v if (vk or v.stride(-1) == 1) else v.contiguous()
    return q, k, v, vk


def _common(q, k, v, indices):
    B, T, HQ, D = q.shape
    HK, DV = k.shape[2], (v.shape[-1] if v is not None else _split_d(D)[0])
    G = HQ // HK
    idx = indices.contiguous()
    idx = idx if idx.dim() == 4 else idx[:, :, None, :]
    si_h = idx.stride(2) if indices.dim() == 4 else 0
    d1, d2 = _split_d(D)
    return B, T, HQ, HK, G, D, DV, idx, si_h, d1, d2


def _launch_args(cfg, G, HK, B, T):
    bh = min(cfg["BLOCK_H"], max(16, triton.next_power_of_2(G)))
    nhb = triton.cdiv(G, bh)
    return bh, nhb, (B * T, HK * nhb)


def _walk_args(cfg, topk):
    tp2 = max(16, triton.next_power_of_2(topk))
    skip = bool(cfg.get("SKIP", False)) and tp2 <= MAX_SKIP_TOPK
    return dict(SKIP=skip, REVERSE=bool(cfg.get("REVERSE", False)), TOPK_P2=tp2 if skip else 16)


def _gluon_module(q, k, v, indices, gluon: bool = True):
    """gluon_sparse_attn (the warp-specialised forward and backward pass 1) when it applies: `gluon`, sm_90, bf16,
    the MLA shape (D = 576, v = k[..., :512], one KV head, heads a multiple of 64)."""
    if not gluon or not q.is_cuda:
        return None
    try:
        from . import gluon_sparse_attn
    except ImportError:  # a Triton without Gluon
        return None
    return gluon_sparse_attn if gluon_sparse_attn.supported(q, k, v, indices) else None


def sfa_forward(q, k, v, indices, scale, cfg=None, gluon: bool = True, v_from_k: bool | None = None):
    """o, lse of sparse attention. cfg=None: the Gluon kernel where it applies (H200, T = 32768: 388-398 vs
    294-297 TFLOP/s for this one), else the dense-tile kernel where DENSE_FWD_CONFIG applies (with AUTO), else
    FWD_CONFIG; an explicit cfg always runs the Triton kernel it names (with TILES: the dense-tile one).
    v=None or v_from_k=True: v is k[..., :D1] (MLA's shared latent); v_from_k=None: detected (`_v_from_k`)."""
    B, T, HQ, HK, G, D, DV, idx, si_h, d1, d2 = _common(q, k, v, indices)
    v_sel = k[..., :d1] if (v is None or v_from_k) else v
    if cfg is None and (v_from_k is not False) and (gws := _gluon_module(q, k, v_sel, indices, gluon)) is not None:
        return gws.sfa_forward_ws(q, k, indices, scale)
    q, k, v, vk = _prep(q, k, v, d1, v_from_k)
    if not cfg:  # dense tiles where they apply and pay (2-byte dtypes: the tiles are sized for them)
        tiles = (DENSE_FWD_CONFIG["AUTO"] and q.element_size() == 2
                 and _tiles_apply(DENSE_FWD_CONFIG, B, T, k.shape[1], HQ, HK, idx.shape[-1], vk, DV, d1))
        cfg = DENSE_FWD_CONFIG if tiles else FWD_CONFIG
    elif cfg.get("TILES") and not _tiles_apply(cfg, B, T, k.shape[1], HQ, HK, idx.shape[-1], vk, DV, d1):
        raise ValueError("the dense-tile forward (fwd_cfg with TILES) needs one KV head with v = k[..., :DV], "
                         f"a power-of-two number of query heads <= {cfg['MAX_HEADS']}, Tk = T and a selection "
                         f"at least MIN_DENSITY dense; got HK = {HK}, HQ = {HQ}, v from k: {vk}, T = {T}, "
                         f"Tk = {k.shape[1]}, topk = {idx.shape[-1]}")
    if cfg.get("TILES"):
        return _forward_tiles(q, k, idx, scale, cfg, B, T, HQ, D, d1, d2)
    o = torch.empty(B, T, HQ, DV, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    bh, nhb, grid = _launch_args(cfg, G, HK, B, T)
    walk = _walk_args(cfg, idx.shape[-1])
    _sfa_fwd_kernel[grid](
        q, k, v, idx, o, lse,
        q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        idx.stride(1), si_h, o.stride(1), o.stride(2), lse.stride(1),
        T, G, idx.shape[-1], D, DV, nhb, scale * LOG2E,
        D1=d1, D2=d2, BLOCK_DV=max(16, triton.next_power_of_2(DV)), BLOCK_H=bh, BLOCK_K=cfg["BLOCK_K"],
        V_FROM_K=vk, IEEE=use_ieee(q), I64=max(T, k.shape[1]) * max(k.stride(1), v.stride(1), D) >= 2**31,
        DENSE=bool(cfg.get("DENSE", False)) and walk["SKIP"],  # DENSE counts the valid slots of the read row
        **walk,
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, lse


def _tiles_apply(cfg, B, T, Tk, HQ, HK, topk, vk, dv, d1) -> bool:
    """Whether the dense-tile forward (DENSE_FWD_CONFIG's conditions, cfg a copy of it) can run this call and
    is expected to pay: the selected pairs (each query's min(t + 1, topk) keys) over the causal ones. Queries of
    a longer key sequence (Tk > T, context parallelism) sit at positions this estimate does not know (a local
    block near the end walks ~Tk keys a query for topk selected ones), so they take the gathering forward."""
    if HK != 1 or not vk or dv != d1 or HQ & (HQ - 1) or HQ > cfg["MAX_HEADS"] or HQ > cfg["BLOCK_M"] or Tk != T:
        return False
    if B * T * Tk > cfg["MASK_BYTES"]:
        return False
    n = min(T, topk)
    return (n * (n + 1) // 2 + (T - n) * topk) >= cfg["MIN_DENSITY"] * T * (T + 1) // 2


def _forward_tiles(q, k, idx, scale, cfg, B, T, HQ, D, d1, d2):
    """o, lse by `_sfa_fwd_tiles_kernel`: marks each row's selected keys in a byte mask first."""
    Tk = k.shape[1]
    sel, lo, hi = _mark_selected(idx, B, T, Tk)
    o = torch.empty(B, T, HQ, d1, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    nqb = triton.cdiv(T * HQ, cfg["BLOCK_M"])
    _sfa_fwd_tiles_kernel[(nqb, B)](
        q, k, sel, lo, hi, o, lse, k.stride(0), k.stride(1), sel.stride(0), T, Tk, D, d1, nqb, scale * LOG2E,
        HQ=HQ, D1=d1, D2=d2, BLOCK_M=cfg["BLOCK_M"], BLOCK_KEYS=cfg["BLOCK_KEYS"], IEEE=use_ieee(q),
        num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, lse


def sfa_backward(q, k, v, indices, o, lse, do, scale, cfg=None, gluon: bool = True, v_from_k: bool | None = None):
    """dq, dk, dv (None when v = k[..., :DV]) by the two-pass P/dS backward; cfg: BWD_CONFIG or a changed copy;
    gluon: pass 1 by the Gluon kernel where it applies; v / v_from_k as for sfa_forward."""
    cfg = cfg or BWD_CONFIG
    B, T, HQ, HK, G, D, DV, idx, si_h, d1, d2 = _common(q, k, v, indices)
    q, k, v, vk = _prep(q, k, v, d1, v_from_k)
    do = do.contiguous()
    o = o.contiguous()  # same layout as do: the kernel reads both with do's strides
    dq = torch.empty_like(q)
    Tk = k.shape[1]  # keys may be a longer sequence than the queries (context parallelism)
    dk = torch.zeros(B, Tk, HK, D, device=q.device, dtype=torch.float32)
    dv = dk if vk else torch.zeros(B, Tk, HK, DV, device=q.device, dtype=torch.float32)
    _backward_pds(q, k, v, idx, si_h, o, do, lse, dq, dk, dv, scale, vk, G, HK, B, T, D, DV, d1, d2, cfg, gluon)
    return dq, dk.to(k.dtype), (None if vk else dv.to(v.dtype))


# Used when a P/dS pass does not fit the GPU's shared memory (the defaults take 217 / 197 KB
# under Triton 3.9, near the 227 KB of an H100/H200; another Triton may lay them out larger).
PDS_FALLBACK = {"BLOCK_H": 64, "BLOCK_K": 16, "num_warps": 4, "num_stages": 4}  # 178 KB (3.9)
APPLY_FALLBACK = {"BLOCK_H": 64, "BLOCK_K": 64, "BLOCK_C": 128, "num_warps": 8, "num_stages": 3}  # 131 KB
_fallen_back: dict[str, dict] = {}


def _launch(kernel, grid, *args, **meta):
    kernel[grid](*args, **meta)


def _with_fallback(run, c, fallback, name):
    """run(c); if the launch needs more shared memory than the device has, run(fallback) from
    then on (OutOfResources is raised before anything is written)."""
    key = f"{name}:{sorted(c.items())}"
    if key in _fallen_back:
        return run(_fallen_back[key])
    try:
        return run(c)
    except triton.runtime.errors.OutOfResources as e:
        warnings.warn(f"sparse attention backward: {name} config {c} does not fit ({e}); using {fallback}", stacklevel=2)
        _fallen_back[key] = fallback
        return run(fallback)


def _channel_major(mode, dk, vk, nc, HQ, HK, D, DV) -> bool:
    """Pass 2's order: True / False as given, or "auto": channel-major when the DRAM traffic it saves is larger
    than what it adds. Per (row, selected slot): row-major's atomics miss L2 once the fp32 dk (+ dv) buffer is
    larger than the cache (HK x (D [+ DV]) x 4 bytes read and written, missing in proportion 1 - L2 / buffer);
    channel-major reads the P / dS tiles nc - 1 more times (HQ x 2 x 2 bytes each). It matches the H200's
    bench_dsa --check: channel-major at T = 131072 / 16 heads (1.56x) and 32768 / 16 (1.09x), row-major at
    32768 / 64 and 128 heads (channel-major 0.97x / 0.98x)."""
    if mode != "auto":
        return bool(mode)
    if not dk.is_cuda:
        return False
    buf = dk.numel() * 4 * (1 if vk else 2)
    miss = max(0.0, 1.0 - torch.cuda.get_device_properties(dk.device).L2_cache_size / buf)
    saved = HK * (D if vk else D + DV) * 4 * 2 * miss
    added = (nc - 1) * HQ * 2 * 2
    return saved > added


def _slot_rows(cfg, B, T, HQ, topk, elem) -> int:
    """Rows of one slot P / dS chunk ([rows, HQ, topk] x 2 within PDS_BYTES; grid y <= 65535)."""
    per_row = HQ * topk * elem * 2
    return max(1, min(B * T, 65535, int(cfg.get("PDS_BYTES", 2**30)) // per_row))


def _dense_tiles(cfg, B, T, Tk, HQ, elem, mla) -> tuple[int, int, int, int] | None:
    """(query block, key block, query blocks, key blocks) of the dense pass 2 where it applies, else None: cfg["DENSE"]
    set, mla (one KV head with v = k[..., :DV]), a power-of-two number of query heads up to MAX_HEADS (a query's
    heads are one run of a tile's columns; 4-byte elements count twice: fp32 tiles of 32 heads need more shared
    memory than an H100 has), B * T <= 65535 (pass 1's grid axis 1) and P + dS of every row ([B, Tk, T, HQ]
    each) within BYTES."""
    dense = cfg.get("DENSE")
    if not dense or not mla or B * T > 65535 or HQ & (HQ - 1) or HQ * elem > 2 * dense["MAX_HEADS"]:
        return None
    if 2 * B * T * Tk * HQ * elem > dense["BYTES"]:
        return None
    bq, bkeys = max(dense["BLOCK_Q"], triton.cdiv(16, HQ)), dense["BLOCK_KEYS"]  # the MMA needs >= 16 rows
    return bq, bkeys, triton.cdiv(T, bq), triton.cdiv(Tk, bkeys)


def _pass1(c, q, k, v, idx, si_h, o, do, lse, p, ds, G, HK, B, T, D, DV, d1, d2, vk, i64, walk, scale, row0, n,
           dense_out=None) -> int:
    """Launch the Triton pass 1 for rows [row0, row0 + n) into the slot buffers p / ds ([rows, HQ, topk]) or, with
    dense_out = (flags, query block, key block, query blocks, key blocks), the dense ones ([B, Tk, T, HQ]);
    returns the key block it ran with (head blocks of <= 32: BLOCK_K_H32, else BLOCK_K)."""
    bh, nhb, _ = _launch_args(c, G, HK, B, T)
    bk = c.get("BLOCK_K_H32", c["BLOCK_K"]) if bh <= 32 else c["BLOCK_K"]
    flags, fq, fk, nqb, nkb = dense_out or (p, 1, 1, 0, 0)
    sp = (0, 0) if dense_out else (p.stride(0), p.stride(1))  # slot strides (row, head)
    spd = (p.stride(0), p.stride(1)) if dense_out else (0, 0)  # dense strides (batch, key)
    _launch(
        _sfa_bwd_pds_kernel, (HK * nhb, n),
        q, k, v, idx, o, do, lse, p, ds,
        q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        idx.stride(1), si_h, do.stride(1), do.stride(2), lse.stride(1), *sp,
        T, G, idx.shape[-1], D, DV, nhb, row0, n, scale * LOG2E, scale, flags, *spd, nqb, nkb,
        D1=d1, D2=d2, BLOCK_DV=max(16, triton.next_power_of_2(DV)), BLOCK_H=bh, BLOCK_K=bk,
        V_FROM_K=vk, IEEE=use_ieee(q), I64=i64, IDX_AHEAD=bool(c.get("IDX_AHEAD", False)), **walk,
        DENSE_OUT=dense_out is not None, FQ=fq, FK=fk, EVEN_H=dense_out is not None and G % bh == 0,
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )
    return bk


def _backward_pds(q, k, v, idx, si_h, o, do, lse, dq, dk, dv, scale, vk, G, HK, B, T, D, DV, d1, d2, cfg, gluon):
    """P/dS backward: pass 1 stores P and dS for a chunk of rows (at most PDS_BYTES),
    pass 2 turns them into dq (owned per program: deterministic) and dk/dv (fp32 atomics);
    the dense pass 2 (`_backward_dense`) where it applies."""
    topk = idx.shape[-1]
    HQ = q.shape[2]
    walk = _walk_args(cfg, topk)  # one SKIP for both passes: pass 2 reads only what pass 1 wrote
    i64 = max(T, k.shape[1]) * max(k.stride(1), v.stride(1), D) >= 2**31
    p1 = (q, k, v, idx, si_h, o, do, lse)
    tiles = _dense_tiles(cfg, B, T, k.shape[1], HQ, q.element_size(), HK == 1 and vk)
    if tiles is not None:
        _backward_dense(p1, dq, dk, scale, G, B, T, D, DV, d1, d2, cfg, tiles, walk, i64)
        return
    rows_total = B * T
    nrows = _slot_rows(cfg, B, T, HQ, topk, q.element_size())
    if nrows < rows_total and q.is_cuda:  # whole waves of pass 1 (one program per SM) in every chunk
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        nrows = max(nrows // sms * sms, min(sms, rows_total))
    pds = torch.empty(2, nrows, HQ, topk, device=q.device, dtype=q.dtype)
    if _POISON_PDS:  # tests: unwritten slots must never be read (CPU allocations often come back zeroed)
        pds.fill_(float("nan"))

    bk1 = [cfg["PDS_CFG"]["BLOCK_K"]]  # the key block pass 1 ran with (its fallback's, if it fell back)
    # pass 1 by the warp-specialised Gluon kernel where it applies (sm_90, bf16 MLA shapes; 1.23-1.29x the Triton
    # pass 1). It always stops at the row's last valid slot, so pass 2 must too (SKIP) for the extent to hold.
    gws = _gluon_module(q, k, v, idx, gluon) if walk["SKIP"] else None

    def pass1(c, row0, n):
        bk1[0] = _pass1(c, *p1, pds[0], pds[1], G, HK, B, T, D, DV, d1, d2, vk, i64, walk, scale, row0, n)

    def pass2(c, row0, n):
        bh, nhb, _ = _launch_args(c, G, HK, B, T)
        # 64-head blocks: 64-channel chunks (576 = 9 x 64, no half-empty last chunk); 128 at 128-head blocks
        bc = c.get("BLOCK_C_H64", c["BLOCK_C"]) if bh <= 64 else c["BLOCK_C"]
        nc = triton.cdiv(max(D, DV), bc)
        cm = _channel_major(c.get("CHANNEL_MAJOR", "auto"), dk, vk, nc, HQ, HK, D, DV)
        _launch(
            _sfa_bwd_from_pds_kernel, (n, HK * nhb * nc) if cm else (HK * nhb * nc, n),
            q, k, idx, do, pds[0], pds[1], dq, dk, dv,
            q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            idx.stride(1), si_h, do.stride(1), do.stride(2), pds.stride(1), pds.stride(2),
            dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
            T, G, topk, D, DV, nhb, nc, row0, n,
            BLOCK_C=bc, BLOCK_H=bh, BLOCK_K=c["BLOCK_K"], V_FROM_K=vk, IEEE=use_ieee(q), I64=i64,
            IDX_AHEAD=bool(c.get("IDX_AHEAD", False)), **walk,
            EXTENT_BK=bk1[0] if walk["SKIP"] else 1,  # P/dS loads masked by pass 1's written extent
            CHANNEL_MAJOR=cm,
            num_warps=c["num_warps"], num_stages=c["num_stages"],
        )

    for row0 in range(0, rows_total, nrows):
        n = min(nrows, rows_total - row0)
        if gws is not None:
            gws.pds_pass1_ws(q, k, idx, o, do, lse, pds[0], pds[1], scale, row0, n)
            bk1[0] = gws.P1_BK.value
        else:
            _with_fallback(lambda c, r=row0, m=n: pass1(c, r, m), cfg["PDS_CFG"], PDS_FALLBACK, "P/dS pass 1")
        _with_fallback(lambda c, r=row0, m=n: pass2(c, r, m), cfg["APPLY_CFG"], APPLY_FALLBACK, "P/dS pass 2")


def _mark_selected(idx, B, T, Tk):
    """(byte mask [B * T, Tk] of each row's selected keys, each row's smallest and largest selected key) by
    `_mark_selected_kernel`; idx [B, T, 1, topk] or [B, T, topk], contiguous."""
    idx = idx.reshape(B * T, idx.shape[-1])
    sel = torch.zeros(B * T, Tk, device=idx.device, dtype=torch.uint8)
    lo = torch.empty(B * T, device=idx.device, dtype=torch.int32)
    hi = torch.empty_like(lo)
    _mark_selected_kernel[(B * T,)](idx, sel, lo, hi, idx.stride(0), sel.stride(0), idx.shape[-1], Tk,
                                    BLOCK_I=min(1024, triton.next_power_of_2(idx.shape[-1])), num_warps=4)
    return sel, lo, hi


def _pass1_tiles(p1, pds, flags, scale, c, B, T, D, d1, d2, tiles):
    """Pass 1 of the dense backward by `_sfa_bwd_pds_tiles_kernel` (v = k[..., :D1]) into pds / flags."""
    q, k, idx, o, do, lse = p1[0], p1[1], p1[3], p1[5], p1[6], p1[7].contiguous()
    HQ, Tk = q.shape[2], k.shape[1]
    bq, bkeys, nqb, nkb = tiles
    sel, lo, hi = _mark_selected(idx, B, T, Tk)
    bm, bk = min(c["BLOCK_M"], bq * HQ), min(c["BLOCK_KEYS"], bkeys)
    _sfa_bwd_pds_tiles_kernel[(nqb * bq * HQ // bm, B)](
        q, k, o, do, lse, sel, lo, hi, pds[0], pds[1], flags,
        k.stride(0), k.stride(1), sel.stride(0), pds.stride(1), pds.stride(2), T, Tk, D, nqb, nkb, scale * LOG2E,
        scale, HQ=HQ, D1=d1, D2=d2, BLOCK_M=bm, BLOCK_KEYS=bk, FQ=bq, FK=bkeys, IEEE=use_ieee(q),
        num_warps=c["num_warps"], num_stages=c["num_stages"],
    )


def _backward_dense(p1, dq, dk, scale, G, B, T, D, DV, d1, d2, cfg, tiles, walk, i64):
    """Backward with the dense pass 2: pass 1 (Triton, dense_out; or on dense tiles with P1_TILES) writes P and
    dS at their keys' places ([B, Tk, T, HQ], padded) and flags the touched tiles; `_sfa_bwd_dense_dk_kernel` adds dk (+ dv, folded),
    `_sfa_bwd_dense_dq_kernel` stores dq. q, do and dq are contiguous here (sfa_backward)."""
    q, k, do = p1[0], p1[1], p1[6]
    Tk, HQ = k.shape[1], q.shape[2]
    bq, bkeys, nqb, nkb = tiles
    # padded to whole (query block, key block) tiles, so that the dense kernels load tiles unmasked; with
    # ZERO_TOUCHED only the tiles pass 1 may write into are zeroed (the dense kernels read flagged tiles only)
    pds = torch.empty(2, B, nkb * bkeys, nqb * bq, HQ, device=q.device, dtype=q.dtype)
    if _POISON_PDS:  # tests: a tile read without being zeroed shows as NaN
        pds.fill_(float("nan"))
    flags = torch.zeros(B, nqb, nkb, device=q.device, dtype=torch.int32)
    t1 = cfg["DENSE"].get("P1_TILES")
    if t1 and d1 == DV:  # pass 1 on dense tiles writes whole every tile pass 2 may read: nothing to zero
        _pass1_tiles(p1, pds, flags, scale, t1, B, T, D, d1, d2, tiles)
    else:
        if cfg["DENSE"].get("ZERO_TOUCHED", False):
            idx = p1[3]
            _zero_touched_tiles_kernel[(nqb, B)](
                idx, pds[0], pds[1], idx.stride(1), pds.stride(1), pds.stride(2), T, idx.shape[-1], HQ=HQ,
                BLOCK_Q=bq, BLOCK_KEYS=bkeys, BLOCK_I=min(1024, triton.next_power_of_2(idx.shape[-1])), num_warps=4)
        else:
            pds.zero_()
        _pass1(cfg["PDS_CFG"], *p1, pds[0], pds[1], G, 1, B, T, D, DV, d1, d2, True, i64, walk, scale, 0, B * T,
               dense_out=(flags, bq, bkeys, nqb, nkb))
    spd_b, spd_key = pds.stride(1), pds.stride(2)
    ck, cq, seg = cfg["DENSE"]["DK_CFG"], cfg["DENSE"]["DQ_CFG"], cfg["DENSE"]["SEG"]
    nck = triton.cdiv(D, ck["BLOCK_C"])
    _sfa_bwd_dense_dk_kernel[(nkb * nck, triton.cdiv(nqb, seg), B)](
        q, do, pds[0], pds[1], flags, dk, spd_b, spd_key, dk.stride(0), dk.stride(1),
        T, Tk, D, DV, nqb, nkb, nck, seg,
        HQ=HQ, BLOCK_Q=bq, BLOCK_KEYS=bkeys, BLOCK_C=ck["BLOCK_C"], IEEE=use_ieee(q),
        num_warps=ck["num_warps"], num_stages=ck["num_stages"],
    )
    ncq = triton.cdiv(D, cq["BLOCK_C"])
    _sfa_bwd_dense_dq_kernel[(nqb * ncq, B)](
        k, pds[1], flags, dq, k.stride(0), k.stride(1), spd_b, spd_key,
        T, Tk, D, nqb, nkb, ncq,
        HQ=HQ, BLOCK_Q=bq, BLOCK_KEYS=bkeys, BLOCK_C=cq["BLOCK_C"], IEEE=use_ieee(q),
        num_warps=cq["num_warps"], num_stages=cq["num_stages"],
    )


def backward_workspace_bytes(B: int, T: int, Tk: int, HQ: int, topk: int, elem: int = 2, cfg: dict | None = None,
                             shared_v: bool = True) -> int:
    """Bytes the backward allocates for P and dS on top of its inputs and gradients (the planner's DSA backward
    transient): the dense buffer ([B, Tk, T, HQ] x 2, padded to whole tiles) where the dense pass 2 applies (one KV
    head, shared_v: v = k[..., :DV]; with P1_TILES also its selection mask and key ranges, [B * T, Tk] bytes and
    8 bytes a row), else one chunk of the slot buffer (<= PDS_BYTES; on a GPU it is rounded down to whole waves)."""
    cfg = cfg or BWD_CONFIG
    tiles = _dense_tiles(cfg, B, T, Tk, HQ, elem, shared_v)
    if tiles is not None:
        bq, bkeys, nqb, nkb = tiles
        mask = B * T * (Tk + 8) if cfg["DENSE"].get("P1_TILES") else 0
        return 2 * B * nkb * bkeys * nqb * bq * HQ * elem + mask
    return _slot_rows(cfg, B, T, HQ, topk, elem) * HQ * topk * elem * 2


def _cfg_key(cfg: dict | None) -> str | None:
    """A launch configuration as the canonical string the custom ops take (None: the defaults)."""
    return None if cfg is None else json.dumps(cfg, sort_keys=True)


@functools.lru_cache(maxsize=32)
def _cfg_of(key: str | None) -> dict | None:
    """The configuration a `_cfg_key` string names (parsed once per string; read-only)."""
    return None if key is None else json.loads(key)


def _sparse_attn_fwd_impl(q: Tensor, k: Tensor, v: Tensor | None, indices: Tensor, scale: float, gluon: bool,
                          fwd_cfg: str | None, bwd_cfg: str | None) -> tuple[Tensor, Tensor]:
    """(o [B,T,HQ,DV] in q's dtype, lse [B,T,HQ] fp32) of sparse attention; v None: v is k[..., :D1] (MLA's
    shared latent, read once); fwd_cfg: a `_cfg_key` string or None (FWD_CONFIG, or the Gluon kernel where it
    applies); bwd_cfg: the backward's (sparse_attn_bwd), only carried to it."""
    return sfa_forward(q, k, v, indices, scale, _cfg_of(fwd_cfg), gluon, v_from_k=v is None)


sparse_attn_fwd = torch.library.custom_op("moeadapt::sparse_attn_fwd", mutates_args=())(_sparse_attn_fwd_impl)


@sparse_attn_fwd.register_fake
def _(q, k, v, indices, scale, gluon, fwd_cfg, bwd_cfg):
    B, T, HQ, D = q.shape
    DV = v.shape[-1] if v is not None else _split_d(int(D))[0]
    return (torch.empty(B, T, HQ, DV, device=q.device, dtype=q.dtype),
            torch.empty(B, T, HQ, device=q.device, dtype=torch.float32))


def _sparse_attn_bwd_impl(q: Tensor, k: Tensor, v: Tensor | None, indices: Tensor, o: Tensor, lse: Tensor,
                          do: Tensor, scale: float, gluon: bool, cfg: str | None) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of sparse_attn_fwd for the cotangent do, in q / k / v's dtypes; with v None dv is folded into
    dk and returned as a shape-[0] stand-in. cfg: a `_cfg_key` string or None (BWD_CONFIG)."""
    dq, dk, dv = sfa_backward(q, k, v, indices, o, lse, do, scale, _cfg_of(cfg), gluon, v_from_k=v is None)
    return dq, dk, (dv if dv is not None else torch.empty(0, device=q.device, dtype=q.dtype))


sparse_attn_bwd = torch.library.custom_op("moeadapt::sparse_attn_bwd", mutates_args=())(_sparse_attn_bwd_impl)
sparse_attn_bwd_fast = impl_or_op(sparse_attn_bwd, _sparse_attn_bwd_impl)  # the implementation itself in eager


@sparse_attn_bwd.register_fake
def _(q, k, v, indices, o, lse, do, scale, gluon, cfg):
    def like(x):
        return torch.empty(x.shape, device=x.device, dtype=x.dtype)

    return like(q), like(k), (like(v) if v is not None else torch.empty(0, device=q.device, dtype=q.dtype))


def _sfa_setup_context(ctx, inputs, output) -> None:
    q, k, v, indices, scale, gluon, fwd_cfg, bwd_cfg = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, indices, o, lse)
    ctx.scale, ctx.gluon, ctx.bwd_cfg = scale, gluon, bwd_cfg
    ctx.mark_non_differentiable(lse)
    ctx.set_materialize_grads(False)


def _sfa_backward(ctx, do, _dlse):
    q, k, v, indices, o, lse = ctx.saved_tensors
    if do is None:
        return (None,) * 8
    dq, dk, dv = sparse_attn_bwd_fast(q, k, v, indices, o, lse, do, ctx.scale, ctx.gluon, ctx.bwd_cfg)
    return dq, dk, (dv if v is not None else None), None, None, None, None, None


sparse_attn_fwd.register_autograd(_sfa_backward, setup_context=_sfa_setup_context)
# what sparse_attention_triton calls: the op where traced, in eager an autograd.Function of the same functions
# (ops/custom.py)
sparse_attn_fwd_fast = eager_or_op(sparse_attn_fwd, _sparse_attn_fwd_impl, _sfa_setup_context, _sfa_backward)


def sparse_attention_triton(q, k, v, indices, scale=None, *, gluon: bool = True, fwd_cfg: dict | None = None,
                            bwd_cfg: dict | None = None):
    """Triton SFA/SFAG; same contract as `sparse_attention_reference`. gluon: the Gluon kernels where they apply
    (sm_90, bf16 MLA shapes); fwd_cfg / bwd_cfg: launch configurations (None: FWD_CONFIG / BWD_CONFIG; an
    explicit fwd_cfg runs the Triton forward). v = k[..., :DV] (MLA) is detected eagerly and passed to the ops as
    v=None (one read of each row, dv folded into dk); under torch.compile, which cannot compare data pointers,
    v goes in as its own tensor (same values, dk and dv apart)."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"scale={scale} must be finite")
    if q.shape[-1] < 16:  # MMA needs K >= 16: zero channels change no dot product
        q, k = (F.pad(x, (0, 16 - x.shape[-1])) for x in (q, k))
    if not torch.compiler.is_compiling() and _v_from_k(k, v, _split_d(q.shape[-1])[0]):
        v = None
    o, _ = sparse_attn_fwd_fast(q, k, v, indices, scale, bool(gluon), _cfg_key(fwd_cfg), _cfg_key(bwd_cfg))
    return o
