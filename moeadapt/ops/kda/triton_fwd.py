"""Forward Triton kernels of chunked KDA (see `triton_kda.py` for the math and the wrapper).

Owns the per-chunk intra kernel (G, Akk, Aqk, Ti, w, u, k e^(gam-G), q e^G), the state recurrence,
the output kernel and the token-parallel diagonal-block kernels. Imports only triton.
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
def _fwd_intra(
    q, k, Gc, beta, Aqk, Ti, cu, cidx,
    H, HV, K: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr, DPREC: tl.constexpr,
):
    """Per (chunk, head), on the four 16-row sub-chunks 0..3 of the chunk: the six off-diagonal blocks (a > b) of
    Akk and Aqk by dots split at the reference row r = G at the first row of sub-chunk a,
      A_ab = (x_a e^(G_a - r)) (k_b e^(r - G_b))^T    (both factors <= 1),
    then Ti = (I + Akk)^-1 blockwise. The diagonal blocks were written by the token-parallel `_fwd_diag` (Akk
    with beta into the Ti buffer, Aqk) and are read back; every 16x16 block of the 64-wide rows is stored (the
    upper ones as zeros), as `_fwd_wu`, `_fwd_o` and the backward read the rows whole."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_h = i_hv // (HV // H)
    i_n, bos, eos, t0 = _chunk_span(cu, cidx, i_c, BT)
    L = tl.minimum(eos - t0, BT)
    ii = tl.arange(0, BC)
    m0, m1, m2, m3 = ii < L, ii + BC < L, ii + 2 * BC < L, ii + 3 * BC < L
    t_0, t_1, t_2, t_3 = t0 + ii, t0 + BC + ii, t0 + 2 * BC + ii, t0 + 3 * BC + ii
    # reference rows: a sub-chunk's first row, clamped to the last valid one (a sub-chunk past the end has no
    # valid rows; the clamp keeps every exponent <= 0)
    r_1, r_2, r_3 = tl.minimum(t0 + BC, eos - 1), tl.minimum(t0 + 2 * BC, eos - 1), tl.minimum(t0 + 3 * BC, eos - 1)
    sq, sg = H * K, HV * K
    zero = tl.zeros([BC, BC], dtype=tl.float32)
    q10, q20, q21, q30, q31, q32 = zero, zero, zero, zero, zero, zero
    k10, k20, k21, k30, k31, k32 = zero, zero, zero, zero, zero, zero
    for kb in range(0, K, BK):
        ck = kb + tl.arange(0, BK)
        cq = i_h * K + ck
        cg = i_hv * K + ck
        k_0, G_0 = _sub_tile(k, t_0, m0, cq, sq), _sub_tile(Gc, t_0, m0, cg, sg)
        k_1, G_1 = _sub_tile(k, t_1, m1, cq, sq), _sub_tile(Gc, t_1, m1, cg, sg)
        k_2, G_2 = _sub_tile(k, t_2, m2, cq, sq), _sub_tile(Gc, t_2, m2, cg, sg)
        # row sub-chunk 1 against column sub-chunk 0
        g_r = tl.load(Gc + r_1 * sg + cg)[None, :]
        e = tl.where(m1[:, None], tl.exp(G_1 - g_r), 0.0)
        qe, ke = _sub_tile(q, t_1, m1, cq, sq) * e, k_1 * e
        c = tl.trans(k_0 * tl.exp(g_r - G_0))
        q10 = tl.dot(qe, c, q10, input_precision=DPREC)
        k10 = tl.dot(ke, c, k10, input_precision=DPREC)
        # row sub-chunk 2 against 0, 1
        g_r = tl.load(Gc + r_2 * sg + cg)[None, :]
        e = tl.where(m2[:, None], tl.exp(G_2 - g_r), 0.0)
        qe, ke = _sub_tile(q, t_2, m2, cq, sq) * e, k_2 * e
        c = tl.trans(k_0 * tl.exp(g_r - G_0))
        q20 = tl.dot(qe, c, q20, input_precision=DPREC)
        k20 = tl.dot(ke, c, k20, input_precision=DPREC)
        c = tl.trans(k_1 * tl.exp(g_r - G_1))
        q21 = tl.dot(qe, c, q21, input_precision=DPREC)
        k21 = tl.dot(ke, c, k21, input_precision=DPREC)
        # row sub-chunk 3 against 0, 1, 2
        g_r = tl.load(Gc + r_3 * sg + cg)[None, :]
        e = tl.where(m3[:, None], tl.exp(_sub_tile(Gc, t_3, m3, cg, sg) - g_r), 0.0)
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
    # Akk rows carry beta
    b_1 = tl.load(beta + t_1 * HV + i_hv, mask=m1, other=0.0).to(tl.float32)[:, None]
    b_2 = tl.load(beta + t_2 * HV + i_hv, mask=m2, other=0.0).to(tl.float32)[:, None]
    b_3 = tl.load(beta + t_3 * HV + i_hv, mask=m3, other=0.0).to(tl.float32)[:, None]
    k10, k20, k21, k30, k31, k32 = k10 * b_1, k20 * b_2, k21 * b_2, k30 * b_3, k31 * b_3, k32 * b_3
    # the diagonal blocks (_fwd_diag): Aqk on and below the diagonal, Akk strictly below
    SA = HV * BT
    low = ii[:, None] >= ii[None, :]
    slow = ii[:, None] > ii[None, :]
    o_0, o_1, o_2, o_3 = t_0 * SA + i_hv * BT, t_1 * SA + i_hv * BT, t_2 * SA + i_hv * BT, t_3 * SA + i_hv * BT
    c0, c1, c2, c3 = ii, BC + ii, 2 * BC + ii, 3 * BC + ii
    _store_row_blocks(Aqk, o_0, m0, c0, c1, c2, c3,
                      tl.load(Aqk + o_0[:, None] + c0[None, :], mask=m0[:, None] & low, other=0.0), zero, zero, zero)
    _store_row_blocks(Aqk, o_1, m1, c0, c1, c2, c3, q10,
                      tl.load(Aqk + o_1[:, None] + c1[None, :], mask=m1[:, None] & low, other=0.0), zero, zero)
    _store_row_blocks(Aqk, o_2, m2, c0, c1, c2, c3, q20, q21,
                      tl.load(Aqk + o_2[:, None] + c2[None, :], mask=m2[:, None] & low, other=0.0), zero)
    _store_row_blocks(Aqk, o_3, m3, c0, c1, c2, c3, q30, q31, q32,
                      tl.load(Aqk + o_3[:, None] + c3[None, :], mask=m3[:, None] & low, other=0.0))
    # Ti = (I + Akk)^-1, block lower triangular: D_a = (I + Akk_aa)^-1 and
    # Ti_ab = -D_a sum_{b <= m < a} Akk_am Ti_mb
    eye = tl.where(ii[:, None] == ii[None, :], 1.0, 0.0)
    d0 = _inv_unit_lower(tl.load(Ti + o_0[:, None] + c0[None, :], mask=m0[:, None] & slow, other=0.0), eye, PREC)
    d1 = _inv_unit_lower(tl.load(Ti + o_1[:, None] + c1[None, :], mask=m1[:, None] & slow, other=0.0), eye, PREC)
    d2 = _inv_unit_lower(tl.load(Ti + o_2[:, None] + c2[None, :], mask=m2[:, None] & slow, other=0.0), eye, PREC)
    d3 = _inv_unit_lower(tl.load(Ti + o_3[:, None] + c3[None, :], mask=m3[:, None] & slow, other=0.0), eye, PREC)
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
def _fwd_gcum(
    g, Gc, cu, cidx, A_log, dt_bias, HV, K: tl.constexpr, BT: tl.constexpr, USE_GATE: tl.constexpr,
):
    """G = in-chunk cumulative sum of g (float32), per (chunk, head)."""
    i_c, i_hv = tl.program_id(0), tl.program_id(1)
    i_n, bos, eos, t0 = _chunk_span(cu, cidx, i_c, BT)
    rows = tl.arange(0, BT)
    rmask = rows < eos - t0
    ck = tl.arange(0, K)
    o_g = (t0 + rows)[:, None] * (HV * K) + i_hv * K + ck[None, :]
    b_G = tl.cumsum(_load_g(g, o_g, rmask[:, None], A_log, dt_bias, i_hv, ck, K, USE_GATE), axis=0)
    tl.store(Gc + o_g, b_G, mask=rmask[:, None])


