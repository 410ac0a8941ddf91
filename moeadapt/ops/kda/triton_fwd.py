"""Forward Triton kernels of chunked KDA (see `triton_kda.py` for the math and the wrapper).

Owns the per-chunk intra kernels (G, Akk, Aqk, Ti; w, u, k e^(gam-G), q e^G), the state recurrence, the output
kernel and the in-chunk gate cumsum the backward reads. Imports only triton.
"""

import triton
import triton.language as tl


@triton.jit
def _load_g(g, o_g, mask, A_log, dt_bias, i_hv, ck, K: tl.constexpr, USE_GATE: tl.constexpr):
    """The log decay tile (float32): g itself, or with USE_GATE the fused gate
    -exp(A_log[h]) * softplus(g + dt_bias[h]) of the raw input (0 on masked rows)."""
    x = tl.load(g + o_g, mask=mask, other=0.0).to(tl.float32)
    if USE_GATE:
        x = x + tl.load(dt_bias + i_hv * K + ck).to(tl.float32)[None, :]
        sp = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        x = tl.where(mask, -tl.exp(tl.load(A_log + i_hv).to(tl.float32)) * sp, 0.0)
    return x


@triton.jit
def _sub_tile(x, tok, m, col, stride):
    """Rows tok (mask m) of a [tokens, stride] row-major tensor at the columns col, as float32 [BC, BK]."""
    return tl.load(x + tok[:, None] * stride + col[None, :], mask=m[:, None], other=0.0).to(tl.float32)


@triton.jit
def _inv_unit_lower(N, eye, PREC: tl.constexpr):
    """(I + N)^-1 of a strictly lower 16x16 block: (I - N)(I + N^2)(I + N^4)(I + N^8), as N^16 = 0."""
    P = tl.dot(N, N, input_precision=PREC)
    X = tl.dot(eye - N, eye + P, input_precision=PREC)
    P = tl.dot(P, P, input_precision=PREC)
    X = tl.dot(X, eye + P, input_precision=PREC)
    P = tl.dot(P, P, input_precision=PREC)
    return tl.dot(X, eye + P, input_precision=PREC)


@triton.jit
def _g_sub(g, t, m, cg, sg, A_log, dt_bias, i_hv, ck, carry, K: tl.constexpr, USE_GATE: tl.constexpr):
    """One sub-chunk's in-chunk cumulative gate G [BC, BK] (carry: the sum of g over the chunk's earlier rows; rows
    past the end add 0, so there G stays at the last valid row's value) and the carry after it."""
    x = _load_g(g, t[:, None] * sg + cg[None, :], m[:, None], A_log, dt_bias, i_hv, ck, K, USE_GATE)
    return tl.cumsum(x, axis=0) + carry[None, :], carry + tl.sum(x, axis=0)


@triton.jit
def _row(x, ii, r):
    """Row r of a [BC, BK] tile, as [BK]."""
    return tl.sum(tl.where(ii[:, None] == r, x, 0.0), axis=0)


@triton.jit
def _diag_dots(q_a, k_a, G_a, m_a, ii, aq, ak, DPREC: tl.constexpr, DIAG_SPREAD: tl.constexpr, BC: tl.constexpr):
    """This K-block's share of the diagonal block (a, a): aq += sum_c q_ic k_jc e^(G_ic - G_jc), ak the same with k_i
    (all i, j; the caller keeps j <= i / j < i). By tensor-core dots split at the sub-chunk's middle gate rm when
    every channel decays by at most DIAG_SPREAD across the sub-chunk (each factor then within e^(+-DIAG_SPREAD/2)),
    else column by column with E = e^-|G_i - G_j| (= e^(G_i - G_j) for i >= j: G is non-increasing)."""
    g_first = _row(G_a, ii, 0)
    g_last = _row(G_a, ii, BC - 1)
    if tl.max(g_first - g_last, axis=0) <= DIAG_SPREAD:
        rm = (0.5 * (g_first + g_last))[None, :]
        c = tl.trans(tl.where(m_a[:, None], k_a * tl.exp(rm - G_a), 0.0))
        e = tl.where(m_a[:, None], tl.exp(G_a - rm), 0.0)
        aq = tl.dot(q_a * e, c, aq, input_precision=DPREC)
        ak = tl.dot(k_a * e, c, ak, input_precision=DPREC)
    else:
        for j in range(0, BC):
            kE = _row(k_a, ii, j)[None, :] * tl.exp(-tl.abs(G_a - _row(G_a, ii, j)[None, :]))
            sel = ii[None, :] == j
            aq += tl.where(sel, tl.sum(q_a * kE, axis=1)[:, None], 0.0)
            ak += tl.where(sel, tl.sum(k_a * kE, axis=1)[:, None], 0.0)
    return aq, ak


