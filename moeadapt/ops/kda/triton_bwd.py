"""Backward Triton kernels of chunked KDA (see `triton_kda.py` for the math and the wrapper).

Owns the reverse state recurrence and the per-chunk / token-parallel gradient kernels. Imports only triton.
"""

import triton
import triton.language as tl

from .triton_fwd import _chunk_span, _load_g, _state_setup, _store_state, _sub_tile


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
        tl.store(dv + o_v, (b_dRu * b_beta[:, None]).to(dv.dtype.element_ty), mask=rmask[:, None])
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
    q, k, g, beta, h, dh, vn, dRu, do, dq, dk, dg, db, Gc, cu, cidx, scale, T_total, A_log, dt_bias,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, USE_GATE: tl.constexpr,
):
    """Per (chunk, head, K-block): state and WY terms of dq, dk (partial, in their buffers' dtype), dg (partial,
    float32), dbeta (partial); also the in-chunk cumulative gate G into Gc (float32), which _bwd_intra reads."""
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
    tl.store(dq + o_g, b_dq.to(dq.dtype.element_ty), mask=rmask[:, None])
    tl.store(dk + o_g, b_dk.to(dk.dtype.element_ty), mask=rmask[:, None])
    tl.store(dg + o_g, dG, mask=rmask[:, None])
    tl.store(Gc + o_g, b_G, mask=rmask[:, None])
    tl.store(db + i_k * T_total * HV + tok * HV + i_hv, tl.sum(dRw * rw, axis=1), mask=rmask)


@triton.jit
def _dA_block(A, o_r, m, cols):
    """A 16x16 block of a [tokens, HV, 64] float32 matrix: rows at offsets o_r (mask m), columns cols."""
    return tl.load(A + o_r[:, None] + cols[None, :], mask=m[:, None], other=0.0)


@triton.jit
def _bwd_sub_add(dq, dk, dg, tok, m, cg, sg, b_q, b_k, b_b, rq, rk, cq, ckk):
    """One sub-chunk: dq += rq and dk += beta rk + cq + ckk in place, in their buffers' dtype (each element is read
    and written by this program only); returns dG = (partial dg) + q rq + k (beta rk - cq - ckk)."""
    o = tok[:, None] * sg + cg[None, :]
    mm = m[:, None]
    tl.store(dq + o, (tl.load(dq + o, mask=mm, other=0.0).to(tl.float32) + rq).to(dq.dtype.element_ty), mask=mm)
    tl.store(dk + o, (tl.load(dk + o, mask=mm, other=0.0).to(tl.float32) + b_b * rk + cq + ckk)
             .to(dk.dtype.element_ty), mask=mm)
    return tl.load(dg + o, mask=mm, other=0.0) + b_q * rq + b_k * (b_b * rk - cq - ckk)


@triton.jit
def _bwd_sub_dg(dg_out, g, o_dA, tok, m, ck, cg, sg, s_from, dG, A_log, dt_bias, i_hv, HV, K: tl.constexpr,
                USE_GATE: tl.constexpr):
    """One sub-chunk's dg = (sum of dG from its first row to the chunk's end: s_from at the first row) - the
    in-sub-chunk cumsum + dG, stored into dg_out in its dtype; with USE_GATE, through the fused gate (d/dA_log
    partials per row into o_dA). Returns the float32 sum of the stored dg over the sub-chunk's valid rows (its
    share of d dt_bias, which is dg summed over tokens)."""
    b_dg = s_from[None, :] - tl.cumsum(dG, axis=0) + dG
    o = tok[:, None] * sg + cg[None, :]
    mm = m[:, None]
    if USE_GATE:  # d/dA_log of g is g; d/d(raw) is -exp(A_log) sigmoid(raw + dt_bias)
        tl.store(o_dA + tok * HV, tl.sum(b_dg * _load_g(g, o, mm, A_log, dt_bias, i_hv, ck, K, USE_GATE),
                                                 axis=1), mask=m)
        x = tl.load(g + o, mask=mm, other=0.0).to(tl.float32) + tl.load(dt_bias + i_hv * K + ck).to(tl.float32)[None, :]
        b_dg *= -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * tl.sigmoid(x)
    tl.store(dg_out + o, b_dg.to(dg_out.dtype.element_ty), mask=mm)
    return tl.sum(tl.where(mm, b_dg, 0.0), axis=0)


