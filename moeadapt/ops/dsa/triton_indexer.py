"""Triton lightning indexer behind `lightning_indexer(backend="triton")`: fused scores + exact top-k.

Owns the indexer kernel; the math is `reference.lightning_indexer_reference`.

A persistent grid of P programs; program p handles query rows p, p + P, ...
(interleaved, so the causal work is balanced). For one query row:
1. score pass: tiles of BLOCK_S keys, s = ReLU(k_idx @ q_idx[HI, DI]^T) weighted
   and summed over heads (keys are the MMA's M dimension and heads its N, so the
   head sum stays inside a thread: 5x faster than heads as M on the H200);
   each score becomes an order-preserving uint32 key written to the program's
   scratch row, and a 256-bin histogram of its top byte is kept.
2. radix select: one more pass over the scratch row (tiles of BLOCK_R keys) copies
   the keys sharing the selected top byte to a candidate buffer, with the histogram
   of their second byte; two passes over the candidates refine the last two bytes,
   giving the exact k-th largest key u* and how many keys equal to u* are needed
   (three full passes over the row in all, not five).
3. write pass: keys > u*, and the first needed keys == u* in index order (lower
   index wins ties), are written in ascending index order, then -1 padding.
Rows with at most topk visible keys take all of them without scoring.
Device memory is the [P, 2, T] scratch (P = 4 programs per SM), never [T, T].
Query rows may be a subset of the key sequence (context parallelism): row r sits at position QPOS[r].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

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
def _indexer_kernel(
    QI, KI, WI, STARTS, QPOS, OUT, SCR,
    sq_r, sq_h, sk_b, sk_t, sw_r, so_r, s_scr, s_scr_c,
    TQ, NROWS, HI, TOPK, NPROG,
    DI: tl.constexpr, BLOCK_HI: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid = tl.program_id(0)
    NB: tl.constexpr = 256
    offs_s = tl.arange(0, BLOCK_S)
    offs_r = tl.arange(0, BLOCK_R)
    offs_h = tl.arange(0, BLOCK_HI)
    offs_d = tl.arange(0, DI)
    bins = tl.arange(0, NB)
    scr = SCR + pid.to(tl.int64) * s_scr
    for r in range(pid, NROWS, NPROG):
        r64 = tl.cast(r, tl.int64)
        b = r64 // TQ
        t = tl.load(QPOS + r64 % TQ)  # the query's position among the keys
        start = tl.load(STARTS + t)
        n = t - start + 1
        out = OUT + r64 * so_r
        if n <= TOPK:
            for j0 in range(0, TOPK, BLOCK_R):
                j = j0 + offs_r
                tl.store(out + j, tl.where(j < n, start + j, -1), mask=j < TOPK)
        else:
            q = tl.load(QI + r64 * sq_r + offs_h[:, None] * sq_h + offs_d[None, :],
                        mask=offs_h[:, None] < HI, other=0.0)
            w = tl.load(WI + r64 * sw_r + offs_h, mask=offs_h < HI, other=0.0).to(tl.float32)
            kbase = KI + b * sk_b
            # 1. scores -> sortable keys in scratch, histogram of the top byte
            hist = tl.zeros([NB], tl.int32)
            for s0 in range(0, n, BLOCK_S):
                j = s0 + offs_s
                valid = j < n
                kt = tl.load(kbase + (start + j).to(tl.int64)[:, None] * sk_t + offs_d[None, :],
                             mask=valid[:, None], other=0.0)
                # keys are the MMA's M dimension, heads its N: the head sum stays in-thread
                if IEEE:
                    sc = tl.dot(kt.to(tl.float32), tl.trans(q.to(tl.float32)), input_precision="ieee")
                else:
                    sc = tl.dot(kt, tl.trans(q))
                score = tl.sum(tl.maximum(sc, 0.0) * w[None, :], 1)
                u = _sortable(score)
                tl.store(scr + j, u.to(tl.int32, bitcast=True), mask=valid)
                hist += tl.histogram(tl.where(valid, u >> 24, 0).to(tl.int32), NB)
            pad = ((n + BLOCK_S - 1) // BLOCK_S) * BLOCK_S - n  # masked lanes counted in bin 0
            hist -= tl.where(bins == 0, pad, 0)
            krem = TOPK
            bin_, above = _pick_bin(hist, krem, NB)
            prefix = bin_.to(tl.uint32)
            krem -= above
            # 2. one pass over the row: the keys sharing the top byte go to the candidate buffer (their values
            #    only), with the histogram of their second byte
            cand = scr + s_scr_c
            hist = tl.zeros([NB], tl.int32)
            c = 0
            for s0 in range(0, n, BLOCK_R):
                j = s0 + offs_r
                u = tl.load(scr + j, mask=j < n, other=0).to(tl.uint32, bitcast=True)
                match = (j < n) & ((u >> 24) == prefix)
                m = match.to(tl.int32)
                tl.store(cand + c + tl.cumsum(m, 0) - m, u.to(tl.int32, bitcast=True), mask=match)
                hist += tl.histogram(tl.where(match, ((u >> 16) & 255).to(tl.int32), 0), NB)
                c += tl.sum(m, 0)
            hist -= tl.where(bins == 0, tl.cdiv(n, BLOCK_R) * BLOCK_R - c, 0)  # the others, counted in bin 0
            bin_, above = _pick_bin(hist, krem, NB)
            prefix = (prefix << 8) | bin_.to(tl.uint32)
            krem -= above
            # the last two bytes among the c candidates (a part of the row: the keys of one top-byte bin)
            for step in tl.static_range(2):
                shift = 8 - 8 * step
                hist = tl.zeros([NB], tl.int32)
                nomatch = 0
                for s0 in range(0, c, BLOCK_R):
                    j = s0 + offs_r
                    valid = j < c
                    u = tl.load(cand + j, mask=valid, other=0).to(tl.uint32, bitcast=True)
                    match = valid & ((u >> (shift + 8)) == prefix)
                    byte = ((u >> shift) & 255).to(tl.int32)
                    hist += tl.histogram(tl.where(match, byte, 0), NB)
                    nomatch += tl.sum((~match).to(tl.int32), 0)
                hist -= tl.where(bins == 0, nomatch, 0)
                bin_, above = _pick_bin(hist, krem, NB)
                prefix = (prefix << 8) | bin_.to(tl.uint32)
                krem -= above
            # 3. write keys > u*, then the first krem keys == u*, ascending
            written = 0
            ties = 0
            for s0 in range(0, n, BLOCK_R):
                j = s0 + offs_r
                valid = j < n
                u = tl.load(scr + j, mask=valid, other=0).to(tl.uint32, bitcast=True)
                gt = valid & (u > prefix)
                eq = (valid & (u == prefix)).to(tl.int32)
                tie_rank = ties + tl.cumsum(eq, 0) - eq
                take = (gt | ((eq > 0) & (tie_rank < krem))).to(tl.int32)
                pos = written + tl.cumsum(take, 0) - take
                tl.store(out + pos, start + j, mask=take > 0)
                written += tl.sum(take, 0)
                ties += tl.sum(eq, 0)


def pad_head_dim(q_idx, k_idx):
    """Zero-pad DI to a power of two >= 16 (the MMA's K); scores are unchanged."""
    DI = q_idx.shape[-1]
    pad = max(16, triton.next_power_of_2(DI)) - DI
    if pad:
        q_idx, k_idx = F.pad(q_idx, (0, pad)), F.pad(k_idx, (0, pad))
    return q_idx, k_idx


# Launch configuration (BLOCK_S keys per tile, resident programs per SM), the fastest of the H200 sweep of
# benchmarks/bench_dsa.py --sweep li (200 TFLOP/s at T = 16384; 1024-key select tiles, 4 warps). With at most
# 16 indexer heads (the MMA's N) 64-key tiles are faster (`bench_dsa.py --li --hi 16 64`: 500.7 vs 549.9 ms at
# T = 131072, 0.95 vs 1.07 ms at 2 x 4096; at 64 heads 706 vs 648 ms).
LI_CONFIG = {"BLOCK_S": 128, "BLOCK_R": 1024, "progs_per_sm": 4, "num_warps": 4}
LI_CONFIG_FEW_HEADS = dict(LI_CONFIG, BLOCK_S=64)


def lightning_indexer_triton(q_idx, k_idx, w_idx, topk, cu_seqlens=None, cfg=None, q_positions=None):
    """Triton lightning indexer; same contract as `lightning_indexer_reference`."""
    cfg = cfg or (LI_CONFIG_FEW_HEADS if q_idx.shape[2] <= 16 else LI_CONFIG)
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
    nprog = max(1, min(nprog, B * TQ))
    block_r = cfg.get("BLOCK_R", block_s)
    scratch = torch.empty(nprog, 2, T, dtype=torch.int32, device=dev)  # per program: the row's keys, candidates
    _indexer_kernel[(nprog,)](
        q, k, w, starts, qpos, out, scratch,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), w.stride(0), out.stride(1), scratch.stride(0),
        scratch.stride(1), TQ, B * TQ, HI, topk, nprog,
        DI=DI, BLOCK_HI=max(16, triton.next_power_of_2(HI)), BLOCK_S=block_s, BLOCK_R=block_r,
        IEEE=use_ieee(q), num_warps=cfg["num_warps"],
    )
    # rows of n > topk wrote exactly topk entries; shorter rows were padded in-kernel
    return out
