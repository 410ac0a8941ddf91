"""Triton lightning indexer behind `lightning_indexer(backend="triton")`: fused scores + exact top-k.

Owns the indexer kernel; the math is `reference.lightning_indexer_reference`.

A persistent grid of P programs; program p handles blocks of BLOCK_Q consecutive query rows p, p + P, ...
(interleaved, so the causal work is balanced). For one block:
1. score pass: tiles of BLOCK_S keys serve all the block's rows, s = ReLU(k_idx @ q_idx[rows x HI, DI]^T)
   weighted and summed over heads (keys are the MMA's M dimension and (row, head) its N, so the head sum stays
   inside a thread: 5x faster than heads as M on the H200); each score becomes an order-preserving uint32 key
   written to the row's scratch. With PREDICT, the keys at or above the row's threshold (its slot's previous
   k-th key lowered by an adaptive delta) are also appended, with their positions, to the row's candidate
   buffer; without it, a 256-bin histogram of each row's top byte is kept.
2. select, row by row. PREDICT and at least topk (at most CAP) candidates: the k-th key is among them, so four
   byte-wise radix passes over the candidates find it and the write pass runs over them. Otherwise the full
   row: (the top-byte histogram,) one pass copying the keys sharing the selected top byte to a candidate buffer
   with the histogram of their second byte, two passes over those for the last two bytes, giving the exact k-th
   largest key u* and how many keys equal to u* are needed.
3. write pass: keys > u*, and the first needed keys == u* in index order (lower index wins ties), are written
   in ascending index order, then -1 padding.
Rows with at most topk visible keys take all of them without scoring.
Device memory is the [P, BLOCK_Q + 1, T] scratch and the [P, BLOCK_Q, 2, CAP] candidates, never [T, T].
Query rows may be a subset of the key sequence (context parallelism): row r sits at position QPOS[r].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ..custom import impl_or_op
from ..host import to_device
from .triton_sparse_attn import use_ieee


@triton.jit
def _sortable(x):
    """fp32 -> uint32 whose unsigned order is the float order (-0.0 folded into +0.0)."""
    x = tl.where(x == 0.0, 0.0, x)
    bits = x.to(tl.int32, bitcast=True)
    flipped = tl.where(bits < 0, ~bits, bits | -2147483648)
    return flipped.to(tl.uint32, bitcast=True)


@triton.jit
def _pick_bin(hist, krem, NB: tl.constexpr):
    """Highest bin whose suffix count reaches krem; returns (bin, count strictly above it)."""
    incl = tl.cumsum(hist, 0)
    total = tl.sum(hist, 0)
    suffix = total - incl + hist  # keys in bins >= b
    bin_ = tl.sum((suffix >= krem).to(tl.int32), 0) - 1
    bins = tl.arange(0, NB)
    above = tl.sum(tl.where(bins == bin_, suffix - hist, 0), 0)
    return bin_, above


@triton.jit
def _refine(buf, c, prefix, krem, dst, SHIFT: tl.constexpr, FIRST: tl.constexpr, STORE: tl.constexpr,
            BLOCK_R: tl.constexpr):
    """One radix step over the keys buf[0:c]: among those whose bytes above SHIFT equal `prefix` (all of them
    when FIRST), the histogram of byte SHIFT picks the k-th key's byte; returns (prefix with it, keys still
    needed, matching keys). STORE: the matching keys are also copied, in order, to dst."""
    NB: tl.constexpr = 256
    offs = tl.arange(0, BLOCK_R)
    bins = tl.arange(0, NB)
    hist = tl.zeros([NB], tl.int32)
    nmatch = 0
    for s0 in range(0, c, BLOCK_R):
        j = s0 + offs
        valid = j < c
        u = tl.load(buf + j, mask=valid, other=0).to(tl.uint32, bitcast=True)
        if FIRST:
            match = valid
        else:
            match = valid & ((u >> (SHIFT + 8)) == prefix)
        m = match.to(tl.int32)
        if STORE:
            tl.store(dst + nmatch + tl.cumsum(m, 0) - m, u.to(tl.int32, bitcast=True), mask=match)
        hist += tl.histogram(tl.where(match, ((u >> SHIFT) & 255).to(tl.int32), 0), NB)
        nmatch += tl.sum(m, 0)
    hist -= tl.where(bins == 0, tl.cdiv(c, BLOCK_R) * BLOCK_R - nmatch, 0)  # the others were counted in bin 0
    bin_, above = _pick_bin(hist, krem, NB)
    return (prefix << 8) | bin_.to(tl.uint32), krem - above, nmatch


@triton.jit
def _write_selected(keys, idx, n, kth, krem, out, start, HAS_IDX: tl.constexpr, BLOCK_R: tl.constexpr):
    """Write the positions of keys[0:n] > kth, then of the first krem keys == kth, in ascending order (the
    position of keys[j] is start + idx[j], or start + j without idx)."""
    offs = tl.arange(0, BLOCK_R)
    written = 0
    ties = 0
    for s0 in range(0, n, BLOCK_R):
        j = s0 + offs
        valid = j < n
        u = tl.load(keys + j, mask=valid, other=0).to(tl.uint32, bitcast=True)
        gt = valid & (u > kth)
        eq = (valid & (u == kth)).to(tl.int32)
        tie_rank = ties + tl.cumsum(eq, 0) - eq
        take = (gt | ((eq > 0) & (tie_rank < krem))).to(tl.int32)
        pos = written + tl.cumsum(take, 0) - take
        if HAS_IDX:
            src = tl.load(idx + j, mask=valid, other=0)
        else:
            src = j
        tl.store(out + pos, start + src, mask=take > 0)
        written += tl.sum(take, 0)
        ties += tl.sum(eq, 0)


@triton.jit
def _indexer_kernel(
    QI, KI, WI, STARTS, QPOS, OUT, SCR, CAND,
    sq_r, sq_h, sk_b, sk_t, sw_r, so_r, s_scr, s_scr_c, s_cand, s_cand_r, s_cand_c,
    TQ, NBLK_B, HI, TOPK, NPROG, CAP,
    DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_R: tl.constexpr, PREDICT: tl.constexpr, IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    NB: tl.constexpr = 256
    QH: tl.constexpr = BLOCK_Q * BLOCK_HI
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    offs_i = tl.arange(0, BLOCK_Q)
    offs_qh = tl.arange(0, QH)  # (row of the block, head) pairs: the MMA's N
    offs_d = tl.arange(0, DI)
    bins = tl.arange(0, NB)
    qrow = offs_qh // BLOCK_HI
    head = offs_qh % BLOCK_HI
    scr = SCR + pid.to(tl.int64) * s_scr
    comp = scr + BLOCK_Q * s_scr_c  # the full-row select's candidate buffer
    cand = CAND + pid.to(tl.int64) * s_cand
    # PREDICT: each row slot's threshold (a sortable key: the slot's previous k-th key lowered by delta) and
    # delta, which widens when a row's k-th key fell below the threshold and narrows when too many keys passed
    thr_i = tl.zeros([BLOCK_Q], tl.uint32)
    delta_i = tl.full([BLOCK_Q], 1 << 20, tl.int64)
    nblk_q = tl.cdiv(TQ, BLOCK_Q)  # row blocks per sequence
    for blk in range(pid, NBLK_B * nblk_q, NPROG):
        b = blk // nblk_q
        tq0 = (blk % nblk_q) * BLOCK_Q
        # the block's rows: their positions, document starts and visible key counts (0: past the end)
        tq_i = tq0 + offs_i
        live_i = tq_i < TQ
        t_i = tl.load(QPOS + tq_i, mask=live_i, other=0)
        start_i = tl.load(STARTS + t_i, mask=live_i, other=0)
        n_i = tl.where(live_i, t_i - start_i + 1, 0)
        lo = tl.min(tl.where(live_i, start_i, 2147483647), 0)
        hi = tl.max(tl.where(live_i, t_i + 1, 0), 0)
        scored = tl.max(n_i, 0) > TOPK  # some row needs the scores; shorter rows take all their keys
        r0 = b.to(tl.int64) * TQ + tq0
        if not PREDICT:
            hist2 = tl.zeros([BLOCK_Q, NB], tl.int32)  # each row's top-byte histogram
        c_i = tl.zeros([BLOCK_Q], tl.int32)  # PREDICT: keys at or above each row's threshold
        if scored:
            live_qh = (tq0 + qrow) < TQ
            q = tl.load(QI + (r0 + qrow)[:, None] * sq_r + head[:, None] * sq_h + offs_d[None, :],
                        mask=(live_qh & (head < HI))[:, None], other=0.0)
            w = tl.load(WI + (r0 + qrow) * sw_r + head, mask=live_qh & (head < HI), other=0.0).to(tl.float32)
            kbase = KI + b.to(tl.int64) * sk_b
            # 1. one key tile serves the block's rows: scores -> sortable keys in each row's scratch (at key
            #    position - lo); PREDICT: the keys at or above the row's threshold (and their positions) are
            #    also appended to its candidate buffer; else each row's histogram of the top byte is kept (row i
            #    in bins [256 i, 256 i + 256))
            if not PREDICT:
                hist = tl.zeros([BLOCK_Q * NB], tl.int32)
            for s0 in range(lo, hi, BLOCK_S):
                j = s0 + offs_s
                kt = tl.load(kbase + j.to(tl.int64)[:, None] * sk_t + offs_d[None, :],
                             mask=(j < hi)[:, None], other=0.0)
                # keys are the MMA's M dimension, (row, head) its N: the head sum stays in-thread
                if IEEE:
                    sc = tl.dot(kt.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
                else:
                    sc = tl.dot(kt, tl.trans(q))
                sc = tl.maximum(sc, 0.0) * w[None, :]
                score = tl.sum(tl.reshape(sc, [BLOCK_S, BLOCK_Q, BLOCK_HI]), 2)  # [keys, rows]
                u = _sortable(score)
                valid = (j[:, None] >= start_i[None, :]) & (j[:, None] < (start_i + n_i)[None, :])
                tl.store(scr + offs_i[None, :] * s_scr_c + (j - lo)[:, None], u.to(tl.int32, bitcast=True),
                         mask=valid)
                if PREDICT:
                    m = valid & (u >= thr_i[None, :])
                    mi = m.to(tl.int32)
                    pos = c_i[None, :] + tl.cumsum(mi, 0) - mi
                    ok = m & (pos < CAP)
                    ptr = cand + offs_i[None, :] * s_cand_r + pos
                    tl.store(ptr, u.to(tl.int32, bitcast=True), mask=ok)
                    tl.store(ptr + s_cand_c, j[:, None] - start_i[None, :], mask=ok)
                    c_i += tl.sum(mi, 0)
                else:
                    byte = tl.where(valid, (u >> 24).to(tl.int32), 0) + offs_i[None, :] * NB
                    hist += tl.histogram(tl.reshape(byte, [BLOCK_S * BLOCK_Q]), BLOCK_Q * NB)
            if not PREDICT:  # masked lanes were counted in each row's bin 0
                pad = tl.cdiv(hi - lo, BLOCK_S) * BLOCK_S - n_i
                hist2 = tl.reshape(hist, [BLOCK_Q, NB]) - tl.where((bins == 0)[None, :], pad[:, None], 0)
        for i in range(BLOCK_Q):
            sel_i = offs_i == i
            n = tl.sum(tl.where(sel_i, n_i, 0), 0)
            start = tl.sum(tl.where(sel_i, start_i, 0), 0)
            c = tl.sum(tl.where(sel_i, c_i, 0), 0)
            out = OUT + (r0 + i) * so_r
            if n <= TOPK:
                lim = tl.where(tq0 + i < TQ, TOPK, 0)  # a row past the end of the queries writes nothing
                for j0 in range(0, TOPK, BLOCK_R):
                    j = j0 + offs_r
                    tl.store(out + j, tl.where(j < n, start + j, -1), mask=j < lim)
            else:
                row = scr + i * s_scr_c + (start - lo)
                if (c >= TOPK) & (c <= CAP):  # never without PREDICT (c = 0)
                    # the k-th key is at or above the threshold: the select and the write see the c
                    # candidates only (in ascending position order), not the row
                    ck = cand + i * s_cand_r
                    kth, krem, _ = _refine(ck, c, tl.zeros([], tl.uint32), TOPK, ck, 24, True, False, BLOCK_R)
                    kth, krem, _ = _refine(ck, c, kth, krem, ck, 16, False, False, BLOCK_R)
                    kth, krem, _ = _refine(ck, c, kth, krem, ck, 8, False, False, BLOCK_R)
                    kth, krem, _ = _refine(ck, c, kth, krem, ck, 0, False, False, BLOCK_R)
                    _write_selected(ck, ck + s_cand_c, c, kth, krem, out, start, True, BLOCK_R)
                else:
                    if PREDICT:  # the row's top byte, which the score pass did not histogram
                        kth, krem, _ = _refine(row, n, tl.zeros([], tl.uint32), TOPK, row, 24, True, False, BLOCK_R)
                    else:
                        bin_, above = _pick_bin(tl.sum(tl.where(sel_i[:, None], hist2, 0), 0), TOPK, NB)
                        kth = bin_.to(tl.uint32)
                        krem = TOPK - above
                    # 2. one pass over the row: the keys sharing the top byte go to the candidate buffer (their
                    #    values only), with the histogram of their second byte; the last two bytes among those
                    kth, krem, nc = _refine(row, n, kth, krem, comp, 16, False, True, BLOCK_R)
                    kth, krem, _ = _refine(comp, nc, kth, krem, comp, 8, False, False, BLOCK_R)
                    kth, krem, _ = _refine(comp, nc, kth, krem, comp, 0, False, False, BLOCK_R)
                    # 3. write keys > u*, then the first krem keys == u*, ascending
                    _write_selected(row, row, n, kth, krem, out, start, False, BLOCK_R)
                if PREDICT:  # the next row of this slot: a threshold below this row's k-th key
                    d = tl.sum(tl.where(sel_i, delta_i, 0), 0)
                    d = tl.where(c < TOPK, tl.minimum(d * 4, 1 << 31),
                                 tl.where(c > CAP, tl.maximum(d // 4, 1 << 12),
                                          tl.where(c > 4 * TOPK, tl.maximum(d // 2, 1 << 12), d)))
                    delta_i = tl.where(sel_i, d, delta_i)
                    thr_i = tl.where(sel_i, tl.maximum(kth.to(tl.int64) - d, 0).to(tl.uint32), thr_i)


def pad_head_dim(q_idx, k_idx):
    """Zero-pad DI to a power of two >= 16 (the MMA's K); scores are unchanged."""
    DI = q_idx.shape[-1]
    pad = max(16, triton.next_power_of_2(DI)) - DI
    if pad:
        q_idx, k_idx = F.pad(q_idx, (0, pad)), F.pad(k_idx, (0, pad))
    return q_idx, k_idx


# Launch configuration: BLOCK_Q query rows per program share each key tile (the MMA's N is BLOCK_Q x heads),
# BLOCK_S keys per tile, BLOCK_R keys per select tile, resident programs per SM; PREDICT: each row selects
# among the keys at or above a threshold predicted from the previous row of its slot (at most CAP of them; else
# the full-row select). H200, one-run A/B against one row per program without PREDICT (2026-12-03, random bf16
# inputs, topk 2048, DI 128; benchmarks/RESULTS.md): with at most 32 heads, 4 rows + PREDICT (16 heads 1.27x /
# 1.24x at T = 131072 / 32768, 0.81-0.98x at 2 x 4096; 32 heads 1.41x / 1.36x / 1.13x; 4 rows without PREDICT
# 0.56x: a 1024-bin histogram per key tile); at 64 heads one row per program, 128-key tiles (1.21-1.23x;
# 2 or 4 rows 0.63-0.82x, PREDICT 1.01x).
LI_CONFIG = {"BLOCK_Q": 1, "BLOCK_S": 128, "BLOCK_R": 1024, "progs_per_sm": 4, "num_warps": 4, "PREDICT": False,
             "CAP": 16384}
LI_CONFIG_FEW_HEADS = dict(LI_CONFIG, BLOCK_Q=4, BLOCK_S=64, progs_per_sm=2, PREDICT=True)  # <= 32 heads
FEW_HEADS = 32


def lightning_indexer_triton(q_idx, k_idx, w_idx, topk, cu_seqlens=None, cfg=None, q_positions=None):
    """Triton lightning indexer; same contract as `lightning_indexer_reference`."""
    cfg = cfg or (LI_CONFIG_FEW_HEADS if q_idx.shape[2] <= FEW_HEADS else LI_CONFIG)
    block_s, progs_per_sm = cfg["BLOCK_S"], cfg["progs_per_sm"]
    q_idx, k_idx = pad_head_dim(q_idx, k_idx)
    B, TQ, HI, DI = q_idx.shape
    T = k_idx.shape[1]
    dev = q_idx.device
    q = q_idx.reshape(B * TQ, HI, DI).contiguous()
    k = k_idx if k_idx.stride(-1) == 1 else k_idx.contiguous()
    w = w_idx.reshape(B * TQ, HI).contiguous()
    if q_positions is None:
        qpos = torch.arange(TQ, dtype=torch.int32, device=dev)
    else:
        qpos = q_positions.to(device=dev, dtype=torch.int32).contiguous()
    if cu_seqlens is None:
        starts = torch.zeros(T, dtype=torch.int32, device=dev)
    else:
        cu = to_device(cu_seqlens, dev, torch.long)
        seq = torch.searchsorted(cu[1:], torch.arange(T, device=dev), right=True)
        starts = cu[seq].to(torch.int32)
    out = torch.empty(B, TQ, topk, dtype=torch.int32, device=dev)
    if dev.type == "cuda":
        nprog = torch.cuda.get_device_properties(dev).multi_processor_count * progs_per_sm
    else:
        nprog = 4
    block_q = cfg.get("BLOCK_Q", 1)
    nprog = max(1, min(nprog, B * triton.cdiv(TQ, block_q)))
    block_r = cfg.get("BLOCK_R", block_s)
    predict = cfg.get("PREDICT", False)
    cap = min(T, cfg.get("CAP", 16384)) if predict else 1
    # per program: the keys of each of its block's rows, one candidate buffer for the full-row select; with
    # PREDICT, each row's keys above its threshold and their positions
    scratch = torch.empty(nprog, block_q + 1, T, dtype=torch.int32, device=dev)
    cand = torch.empty(nprog, block_q, 2, cap, dtype=torch.int32, device=dev)
    _indexer_kernel[(nprog,)](
        q, k, w, starts, qpos, out, scratch, cand,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), w.stride(0), out.stride(1), scratch.stride(0),
        scratch.stride(1), cand.stride(0), cand.stride(1), cand.stride(2), TQ, B, HI, topk, nprog, cap,
        DI=DI, BLOCK_HI=max(16, triton.next_power_of_2(HI)), BLOCK_Q=block_q, BLOCK_S=block_s, BLOCK_R=block_r,
        PREDICT=predict, IEEE=use_ieee(q), num_warps=cfg["num_warps"],
    )
    # rows of n > topk wrote exactly topk entries; shorter rows were padded in-kernel
    return out


