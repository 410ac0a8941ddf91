"""The KDA layer's short causal depthwise convolution + SiLU in Triton, on [B, T, C] directly: one pass forward,
two backward.

Owns the kernels behind `causal_conv_silu(..., backend="triton")` and their registration as the torch.library
custom ops `moeadapt::causal_conv_silu_fwd` / `_bwd` (so torch.compile and selective activation checkpointing
see one op, not a Triton launch they cannot trace; `conv_silu_fwd_fast` skips the op's dispatch in plain eager
mode, ops/custom.py). Reads the projection output in its own [B, T, C] layout (unit channel stride): no
transposes, no padded copy, no separate SiLU pass. Forward saves only x. Backward pass 1 recomputes the
pre-activation from x (KW shifted reads, served by L1/L2), stores dpre = dy * silu'(pre) in fp32 and the weight
gradient's partial sums (KW rows per program, which walks several time blocks; summed by one torch reduction);
pass 2 computes dx as the transposed conv of dpre (KW shifted reads). A single backward pass that recomputed dpre
at each of the KW shifts read x KW * KW + KW times per tile and was 1.55x slower (benchmarks/RESULTS.md).
Math in fp32, storage in x's dtype.
Packed documents: an optional int32 `positions` [B, T] (contiguous) masks tap j of output t unless
j <= positions[b, t] (HAS_POS: without it the kernels are the plain conv).

Shape suffixes: B batch, T time, C channels (heads x head dim), KW kernel width.
No `from __future__ import annotations` here: torch.library infers the op schemas from real annotations.
"""

import torch
import triton
import triton.language as tl

from ..custom import eager_or_op, impl_or_op

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
def _conv_silu_fwd_kernel(x_ptr, w_ptr, y_ptr, p_ptr, T, C, s_xb, s_xt, s_yb, s_yt,
                          KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, HAS_POS: tl.constexpr):
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2).to(tl.int64)
    cm = c < C
    pos = _positions(p_ptr, b, t, T, HAS_POS)
    acc = _pre_tile(x_ptr + b * s_xb, w_ptr, t, c, cm, T, s_xt, pos, KW, BT, BC, HAS_POS)
    y = acc * tl.sigmoid(acc)
    om = (t < T)[:, None] & cm[None, :]
    tl.store(y_ptr + b * s_yb + t.to(tl.int64)[:, None] * s_yt + c[None, :], y.to(y_ptr.dtype.element_ty), mask=om)


@triton.jit
def _conv_silu_dpre_kernel(x_ptr, w_ptr, dy_ptr, dpre_ptr, dwp_ptr, p_ptr, T, C, s_xb, s_xt, s_dyb, s_dyt,
                           KW: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, NTB: tl.constexpr,
                           HAS_POS: tl.constexpr):
    """Backward, first pass, over NTB consecutive time blocks of BT steps: dpre = dy * silu'(pre) (pre recomputed
    from x) stored in fp32 [B, T, C], and the program's partial weight gradient dw[KW-1-j] = sum_t dpre[t] x[t-j].
    With KW <= 4 the products accumulate in [BT, BC] tiles and are reduced over time once per program; a wider
    kernel reduces per block (the launcher passes NTB = 1 then)."""
    pid_t = tl.program_id(0)
    c = tl.program_id(1) * BC + tl.arange(0, BC)
    b = tl.program_id(2).to(tl.int64)
    cm = c < C
    xb = x_ptr + b * s_xb
    dwp = dwp_ptr + (b * tl.num_programs(0) + pid_t) * KW * C  # this program's KW partial rows
    TILE_ACC: tl.constexpr = KW <= 4
    a0 = tl.zeros([BT, BC], dtype=tl.float32)
    a1 = tl.zeros([BT, BC], dtype=tl.float32)
    a2 = tl.zeros([BT, BC], dtype=tl.float32)
    a3 = tl.zeros([BT, BC], dtype=tl.float32)
    for it in range(NTB):
        t = (pid_t * NTB + it) * BT + tl.arange(0, BT)
        pos = _positions(p_ptr, b, t, T, HAS_POS)
        pre = _pre_tile(xb, w_ptr, t, c, cm, T, s_xt, pos, KW, BT, BC, HAS_POS)
        om = (t < T)[:, None] & cm[None, :]
        dyv = tl.load(dy_ptr + b * s_dyb + t.to(tl.int64)[:, None] * s_dyt + c[None, :], mask=om, other=0.0)
        sig = tl.sigmoid(pre)
        dpre = dyv.to(tl.float32) * sig * (1.0 + pre * (1.0 - sig))  # silu'(pre); 0 past T (dy masked to 0)
        tl.store(dpre_ptr + (b * T + t.to(tl.int64))[:, None] * C + c[None, :], dpre, mask=om)
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
                     other=0.0)
        ws = tl.load(w_ptr + c * KW + (KW - 1 - s), mask=cm, other=0.0).to(tl.float32)
        dx += dv * ws[None, :]
    om = (t < T)[:, None] & cm[None, :]
    tl.store(dx_ptr + b * s_dxb + t.to(tl.int64)[:, None] * s_dxt + c[None, :], dx.to(dx_ptr.dtype.element_ty),
             mask=om)


