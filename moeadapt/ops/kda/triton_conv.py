"""The KDA layer's short causal depthwise convolution + SiLU in Triton, on [B, T, C] directly: one pass forward,
two backward (one where the weight is frozen).

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
# the forward's tile, BLOCK_T x BLOCK_C on NUM_WARPS, then _conv_dx_kernel) or "fused"
# (_conv_silu_dx_fused_kernel: one pass from x, w and dy, no dpre buffer; KW <= 4, wider kernels take "two_pass").
# Same H100 run: two_pass 71.9 us with a bf16 dpre (96.1 with fp32), fused 99.8 us (its best launch) against the
# full backward's 157.9; fused keeps dx within 7e-6 of the fp32 path.
DX_ONLY_IMPL = "two_pass"
# The fused kernel's launch: 32 time steps x 64 channels a program on 4 warps (168 registers on sm_90, no spills):
# 99.8 us; 16 x 128 on 4 warps 100.1, 32 x 128 on 8 warps 135.1 (the H100 run above).
FUSED_DX_BLOCK_T = 32
FUSED_DX_BLOCK_C = 64
FUSED_DX_NUM_WARPS = 4


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


def _conv_silu_fwd_impl(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor | None = None,
                        norm_dim: int = 0) -> torch.Tensor:
    """y [B, T, C] = silu(causal depthwise conv of x [B, T, C] with w [C, 1, KW]), in x's dtype; positions:
    int32 [B, T] contiguous (packed documents) or None; norm_dim > 0: y L2-normalised over each group of norm_dim
    channels (check_norm_dim)."""
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


def conv_silu_bwd_launch(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, positions: torch.Tensor | None = None,
                         block_t: int = BWD_BLOCK_T, block_c: int = BWD_BLOCK_C, num_warps: int = BWD_NUM_WARPS,
                         time_blocks: int = BWD_TIME_BLOCKS, dpre_dtype: torch.dtype | None = DPRE_DTYPE,
                         norm_dim: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward (dx and dw) with an explicit launch (benchmarks/bench_short_conv.py sweeps it): the first pass's
    programs take `time_blocks` blocks of `block_t` steps x `block_c` channels (norm_dim's where it is > 0) on
    `num_warps` warps, and store dpre in `dpre_dtype` (None: x's dtype). norm_dim: as in the forward."""
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
    """dx alone (the weight needs no gradient), by `impl`: "fused" (one pass; KW > 4 or a norm take "two_pass") or
    "two_pass" (dpre in `dpre_dtype` without the weight-gradient partials, then the transposed conv). block_t /
    block_c / num_warps: the fused kernel's launch, or the two-pass form's first pass; None takes the constants
    beside the kernels (FUSED_DX_* for "fused", the forward's BLOCK_T / BLOCK_C / NUM_WARPS for "two_pass").
    norm_dim: as in the forward."""
    if impl not in ("fused", "two_pass"):
        raise ValueError(f"impl must be 'fused' or 'two_pass', got {impl!r}.")
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
