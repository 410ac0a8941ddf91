"""The DSA layer's elementwise glue in Triton, one pass each way: the MHA form's attention inputs (`mha_inputs`), the
per-head output gate (`gate_heads`) and the lightning indexer's RoPE (`rope_first`).

Owns the kernels behind models/dsa_attn.py's GLUE_IMPL = "triton" and their registration as the torch.library
custom ops `moeadapt::dsa_mha_inputs_fwd` / `_bwd`, `moeadapt::dsa_gate_heads_fwd` / `_bwd` and
`moeadapt::dsa_rope_first` (so torch.compile and selective activation checkpointing see one op each way; the
`*_triton` functions call them through ops/custom.py's eager fast path). The math is the torch functions of the
same names in models/dsa_attn.py, the reference (tests and benchmarks/bench_dsa_glue.py compare against them), with
RoPE as in models/common.py `apply_rope`: half-split (channel j pairs with j + r/2), fp32, the result stored in the
input's dtype. Each `*_triton` function takes the reference's arguments and returns its tensors (new, contiguous).

What they replace: the torch functions compiled with dynamic shapes (models/common.py `compiled`), whose kernels
ran at 0.3-1.5 TB/s on an H100 for traffic worth ~0.8 ms at 3 TB/s in a step of the `small` preset. Here every
input is read once in its own strides (unit last-dim stride; any other tensor is copied first), the channel offsets
and widths are compile-time constants (vector loads), and each output is written once.

Backward math: a rotation's transpose is the rotation by the opposite angle (sin negated), so a rotated channel
pair's gradient is the incoming gradient rotated back. k_pe, one row per token broadcast to every head, gets the sum
over heads of dk_full's rope channels, rotated back once (the rotation is linear: sum first), summed in fp32 in
registers (a program holds every head of its tokens; no atomics, deterministic). The gate's
d gate_logits = sum_v(dy o) s (1 - s), s = sigmoid(gate_logits). cos / sin get no gradient (the model's tables are
constants).

cos / sin: [T, r/2] (every row alike) or [B, T, r/2] (packed documents: per row), any float dtype, read as fp32.
Shape suffixes: B batch, T time, H heads, N = B T tokens, nope / r / vd the key-only, rope and value channels.
No `from __future__ import annotations` here: torch.library infers the op schemas from real annotations.
"""

import torch
import triton
import triton.language as tl

from ..custom import eager_or_op, impl_or_op

# mha_inputs and rope_first: a program takes every head of BT = max(1, ROWS // next_pow2(H)) tokens, ~ROWS (token,
# head) rows (H = 16: 2 tokens; a [2, 4096, 16, .] tensor is 4096 programs), on NUM_WARPS warps.
ROWS = 32
NUM_WARPS = 4
# gate_heads: a program takes GATE_BLOCK_T tokens of one head (o rows of V channels), on GATE_NUM_WARPS warps.
GATE_BLOCK_T = 32
GATE_NUM_WARPS = 4


# ------------------------------------------------------------------ shared pieces


@triton.jit
def _tokens(pid, N, T, BT: tl.constexpr):
    """The tokens n = b T + t of program pid: (n, b, t) as int64 [BT], and the mask n < N."""
    n = pid * BT + tl.arange(0, BT)
    n64 = n.to(tl.int64)
    return n64, n64 // T, n64 % T, n < N


@triton.jit
def _ptrs(base, row, s_h, h, c0: tl.constexpr, W: tl.constexpr, WP: tl.constexpr):
    """Pointers [BT, HP, WP] to channels c0 .. c0 + W - 1 of heads h [HP] of the tokens at offsets row [BT], and the
    channel mask [1, 1, WP]."""
    c = tl.arange(0, WP)
    p = base + row[:, None, None] + (h.to(tl.int64) * s_h)[None, :, None] + (c0 + c)[None, None, :]
    return p, (c < W)[None, None, :]