@triton.jit
def _fwd_intra(
    q, k, g, beta, Aqk, Ti, cu, cidx, A_log, dt_bias,
    H, HV, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, DPREC: tl.constexpr,
    USE_GATE: tl.constexpr, DIAG_SPREAD: tl.constexpr,
):
    """Per (chunk, head), on the four 16-row sub-chunks 0..3 of the chunk, in two passes over the K-blocks (each
    taking G, the in-chunk cumsum of g with the gate fused, itself): first the four diagonal blocks of Akk and Aqk
    (`_diag_dots`; Aqk's stored, D_a = (I + Akk_aa)^-1 kept), then the six off-diagonal blocks (a > b) by dots
    split at the reference row r = G at the first row of sub-chunk a,
      A_ab = (x_a e^(G_a - r)) (k_b e^(r - G_b))^T    (both factors <= 1),
    and Ti = (I + Akk)^-1 blockwise. Two passes, so that the diagonal blocks' elementwise fallback and the twelve
    off-diagonal accumulators are not live at once (fewer register spills). Every 16x16 block of the 64-wide rows
    is stored (the upper ones as zeros), as `_fwd_wu`, `_fwd_o` and the backward read the rows whole."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, bos, eos, t0 = _chunk_span(cu, cidx, i_c, BT)
    L = tl.minimum(eos - t0, BT)
    ii = tl.arange(0, BC)
    m0, m1, m2, m3 = ii < L, ii + BC < L, ii + 2 * BC < L, ii + 3 * BC < L
    t_0, t_1, t_2, t_3 = t0 + ii, t0 + BC + ii, t0 + 2 * BC + ii, t0 + 3 * BC + ii
    sq, sg = H * K, HV * K
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    kz = tl.zeros([BK], dtype=tl.float32)
    # pass 1: the diagonal blocks
    q00, q11, q22, q33, k00, k11, k22, k33 = zero, zero, zero, zero, zero, zero, zero, zero
    for kb in range(0, K, BK):
        ck = kb + tl.arange(0, BK)
        cq = i_h * K + ck
        cg = i_hv * K + ck
        G_a, s = _g_sub(g, t_0, m0, cg, sg, A_log, dt_bias, i_hv, ck, kz, K, USE_GATE)
        q00, k00 = _diag_dots(_sub_tile(q, t_0, m0, cq, sq), _sub_tile(k, t_0, m0, cq, sq), G_a, m0, ii, q00, k00,
                              DPREC, DIAG_SPREAD, BC)
        G_a, s = _g_sub(g, t_1, m1, cg, sg, A_log, dt_bias, i_hv, ck, s, K, USE_GATE)
        q11, k11 = _diag_dots(_sub_tile(q, t_1, m1, cq, sq), _sub_tile(k, t_1, m1, cq, sq), G_a, m1, ii, q11, k11,
                              DPREC, DIAG_SPREAD, BC)
        G_a, s = _g_sub(g, t_2, m2, cg, sg, A_log, dt_bias, i_hv, ck, s, K, USE_GATE)
        q22, k22 = _diag_dots(_sub_tile(q, t_2, m2, cq, sq), _sub_tile(k, t_2, m2, cq, sq), G_a, m2, ii, q22, k22,
                              DPREC, DIAG_SPREAD, BC)
        G_a, s = _g_sub(g, t_3, m3, cg, sg, A_log, dt_bias, i_hv, ck, s, K, USE_GATE)
        q33, k33 = _diag_dots(_sub_tile(q, t_3, m3, cq, sq), _sub_tile(k, t_3, m3, cq, sq), G_a, m3, ii, q33, k33,
                              DPREC, DIAG_SPREAD, BC)
    # Aqk keeps the diagonal blocks on and below the diagonal, Akk (rows times beta) strictly below
    SA = HV * BT
    o_0, o_1, o_2, o_3 = t_0 * SA + i_hv * BT, t_1 * SA + i_hv * BT, t_2 * SA + i_hv * BT, t_3 * SA + i_hv * BT
    c0, c1, c2, c3 = ii, BC + ii, 2 * BC + ii, 3 * BC + ii
    low = ii[:, None] >= ii[None, :]
    slow = ii[:, None] > ii[None, :]
    tl.store(Aqk + o_0[:, None] + c0[None, :], tl.where(low, q00, 0.0), mask=m0[:, None])
    tl.store(Aqk + o_1[:, None] + c1[None, :], tl.where(low, q11, 0.0), mask=m1[:, None])
    tl.store(Aqk + o_2[:, None] + c2[None, :], tl.where(low, q22, 0.0), mask=m2[:, None])
    tl.store(Aqk + o_3[:, None] + c3[None, :], tl.where(low, q33, 0.0), mask=m3[:, None])
    b_0 = tl.load(beta + t_0 * HV + i_hv, mask=m0, other=0.0).to(tl.float32)[:, None]
    b_1 = tl.load(beta + t_1 * HV + i_hv, mask=m1, other=0.0).to(tl.float32)[:, None]
    b_2 = tl.load(beta + t_2 * HV + i_hv, mask=m2, other=0.0).to(tl.float32)[:, None]
    b_3 = tl.load(beta + t_3 * HV + i_hv, mask=m3, other=0.0).to(tl.float32)[:, None]
    eye = tl.where(ii[:, None] == ii[None, :], 1.0, 0.0)
    d0 = _inv_unit_lower(tl.where(slow, k00 * b_0, 0.0), eye, PREC)
    d1 = _inv_unit_lower(tl.where(slow, k11 * b_1, 0.0), eye, PREC)
    d2 = _inv_unit_lower(tl.where(slow, k22 * b_2, 0.0), eye, PREC)
    d3 = _inv_unit_lower(tl.where(slow, k33 * b_3, 0.0), eye, PREC)
    # pass 2: the off-diagonal blocks
    q10, q20, q21, q30, q31, q32 = zero, zero, zero, zero, zero, zero
    k10, k20, k21, k30, k31, k32 = zero, zero, zero, zero, zero, zero
    for kb in range(0, K, BK):
        ck = kb + tl.arange(0, BK)
        cq = i_h * K + ck
        cg = i_hv * K + ck
        G_0, s = _g_sub(g, t_0, m0, cg, sg, A_log, dt_bias, i_hv, ck, kz, K, USE_GATE)
        G_1, s = _g_sub(g, t_1, m1, cg, sg, A_log, dt_bias, i_hv, ck, s, K, USE_GATE)
        G_2, s = _g_sub(g, t_2, m2, cg, sg, A_log, dt_bias, i_hv, ck, s, K, USE_GATE)
        k_0, k_1, k_2 = _sub_tile(k, t_0, m0, cq, sq), _sub_tile(k, t_1, m1, cq, sq), _sub_tile(k, t_2, m2, cq, sq)
        # row sub-chunk 1 against column sub-chunk 0 (reference: G at sub-chunk 1's first row, or the last valid
        # row's G where sub-chunk 1 is past the end: every exponent <= 0)
        g_r = _row(G_1, ii, 0)[None, :]
        e = tl.where(m1[:, None], tl.exp(G_1 - g_r), 0.0)
        qe, ke = _sub_tile(q, t_1, m1, cq, sq) * e, k_1 * e
        c = tl.trans(k_0 * tl.exp(g_r - G_0))
        q10 = tl.dot(qe, c, q10, input_precision=DPREC)
        k10 = tl.dot(ke, c, k10, input_precision=DPREC)
        # row sub-chunk 2 against 0, 1
        g_r = _row(G_2, ii, 0)[None, :]
        e = tl.where(m2[:, None], tl.exp(G_2 - g_r), 0.0)
        qe, ke = _sub_tile(q, t_2, m2, cq, sq) * e, k_2 * e
        c = tl.trans(k_0 * tl.exp(g_r - G_0))
        q20 = tl.dot(qe, c, q20, input_precision=DPREC)
        k20 = tl.dot(ke, c, k20, input_precision=DPREC)
        c = tl.trans(k_1 * tl.exp(g_r - G_1))
        q21 = tl.dot(qe, c, q21, input_precision=DPREC)
        k21 = tl.dot(ke, c, k21, input_precision=DPREC)
        # row sub-chunk 3 against 0, 1, 2
        G_3, s = _g_sub(g, t_3, m3, cg, sg, A_log, dt_bias, i_hv, ck, s, K, USE_GATE)
        g_r = _row(G_3, ii, 0)[None, :]
        e = tl.where(m3[:, None], tl.exp(G_3 - g_r), 0.0)
        qe, ke = _sub_tile(q, t_3, m3, cq, sq) * e, _sub_tile(k, t_3, m3, cq, sq) * e
        c = tl.trans(k_0 * tl.exp(g_r - G_0))
        q30 = tl.dot(qe, c, q30, input_precision=DPREC)
        k30 = tl.dot(ke, c, k30, input_precision=DPREC)
        c = tl.trans(k_1 * tl.exp(g_r - G_1))
        q31 = tl.dot(qe, c, q31, input_precision=DPREC)
        k31 = tl.dot(ke, c, k31, input_precision=DPREC)
        c = tl.trans(k_2 * tl.exp(g_r - G_2))
        q32 = tl.dot(qe, c, q32, input_precision=DPREC)
        k32 = tl.dot(ke, c, k32, input_precision=DPREC)
    k10, k20, k21, k30, k31, k32 = k10 * b_1, k20 * b_2, k21 * b_2, k30 * b_3, k31 * b_3, k32 * b_3
    tl.store(Aqk + o_0[:, None] + c1[None, :], zero, mask=m0[:, None])
    tl.store(Aqk + o_0[:, None] + c2[None, :], zero, mask=m0[:, None])
    tl.store(Aqk + o_0[:, None] + c3[None, :], zero, mask=m0[:, None])
    tl.store(Aqk + o_1[:, None] + c0[None, :], q10, mask=m1[:, None])
    tl.store(Aqk + o_1[:, None] + c2[None, :], zero, mask=m1[:, None])
    tl.store(Aqk + o_1[:, None] + c3[None, :], zero, mask=m1[:, None])
    tl.store(Aqk + o_2[:, None] + c0[None, :], q20, mask=m2[:, None])
    tl.store(Aqk + o_2[:, None] + c1[None, :], q21, mask=m2[:, None])
    tl.store(Aqk + o_2[:, None] + c3[None, :], zero, mask=m2[:, None])
    tl.store(Aqk + o_3[:, None] + c0[None, :], q30, mask=m3[:, None])
    tl.store(Aqk + o_3[:, None] + c1[None, :], q31, mask=m3[:, None])
    tl.store(Aqk + o_3[:, None] + c2[None, :], q32, mask=m3[:, None])
    # Ti = (I + Akk)^-1, block lower triangular: D_a = (I + Akk_aa)^-1 and
    # Ti_ab = -D_a sum_{b <= m < a} Akk_am Ti_mb
    t10 = -tl.dot(d1, tl.dot(k10, d0, input_precision=PREC), input_precision=PREC)
    t21 = -tl.dot(d2, tl.dot(k21, d1, input_precision=PREC), input_precision=PREC)
    t20 = -tl.dot(d2, tl.dot(k21, t10, tl.dot(k20, d0, input_precision=PREC), input_precision=PREC),
                  input_precision=PREC)
    t32 = -tl.dot(d3, tl.dot(k32, d2, input_precision=PREC), input_precision=PREC)
    t31 = -tl.dot(d3, tl.dot(k32, t21, tl.dot(k31, d1, input_precision=PREC), input_precision=PREC),
                  input_precision=PREC)
    s30 = tl.dot(k31, t10, tl.dot(k30, d0, input_precision=PREC), input_precision=PREC)
    t30 = -tl.dot(d3, tl.dot(k32, t20, s30, input_precision=PREC), input_precision=PREC)
    _store_row_blocks(Ti, o_0, m0, c0, c1, c2, c3, d0, zero, zero, zero)
    _store_row_blocks(Ti, o_1, m1, c0, c1, c2, c3, t10, d1, zero, zero)
    _store_row_blocks(Ti, o_2, m2, c0, c1, c2, c3, t20, t21, d2, zero)
    _store_row_blocks(Ti, o_3, m3, c0, c1, c2, c3, t30, t31, t32, d3)


@triton.jit
def _store_row_blocks(A, o_r, m, c0, c1, c2, c3, x0, x1, x2, x3):
    """One sub-chunk's 16 rows (offsets o_r, mask m) of a 64-wide matrix, as its four 16x16 column blocks."""
    tl.store(A + o_r[:, None] + c0[None, :], x0, mask=m[:, None])
    tl.store(A + o_r[:, None] + c1[None, :], x1, mask=m[:, None])
    tl.store(A + o_r[:, None] + c2[None, :], x2, mask=m[:, None])
    tl.store(A + o_r[:, None] + c3[None, :], x3, mask=m[:, None])


