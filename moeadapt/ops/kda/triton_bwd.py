"""Backward Triton kernels of chunked KDA (see `triton_kda.py` for the math and the wrapper).

Owns the reverse state recurrence and the per-chunk / token-parallel gradient kernels. Imports only triton.
"""

import triton
import triton.language as tl

from .triton_fwd import _chunk_span, _load_g, _state_setup, _store_state, _sub_tile, _tok_setup


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
    q, k, g, Gc, beta, dAqk, dAkk, dq, dk, dg, db, cu, cidx, T_total, A_log, dt_bias, dA,
    H, HV, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DPREC: tl.constexpr, USE_GATE: tl.constexpr,
):
    """Per (chunk, head, K-block), on the four 16-row sub-chunks 0..3: the six off-diagonal blocks' (a > b) pair
    terms of Aqk and Akk added to dq, dk, dg, dbeta (the diagonal blocks' were added by the token-parallel
    `_bwd_diag`, run before), then dg = reverse cumsum of dG within the chunk. With X = q or beta k:
      row side     r_a += e^(G_a - ra) sum_b dA_ab (k_b e^(ra - G_b)),     ra = G at the first row of a
      column side  c_b += e^(rb - G_b) sum_a dA_ab^T (X_a e^(G_a - rb)),   rb = G at the last row of b
    (every factor <= 1; reference rows clamped to the last valid row, as in `_fwd_intra`)."""
    i_c, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, bos, eos, t0 = _chunk_span(cu, cidx, i_c, BT)
    L = tl.minimum(eos - t0, BT)
    ii = tl.arange(0, BC)
    m0, m1, m2, m3 = ii < L, ii + BC < L, ii + 2 * BC < L, ii + 3 * BC < L
    t_0, t_1, t_2, t_3 = t0 + ii, t0 + BC + ii, t0 + 2 * BC + ii, t0 + 3 * BC + ii
    ck = i_k * BK + tl.arange(0, BK)
    cq = i_h * K + ck
    cg = i_hv * K + ck
    sq, sg, SA = H * K, HV * K, HV * BT
    # the off-diagonal dA blocks
    o_1, o_2, o_3 = t_1 * SA + i_hv * BT, t_2 * SA + i_hv * BT, t_3 * SA + i_hv * BT
    aq10, ak10 = _dA_block(dAqk, o_1, m1, ii), _dA_block(dAkk, o_1, m1, ii)
    aq20, ak20 = _dA_block(dAqk, o_2, m2, ii), _dA_block(dAkk, o_2, m2, ii)
    aq21, ak21 = _dA_block(dAqk, o_2, m2, BC + ii), _dA_block(dAkk, o_2, m2, BC + ii)
    aq30, ak30 = _dA_block(dAqk, o_3, m3, ii), _dA_block(dAkk, o_3, m3, ii)
    aq31, ak31 = _dA_block(dAqk, o_3, m3, BC + ii), _dA_block(dAkk, o_3, m3, BC + ii)
    aq32, ak32 = _dA_block(dAqk, o_3, m3, 2 * BC + ii), _dA_block(dAkk, o_3, m3, 2 * BC + ii)
    G_0, G_1 = _sub_tile(Gc, t_0, m0, cg, sg), _sub_tile(Gc, t_1, m1, cg, sg)
    G_2, G_3 = _sub_tile(Gc, t_2, m2, cg, sg), _sub_tile(Gc, t_3, m3, cg, sg)
    k_0, k_1 = _sub_tile(k, t_0, m0, cq, sq), _sub_tile(k, t_1, m1, cq, sq)
    k_2, k_3 = _sub_tile(k, t_2, m2, cq, sq), _sub_tile(k, t_3, m3, cq, sq)
    q_1, q_2, q_3 = _sub_tile(q, t_1, m1, cq, sq), _sub_tile(q, t_2, m2, cq, sq), _sub_tile(q, t_3, m3, cq, sq)
    b_0 = tl.load(beta + t_0 * HV + i_hv, mask=m0, other=0.0).to(tl.float32)[:, None]
    b_1 = tl.load(beta + t_1 * HV + i_hv, mask=m1, other=0.0).to(tl.float32)[:, None]
    b_2 = tl.load(beta + t_2 * HV + i_hv, mask=m2, other=0.0).to(tl.float32)[:, None]
    b_3 = tl.load(beta + t_3 * HV + i_hv, mask=m3, other=0.0).to(tl.float32)[:, None]
    # row side: sub-chunks 1..3 against the columns left of them
    ra = tl.load(Gc + tl.minimum(t0 + BC, eos - 1) * sg + cg)[None, :]
    c = k_0 * tl.exp(ra - G_0)
    e = tl.where(m1[:, None], tl.exp(G_1 - ra), 0.0)
    rq1 = e * tl.dot(aq10, c, input_precision=DPREC)
    rk1 = e * tl.dot(ak10, c, input_precision=DPREC)
    ra = tl.load(Gc + tl.minimum(t0 + 2 * BC, eos - 1) * sg + cg)[None, :]
    c = k_0 * tl.exp(ra - G_0)
    c1 = k_1 * tl.exp(ra - G_1)
    e = tl.where(m2[:, None], tl.exp(G_2 - ra), 0.0)
    rq2 = e * tl.dot(aq21, c1, tl.dot(aq20, c, input_precision=DPREC), input_precision=DPREC)
    rk2 = e * tl.dot(ak21, c1, tl.dot(ak20, c, input_precision=DPREC), input_precision=DPREC)
    ra = tl.load(Gc + tl.minimum(t0 + 3 * BC, eos - 1) * sg + cg)[None, :]
    c = k_0 * tl.exp(ra - G_0)
    c1 = k_1 * tl.exp(ra - G_1)
    c2 = k_2 * tl.exp(ra - G_2)
    e = tl.where(m3[:, None], tl.exp(G_3 - ra), 0.0)
    rq3 = e * tl.dot(aq32, c2, tl.dot(aq31, c1, tl.dot(aq30, c, input_precision=DPREC), input_precision=DPREC),
                     input_precision=DPREC)
    rk3 = e * tl.dot(ak32, c2, tl.dot(ak31, c1, tl.dot(ak30, c, input_precision=DPREC), input_precision=DPREC),
                     input_precision=DPREC)
    # column side: sub-chunks 0..2 against the rows below them (X_a e^(G_a - rb): q and beta k)
    kb_1, kb_2, kb_3 = k_1 * b_1, k_2 * b_2, k_3 * b_3
    rb = tl.load(Gc + tl.minimum(t0 + BC - 1, eos - 1) * sg + cg)[None, :]
    e1 = tl.where(m1[:, None], tl.exp(G_1 - rb), 0.0)
    e2 = tl.where(m2[:, None], tl.exp(G_2 - rb), 0.0)
    e3 = tl.where(m3[:, None], tl.exp(G_3 - rb), 0.0)
    e = tl.exp(rb - G_0)
    cq0 = e * _dot_t3(aq10, q_1 * e1, aq20, q_2 * e2, aq30, q_3 * e3, DPREC)
    ck0 = e * _dot_t3(ak10, kb_1 * e1, ak20, kb_2 * e2, ak30, kb_3 * e3, DPREC)
    rb = tl.load(Gc + tl.minimum(t0 + 2 * BC - 1, eos - 1) * sg + cg)[None, :]
    e2 = tl.where(m2[:, None], tl.exp(G_2 - rb), 0.0)
    e3 = tl.where(m3[:, None], tl.exp(G_3 - rb), 0.0)
    e = tl.exp(rb - G_1)
    cq1 = e * tl.dot(tl.trans(aq31), q_3 * e3, tl.dot(tl.trans(aq21), q_2 * e2, input_precision=DPREC),
                     input_precision=DPREC)
    ck1 = e * tl.dot(tl.trans(ak31), kb_3 * e3, tl.dot(tl.trans(ak21), kb_2 * e2, input_precision=DPREC),
                     input_precision=DPREC)
    rb = tl.load(Gc + tl.minimum(t0 + 3 * BC - 1, eos - 1) * sg + cg)[None, :]
    e3 = tl.where(m3[:, None], tl.exp(G_3 - rb), 0.0)
    e = tl.exp(rb - G_2)
    cq2 = e * tl.dot(tl.trans(aq32), q_3 * e3, input_precision=DPREC)
    ck2 = e * tl.dot(tl.trans(ak32), kb_3 * e3, input_precision=DPREC)
    # per sub-chunk: dq, dk and dG (the partials already in dq, dk, dg added), then dg = reverse cumsum of dG
    zero = tl.zeros([BC, BK], dtype=tl.float32)
    dG0 = _bwd_sub_add(dq, dk, dg, t_0, m0, cg, sg, _sub_tile(q, t_0, m0, cq, sq), k_0, b_0, zero, zero, cq0, ck0)
    dG1 = _bwd_sub_add(dq, dk, dg, t_1, m1, cg, sg, q_1, k_1, b_1, rq1, rk1, cq1, ck1)
    dG2 = _bwd_sub_add(dq, dk, dg, t_2, m2, cg, sg, q_2, k_2, b_2, rq2, rk2, cq2, ck2)
    dG3 = _bwd_sub_add(dq, dk, dg, t_3, m3, cg, sg, q_3, k_3, b_3, rq3, rk3, zero, zero)
    s3 = tl.sum(dG3, axis=0)
    s2 = s3 + tl.sum(dG2, axis=0)
    s1 = s2 + tl.sum(dG1, axis=0)
    s0 = s1 + tl.sum(dG0, axis=0)
    o_db = db + i_k * T_total * HV + i_hv
    o_dA = dA + i_k * T_total * HV + i_hv
    _bwd_sub_dg(dg, g, o_dA, t_0, m0, ck, cg, sg, s0, dG0, A_log, dt_bias, i_hv, HV, K, USE_GATE)
    _bwd_sub_dg(dg, g, o_dA, t_1, m1, ck, cg, sg, s1, dG1, A_log, dt_bias, i_hv, HV, K, USE_GATE)
    _bwd_sub_dg(dg, g, o_dA, t_2, m2, ck, cg, sg, s2, dG2, A_log, dt_bias, i_hv, HV, K, USE_GATE)
    _bwd_sub_dg(dg, g, o_dA, t_3, m3, ck, cg, sg, s3, dG3, A_log, dt_bias, i_hv, HV, K, USE_GATE)
    tl.store(o_db + t_0 * HV, tl.zeros([BC], dtype=tl.float32), mask=m0)
    tl.store(o_db + t_1 * HV, tl.sum(k_1 * rk1, axis=1), mask=m1)
    tl.store(o_db + t_2 * HV, tl.sum(k_2 * rk2, axis=1), mask=m2)
    tl.store(o_db + t_3 * HV, tl.sum(k_3 * rk3, axis=1), mask=m3)


