"""The KDA layer's short causal depthwise convolution + SiLU in Triton, on [B, T, C] directly: one pass forward,
two backward (one where the weight is frozen), and one-pass sliding-window forms of both (below).

Owns the kernels behind `causal_conv_silu(..., backend="triton")` and their registration as the torch.library
custom ops `moeadapt::causal_conv_silu_fwd` / `_bwd` / `_bwd_dx` (so torch.compile and selective activation
checkpointing see one op, not a Triton launch they cannot trace; `conv_silu_fwd_fast` skips the op's dispatch in
plain eager mode, ops/custom.py). Reads the projection output in its own [B, T, C] layout (unit channel stride): no
transposes, no padded copy, no separate SiLU pass. Forward saves only x. Backward pass 1 recomputes the
pre-activation from x (KW shifted reads, served by L1/L2), stores dpre = dy * silu'(pre) (in x's dtype by
default, DPRE_DTYPE) and the weight gradient's partial sums (KW rows per program, which walks several time blocks; summed by
one torch reduction); pass 2 computes dx as the transposed conv of dpre (KW shifted reads). A single backward pass
that recomputed dpre at each of the KW shifts read x KW * KW + KW times per tile and was 1.55x slower
(benchmarks/RESULTS.md).
Where the weight needs no gradient (LoRA fine-tuning: the conv weight is frozen) the backward is the op
`_bwd_dx`, dx alone (DX_ONLY_IMPL): by default the two passes above without the weight-gradient partials, pass 1
on the forward's larger tile; or one kernel that reads x at its 2 KW - 1 shifts and dy at its KW shifts once each
and builds pre, dpre and dx in registers (no dpre buffer; slower on the H100, more exact).
Math in fp32, storage in x's dtype.
L2 norm per head (`norm_dim` > 0: KDA's q and k, which the delta rule takes L2-normalised): the output is
y / sqrt(sum(y^2) + eps) over each group of norm_dim channels (`reference.l2norm`, L2_EPS). A program's channel
tile is then one head, so the forward normalises the fp32 SiLU output in registers before its one store, and the
backward's first pass turns the normalised output's gradient into y's, r (dy - yn sum(dy yn)) with r = 1 / |y|,
from the y it recomputes anyway: no separate norm pass either way, no extra buffer (the norm's own kernels read
and wrote q and k once more each way).
Packed documents: an optional int32 `positions` [B, T] (contiguous) masks tap j of output t unless
j <= positions[b, t] (HAS_POS: without it the kernels are the plain conv).

Sliding-window kernels (FWD_IMPL / BWD_IMPL / DX_ONLY_IMPL = "window"; KW <= 4, wider kernels take the forms
above). The tile kernels read each x (and dpre) row at KW shifts because Triton cannot shift a register tile, and
the two-pass backward writes and re-reads a dpre buffer: the backward moves well over the ~3 B/element (x, dy in,
dx out) it needs. A window program owns a block of channels and a segment of L consecutive steps and walks the
segment one row at a time, keeping the last KW-1 rows it needs as rotating loop-carried [channels] vectors, so
each row of x and dy is read once per program, plus KW-1 halo rows at the segment's edges (the forward: x before
it; the backward: x before and after it, dy after it; L2 hits). Forward: t upwards, x[t]
loaded, x[t-1..t-KW+1] carried, y[t] stored (NORM per head in registers). Backward, one pass: t downwards from
the segment's end + KW-2; each step loads x[t-KW+1] and dy[t], recomputes pre[t] and dpre[t] (NORM's backward
per head first) and forms dx[t] from dpre[t..t+KW-1], dpre[t+1..] carried, so no dpre buffer exists; the first
KW-1 steps are the halo (the next segment's first rows: dpre only, nothing stored). The weight gradient's KW
partial rows per program come from fp32 register accumulators (NEED_DW; off for the dx-only backward). Load
addresses depend on the loop index only, and each loop iteration takes KW-1 steps so that every carried value is
made inside the iteration that passes it on: both are conditions of Triton's software pipeliner, which then
prefetches the next iterations' rows (num_stages). Not yet timed on a GPU; the defaults stay the tile / two-pass
forms until they are.

Shape suffixes: B batch, T time, C channels (heads x head dim), KW kernel width.
No `from __future__ import annotations` here: torch.library infers the op schemas from real annotations.
"""

import torch
import triton
import triton.language as tl

from ..custom import eager_or_op, impl_or_op
from .reference import L2_EPS, norm_fits_tile

# Launch shape: 32 time steps x 128 channels a program (a [2, 4096, 2048] input is 4096 programs), 4 warps.
BLOCK_T = 32
BLOCK_C = 128
NUM_WARPS = 4
# The backward's first pass (dpre + weight-gradient partials): each program walks BWD_TIME_BLOCKS consecutive
# time blocks of 8 steps x 128 channels, so the weight gradient is reduced over time once per program (64 steps)
# and the partials are 8x fewer. Tiles of 32 x 128 on 4 warps, or 8 time blocks of 32 x 128 on 8, need more
# than 255 registers and spill (benchmarks/sm90_check.py); this one takes 143. Sweep: RESULTS.md, KDA section.
BWD_BLOCK_T = 8
BWD_BLOCK_C = 128
BWD_NUM_WARPS = 4
BWD_TIME_BLOCKS = 8
# dpre's storage dtype between the two backward passes: None = x's dtype (bf16 in training: half the fp32 buffer's
# traffic; dpre is rounded once before the transposed conv, dx within 2.7e-3 of the fp32-dpre dx, about bf16's own
# rounding of dx; the weight gradient is taken from the fp32 values in registers either way), or a dtype such as
# torch.float32. On an H100 at [2, 4096, 2048] bf16 (benchmarks/bench_short_conv.py, RESULTS.md): the full backward
# 157.9 -> 139.3 us, the dx-only two-pass form 96.1 -> 71.9 us.
DPRE_DTYPE = None
# The dx-only backward (frozen weight): "two_pass" (_conv_silu_dpre_kernel without the weight-gradient partials on
# the forward's tile, BLOCK_T x BLOCK_C on NUM_WARPS, then _conv_dx_kernel), "fused"
# (_conv_silu_dx_fused_kernel: one pass from x, w and dy, no dpre buffer; KW <= 4, wider kernels take "two_pass")
# or "window" (_conv_silu_bwd_window_kernel without NEED_DW at the WIN_BWD_* launch; not yet timed).
# Same H100 run: two_pass 71.9 us with a bf16 dpre (96.1 with fp32), fused 99.8 us (its best launch) against the
# full backward's 157.9; fused keeps dx within 7e-6 of the fp32 path.
DX_ONLY_IMPL = "two_pass"
# The fused kernel's launch: 32 time steps x 64 channels a program on 4 warps (168 registers on sm_90, no spills):
# 99.8 us; 16 x 128 on 4 warps 100.1, 32 x 128 on 8 warps 135.1 (the H100 run above).
FUSED_DX_BLOCK_T = 32
FUSED_DX_BLOCK_C = 64
FUSED_DX_NUM_WARPS = 4
# Which kernels run (each launcher's `impl=` defaults to these): the forward "tile" (_conv_silu_fwd_kernel) or
# "window" (_conv_silu_fwd_window_kernel); the full backward "two_pass" (_conv_silu_dpre_kernel, _conv_dx_kernel)
# or "window" (_conv_silu_bwd_window_kernel); DX_ONLY_IMPL above also takes "window" (the same kernel without the
# weight-gradient work). The window kernels hold at most 4 taps: wider kernels take the tile / two-pass forms.
# The window forms are not yet timed on a GPU; the defaults stay the measured ones.
FWD_IMPL = "tile"
BWD_IMPL = "two_pass"
# The window kernels' launches: a program owns WIN_*_BLOCK_C channels (with norm_dim > 0 a whole number of heads,
# at least one) and WIN_*_SEG_LEN consecutive time steps (rounded up to a multiple of KW-1, the steps one loop
# iteration takes; [2, 4096, 2048]: 2 x 86 x 8 = 1376 programs), on WIN_*_NUM_WARPS warps, the time loop
# software-pipelined WIN_*_NUM_STAGES deep (tl.range(num_stages=...): the rows of the next iterations are copied
# asynchronously while this one computes). The backward's launch serves the full and the dx-only backward.
# Compiled for sm_90 (Triton 3.6 and 3.9, C and the strides divisible by 16 as in a real launch) the loads pipeline
# only where a thread's part of a row is at least 4 contiguous bytes: BLOCK_C >= 64 x NUM_WARPS for bf16 (256 on
# 4 warps: yes; 128 on 4 or 256 on 8: no); at these defaults at most 137 registers, no spills, <= 13 KB shared.
# Not yet timed on a GPU: guesses to sweep (benchmarks/bench_short_conv.py).
WIN_FWD_SEG_LEN = 48
WIN_FWD_BLOCK_C = 256
WIN_FWD_NUM_WARPS = 4
WIN_FWD_NUM_STAGES = 3
WIN_BWD_SEG_LEN = 48
WIN_BWD_BLOCK_C = 256
WIN_BWD_NUM_WARPS = 4
WIN_BWD_NUM_STAGES = 3