def _lightning_indexer_impl(q_idx: torch.Tensor, k_idx: torch.Tensor, w_idx: torch.Tensor, topk: int,
                            cu_seqlens: torch.Tensor | None = None,
                            q_positions: torch.Tensor | None = None) -> torch.Tensor:
    return lightning_indexer_triton(q_idx, k_idx, w_idx, topk, cu_seqlens, q_positions=q_positions)


# The Triton indexer as the torch.library op `moeadapt::lightning_indexer`, so that selective activation
# checkpointing sees it and keeps its selection (parallel/activation.py) instead of running it again in the
# recompute, and torch.compile traces one op. Its output is integer (no gradient: no autograd formula).
lightning_indexer_op = torch.library.custom_op(
    "moeadapt::lightning_indexer", mutates_args=(),
    schema="(Tensor q_idx, Tensor k_idx, Tensor w_idx, int topk, Tensor? cu_seqlens=None, "
           "Tensor? q_positions=None) -> Tensor")(_lightning_indexer_impl)


@lightning_indexer_op.register_fake
def _(q_idx, k_idx, w_idx, topk, cu_seqlens=None, q_positions=None):
    return q_idx.new_empty((q_idx.shape[0], q_idx.shape[1], topk), dtype=torch.int32)


# what lightning_indexer calls: the op where traced (a dispatch mode, compile), in eager the function itself
lightning_indexer_fast = impl_or_op(lightning_indexer_op, _lightning_indexer_impl)
