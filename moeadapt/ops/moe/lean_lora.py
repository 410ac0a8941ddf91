"""Grouped LoRA of the SwiGLU experts with the base GEMMs at their native width ("lean" fold).

Why: `fused_lora` folds the rank-R term into the base GEMM by widening it ([x | s·x·A] · [W | Bᵀ]ᵀ).
On the H200 that widening costs far more than its FLOPs: a 1024-wide grouped GEMM made 1040 wide runs
21-33% slower (RESULTS.md, MoE, session 3). Here the base GEMMs of the gate/up projection run unwidened
and the rank-R terms go into the memory-bound passes that touch those rows anyway:

  forward   gather pass:  x = z[row_index // K] (permuted rows), h = s·x·A_e          (one read of z)
            gmm:          gu = x·W_guᵀ                                                (native width)
            SwiGLU pass:  gate = gu_g + h_g·B_g,  up = gu_u + h_u·B_u,  a = silu(gate)·up,
                          acat = [a | s_d·a·A_d]                                       (one read of gu)
            gmm:          y = acat·[W_d | B_dᵀ]ᵀ      (the down projection keeps fused_lora's widened GEMM:
                                                         +3% there, cheaper than another pass over y)
  backward  (da, g_d) = dy·[W_d | B_dᵀ]  (fused_lora._dx_parts: widened GEMM or base GEMM + thin pass), or with
                          CONFIG["lean_down"] = "fused": da = dy·W_d (unwidened) and one pass over dy giving
                          g_d = dy·B_dᵀ and dB_d = hdᵀ·dy together (`down_lora_bwd`)
            SwiGLU bwd:   da += s_d·g_d·A_dᵀ; gate, up recomputed with their LoRA terms; d(gate), d(up);
                          dh_g = d(gate)·B_gᵀ, dh_u = d(up)·B_uᵀ accumulated over the row   (one pass)
            gmm:          dx = d(gu)·W_gu (native width);  dx += s·dh·Aᵀ (epilogue);  dz = Σ over copies
            K-grouped:    dA = s·xᵀ·dh, dB_g = hᵀ·d(gate), dB_u = hᵀ·d(up), dA_d, dB_d as in fused_lora.

The gate/up projection is one packed weight [E, 2F, I] (W_gu; gate = the first F outputs) with either one
LoRA (A [E, I, R], B [E, R, 2F]: h_g = h_u = h) or two (gate's and up's: A [E, I, 2R] = [A_g | A_u] and
B_g, B_u [E, R, F]); h holds [h_g | h_u] then. The base weights are frozen (no dW).

The math is `reference`-checked in tests/ops/test_moe_ops.py (-k lean) against float64 loops; on CPU the
passes run under TRITON_INTERPRET=1 or as their torch twins below.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .fused_lora import (
    CONFIG,
    FOLD_TILES,
    _combine_copies,
    _counts,
    _dx_parts,
    _fold_cat,
    _interpreting,
    _lora_in_kernel,
    _use_triton,
    gmm,
    kgmm,
    lora_out,
    padded_rank,
)
from .reference import _rows_to_padded, grouped_mm_reference
from .triton_grouped_mm import _cached_tile_map, _tile_rows

LEAN_TILES = {  # GPU tiles (the interpreter uses BM = 16, 32-wide column blocks); benchmarks/tune_fold.py --lean
    "swiglu_in": dict(BM=64, BK=32, num_warps=4, num_stages=3),
    "swiglu_bwd": dict(BM=32, BN=64, num_warps=2, num_stages=2, SPLIT=1),  # H200 call 7: 0.60 ms at E = 64
    "down_bwd": dict(BK=128, BO=256, num_warps=8, num_stages=2),  # H200 session 4 call 2: 0.118 ms at E = 64
    "swiglu_bwd_cp": dict(BM=32, BN=64, RC=512, num_warps=4, num_stages=2),  # CONFIG["lean_bwd"] = "cp"
}


# ---------------------------------------------------------------- Triton passes
@triton.jit
def _mm_acc(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _lora_terms(hg, hu, bg_ptr, bu_ptr, e64, cols, col_ok, rs, r_ok, s_be, s_br, s_bf, IEEE: tl.constexpr):
    """[BM, BN] fp32 rank-R terms hg·B_g[e][:, cols] and hu·B_u[e][:, cols]."""
    m = r_ok[:, None] & col_ok[None, :]
    bg = tl.load(bg_ptr + e64 * s_be + rs[:, None] * s_br + cols[None, :] * s_bf, mask=m, other=0.0)
    bu = tl.load(bu_ptr + e64 * s_be + rs[:, None] * s_br + cols[None, :] * s_bf, mask=m, other=0.0)
    if IEEE:
        return (tl.dot(hg, bg.to(hg.dtype), input_precision="ieee"),
                tl.dot(hu, bu.to(hu.dtype), input_precision="ieee"))
    return tl.dot(hg, bg.to(hg.dtype)), tl.dot(hu, bu.to(hu.dtype))


@triton.jit
def _row_tile_h(pid, e, tile_row_ptr, offsets_ptr, hg_ptr, hu_ptr, R, s_hn, s_hr,
                BM: tl.constexpr, RP: tl.constexpr):
    """This program's tile of expert-sorted rows (expert e >= 0, checked by the caller) and its h_g, h_u
    rows [BM, RP]. Returns (rows, row_ok, rows as int64 [BM, 1], rs, r_ok, hg, hu)."""
    rows, row_ok = _tile_rows(pid, e, tile_row_ptr, offsets_ptr, BM)
    r64 = rows.to(tl.int64)[:, None]
    rs = tl.arange(0, RP)
    r_ok = rs < R
    hm = row_ok[:, None] & r_ok[None, :]
    hg = tl.load(hg_ptr + r64 * s_hn + rs[None, :] * s_hr, mask=hm, other=0.0)
    hu = tl.load(hu_ptr + r64 * s_hn + rs[None, :] * s_hr, mask=hm, other=0.0)
    return rows, row_ok, r64, rs, r_ok, hg, hu


@triton.jit
def _swiglu_lora_in_kernel(
    g_ptr, u_ptr, hg_ptr, hu_ptr, bg_ptr, bu_ptr, ad_ptr, a_out_ptr, hd_ptr,
    tile_expert_ptr, tile_row_ptr, offsets_ptr, F, R, RW, RD, scale_d,
    s_gn, s_gf, s_hn, s_hr, s_be, s_br, s_bf, s_ae, s_af, s_ar, s_on, s_of, s_dn, s_dr,
    IEEE: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, RP: tl.constexpr, RPD: tl.constexpr,
):
    """a = silu(g + hg·B_g)·(u + hu·B_u) -> a_out; hd = scale_d·a·A_d (width RW, zeros past RD)."""
    e = tl.load(tile_expert_ptr + tl.program_id(0))
    if e < 0:
        return
    rows, row_ok, r64, rs, r_ok, hg, hu = _row_tile_h(tl.program_id(0), e, tile_row_ptr, offsets_ptr, hg_ptr,
                                                      hu_ptr, R, s_hn, s_hr, BM, RP)
    e64 = e.to(tl.int64)
    rd = tl.arange(0, RPD)
    acc = tl.zeros([BM, RPD], dtype=tl.float32)
    for k0 in range(0, F, BK):
        cols = k0 + tl.arange(0, BK)
        col_ok = cols < F
        m = row_ok[:, None] & col_ok[None, :]
        lg, lu = _lora_terms(hg, hu, bg_ptr, bu_ptr, e64, cols, col_ok, rs, r_ok, s_be, s_br, s_bf, IEEE)
        g = tl.load(g_ptr + r64 * s_gn + cols[None, :] * s_gf, mask=m, other=0.0).to(tl.float32) + lg
        u = tl.load(u_ptr + r64 * s_gn + cols[None, :] * s_gf, mask=m, other=0.0).to(tl.float32) + lu
        a = (g * tl.sigmoid(g) * u).to(a_out_ptr.dtype.element_ty)
        tl.store(a_out_ptr + r64 * s_on + cols[None, :] * s_of, a, mask=m)
        ad = tl.load(ad_ptr + e64 * s_ae + cols[:, None] * s_af + rd[None, :] * s_ar,
                     mask=col_ok[:, None] & (rd < RD)[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, ad.to(a.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, ad.to(a.dtype), acc)
    tl.store(hd_ptr + r64 * s_dn + rd[None, :] * s_dr, (acc * scale_d).to(hd_ptr.dtype.element_ty),
             mask=row_ok[:, None] & (rd < RW)[None, :])


@triton.jit
def _swiglu_lora_bwd_kernel(
    da_ptr, gd_ptr, ad_ptr, g_ptr, u_ptr, hg_ptr, hu_ptr, bg_ptr, bu_ptr, dg_ptr, du_ptr, dhg_ptr, dhu_ptr,
    tile_expert_ptr, tile_row_ptr, offsets_ptr, F, R, RD, scale_d, CSPAN,
    s_an, s_af, s_qn, s_qr, s_ae, s_af2, s_ar, s_gn, s_gf, s_hn, s_hr, s_be, s_br, s_bf, s_dn, s_df, s_xn, s_xr,
    s_xp, SHARED: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RP: tl.constexpr,
    RPD: tl.constexpr, BT: tl.constexpr = False,
):
    """da = da_base + scale_d·gd·A_dᵀ; gate/up recomputed with their LoRA terms; d(gate), d(up) -> dg, du;
    dhg = d(gate)·B_gᵀ, dhu = d(up)·B_uᵀ (SHARED: one sum into dhg), accumulated over this program's CSPAN
    columns (program_id(1)) and stored at dhg + program_id(1)·s_xp (partial sums when the columns are split).
    BT: the dh products take B_gᵀ, B_uᵀ tiles loaded a second time ([BN, RP], from L2) instead of transposing
    the loaded B tiles in registers (sm_90: 168 instead of 255 registers at BM 32, BN 64, 4 warps)."""
    pid_c = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tl.program_id(0))
    if e < 0:
        return
    rows, row_ok, r64, rs, r_ok, hg, hu = _row_tile_h(tl.program_id(0), e, tile_row_ptr, offsets_ptr, hg_ptr,
                                                      hu_ptr, R, s_hn, s_hr, BM, RP)
    e64 = e.to(tl.int64)
    hm = row_ok[:, None] & r_ok[None, :]
    rd = tl.arange(0, RPD)
    gd = tl.load(gd_ptr + r64 * s_qn + rd[None, :] * s_qr, mask=row_ok[:, None] & (rd < RD)[None, :], other=0.0)
    dhg = tl.zeros([BM, RP], dtype=tl.float32)
    dhu = tl.zeros([BM, RP], dtype=tl.float32)
    c_end = tl.minimum(F, (pid_c + 1) * CSPAN)
    for c0 in range(pid_c * CSPAN, c_end, BN):
        cols = c0 + tl.arange(0, BN)
        col_ok = cols < c_end
        m = row_ok[:, None] & col_ok[None, :]
        adt = tl.load(ad_ptr + e64 * s_ae + rd[:, None] * s_ar + cols[None, :] * s_af2,
                      mask=(rd < RD)[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            da = tl.dot(gd, adt.to(gd.dtype), input_precision="ieee")
        else:
            da = tl.dot(gd, adt.to(gd.dtype))
        da = tl.load(da_ptr + r64 * s_an + cols[None, :] * s_af, mask=m, other=0.0).to(tl.float32) + da * scale_d
        bmask = r_ok[:, None] & col_ok[None, :]
        bg = tl.load(bg_ptr + e64 * s_be + rs[:, None] * s_br + cols[None, :] * s_bf, mask=bmask, other=0.0)
        bu = tl.load(bu_ptr + e64 * s_be + rs[:, None] * s_br + cols[None, :] * s_bf, mask=bmask, other=0.0)
        bg = bg.to(hg.dtype)
        bu = bu.to(hu.dtype)
        x = tl.load(g_ptr + r64 * s_gn + cols[None, :] * s_gf, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r64 * s_gn + cols[None, :] * s_gf, mask=m, other=0.0).to(tl.float32)
        if IEEE:
            x += tl.dot(hg, bg, input_precision="ieee")
            u += tl.dot(hu, bu, input_precision="ieee")
        else:
            x += tl.dot(hg, bg)
            u += tl.dot(hu, bu)
        sig = tl.sigmoid(x)
        dgv = (da * u * sig * (1.0 + x * (1.0 - sig))).to(dg_ptr.dtype.element_ty)
        duv = (da * x * sig).to(du_ptr.dtype.element_ty)
        tl.store(dg_ptr + r64 * s_dn + cols[None, :] * s_df, dgv, mask=m)
        tl.store(du_ptr + r64 * s_dn + cols[None, :] * s_df, duv, mask=m)
        # dh += d(gate)·B_gᵀ: the B tiles loaded above, transposed in registers (no second, strided load)
        if BT:
            tm = col_ok[:, None] & r_ok[None, :]
            bgt = tl.load(bg_ptr + e64 * s_be + rs[None, :] * s_br + cols[:, None] * s_bf, mask=tm, other=0.0)
            but = tl.load(bu_ptr + e64 * s_be + rs[None, :] * s_br + cols[:, None] * s_bf, mask=tm, other=0.0)
            dhg = _mm_acc(dgv, bgt.to(dgv.dtype), dhg, IEEE)
            if SHARED:
                dhg = _mm_acc(duv, but.to(duv.dtype), dhg, IEEE)
            else:
                dhu = _mm_acc(duv, but.to(duv.dtype), dhu, IEEE)
        elif IEEE:
            dhg = tl.dot(dgv, tl.trans(bg).to(dgv.dtype), dhg, input_precision="ieee")
            if SHARED:
                dhg = tl.dot(duv, tl.trans(bu).to(duv.dtype), dhg, input_precision="ieee")
            else:
                dhu = tl.dot(duv, tl.trans(bu).to(duv.dtype), dhu, input_precision="ieee")
        else:
            dhg = tl.dot(dgv, tl.trans(bg).to(dgv.dtype), dhg)
            if SHARED:
                dhg = tl.dot(duv, tl.trans(bu).to(duv.dtype), dhg)
            else:
                dhu = tl.dot(duv, tl.trans(bu).to(duv.dtype), dhu)
    part = pid_c.to(tl.int64) * s_xp
    tl.store(dhg_ptr + part + r64 * s_xn + rs[None, :] * s_xr, dhg.to(dhg_ptr.dtype.element_ty), mask=hm)
    if not SHARED:
        tl.store(dhu_ptr + part + r64 * s_xn + rs[None, :] * s_xr, dhu.to(dhu_ptr.dtype.element_ty), mask=hm)


@triton.jit
def _swiglu_lora_bwd_cp_kernel(
    da_ptr, gd_ptr, ad_ptr, g_ptr, u_ptr, hg_ptr, hu_ptr, bg_ptr, bu_ptr, dg_ptr, du_ptr, dhp_ptr, wp_ptr,
    tile_expert_ptr, tile_row_ptr, offsets_ptr, F, R, RD, scale_d,
    s_an, s_af, s_qn, s_qr, s_ae, s_af2, s_ar, s_gn, s_gf, s_hn, s_hr, s_be, s_br, s_bf, s_dn, s_df,
    s_pc, s_pn, s_pr, s_wt, s_wk, s_wr, s_wf,
    SHARED: tl.constexpr, IEEE: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, RC: tl.constexpr,
    RP: tl.constexpr, RPD: tl.constexpr,
):
    """The SwiGLU backward of `_swiglu_lora_bwd_kernel`, column-parallel: one program per (BN columns, RC-row tile
    of one expert) walks its rows BM at a time with the B_g, B_u, A_d column tiles held in registers, and also
    accumulates the rank-R weight gradients of those columns, so nothing re-reads d(gate), d(up) or a for them:
      wp[tile, 0] = h_gᵀ·d(gate), wp[tile, 1] = h_uᵀ·d(up), wp[tile, 2] = g_dᵀ·a   ([RP|RPD, BN] fp32 partials)
    dh (a sum over all columns) is left as per-column-block partials dhp[pid_c] ([N, R] or [N, 2R] fp32)."""
    pid_c = tl.program_id(0)
    tile = tl.program_id(1)
    e = tl.load(tile_expert_ptr + tile)
    if e < 0:
        return
    row0 = tl.load(tile_row_ptr + tile)
    end = tl.minimum(tl.load(offsets_ptr + e), row0 + RC)
    e64 = e.to(tl.int64)
    cols = pid_c * BN + tl.arange(0, BN)
    col_ok = cols < F
    rs = tl.arange(0, RP)
    r_ok = rs < R
    rd = tl.arange(0, RPD)
    rd_ok = rd < RD
    bm = r_ok[:, None] & col_ok[None, :]
    bg = tl.load(bg_ptr + e64 * s_be + rs[:, None] * s_br + cols[None, :] * s_bf, mask=bm, other=0.0)
    bu = tl.load(bu_ptr + e64 * s_be + rs[:, None] * s_br + cols[None, :] * s_bf, mask=bm, other=0.0)
    adt = tl.load(ad_ptr + e64 * s_ae + rd[:, None] * s_ar + cols[None, :] * s_af2,
                  mask=rd_ok[:, None] & col_ok[None, :], other=0.0)
    bgt = tl.trans(bg)
    but = tl.trans(bu)
    wg = tl.zeros([RP, BN], dtype=tl.float32)
    wu = tl.zeros([RP, BN], dtype=tl.float32)
    wa = tl.zeros([RPD, BN], dtype=tl.float32)
    for r0 in range(row0, end, BM):
        rows = r0 + tl.arange(0, BM)
        row_ok = rows < end
        r64 = rows.to(tl.int64)[:, None]
        hm = row_ok[:, None] & r_ok[None, :]
        hg = tl.load(hg_ptr + r64 * s_hn + rs[None, :] * s_hr, mask=hm, other=0.0)
        hu = tl.load(hu_ptr + r64 * s_hn + rs[None, :] * s_hr, mask=hm, other=0.0)
        gd = tl.load(gd_ptr + r64 * s_qn + rd[None, :] * s_qr, mask=row_ok[:, None] & rd_ok[None, :], other=0.0)
        m = row_ok[:, None] & col_ok[None, :]
        da = _mm_acc(gd, adt.to(gd.dtype), tl.zeros([BM, BN], dtype=tl.float32), IEEE)
        da = tl.load(da_ptr + r64 * s_an + cols[None, :] * s_af, mask=m, other=0.0).to(tl.float32) + da * scale_d
        x = tl.load(g_ptr + r64 * s_gn + cols[None, :] * s_gf, mask=m, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + r64 * s_gn + cols[None, :] * s_gf, mask=m, other=0.0).to(tl.float32)
        x = _mm_acc(hg, bg.to(hg.dtype), x, IEEE)
        u = _mm_acc(hu, bu.to(hu.dtype), u, IEEE)
        sig = tl.sigmoid(x)
        dgv = (da * u * sig * (1.0 + x * (1.0 - sig))).to(dg_ptr.dtype.element_ty)
        duv = (da * x * sig).to(du_ptr.dtype.element_ty)
        a = (x * sig * u).to(dg_ptr.dtype.element_ty)
        tl.store(dg_ptr + r64 * s_dn + cols[None, :] * s_df, dgv, mask=m)
        tl.store(du_ptr + r64 * s_dn + cols[None, :] * s_df, duv, mask=m)
        dhg = _mm_acc(dgv, bgt.to(dgv.dtype), tl.zeros([BM, RP], dtype=tl.float32), IEEE)
        dhu = _mm_acc(duv, but.to(duv.dtype), tl.zeros([BM, RP], dtype=tl.float32), IEEE)
        dh_ptrs = dhp_ptr + pid_c.to(tl.int64) * s_pc + r64 * s_pn + rs[None, :] * s_pr
        if SHARED:
            tl.store(dh_ptrs, dhg + dhu, mask=hm)
        else:
            tl.store(dh_ptrs, dhg, mask=hm)
            tl.store(dh_ptrs + R * s_pr, dhu, mask=hm)
        wg = _mm_acc(tl.trans(hg), dgv.to(hg.dtype), wg, IEEE)
        wu = _mm_acc(tl.trans(hu), duv.to(hu.dtype), wu, IEEE)
        wa = _mm_acc(tl.trans(gd), a.to(gd.dtype), wa, IEEE)
    w_ptrs = wp_ptr + tile.to(tl.int64) * s_wt + cols[None, :] * s_wf
    tl.store(w_ptrs + rs[:, None] * s_wr, wg, mask=bm)
    tl.store(w_ptrs + s_wk + rs[:, None] * s_wr, wu, mask=bm)
    tl.store(w_ptrs + 2 * s_wk + rd[:, None] * s_wr, wa, mask=rd_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_lora_bwd_kernel(
    dy_ptr, hd_ptr, bd_ptr, dbd_ptr, gdp_ptr, offsets_ptr, L, R,
    s_yn, s_yl, s_hn, s_hr, s_be, s_br, s_bl, s_de, s_dr, s_dl, s_pp, s_pn, s_pr,
    IEEE: tl.constexpr, BK: tl.constexpr, BO: tl.constexpr, RP: tl.constexpr,
):
    """One read of dy for the down projection's LoRA backward, per (column block, expert) over the expert's rows:
    dB_d[e][:, cols] = hdᵀ·dy[:, cols] (K-grouped, in registers) and the partial row products
    gdp[pid, rows] = dy[rows, cols]·B_d[e][:, cols]ᵀ (fp32; gd = Σ over the column blocks)."""
    pid_o = tl.program_id(0)
    e = tl.program_id(1)
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets_ptr + e)
    e64 = e.to(tl.int64)
    cols = pid_o * BO + tl.arange(0, BO)
    col_ok = cols < L
    rs = tl.arange(0, RP)
    r_ok = rs < R
    bdt = tl.load(bd_ptr + e64 * s_be + rs[None, :] * s_br + cols[:, None] * s_bl,
                  mask=col_ok[:, None] & r_ok[None, :], other=0.0)  # B_d[e][:, cols]ᵀ, [BO, RP]
    ks = tl.arange(0, BK)
    acc = tl.zeros([RP, BO], dtype=tl.float32)
    for r0 in range(start, end, BK):
        rows = (r0 + ks).to(tl.int64)
        row_ok = (r0 + ks) < end
        dy = tl.load(dy_ptr + rows[:, None] * s_yn + cols[None, :] * s_yl,
                     mask=row_ok[:, None] & col_ok[None, :], other=0.0)
        hd = tl.load(hd_ptr + rows[:, None] * s_hn + rs[None, :] * s_hr,
                     mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        acc = _mm_acc(tl.trans(hd), dy.to(hd.dtype), acc, IEEE)
        gdp = _mm_acc(dy, bdt.to(dy.dtype), tl.zeros([BK, RP], dtype=tl.float32), IEEE)
        tl.store(gdp_ptr + pid_o.to(tl.int64) * s_pp + rows[:, None] * s_pn + rs[None, :] * s_pr, gdp,
                 mask=row_ok[:, None] & r_ok[None, :])
    tl.store(dbd_ptr + e64 * s_de + rs[:, None] * s_dr + cols[None, :] * s_dl, acc.to(dbd_ptr.dtype.element_ty),
             mask=r_ok[:, None] & col_ok[None, :])


# ---------------------------------------------------------------- pass wrappers (torch twins off the GPU)
def _tiles(offsets_E, N, name, wide):
    t = LEAN_TILES[name]
    if _interpreting():
        BM, BW, launch = 16, 32, {}
    else:
        BM, BW, launch = t["BM"], t[wide], dict(num_warps=t["num_warps"], num_stages=t["num_stages"])
    expert_T, row_T = _cached_tile_map(offsets_E, N, BM)
    return expert_T, row_T, BM, BW, launch


def _lora_term_ref(h_NR, B_ERF, offsets_E, rows):
    return grouped_mm_reference(h_NR[:rows], B_ERF.to(h_NR.dtype), offsets_E)[:rows].float()


def swiglu_lora_in(g_NF, u_NF, hg_NR, hu_NR, Bg_ERF, Bu_ERF, Ad_EFR, offsets_E, scale_d, a_NF, hd_NW):
    """a = silu(g + hg·B_g)·(u + hu·B_u) into a_NF; hd_NW[:, :R_d] = scale_d·a·A_d, zeros after."""
    N, F = g_NF.shape
    R, RD, RW = hg_NR.shape[1], Ad_EFR.shape[2], hd_NW.shape[1]
    if N == 0:
        return
    if not _use_triton(g_NF):
        rows = len(_rows_to_padded(offsets_E, N)[0])
        gate = g_NF[:rows].float() + _lora_term_ref(hg_NR, Bg_ERF, offsets_E, rows)
        up = u_NF[:rows].float() + _lora_term_ref(hu_NR, Bu_ERF, offsets_E, rows)
        a = (torch.nn.functional.silu(gate) * up).to(a_NF.dtype)
        a_NF[:rows] = a
        hd = grouped_mm_reference(a, Ad_EFR.to(a.dtype), offsets_E)[:rows].float() * scale_d
        hd_NW[:rows, :RD] = hd.to(hd_NW.dtype)
        hd_NW[:rows, RD:] = 0
        return
    expert_T, row_T, BM, BK, launch = _tiles(offsets_E, N, "swiglu_in", "BK")
    assert g_NF.stride() == u_NF.stride() and hg_NR.stride() == hu_NR.stride() and Bg_ERF.stride() == Bu_ERF.stride()
    _swiglu_lora_in_kernel[(len(expert_T),)](
        g_NF, u_NF, hg_NR, hu_NR, Bg_ERF, Bu_ERF, Ad_EFR, a_NF, hd_NW, expert_T, row_T, offsets_E,
        F, R, RW, RD, float(scale_d), *g_NF.stride(), *hg_NR.stride(), *Bg_ERF.stride(), *Ad_EFR.stride(),
        *a_NF.stride(), *hd_NW.stride(),
        IEEE=g_NF.dtype == torch.float32, BM=BM, BK=BK, RP=max(16, triton.next_power_of_2(R)),
        RPD=max(16, triton.next_power_of_2(max(RW, RD))), **launch,
    )


def swiglu_lora_bwd(da_NF, gd_NR, Ad_EFR, scale_d, g_NF, u_NF, hg_NR, hu_NR, Bg_ERF, Bu_ERF, offsets_E,
                    dg_NF, du_NF, dhg_NR, dhu_NR=None):
    """The SwiGLU backward with both LoRA terms (see the module docstring); dhu_NR=None: shared h, one sum."""
    N, F = g_NF.shape
    R, RD = hg_NR.shape[1], Ad_EFR.shape[2]
    shared = dhu_NR is None
    if N == 0:
        return
    if not _use_triton(g_NF):
        rows = len(_rows_to_padded(offsets_E, N)[0])
        d = grouped_mm_reference(gd_NR[:rows, :RD], Ad_EFR.transpose(1, 2).to(gd_NR.dtype), offsets_E)[:rows]
        da = da_NF[:rows].float() + d.float() * scale_d
        x = g_NF[:rows].float() + _lora_term_ref(hg_NR, Bg_ERF, offsets_E, rows)
        u = u_NF[:rows].float() + _lora_term_ref(hu_NR, Bu_ERF, offsets_E, rows)
        sig = torch.sigmoid(x)
        dg = (da * u * sig * (1 + x * (1 - sig))).to(dg_NF.dtype)
        du = (da * x * sig).to(du_NF.dtype)
        dg_NF[:rows], du_NF[:rows] = dg, du
        dhg = grouped_mm_reference(dg, Bg_ERF.transpose(1, 2).to(dg.dtype), offsets_E)[:rows].float()
        dhu = grouped_mm_reference(du, Bu_ERF.transpose(1, 2).to(du.dtype), offsets_E)[:rows].float()
        if shared:
            dhg_NR[:rows] = (dhg + dhu).to(dhg_NR.dtype)
        else:
            dhg_NR[:rows], dhu_NR[:rows] = dhg.to(dhg_NR.dtype), dhu.to(dhu_NR.dtype)
        return
    expert_T, row_T, BM, BN, launch = _tiles(offsets_E, N, "swiglu_bwd", "BN")
    assert g_NF.stride() == u_NF.stride() and dg_NF.stride() == du_NF.stride()
    assert hg_NR.stride() == hu_NR.stride() and Bg_ERF.stride() == Bu_ERF.stride()
    # SPLIT > 1: the columns in SPLIT slices, one program each (more parallel), dh as fp32 partial sums
    split = LEAN_TILES["swiglu_bwd"].get("SPLIT", 1)
    split = max(1, min(split, triton.cdiv(F, BN)))
    cspan = triton.cdiv(triton.cdiv(F, split), BN) * BN
    split = triton.cdiv(F, cspan)
    if split == 1:
        dhg, dhu = dhg_NR, (dhg_NR if shared else dhu_NR)
    else:
        dhg = torch.empty(split, N, R, device=g_NF.device, dtype=torch.float32)
        dhu = dhg if shared else torch.empty_like(dhg)
    assert dhu.stride() == dhg.stride()
    _swiglu_lora_bwd_kernel[(len(expert_T), split)](
        da_NF, gd_NR, Ad_EFR, g_NF, u_NF, hg_NR, hu_NR, Bg_ERF, Bu_ERF, dg_NF, du_NF, dhg, dhu,
        expert_T, row_T, offsets_E, F, R, RD, float(scale_d), cspan,
        *da_NF.stride(), *gd_NR.stride(), *Ad_EFR.stride(), *g_NF.stride(), *hg_NR.stride(), *Bg_ERF.stride(),
        *dg_NF.stride(), *dhg.stride()[-2:], dhg.stride(0) if split > 1 else 0,
        SHARED=shared, IEEE=g_NF.dtype == torch.float32, BM=BM, BN=BN, RP=max(16, triton.next_power_of_2(R)),
        RPD=max(16, triton.next_power_of_2(RD)), BT=LEAN_TILES["swiglu_bwd"].get("BT", False), **launch,
    )
    if split > 1:
        dhg_NR.copy_(dhg.sum(0))
        if not shared:
            dhu_NR.copy_(dhu.sum(0))


def swiglu_lora_bwd_cp(da_NF, gd_NR, Ad_EFR, scale_d, g_NF, u_NF, hg_NR, hu_NR, Bg_ERF, Bu_ERF, offsets_E,
                       dg_NF, du_NF, dh_NW, shared):
    """`swiglu_lora_bwd` plus the rank-R weight gradients from the same pass (CONFIG["lean_bwd"] = "cp"):
    writes d(gate), d(up) and dh_NW[:, :R] (shared) or [:, :2R] ([dh_g | dh_u]); returns (dB_g, dB_u, dA_d)
    fp32, with dA_d = scale_d·aᵀ·g_d, a = silu(gate)·up recomputed. Triton only (GPU or the interpreter)."""
    N, F = g_NF.shape
    R, RD, E = hg_NR.shape[1], Ad_EFR.shape[2], Ad_EFR.shape[0]
    RW = R if shared else 2 * R
    t = LEAN_TILES["swiglu_bwd_cp"]
    if _interpreting():
        BM, BN, RC, launch = 16, 32, 32, {}
    else:
        BM, BN, RC = t["BM"], t["BN"], t["RC"]
        launch = dict(num_warps=t["num_warps"], num_stages=t["num_stages"])
    RP, RPD = max(16, triton.next_power_of_2(R)), max(16, triton.next_power_of_2(RD))
    RPM = max(RP, RPD)
    expert_T, row_T = _cached_tile_map(offsets_E, N, RC)
    n_c = triton.cdiv(F, BN)
    dhp = torch.zeros(n_c, N, RW, device=g_NF.device, dtype=torch.float32)
    wp = torch.zeros(len(expert_T), 3, RPM, F, device=g_NF.device, dtype=torch.float32)
    assert g_NF.stride() == u_NF.stride() and dg_NF.stride() == du_NF.stride()
    assert hg_NR.stride() == hu_NR.stride() and Bg_ERF.stride() == Bu_ERF.stride()
    if N > 0 and len(expert_T) > 0:
        _swiglu_lora_bwd_cp_kernel[(n_c, len(expert_T))](
            da_NF, gd_NR, Ad_EFR, g_NF, u_NF, hg_NR, hu_NR, Bg_ERF, Bu_ERF, dg_NF, du_NF, dhp, wp,
            expert_T, row_T, offsets_E, F, R, RD, float(scale_d),
            *da_NF.stride(), *gd_NR.stride(), *Ad_EFR.stride(), *g_NF.stride(), *hg_NR.stride(), *Bg_ERF.stride(),
            *dg_NF.stride(), *dhp.stride(), *wp.stride(),
            SHARED=shared, IEEE=g_NF.dtype == torch.float32, BM=BM, BN=BN, RC=RC, RP=RP, RPD=RPD, **launch,
        )
    dh_NW[:, :RW] = dhp.sum(0).to(dh_NW.dtype)
    w = torch.zeros(E, 3, RPM, F, device=g_NF.device, dtype=torch.float32)
    w.index_add_(0, expert_T.clamp_min(0).long(), wp)  # the tiles of one expert (tiles with expert -1 are zero)
    return w[:, 0, :R], w[:, 1, :R], w[:, 2, :RD].transpose(1, 2) * scale_d


def down_lora_bwd(dy_NL, hd_NR, Bd_ERL, offsets_E):
    """(gd = dy·B_dᵀ [N, R] in dy's dtype, dB_d = hdᵀ·dy [E, R, L] in B_d's dtype) over one read of dy:
    the down projection's LoRA backward next to its unwidened base GEMM (LEAN_TILES["down_bwd"])."""
    N, L = dy_NL.shape
    E, R = Bd_ERL.shape[0], Bd_ERL.shape[1]
    if not _use_triton(dy_NL):
        rows = len(_rows_to_padded(offsets_E, N)[0])
        gd = torch.zeros(N, R, dtype=dy_NL.dtype, device=dy_NL.device)
        gd[:rows] = grouped_mm_reference(dy_NL[:rows], Bd_ERL.transpose(1, 2).to(dy_NL.dtype), offsets_E)[:rows]
        return gd, kgmm(hd_NR, dy_NL, offsets_E, _counts(offsets_E)).to(Bd_ERL.dtype)
    t = LEAN_TILES["down_bwd"]
    BK, BO = (16, 32) if _interpreting() else (t["BK"], t["BO"])
    launch = {} if _interpreting() else dict(num_warps=t["num_warps"], num_stages=t["num_stages"])
    n_o = triton.cdiv(L, BO)
    gdp = torch.zeros(n_o, N, R, dtype=torch.float32, device=dy_NL.device)  # rows past the last expert stay 0
    dbd = torch.empty(E, R, L, dtype=Bd_ERL.dtype, device=dy_NL.device)
    if E > 0 and N > 0:
        _down_lora_bwd_kernel[(n_o, E)](
            dy_NL, hd_NR, Bd_ERL, dbd, gdp, offsets_E, L, R, *dy_NL.stride(), *hd_NR.stride(), *Bd_ERL.stride(),
            *dbd.stride(), *gdp.stride(), IEEE=dy_NL.dtype == torch.float32, BK=BK, BO=BO,
            RP=max(16, triton.next_power_of_2(R)), **launch,
        )
    return gdp.sum(0).to(dy_NL.dtype), dbd


