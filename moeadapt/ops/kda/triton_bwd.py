"""Backward Triton kernels of chunked KDA (see `triton_kda.py` for the math and the wrapper).

Owns the reverse state recurrence and the per-chunk / token-parallel gradient kernels. Imports only triton.
"""

import triton
import triton.language as tl

from .triton_fwd import _chunk_span, _load_g, _state_setup, _store_state, _tok_setup


@triton.jit
def _bwd_dh(
    qg, kd, w, gl, Aqk, do, dh, dd, dht, dh0, cu, coff, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr, KH: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_DHT: tl.constexpr, STORE_DH0: tl.constexpr,
):
    """Per (V-block, sequence and head): the reverse recurrence, storing dS entering each chunk (dh, from
    its end) and dd = (Aqk^T scale dO) + kd dS; dS kept as K/KH (1 or 2) row blocks of KH rows."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv, bos, eos, c0, NT, c1, c2, cv, o_s1, o_s2, b_dS1, b_dS2 = _state_setup(
        i_v, i_nh, cu, coff, dht, HV, K, V, KH, BT, BV, HAS_DHT)
    TWO: tl.constexpr = K // KH == 2
    rows = tl.arange(0, BT)
    DT = w.dtype.element_ty
    for j in range(0, NT):
        it = NT - 1 - j
        # (the offsets inline, not _chunk_rows as in _fwd_h: that order spills 8-16 B/thread more here, sm_90)
        t0 = bos + it * BT
        rmask = rows < tl.minimum(eos - t0, BT)
        tok = t0 + rows
        _store_state(dh + ((c0 + it) * HV + i_hv) * K * V, o_s1, o_s2, b_dS1, b_dS2, TWO)
        o_k = tok[:, None] * (HV * K) + i_hv * K
        o_v = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
        o_gl = ((c0 + it) * HV + i_hv) * K
        b_do = tl.load(do + o_v, mask=rmask[:, None], other=0.0).to(DT)  # (scale applied to the products)
        b_A = tl.load(Aqk + tok[:, None] * (HV * BT) + i_hv * BT + rows[None, :], mask=rmask[:, None], other=0.0)
        b_dd = tl.dot(tl.trans(b_A.to(DT)), b_do, input_precision=PREC) * scale
        b_dd = tl.dot(tl.load(kd + o_k + c1[None, :], mask=rmask[:, None], other=0.0), b_dS1.to(DT), b_dd,
                      input_precision=PREC)
        if TWO:
            b_dd = tl.dot(tl.load(kd + o_k + c2[None, :], mask=rmask[:, None], other=0.0), b_dS2.to(DT), b_dd,
                          input_precision=PREC)
        tl.store(dd + o_v, b_dd, mask=rmask[:, None])
        b_ddn = (-b_dd).to(DT)
        b_qg = tl.load(qg + o_k + c1[None, :], mask=rmask[:, None], other=0.0)
        b_w = tl.load(w + o_k + c1[None, :], mask=rmask[:, None], other=0.0)
        b_dS1 = b_dS1 * tl.exp(tl.load(gl + o_gl + c1))[:, None] + scale * tl.dot(
            tl.trans(b_qg), b_do, input_precision=PREC)
        b_dS1 = tl.dot(tl.trans(b_w), b_ddn, b_dS1, input_precision=PREC)
        if TWO:
            b_qg = tl.load(qg + o_k + c2[None, :], mask=rmask[:, None], other=0.0)
            b_w = tl.load(w + o_k + c2[None, :], mask=rmask[:, None], other=0.0)
            b_dS2 = b_dS2 * tl.exp(tl.load(gl + o_gl + c2))[:, None] + scale * tl.dot(
                tl.trans(b_qg), b_do, input_precision=PREC)
            b_dS2 = tl.dot(tl.trans(b_w), b_ddn, b_dS2, input_precision=PREC)
    if STORE_DH0:
        _store_state(dh0 + (i_n * HV + i_hv) * K * V, o_s1, o_s2, b_dS1, b_dS2, TWO)


@triton.jit
def _bwd_dv(
    v, beta, Ti, vn, dd, do, dv, dRu, db, dAqk, dAkk, cu, cidx, scale,
    HV, V: tl.constexpr, BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    """Per (chunk, head): dRu = Ti^T dd, dv = beta dRu, dbeta(v) = sum dRu v,
    dAkk = -dRu d^T (strictly lower), dAqk = scale dO d^T (lower)."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_n, bos, eos, t0 = _chunk_span(cu, cidx, i_c, BT)
    rows = tl.arange(0, BT)
    rmask = rows < eos - t0
    tok = t0 + rows
    DT = vn.dtype.element_ty
    o_A = tok[:, None] * (HV * BT) + i_hv * BT + rows[None, :]
    b_Ti = tl.load(Ti + o_A, mask=rmask[:, None], other=0.0)
    b_beta = tl.load(beta + tok * HV + i_hv, mask=rmask, other=0.0).to(tl.float32)
    b_db = tl.zeros([BT], dtype=tl.float32)
    b_dAkk = tl.zeros([BT, BT], dtype=tl.float32)
    b_dAqk = tl.zeros([BT, BT], dtype=tl.float32)
    for vb in range(0, V, BV):
        cv = vb + tl.arange(0, BV)
        o_v = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
        b_dd = tl.load(dd + o_v, mask=rmask[:, None], other=0.0)
        b_d = tl.load(vn + o_v, mask=rmask[:, None], other=0.0)
        b_do = tl.load(do + o_v, mask=rmask[:, None], other=0.0).to(DT)
        b_v = tl.load(v + o_v, mask=rmask[:, None], other=0.0).to(tl.float32)
        b_dRu = tl.dot(tl.trans(b_Ti), b_dd, input_precision=PREC)
        tl.store(dv + o_v, b_dRu * b_beta[:, None], mask=rmask[:, None])
        tl.store(dRu + o_v, b_dRu.to(dRu.dtype.element_ty), mask=rmask[:, None])
        b_db += tl.sum(b_dRu * b_v, axis=1)
        b_dAkk = tl.dot((-b_dRu).to(DT), tl.trans(b_d), b_dAkk, input_precision=PREC)
        b_dAqk = tl.dot(b_do, tl.trans(b_d), b_dAqk, input_precision=PREC)
    b_dAqk = tl.where(rows[:, None] >= rows[None, :], b_dAqk * scale, 0.0)
    b_dAkk = tl.where(rows[:, None] > rows[None, :], b_dAkk, 0.0)
    tl.store(dAqk + o_A, b_dAqk, mask=rmask[:, None])
    tl.store(dAkk + o_A, b_dAkk, mask=rmask[:, None])
    tl.store(db + tok * HV + i_hv, b_db, mask=rmask)


