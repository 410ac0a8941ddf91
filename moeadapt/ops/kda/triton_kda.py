"""Triton kernels for chunked KDA (forward and backward) behind one autograd.Function.

Owns the kernels and `chunk_kda_triton`; imports only torch/triton. The math is the
chunk form of `reference.py` (chunk BT=64, sub-chunks BC=16). Per chunk, with G the
in-chunk cumulative gate, gam = G at the chunk's last row, q unscaled:
  Akk_ij = beta_i sum_c k_ic k_jc e^(G_ic-G_jc) (j<i),  Aqk_ij = sum_c q_ic k_jc e^(G_ic-G_jc) (j<=i)
  Ti = (I + Akk)^-1,  w = Ti (beta k e^G),  u = Ti (beta v)
  d = u - w S,  o = scale (q e^G S + Aqk d),  S <- e^gam S + (k e^(gam-G))^T d
Every exponent taken is <= 0: diagonal BCxBC blocks form e^(G_i-G_j) elementwise; off-
diagonal blocks split it at a reference row between i and j.

Kernels: `_fwd_intra` (per chunk: G, Akk, Aqk, Ti, w, u), `_fwd_h` (per sequence and
V-block: the state recurrence, storing the state entering each chunk and d), `_fwd_o`
(per chunk: output), `_bwd_dh` (reverse state recurrence: dS per chunk and dd),
`_bwd_local` (per chunk: dq, dk, dv, dg, dbeta). Backward recomputes h and d.
Sequences are always handled in varlen form (dense batches become B sequences of T).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BT = 64
BC = 16
# Launch parameters (the benchmark may override them to compare variants).
CONFIG = dict(
    intra_BK=16, intra_warps=4, h_BV=32, h_warps=4, o_BV=64, o_warps=4,
    dh_warps=4, local_BK=64, local_BK2=16, local_BV=64, local_warps=4, intra2_warps=4,
    save_h=True,  # keep the per-chunk states h and d from forward (h is T/64*K*V per head) instead of recomputing
)


@triton.jit
def _diag_exp(G3, BCc: tl.constexpr):
    """E[a,i,j,c] = exp(G[a,i,c] - G[a,j,c]) for j <= i within each sub-chunk, else 0."""
    ii = tl.arange(0, BCc)
    causal = (ii[:, None] >= ii[None, :])[None, :, :, None]
    return tl.exp(tl.where(causal, G3[:, :, None, :] - G3[:, None, :, :], float("-inf")))


@triton.jit
def _fwd_intra(
    g, q, k, v, beta, Aqk, Ti, w, u, kd, qg, gl, cu, cidx,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    NS: tl.constexpr = BT // BC
    i_n = tl.load(cidx + 2 * i_c)
    i_t = tl.load(cidx + 2 * i_c + 1)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    L = tl.minimum(eos - t0, BT)
    rows = tl.arange(0, BT)
    rmask = rows < L
    blk = rows // BC
    tok = t0 + rows
    b_beta = tl.load(beta + tok * HV + i_hv, mask=rmask, other=0.0).to(tl.float32)
    b_Akk = tl.zeros([BT, BT], dtype=tl.float32)
    b_Aqk = tl.zeros([BT, BT], dtype=tl.float32)
    d_kk = tl.zeros([NS, BC, BC], dtype=tl.float32)
    d_qk = tl.zeros([NS, BC, BC], dtype=tl.float32)
    ii = tl.arange(0, BC)
    for kb in tl.static_range(0, K, BK):
        ck = kb + tl.arange(0, BK)
        o_qk = tok[:, None] * (H * K) + i_h * K + ck[None, :]
        o_g = tok[:, None] * (HV * K) + i_hv * K + ck[None, :]
        b_g = tl.load(g + o_g, mask=rmask[:, None], other=0.0).to(tl.float32)
        b_G = tl.cumsum(b_g, axis=0)
        b_q = tl.load(q + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
        b_k = tl.load(k + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
        # diagonal sub-chunks, elementwise
        G3 = tl.reshape(b_G, (NS, BC, BK))
        k3 = tl.reshape(b_k, (NS, BC, BK))
        q3 = tl.reshape(b_q, (NS, BC, BK))
        E = _diag_exp(G3, BC)
        d_kk += tl.sum(k3[:, :, None, :] * k3[:, None, :, :] * E, axis=3)
        d_qk += tl.sum(q3[:, :, None, :] * k3[:, None, :, :] * E, axis=3)
        # off-diagonal: reference r_a = G at the first row of row sub-chunk a
        r_first = tl.sum(tl.where((ii == 0)[None, :, None], G3, 0.0), axis=1)  # [NS, BK]
        r_row = tl.reshape(tl.broadcast_to(r_first[:, None, :], (NS, BC, BK)), (BT, BK))
        e_row = tl.exp(b_G - r_row)
        kr = b_k * e_row
        qr = b_q * e_row
        for a in tl.static_range(1, NS):
            r_a = tl.sum(tl.where((tl.arange(0, NS) == a)[:, None], r_first, 0.0), axis=0)
            cm = (rows < a * BC)[:, None]
            colf = tl.exp(tl.where(cm, r_a[None, :] - b_G, float("-inf"))) * b_k
            sel = (blk == a)[:, None]
            b_Akk += tl.where(sel, tl.dot(kr, tl.trans(colf), input_precision=PREC), 0.0)
            b_Aqk += tl.where(sel, tl.dot(qr, tl.trans(colf), input_precision=PREC), 0.0)
    eye_s = (tl.arange(0, NS)[:, None] == tl.arange(0, NS)[None, :])[:, None, :, None]
    b_Akk += tl.reshape(tl.where(eye_s, d_kk[:, :, None, :], 0.0), (BT, BT))
    b_Aqk += tl.reshape(tl.where(eye_s, d_qk[:, :, None, :], 0.0), (BT, BT))
    b_Akk = tl.where(rows[:, None] > rows[None, :], b_Akk, 0.0) * b_beta[:, None]
    b_Aqk = tl.where(rows[:, None] >= rows[None, :], b_Aqk, 0.0)
    o_A = tok[:, None] * (HV * BT) + i_hv * BT + rows[None, :]
    tl.store(Aqk + o_A, b_Aqk, mask=rmask[:, None])
    # Ti = (I + Akk)^-1: block-diagonal part by (I-N)(I+N^2)(I+N^4)(I+N^8) (N^16 = 0 in a
    # 16-block), then the block-lower part by (I+E)^-1 = (I-E)(I+E^2) with E = Xd Lo.
    eye = tl.where(rows[:, None] == rows[None, :], 1.0, 0.0)
    same = blk[:, None] == blk[None, :]
    Nd = tl.where(same, b_Akk, 0.0)
    Lo = b_Akk - Nd
    P = tl.dot(Nd, Nd, input_precision=PREC)
    X = tl.dot(eye - Nd, eye + P, input_precision=PREC)
    P = tl.dot(P, P, input_precision=PREC)
    X = tl.dot(X, eye + P, input_precision=PREC)
    P = tl.dot(P, P, input_precision=PREC)
    X = tl.dot(X, eye + P, input_precision=PREC)
    Em = tl.dot(X, Lo, input_precision=PREC)
    E2 = tl.dot(Em, Em, input_precision=PREC)
    b_Ti = tl.dot(tl.dot(eye - Em, eye + E2, input_precision=PREC), X, input_precision=PREC)
    tl.store(Ti + o_A, b_Ti, mask=rmask[:, None])
    for kb in tl.static_range(0, K, BK):
        ck = kb + tl.arange(0, BK)
        o_qk = tok[:, None] * (H * K) + i_h * K + ck[None, :]
        o_g = tok[:, None] * (HV * K) + i_hv * K + ck[None, :]
        b_G = tl.cumsum(tl.load(g + o_g, mask=rmask[:, None], other=0.0).to(tl.float32), axis=0)
        b_k = tl.load(k + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
        b_q = tl.load(q + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
        eG = tl.exp(b_G)
        b_w = tl.dot(b_Ti, b_k * eG * b_beta[:, None], input_precision=PREC)
        tl.store(w + o_g, b_w.to(w.dtype.element_ty), mask=rmask[:, None])
        gam = tl.sum(tl.where((rows == BT - 1)[:, None], b_G, 0.0), axis=0)  # padded rows repeat G_last
        tl.store(kd + o_g, (b_k * tl.exp(gam[None, :] - b_G)).to(kd.dtype.element_ty), mask=rmask[:, None])
        tl.store(qg + o_g, (b_q * eG).to(qg.dtype.element_ty), mask=rmask[:, None])
        tl.store(gl + (i_c.to(tl.int64) * HV + i_hv) * K + ck, gam)
    for vb in tl.static_range(0, V, BV):
        cv = vb + tl.arange(0, BV)
        o_v = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
        b_v = tl.load(v + o_v, mask=rmask[:, None], other=0.0).to(tl.float32)
        b_u = tl.dot(b_Ti, b_v * b_beta[:, None], input_precision=PREC)
        tl.store(u + o_v, b_u.to(u.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _fwd_h(
    kd, w, u, gl, h, vn, h0, ht, cu, coff,
    HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(coff + i_n).to(tl.int64)
    NT = tl.cdiv(eos - bos, BT)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    o_s = ck[:, None] * V + cv[None, :]
    DT = w.dtype.element_ty
    if HAS_H0:
        b_S = tl.load(h0 + (i_n * HV + i_hv) * K * V + o_s).to(tl.float32)
    else:
        b_S = tl.zeros([K, BV], dtype=tl.float32)
    for it in range(0, NT):
        t0 = bos + it * BT
        L = tl.minimum(eos - t0, BT)
        rmask = rows < L
        tok = t0 + rows
        tl.store(h + ((c0 + it) * HV + i_hv) * K * V + o_s, b_S.to(h.dtype.element_ty))
        o_k = tok[:, None] * (HV * K) + i_hv * K + ck[None, :]
        o_v = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
        b_w = tl.load(w + o_k, mask=rmask[:, None], other=0.0)
        b_d = tl.load(u + o_v, mask=rmask[:, None], other=0.0).to(tl.float32)
        b_d -= tl.dot(b_w, b_S.to(DT), input_precision=PREC)
        tl.store(vn + o_v, b_d.to(vn.dtype.element_ty), mask=rmask[:, None])
        gam = tl.load(gl + ((c0 + it) * HV + i_hv) * K + ck)
        b_kd = tl.load(kd + o_k, mask=rmask[:, None], other=0.0)
        b_S = b_S * tl.exp(gam)[:, None] + tl.dot(tl.trans(b_kd), b_d.to(DT), input_precision=PREC)
    if STORE_HT:
        tl.store(ht + (i_n * HV + i_hv) * K * V + o_s, b_S)


@triton.jit
def _fwd_o(
    qg, h, vn, Aqk, o, cu, cidx, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n = tl.load(cidx + 2 * i_c)
    i_t = tl.load(cidx + 2 * i_c + 1)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    rows = tl.arange(0, BT)
    rmask = rows < eos - t0
    tok = t0 + rows
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    DT = vn.dtype.element_ty
    b_qg = tl.load(qg + tok[:, None] * (HV * K) + i_hv * K + ck[None, :], mask=rmask[:, None], other=0.0)
    b_h = tl.load(h + (i_c.to(tl.int64) * HV + i_hv) * K * V + ck[:, None] * V + cv[None, :])
    o_v = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
    b_d = tl.load(vn + o_v, mask=rmask[:, None], other=0.0)
    b_A = tl.load(Aqk + tok[:, None] * (HV * BT) + i_hv * BT + rows[None, :], mask=rmask[:, None], other=0.0)
    b_o = tl.dot(b_qg, b_h.to(DT), input_precision=PREC) + tl.dot(b_A.to(DT), b_d, input_precision=PREC)
    tl.store(o + o_v, (b_o * scale).to(o.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _bwd_dh(
    qg, kd, w, gl, Aqk, do, dh, dd, dht, dh0, cu, coff, scale,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
):
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n = i_nh // HV
    i_hv = i_nh % HV
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(coff + i_n).to(tl.int64)
    NT = tl.cdiv(eos - bos, BT)
    ck = tl.arange(0, K)
    cv = i_v * BV + tl.arange(0, BV)
    rows = tl.arange(0, BT)
    o_s = ck[:, None] * V + cv[None, :]
    DT = w.dtype.element_ty
    if HAS_DHT:
        b_dS = tl.load(dht + (i_n * HV + i_hv) * K * V + o_s).to(tl.float32)
    else:
        b_dS = tl.zeros([K, BV], dtype=tl.float32)
    for j in range(0, NT):
        it = NT - 1 - j
        t0 = bos + it * BT
        L = tl.minimum(eos - t0, BT)
        rmask = rows < L
        tok = t0 + rows
        tl.store(dh + ((c0 + it) * HV + i_hv) * K * V + o_s, b_dS.to(dh.dtype.element_ty))
        o_k = tok[:, None] * (HV * K) + i_hv * K + ck[None, :]
        o_v = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
        b_do = (tl.load(do + o_v, mask=rmask[:, None], other=0.0).to(tl.float32) * scale).to(DT)
        b_A = tl.load(Aqk + tok[:, None] * (HV * BT) + i_hv * BT + rows[None, :], mask=rmask[:, None], other=0.0)
        gam = tl.load(gl + ((c0 + it) * HV + i_hv) * K + ck)
        b_kd = tl.load(kd + o_k, mask=rmask[:, None], other=0.0)
        b_qg = tl.load(qg + o_k, mask=rmask[:, None], other=0.0)
        b_w = tl.load(w + o_k, mask=rmask[:, None], other=0.0)
        b_dd = tl.dot(tl.trans(b_A.to(DT)), b_do, input_precision=PREC)
        b_dd += tl.dot(b_kd, b_dS.to(DT), input_precision=PREC)
        tl.store(dd + o_v, b_dd, mask=rmask[:, None])
        b_dS = b_dS * tl.exp(gam)[:, None] + tl.dot(tl.trans(b_qg), b_do, input_precision=PREC)
        b_dS -= tl.dot(tl.trans(b_w), b_dd.to(DT), input_precision=PREC)
    if STORE_DH0:
        tl.store(dh0 + (i_n * HV + i_hv) * K * V + o_s, b_dS)


@triton.jit
def _bwd_wy(
    q, k, v, g, beta, Ti, h, dh, vn, dd, do, dq, dk, dv, dg, db, dAqk, dAkk, cu, cidx, scale, T_total,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """Per (chunk, head, K-block): state and WY terms of dq, dk, dg (partial), dbeta (partial);
    the K-block-0 program also writes dv, dAqk = scale dO d^T and dAkk = -(Ti^T dd) d^T."""
    i_c, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n = tl.load(cidx + 2 * i_c)
    i_t = tl.load(cidx + 2 * i_c + 1)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    L = tl.minimum(eos - t0, BT)
    rows = tl.arange(0, BT)
    rmask = rows < L
    tok = t0 + rows
    DT = vn.dtype.element_ty
    o_A = tok[:, None] * (HV * BT) + i_hv * BT + rows[None, :]
    b_Ti = tl.load(Ti + o_A, mask=rmask[:, None], other=0.0)
    b_beta = tl.load(beta + tok * HV + i_hv, mask=rmask, other=0.0).to(tl.float32)
    o_hc = (i_c.to(tl.int64) * HV + i_hv) * K * V
    b_db = tl.zeros([BT], dtype=tl.float32)
    if i_k == 0:
        b_dAkk = tl.zeros([BT, BT], dtype=tl.float32)
        b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)
        for vb in tl.static_range(0, V, BV):
            cv = vb + tl.arange(0, BV)
            o_v = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
            b_dd = tl.load(dd + o_v, mask=rmask[:, None], other=0.0)
            b_d = tl.load(vn + o_v, mask=rmask[:, None], other=0.0)
            b_do = tl.load(do + o_v, mask=rmask[:, None], other=0.0).to(DT)
            b_v = tl.load(v + o_v, mask=rmask[:, None], other=0.0).to(tl.float32)
            dRu = tl.dot(tl.trans(b_Ti), b_dd, input_precision=PREC)
            tl.store(dv + o_v, dRu * b_beta[:, None], mask=rmask[:, None])
            b_db += tl.sum(dRu * b_v, axis=1)
            b_dAkk -= tl.dot(dRu.to(DT), tl.trans(b_d), input_precision=PREC)
            b_dAqk += tl.dot(b_do, tl.trans(b_d), input_precision=PREC)
        b_dAqk = tl.where(rows[:, None] >= rows[None, :], b_dAqk * scale, 0.0)
        b_dAkk = tl.where(rows[:, None] > rows[None, :], b_dAkk, 0.0)
        tl.store(dAqk + o_A, b_dAqk, mask=rmask[:, None])
        tl.store(dAkk + o_A, b_dAkk, mask=rmask[:, None])
    ck = i_k * BK + tl.arange(0, BK)
    o_qk = tok[:, None] * (H * K) + i_h * K + ck[None, :]
    o_g = tok[:, None] * (HV * K) + i_hv * K + ck[None, :]
    b_G = tl.cumsum(tl.load(g + o_g, mask=rmask[:, None], other=0.0).to(tl.float32), axis=0)
    gam = tl.sum(tl.where((rows == BT - 1)[:, None], b_G, 0.0), axis=0)  # padded rows repeat G_last
    b_q = tl.load(q + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
    b_k = tl.load(k + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
    dqg = tl.zeros([BT, BK], dtype=tl.float32)
    dkd = tl.zeros([BT, BK], dtype=tl.float32)
    dRw = tl.zeros([BT, BK], dtype=tl.float32)
    dgs = tl.zeros([BK], dtype=tl.float32)
    for vb in tl.static_range(0, V, BV):
        cv = vb + tl.arange(0, BV)
        o_v = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
        o_s = o_hc + ck[:, None] * V + cv[None, :]
        b_h = tl.load(h + o_s)
        b_dh = tl.load(dh + o_s)
        b_dd = tl.load(dd + o_v, mask=rmask[:, None], other=0.0)
        b_d = tl.load(vn + o_v, mask=rmask[:, None], other=0.0)
        b_do = tl.load(do + o_v, mask=rmask[:, None], other=0.0).to(DT)
        dRu = tl.dot(tl.trans(b_Ti), b_dd, input_precision=PREC)
        dqg += tl.dot(b_do, tl.trans(b_h.to(DT)), input_precision=PREC)
        dkd += tl.dot(b_d, tl.trans(b_dh.to(DT)), input_precision=PREC)
        dRw -= tl.dot(dRu.to(DT), tl.trans(b_h.to(DT)), input_precision=PREC)
        dgs += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    eG = tl.exp(b_G)
    b_dq = dqg * scale * eG
    dG = b_q * b_dq
    ed = tl.exp(gam[None, :] - b_G)
    kd = b_k * ed
    b_dk = dkd * ed
    dG -= kd * dkd
    dgam = tl.exp(gam) * dgs + tl.sum(kd * dkd, axis=0)
    rw = b_k * eG
    b_dk += b_beta[:, None] * eG * dRw
    dG += b_beta[:, None] * rw * dRw
    b_db += tl.sum(dRw * rw, axis=1)
    dG += tl.where((rows == L - 1)[:, None], dgam[None, :], 0.0)
    tl.store(dq + o_g, b_dq, mask=rmask[:, None])
    tl.store(dk + o_g, b_dk, mask=rmask[:, None])
    tl.store(dg + o_g, dG, mask=rmask[:, None])
    tl.store(db + i_k * T_total * HV + tok * HV + i_hv, b_db, mask=rmask)


@triton.jit
def _bwd_intra(
    q, k, g, beta, dAqk, dAkk, dq, dk, dg, db, cu, cidx, T_total,
    H: tl.constexpr, HV: tl.constexpr, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr,
):
    """Per (chunk, head, K-block): the intra-chunk pair terms of Aqk and Akk added to dq, dk,
    dg, dbeta, then dg = reverse cumsum of dG within the chunk."""
    i_c, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    NS: tl.constexpr = BT // BC
    i_n = tl.load(cidx + 2 * i_c)
    i_t = tl.load(cidx + 2 * i_c + 1)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    t0 = bos + i_t * BT
    L = tl.minimum(eos - t0, BT)
    rows = tl.arange(0, BT)
    rmask = rows < L
    blk = rows // BC
    tok = t0 + rows
    o_A = tok[:, None] * (HV * BT) + i_hv * BT + rows[None, :]
    b_dAqk = tl.load(dAqk + o_A, mask=rmask[:, None], other=0.0)
    b_dAkk = tl.load(dAkk + o_A, mask=rmask[:, None], other=0.0)
    b_beta = tl.load(beta + tok * HV + i_hv, mask=rmask, other=0.0).to(tl.float32)
    eye_s = (tl.arange(0, NS)[:, None] == tl.arange(0, NS)[None, :])[:, None, :, None]
    Dqk = tl.sum(tl.where(eye_s, tl.reshape(b_dAqk, (NS, BC, NS, BC)), 0.0), axis=2)
    Dkk = tl.sum(tl.where(eye_s, tl.reshape(b_dAkk, (NS, BC, NS, BC)), 0.0), axis=2)
    ii = tl.arange(0, BC)
    ck = i_k * BK + tl.arange(0, BK)
    o_qk = tok[:, None] * (H * K) + i_h * K + ck[None, :]
    o_g = tok[:, None] * (HV * K) + i_hv * K + ck[None, :]
    b_G = tl.cumsum(tl.load(g + o_g, mask=rmask[:, None], other=0.0).to(tl.float32), axis=0)
    b_q = tl.load(q + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
    b_k = tl.load(k + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
    b_kb = b_k * b_beta[:, None]
    G3 = tl.reshape(b_G, (NS, BC, BK))
    q3 = tl.reshape(b_q, (NS, BC, BK))
    k3 = tl.reshape(b_k, (NS, BC, BK))
    kb3 = tl.reshape(b_kb, (NS, BC, BK))
    E = _diag_exp(G3, BC)  # [a, i, j, c]
    # row side: sum_j dA_ij X_j e^(G_i - G_j);  col side: sum_i dA_ij X_i e^(G_i - G_j)
    kE = k3[:, None, :, :] * E
    rq = tl.reshape(tl.sum(Dqk[:, :, :, None] * kE, axis=2), (BT, BK))
    rk = tl.reshape(tl.sum(Dkk[:, :, :, None] * kE, axis=2), (BT, BK))
    cq = tl.reshape(tl.sum(Dqk[:, :, :, None] * q3[:, :, None, :] * E, axis=1), (BT, BK))
    ckk = tl.reshape(tl.sum(Dkk[:, :, :, None] * kb3[:, :, None, :] * E, axis=1), (BT, BK))
    r_first = tl.sum(tl.where((ii == 0)[None, :, None], G3, 0.0), axis=1)  # [NS, BK]
    r_last = tl.sum(tl.where((ii == BC - 1)[None, :, None], G3, 0.0), axis=1)
    for a in tl.static_range(1, NS):
        r_a = tl.sum(tl.where((tl.arange(0, NS) == a)[:, None], r_first, 0.0), axis=0)
        colf = tl.exp(tl.where((rows < a * BC)[:, None], r_a[None, :] - b_G, float("-inf"))) * b_k
        ef = tl.exp(tl.where((blk == a)[:, None], b_G - r_a[None, :], float("-inf")))
        rq += ef * tl.dot(b_dAqk, colf, input_precision=PREC)
        rk += ef * tl.dot(b_dAkk, colf, input_precision=PREC)
    for b in tl.static_range(0, NS - 1):
        r_b = tl.sum(tl.where((tl.arange(0, NS) == b)[:, None], r_last, 0.0), axis=0)
        ex = tl.exp(tl.where((rows >= (b + 1) * BC)[:, None], b_G - r_b[None, :], float("-inf")))
        ef = tl.exp(tl.where((blk == b)[:, None], r_b[None, :] - b_G, float("-inf")))
        cq += ef * tl.dot(tl.trans(b_dAqk), ex * b_q, input_precision=PREC)
        ckk += ef * tl.dot(tl.trans(b_dAkk), ex * b_kb, input_precision=PREC)
    b_dq = tl.load(dq + o_g, mask=rmask[:, None], other=0.0) + rq
    b_dk = tl.load(dk + o_g, mask=rmask[:, None], other=0.0) + b_beta[:, None] * rk + cq + ckk
    dG = tl.load(dg + o_g, mask=rmask[:, None], other=0.0)
    dG += b_q * rq + b_k * (b_beta[:, None] * rk - cq - ckk)
    b_dg = tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG
    tl.store(dq + o_g, b_dq, mask=rmask[:, None])
    tl.store(dk + o_g, b_dk, mask=rmask[:, None])
    tl.store(dg + o_g, b_dg, mask=rmask[:, None])
    tl.store(db + i_k * T_total * HV + tok * HV + i_hv, tl.sum(b_k * rk, axis=1), mask=rmask)


def _prep_varlen(B, T, cu_seqlens, device):
    """cu (int32 [N+1]), chunk index pairs (int32 [NC,2]: sequence, chunk), chunk offsets (int32 [N+1])."""
    if cu_seqlens is None:
        lens = [T] * B
        cu = torch.arange(0, B + 1, device=device, dtype=torch.int32) * T
    else:
        bounds = cu_seqlens.tolist()
        lens = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
        cu = cu_seqlens.to(device=device, dtype=torch.int32)
    nchunks = [-(-n // BT) for n in lens]
    pairs = [(i, j) for i, nc in enumerate(nchunks) for j in range(nc)]
    offs = [0]
    for nc in nchunks:
        offs.append(offs[-1] + nc)
    cidx = torch.tensor(pairs if pairs else [(0, 0)], dtype=torch.int32).reshape(-1, 2).to(device)
    coff = torch.tensor(offs, dtype=torch.int32).to(device)
    return cu, cidx, coff, len(pairs)


def _cfg(K, V, dtype):
    if K not in (16, 32, 64, 128) or V not in (16, 32, 64, 128):
        raise ValueError(f"backend='triton' supports head dims K, V in (16, 32, 64, 128), got K={K}, V={V}.")
    c = dict(CONFIG)
    for key in ("h_BV", "o_BV", "local_BV"):
        c[key] = min(c[key], V)
    c["local_BK"] = min(c["local_BK"], K)
    c["intra_BK"] = min(c["intra_BK"], K)
    c["local_BK2"] = min(c["local_BK2"], K)
    c["BV"] = c["local_BV"]
    c["PREC"] = "ieee" if dtype == torch.float32 else "tf32"
    return c


class ChunkKDAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens):
        B, T, H, K = q.shape
        HV, V = v.shape[2], v.shape[3]
        dev = q.device
        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        cu, cidx, coff, NC = _prep_varlen(B, T, cu_seqlens, dev)
        N = cu.numel() - 1
        cfg = _cfg(K, V, q.dtype)
        Tt = B * T
        Aqk = torch.empty(Tt, HV, BT, device=dev, dtype=torch.float32)
        Ti = torch.empty_like(Aqk)
        w, kd, qg = (torch.empty(Tt, HV, K, device=dev, dtype=q.dtype) for _ in range(3))
        u = torch.empty(Tt, HV, V, device=dev, dtype=q.dtype)
        gl = torch.empty(NC, HV, K, device=dev, dtype=torch.float32)
        _fwd_intra[(NC, HV)](
            g, q, k, v, beta, Aqk, Ti, w, u, kd, qg, gl, cu, cidx,
            H=H, HV=HV, K=K, V=V, BT=BT, BC=BC, BK=cfg["intra_BK"], BV=cfg["BV"], PREC=cfg["PREC"],
            num_warps=cfg["intra_warps"],
        )
        h, vn, ht = _run_fwd_h(kd, w, u, gl, h0, cu, coff, NC, N, HV, K, V, cfg, output_final_state)
        o = torch.empty(Tt, HV, V, device=dev, dtype=v.dtype)
        _fwd_o[(triton.cdiv(V, cfg["o_BV"]), NC, HV)](
            qg, h, vn, Aqk, o, cu, cidx, scale,
            H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg["o_BV"], PREC=cfg["PREC"], num_warps=cfg["o_warps"],
        )
        keep = cfg["save_h"]
        ctx.save_for_backward(
            q, k, v, g, beta, Aqk, Ti, w, u, kd, qg, gl, h0, cu, cidx, coff,
            h if keep else None, vn if keep else None,
        )
        ctx.meta = (B, T, H, HV, K, V, NC, N, scale)
        return o.view(B, T, HV, V), ht

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g, beta, Aqk, Ti, w, u, kd, qg, gl, h0, cu, cidx, coff, h, vn = ctx.saved_tensors
        B, T, H, HV, K, V, NC, N, scale = ctx.meta
        dev = q.device
        cfg = _cfg(K, V, q.dtype)
        Tt = B * T
        do = do.contiguous()
        if h is None:
            h, vn, _ = _run_fwd_h(kd, w, u, gl, h0, cu, coff, NC, N, HV, K, V, cfg, False)
        dh = torch.empty_like(h)
        dd = torch.empty(Tt, HV, V, device=dev, dtype=torch.float32)
        dh0 = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32) if h0 is not None else None
        _bwd_dh[(triton.cdiv(V, cfg["h_BV"]), N * HV)](
            qg, kd, w, gl, Aqk, do, dh, dd, dht if dht is not None else dd, dh0 if dh0 is not None else dd,
            cu, coff, scale, H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg["h_BV"], PREC=cfg["PREC"],
            HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, num_warps=cfg["dh_warps"],
        )
        dq = torch.empty(Tt, HV, K, device=dev, dtype=torch.float32)
        dk = torch.empty_like(dq)
        dg = torch.empty_like(dq)
        dv = torch.empty(Tt, HV, V, device=dev, dtype=torch.float32)
        dAqk = torch.empty(Tt, HV, BT, device=dev, dtype=torch.float32)
        dAkk = torch.empty_like(dAqk)
        BK, BK2 = cfg["local_BK"], cfg["local_BK2"]
        db1 = torch.empty(K // BK, Tt, HV, device=dev, dtype=torch.float32)
        db2 = torch.empty(K // BK2, Tt, HV, device=dev, dtype=torch.float32)
        _bwd_wy[(NC, HV, K // BK)](
            q, k, v, g, beta, Ti, h, dh, vn, dd, do, dq, dk, dv, dg, db1, dAqk, dAkk, cu, cidx, scale, Tt,
            H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=cfg["local_BV"], PREC=cfg["PREC"],
            num_warps=cfg["local_warps"],
        )
        _bwd_intra[(NC, HV, K // BK2)](
            q, k, g, beta, dAqk, dAkk, dq, dk, dg, db2, cu, cidx, Tt,
            H=H, HV=HV, K=K, BT=BT, BC=BC, BK=BK2, PREC=cfg["PREC"], num_warps=cfg["intra2_warps"],
        )
        dbeta = db1.sum(0) + db2.sum(0)
        if HV != H:
            dq = dq.view(Tt, H, HV // H, K).sum(2)
            dk = dk.view(Tt, H, HV // H, K).sum(2)
        shp = lambda x, n: x.view(B, T, n, -1)  # noqa: E731
        return (
            shp(dq, H).to(q.dtype), shp(dk, H).to(k.dtype), shp(dv, HV).to(v.dtype), shp(dg, HV).to(g.dtype),
            dbeta.view(B, T, HV).to(beta.dtype), None, dh0, None, None,
        )


def _run_fwd_h(kd, w, u, gl, h0, cu, coff, NC, N, HV, K, V, cfg, output_final_state):
    dev = kd.device
    BV = cfg["h_BV"]
    h = torch.empty(NC, HV, K, V, device=dev, dtype=kd.dtype)
    vn = torch.empty(u.shape, device=dev, dtype=u.dtype)
    ht = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    _fwd_h[(triton.cdiv(V, BV), N * HV)](
        kd, w, u, gl, h, vn, h0 if h0 is not None else vn, ht if ht is not None else vn, cu, coff,
        HV=HV, K=K, V=V, BT=BT, BV=BV, PREC=cfg["PREC"],
        HAS_H0=h0 is not None, STORE_HT=output_final_state, num_warps=cfg["h_warps"],
    )
    return h, vn, ht


def chunk_kda_triton(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    *, use_qk_l2norm=False, A_log=None, dt_bias=None, beta_is_logits=False,
):
    """Triton KDA; same contract as `moeadapt.ops.kda.chunk_kda` (fused options applied in PyTorch)."""
    from .reference import kda_gate, l2norm

    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = l2norm(q.float()).to(q.dtype), l2norm(k.float()).to(k.dtype)
    if A_log is not None:
        g = kda_gate(g, A_log, dt_bias)
    if beta_is_logits:
        beta = torch.sigmoid(beta.float()).to(beta.dtype)
    h0 = None if initial_state is None else initial_state.float()
    o, ht = ChunkKDAFunction.apply(q, k, v, g.float(), beta, scale, h0, output_final_state, cu_seqlens)
    return o, ht