@triton.jit
def _positions(p_ptr, b, t, T, HAS_POS: tl.constexpr):
    """positions[b, t] of a time block (packed documents), or t itself when there are none (then unused)."""
    if HAS_POS:
        return tl.load(p_ptr + b * T + t, mask=t < T, other=0)
    return t


@triton.jit
def _x_tap(xb, t, j: tl.constexpr, c, cm, T, s_xt, pos, HAS_POS: tl.constexpr):
    """x[t - j] as an fp32 [BT, BC] tile: zero before t = 0 and, with positions, outside t's document."""
    tj = t - j
    m = (tj >= 0) & (tj < T)
    if HAS_POS:
        m = m & (pos >= j)
    return tl.load(xb + tj.to(tl.int64)[:, None] * s_xt + c[None, :], mask=m[:, None] & cm[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _pre_tile(xb, w_ptr, t, c, cm, T, s_xt, pos, KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
              HAS_POS: tl.constexpr):
    """The conv's pre-activation of a time block, fp32: sum_j w[KW-1-j] x[t-j] (conv1d with KW-1 left zeros)."""
    pre = tl.zeros([BT, BC], dtype=tl.float32)
    for j in tl.static_range(KW):
        wv = tl.load(w_ptr + c * KW + (KW - 1 - j), mask=cm, other=0.0).to(tl.float32)
        pre += _x_tap(xb, t, j, c, cm, T, s_xt, pos, HAS_POS) * wv[None, :]
    return pre


@triton.jit
def _inv_norm(y, eps):
    """1 / sqrt(sum(y^2) + eps) of each row of an fp32 [BT, BC] tile (one head per row: BC = the norm's group)."""
    return 1.0 / tl.sqrt_rn(tl.sum(y * y, axis=1) + eps)


@triton.jit
def _conv_silu_fwd_kernel(x_ptr, w_ptr, y_ptr, p_ptr, T, C, s_xb, s_xt, s_yb, s_yt, eps,
                          KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr,
                          NORM: tl.constexpr):
    """y = silu(pre) for a [BT, BC] tile; NORM: each row of the tile (one head, BC = its channels) L2-normalised."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2).to(tl.int64)
    cm = c < C
    pos = _positions(p_ptr, b, t, T, HAS_POS)
    acc = _pre_tile(x_ptr + b * s_xb, w_ptr, t, c, cm, T, s_xt, pos, KW, BT, BC, HAS_POS)
    y = acc * tl.sigmoid(acc)
    if NORM:
        y = y * _inv_norm(y, eps)[:, None]
    om = (t < T)[:, None] & cm[None, :]
    tl.store(y_ptr + b * s_yb + t.to(tl.int64)[:, None] * s_yt + c[None, :], y.to(y_ptr.dtype.element_ty), mask=om)


@triton.jit
def _conv_silu_dpre_kernel(x_ptr, w_ptr, dy_ptr, dpre_ptr, dwp_ptr, p_ptr, T, C, s_xb, s_xt, s_dyb, s_dyt, eps,
                           KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, NTB: tl.constexpr,
                           HAS_POS: tl.constexpr, NEED_DW: tl.constexpr, NORM: tl.constexpr):
    """Backward, first pass, over NTB consecutive time blocks of BT steps: dpre = dy * silu'(pre) (pre recomputed
    from x; NORM: dy is the gradient of the L2-normalised rows yn = y r, so y's is r (dy - yn sum(dy yn)) first)
    stored in dpre_ptr's dtype [B, T, C], and (NEED_DW) the program's partial weight gradient
    dw[KW-1-j] = sum_t dpre[t] x[t-j] from the fp32 dpre. With KW <= 4 the products accumulate in [BT, BC] tiles and
    are reduced over time once per program; a wider kernel reduces per block (the launcher passes NTB = 1 then).
    Without NEED_DW (the dx-only backward's two-pass form) dwp_ptr is unused and nothing but dpre is computed."""
    pid_t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2).to(tl.int64)
    cm = c < C
    xb = x_ptr + b * s_xb
    dwp = dwp_ptr + (b * tl.num_programs(0) + pid_t) * KW * C  # this program's KW partial rows
    TILE_ACC: tl.constexpr = NEED_DW and KW <= 4
    a0 = tl.zeros([BT, BC], dtype=tl.float32)
    a1 = tl.zeros([BT, BC], dtype=tl.float32)
    a2 = tl.zeros([BT, BC], dtype=tl.float32)
    a3 = tl.zeros([BT, BC], dtype=tl.float32)
    for it in range(NTB):
        t = (pid_t * NTB + it) * BT + tl.arange(0, BT)
        pos = _positions(p_ptr, b, t, T, HAS_POS)
        pre = _pre_tile(xb, w_ptr, t, c, cm, T, s_xt, pos, KW, BT, BC, HAS_POS)
        om = (t < T)[:, None] & cm[None, :]
        dyv = tl.load(dy_ptr + b * s_dyb + t.to(tl.int64)[:, None] * s_dyt + c[None, :], mask=om,
                      other=0.0).to(tl.float32)
        sig = tl.sigmoid(pre)
        if NORM:  # the norm's backward: y = silu(pre), r = 1 / |y| per row (head), dy <- r (dy - yn sum(dy yn))
            y = pre * sig
            r = _inv_norm(y, eps)
            yn = y * r[:, None]
            dyv = r[:, None] * (dyv - yn * tl.sum(dyv * yn, axis=1)[:, None])
        dpre = dyv * sig * (1.0 + pre * (1.0 - sig))  # silu'(pre); 0 past T (dy masked to 0)
        tl.store(dpre_ptr + (b * T + t.to(tl.int64))[:, None] * C + c[None, :], dpre.to(dpre_ptr.dtype.element_ty),
                 mask=om)
        if NEED_DW:
            for j in tl.static_range(KW):  # the same x tiles again (L1 / L2 hits)
                prod = dpre * _x_tap(xb, t, j, c, cm, T, s_xt, pos, HAS_POS)
                if TILE_ACC:
                    if j == 0:
                        a0 += prod
                    elif j == 1:
                        a1 += prod
                    elif j == 2:
                        a2 += prod
                    else:
                        a3 += prod
                else:
                    tl.store(dwp + (KW - 1 - j) * C + c, tl.sum(prod, axis=0), mask=cm)
    if TILE_ACC:
        for j in tl.static_range(KW):
            if j == 0:
                dw = tl.sum(a0, axis=0)
            elif j == 1:
                dw = tl.sum(a1, axis=0)
            elif j == 2:
                dw = tl.sum(a2, axis=0)
            else:
                dw = tl.sum(a3, axis=0)
            tl.store(dwp + (KW - 1 - j) * C + c, dw, mask=cm)


@triton.jit
def _conv_dx_kernel(dpre_ptr, w_ptr, dx_ptr, p_ptr, T, C, s_dxb, s_dxt,
                    KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr):
    """Backward, second pass: dx[t] = sum_s w[KW-1-s] dpre[t+s] (the transposed conv; with positions, x[t] reaches
    output t+s only where positions[t+s] >= s, i.e. inside one document)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2).to(tl.int64)
    cm = c < C
    dx = tl.zeros([BT, BC], dtype=tl.float32)
    for s in tl.static_range(KW):
        ts = t + s
        m = ts < T
        if HAS_POS:
            m = m & (tl.load(p_ptr + b * T + ts, mask=ts < T, other=0) >= s)
        dv = tl.load(dpre_ptr + (b * T + ts.to(tl.int64))[:, None] * C + c[None, :], mask=m[:, None] & cm[None, :],
                     other=0.0).to(tl.float32)
        ws = tl.load(w_ptr + c * KW + (KW - 1 - s), mask=cm, other=0.0).to(tl.float32)
        dx += dv * ws[None, :]
    om = (t < T)[:, None] & cm[None, :]
    tl.store(dx_ptr + b * s_dxb + t.to(tl.int64)[:, None] * s_dxt + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=om)


@triton.jit
def _pick(i: tl.constexpr, v0, v1, v2, v3):
    """v_i for a compile-time i < 4 (the fused dx kernel keeps its per-tap values in named registers)."""
    if i == 0:
        return v0
    if i == 1:
        return v1
    if i == 2:
        return v2
    return v3


@triton.jit
def _tap_weight(w_ptr, c, cm, j: tl.constexpr, KW: tl.constexpr, BC: tl.constexpr):
    """The weight of tap j (w[c, KW-1-j], which multiplies x[u-j] in output u) as an fp32 [BC] vector; zero for
    j >= KW (a tap the kernel does not have)."""
    if j < KW:
        return tl.load(w_ptr + c * KW + (KW - 1 - j), mask=cm, other=0.0).to(tl.float32)
    return tl.zeros([BC], dtype=tl.float32)


@triton.jit
def _x_rows(xb, u, c, cm, T, s_xt):
    """x[u] as an fp32 [BT, BC] tile, zero outside 0 <= u < T (the document mask is applied per tap, by the
    output that reads it)."""
    m = (u >= 0) & (u < T)
    return tl.load(xb + u.to(tl.int64)[:, None] * s_xt + c[None, :], mask=m[:, None] & cm[None, :],
                   other=0.0).to(tl.float32)


@triton.jit
def _in_doc(v, pos, j: tl.constexpr, HAS_POS: tl.constexpr):
    """v [BT, BC] where tap j of each row's output lies inside its document (j <= positions), else 0."""
    if HAS_POS:
        return tl.where((pos >= j)[:, None], v, 0.0)
    return v


@triton.jit
def _conv_silu_dx_fused_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, p_ptr, T, C, s_xb, s_xt, s_dyb, s_dyt, s_dxb, s_dxt,
                               KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr):
    """The dx-only backward in one pass (no dpre buffer, no weight gradient), for KW <= 4: for the times t of a
    block, dx[t] = sum_s w[KW-1-s] dpre[t+s], with dpre[u] = dy[u] silu'(pre[u]) and
    pre[u] = sum_j w[KW-1-j] x[u-j]. The KW outputs u = t+s are visited in order with a window of registers holding
    x[u-1], x[u-2], x[u-3] that slides one step per output, so each of the 2 KW - 1 shifted x tiles (t-KW+1 .. t+KW-1)
    and each of the KW shifted dy tiles is loaded once. Masks as in the two-pass form: zero before t = 0 and past T;
    with positions, tap j of output u counts only where j <= positions[u], and x[t] reaches output t+s only where
    positions[t+s] >= s."""
    tl.static_assert(KW <= 4, "the fused dx kernel holds at most 4 taps; wider kernels take the two-pass form")
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2).to(tl.int64)
    cm = c < C
    xb = x_ptr + b * s_xb
    w0 = _tap_weight(w_ptr, c, cm, 0, KW, BC)
    w1 = _tap_weight(w_ptr, c, cm, 1, KW, BC)
    w2 = _tap_weight(w_ptr, c, cm, 2, KW, BC)
    w3 = _tap_weight(w_ptr, c, cm, 3, KW, BC)
    # the window before output u = t: x[t-1], x[t-2], x[t-3] (those the kernel's taps reach)
    x1 = _x_rows(xb, t - 1, c, cm, T, s_xt) if KW > 1 else tl.zeros([BT, BC], dtype=tl.float32)
    x2 = _x_rows(xb, t - 2, c, cm, T, s_xt) if KW > 2 else tl.zeros([BT, BC], dtype=tl.float32)
    x3 = _x_rows(xb, t - 3, c, cm, T, s_xt) if KW > 3 else tl.zeros([BT, BC], dtype=tl.float32)
    dx = tl.zeros([BT, BC], dtype=tl.float32)
    for s in tl.static_range(KW):
        u = t + s
        pos = _positions(p_ptr, b, u, T, HAS_POS)  # 0 past T (unused there: dy is 0)
        x0 = _x_rows(xb, u, c, cm, T, s_xt)  # the one new x tile of this shift
        pre = x0 * w0[None, :]  # tap 0 is always inside the document
        if KW > 1:
            pre += _in_doc(x1, pos, 1, HAS_POS) * w1[None, :]
        if KW > 2:
            pre += _in_doc(x2, pos, 2, HAS_POS) * w2[None, :]
        if KW > 3:
            pre += _in_doc(x3, pos, 3, HAS_POS) * w3[None, :]
        um = (u < T)[:, None] & cm[None, :]
        dyv = tl.load(dy_ptr + b * s_dyb + u.to(tl.int64)[:, None] * s_dyt + c[None, :], mask=um, other=0.0)
        sig = tl.sigmoid(pre)
        dpre = dyv.to(tl.float32) * sig * (1.0 + pre * (1.0 - sig))  # silu'(pre); 0 past T (dy masked to 0)
        # x[t] is tap s of output t+s: it counts where that output's document reaches s steps back
        dx += _in_doc(dpre, pos, s, HAS_POS) * _pick(s, w0, w1, w2, w3)[None, :]
        x3 = x2
        x2 = x1
        x1 = x0
    om = (t < T)[:, None] & cm[None, :]
    tl.store(dx_ptr + b * s_dxb + t.to(tl.int64)[:, None] * s_dxt + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=om)