@triton.jit
def _copy(src, s_row, s_h, s0: tl.constexpr, dst, d_row, d_h, d0: tl.constexpr, h, m2, W: tl.constexpr,
          WP: tl.constexpr):
    """dst[..., d0:d0 + W] = src[..., s0:s0 + W] in dst's dtype, for the (token, head) rows of mask m2 [BT, HP]."""
    if W > 0:
        ps, cm = _ptrs(src, s_row, s_h, h, s0, W, WP)
        pd, _ = _ptrs(dst, d_row, d_h, h, d0, W, WP)
        m = m2[:, :, None] & cm
        tl.store(pd, tl.load(ps, mask=m).to(dst.dtype.element_ty), mask=m)


@triton.jit
def _cos_sin(cos, sin, cs_row, nm, RH: tl.constexpr, RHP: tl.constexpr, ROTATE: tl.constexpr = True):
    """cos and sin of the tokens at table offsets cs_row [BT], fp32 [BT, RHP] (0 in the padding); without ROTATE
    zeros (unused: the rope channels are copied as they are)."""
    if not ROTATE:
        z = tl.zeros_like(cs_row[:, None] + tl.arange(0, RHP)[None, :]).to(tl.float32)
        return z, z
    j = tl.arange(0, RHP)
    m = nm[:, None] & (j < RH)[None, :]
    off = cs_row[:, None] + j[None, :]
    return (tl.load(cos + off, mask=m, other=0.0).to(tl.float32),
            tl.load(sin + off, mask=m, other=0.0).to(tl.float32))


@triton.jit
def _rotate(x1, x2, c, s, SIGN: tl.constexpr):
    """apply_rope's rotation of the halves (x1, x2): (x1 c - x2 s, x1 s + x2 c); SIGN = -1 rotates back (the
    transpose: the backward)."""
    s = s * SIGN
    return x1 * c - x2 * s, x1 * s + x2 * c


@triton.jit
def _rope_rows(src, s_row, s_h, s0: tl.constexpr, dst, d_row, d_h, d0: tl.constexpr, h, m2, c, s,
               RH: tl.constexpr, RHP: tl.constexpr, ROTATE: tl.constexpr, SIGN: tl.constexpr):
    """dst[..., d0:d0 + 2 RH] = the rotation of src[..., s0:s0 + 2 RH] per (token, head) row of mask m2 (with
    cos / sin c, s [BT, RHP] per token), or the channels as they are without ROTATE."""
    p1, cm = _ptrs(src, s_row, s_h, h, s0, RH, RHP)
    p2, _ = _ptrs(src, s_row, s_h, h, s0 + RH, RH, RHP)
    q1, _ = _ptrs(dst, d_row, d_h, h, d0, RH, RHP)
    q2, _ = _ptrs(dst, d_row, d_h, h, d0 + RH, RH, RHP)
    m = m2[:, :, None] & cm
    x1 = tl.load(p1, mask=m, other=0.0)
    x2 = tl.load(p2, mask=m, other=0.0)
    if ROTATE:
        y1, y2 = _rotate(x1.to(tl.float32), x2.to(tl.float32), c[:, None, :], s[:, None, :], SIGN)
        tl.store(q1, y1.to(dst.dtype.element_ty), mask=m)
        tl.store(q2, y2.to(dst.dtype.element_ty), mask=m)
    else:
        tl.store(q1, x1.to(dst.dtype.element_ty), mask=m)
        tl.store(q2, x2.to(dst.dtype.element_ty), mask=m)


