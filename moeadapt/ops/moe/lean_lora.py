"""Grouped LoRA of the SwiGLU experts with the base GEMMs at their native width ("lean" fold).

Why: `fused_lora` folds the rank-R term into the base GEMM by widening it ([x | s·x·A] · [W | Bᵀ]ᵀ).
On the H200 that widening costs far more than its FLOPs: a 1024-wide grouped GEMM made 1040 wide runs
21-33% slower (benchmarks/bench_moe.py). Here the base GEMMs of the gate/up projection run unwidened
and the rank-R terms go into the memory-bound passes that touch those rows anyway:

  forward   gather pass:  x = z[row_index // K] (permuted rows), h = s·x·A_e          (one read of z)
            gmm:          gu = x·W_guᵀ                                                (native width)
            SwiGLU pass:  gate = gu_g + h_g·B_g,  up = gu_u + h_u·B_u,  a = silu(gate)·up,
                          acat = [a | s_d·a·A_d]                                       (one read of gu)
            gmm:          y = acat·[W_d | B_dᵀ]ᵀ      (the down projection keeps fused_lora's widened GEMM:
                                                         +3% there, cheaper than another pass over y)
  backward  (da, g_d) = dy·[W_d | B_dᵀ]  (fused_lora._dx_parts: widened GEMM or base GEMM + thin pass)
            SwiGLU bwd:   da += s_d·g_d·A_dᵀ; gate, up recomputed with their LoRA terms; d(gate), d(up);
                          dh_g = d(gate)·B_gᵀ, dh_u = d(up)·B_uᵀ accumulated over the row   (one pass)
            gmm:          dx = d(gu)·W_gu (native width);  dx += s·dh·Aᵀ (epilogue);  dz = Σ over copies
                          (with W_g, W_u as views of a gate/up buffer [W_g; W_u; s·Aᵀ] — gate_up_buffer, one
                          process — one GEMM: dx = [d(gate) | d(up) | dh]·[W_g; W_u; s·Aᵀ], _LeanCatFn)
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
    FOLD_TILES,
    _combine_copies,
    _dx_parts,
    _fold_cat,
    _interpreting,
    _lora_in_kernel,
    _use_triton,
    check_dx,
    gmm,
    kgmm,
    lora_out,
    make_cat_buffer,
    padded_rank,
)
from .reference import _rows_to_padded, grouped_mm_reference
from .triton_grouped_mm import _cached_tile_map, _tile_rows

LEAN_TILES = {  # GPU tiles from an H200 tile sweep at E = 64 (the interpreter uses BM = 16, 32-wide column blocks)
    # BK 128 from bench_lean_tiles.py on an H100 at the `small` step's shapes: 179.7 -> 165.9 us (BK 32 before)
    "swiglu_in": dict(BM=64, BK=128, num_warps=4, num_stages=3),
    "swiglu_bwd": dict(BM=32, BN=64, num_warps=2, num_stages=2, SPLIT=1),  # H200: 0.60 ms at E = 64
}


# ---------------------------------------------------------------- Triton passes
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
    RPD: tl.constexpr,
):
    """da = da_base + scale_d·gd·A_dᵀ; gate/up recomputed with their LoRA terms; d(gate), d(up) -> dg, du;
    dhg = d(gate)·B_gᵀ, dhu = d(up)·B_uᵀ (SHARED: one sum into dhg), accumulated over this program's CSPAN
    columns (program_id(1)) and stored at dhg + program_id(1)·s_xp (partial sums when the columns are split)."""
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
        if IEEE:
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


# ---------------------------------------------------------------- pass wrappers (torch twins off the GPU)
def _tiles(offsets_E, N, name, wide, tiles=None):
    """(tile map, BM, the column block `wide`, num_warps / num_stages) of a lean pass. tiles: an explicit launch
    (a dict with LEAN_TILES[name]'s keys), taken as given on any device; None: LEAN_TILES[name] on the GPU,
    BM = 16 and 32-wide blocks in the interpreter. The tile map is cached per BM (_cached_tile_map)."""
    if tiles is None and _interpreting():
        BM, BW, launch = 16, 32, {}
    else:
        t = LEAN_TILES[name] if tiles is None else tiles
        BM, BW, launch = t["BM"], t[wide], dict(num_warps=t["num_warps"], num_stages=t["num_stages"])
    expert_T, row_T = _cached_tile_map(offsets_E, N, BM)
    return expert_T, row_T, BM, BW, launch


def _lora_term_ref(h_NR, B_ERF, offsets_E, rows):
    return grouped_mm_reference(h_NR[:rows], B_ERF.to(h_NR.dtype), offsets_E)[:rows].float()


def swiglu_lora_in(g_NF, u_NF, hg_NR, hu_NR, Bg_ERF, Bu_ERF, Ad_EFR, offsets_E, scale_d, a_NF, hd_NW, tiles=None):
    """a = silu(g + hg·B_g)·(u + hu·B_u) into a_NF; hd_NW[:, :R_d] = scale_d·a·A_d, zeros after.
    tiles: the Triton launch, dict(BM, BK, num_warps, num_stages); None: LEAN_TILES["swiglu_in"]."""
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
    expert_T, row_T, BM, BK, launch = _tiles(offsets_E, N, "swiglu_in", "BK", tiles)
    assert g_NF.stride() == u_NF.stride() and hg_NR.stride() == hu_NR.stride() and Bg_ERF.stride() == Bu_ERF.stride()
    _swiglu_lora_in_kernel[(len(expert_T),)](
        g_NF, u_NF, hg_NR, hu_NR, Bg_ERF, Bu_ERF, Ad_EFR, a_NF, hd_NW, expert_T, row_T, offsets_E,
        F, R, RW, RD, float(scale_d), *g_NF.stride(), *hg_NR.stride(), *Bg_ERF.stride(), *Ad_EFR.stride(),
        *a_NF.stride(), *hd_NW.stride(),
        IEEE=g_NF.dtype == torch.float32, BM=BM, BK=BK, RP=max(16, triton.next_power_of_2(R)),
        RPD=max(16, triton.next_power_of_2(max(RW, RD))), **launch,
    )


def swiglu_lora_bwd(da_NF, gd_NR, Ad_EFR, scale_d, g_NF, u_NF, hg_NR, hu_NR, Bg_ERF, Bu_ERF, offsets_E,
                    dg_NF, du_NF, dhg_NR, dhu_NR=None, tiles=None):
    """The SwiGLU backward with both LoRA terms (see the module docstring); dhu_NR=None: shared h, one sum.
    tiles: the Triton launch, dict(BM, BN, num_warps, num_stages, SPLIT); None: LEAN_TILES["swiglu_bwd"]."""
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
    expert_T, row_T, BM, BN, launch = _tiles(offsets_E, N, "swiglu_bwd", "BN", tiles)
    assert g_NF.stride() == u_NF.stride() and dg_NF.stride() == du_NF.stride()
    assert hg_NR.stride() == hu_NR.stride() and Bg_ERF.stride() == Bu_ERF.stride()
    # SPLIT > 1: the columns in SPLIT slices, one program each (more parallel), dh as fp32 partial sums
    split = (LEAN_TILES["swiglu_bwd"] if tiles is None else tiles).get("SPLIT", 1)
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
        RPD=max(16, triton.next_power_of_2(RD)), **launch,
    )
    if split > 1:
        dhg_NR.copy_(dhg.sum(0))
        if not shared:
            dhu_NR.copy_(dhu.sum(0))


def gather_lora_in(z_TI, A_EIR, offsets_E, scale, row_index_N, K, x_NI, h_NW, tiles=None):
    """x = z[row_index // K] (the permuted rows) and h_NW[:, :R] = scale·x·A_e, zeros after.
    tiles: the Triton launch, dict(BM, BK, num_warps, num_stages), taken as given on any device; None:
    FOLD_TILES["in_gather"] on the GPU, BM = 16 and BK = 32 in the interpreter."""
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
    interp = tiles is None and _interpreting()
    t = FOLD_TILES["in_gather"] if tiles is None else tiles
    BM = 16 if interp else t["BM"]
    BK = 32 if interp else t["BK"]
    expert_T, row_T = _cached_tile_map(offsets_E, N, BM)
    _lora_in_kernel[(len(expert_T),)](
        z_TI, z_TI, row_index_N, A_EIR, x_NI, h_NW, expert_T, row_T, offsets_E, I, R, W, K, float(scale),
        z_TI.stride(0), z_TI.stride(1), 0, 0, *A_EIR.stride(), x_NI.stride(0), x_NI.stride(1),
        h_NW.stride(0), h_NW.stride(1),
        COPY=True, GATHER=True, SWIGLU=False, IEEE=z_TI.dtype == torch.float32, BM=BM, BK=BK,
        RP=max(16, triton.next_power_of_2(W)),
        **({} if interp else dict(num_warps=t["num_warps"], num_stages=t["num_stages"])),
    )


# ---------------------------------------------------------------- autograd
def _gathered(z_TI, A_in, row_index_N, offsets_E, scaling, K):
    """(A in z's dtype, x = z[row_index // K] [N, I], h = scaling·x·A [N, padded rank]): the gather pass that both
    lean autograd Functions open with."""
    N, I = row_index_N.shape[0], z_TI.shape[1]
    A_EIR = A_in.to(z_TI.dtype)
    x_NI = torch.empty(N, I, dtype=z_TI.dtype, device=z_TI.device)
    h_NW = torch.empty(N, padded_rank(A_in.shape[2]), dtype=z_TI.dtype, device=z_TI.device)
    gather_lora_in(z_TI, A_EIR, offsets_E, scaling, row_index_N, K, x_NI, h_NW)
    return A_EIR, x_NI, h_NW


class _GatherBaseFn(torch.autograd.Function):
    """(y_a, y_b, h) = (x·W_aᵀ, x·W_bᵀ, s·x·A) with x = z[row_index // K]; dz in token order. h is [N, RW].
    w_b None (packed gate/up in w_a): y_b is an empty placeholder. A in any dtype (the fp32 adapter itself):
    cast to z's here, its gradient comes back in A's dtype straight from the K-grouped kernel."""

    @staticmethod
    def forward(ctx, z_TI, A_in, row_index_N, offsets_E, K, scaling, w_a, w_b):
        T, R = z_TI.shape[0], A_in.shape[2]
        ctx.a_dtype = A_in.dtype
        A_EIR, x_NI, h_NW = _gathered(z_TI, A_in, row_index_N, offsets_E, scaling, K)
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
            dx_b = None
            if ctx.w_b is not None and dy_b is not None:  # the pair (w1, w3): two GEMMs, summed below
                dx_b = gmm(dy_b.contiguous().to(x_NI.dtype), ctx.w_b, offsets_E)
            if dh_NR is not None:  # dx = dx_a (+ dx_b) + s·dh·Aᵀ in one pass
                lora_out(dx_NI, dh_NR, A_EIR.transpose(1, 2), offsets_E, s, dx_NI, base2_NO=dx_b)
            elif dx_b is not None:
                dx_NI += dx_b
            dz = _combine_copies(dx_NI, row_index_N, ctx.K, ctx.T)
        if need_a and dh_NR is not None:
            dA = kgmm(x_NI, dh_NR, offsets_E, s, ctx.a_dtype)
        return dz, dA, None, None, None, None, None, None


def _down_forward(ctx, g, u, h_NW, Bg_in, Bu_in, Ad_in, Bd_in, offsets_E, scaling_d, wcat_EOJ, shared, R, dx,
                  w_d_EOI, copies):
    """_SwiGLUDownFn's forward (its docstring): returns y and the tensors its backward needs (`_down_backward`),
    and leaves the rest on ctx. copies: (B_g, B_u, A_d, B_d) in g's dtype to compute with, or None: cast here."""
    ctx.dtypes = (Bg_in.dtype, Bu_in.dtype, Ad_in.dtype, Bd_in.dtype)
    Bg_ERF, Bu_ERF, Ad_EFR, Bd_ERO = copies or (*(t.to(g.dtype) for t in (Bg_in, Bu_in, Ad_in)), Bd_in)
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
    ctx.scaling, ctx.I, ctx.R, ctx.RL, ctx.shared, ctx.packed, ctx.dx = scaling_d, F, RD, R, shared, packed, dx
    # w_d_EOI (the base weight itself) given: wcat is this call's temporary copy. It is not kept for the
    # backward, which runs dx "split" on the base weight (under FSDP2 the gathered parameter, which FSDP2
    # gathers again before this block's backward, as it does for any saved weight)
    ctx.wcat = wcat_EOJ if w_d_EOI is None else None
    ctx.w_d = w_d_EOI
    return y_NO, (acat_NJ, g, u, h_NW, Bg_ERF, Bu_ERF, Ad_EFR, Bd_ERO, offsets_E)


class _SwiGLUDownFn(torch.autograd.Function):
    """y = [a | s_d·a·A_d]·[W_d | B_dᵀ]ᵀ with a = silu(g + h_g·B_g)·(u + h_u·B_u); u None: g is gate/up packed.
    The adapters come in their own dtype (fp32): cast here, or their bf16 `copies` read instead (train/copies.py);
    gradients returned in the adapters' dtype (no autograd casts)."""

    @staticmethod
    def forward(ctx, g, u, h_NW, Bg_in, Bu_in, Ad_in, Bd_ERO, offsets_E, scaling_d, wcat_EOJ, shared, R, dx,
                w_d_EOI=None, copies=None):
        y_NO, saved = _down_forward(ctx, g, u, h_NW, Bg_in, Bu_in, Ad_in, Bd_ERO, offsets_E, scaling_d, wcat_EOJ,
                                    shared, R, dx, w_d_EOI, copies)
        ctx.save_for_backward(*saved)
        return y_NO

    @staticmethod
    def backward(ctx, dy_NO):
        acat_NJ, g, u, h_NW, Bg, Bu, Ad, Bd, offsets_E = ctx.saved_tensors
        F, R, shared = ctx.I, ctx.RL, ctx.shared
        if ctx.packed:
            dg = torch.empty_like(g)
            du = None
            dg_NF, du_NF = dg[:, :F], dg[:, F:]
        else:
            dg, du = torch.empty_like(g), torch.empty_like(u)
            dg_NF, du_NF = dg, du
        dh_NW = torch.zeros_like(h_NW)
        dhg, dhu = dh_NW[:, :R], None if shared else dh_NW[:, R:2 * R]
        dBg, dBu, dAd, dBd = _down_backward(ctx, dy_NO, (acat_NJ, g, u, h_NW, Bg, Bu, Ad, Bd, offsets_E),
                                            dg_NF, du_NF, dhg, dhu)
        return dg, du, dh_NW, dBg, dBu, dAd, dBd, None, None, None, None, None, None, None, None


def _down_backward(ctx, dy_NO, saved, dg_NF, du_NF, dhg, dhu):
    """The backward of the SwiGLU and down projection (ctx as _SwiGLUDownFn.forward leaves it): d(gate), d(up)
    into dg_NF, du_NF, their rank-R gradients d(gate)·B_gᵀ (+ d(up)·B_uᵀ when shared) into dhg (and
    d(up)·B_uᵀ into dhu), and the adapters' gradients (dB_g, dB_u, dA_d, dB_d), returned."""
    acat_NJ, g, u, h_NW, Bg, Bu, Ad, Bd, offsets_E = saved
    s_d, F, RD, R, shared, wcat = ctx.scaling, ctx.I, ctx.R, ctx.RL, ctx.shared, ctx.wcat
    dy_NO = dy_NO.contiguous().to(acat_NJ.dtype)
    if wcat is None:  # no persistent buffer: the base GEMM on the weight + the thin dy·Bᵀ pass
        da_NF, gd_NR = _dx_parts(dy_NO, ctx.w_d, Bd, offsets_E, F, RD, True, "split")
    else:
        with torch.no_grad():
            wcat[:, :, F:F + RD].copy_(Bd.transpose(1, 2))
        da_NF, gd_NR = _dx_parts(dy_NO, wcat, Bd, offsets_E, F, RD, True, ctx.dx)
    g_NF, u_NF = (g[:, :F], g[:, F:]) if ctx.packed else (g, u)
    hg, hu = (h_NW[:, :R], h_NW[:, :R]) if shared else (h_NW[:, :R], h_NW[:, R:2 * R])
    swiglu_lora_bwd(da_NF, gd_NR, Ad, s_d, g_NF, u_NF, hg, hu, Bg, Bu, offsets_E, dg_NF, du_NF, dhg, dhu)
    tg, tu, ta, tb = ctx.dtypes
    dBg = kgmm(hg.contiguous(), dg_NF, offsets_E, 1.0, tg)
    dBu = kgmm(hu.contiguous(), du_NF, offsets_E, 1.0, tu)
    dAd = kgmm(acat_NJ[:, :F], gd_NR, offsets_E, s_d, ta)
    dBd = kgmm(acat_NJ[:, F:F + RD], dy_NO, offsets_E, 1.0, tb)
    return dBg, dBu, dAd, dBd


class _LeanCatFn(torch.autograd.Function):
    """The lean experts block as one node, for gate/up weights that live in a buffer wk [E, 2F + RW, I] (W_g,
    then W_u, then RW rows for the adapters' A): _GatherBaseFn and _SwiGLUDownFn in one, with one change in
    the backward. There dx of the gate/up projection, its LoRA term included, is one grouped GEMM,
        dx = [d(gate) | d(up) | dh] · [W_g; W_u; s·Aᵀ]     (K = 2F + RW),
    on one buffer the SwiGLU backward writes all three into; the pair of base GEMMs (each a [N, I] output) and the
    pass that adds them and s·dh·Aᵀ (lora_out) are gone. The forward's gate/up GEMM is one GEMM on wk[:, :2F]."""

    @staticmethod
    def forward(ctx, z_TI, A_in, Bg_in, Bu_in, Ad_in, Bd_ERO, row_index_N, offsets_E, K, scaling, scaling_d, wk,
                shared, R, wcat_d, dx, w_d_EOI, copies=None):
        T, RA = z_TI.shape[0], A_in.shape[2]
        F2 = wk.shape[1] - padded_rank(RA)
        A_EIR, x_NI, h_NW = _gathered(z_TI, A_in, row_index_N, offsets_E, scaling, K)
        gu = gmm(x_NI, wk[:, :F2].transpose(1, 2), offsets_E)
        y, down = _down_forward(ctx, gu, None, h_NW, Bg_in, Bu_in, Ad_in, Bd_ERO, offsets_E, scaling_d, wcat_d,
                                shared, R, dx, w_d_EOI, copies)
        ctx.lean = (scaling, K, T, RA, wk, A_in.dtype)
        ctx.save_for_backward(x_NI, A_EIR, row_index_N, *down)
        return y

    @staticmethod
    def backward(ctx, dy_NO):
        x_NI, A_EIR, row_index_N, *down = ctx.saved_tensors
        s, K, T, RA, wk, a_dtype = ctx.lean
        offsets_E = down[-1]
        RW = padded_rank(RA)
        F2 = wk.shape[1] - RW
        N, F, R = x_NI.shape[0], ctx.I, ctx.RL
        dcat = torch.empty(N, F2 + RW, dtype=x_NI.dtype, device=x_NI.device)
        if RW > RA:
            dcat[:, F2 + RA:].zero_()  # they meet wk's zero padding rows: uninitialised, a NaN there would spread
        dhg, dhu = dcat[:, F2:F2 + R], None if ctx.shared else dcat[:, F2 + R:F2 + 2 * R]
        dBg, dBu, dAd, dBd = _down_backward(ctx, dy_NO, down, dcat[:, :F], dcat[:, F:F2], dhg, dhu)
        with torch.no_grad():
            wk[:, F2:F2 + RA].copy_((A_EIR * s).transpose(1, 2))
        dz = _combine_copies(gmm(dcat, wk, offsets_E), row_index_N, K, T) if ctx.needs_input_grad[0] else None
        dA = kgmm(x_NI, dcat[:, F2:F2 + RA], offsets_E, s, a_dtype) if ctx.needs_input_grad[1] else None
        return dz, dA, dBg, dBu, dAd, dBd, *([None] * 12)


def lean_lora_experts(z_TI, row_index_N, K, offsets_E, w_gu_EOI, A_EIR, B_gu, scaling, w_d_EIO, A_d, B_d,
                      scaling_d, wcat_d=None, dx: str = "cat", wk_gu=None, copies=None):
    """The LoRA'd SwiGLU experts over permute's rows, base GEMMs of gate/up at native width.

    z_TI [T, I] token-major input; row_index_N, K, offsets_E from `permutation`; w_gu_EOI the frozen gate/up
    weight: packed [E, 2F, I] (gate first) or a pair (W_gate, W_up) of [E, F, I]; A_EIR [E, I, R] with
    B_gu [E, R, 2F] (one LoRA on the packed projection), or A_EIR [E, I, 2R] = [A_gate | A_up] with
    B_gu = (B_gate, B_up) each [E, R, F] (two LoRAs with the same scaling); w_d_EIO [E, F, L] frozen down weight
    (a view of wcat_d [E, L, F + RW] when given) with A_d [E, F, R_d], B_d [E, R_d, L]. Without wcat_d (the
    layer owns no buffer: FSDP2) a temporary one serves the forward GEMM, and the backward runs dx "split" on
    w_d itself, so nothing weight-sized is held until the backward.
    dx: the down projection's backward GEMM, as fused_lora.DX_MODES. wk_gu: the buffer the gate/up weights are
    views of (`gate_up_buffer`; the layers own it: one process): the block then runs as _LeanCatFn, whose
    backward takes dx of the gate/up projection, LoRA term included, in one GEMM. copies: (B_gu, A_d, B_d) as
    tensors in z's dtype shaped as those arguments (train/copies.py's bf16 copies), which the passes compute with
    instead of casting the adapters; the gradients still go to B_gu, A_d, B_d in their own dtype. Returns y_NL
    (sorted rows, unweighted)."""
    check_dx(dx)
    pair = isinstance(w_gu_EOI, (tuple, list))
    w_a, w_b = (w_gu_EOI[0], w_gu_EOI[1]) if pair else (w_gu_EOI, None)
    if w_a.requires_grad or (w_b is not None and w_b.requires_grad) or w_d_EIO.requires_grad:
        raise ValueError("lean_lora_experts: the base weights must be frozen")
    dt = z_TI.dtype
    F = w_a.shape[1] if pair else w_a.shape[1] // 2
    if isinstance(B_gu, (tuple, list)):
        Bg, Bu = B_gu
        R, shared = Bg.shape[1], False
        if A_EIR.shape[2] != 2 * R:
            raise ValueError(f"lean_lora_experts: two LoRAs need A [E, I, 2R]; got {tuple(A_EIR.shape)}, R = {R}")
    else:
        Bg, Bu = B_gu[:, :, :F], B_gu[:, :, F:]
        R, shared = B_gu.shape[1], True
    if copies is not None:
        cB, cAd, cBd = copies
        copies = (*(cB if isinstance(cB, (tuple, list)) else (cB[:, :, :F], cB[:, :, F:])), cAd, cBd)
        if any(c.dtype != dt or c.shape != t.shape for c, t in zip(copies, (Bg, Bu, A_d, B_d))):
            raise ValueError(f"lean_lora_experts: copies must be B_gu, A_d, B_d's shapes in {dt}")
    if wcat_d is None:  # no persistent buffer (FSDP2 owns the gathered weight): a temporary one for the forward
        w_d_EOI = w_d_EIO.detach().transpose(1, 2).to(dt)
        wcat_d = make_cat_buffer(w_d_EOI, A_d.shape[2])
    else:
        w_d_EOI = None
        wcat_d = _fold_cat(w_d_EIO, wcat_d, A_d.shape[2], dt)
    if wk_gu is not None:
        _check_gate_up_buffer(wk_gu, w_a, w_b, F, A_EIR.shape[2], dt)
        return _LeanCatFn.apply(z_TI, A_EIR, Bg, Bu, A_d, B_d, row_index_N, offsets_E, int(K), float(scaling),
                                float(scaling_d), wk_gu, shared, R, wcat_d, dx, w_d_EOI, copies)
    y_a, y_b, h = _GatherBaseFn.apply(z_TI, A_EIR, row_index_N, offsets_E, int(K), float(scaling),
                                      w_a.to(dt), None if w_b is None else w_b.to(dt))
    return _SwiGLUDownFn.apply(y_a, y_b if pair else None, h, Bg, Bu, A_d, B_d, offsets_E,
                               float(scaling_d), wcat_d, shared, R, dx, w_d_EOI, copies)


def gate_up_buffer(w_g_EFI: torch.Tensor, w_u_EFI: torch.Tensor, RA: int) -> torch.Tensor:
    """A fresh [E, 2F + padded_rank(RA), I] buffer holding W_gate, then W_up, then zeros: the rows _LeanCatFn's
    backward fills with s·Aᵀ of an adapter A [E, I, RA]. Make the layers' weights views of its first 2F rows."""
    E, F, I = w_g_EFI.shape
    wk = torch.empty(E, 2 * F + padded_rank(RA), I, dtype=w_g_EFI.dtype, device=w_g_EFI.device)
    wk[:, :F].copy_(w_g_EFI)
    wk[:, F:2 * F].copy_(w_u_EFI)
    wk[:, 2 * F:].zero_()
    return wk


def _is_rows(w: torch.Tensor, wk: torch.Tensor, start: int, stop: int) -> bool:
    v = wk[:, start:stop]
    return w.shape == v.shape and w.stride() == v.stride() and w.data_ptr() == v.data_ptr() and w.dtype == v.dtype


def is_gate_up_view(w_g, w_u, wk, RA: int) -> bool:
    """True when the gate/up weights are the first 2F rows of a gate/up buffer for rank RA: (w_g, w_u) a pair of
    [E, F, I] views, or w_u None and w_g the packed [E, 2F, I] view."""
    F = w_g.shape[1] if w_u is not None else w_g.shape[1] // 2
    if wk.shape[1] != 2 * F + padded_rank(RA):
        return False
    return _is_rows(w_g, wk, 0, F) and _is_rows(w_u, wk, F, 2 * F) if w_u is not None else _is_rows(w_g, wk, 0, 2 * F)


def _check_gate_up_buffer(wk, w_a, w_b, F, RA, dtype):
    if wk.dtype != dtype or wk.shape[1] != 2 * F + padded_rank(RA):
        raise ValueError(f"lean_lora_experts: wk_gu {tuple(wk.shape)} {wk.dtype} is not a gate/up buffer for F = "
                         f"{F}, rank {RA} in {dtype} (gate_up_buffer)")
    if not is_gate_up_view(w_a, w_b, wk, RA):
        raise ValueError("lean_lora_experts: the gate/up weights must be views of wk_gu's first 2F rows")