def gather_lora_in(z_TI, A_EIR, offsets_E, scale, row_index_N, K, x_NI, h_NW):
    """x = z[row_index // K] (the permuted rows) and h_NW[:, :R] = scale·x·A_e, zeros after."""
    N, I = x_NI.shape
    R, W = A_EIR.shape[2], h_NW.shape[1]
    if N == 0:
        return
    if not _use_triton(z_TI):
        rows = len(_rows_to_padded(offsets_E, N)[0])
        x = z_TI[row_index_N[:rows].long() // K]
        x_NI[:rows] = x
        h_NW[:rows, :R] = (grouped_mm_reference(x, A_EIR.to(x.dtype), offsets_E)[:rows] * scale).to(h_NW.dtype)
        h_NW[:rows, R:] = 0
        return
    t = FOLD_TILES["in_gather"]
    BM = 16 if _interpreting() else t["BM"]
    BK = 32 if _interpreting() else t["BK"]
    expert_T, row_T = _cached_tile_map(offsets_E, N, BM)
    _lora_in_kernel[(len(expert_T),)](
        z_TI, z_TI, row_index_N, A_EIR, x_NI, h_NW, expert_T, row_T, offsets_E, I, R, W, K, float(scale),
        z_TI.stride(0), z_TI.stride(1), 0, 0, *A_EIR.stride(), x_NI.stride(0), x_NI.stride(1),
        h_NW.stride(0), h_NW.stride(1),
        COPY=True, GATHER=True, SWIGLU=False, IEEE=z_TI.dtype == torch.float32, BM=BM, BK=BK,
        RP=max(16, triton.next_power_of_2(W)),
        **({} if _interpreting() else dict(num_warps=t["num_warps"], num_stages=t["num_stages"])),
    )


# ---------------------------------------------------------------- autograd
class _GatherBaseFn(torch.autograd.Function):
    """(y_a, y_b, h) = (x·W_aᵀ, x·W_bᵀ, s·x·A) with x = z[row_index // K]; dz in token order. h is [N, RW].
    w_b None (packed gate/up in w_a): y_b is an empty placeholder."""

    @staticmethod
    def forward(ctx, z_TI, A_EIR, row_index_N, offsets_E, K, scaling, w_a, w_b):
        T, I = z_TI.shape
        N, R = row_index_N.shape[0], A_EIR.shape[2]
        x_NI = torch.empty(N, I, dtype=z_TI.dtype, device=z_TI.device)
        h_NW = torch.empty(N, padded_rank(R), dtype=z_TI.dtype, device=z_TI.device)
        gather_lora_in(z_TI, A_EIR, offsets_E, scaling, row_index_N, K, x_NI, h_NW)
        y_a = gmm(x_NI, w_a.transpose(1, 2), offsets_E)
        if w_b is None:
            y_b = y_a.new_empty(0)
            ctx.mark_non_differentiable(y_b)
        else:
            y_b = gmm(x_NI, w_b.transpose(1, 2), offsets_E)
        ctx.scaling, ctx.K, ctx.T, ctx.R = scaling, K, T, R
        ctx.w_a, ctx.w_b = w_a, w_b
        ctx.save_for_backward(x_NI, A_EIR, row_index_N, offsets_E)
        return y_a, y_b, h_NW

    @staticmethod
    def backward(ctx, dy_a, dy_b, dh_NW):
        x_NI, A_EIR, row_index_N, offsets_E = ctx.saved_tensors
        need_z, need_a = ctx.needs_input_grad[:2]
        s, R = ctx.scaling, ctx.R
        dh_NR = dh_NW[:, :R].contiguous().to(x_NI.dtype) if dh_NW is not None else None
        dz = dA = None
        if need_z:
            dx_NI = gmm(dy_a.contiguous().to(x_NI.dtype), ctx.w_a, offsets_E)
            if ctx.w_b is not None and dy_b is not None:
                dx_NI += gmm(dy_b.contiguous().to(x_NI.dtype), ctx.w_b, offsets_E)
            if dh_NR is not None:
                lora_out(dx_NI, dh_NR, A_EIR.transpose(1, 2), offsets_E, s, dx_NI)
            dz = _combine_copies(dx_NI, row_index_N, ctx.K, ctx.T)
        if need_a and dh_NR is not None:
            dA = (kgmm(x_NI, dh_NR, offsets_E, _counts(offsets_E)) * s).to(A_EIR.dtype)
        return dz, dA, None, None, None, None, None, None


class _SwiGLUDownFn(torch.autograd.Function):
    """y = [a | s_d·a·A_d]·[W_d | B_dᵀ]ᵀ with a = silu(g + h_g·B_g)·(u + h_u·B_u); u None: g is gate/up packed."""

    @staticmethod
    def forward(ctx, g, u, h_NW, Bg_ERF, Bu_ERF, Ad_EFR, Bd_ERO, offsets_E, scaling_d, wcat_EOJ, shared, R):
        packed = u is None
        F = g.shape[1] // 2 if packed else g.shape[1]
        g_NF, u_NF = (g[:, :F], g[:, F:]) if packed else (g, u)
        N = g.shape[0]
        RD, J = Ad_EFR.shape[2], wcat_EOJ.shape[2]
        hg, hu = (h_NW[:, :R], h_NW[:, :R]) if shared else (h_NW[:, :R], h_NW[:, R:2 * R])
        with torch.no_grad():
            wcat_EOJ[:, :, F:F + RD].copy_(Bd_ERO.transpose(1, 2))
        acat_NJ = torch.empty(N, J, dtype=g.dtype, device=g.device)
        swiglu_lora_in(g_NF, u_NF, hg, hu, Bg_ERF, Bu_ERF, Ad_EFR, offsets_E, scaling_d, acat_NJ[:, :F], acat_NJ[:, F:])
        y_NO = gmm(acat_NJ, wcat_EOJ.transpose(1, 2), offsets_E)
        ctx.scaling, ctx.I, ctx.R, ctx.RL, ctx.shared, ctx.packed = scaling_d, F, RD, R, shared, packed
        ctx.wcat = wcat_EOJ
        ctx.save_for_backward(acat_NJ, g, u, h_NW, Bg_ERF, Bu_ERF, Ad_EFR, Bd_ERO, offsets_E)
        return y_NO

    @staticmethod
    def backward(ctx, dy_NO):
        acat_NJ, g, u, h_NW, Bg, Bu, Ad, Bd, offsets_E = ctx.saved_tensors
        s_d, F, RD, R, shared, wcat = ctx.scaling, ctx.I, ctx.R, ctx.RL, ctx.shared, ctx.wcat
        dy_NO = dy_NO.contiguous().to(acat_NJ.dtype)
        with torch.no_grad():
            wcat[:, :, F:F + RD].copy_(Bd.transpose(1, 2))
        if CONFIG.get("lean_down") == "fused":  # base GEMM unwidened; gd and dB_d in one pass over dy
            da_NF = gmm(dy_NO, wcat[:, :, :F], offsets_E)
            gd_NR, dBd = down_lora_bwd(dy_NO, acat_NJ[:, F:F + RD], Bd, offsets_E)
        else:
            da_NF, gd_NR = _dx_parts(dy_NO, wcat, Bd, offsets_E, F, RD, True)
            dBd = None
        if ctx.packed:
            dg = torch.empty_like(g)
            du = None
            g_NF, u_NF, dg_NF, du_NF = g[:, :F], g[:, F:], dg[:, :F], dg[:, F:]
        else:
            dg, du = torch.empty_like(g), torch.empty_like(u)
            g_NF, u_NF, dg_NF, du_NF = g, u, dg, du
        dh_NW = torch.zeros_like(h_NW)
        hg, hu = (h_NW[:, :R], h_NW[:, :R]) if shared else (h_NW[:, :R], h_NW[:, R:2 * R])
        counts_E = _counts(offsets_E)
        if CONFIG.get("lean_bwd") == "cp" and _use_triton(g_NF):  # weight gradients inside the pass
            dBg, dBu, dAd = swiglu_lora_bwd_cp(da_NF, gd_NR, Ad, s_d, g_NF, u_NF, hg, hu, Bg, Bu, offsets_E,
                                               dg_NF, du_NF, dh_NW, shared)
            dBg, dBu, dAd = dBg.to(Bg.dtype), dBu.to(Bu.dtype), dAd.to(Ad.dtype)
        else:
            swiglu_lora_bwd(da_NF, gd_NR, Ad, s_d, g_NF, u_NF, hg, hu, Bg, Bu, offsets_E,
                            dg_NF, du_NF, dh_NW[:, :R], None if shared else dh_NW[:, R:2 * R])
            dBg = kgmm(hg.contiguous(), dg_NF, offsets_E, counts_E).to(Bg.dtype)
            dBu = kgmm(hu.contiguous(), du_NF, offsets_E, counts_E).to(Bu.dtype)
            dAd = (kgmm(acat_NJ[:, :F], gd_NR, offsets_E, counts_E) * s_d).to(Ad.dtype)
        if dBd is None:
            dBd = kgmm(acat_NJ[:, F:F + RD], dy_NO, offsets_E, counts_E).to(Bd.dtype)
        return dg, du, dh_NW, dBg, dBu, dAd, dBd, None, None, None, None, None


def lean_lora_experts(z_TI, row_index_N, K, offsets_E, w_gu_EOI, A_EIR, B_gu, scaling, w_d_EIO, A_d, B_d,
                      scaling_d, wcat_d=None):
    """The LoRA'd SwiGLU experts over permute's rows, base GEMMs of gate/up at native width.

    z_TI [T, I] token-major input; row_index_N, K, offsets_E from `permutation`; w_gu_EOI the frozen gate/up
    weight: packed [E, 2F, I] (gate first) or a pair (W_gate, W_up) of [E, F, I]; A_EIR [E, I, R] with
    B_gu [E, R, 2F] (one LoRA on the packed projection), or A_EIR [E, I, 2R] = [A_gate | A_up] with
    B_gu = (B_gate, B_up) each [E, R, F] (two LoRAs with the same scaling); w_d_EIO [E, F, L] frozen down weight
    (a view of wcat_d [E, L, F + RW] when given) with A_d [E, F, R_d], B_d [E, R_d, L].
    Returns y_NL (sorted rows, unweighted)."""
    pair = isinstance(w_gu_EOI, (tuple, list))
    w_a, w_b = (w_gu_EOI[0], w_gu_EOI[1]) if pair else (w_gu_EOI, None)
    if w_a.requires_grad or (w_b is not None and w_b.requires_grad) or w_d_EIO.requires_grad:
        raise ValueError("lean_lora_experts: the base weights must be frozen")
    dt = z_TI.dtype
    F = w_a.shape[1] if pair else w_a.shape[1] // 2
    if isinstance(B_gu, (tuple, list)):
        Bg, Bu = (b.to(dt) for b in B_gu)
        R, shared = Bg.shape[1], False
        if A_EIR.shape[2] != 2 * R:
            raise ValueError(f"lean_lora_experts: two LoRAs need A [E, I, 2R]; got {tuple(A_EIR.shape)}, R = {R}")
    else:
        B = B_gu.to(dt)
        Bg, Bu = B[:, :, :F], B[:, :, F:]
        R, shared = B.shape[1], True
    wcat_d = _fold_cat(w_d_EIO, wcat_d, A_d.shape[2], dt)
    y_a, y_b, h = _GatherBaseFn.apply(z_TI, A_EIR.to(dt), row_index_N, offsets_E, int(K), float(scaling),
                                      w_a.to(dt), None if w_b is None else w_b.to(dt))
    return _SwiGLUDownFn.apply(y_a, y_b if pair else None, h, Bg, Bu, A_d.to(dt), B_d.to(dt), offsets_E,
                               float(scaling_d), wcat_d, shared, R)