def _unit_channel_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(2) == 1 else x.contiguous()


def _conv_silu_fwd_impl(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """y [B, T, C] = silu(causal depthwise conv of x [B, T, C] with w [C, 1, KW]), in x's dtype; positions:
    int32 [B, T] contiguous (packed documents) or None."""
    x = _unit_channel_stride(x)
    B, T, C = x.shape
    y = torch.empty((B, T, C), device=x.device, dtype=x.dtype)
    if x.numel():
        grid = (triton.cdiv(T, BLOCK_T), triton.cdiv(C, BLOCK_C), B)
        _conv_silu_fwd_kernel[grid](x, w.contiguous(), y, x if positions is None else positions, T, C, x.stride(0),
                                    x.stride(1), y.stride(0), y.stride(1), KW=w.shape[-1], BT=BLOCK_T, BC=BLOCK_C,
                                    HAS_POS=positions is not None, num_warps=NUM_WARPS)
    return y


conv_silu_fwd = torch.library.custom_op("moeadapt::causal_conv_silu_fwd", mutates_args=())(_conv_silu_fwd_impl)


@conv_silu_fwd.register_fake
def _(x: torch.Tensor, w: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    return torch.empty(x.shape, device=x.device, dtype=x.dtype)


def conv_silu_bwd_launch(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor, positions: torch.Tensor | None = None,
                         block_t: int = BWD_BLOCK_T, block_c: int = BWD_BLOCK_C, num_warps: int = BWD_NUM_WARPS,
                         time_blocks: int = BWD_TIME_BLOCKS) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward with an explicit launch (benchmarks/bench_short_conv.py sweeps it): the first pass's programs
    take `time_blocks` blocks of `block_t` steps x `block_c` channels on `num_warps` warps."""
    x, dy = _unit_channel_stride(x), _unit_channel_stride(dy)
    B, T, C = x.shape
    KW = w.shape[-1]
    ntb = time_blocks if KW <= 4 else 1  # tile accumulators for the weight gradient exist up to KW = 4
    npt = triton.cdiv(T, block_t * ntb)
    dx = torch.empty((B, T, C), device=x.device, dtype=x.dtype)
    dw_part = torch.empty((B * npt, KW, C), device=x.device, dtype=torch.float32)
    if x.numel():
        dpre = torch.empty((B, T, C), device=x.device, dtype=torch.float32)
        pos = x if positions is None else positions
        w = w.contiguous()
        _conv_silu_dpre_kernel[(npt, triton.cdiv(C, block_c), B)](
            x, w, dy, dpre, dw_part, pos, T, C, x.stride(0), x.stride(1), dy.stride(0), dy.stride(1), KW=KW,
            BT=block_t, BC=block_c, NTB=ntb, HAS_POS=positions is not None, num_warps=num_warps)
        _conv_dx_kernel[(triton.cdiv(T, BLOCK_T), triton.cdiv(C, BLOCK_C), B)](
            dpre, w, dx, pos, T, C, dx.stride(0), dx.stride(1), KW=KW, BT=BLOCK_T, BC=BLOCK_C,
            HAS_POS=positions is not None, num_warps=NUM_WARPS)
    dw = dw_part.sum(0).t().reshape(C, 1, KW).to(w.dtype)
    return dx, dw


def _conv_silu_bwd_impl(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
                        positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [B, T, C] in x's dtype, dw [C, 1, KW] in w's dtype) of conv_silu_fwd for the output gradient dy."""
    return conv_silu_bwd_launch(x, w, dy, positions)


conv_silu_bwd = torch.library.custom_op("moeadapt::causal_conv_silu_bwd", mutates_args=())(_conv_silu_bwd_impl)
conv_silu_bwd_fast = impl_or_op(conv_silu_bwd, _conv_silu_bwd_impl)  # the implementation itself in eager


@conv_silu_bwd.register_fake
def _(x: torch.Tensor, w: torch.Tensor, dy: torch.Tensor,
      positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty(x.shape, device=x.device, dtype=x.dtype), torch.empty(w.shape, device=w.device, dtype=w.dtype)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy: torch.Tensor):
    x, w, positions = ctx.saved_tensors
    dx, dw = conv_silu_bwd_fast(x, w, dy, positions)
    return (dx if ctx.needs_input_grad[0] else None), (dw if ctx.needs_input_grad[1] else None), None


conv_silu_fwd.register_autograd(_backward, setup_context=_setup_context)
# what causal_conv_silu calls (all three arguments): the op where traced, in eager an autograd.Function of the same
# functions (ops/custom.py)
conv_silu_fwd_fast = eager_or_op(conv_silu_fwd, _conv_silu_fwd_impl, _setup_context, _backward)