def _p2(n: int) -> int:
    """The power of two >= n (>= 1): a block width for n channels (a tile of 1 where n = 0, then unused)."""
    return triton.next_power_of_2(max(int(n), 1))


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """x itself where its last dim has unit stride (what the kernels index), else a contiguous copy."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


def _tables(cos: torch.Tensor, sin: torch.Tensor, rotate: bool) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """(cos, sin, batch stride, time stride) as the kernels read the tables: [T, r/2] rows alike (batch stride 0)
    or [B, T, r/2] per row (a batch of 1 read by every row), both with the same strides and a unit last stride."""
    if not rotate:
        return cos, sin, 0, 0
    cos, sin = _unit_last(cos), _unit_last(sin)
    if cos.stride() != sin.stride():
        cos, sin = cos.contiguous(), sin.contiguous()
    if cos.dim() == 2:
        return cos, sin, 0, cos.stride(0)
    return cos, sin, (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)


def _check_tables(name: str, cos: torch.Tensor, sin: torch.Tensor, B: int, T: int, r: int) -> None:
    if r % 2:
        raise ValueError(f"{name}: the rope width r = {r} must be even (half-split rotary pairs)")
    ok = (cos.shape == sin.shape and cos.shape[-1] == r // 2 and
          (tuple(cos.shape[:-1]) == (T,) or (cos.dim() == 3 and cos.shape[0] in (1, B) and cos.shape[1] == T)))
    if not ok:
        raise ValueError(f"{name}: cos / sin must be [T, r/2] = [{T}, {r // 2}] or [B, T, r/2] with B = {B}, got "
                         f"{tuple(cos.shape)} and {tuple(sin.shape)}")


def _launch_rows(N: int, H: int) -> tuple[int, int, tuple[int]]:
    """(HP, BT, grid) of the row kernels: every head (padded to HP) of BT tokens a program."""
    HP = _p2(H)
    BT = max(1, ROWS // HP)
    return HP, BT, (triton.cdiv(N, BT),)


# ------------------------------------------------------------------ mha_inputs


@triton.jit
def _mha_inputs_fwd_kernel(q, kvb, kpe, cos, sin, qf, kf, v, N, T, H,
                           s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_pb, s_pt, s_cb, s_ct,
                           NOPE: tl.constexpr, NOPE_P: tl.constexpr, RH: tl.constexpr, RH_P: tl.constexpr,
                           VD: tl.constexpr, VD_P: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr,
                           ROTATE: tl.constexpr):
    """q_full = [q_nope, rot(q_pe)], k_full = [kvb_nope, rot(k_pe) for every head], v = kvb's value channels, for
    every head of BT tokens; q_full, k_full contiguous [N, H, NOPE + 2 RH], v contiguous [N, H, VD]."""
    n, b, t, nm = _tokens(tl.program_id(0), N, T, BT)
    h = tl.arange(0, HP)
    m2 = nm[:, None] & (h < H)[None, :]
    DQ: tl.constexpr = NOPE + 2 * RH
    q_row = b * s_qb + t * s_qt
    k_row = b * s_kb + t * s_kt
    o_row = n * H * DQ
    _copy(q, q_row, s_qh, 0, qf, o_row, DQ, 0, h, m2, NOPE, NOPE_P)
    _copy(kvb, k_row, s_kh, 0, kf, o_row, DQ, 0, h, m2, NOPE, NOPE_P)
    _copy(kvb, k_row, s_kh, NOPE, v, n * H * VD, VD, 0, h, m2, VD, VD_P)
    if RH > 0:
        c, s = _cos_sin(cos, sin, b * s_cb + t * s_ct, nm, RH, RH_P, ROTATE)
        _rope_rows(q, q_row, s_qh, NOPE, qf, o_row, DQ, NOPE, h, m2, c, s, RH, RH_P, ROTATE, 1.0)
        # k_pe: one row per token, rotated once and stored into every head's rope channels
        j = tl.arange(0, RH_P)
        pm = nm[:, None] & (j < RH)[None, :]
        p_off = (b * s_pb + t * s_pt)[:, None] + j[None, :]
        x1 = tl.load(kpe + p_off, mask=pm, other=0.0)
        x2 = tl.load(kpe + p_off + RH, mask=pm, other=0.0)
        if ROTATE:
            x1, x2 = _rotate(x1.to(tl.float32), x2.to(tl.float32), c, s, 1.0)
        k1, cm = _ptrs(kf, o_row, DQ, h, NOPE, RH, RH_P)
        k2, _ = _ptrs(kf, o_row, DQ, h, NOPE + RH, RH, RH_P)
        m = m2[:, :, None] & cm
        tl.store(k1, tl.broadcast_to(x1.to(kf.dtype.element_ty)[:, None, :], [BT, HP, RH_P]), mask=m)
        tl.store(k2, tl.broadcast_to(x2.to(kf.dtype.element_ty)[:, None, :], [BT, HP, RH_P]), mask=m)


@triton.jit
def _mha_inputs_bwd_kernel(dqf, dkf, dv, cos, sin, dq, dkvb, dkpe, N, T, H,
                           s_qb, s_qt, s_qh, s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_cb, s_ct,
                           NOPE: tl.constexpr, NOPE_P: tl.constexpr, RH: tl.constexpr, RH_P: tl.constexpr,
                           VD: tl.constexpr, VD_P: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr,
                           ROTATE: tl.constexpr):
    """dq = [dq_full_nope, rot^-1(dq_full_pe)], dkvb = [dk_full_nope, dv], dk_pe = rot^-1(sum over heads of
    dk_full_pe), for every head of BT tokens; dq contiguous [N, H, NOPE + 2 RH], dkvb [N, H, NOPE + VD],
    dk_pe [N, 2 RH]."""
    n, b, t, nm = _tokens(tl.program_id(0), N, T, BT)
    h = tl.arange(0, HP)
    m2 = nm[:, None] & (h < H)[None, :]
    DQ: tl.constexpr = NOPE + 2 * RH
    DKV: tl.constexpr = NOPE + VD
    q_row = b * s_qb + t * s_qt
    k_row = b * s_kb + t * s_kt
    dq_row = n * H * DQ
    dkv_row = n * H * DKV
    _copy(dqf, q_row, s_qh, 0, dq, dq_row, DQ, 0, h, m2, NOPE, NOPE_P)
    _copy(dkf, k_row, s_kh, 0, dkvb, dkv_row, DKV, 0, h, m2, NOPE, NOPE_P)
    _copy(dv, b * s_vb + t * s_vt, s_vh, 0, dkvb, dkv_row, DKV, NOPE, h, m2, VD, VD_P)
    if RH > 0:
        c, s = _cos_sin(cos, sin, b * s_cb + t * s_ct, nm, RH, RH_P, ROTATE)
        _rope_rows(dqf, q_row, s_qh, NOPE, dq, dq_row, DQ, NOPE, h, m2, c, s, RH, RH_P, ROTATE, -1.0)
        # dk_pe: the heads' rope-channel gradients summed (fp32, masked heads read as 0), then rotated back once
        k1, cm = _ptrs(dkf, k_row, s_kh, h, NOPE, RH, RH_P)
        k2, _ = _ptrs(dkf, k_row, s_kh, h, NOPE + RH, RH, RH_P)
        m = m2[:, :, None] & cm
        g1 = tl.sum(tl.load(k1, mask=m, other=0.0).to(tl.float32), axis=1)
        g2 = tl.sum(tl.load(k2, mask=m, other=0.0).to(tl.float32), axis=1)
        if ROTATE:
            g1, g2 = _rotate(g1, g2, c, s, -1.0)
        j = tl.arange(0, RH_P)
        pm = nm[:, None] & (j < RH)[None, :]
        p_off = (n * (2 * RH))[:, None] + j[None, :]
        tl.store(dkpe + p_off, g1.to(dkpe.dtype.element_ty), mask=pm)
        tl.store(dkpe + p_off + RH, g2.to(dkpe.dtype.element_ty), mask=pm)


def _mha_inputs_fwd_impl(q: torch.Tensor, kvb: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                         nope: int, rotate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q_full, k_full, v) of models/dsa_attn.py mha_inputs: q [B, T, H, nope + r], kvb [B, T, H, nope + vd],
    k_pe [B, T, r] in any strides; outputs contiguous in q's dtype."""
    q, kvb, k_pe = _unit_last(q), _unit_last(kvb), _unit_last(k_pe)
    B, T, H, DQ = q.shape
    r, vd = k_pe.shape[-1], kvb.shape[-1] - nope
    q_full = torch.empty((B, T, H, DQ), device=q.device, dtype=q.dtype)
    k_full = torch.empty((B, T, H, DQ), device=q.device, dtype=q.dtype)
    v = torch.empty((B, T, H, vd), device=q.device, dtype=q.dtype)
    if B * T * H:
        cos, sin, s_cb, s_ct = _tables(cos, sin, rotate and r > 0)
        HP, BT, grid = _launch_rows(B * T, H)
        _mha_inputs_fwd_kernel[grid](
            q, kvb, k_pe, cos, sin, q_full, k_full, v, B * T, T, H, *q.stride()[:3], *kvb.stride()[:3],
            *k_pe.stride()[:2], s_cb, s_ct, NOPE=nope, NOPE_P=_p2(nope), RH=r // 2, RH_P=_p2(r // 2), VD=vd,
            VD_P=_p2(vd), HP=HP, BT=BT, ROTATE=bool(rotate), num_warps=NUM_WARPS)
    return q_full, k_full, v