# ------------------------------------------------------------------ sliding-window kernels (KW <= 4)


@triton.jit
def _win_mask(cm, ok):
    """The channel mask cm where the scalar condition ok holds, else all false (a select on the scalar: the
    interpreter turns `cm & ok` into int32)."""
    return tl.where(ok, cm, False)


@triton.jit
def _win_row(base, t, T, s_t, c, cm):
    """Row t of a [B, T, C] operand (base: its batch row) at the program's channels c [NH, ND], fp32; zero outside
    0 <= t < T. t is a scalar (the loop's row), so the address depends on the loop index alone."""
    return tl.load(base + t.to(tl.int64) * s_t + c, mask=_win_mask(cm, (t >= 0) & (t < T)),
                   other=0.0).to(tl.float32)


@triton.jit
def _win_pos(p_ptr, b, t, T, zero, HAS_POS: tl.constexpr):
    """positions[b, t] broadcast over the program's [NH, ND] channels (one address: a tensor load the pipeliner can
    prefetch, unlike a scalar one), 0 outside 0 <= t < T; `zero` itself without positions (then unused)."""
    if HAS_POS:
        return tl.load(p_ptr + b * T + t + zero, mask=_win_mask(zero == 0, (t >= 0) & (t < T)), other=0)
    return zero


