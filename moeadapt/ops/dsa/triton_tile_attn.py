"""Selected-key attention in the MHA layout over dense tiles, in Triton: the job FlexAttention does in flex_attn.py,
without its padding of the head dim.

The math is `reference.sparse_attention_reference` (q, k [B, T, H, D], v [B, T, H, DV], one selection per token);
the tiles are a selection's block lists (`flex_attn.selection_tiles`): per 128-query block the 128-key blocks that
hold a selected pair, the full ones (every pair selected: no mask read) apart from the partial ones (the byte mask
says which pairs count), and the same lists per key block for the dk / dv pass.

Why not FlexAttention: MLA's MHA form has a q / k head dim of nope + rope = 192, which inductor's templates pad
to 256 (a power of two): 1.33x the FLOPs of every score product and of dq / dk. Here the channels are two
power-of-two parts (128 + 64; `triton_sparse_attn._split_d`) and each product is two MMAs.

Three kernels, FlashAttention-2's scheme (scores recomputed in the backward, no atomics):
- forward, per (128-query block, batch and head): online softmax over the listed key blocks -> o, and the
  log-sum-exp (base 2) per row;
- dq, per (128-query block, batch and head): delta = rowsum(o * dO) first (stored for the dk / dv pass), then
  P = exp2(S - lse), dP = dO V^T, dS = P (dP - delta), dq += dS K;
- dk / dv, per (DKV_BN keys, batch and head), walking the listed query blocks: dv += P^T dO, dk += dS^T Q.
A query that selects nothing gets o = 0 and no gradient (lse = +inf there).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_sparse_attn import _mm, _split_d, use_ieee

LOG2E = 1.4426950408889634
LIST_BLOCK = 128  # the lists' query and key block (flex_attn.BLOCK)
# The launch (bench_dsa.py --forms times variants): the forward and dq programs take LIST_BLOCK queries and walk
# each listed key block in steps of FWD_BN / DQ_BN keys; a dk / dv program takes DKV_BN keys and walks each listed
# query block in steps of DKV_BM queries. On an H100 at B 2, T 4096, 16 heads (RESULTS.md, DSA section), fwd + bwd:
# 2.30 ms here against 3.01 with 64-key dk / dv programs and 2.34 with three stages everywhere. 128-key dk / dv
# programs take 255 registers and spill 16 bytes (sm_90, Triton 3.6) yet run the backward 1.46x faster than 64 keys:
# half the programs re-read each query block. Each launch fits an sm_90 card's 227 KiB of shared memory
# (tests/ops/test_tile_attn_fits.py compiles them ahead of time).
TILE_LAUNCH = dict(FWD_BN=64, FWD_WARPS=8, FWD_STAGES=3, DQ_BN=64, DQ_WARPS=8, DQ_STAGES=2,
                   DKV_BN=128, DKV_BM=64, DKV_WARPS=8, DKV_STAGES=2)
# fp32 inputs (tests) hold twice the bytes a tile: smaller steps, no pipelining
FP32_LAUNCH = dict(FWD_BN=32, FWD_STAGES=1, DQ_BN=16, DQ_STAGES=1, DKV_BM=16, DKV_STAGES=1)


def _launch(q: torch.Tensor, launch: dict | None) -> dict:
    lc = TILE_LAUNCH if launch is None else launch
    return {**lc, **FP32_LAUNCH} if q.dtype == torch.float32 and q.is_cuda else lc


def supported(q: torch.Tensor, v: torch.Tensor) -> bool:
    """Head dims these kernels take: D = a power of two >= 16 plus a power-of-two tail (or none), DV a power of
    two >= 16; at most 256 each (registers)."""
    D, DV = q.shape[-1], v.shape[-1]
    d1, d2 = _split_d(D)
    return 16 <= D <= 256 and d1 + d2 == D and 16 <= DV <= 256 and DV & (DV - 1) == 0


@triton.jit
def _rows(base, rows, s_t, C0: tl.constexpr, CW: tl.constexpr, C: tl.constexpr):
    """[len(rows), CW] channels C0 .. C0 + CW of the rows at base + row * s_t."""
    c = C0 + tl.arange(0, CW)
    return tl.load(base + rows[:, None] * s_t + c[None, :], mask=c[None, :] < C, other=0.0)


@triton.jit
def _store_rows(base, rows, s_t, x, C0: tl.constexpr, CW: tl.constexpr, C: tl.constexpr):
    c = C0 + tl.arange(0, CW)
    tl.store(base + rows[:, None] * s_t + c[None, :], x.to(base.dtype.element_ty), mask=c[None, :] < C)


@triton.jit
def _parts(base, rows, s_t, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr):
    """The rows' channels as the two power-of-two parts [rows, D1] and [rows, D2] (the second is the first where
    D2 = 0: unused)."""
    x1 = _rows(base, rows, s_t, 0, D1, D)
    x2 = x1
    if D2 > 0:
        x2 = _rows(base, rows, s_t, D1, D2, D)
    return x1, x2


@triton.jit
def _dot_parts(a1, a2, b1, b2, D2: tl.constexpr, IEEE: tl.constexpr):
    """a b^T over the two channel parts (fp32)."""
    s = _mm(a1, tl.trans(b1), IEEE)
    if D2 > 0:
        s = _mm(a2, tl.trans(b2), IEEE, s)
    return s


@triton.jit
def _step_rows(IDX, it, LB: tl.constexpr, STEP: tl.constexpr):
    """Rows of step `it` of a flat walk over listed blocks IDX[...] of LB rows in steps of STEP rows. One flat loop
    (not blocks x sub-steps): the pipeliner then buffers one step a stage, not a whole block's sub-steps."""
    return tl.load(IDX + it // (LB // STEP)) * LB + (it % (LB // STEP)) * STEP + tl.arange(0, STEP)


@triton.jit
def _query_block(Q, K, V, SEL, sq_b, sq_t, sq_h, sk_b, sk_h, sv_b, sv_h, T, TK, H: tl.constexpr, D: tl.constexpr,
                 D1: tl.constexpr, D2: tl.constexpr, LB: tl.constexpr):
    """The forward's and dq's program (query block, b * H + h): (those two ids, b, h, its query rows, its batch and
    head's k / v bases and byte-mask rows, q's two parts)."""
    qb, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    qrows = qb * LB + tl.arange(0, LB)
    q1, q2 = _parts(Q + b * sq_b + h * sq_h, qrows, sq_t, D, D1, D2)
    return qb, bh, b, h, qrows, K + b * sk_b + h * sk_h, V + b * sv_b + h * sv_h, SEL + b * T * TK, q1, q2


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q1, q2, k_b, v_b, sel_b, qrows, IDX, n, s_kt, s_vt, TK, qk_scale,
               D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, LB: tl.constexpr,
               BN: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """Online softmax of the query rows over the n listed key blocks IDX[0:n] (MASKED: partial blocks, the byte
    mask decides each pair)."""
    for it in range(n * (LB // BN)):
        keys = _step_rows(IDX, it, LB, BN)
        k1, k2 = _parts(k_b, keys, s_kt, D, D1, D2)
        s = _dot_parts(q1, q2, k1, k2, D2, IEEE) * qk_scale
        if MASKED:
            sel = tl.load(sel_b + qrows[:, None].to(tl.int64) * TK + keys[None, :])
            s = tl.where(sel != 0, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no pair yet: p = 0, not NaN
        p = tl.exp2(s - m_use[:, None])
        alpha = tl.exp2(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _rows(v_b, keys, s_vt, 0, DV, DV)
        acc = _mm(p.to(v.dtype), v, IEEE, acc * alpha[:, None])
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _tile_attn_fwd(Q, K, V, O, LSE, SEL, NUM, IDX, FNUM, FIDX,
                   sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, T, TK, NQB, NKB, qk_scale,
                   H: tl.constexpr, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                   LB: tl.constexpr, BN: tl.constexpr, FULL: tl.constexpr, IEEE: tl.constexpr):
    """o [B, T, H, DV] and lse [B, H, T] (base 2, +inf where a row selects nothing) of one query block and head.
    Program (query block, b * H + h)."""
    qb, bh, b, h, qrows, k_b, v_b, sel_b, q1, q2 = _query_block(Q, K, V, SEL, sq_b, sq_t, sq_h, sk_b, sk_h, sv_b,
                                                                 sv_h, T, TK, H, D, D1, D2, LB)
    m_i = tl.full([LB], float("-inf"), tl.float32)
    l_i = tl.zeros([LB], tl.float32)
    acc = tl.zeros([LB, DV], tl.float32)
    lst = b * NQB + qb
    if FULL:
        acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q1, q2, k_b, v_b, sel_b, qrows, FIDX + lst * NKB,
                                   tl.load(FNUM + lst), sk_t, sv_t, TK, qk_scale, D, D1, D2, DV, LB, BN, False, IEEE)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, q1, q2, k_b, v_b, sel_b, qrows, IDX + lst * NKB,
                               tl.load(NUM + lst), sk_t, sv_t, TK, qk_scale, D, D1, D2, DV, LB, BN, True, IEEE)
    ok = l_i > 0
    o = acc / tl.where(ok, l_i, 1.0)[:, None]
    _store_rows(O + (b * T * H + h) * DV, qrows, H * DV, o, 0, DV, DV)
    tl.store(LSE + bh.to(tl.int64) * T + qrows, tl.where(ok, m_i + tl.log2(tl.where(ok, l_i, 1.0)), float("inf")))


@triton.jit
def _dq_tiles(dq1, dq2, q1, q2, do, lse, delta, k_b, v_b, sel_b, qrows, IDX, n, s_kt, s_vt, TK, qk_scale,
              D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, LB: tl.constexpr,
              BN: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """dS K of the query rows over the n listed key blocks IDX[0:n], added to (dq1, dq2) (unscaled)."""
    for it in range(n * (LB // BN)):
        keys = _step_rows(IDX, it, LB, BN)
        k1, k2 = _parts(k_b, keys, s_kt, D, D1, D2)
        p = tl.exp2(_dot_parts(q1, q2, k1, k2, D2, IEEE) * qk_scale - lse[:, None])
        if MASKED:
            sel = tl.load(sel_b + qrows[:, None].to(tl.int64) * TK + keys[None, :])
            p = tl.where(sel != 0, p, 0.0)
        dp = _mm(do, tl.trans(_rows(v_b, keys, s_vt, 0, DV, DV)), IEEE)
        ds = (p * (dp - delta[:, None])).to(k1.dtype)
        dq1 = _mm(ds, k1, IEEE, dq1)
        if D2 > 0:
            dq2 = _mm(ds, k2, IEEE, dq2)
    return dq1, dq2


@triton.jit
def _tile_attn_dq(Q, K, V, O, DO, LSE, DELTA, DQ, SEL, NUM, IDX, FNUM, FIDX,
                  sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sdo_b, sdo_t, sdo_h,
                  T, TK, NQB, NKB, qk_scale, sm_scale,
                  H: tl.constexpr, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                  LB: tl.constexpr, BN: tl.constexpr, FULL: tl.constexpr, IEEE: tl.constexpr):
    """delta = rowsum(o dO) [B, H, T] and dq [B, T, H, D] of one query block and head. Program (query block,
    b * H + h)."""
    qb, bh, b, h, qrows, k_b, v_b, sel_b, q1, q2 = _query_block(Q, K, V, SEL, sq_b, sq_t, sq_h, sk_b, sk_h, sv_b,
                                                                 sv_h, T, TK, H, D, D1, D2, LB)
    do = _rows(DO + b * sdo_b + h * sdo_h, qrows, sdo_t, 0, DV, DV)
    o = _rows(O + (b * T * H + h) * DV, qrows, H * DV, 0, DV, DV)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + bh.to(tl.int64) * T + qrows, delta)
    lse = tl.load(LSE + bh.to(tl.int64) * T + qrows)
    dq1 = tl.zeros([LB, D1], tl.float32)
    dq2 = dq1  # unused where D2 = 0
    if D2 > 0:
        dq2 = tl.zeros([LB, D2], tl.float32)
    lst = b * NQB + qb
    if FULL:
        dq1, dq2 = _dq_tiles(dq1, dq2, q1, q2, do, lse, delta, k_b, v_b, sel_b, qrows, FIDX + lst * NKB,
                             tl.load(FNUM + lst), sk_t, sv_t, TK, qk_scale, D, D1, D2, DV, LB, BN, False, IEEE)
    dq1, dq2 = _dq_tiles(dq1, dq2, q1, q2, do, lse, delta, k_b, v_b, sel_b, qrows, IDX + lst * NKB,
                         tl.load(NUM + lst), sk_t, sv_t, TK, qk_scale, D, D1, D2, DV, LB, BN, True, IEEE)
    dq_b = DQ + (b * T * H + h) * D
    _store_rows(dq_b, qrows, H * D, dq1 * sm_scale, 0, D1, D)
    if D2 > 0:
        _store_rows(dq_b, qrows, H * D, dq2 * sm_scale, D1, D2, D)


@triton.jit
def _dkv_tiles(dk1, dk2, dv, k1, k2, v, q_b, do_b, lse_b, delta_b, sel_b, keys, IDX, n, s_qt, s_dot, TK,
               qk_scale, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr, LB: tl.constexpr,
               BM: tl.constexpr, MASKED: tl.constexpr, IEEE: tl.constexpr):
    """dv += P^T dO and dk += dS^T Q (unscaled) of the key rows over the n listed query blocks IDX[0:n]."""
    for it in range(n * (LB // BM)):
        qrows = _step_rows(IDX, it, LB, BM)
        q1, q2 = _parts(q_b, qrows, s_qt, D, D1, D2)
        pt = tl.exp2(_dot_parts(k1, k2, q1, q2, D2, IEEE) * qk_scale - tl.load(lse_b + qrows)[None, :])
        if MASKED:
            sel = tl.load(sel_b + qrows[None, :].to(tl.int64) * TK + keys[:, None])
            pt = tl.where(sel != 0, pt, 0.0)
        do = _rows(do_b, qrows, s_dot, 0, DV, DV)
        dv = _mm(pt.to(do.dtype), do, IEEE, dv)
        dpt = _mm(v, tl.trans(do), IEEE)
        dst = (pt * (dpt - tl.load(delta_b + qrows)[None, :])).to(q1.dtype)
        dk1 = _mm(dst, q1, IEEE, dk1)
        if D2 > 0:
            dk2 = _mm(dst, q2, IEEE, dk2)
    return dk1, dk2, dv


@triton.jit
def _tile_attn_dkv(Q, K, V, DO, LSE, DELTA, DK, DV_, SEL, NUM, IDX, FNUM, FIDX,
                   sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, sdo_b, sdo_t, sdo_h,
                   T, TK, NQB, NKB, qk_scale, sm_scale,
                   H: tl.constexpr, D: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, DV: tl.constexpr,
                   LB: tl.constexpr, BN: tl.constexpr, BM: tl.constexpr, FULL: tl.constexpr,
                   IEEE: tl.constexpr):
    """dk [B, TK, H, D] and dv [B, TK, H, DV] of BN keys and one head. Program (key tile, b * H + h)."""
    kt, bh = tl.program_id(0), tl.program_id(1)
    b, h = (bh // H).to(tl.int64), bh % H
    keys = kt * BN + tl.arange(0, BN)
    k1, k2 = _parts(K + b * sk_b + h * sk_h, keys, sk_t, D, D1, D2)
    v = _rows(V + b * sv_b + h * sv_h, keys, sv_t, 0, DV, DV)
    q_b = Q + b * sq_b + h * sq_h
    do_b = DO + b * sdo_b + h * sdo_h
    lse_b = LSE + bh.to(tl.int64) * T
    delta_b = DELTA + bh.to(tl.int64) * T
    sel_b = SEL + b * T * TK
    dk1 = tl.zeros([BN, D1], tl.float32)
    dk2 = dk1  # unused where D2 = 0
    if D2 > 0:
        dk2 = tl.zeros([BN, D2], tl.float32)
    dv = tl.zeros([BN, DV], tl.float32)
    lst = b * NKB + (kt * BN) // LB
    if FULL:
        dk1, dk2, dv = _dkv_tiles(dk1, dk2, dv, k1, k2, v, q_b, do_b, lse_b, delta_b, sel_b, keys,
                                  FIDX + lst * NQB, tl.load(FNUM + lst), sq_t, sdo_t, TK, qk_scale,
                                  D, D1, D2, DV, LB, BM, False, IEEE)
    dk1, dk2, dv = _dkv_tiles(dk1, dk2, dv, k1, k2, v, q_b, do_b, lse_b, delta_b, sel_b, keys,
                              IDX + lst * NQB, tl.load(NUM + lst), sq_t, sdo_t, TK, qk_scale,
                              D, D1, D2, DV, LB, BM, True, IEEE)
    dk_b = DK + (b * TK * H + h) * D
    _store_rows(dk_b, keys, H * D, dk1 * sm_scale, 0, D1, D)
    if D2 > 0:
        _store_rows(dk_b, keys, H * D, dk2 * sm_scale, D1, D2, D)
    _store_rows(DV_ + (b * TK * H + h) * DV, keys, H * DV, dv, 0, DV, DV)


def _bht(x: torch.Tensor) -> tuple[int, int, int]:
    """Strides (batch, token, head) of a [B, T, H, C] tensor whose channels are contiguous."""
    return x.stride(0), x.stride(1), x.stride(2)


def _unit_channels(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def tile_attention_fwd(q, k, v, tiles, scale: float, launch: dict | None = None):
    """(o [B, T, H, DV] in q's dtype, lse [B, H, T] fp32 base 2) of q, k [B, T, H, D], v [B, T, H, DV] over
    `tiles` (flex_attn.SelectionTiles)."""
    lc = _launch(q, launch)
    B, T, H, D = q.shape
    TK, DV = k.shape[1], v.shape[-1]
    d1, d2 = _split_d(D)
    o = torch.empty(B, T, H, DV, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    nqb, nkb = T // LIST_BLOCK, TK // LIST_BLOCK
    _tile_attn_fwd[(nqb, B * H)](
        q, k, v, o, lse, tiles.sel, tiles.kv_num, tiles.kv_idx, tiles.kv_full_num, tiles.kv_full_idx,
        *_bht(q), *_bht(k), *_bht(v), T, TK, nqb, nkb, scale * LOG2E,
        H=H, D=D, D1=d1, D2=d2, DV=DV, LB=LIST_BLOCK, BN=lc["FWD_BN"], FULL=tiles.kv_full_num is not None,
        IEEE=use_ieee(q), num_warps=lc["FWD_WARPS"], num_stages=lc["FWD_STAGES"])
    return o, lse


def tile_attention_bwd(q, k, v, o, lse, do, tiles, scale: float, launch: dict | None = None):
    """(dq, dk, dv) in q's / k's / v's dtypes for the cotangent do of `tile_attention_fwd`'s o."""
    lc = _launch(q, launch)
    B, T, H, D = q.shape
    TK, DV = k.shape[1], v.shape[-1]
    d1, d2 = _split_d(D)
    do = _unit_channels(do)
    nqb, nkb = T // LIST_BLOCK, TK // LIST_BLOCK
    delta = torch.empty_like(lse)
    dq = torch.empty(B, T, H, D, device=q.device, dtype=q.dtype)
    dk = torch.empty(B, TK, H, D, device=k.device, dtype=k.dtype)
    dv = torch.empty(B, TK, H, DV, device=v.device, dtype=v.dtype)
    full = tiles.kv_full_num is not None
    ieee = use_ieee(q)
    _tile_attn_dq[(nqb, B * H)](
        q, k, v, o, do, lse, delta, dq, tiles.sel, tiles.kv_num, tiles.kv_idx, tiles.kv_full_num,
        tiles.kv_full_idx, *_bht(q), *_bht(k), *_bht(v), *_bht(do), T, TK, nqb, nkb, scale * LOG2E, scale,
        H=H, D=D, D1=d1, D2=d2, DV=DV, LB=LIST_BLOCK, BN=lc["DQ_BN"], FULL=full, IEEE=ieee,
        num_warps=lc["DQ_WARPS"], num_stages=lc["DQ_STAGES"])
    _tile_attn_dkv[(TK // lc["DKV_BN"], B * H)](
        q, k, v, do, lse, delta, dk, dv, tiles.sel, tiles.q_num, tiles.q_idx, tiles.q_full_num, tiles.q_full_idx,
        *_bht(q), *_bht(k), *_bht(v), *_bht(do), T, TK, nqb, nkb, scale * LOG2E, scale,
        H=H, D=D, D1=d1, D2=d2, DV=DV, LB=LIST_BLOCK, BN=lc["DKV_BN"], BM=lc["DKV_BM"], FULL=full, IEEE=ieee,
        num_warps=lc["DKV_WARPS"], num_stages=lc["DKV_STAGES"])
    return dq, dk, dv


class _TileAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, tiles, scale, launch):
        q, k, v = (_unit_channels(x) for x in (q, k, v))
        o, lse = tile_attention_fwd(q, k, v, tiles, scale, launch)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.tiles, ctx.scale, ctx.launch = tiles, scale, launch
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = tile_attention_bwd(q, k, v, o, lse, do, ctx.tiles, ctx.scale, ctx.launch)
        return dq, dk, dv, None, None, None


def tile_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tiles, scale: float,
                   launch: dict | None = None) -> torch.Tensor:
    """Attention of q, k [B, T, H, D], v [B, T, H, DV] (T and Tk multiples of LIST_BLOCK) over a selection's
    tiles -> o [B, T, H, DV] in q's dtype; differentiable in q, k, v."""
    if q.shape[1] % LIST_BLOCK or k.shape[1] % LIST_BLOCK or not supported(q, v):
        raise ValueError(f"tile_attention takes T, Tk multiples of {LIST_BLOCK} and head dims D = a power of two "
                         f"(+ a power-of-two tail), DV a power of two, 16 .. 256; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    return _TileAttention.apply(q, k, v, tiles, float(scale), launch)