mha_inputs_fwd = torch.library.custom_op("moeadapt::dsa_mha_inputs_fwd", mutates_args=())(_mha_inputs_fwd_impl)


@mha_inputs_fwd.register_fake
def _(q: torch.Tensor, kvb: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, nope: int,
      rotate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, H, DQ = q.shape
    vd = kvb.shape[-1] - nope
    return (q.new_empty((B, T, H, DQ)), q.new_empty((B, T, H, DQ)), q.new_empty((B, T, H, vd)))


def _mha_inputs_bwd_impl(dq_full: torch.Tensor, dk_full: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor, nope: int, rotate: bool, kvb_dtype: torch.dtype,
                         kpe_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq in dq_full's dtype, dkvb in kvb_dtype, dk_pe in kpe_dtype) of mha_inputs_fwd for the output gradients,
    each contiguous."""
    dq_full, dk_full, dv = _unit_last(dq_full), _unit_last(dk_full), _unit_last(dv)
    B, T, H, DQ = dq_full.shape
    r, vd = DQ - nope, dv.shape[-1]
    dev = dq_full.device
    dq = torch.empty((B, T, H, DQ), device=dev, dtype=dq_full.dtype)
    dkvb = torch.empty((B, T, H, nope + vd), device=dev, dtype=kvb_dtype)
    dk_pe = torch.empty((B, T, r), device=dev, dtype=kpe_dtype)
    if B * T * H:
        cos, sin, s_cb, s_ct = _tables(cos, sin, rotate and r > 0)
        HP, BT, grid = _launch_rows(B * T, H)
        _mha_inputs_bwd_kernel[grid](
            dq_full, dk_full, dv, cos, sin, dq, dkvb, dk_pe, B * T, T, H, *dq_full.stride()[:3],
            *dk_full.stride()[:3], *dv.stride()[:3], s_cb, s_ct, NOPE=nope, NOPE_P=_p2(nope), RH=r // 2,
            RH_P=_p2(r // 2), VD=vd, VD_P=_p2(vd), HP=HP, BT=BT, ROTATE=bool(rotate), num_warps=NUM_WARPS)
    else:
        dk_pe.zero_()  # no heads: nothing reaches k_pe
    return dq, dkvb, dk_pe


mha_inputs_bwd = torch.library.custom_op("moeadapt::dsa_mha_inputs_bwd", mutates_args=())(_mha_inputs_bwd_impl)
mha_inputs_bwd_fast = impl_or_op(mha_inputs_bwd, _mha_inputs_bwd_impl)  # the implementation itself in eager


@mha_inputs_bwd.register_fake
def _(dq_full: torch.Tensor, dk_full: torch.Tensor, dv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
      nope: int, rotate: bool, kvb_dtype: torch.dtype,
      kpe_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, T, H, DQ = dq_full.shape
    return (dq_full.new_empty((B, T, H, DQ)), dq_full.new_empty((B, T, H, nope + dv.shape[-1]), dtype=kvb_dtype),
            dq_full.new_empty((B, T, DQ - nope), dtype=kpe_dtype))


def _mha_setup_context(ctx, inputs, output) -> None:
    _q, kvb, k_pe, cos, sin, nope, rotate = inputs
    ctx.save_for_backward(cos, sin)
    ctx.nope, ctx.rotate, ctx.kvb_dtype, ctx.kpe_dtype = nope, rotate, kvb.dtype, k_pe.dtype


def _mha_backward(ctx, dq_full, dk_full, dv):
    cos, sin = ctx.saved_tensors
    dq, dkvb, dk_pe = mha_inputs_bwd_fast(dq_full, dk_full, dv, cos, sin, ctx.nope, ctx.rotate, ctx.kvb_dtype,
                                          ctx.kpe_dtype)
    need = ctx.needs_input_grad
    return (dq if need[0] else None), (dkvb if need[1] else None), (dk_pe if need[2] else None), None, None, None, None


mha_inputs_fwd.register_autograd(_mha_backward, setup_context=_mha_setup_context)
# the op where traced, in eager an autograd.Function of the same functions (ops/custom.py)
mha_inputs_fwd_fast = eager_or_op(mha_inputs_fwd, _mha_inputs_fwd_impl, _mha_setup_context, _mha_backward)


def mha_inputs_triton(q: torch.Tensor, kvb: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                      nope: int, rotate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """models/dsa_attn.py `mha_inputs` by the Triton kernels: (q_full, k_full, v), contiguous in q's dtype, from
    q [B, T, H, nope + r], kvb [B, T, H, nope + vd], k_pe [B, T, r], cos / sin [T, r/2] or [B, T, r/2];
    differentiable in q, kvb and k_pe."""
    B, T, H, DQ = q.shape
    r = k_pe.shape[-1]
    if not (0 <= nope <= DQ and DQ - nope == r and kvb.shape[:3] == q.shape[:3] and kvb.shape[-1] >= nope
            and tuple(k_pe.shape[:2]) == (B, T) and k_pe.dim() == 3):
        raise ValueError(f"mha_inputs: q [B, T, H, nope + r], kvb [B, T, H, nope + vd], k_pe [B, T, r] with "
                         f"nope = {nope} disagree: {tuple(q.shape)}, {tuple(kvb.shape)}, {tuple(k_pe.shape)}")
    if rotate and r:
        _check_tables("mha_inputs", cos, sin, B, T, r)
    q_full, k_full, v = mha_inputs_fwd_fast(q, kvb, k_pe, cos, sin, int(nope), bool(rotate))
    return q_full, k_full, v


# ------------------------------------------------------------------ gate_heads


@triton.jit
def _gate_tile(o, g, T, s_ob, s_ot, s_oh, s_gb, s_gt, s_gh, V: tl.constexpr, VP: tl.constexpr, BT: tl.constexpr):
    """This program's BT tokens of head h (grid: token blocks, heads, batch): (t, h, b as int64, channels c, token
    mask tm, tile mask m, sigmoid(g) fp32 [BT], o's fp32 tile [BT, VP])."""
    t = (tl.program_id(0) * BT + tl.arange(0, BT)).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    b = tl.program_id(2).to(tl.int64)
    c = tl.arange(0, VP)
    tm = t < T
    m = tm[:, None] & (c < V)[None, :]
    sg = tl.sigmoid(tl.load(g + b * s_gb + t * s_gt + h * s_gh, mask=tm, other=0.0).to(tl.float32))
    x = tl.load(o + (b * s_ob + h * s_oh + t * s_ot)[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
    return t, h, b, c, tm, m, sg, x


@triton.jit
def _gate_fwd_kernel(o, g, y, T, H, s_ob, s_ot, s_oh, s_gb, s_gt, s_gh,
                     V: tl.constexpr, VP: tl.constexpr, BT: tl.constexpr):
    """y[b, t, h V + v] = o[b, t, h, v] sigmoid(g[b, t, h]) for BT tokens of head h; y contiguous [B, T, H V]."""
    t, h, b, c, tm, m, sg, x = _gate_tile(o, g, T, s_ob, s_ot, s_oh, s_gb, s_gt, s_gh, V, VP, BT)
    tl.store(y + ((b * T + t) * H * V + h * V)[:, None] + c[None, :], (x * sg[:, None]).to(y.dtype.element_ty),
             mask=m)


@triton.jit
def _gate_bwd_kernel(o, g, dy, do, dg, T, H, s_ob, s_ot, s_oh, s_gb, s_gt, s_gh, s_yb, s_yt, s_db, s_dt, s_dh,
                     V: tl.constexpr, VP: tl.constexpr, BT: tl.constexpr):
    """do = dy sigmoid(g) (in do's strides), dg = sum_v(dy o) s (1 - s) (contiguous [B, T, H]) for BT tokens of
    head h; dy [B, T, H V]."""
    t, h, b, c, tm, m, sg, x = _gate_tile(o, g, T, s_ob, s_ot, s_oh, s_gb, s_gt, s_gh, V, VP, BT)
    gy = tl.load(dy + (b * s_yb + t * s_yt + h * V)[:, None] + c[None, :], mask=m, other=0.0).to(tl.float32)
    tl.store(do + (b * s_db + h * s_dh + t * s_dt)[:, None] + c[None, :], (gy * sg[:, None]).to(do.dtype.element_ty),
             mask=m)
    dgv = tl.sum(gy * x, axis=1) * sg * (1.0 - sg)
    tl.store(dg + (b * T + t) * H + h, dgv.to(dg.dtype.element_ty), mask=tm)


def _grad_like(o: torch.Tensor) -> torch.Tensor:
    """An empty tensor for o's gradient in o's strides where o is dense with a unit last stride (the attention's
    backward then reads it in its output's layout), else contiguous (empty_like's preserve_format)."""
    return torch.empty_like(o) if o.stride(-1) == 1 else torch.empty(o.shape, device=o.device, dtype=o.dtype)


def _gate_heads_fwd_impl(o: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """y [B, T, H V] (contiguous, o's dtype) = o [B, T, H, V] (any strides) * sigmoid(gate_logits [B, T, H])."""
    o = _unit_last(o)
    B, T, H, V = o.shape
    y = torch.empty((B, T, H * V), device=o.device, dtype=o.dtype)
    if o.numel():
        _gate_fwd_kernel[(triton.cdiv(T, GATE_BLOCK_T), H, B)](
            o, gate_logits, y, T, H, *o.stride()[:3], *gate_logits.stride(), V=V, VP=_p2(V), BT=GATE_BLOCK_T,
            num_warps=GATE_NUM_WARPS)
    return y


gate_heads_fwd = torch.library.custom_op("moeadapt::dsa_gate_heads_fwd", mutates_args=())(_gate_heads_fwd_impl)


@gate_heads_fwd.register_fake
def _(o: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    B, T, H, V = o.shape
    return o.new_empty((B, T, H * V))


def _gate_heads_bwd_impl(o: torch.Tensor, gate_logits: torch.Tensor,
                         dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(d o in o's strides (`_grad_like`), d gate_logits contiguous in its dtype) of gate_heads_fwd for dy."""
    d_o = _grad_like(o)
    o, dy = _unit_last(o), _unit_last(dy)
    B, T, H, V = o.shape
    d_gl = torch.empty((B, T, H), device=o.device, dtype=gate_logits.dtype)
    if o.numel():
        _gate_bwd_kernel[(triton.cdiv(T, GATE_BLOCK_T), H, B)](
            o, gate_logits, dy, d_o, d_gl, T, H, *o.stride()[:3], *gate_logits.stride(), *dy.stride()[:2],
            *d_o.stride()[:3], V=V, VP=_p2(V), BT=GATE_BLOCK_T, num_warps=GATE_NUM_WARPS)
    else:
        d_gl.zero_()
    return d_o, d_gl


gate_heads_bwd = torch.library.custom_op("moeadapt::dsa_gate_heads_bwd", mutates_args=())(_gate_heads_bwd_impl)
gate_heads_bwd_fast = impl_or_op(gate_heads_bwd, _gate_heads_bwd_impl)


@gate_heads_bwd.register_fake
def _(o: torch.Tensor, gate_logits: torch.Tensor, dy: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _grad_like(o), gate_logits.new_empty(gate_logits.shape)


def _gate_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)  # o is the attention's output, which its own backward keeps anyway


def _gate_backward(ctx, dy):
    o, gate_logits = ctx.saved_tensors
    d_o, d_gl = gate_heads_bwd_fast(o, gate_logits, dy)
    return (d_o if ctx.needs_input_grad[0] else None), (d_gl if ctx.needs_input_grad[1] else None)


gate_heads_fwd.register_autograd(_gate_backward, setup_context=_gate_setup_context)
gate_heads_fwd_fast = eager_or_op(gate_heads_fwd, _gate_heads_fwd_impl, _gate_setup_context, _gate_backward)


def gate_heads_triton(o: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """models/dsa_attn.py `gate_heads` by the Triton kernels: o [B, T, H, V] (any strides, e.g. a transposed view
    of FlexAttention's [B, H, T, V] output) * sigmoid(gate_logits [B, T, H]) per head, as contiguous [B, T, H V] in o's
    dtype; differentiable in both."""
    if o.dim() != 4 or tuple(gate_logits.shape) != tuple(o.shape[:3]):
        raise ValueError(f"gate_heads: o [B, T, H, V] and gate_logits [B, T, H] disagree: {tuple(o.shape)}, "
                         f"{tuple(gate_logits.shape)}")
    return gate_heads_fwd_fast(o, gate_logits)


# ------------------------------------------------------------------ rope_first


@triton.jit
def _rope_first_kernel(x, y, cos, sin, N, T, H, s_xb, s_xt, s_xh, s_cb, s_ct,
                       RH: tl.constexpr, RH_P: tl.constexpr, REST: tl.constexpr, REST_P: tl.constexpr,
                       HP: tl.constexpr, BT: tl.constexpr, SIGN: tl.constexpr):
    """y = [rot(x[..., :2 RH]), x[..., 2 RH:]] (SIGN = -1: rotated back) for every head of BT tokens; y contiguous
    [N, H, 2 RH + REST]."""
    n, b, t, nm = _tokens(tl.program_id(0), N, T, BT)
    h = tl.arange(0, HP)
    m2 = nm[:, None] & (h < H)[None, :]
    D: tl.constexpr = 2 * RH + REST
    x_row = b * s_xb + t * s_xt
    y_row = n * H * D
    _copy(x, x_row, s_xh, 2 * RH, y, y_row, D, 2 * RH, h, m2, REST, REST_P)
    if RH > 0:
        c, s = _cos_sin(cos, sin, b * s_cb + t * s_ct, nm, RH, RH_P)
        _rope_rows(x, x_row, s_xh, 0, y, y_row, D, 0, h, m2, c, s, RH, RH_P, True, SIGN)


def _rope_first_impl(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int, inverse: bool) -> torch.Tensor:
    """x [B, T, D] or [B, T, H, D] (any strides) with its first r channels rotated (by -angle where `inverse`: the
    transpose, which is the backward), the rest as they are; contiguous in x's dtype."""
    x = _unit_last(x)
    y = torch.empty(x.shape, device=x.device, dtype=x.dtype)
    if x.numel():
        B, T, D = x.shape[0], x.shape[1], x.shape[-1]
        H, s_xh = (x.shape[2], x.stride(2)) if x.dim() == 4 else (1, 0)
        cos, sin, s_cb, s_ct = _tables(cos, sin, r > 0)
        HP, BT, grid = _launch_rows(B * T, H)
        _rope_first_kernel[grid](x, y, cos, sin, B * T, T, H, x.stride(0), x.stride(1), s_xh, s_cb, s_ct,
                                 RH=r // 2, RH_P=_p2(r // 2), REST=D - r, REST_P=_p2(D - r), HP=HP, BT=BT,
                                 SIGN=-1.0 if inverse else 1.0, num_warps=NUM_WARPS)
    return y


rope_first_op = torch.library.custom_op("moeadapt::dsa_rope_first", mutates_args=())(_rope_first_impl)
rope_first_bwd_fast = impl_or_op(rope_first_op, _rope_first_impl)  # the backward is the same op, inverse flipped


@rope_first_op.register_fake
def _(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int, inverse: bool) -> torch.Tensor:
    return x.new_empty(x.shape)


def _rope_setup_context(ctx, inputs, output) -> None:
    _x, cos, sin, r, inverse = inputs
    ctx.save_for_backward(cos, sin)
    ctx.r, ctx.inverse = r, inverse


def _rope_backward(ctx, dy):
    cos, sin = ctx.saved_tensors
    return rope_first_bwd_fast(dy, cos, sin, ctx.r, not ctx.inverse), None, None, None, None


rope_first_op.register_autograd(_rope_backward, setup_context=_rope_setup_context)
rope_first_fast = eager_or_op(rope_first_op, _rope_first_impl, _rope_setup_context, _rope_backward)


def rope_first_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int) -> torch.Tensor:
    """models/dsa_attn.py `rope_first` by the Triton kernel: x [B, T, D] or [B, T, H, D] with RoPE on its first r
    channels, contiguous in x's dtype; differentiable in x."""
    if x.dim() not in (3, 4) or not 0 <= r <= x.shape[-1]:
        raise ValueError(f"rope_first: x must be [B, T, D] or [B, T, H, D] with r = {r} <= D, got {tuple(x.shape)}")
    if r:
        _check_tables("rope_first", cos, sin, x.shape[0], x.shape[1], r)
    return rope_first_fast(x, cos, sin, int(r), False)