@triton.jit
def _win_doc(v, pos, j: tl.constexpr, HAS_POS: tl.constexpr):
    """v where tap j of the output whose position is `pos` lies inside its document (j <= pos), else 0."""
    if HAS_POS:
        if j > 0:
            return tl.where(pos >= j, v, 0.0)
    return v


@triton.jit
def _win_taps(v0, v1, v2, v3, p1, p2, p3, w0, w1, w2, w3, KW: tl.constexpr, HAS_POS: tl.constexpr):
    """sum_j w_j v_j over the KW taps, tap j > 0 counted only where j <= p_j (HAS_POS): the forward's pre from
    x[t-j] (every p_j = positions[t]) and the backward's dx from dpre[t+j] (p_j = positions[t+j])."""
    acc = v0 * w0
    if KW > 1:
        acc += _win_doc(v1, p1, 1, HAS_POS) * w1
    if KW > 2:
        acc += _win_doc(v2, p2, 2, HAS_POS) * w2
    if KW > 3:
        acc += _win_doc(v3, p3, 3, HAS_POS) * w3
    return acc


@triton.jit
def _win_weight(w_ptr, c, cm, j: tl.constexpr, KW: tl.constexpr):
    """Tap j's weight w[c, KW-1-j] (it multiplies x[t-j] in output t) over the program's [NH, ND] channels, fp32;
    zero for j >= KW."""
    if j < KW:
        return tl.load(w_ptr + c * KW + (KW - 1 - j), mask=cm, other=0.0).to(tl.float32)
    return tl.zeros(c.shape, dtype=tl.float32)


@triton.jit
def _win_head_scale(y, eps):
    """1 / sqrt(sum(y^2) + eps) over each head (row) of an fp32 [NH, ND] tile, broadcast back to [NH, ND]."""
    return (1.0 / tl.sqrt_rn(tl.sum(y * y, axis=1) + eps))[:, None]


@triton.jit
def _win_channels(NH: tl.constexpr, ND: tl.constexpr, C):
    """The program's channels as an [NH, ND] tile (NH heads of ND channels; NH = 1 and ND = the block without a
    norm) and their mask."""
    c = tl.program_id(1) * (NH * ND) + tl.arange(0, NH)[:, None] * ND + tl.arange(0, ND)[None, :]
    return c, c < C