@triton.jit
def _chunk_span(cu, cidx, i_c, BT: tl.constexpr):
    """Chunk i_c -> (its sequence i_n, the sequence's [bos, eos) in tokens, the chunk's first token t0)."""
    i_n = tl.load(cidx + 2 * i_c)
    i_t = tl.load(cidx + 2 * i_c + 1)
    bos = tl.load(cu + i_n).to(tl.int64)
    eos = tl.load(cu + i_n + 1).to(tl.int64)
    return i_n, bos, eos, bos + i_t * BT


@triton.jit
def _tok_setup(cu, cidx, BT: tl.constexpr, BC: tl.constexpr):
    """Program (chunk*BT + row) -> (token t, chunk start t0, sub-chunk start s0, sub-chunk end s1, valid)."""
    p = tl.program_id(0)
    i_c = p // BT
    r = p % BT
    _, _, eos, t0 = _chunk_span(cu, cidx, i_c, BT)
    t = t0 + r
    s0 = t0 + (r // BC) * BC
    s1 = tl.minimum(s0 + BC, eos)
    return t, t0, s0, s1, t < eos


@triton.jit
def _fwd_diag(
    q, k, Gc, beta, Aqk, Akk, cu, cidx,
    H, HV, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, BH: tl.constexpr,
):
    """Token-parallel diagonal sub-chunk entries of row t: Aqk[t, j] = sum_c q_t k_j e^(G_t - G_j)
    (j <= t) and Akk[t, j] = beta_t sum_c k_t k_j e^(G_t - G_j) (j < t), j in t's sub-chunk."""
    t, t0, s0, s1, valid = _tok_setup(cu, cidx, BT, BC)
    if valid:
        o_hv = tl.program_id(1) * BH + tl.arange(0, BH)
        m_hv = o_hv < HV
        ck = tl.arange(0, K)
        p_qk = (o_hv // (HV // H))[:, None] * K + ck[None, :]
        p_g = o_hv[:, None] * K + ck[None, :]
        b_q = tl.load(q + t * (H * K) + p_qk, mask=m_hv[:, None], other=0.0).to(tl.float32)
        b_k = tl.load(k + t * (H * K) + p_qk, mask=m_hv[:, None], other=0.0).to(tl.float32)
        b_G = tl.load(Gc + t * (HV * K) + p_g, mask=m_hv[:, None], other=0.0)
        b_beta = tl.load(beta + t * HV + o_hv, mask=m_hv, other=0.0).to(tl.float32)
        for j in range(s0, t + 1):
            b_kj = tl.load(k + j * (H * K) + p_qk, mask=m_hv[:, None], other=0.0).to(tl.float32)
            kE = b_kj * tl.exp(b_G - tl.load(Gc + j * (HV * K) + p_g, mask=m_hv[:, None], other=0.0))
            o_A = t * (HV * BT) + o_hv * BT + (j - t0)
            tl.store(Aqk + o_A, tl.sum(b_q * kE, axis=1), mask=m_hv)
            tl.store(Akk + o_A, tl.sum(b_k * kE, axis=1) * b_beta, mask=m_hv & (o_hv * 0 + j < t))