@triton.jit
def _wu_k(b_Ti, g, q, k, b_beta, w, kd, qg, gl, tok, rows, rmask, ck, i_c, i_h, i_hv, A_log, dt_bias,
          H, HV, K: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, USE_GATE: tl.constexpr):
    """On the channels ck: w = Ti (beta k e^G), k e^(gam-G), q e^G and gam for one (chunk, head)."""
    o_qk = tok[:, None] * (H * K) + i_h * K + ck[None, :]
    o_g = tok[:, None] * (HV * K) + i_hv * K + ck[None, :]
    b_G = tl.cumsum(_load_g(g, o_g, rmask[:, None], A_log, dt_bias, i_hv, ck, K, USE_GATE), axis=0)
    b_k = tl.load(k + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
    b_q = tl.load(q + o_qk, mask=rmask[:, None], other=0.0).to(tl.float32)
    eG = tl.exp(b_G)
    b_w = tl.dot(b_Ti, b_k * eG * b_beta[:, None], input_precision=PREC)
    tl.store(w + o_g, b_w.to(w.dtype.element_ty), mask=rmask[:, None])
    gam = tl.sum(tl.where((rows == BT - 1)[:, None], b_G, 0.0), axis=0)  # padded rows repeat G_last
    tl.store(kd + o_g, (b_k * tl.exp(gam[None, :] - b_G)).to(kd.dtype.element_ty), mask=rmask[:, None])
    tl.store(qg + o_g, (b_q * eG).to(qg.dtype.element_ty), mask=rmask[:, None])
    tl.store(gl + (i_c.to(tl.int64) * HV + i_hv) * K + ck, gam)


@triton.jit
def _wu_v(b_Ti, v, b_beta, u, tok, rmask, cv, i_hv, HV, V: tl.constexpr, PREC: tl.constexpr):
    """On the value channels cv: u = Ti (beta v) for one (chunk, head)."""
    o_v = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
    b_v = tl.load(v + o_v, mask=rmask[:, None], other=0.0).to(tl.float32)
    b_u = tl.dot(b_Ti, b_v * b_beta[:, None], input_precision=PREC)
    tl.store(u + o_v, b_u.to(u.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _fwd_wu(
    g, q, k, v, beta, Ti, w, u, kd, qg, gl, cu, cidx, A_log, dt_bias,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr, USE_GATE: tl.constexpr,
):
    """Per (chunk, head, block), after `_fwd_intra`, Ti read back: blocks 0..K/BK-1
    give w = Ti (beta k e^G), k e^(gam-G), q e^G and gam on BK channels; the next V/BV give u = Ti (beta v)."""
    i_c, i_hv, i_b = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h = i_hv // (HV // H)
    i_n, bos, eos, t0 = _chunk_span(cu, cidx, i_c, BT)
    rows = tl.arange(0, BT)
    rmask = rows < eos - t0
    tok = t0 + rows
    b_beta = tl.load(beta + tok * HV + i_hv, mask=rmask, other=0.0).to(tl.float32)
    b_Ti = tl.load(Ti + tok[:, None] * (HV * BT) + i_hv * BT + rows[None, :], mask=rmask[:, None], other=0.0)
    if i_b < K // BK:
        _wu_k(b_Ti, g, q, k, b_beta, w, kd, qg, gl, tok, rows, rmask, i_b * BK + tl.arange(0, BK), i_c, i_h, i_hv,
              A_log, dt_bias, H, HV, K, BT, PREC, USE_GATE)
    else:
        _wu_v(b_Ti, v, b_beta, u, tok, rmask, (i_b - K // BK) * BV + tl.arange(0, BV), i_hv, HV, V, PREC)


@triton.jit
def _state_setup(i_v, i_nh, cu, coff, s0, HV, K: tl.constexpr, V: tl.constexpr, KH: tl.constexpr,
                 BT: tl.constexpr, BV: tl.constexpr, HAS_S0: tl.constexpr):
    """Common start of the state recurrences (`_fwd_h` forward, `_bwd_dh` in reverse): the program's
    sequence, head and V-block, its chunk span, and the state's K/KH row blocks loaded from s0 (or zeros)."""
    i_n = i_nh // HV
    i_hv = i_nh % HV
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    c0 = tl.load(coff + i_n).to(tl.int64)
    NT = tl.cdiv(eos - bos, BT)
    c1 = tl.arange(0, KH)
    c2 = KH + tl.arange(0, KH)
    cv = i_v * BV + tl.arange(0, BV)
    o_s1 = c1[:, None] * V + cv[None, :]
    o_s2 = c2[:, None] * V + cv[None, :]
    b_S1 = tl.zeros([KH, BV], dtype=tl.float32)
    b_S2 = tl.zeros([KH, BV], dtype=tl.float32)
    if HAS_S0:
        b_S1 = tl.load(s0 + (i_n * HV + i_hv) * K * V + o_s1).to(tl.float32)
        if K // KH == 2:
            b_S2 = tl.load(s0 + (i_n * HV + i_hv) * K * V + o_s2).to(tl.float32)
    return i_n, i_hv, bos, eos, c0, NT, c1, c2, cv, o_s1, o_s2, b_S1, b_S2


@triton.jit
def _store_state(base, o_s1, o_s2, b_S1, b_S2, TWO: tl.constexpr):
    """One (sequence, head) state [K, BV] kept as one or two (TWO) row blocks, stored at base."""
    tl.store(base + o_s1, b_S1.to(base.dtype.element_ty))
    if TWO:
        tl.store(base + o_s2, b_S2.to(base.dtype.element_ty))


@triton.jit
def _chunk_rows(it, bos, eos, c0, i_hv, HV, rows, cv, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr):
    """Chunk `it` of a sequence in the state recurrences: (row mask, tokens, k / v / per-chunk-gate offsets)."""
    t0 = bos + it * BT
    rmask = rows < tl.minimum(eos - t0, BT)
    tok = t0 + rows
    o_k = tok[:, None] * (HV * K) + i_hv * K
    o_v = tok[:, None] * (HV * V) + i_hv * V + cv[None, :]
    o_gl = ((c0 + it) * HV + i_hv) * K
    return rmask, tok, o_k, o_v, o_gl


@triton.jit
def _fwd_h(
    kd, w, u, gl, h, vn, h0, ht, cu, coff,
    HV, K: tl.constexpr, V: tl.constexpr, KH: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
    HAS_H0: tl.constexpr, STORE_HT: tl.constexpr,
):
    """Per (V-block, sequence and head): the state recurrence over chunks, storing the state entering each
    chunk (h) and d = u - w S (vn). The state is kept as K/KH (1 or 2) row blocks of KH rows."""
    i_v, i_nh = tl.program_id(0), tl.program_id(1)
    i_n, i_hv, bos, eos, c0, NT, c1, c2, cv, o_s1, o_s2, b_S1, b_S2 = _state_setup(
        i_v, i_nh, cu, coff, h0, HV, K, V, KH, BT, BV, HAS_H0)
    TWO: tl.constexpr = K // KH == 2
    rows = tl.arange(0, BT)
    DT = w.dtype.element_ty
    for it in range(0, NT):
        rmask, tok, o_k, o_v, o_gl = _chunk_rows(it, bos, eos, c0, i_hv, HV, rows, cv, K, V, BT)
        _store_state(h + ((c0 + it) * HV + i_hv) * K * V, o_s1, o_s2, b_S1, b_S2, TWO)
        b_d = tl.load(u + o_v, mask=rmask[:, None], other=0.0).to(tl.float32)
        b_d = tl.dot(tl.load(w + o_k + c1[None, :], mask=rmask[:, None], other=0.0), (-b_S1).to(DT), b_d,
                     input_precision=PREC)
        if TWO:
            b_d = tl.dot(tl.load(w + o_k + c2[None, :], mask=rmask[:, None], other=0.0), (-b_S2).to(DT), b_d,
                         input_precision=PREC)
        tl.store(vn + o_v, b_d.to(vn.dtype.element_ty), mask=rmask[:, None])
        b_dc = b_d.to(DT)
        b_kd = tl.load(kd + o_k + c1[None, :], mask=rmask[:, None], other=0.0)
        b_S1 = tl.dot(tl.trans(b_kd), b_dc, b_S1 * tl.exp(tl.load(gl + o_gl + c1))[:, None], input_precision=PREC)
        if TWO:
            b_kd = tl.load(kd + o_k + c2[None, :], mask=rmask[:, None], other=0.0)
            b_S2 = tl.dot(tl.trans(b_kd), b_dc, b_S2 * tl.exp(tl.load(gl + o_gl + c2))[:, None],
                          input_precision=PREC)
    if STORE_HT:
        _store_state(ht + (i_n * HV + i_hv) * K * V, o_s1, o_s2, b_S1, b_S2, TWO)


@triton.jit
def _fwd_o(
    qg, h, vn, Aqk, o, cu, cidx, scale,
    H, HV, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):
    i_v, i_c, i_hv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, bos, eos, t0 = _chunk_span(cu, cidx, i_c, BT)
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
    b_o = tl.dot(b_A.to(DT), b_d, tl.dot(b_qg, b_h.to(DT), input_precision=PREC), input_precision=PREC)
    tl.store(o + o_v, (b_o * scale).to(o.dtype.element_ty), mask=rmask[:, None])


@triton.jit
def _chunk_span(cu, cidx, i_c, BT: tl.constexpr):
    """Chunk i_c -> (its sequence i_n, the sequence's [bos, eos) in tokens, the chunk's first token t0)."""
    i_n = tl.load(cidx + 2 * i_c)
    i_t = tl.load(cidx + 2 * i_c + 1)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    return i_n, bos, eos, bos + i_t * BT