@triton.jit
def _conv_silu_fwd_window_kernel(x_ptr, w_ptr, y_ptr, p_ptr, T, C, s_xb, s_xt, s_yb, s_yt, eps,
                                 KW: tl.constexpr, L: tl.constexpr, NH: tl.constexpr, ND: tl.constexpr,
                                 HAS_POS: tl.constexpr, NORM: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The forward as a sliding window: a program owns NH x ND channels and the L steps t0 .. t0+L-1 and walks them
    in order, one row a step. x[t] is loaded once (the KW-1 rows before t0 once more, by the program before); x[t-1],
    x[t-2], x[t-3] are carried from earlier steps in registers. y[t] = silu(sum_j w[KW-1-j] x[t-j]), tap j counted
    only where j <= positions[t] (HAS_POS); NORM: each head (row of the tile) L2-normalised before the store.
    Each iteration of the time loop takes U = KW-1 steps (unrolled; L a multiple of U), so the rows it carries to
    the next are the ones it loaded: a loop that passes a carried value on unchanged (x2 = x1 across iterations) is
    one Triton's software pipeliner declines (loopHasDistGreaterThanOne), and then no row is prefetched."""
    tl.static_assert(KW <= 4, "the window kernels carry at most 3 rows; wider kernels take the tile form")
    U: tl.constexpr = KW - 1 if KW > 1 else 1
    tl.static_assert(L % U == 0, "the segment must be a whole number of KW-1 steps")
    t0 = tl.program_id(0) * L
    b = tl.program_id(2).to(tl.int64)
    c, cm = _win_channels(NH, ND, C)
    xb = x_ptr + b * s_xb
    yb = y_ptr + b * s_yb
    zero = tl.zeros([NH, ND], dtype=tl.int32)
    w0 = _win_weight(w_ptr, c, cm, 0, KW)
    w1 = _win_weight(w_ptr, c, cm, 1, KW)
    w2 = _win_weight(w_ptr, c, cm, 2, KW)
    w3 = _win_weight(w_ptr, c, cm, 3, KW)
    # the window before t0: x1 = x[t-1], x2 = x[t-2], x3 = x[t-3] (those the taps reach; zero before t = 0)
    x1 = _win_row(xb, t0 - 1, T, s_xt, c, cm) if KW > 1 else tl.zeros([NH, ND], dtype=tl.float32)
    x2 = _win_row(xb, t0 - 2, T, s_xt, c, cm) if KW > 2 else tl.zeros([NH, ND], dtype=tl.float32)
    x3 = _win_row(xb, t0 - 3, T, s_xt, c, cm) if KW > 3 else tl.zeros([NH, ND], dtype=tl.float32)
    for i in tl.range(L // U, num_stages=NUM_STAGES):
        for k in tl.static_range(U):
            t = t0 + i * U + k
            x0 = _win_row(xb, t, T, s_xt, c, cm)
            pos = _win_pos(p_ptr, b, t, T, zero, HAS_POS)
            pre = _win_taps(x0, x1, x2, x3, pos, pos, pos, w0, w1, w2, w3, KW, HAS_POS)
            y = pre * tl.sigmoid(pre)
            if NORM:
                y = y * _win_head_scale(y, eps)
            tl.store(yb + t.to(tl.int64) * s_yt + c, y.to(y_ptr.dtype.element_ty), mask=_win_mask(cm, t < T))
            if KW > 3:
                x3 = x2
            if KW > 2:
                x2 = x1
            if KW > 1:
                x1 = x0


@triton.jit
def _win_tap(j: tl.constexpr, KW: tl.constexpr, u0, u1, u2, xn):
    """x[t-j] in the backward's window: u0 = x[t], u1 = x[t-1], u2 = x[t-2] (the KW-1 carried rows) and xn =
    x[t-(KW-1)] (the row loaded this step)."""
    if j == KW - 1:
        return xn
    if j == 0:
        return u0
    if j == 1:
        return u1
    return u2


@triton.jit
def _conv_silu_bwd_window_kernel(x_ptr, w_ptr, dy_ptr, dx_ptr, dwp_ptr, p_ptr, T, C, s_xb, s_xt, s_dyb, s_dyt,
                                 s_dxb, s_dxt, eps, KW: tl.constexpr, L: tl.constexpr, NH: tl.constexpr,
                                 ND: tl.constexpr, HAS_POS: tl.constexpr, NEED_DW: tl.constexpr,
                                 NORM: tl.constexpr, NUM_STAGES: tl.constexpr):
    """The backward as a sliding window, one pass, no dpre buffer: a program owns NH x ND channels and the L steps
    t0 .. t0+L-1 and walks t downwards from t0+L+KW-2, one row a step. Step t loads x[t-(KW-1)] (x[t], x[t-1],
    x[t-2] are carried) and dy[t], recomputes pre[t] = sum_j w[KW-1-j] x[t-j] (tap j only where
    j <= positions[t]), dpre[t] = dy[t] silu'(pre[t]) (NORM: dy first turned into y's gradient per head, as in
    _conv_silu_dpre_kernel), and dx[t] = sum_s w[KW-1-s] dpre[t+s] from dpre[t+1 .. t+3] carried (x[t] reaches
    output t+s only where positions[t+s] >= s). The first KW-1 steps are the halo, rows t0+L .. t0+L+KW-2 of the
    next segment: their dpre is recomputed for the transposed conv, their dx is not stored and they add nothing
    to the weight gradient. NEED_DW: dw[KW-1-j] += dpre[t] x[t-j] (document-masked) in fp32 registers over the
    segment, stored as this program's KW partial rows of dwp [programs, KW, C].
    As in the forward, each loop iteration takes U = KW-1 steps (the first iteration is the halo), so every value
    it carries on was made in it and Triton's pipeliner can prefetch the next iterations' rows."""
    tl.static_assert(KW <= 4, "the window kernels carry at most 3 rows; wider kernels take the two-pass form")
    U: tl.constexpr = KW - 1 if KW > 1 else 1
    HALO: tl.constexpr = 1 if KW > 1 else 0  # loop iterations spent on the halo
    tl.static_assert(L % U == 0, "the segment must be a whole number of KW-1 steps")
    pid_t = tl.program_id(0)
    t0 = pid_t * L
    b = tl.program_id(2).to(tl.int64)
    c, cm = _win_channels(NH, ND, C)
    xb = x_ptr + b * s_xb
    dyb = dy_ptr + b * s_dyb
    dxb = dx_ptr + b * s_dxb
    zero = tl.zeros([NH, ND], dtype=tl.int32)
    fzero = tl.zeros([NH, ND], dtype=tl.float32)
    w0 = _win_weight(w_ptr, c, cm, 0, KW)
    w1 = _win_weight(w_ptr, c, cm, 1, KW)
    w2 = _win_weight(w_ptr, c, cm, 2, KW)
    w3 = _win_weight(w_ptr, c, cm, 3, KW)
    top = t0 + L + KW - 2  # the last halo row, the walk's first
    # the x window at t = top: u0 = x[t], u1 = x[t-1], u2 = x[t-2] (KW-1 rows; zero outside 0 <= t < T)
    u0 = _win_row(xb, top, T, s_xt, c, cm) if KW > 1 else tl.zeros([NH, ND], dtype=tl.float32)
    u1 = _win_row(xb, top - 1, T, s_xt, c, cm) if KW > 2 else tl.zeros([NH, ND], dtype=tl.float32)
    u2 = _win_row(xb, top - 2, T, s_xt, c, cm) if KW > 3 else tl.zeros([NH, ND], dtype=tl.float32)
    # dpre[t+1], dpre[t+2], dpre[t+3] and positions[t+1 ..] (rows past the halo: zero, never reach a stored dx).
    # Each starts as its own tensor: Triton finds a loop's carried values by comparing each name's value after the
    # body with its value before, so d2 = d1 with both the same zeros would read as unchanged and d2 stay zero.
    d1 = tl.zeros([NH, ND], dtype=tl.float32)
    d2 = tl.zeros([NH, ND], dtype=tl.float32)
    d3 = tl.zeros([NH, ND], dtype=tl.float32)
    q1 = tl.zeros([NH, ND], dtype=tl.int32)
    q2 = tl.zeros([NH, ND], dtype=tl.int32)
    q3 = tl.zeros([NH, ND], dtype=tl.int32)
    a0 = tl.zeros([NH, ND], dtype=tl.float32)  # the weight gradient of taps 0 .. 3 over the segment
    a1 = tl.zeros([NH, ND], dtype=tl.float32)
    a2 = tl.zeros([NH, ND], dtype=tl.float32)
    a3 = tl.zeros([NH, ND], dtype=tl.float32)
    for i in tl.range(L // U + HALO, num_stages=NUM_STAGES):
        live = i >= HALO  # rows of the segment (not the halo)
        for k in tl.static_range(U):
            t = top - (i * U + k)
            xn = _win_row(xb, t - (KW - 1), T, s_xt, c, cm)
            dyv = _win_row(dyb, t, T, s_dyt, c, cm)
            pos = _win_pos(p_ptr, b, t, T, zero, HAS_POS)
            xm0 = _win_tap(0, KW, u0, u1, u2, xn)
            pre = xm0 * w0
            xm1 = fzero
            xm2 = fzero
            xm3 = fzero
            if KW > 1:
                xm1 = _win_doc(_win_tap(1, KW, u0, u1, u2, xn), pos, 1, HAS_POS)
                pre += xm1 * w1
            if KW > 2:
                xm2 = _win_doc(_win_tap(2, KW, u0, u1, u2, xn), pos, 2, HAS_POS)
                pre += xm2 * w2
            if KW > 3:
                xm3 = _win_doc(_win_tap(3, KW, u0, u1, u2, xn), pos, 3, HAS_POS)
                pre += xm3 * w3
            sig = tl.sigmoid(pre)
            if NORM:  # y = silu(pre), r = 1 / |y| per head: dy <- r (dy - yn sum(dy yn))
                y = pre * sig
                r = _win_head_scale(y, eps)
                yn = y * r
                dyv = r * (dyv - yn * tl.sum(dyv * yn, axis=1)[:, None])
            dpre = dyv * sig * (1.0 + pre * (1.0 - sig))  # silu'(pre); 0 past T (dy masked to 0)
            dx = _win_taps(dpre, d1, d2, d3, q1, q2, q3, w0, w1, w2, w3, KW, HAS_POS)  # output t+j's tap j
            tl.store(dxb + t.to(tl.int64) * s_dxt + c, dx.to(dx_ptr.dtype.element_ty),
                     mask=_win_mask(cm, (t < T) & live))
            if NEED_DW:
                dl = tl.where(live, dpre, 0.0)
                a0 += dl * xm0
                if KW > 1:
                    a1 += dl * xm1
                if KW > 2:
                    a2 += dl * xm2
                if KW > 3:
                    a3 += dl * xm3
            # slide one row down: x[t-1 ..] and dpre[t ..], positions[t ..]
            if KW == 4:
                u0 = u1
                u1 = u2
                u2 = xn
                d3 = d2
                q3 = q2
            if KW == 3:
                u0 = u1
                u1 = xn
            if KW == 2:
                u0 = xn
            if KW > 2:
                d2 = d1
                q2 = q1
            if KW > 1:
                d1 = dpre
                q1 = pos
    if NEED_DW:
        dwp = dwp_ptr + (b * tl.num_programs(0) + pid_t) * KW * C  # this program's KW partial rows
        tl.store(dwp + (KW - 1) * C + c, a0, mask=cm)
        if KW > 1:
            tl.store(dwp + (KW - 2) * C + c, a1, mask=cm)
        if KW > 2:
            tl.store(dwp + (KW - 3) * C + c, a2, mask=cm)
        if KW > 3:
            tl.store(dwp + (KW - 4) * C + c, a3, mask=cm)


def _unit_channel_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(2) == 1 else x.contiguous()


def check_norm_dim(C: int, norm_dim: int) -> None:
    """The kernels normalise a whole tile row: norm_dim must be a power of two (the tile's channel width) that
    divides C; 0 means no norm."""
    if norm_dim and (not norm_fits_tile(norm_dim) or C % norm_dim):
        raise ValueError(f"norm_dim={norm_dim} must be a power of two dividing the {C} channels (the fused L2 norm "
                         "normalises one channel tile per head); pass 0 and normalise apart")


def _channel_block(block_c: int, norm_dim: int) -> int:
    """A launch's channel tile: the norm's group where there is one (a tile row is then one head)."""
    return norm_dim or block_c


def _win_tile(block_c: int, norm_dim: int) -> tuple[int, int]:
    """A window launch's channel tile as (NH, ND): whole heads of norm_dim channels covering block_c (at least
    one), or one row of block_c channels without a norm."""
    if block_c <= 0 or block_c & (block_c - 1):
        raise ValueError(f"block_c={block_c} must be a power of two")
    return (max(block_c // norm_dim, 1), norm_dim) if norm_dim else (1, block_c)


def _win_seg_len(seg_len: int, KW: int) -> int:
    """A window launch's segment: seg_len rounded up to a whole number of the kernel's loop iterations (KW-1
    steps each)."""
    u = max(KW - 1, 1)
    return -(-seg_len // u) * u


def conv_silu_window_fwd(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor | None = None,
                         norm_dim: int = 0, seg_len: int = WIN_FWD_SEG_LEN, block_c: int = WIN_FWD_BLOCK_C,
                         num_warps: int = WIN_FWD_NUM_WARPS, num_stages: int = WIN_FWD_NUM_STAGES) -> torch.Tensor:
    """The forward by the sliding-window kernel (KW <= 4) with an explicit launch: programs of `seg_len` time steps
    x `block_c` channels (whole heads of norm_dim with a norm) on `num_warps` warps, the time loop pipelined
    `num_stages` deep. Operands and result as in `_conv_silu_fwd_impl`."""
    x = _unit_channel_stride(x)
    B, T, C = x.shape
    KW = w.shape[-1]
    check_norm_dim(C, norm_dim)
    if KW > 4:
        raise ValueError(f"the window kernels hold at most 4 taps, got KW={KW}")
    y = torch.empty((B, T, C), device=x.device, dtype=x.dtype)
    if x.numel():
        nh, nd = _win_tile(block_c, norm_dim)
        seg_len = _win_seg_len(seg_len, KW)
        _conv_silu_fwd_window_kernel[(triton.cdiv(T, seg_len), triton.cdiv(C, nh * nd), B)](
            x, w.contiguous(), y, x if positions is None else positions, T, C, x.stride(0), x.stride(1), y.stride(0),
            y.stride(1), L2_EPS, KW=KW, L=seg_len, NH=nh, ND=nd, HAS_POS=positions is not None, NORM=norm_dim > 0,
            NUM_STAGES=num_stages, num_warps=num_warps, num_stages=num_stages)
    return y


def conv_silu_fwd_launch(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor | None = None,
                         norm_dim: int = 0, impl: str = FWD_IMPL) -> torch.Tensor:
    """The forward by `impl`: "tile" (_conv_silu_fwd_kernel, BLOCK_T x BLOCK_C tiles) or "window"
    (conv_silu_window_fwd at its WIN_FWD_* launch; KW > 4 takes "tile")."""
    if impl not in ("tile", "window"):
        raise ValueError(f"impl must be 'tile' or 'window', got {impl!r}.")
    if impl == "window" and w.shape[-1] <= 4:
        return conv_silu_window_fwd(x, w, positions, norm_dim)
    x = _unit_channel_stride(x)
    B, T, C = x.shape
    check_norm_dim(C, norm_dim)
    y = torch.empty((B, T, C), device=x.device, dtype=x.dtype)
    if x.numel():
        bc = _channel_block(BLOCK_C, norm_dim)
        grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(C, bc), B)
        _conv_silu_fwd_kernel[grid](x, w.contiguous(), y, x if positions is None else positions, T, C, x.stride(0),
                                    x.stride(1), y.stride(0), y.stride(1), L2_EPS, KW=w.shape[-1], BT=BLOCK_T, BC=bc,
                                    HAS_POS=positions is not None, NORM=norm_dim > 0, num_warps=NUM_WARPS)
    return y


def _conv_silu_fwd_impl(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor | None = None,
                        norm_dim: int = 0) -> torch.Tensor:
    """y [B, T, C] = silu(causal depthwise conv of x [B, T, C] with w [C, 1, KW]), in x's dtype; positions:
    int32 [B, T] contiguous (packed documents) or None; norm_dim > 0: y L2-normalised over each group of norm_dim
    channels (check_norm_dim). FWD_IMPL's kernel."""
    return conv_silu_fwd_launch(x, w, positions, norm_dim)


conv_silu_fwd = torch.library.custom_op("moeadapt::causal_conv_silu_fwd", mutates_args=())(_conv_silu_fwd_impl)


@conv_silu_fwd.register_fake
def _(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor | None = None, norm_dim: int = 0) -> torch.Tensor:
    return torch.empty(x.shape, device=x.device, dtype=x.dtype)


def _dpre_pass(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, positions: torch.Tensor | None, dpre_dtype,
               block_t: int, block_c: int, num_warps: int, time_blocks: int, need_dw: bool, norm_dim: int = 0):
    """Backward pass 1 (_conv_silu_dpre_kernel) on unit-channel-stride x, dy and contiguous w: (dpre [B, T, C] in
    dpre_dtype, the weight gradient's partials [programs, KW, C] fp32 or None without need_dw). norm_dim > 0: dy
    is the gradient of the L2-normalised output, and the channel tile is norm_dim wide."""
    B, T, C = x.shape
    KW = w.shape[-1]
    block_c = _channel_block(block_c, norm_dim)
    ntb = time_blocks if need_dw and KW <= 4 else 1  # tile accumulators for the weight gradient exist up to KW = 4
    npt = triton.cdiv(T, block_t * ntb)
    dpre = torch.empty((B, T, C), device=x.device, dtype=x.dtype if dpre_dtype is None else dpre_dtype)
    dw_part = torch.empty((B * npt, KW, C), device=x.device, dtype=torch.float32) if need_dw else None
    _conv_silu_dpre_kernel[(npt, triton.cdiv(C, block_c), B)](
        x, w, dy, dpre, dpre if dw_part is None else dw_part, x if positions is None else positions, T, C,
        x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), L2_EPS, KW=KW, BT=block_t, BC=block_c, NTB=ntb,
        HAS_POS=positions is not None, NEED_DW=need_dw, NORM=norm_dim > 0, num_warps=num_warps)
    return dpre, dw_part


def _dx_pass(dpre: torch.Tensor, w: torch.Tensor, dx: torch.Tensor, positions: torch.Tensor | None) -> None:
    """Backward pass 2 (_conv_dx_kernel): dx = the transposed conv of dpre, written into dx."""
    B, T, C = dx.shape
    _conv_dx_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(C, BLOCK_C), B)](
        dpre, w, dx, dpre if positions is None else positions, T, C, dx.stride(0), dx.stride(1), KW=w.shape[-1],
        BT=BLOCK_T, BC=BLOCK_C, HAS_POS=positions is not None, num_warps=NUM_WARPS)


def _bwd_operands(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, norm_dim: int):
    """The backward launchers' operands: x and dy with unit channel stride, w contiguous, and an empty dx [B, T, C]
    in x's dtype; norm_dim checked against the channels (check_norm_dim)."""
    x, dy = _unit_channel_stride(x), _unit_channel_stride(dy)
    check_norm_dim(x.shape[-1], norm_dim)
    return x, w.contiguous(), dy, torch.empty(x.shape, device=x.device, dtype=x.dtype)


def conv_silu_window_bwd(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, positions: torch.Tensor | None = None,
                         norm_dim: int = 0, need_dw: bool = True, seg_len: int = WIN_BWD_SEG_LEN,
                         block_c: int = WIN_BWD_BLOCK_C, num_warps: int = WIN_BWD_NUM_WARPS,
                         num_stages: int = WIN_BWD_NUM_STAGES):
    """The backward by the sliding-window kernel (KW <= 4, one pass, no dpre buffer) with an explicit launch:
    programs of `seg_len` time steps x `block_c` channels (whole heads of norm_dim with a norm) on `num_warps` warps,
    the time loop pipelined `num_stages` deep. need_dw: (dx, dw) as conv_silu_bwd_launch returns them (dw summed
    from the programs' partial rows by one torch reduction), else dx alone."""
    x, w, dy, dx = _bwd_operands(x, w, dy, norm_dim)
    B, T, C = x.shape
    KW = w.shape[-1]
    if KW > 4:
        raise ValueError(f"the window kernels hold at most 4 taps, got KW={KW}")
    if not x.numel():
        return (dx, torch.zeros(w.shape, device=w.device, dtype=w.dtype)) if need_dw else dx
    nh, nd = _win_tile(block_c, norm_dim)
    seg_len = _win_seg_len(seg_len, KW)
    npt = triton.cdiv(T, seg_len)
    dw_part = torch.empty((B * npt, KW, C), device=x.device, dtype=torch.float32) if need_dw else None
    _conv_silu_bwd_window_kernel[(npt, triton.cdiv(C, nh * nd), B)](
        x, w, dy, dx, dx if dw_part is None else dw_part, x if positions is None else positions, T, C, x.stride(0),
        x.stride(1), dy.stride(0), dy.stride(1), dx.stride(0), dx.stride(1), L2_EPS, KW=KW, L=seg_len, NH=nh, ND=nd,
        HAS_POS=positions is not None, NEED_DW=need_dw, NORM=norm_dim > 0, NUM_STAGES=num_stages,
        num_warps=num_warps, num_stages=num_stages)
    if not need_dw:
        return dx
    return dx, dw_part.sum(0).t().reshape(C, 1, KW).to(w.dtype).contiguous()


def conv_silu_bwd_launch(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, positions: torch.Tensor | None = None,
                         block_t: int = BWD_BLOCK_T, block_c: int = BWD_BLOCK_C, num_warps: int = BWD_NUM_WARPS,
                         time_blocks: int = BWD_TIME_BLOCKS, dpre_dtype: torch.dtype | None = DPRE_DTYPE,
                         norm_dim: int = 0, impl: str = BWD_IMPL) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward (dx and dw) by `impl`: "two_pass" with an explicit launch (benchmarks/bench_short_conv.py sweeps
    it): the first pass's programs take `time_blocks` blocks of `block_t` steps x `block_c` channels (norm_dim's
    where it is > 0) on `num_warps` warps, and store dpre in `dpre_dtype` (None: x's dtype); or "window"
    (conv_silu_window_bwd at its WIN_BWD_* launch; the launch arguments here and dpre_dtype do not apply; KW > 4
    takes "two_pass"). norm_dim: as in the forward."""
    if impl not in ("two_pass", "window"):
        raise ValueError(f"impl must be 'two_pass' or 'window', got {impl!r}.")
    if impl == "window" and w.shape[-1] <= 4:
        return conv_silu_window_bwd(x, w, dy, positions, norm_dim)
    x, w, dy, dx = _bwd_operands(x, w, dy, norm_dim)
    B, T, C = x.shape
    KW = w.shape[-1]
    if not x.numel():
        return dx, torch.zeros(w.shape, device=w.device, dtype=w.dtype)
    dpre, dw_part = _dpre_pass(x, w, dy, positions, dpre_dtype, block_t, block_c, num_warps, time_blocks, True,
                               norm_dim)
    _dx_pass(dpre, w, dx, positions)
    # contiguous, as the op's fake output says (a transposed view would disagree with it under compile)
    dw = dw_part.sum(0).t().reshape(C, 1, KW).to(w.dtype).contiguous()
    return dx, dw


def conv_silu_dx_launch(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, positions: torch.Tensor | None = None,
                        impl: str = DX_ONLY_IMPL, block_t: int | None = None, block_c: int | None = None,
                        num_warps: int | None = None, dpre_dtype: torch.dtype | None = DPRE_DTYPE,
                        norm_dim: int = 0) -> torch.Tensor:
    """dx alone (the weight needs no gradient), by `impl`: "fused" (one pass; KW > 4 or a norm take "two_pass"),
    "two_pass" (dpre in `dpre_dtype` without the weight-gradient partials, then the transposed conv) or "window"
    (conv_silu_window_bwd without the weight gradient at its WIN_BWD_* launch; KW > 4 takes "two_pass"). block_t /
    block_c / num_warps: the fused kernel's launch, or the two-pass form's first pass; None takes the constants
    beside the kernels (FUSED_DX_* for "fused", the forward's BLOCK_T / BLOCK_C / NUM_WARPS for "two_pass"); for
    "window" block_t / block_c / num_warps are its seg_len / block_c / num_warps (None: WIN_BWD_*).
    norm_dim: as in the forward."""
    if impl not in ("fused", "two_pass", "window"):
        raise ValueError(f"impl must be 'fused', 'two_pass' or 'window', got {impl!r}.")
    if impl == "window" and w.shape[-1] <= 4:
        return conv_silu_window_bwd(x, w, dy, positions, norm_dim, False, block_t or WIN_BWD_SEG_LEN,
                                    block_c or WIN_BWD_BLOCK_C, num_warps or WIN_BWD_NUM_WARPS)
    x, w, dy, dx = _bwd_operands(x, w, dy, norm_dim)
    B, T, C = x.shape
    KW = w.shape[-1]
    if not x.numel():
        return dx
    if impl == "fused" and KW <= 4 and not norm_dim:
        bt, bc = block_t or FUSED_DX_BLOCK_T, block_c or FUSED_DX_BLOCK_C
        _conv_silu_dx_fused_kernel[(triton.cdiv(T, bt), triton.cdiv(C, bc), B)](
            x, w, dy, dx, x if positions is None else positions, T, C, x.stride(0), x.stride(1), dy.stride(0),
            dy.stride(1), dx.stride(0), dx.stride(1), KW=KW, BT=bt, BC=bc, HAS_POS=positions is not None,
            num_warps=num_warps or FUSED_DX_NUM_WARPS)
        return dx
    dpre, _ = _dpre_pass(x, w, dy, positions, dpre_dtype, block_t or BLOCK_T, block_c or BLOCK_C,
                         num_warps or NUM_WARPS, 1, False, norm_dim)
    _dx_pass(dpre, w, dx, positions)
    return dx


def _conv_silu_bwd_impl(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, positions: torch.Tensor | None = None,
                        norm_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [B, T, C] in x's dtype, dw [C, 1, KW] in w's dtype) of conv_silu_fwd for the output gradient dy."""
    return conv_silu_bwd_launch(x, w, dy, positions, norm_dim=norm_dim)


conv_silu_bwd = torch.library.custom_op("moeadapt::causal_conv_silu_bwd", mutates_args=())(_conv_silu_bwd_impl)
conv_silu_bwd_fast = impl_or_op(conv_silu_bwd, _conv_silu_bwd_impl)  # the implementation itself in eager


@conv_silu_bwd.register_fake
def _(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, positions: torch.Tensor | None = None,
      norm_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape, device=x.device, dtype=x.dtype), torch.empty(w.shape, device=w.device, dtype=w.dtype)


def _conv_silu_bwd_dx_impl(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, positions: torch.Tensor | None = None,
                           norm_dim: int = 0) -> torch.Tensor:
    """dx [B, T, C] in x's dtype of conv_silu_fwd for the output gradient dy, the weight taken as a constant (the
    backward where w needs no gradient): no weight-gradient work (DX_ONLY_IMPL's form)."""
    return conv_silu_dx_launch(x, w, dy, positions, norm_dim=norm_dim)


# A separate op rather than a need_dw flag on causal_conv_silu_bwd: each op's outputs then have fixed shapes (no
# empty stand-in for a gradient that was not computed), and a trace or profile names the cheaper backward.
conv_silu_bwd_dx = torch.library.custom_op("moeadapt::causal_conv_silu_bwd_dx",
                                           mutates_args=())(_conv_silu_bwd_dx_impl)
conv_silu_bwd_dx_fast = impl_or_op(conv_silu_bwd_dx, _conv_silu_bwd_dx_impl)


@conv_silu_bwd_dx.register_fake
def _(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, positions: torch.Tensor | None = None,
      norm_dim: int = 0) -> torch.Tensor:
    return torch.empty(x.shape, device=x.device, dtype=x.dtype)


def _setup_context(ctx, inputs, output) -> None:
    x, w, positions, norm_dim = inputs
    ctx.save_for_backward(x, w, positions)
    ctx.norm_dim = norm_dim


def _backward(ctx, dy: torch.Tensor):
    """dx and dw where w needs a gradient (full fine-tuning); else dx alone by the cheaper op (a frozen conv
    weight, as in LoRA fine-tuning)."""
    x, w, positions = ctx.saved_tensors
    need_dx, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not need_dw:
        return conv_silu_bwd_dx_fast(x, w, dy, positions, ctx.norm_dim), None, None, None
    dx, dw = conv_silu_bwd_fast(x, w, dy, positions, ctx.norm_dim)
    return (dx if need_dx else None), dw, None, None


conv_silu_fwd.register_autograd(_backward, setup_context=_setup_context)
# what causal_conv_silu calls (all four arguments): the op where traced, in eager an autograd.Function of the same
# functions (ops/custom.py)
conv_silu_fwd_fast = eager_or_op(conv_silu_fwd, _conv_silu_fwd_impl, _setup_context, _backward)