@triton.jit
def _dA_block(A, o_r, m, cols):
    """A 16x16 block of a [tokens, HV, 64] float32 matrix: rows at offsets o_r (mask m), columns cols."""
    return tl.load(A + o_r[:, None] + cols[None, :], mask=m[:, None], other=0.0)


@triton.jit
def _dot_t3(a1, x1, a2, x2, a3, x3, DPREC: tl.constexpr):
    """a1^T x1 + a2^T x2 + a3^T x3 (16x16 blocks a, [16, BK] tiles x)."""
    acc = tl.dot(tl.trans(a1), x1, input_precision=DPREC)
    acc = tl.dot(tl.trans(a2), x2, acc, input_precision=DPREC)
    return tl.dot(tl.trans(a3), x3, acc, input_precision=DPREC)


@triton.jit
def _bwd_sub_add(dq, dk, dg, tok, m, cg, sg, b_q, b_k, b_b, rq, rk, cq, ckk):
    """One sub-chunk: dq += rq, dk += beta rk + cq + ckk stored; returns dG = (partial dg) + q rq + k (beta rk - cq
    - ckk)."""
    o = tok[:, None] * sg + cg[None, :]
    mm = m[:, None]
    tl.store(dq + o, tl.load(dq + o, mask=mm, other=0.0) + rq, mask=mm)
    tl.store(dk + o, tl.load(dk + o, mask=mm, other=0.0) + b_b * rk + cq + ckk, mask=mm)
    return tl.load(dg + o, mask=mm, other=0.0) + b_q * rq + b_k * (b_b * rk - cq - ckk)


@triton.jit
def _bwd_sub_dg(dg, g, o_dA, tok, m, ck, cg, sg, s_from, dG, A_log, dt_bias, i_hv, HV, K: tl.constexpr,
                USE_GATE: tl.constexpr):
    """One sub-chunk's dg = (sum of dG from its first row to the chunk's end: s_from at the first row) - the
    in-sub-chunk cumsum + dG; with USE_GATE, through the fused gate (d/dA_log partials per row into o_dA)."""
    b_dg = s_from[None, :] - tl.cumsum(dG, axis=0) + dG
    o = tok[:, None] * sg + cg[None, :]
    mm = m[:, None]
    if USE_GATE:  # d/dA_log of g is g; d/d(raw) is -exp(A_log) sigmoid(raw + dt_bias)
        tl.store(o_dA + tok * HV, tl.sum(b_dg * _load_g(g, o, mm, A_log, dt_bias, i_hv, ck, K, USE_GATE),
                                                 axis=1), mask=m)
        x = tl.load(g + o, mask=mm, other=0.0).to(tl.float32) + tl.load(dt_bias + i_hv * K + ck).to(tl.float32)[None, :]
        b_dg *= -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * tl.sigmoid(x)
    tl.store(dg + o, b_dg, mask=mm)


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