@triton.jit
def _bwd_intra(
    q, k, g, Gc, beta, dAqk, dAkk, dq, dk, dg, db, cu, cidx, T_total, A_log, dt_bias, dA, dg_out,
    ddt, H, HV, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, DPREC: tl.constexpr, USE_GATE: tl.constexpr,
    DIAG_SPREAD: tl.constexpr, DDT: tl.constexpr,
):
    """Per (chunk, head, K-block), the sub-chunks i = last..0 one at a time: every intra-chunk pair term of Aqk and
    Akk added to the partials in dq, dk, dg, dbeta, then dg = reverse cumsum of dG within the chunk (the sum over
    the later sub-chunks carried in s). With X = q or beta k, for the blocks (i, j < i) and (a > i, i):
      row side     r_i += e^(G_i - ra) sum_j dA_ij (k_j e^(ra - G_j)),     ra = G at the first row of i
      column side  c_i += e^(rb - G_i) sum_a dA_ai^T (X_a e^(G_a - rb)),   rb = G at the last row of i
    (every factor <= 1). The diagonal block (i, i) splits at the sub-chunk's middle gate rm instead (factors within
    e^(+-DIAG_SPREAD/2): taken only where every channel of the K-block decays by at most DIAG_SPREAD within the
    sub-chunk), else runs elementwise per column / row c with E = e^-|G_r - G_c|, which is e^(G_r - G_c) for r >= c
    and e^(G_c - G_r) for r <= c because G is non-increasing (g <= 0): one exponential serves both sides.
    DDT: the chunk's sum of the stored dg over its tokens goes to ddt[chunk, head, K-block columns] (float32), so
    that d dt_bias is a sum over chunks, not a pass over a float32 copy of dg."""
    i_c, i_hv, i_k = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, bos, eos, t0 = _chunk_span(cu, cidx, i_c, BT)
    L = tl.minimum(eos - t0, BT)
    NS = tl.cdiv(L, BC)
    ii = tl.arange(0, BC)
    ck = i_k * BK + tl.arange(0, BK)
    cq = i_h * K + ck
    cg = i_hv * K + ck
    sq, sg, SA = H * K, HV * K, HV * BT
    o_db = db + i_k * T_total * HV + i_hv
    o_dA = dA + i_k * T_total * HV + i_hv
    s = tl.zeros([BK], dtype=tl.float32)  # sum of dG over the rows after the current sub-chunk
    sdt = tl.zeros([BK], dtype=tl.float32)  # DDT: sum of the stored dg over the chunk's rows
    for n in range(0, NS):
        i = NS - 1 - n
        t_i = t0 + i * BC + ii
        m_i = t_i < eos
        q_i = _sub_tile(q, t_i, m_i, cq, sq)
        k_i = _sub_tile(k, t_i, m_i, cq, sq)
        G_i = _sub_tile(Gc, t_i, m_i, cg, sg)
        b_i = tl.load(beta + t_i * HV + i_hv, mask=m_i, other=0.0).to(tl.float32)
        o_i = t_i * SA + i_hv * BT
        # G at i's first and last valid rows: the reference rows of both sides and the diagonal block's spread
        g_first = tl.load(Gc + (t0 + i * BC) * sg + cg)
        g_last = tl.load(Gc + tl.minimum(t0 + i * BC + BC - 1, eos - 1) * sg + cg)
        # row side, blocks (i, j < i): r_i += e^(G_i - ra) sum_j dA_ij (k_j e^(ra - G_j)), ra = G at i's first row
        ra = g_first[None, :]
        aq = tl.zeros([BC, BK], dtype=tl.float32)
        ak = tl.zeros([BC, BK], dtype=tl.float32)
        for j in range(0, i):
            t_j = t0 + j * BC + ii
            c = _sub_tile(k, t_j, t_j < eos, cq, sq) * tl.exp(ra - _sub_tile(Gc, t_j, t_j < eos, cg, sg))
            aq = tl.dot(_dA_block(dAqk, o_i, m_i, j * BC + ii), c, aq, input_precision=DPREC)
            ak = tl.dot(_dA_block(dAkk, o_i, m_i, j * BC + ii), c, ak, input_precision=DPREC)
        e = tl.where(m_i[:, None], tl.exp(G_i - ra), 0.0)
        rq = e * aq
        rk = e * ak
        # column side, blocks (a > i, i): c_i += e^(rb - G_i) sum_a dA_ai^T (X_a e^(G_a - rb)), rb = G at i's last row
        rb = g_last[None, :]
        aq = tl.zeros([BC, BK], dtype=tl.float32)
        ak = tl.zeros([BC, BK], dtype=tl.float32)
        for a in range(i + 1, NS):
            t_a = t0 + a * BC + ii
            m_a = t_a < eos
            e = tl.where(m_a[:, None], tl.exp(_sub_tile(Gc, t_a, m_a, cg, sg) - rb), 0.0)
            b_a = tl.load(beta + t_a * HV + i_hv, mask=m_a, other=0.0).to(tl.float32)[:, None]
            o_a = t_a * SA + i_hv * BT
            aq = tl.dot(tl.trans(_dA_block(dAqk, o_a, m_a, i * BC + ii)), _sub_tile(q, t_a, m_a, cq, sq) * e, aq,
                        input_precision=DPREC)
            ak = tl.dot(tl.trans(_dA_block(dAkk, o_a, m_a, i * BC + ii)), _sub_tile(k, t_a, m_a, cq, sq) * b_a * e,
                        ak, input_precision=DPREC)
        e = tl.exp(rb - G_i)
        cqq = e * aq
        ckk = e * ak
        # the diagonal block (i, i): by tensor-core dots split at the sub-chunk's middle gate rm when every channel
        # of this K-block decays by at most DIAG_SPREAD within it (each factor then within e^(+-DIAG_SPREAD/2)),
        # else elementwise per column / row c = token t_c
        if tl.max(g_first - g_last, axis=0) <= DIAG_SPREAD:
            rm = (0.5 * (g_first + g_last))[None, :]
            eq = tl.where(m_i[:, None], tl.exp(G_i - rm), 0.0)
            ek = tl.where(m_i[:, None], tl.exp(rm - G_i), 0.0)
            Dq = _dA_block(dAqk, o_i, m_i, i * BC + ii)
            Dk = _dA_block(dAkk, o_i, m_i, i * BC + ii)
            Dq = tl.where(ii[:, None] >= ii[None, :], Dq, 0.0)
            Dk = tl.where(ii[:, None] > ii[None, :], Dk, 0.0)
            kE = k_i * ek
            rq += eq * tl.dot(Dq, kE, input_precision=DPREC)
            rk += eq * tl.dot(Dk, kE, input_precision=DPREC)
            cqq += ek * tl.dot(tl.trans(Dq), q_i * eq, input_precision=DPREC)
            ckk += ek * tl.dot(tl.trans(Dk), k_i * b_i[:, None] * eq, input_precision=DPREC)
        else:
            for c in range(0, tl.minimum(BC, L - i * BC)):
                t_c = t0 + i * BC + c
                k_c = tl.load(k + t_c * sq + cq).to(tl.float32)[None, :]
                q_c = tl.load(q + t_c * sq + cq).to(tl.float32)[None, :]
                E = tl.exp(-tl.abs(G_i - tl.load(Gc + t_c * sg + cg)[None, :]))
                d_q = tl.load(dAqk + o_i + i * BC + c, mask=m_i & (ii >= c), other=0.0)  # column c (rows >= c)
                d_k = tl.load(dAkk + o_i + i * BC + c, mask=m_i & (ii > c), other=0.0)
                rq += d_q[:, None] * E * k_c
                rk += d_k[:, None] * E * k_c
                o_c = t_c * SA + i_hv * BT + i * BC + ii  # row c (columns <= c)
                d_q = tl.load(dAqk + o_c, mask=ii <= c, other=0.0)
                d_k = tl.load(dAkk + o_c, mask=ii < c, other=0.0) * tl.load(beta + t_c * HV + i_hv).to(tl.float32)
                cqq += d_q[:, None] * E * q_c
                ckk += d_k[:, None] * E * k_c
        dG = _bwd_sub_add(dq, dk, dg, t_i, m_i, cg, sg, q_i, k_i, b_i[:, None], rq, rk, cqq, ckk)
        s += tl.sum(dG, axis=0)
        dg_sum = _bwd_sub_dg(dg_out, g, o_dA, t_i, m_i, ck, cg, sg, s, dG, A_log, dt_bias, i_hv, HV, K, USE_GATE)
        if DDT:  # (without it the sum is dead code: no loop-carried value for the compiler to keep)
            sdt += dg_sum
        tl.store(o_db + t_i * HV, tl.sum(k_i * rk, axis=1), mask=m_i)
    if DDT:
        tl.store(ddt + i_c * sg + cg, sdt)