@triton.jit
def _bwd_wy(
    q, k, g, beta, h, dh, vn, dRu, do, dq, dk, dg, db, cu, cidx, scale, T_total, A_log, dt_bias,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, USE_GATE: tl.constexpr,
):
    """Per (chunk, head, K-block): state and WY terms of dq, dk, dg (partial), dbeta (partial)."""
    i_c, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, bos, eos, t0 = _chunk_span(cu, cidx, i_c, BT)
    L = tl.minimum(eos - t0, BT)
    rows = tl.arange(0, BT)
    rmask = rows < L
    tok = t0 + rows
    DT = vn.dtype.element_ty
    b_beta = tl.load(beta + tok * HV + i_hv, mask=rmask, other=0.0).to(tl.float32)
    o_hc = (i_c.to(tl.int64) * HV + i_hv) * K * V
    ck = i_k * BK + tl.arange(0, BK)
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
        b_d = tl.load(vn + o_v, mask=rmask[:, None], other=0.0)
        b_do = tl.load(do + o_v, mask=rmask[:, None], other=0.0).to(DT)
        b_dRu = tl.load(dRu + o_v, mask=rmask[:, None], other=0.0).to(DT)
        dqg = tl.dot(b_do, tl.trans(b_h.to(DT)), dqg, input_precision=PREC)
        dkd = tl.dot(b_d, tl.trans(b_dh.to(DT)), dkd, input_precision=PREC)
        dRw = tl.dot(-b_dRu, tl.trans(b_h.to(DT)), dRw, input_precision=PREC)
        dgs += tl.sum(b_h.to(tl.float32) * b_dh.to(tl.float32), axis=1)
    o_qk = tok[:, None] * (H * K) + i_h * K + ck[None, :]
    o_g = tok[:, None] * (HV * K) + i_hv * K + ck[None, :]
    b_G = tl.cumsum(_load_g(g, o_g, rmask[:, None], A_log, dt_bias, i_hv, ck, K, USE_GATE), axis=0)
    gam = tl.sum(tl.where((rows == BT - 1)[:, None], b_G, 0.0), axis=0)  # padded rows repeat G_last
    b_q = tl.load(q + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
    b_k = tl.load(k + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
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
    dG += tl.where((rows == L - 1)[:, None], dgam[None, :], 0.0)
    tl.store(dq + o_g, b_dq, mask=rmask[:, None])
    tl.store(dk + o_g, b_dk, mask=rmask[:, None])
    tl.store(dg + o_g, dG, mask=rmask[:, None])
    tl.store(db + i_k * T_total * HV + tok * HV + i_hv, tl.sum(dRw * rw, axis=1), mask=rmask)


@triton.jit
def _bwd_intra(
    q, k, g, beta, dAqk, dAkk, dq, dk, dg, db, cu, cidx, T_total, A_log, dt_bias, dA,
    H, HV, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, DPREC: tl.constexpr,
    USE_GATE: tl.constexpr,
):
    """Per (chunk, head, K-block): the off-diagonal intra-chunk pair terms of Aqk and Akk added to dq, dk,
    dg, dbeta (the diagonal 16x16 blocks' were added by the token-parallel `_bwd_diag`, run before), then
    dg = reverse cumsum of dG within the chunk."""
    i_c, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    NS: tl.constexpr = BT // BC
    i_n, bos, eos, t0 = _chunk_span(cu, cidx, i_c, BT)
    L = tl.minimum(eos - t0, BT)
    rows = tl.arange(0, BT)
    rmask = rows < L
    blk = rows // BC
    tok = t0 + rows
    o_A = tok[:, None] * (HV * BT) + i_hv * BT + rows[None, :]
    b_dAqk = tl.load(dAqk + o_A, mask=rmask[:, None], other=0.0)
    b_dAkk = tl.load(dAkk + o_A, mask=rmask[:, None], other=0.0)
    b_beta = tl.load(beta + tok * HV + i_hv, mask=rmask, other=0.0).to(tl.float32)
    ii = tl.arange(0, BC)
    ck = i_k * BK + tl.arange(0, BK)
    o_qk = tok[:, None] * (H * K) + i_h * K + ck[None, :]
    o_g = tok[:, None] * (HV * K) + i_hv * K + ck[None, :]
    b_gg = _load_g(g, o_g, rmask[:, None], A_log, dt_bias, i_hv, ck, K, USE_GATE)
    b_G = tl.cumsum(b_gg, axis=0)
    b_q = tl.load(q + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
    b_k = tl.load(k + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
    b_kb = b_k * b_beta[:, None]
    G3 = tl.reshape(b_G, (NS, BC, BK))
    r_first = tl.sum(tl.where((ii == 0)[None, :, None], G3, 0.0), axis=1)  # [NS, BK]
    r_last = tl.sum(tl.where((ii == BC - 1)[None, :, None], G3, 0.0), axis=1)
    rq = tl.zeros([BT, BK], dtype=tl.float32)
    rk = tl.zeros([BT, BK], dtype=tl.float32)
    cq = tl.zeros([BT, BK], dtype=tl.float32)
    ckk = tl.zeros([BT, BK], dtype=tl.float32)
    # row side r_i += sum_j dA_ij k_j e^(G_i - G_j) over the columns left of row sub-chunk a, split at
    # r_a = G_first of that sub-chunk
    for a in tl.static_range(1, NS):
        r_a = tl.sum(tl.where((tl.arange(0, NS) == a)[:, None], r_first, 0.0), axis=0)
        colf = tl.exp(tl.where((rows < a * BC)[:, None], r_a[None, :] - b_G, float("-inf"))) * b_k
        ef = tl.exp(tl.where((blk == a)[:, None], b_G - r_a[None, :], float("-inf")))
        rq += ef * tl.dot(b_dAqk, colf, input_precision=DPREC)
        rk += ef * tl.dot(b_dAkk, colf, input_precision=DPREC)
    # column side c_j += sum_i dA_ij X_i e^(G_i - G_j) over the rows below column sub-chunk b, split at
    # r_b = G_last of that sub-chunk
    for b in tl.static_range(0, NS - 1):
        r_b = tl.sum(tl.where((tl.arange(0, NS) == b)[:, None], r_last, 0.0), axis=0)
        ex = tl.exp(tl.where((rows >= (b + 1) * BC)[:, None], b_G - r_b[None, :], float("-inf")))
        ef = tl.exp(tl.where((blk == b)[:, None], r_b[None, :] - b_G, float("-inf")))
        cq += ef * tl.dot(tl.trans(b_dAqk), ex * b_q, input_precision=DPREC)
        ckk += ef * tl.dot(tl.trans(b_dAkk), ex * b_kb, input_precision=DPREC)
    b_dq = tl.load(dq + o_g, mask=rmask[:, None], other=0.0) + rq
    b_dk = tl.load(dk + o_g, mask=rmask[:, None], other=0.0) + b_beta[:, None] * rk + cq + ckk
    dG = tl.load(dg + o_g, mask=rmask[:, None], other=0.0)
    dG += b_q * rq + b_k * (b_beta[:, None] * rk - cq - ckk)
    b_dg = tl.sum(dG, axis=0)[None, :] - tl.cumsum(dG, axis=0) + dG
    if USE_GATE:  # d/dA_log of g is g; d/d(raw) is -exp(A_log) sigmoid(raw + dt_bias)
        tl.store(dA + i_k * T_total * HV + tok * HV + i_hv, tl.sum(b_dg * b_gg, axis=1), mask=rmask)
        x = tl.load(g + o_g, mask=rmask[:, None], other=0.0).to(tl.float32)
        x += tl.load(dt_bias + i_hv * K + ck).to(tl.float32)[None, :]
        b_dg *= -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * tl.sigmoid(x)
    tl.store(dq + o_g, b_dq, mask=rmask[:, None])
    tl.store(dk + o_g, b_dk, mask=rmask[:, None])
    tl.store(dg + o_g, b_dg, mask=rmask[:, None])
    b_db = tl.sum(b_k * rk, axis=1)
    tl.store(db + i_k * T_total * HV + tok * HV + i_hv, b_db, mask=rmask)


@triton.jit
def _bwd_diag(
    q, k, Gc, beta, dAqk, dAkk, dq, dk, dg, db, cu, cidx,
    H, HV, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr,
):
    """Token-parallel diagonal sub-chunk terms of dq, dk, dG, dbeta for token t, both as row i = t
    (sum over j <= t) and as column j = t (sum over i >= t); adds to the partials in dq, dk, dg."""
    t, t0, s0, s1, valid = _tok_setup(cu, cidx, BT, BC)
    if valid:
        o_hv = tl.program_id(1) * BH + tl.arange(0, BH)
        m_hv = o_hv < HV
        m2 = m_hv[:, None]
        ck = tl.arange(0, K)
        p_qk = (o_hv // (HV // H))[:, None] * K + ck[None, :]
        p_g = o_hv[:, None] * K + ck[None, :]
        b_q = tl.load(q + t * (H * K) + p_qk, mask=m2, other=0.0).to(tl.float32)
        b_k = tl.load(k + t * (H * K) + p_qk, mask=m2, other=0.0).to(tl.float32)
        b_G = tl.load(Gc + t * (HV * K) + p_g, mask=m2, other=0.0)
        b_beta = tl.load(beta + t * HV + o_hv, mask=m_hv, other=0.0).to(tl.float32)
        rq = tl.zeros([BH, K], dtype=tl.float32)
        rk = tl.zeros([BH, K], dtype=tl.float32)
        for j in range(s0, t + 1):  # t as row i
            kE = tl.load(k + j * (H * K) + p_qk, mask=m2, other=0.0).to(tl.float32) * tl.exp(
                b_G - tl.load(Gc + j * (HV * K) + p_g, mask=m2, other=0.0))
            o_A = t * (HV * BT) + o_hv * BT + (j - t0)
            rq += tl.load(dAqk + o_A, mask=m_hv, other=0.0)[:, None] * kE
            rk += tl.load(dAkk + o_A, mask=m_hv & (o_hv * 0 + j < t), other=0.0)[:, None] * kE
        cq = tl.zeros([BH, K], dtype=tl.float32)
        ckk = tl.zeros([BH, K], dtype=tl.float32)
        for i in range(t, s1):  # t as column j
            e = tl.exp(tl.load(Gc + i * (HV * K) + p_g, mask=m2, other=0.0) - b_G)
            o_A = i * (HV * BT) + o_hv * BT + (t - t0)
            b_qi = tl.load(q + i * (H * K) + p_qk, mask=m2, other=0.0).to(tl.float32)
            b_ki = tl.load(k + i * (H * K) + p_qk, mask=m2, other=0.0).to(tl.float32)
            b_bi = tl.load(beta + i * HV + o_hv, mask=m_hv, other=0.0).to(tl.float32)
            cq += tl.load(dAqk + o_A, mask=m_hv, other=0.0)[:, None] * b_qi * e
            ckk += (tl.load(dAkk + o_A, mask=m_hv & (o_hv * 0 + i > t), other=0.0) * b_bi)[:, None] * b_ki * e
        o_t = t * (HV * K) + p_g
        tl.store(dq + o_t, tl.load(dq + o_t, mask=m2, other=0.0) + rq, mask=m2)
        tl.store(dk + o_t, tl.load(dk + o_t, mask=m2, other=0.0) + b_beta[:, None] * rk + cq + ckk, mask=m2)
        dG = b_q * rq + b_k * (b_beta[:, None] * rk - cq - ckk)
        tl.store(dg + o_t, tl.load(dg + o_t, mask=m2, other=0.0) + dG, mask=m2)
        tl.store(db + t * HV + o_hv, tl.sum(b_k * rk, axis=1), mask=m_hv)
