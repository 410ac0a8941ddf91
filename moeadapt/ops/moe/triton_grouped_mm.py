"""Triton grouped GEMM over all local experts in one launch, and grouped LoRA fused into it.

Owns the kernels behind `grouped_mm(..., backend="triton")` and `grouped_lora(..., backend="triton")`.

Forward / dx (`_grouped_mm_kernel`): rows are expert-major; the row tiles of every expert are
listed in a tile map (built on the device from offsets, no host sync). A program owns one
(row tile, column tile), looks up its expert, and computes
    y[rows] = alpha · x[rows] @ w[e]  (+ beta · x2[rows] @ w2[e]   when HAS_LORA)
The second product is the LoRA up-projection (x2 = h = x·A, w2 = B, rank ≤ 64), added in registers,
so base + LoRA write y once. Column tiles of one row tile run next to each other (program_id 0), so
a row tile is read from HBM about once and an expert's weights stay in L2 across its row tiles.
w may be any strided view (the model stores [E, out, in] and passes a transposed view).

Weight gradient (`_grouped_wgrad_kernel`): dW[e] = alpha · x_eᵀ @ dy_e, one program per
(I tile, O tile, expert), looping over that expert's rows. Never launched for a frozen weight.

Grouped LoRA backward (frozen base): dh = s·dy·Bᵀ; dx = dy·Wᵀ + dh·Aᵀ (one fused launch);
dA = xᵀ·dh; dB = s·hᵀ·dy. ΔW = A·B is never formed.

Both products are the torch.library custom ops `moeadapt::grouped_mm_fwd` / `_bwd` and
`moeadapt::grouped_lora_fwd` (returning y and h = x·A) / `_bwd`, so selective activation checkpointing keeps
their outputs and torch.compile traces them; in plain eager mode `grouped_mm_fast` / `grouped_lora_fast` run
the same functions without the ops' dispatch (ops/custom.py).

Shape suffixes: N routed rows, I / O input / output width, E experts, R LoRA rank.
"""

import os

import torch
import triton
import triton.language as tl
from torch import Tensor

from ..custom import eager_or_op, impl_or_op


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _tile_rows(tile, e, tile_row_ptr, offsets_ptr, BM: tl.constexpr):
    """(rows, rows < the expert's end) of one tile of the tile map, whose expert e >= 0 the caller
    has loaded (tile_expert[tile]) and checked."""
    rows = tl.load(tile_row_ptr + tile) + tl.arange(0, BM)
    return rows, rows < tl.load(offsets_ptr + e)


@triton.jit
def _grouped_mm_kernel(
    x_ptr, w_ptr, y_ptr, x2_ptr, w2_ptr, tile_expert_ptr, tile_row_ptr, offsets_ptr,
    I, O, R, alpha, beta,
    s_xn, s_xi, s_we, s_wi, s_wo, s_x2n, s_x2r, s_w2e, s_w2r, s_w2o,
    HAS_LORA: tl.constexpr, IEEE: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, BR: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    e = tl.load(tile_expert_ptr + pid_m)
    if e < 0:
        return
    rows, row_ok = _tile_rows(pid_m, e, tile_row_ptr, offsets_ptr, BM)
    rows64 = rows.to(tl.int64)
    cols = pid_n * BN + tl.arange(0, BN)
    col_ok = cols < O
    ks = tl.arange(0, BK)
    e64 = e.to(tl.int64)
    x_ptrs = x_ptr + rows64[:, None] * s_xn + ks[None, :] * s_xi
    w_ptrs = w_ptr + e64 * s_we + ks[:, None] * s_wi + cols[None, :] * s_wo
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k0 in range(0, I, BK):
        k_ok = (k0 + ks) < I
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptrs, mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(a, b.to(a.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, b.to(a.dtype), acc)
        x_ptrs += BK * s_xi
        w_ptrs += BK * s_wi
    acc = acc * alpha
    if HAS_LORA:
        rs = tl.arange(0, BR)
        r_ok = rs < R
        h = tl.load(x2_ptr + rows64[:, None] * s_x2n + rs[None, :] * s_x2r,
                    mask=row_ok[:, None] & r_ok[None, :], other=0.0)
        b2 = tl.load(w2_ptr + e64 * s_w2e + rs[:, None] * s_w2r + cols[None, :] * s_w2o,
                     mask=r_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            lora = tl.dot(h, b2.to(h.dtype), input_precision="ieee")
        else:
            lora = tl.dot(h, b2.to(h.dtype))
        acc += beta * lora
    y_ptrs = y_ptr + rows64[:, None] * O + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _grouped_wgrad_kernel(
    x_ptr, dy_ptr, dw_ptr, offsets_ptr, I, O, alpha,
    s_xn, s_xi, s_dyn, s_dyo, s_we, s_wi, s_wo,
    IEEE: tl.constexpr, BI: tl.constexpr, BO: tl.constexpr, BK: tl.constexpr,
):
    pid = tl.program_id(0)
    e = tl.program_id(1)
    n_o = tl.cdiv(O, BO)
    pid_i = pid // n_o
    pid_o = pid % n_o
    start = tl.load(offsets_ptr + e - 1, mask=e > 0, other=0)
    end = tl.load(offsets_ptr + e)
    icols = pid_i * BI + tl.arange(0, BI)
    ocols = pid_o * BO + tl.arange(0, BO)
    i_ok = icols < I
    o_ok = ocols < O
    ks = tl.arange(0, BK)
    acc = tl.zeros([BI, BO], dtype=tl.float32)
    for r0 in range(start, end, BK):
        rows = (r0 + ks).to(tl.int64)
        r_ok = (r0 + ks) < end
        a = tl.load(x_ptr + rows[:, None] * s_xn + icols[None, :] * s_xi,
                    mask=r_ok[:, None] & i_ok[None, :], other=0.0)
        b = tl.load(dy_ptr + rows[:, None] * s_dyn + ocols[None, :] * s_dyo,
                    mask=r_ok[:, None] & o_ok[None, :], other=0.0)
        if IEEE:
            acc = tl.dot(tl.trans(a), b.to(a.dtype), acc, input_precision="ieee")
        else:
            acc = tl.dot(tl.trans(a), b.to(a.dtype), acc)
    acc = acc * alpha
    dw_ptrs = dw_ptr + e.to(tl.int64) * s_we + icols[:, None] * s_wi + ocols[None, :] * s_wo
    tl.store(dw_ptrs, acc.to(dw_ptr.dtype.element_ty), mask=i_ok[:, None] & o_ok[None, :])


# ---------------------------------------------------------------- launch configuration
# Fixed heuristics, not autotuning: every autotune key (I, O, LoRA, BM) would cost compile time
# in each training process. Narrow outputs (the LoRA rank) get narrow tiles.
# Tiles for wide outputs (the expert GEMMs), from a sweep on the H200 (E = 64, 2048 rows per expert).
FWD_WIDE = dict(BN=128, BK=64, num_warps=8, num_stages=3)  # with the LoRA epilogue, or fp32
# plain 16-bit GEMM (H200 sweep, E=64, 2048 rows/expert): fwd 525 vs 483 TFLOP/s, dx 603 vs 538
FWD_WIDE_16BIT = dict(BN=256, BK=64, num_warps=8, num_stages=3)
WGRAD_WIDE = dict(BI=128, BO=128, BK=64, num_warps=8, num_stages=3)


def _cols_block(width: int, cap: int = 128) -> int:
    return max(16, min(cap, triton.next_power_of_2(width)))


def _row_block(num_rows: int, num_experts: int) -> int:
    if _interpreting():
        return 16
    return 64 if num_rows < 384 * max(num_experts, 1) else 128


@triton.jit
def _tile_map_kernel(offsets_ptr, expert_ptr, row_ptr, E, num_tiles,
                     BM: tl.constexpr, BE: tl.constexpr, BT: tl.constexpr):
    """tile_map in one launch: every program recomputes the experts' tile counts and their running sum
    (E <= BE) and places its BT tiles by comparing against it."""
    es = tl.arange(0, BE)
    e_ok = es < E
    ends = tl.load(offsets_ptr + es, mask=e_ok, other=0)
    starts = tl.load(offsets_ptr + es - 1, mask=e_ok & (es > 0), other=0)
    tiles = tl.where(e_ok, (ends - starts + BM - 1) // BM, 0)
    cum = tl.cumsum(tiles, 0)  # tiles of experts 0..e
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    done = cum[None, :] <= t[:, None]  # [BT, BE]: expert e's tiles all come before tile t
    e_t = tl.sum(done.to(tl.int32), 1)
    before = tl.max(tl.where(done, cum[None, :], 0), 1)
    start = tl.sum(tl.where(es[None, :] == e_t[:, None], starts[None, :], 0), 1)
    valid = e_t < E
    t_ok = t < num_tiles
    tl.store(expert_ptr + t, tl.where(valid, e_t, -1), mask=t_ok)
    tl.store(row_ptr + t, tl.where(valid, start + (t - before) * BM, 0), mask=t_ok)


def tile_map(offsets_E: torch.Tensor, num_rows: int, BM: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert and first row of every BM-row tile (expert -1 for the unused tail of the upper bound).

    On the GPU (and under the interpreter) one launch of `_tile_map_kernel`; elsewhere the torch form below."""
    E = len(offsets_E)
    num_tiles = triton.cdiv(num_rows, BM) + E  # upper bound known on the host: no sync
    if offsets_E.is_cuda or _interpreting():
        expert_T = torch.empty(num_tiles, dtype=torch.int32, device=offsets_E.device)
        row_T = torch.empty_like(expert_T)
        BE = triton.next_power_of_2(max(E, 1))
        # small [BT, BE] compare tiles, one warp where they hold <= 4096 entries: at E = 64, 65536 rows (H200,
        # one run) 6.0-6.5 us a map vs 72-74 with 256-tile programs of 4 warps
        BT = max(16, min(64, 4096 // BE))
        _tile_map_kernel[(triton.cdiv(num_tiles, BT),)](offsets_E, expert_T, row_T, E, num_tiles, BM=BM, BE=BE, BT=BT,
                                                        num_warps=1 if BT * BE <= 4096 else 4)
        return expert_T, row_T
    return _tile_map_torch(offsets_E, num_tiles, BM)


def _tile_map_torch(offsets_E: torch.Tensor, num_tiles: int, BM: int) -> tuple[torch.Tensor, torch.Tensor]:
    E = len(offsets_E)
    ends_E = offsets_E.long()
    starts_E = torch.cat([ends_E.new_zeros(1), ends_E[:-1]])
    tiles_E = (ends_E - starts_E + BM - 1) // BM
    cum_E = torch.cumsum(tiles_E, 0)
    tile_ids = torch.arange(num_tiles, device=offsets_E.device)
    e_T = torch.searchsorted(cum_E, tile_ids, right=True)
    e_c = e_T.clamp(max=E - 1)
    row_T = starts_E[e_c] + (tile_ids - (cum_E[e_c] - tiles_E[e_c])) * BM
    expert_T = torch.where(e_T < E, e_T, torch.full_like(e_T, -1))
    return expert_T.to(torch.int32), row_T.to(torch.int32)


def _cached_tile_map(offsets_E: torch.Tensor, num_rows: int, BM: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tile_map, kept on the offsets tensor: one MoE layer calls the GEMM 4-8 times with the same
    offsets, and each map costs ~8 small launches. Keyed on the tensor's version, so an in-place
    change of the offsets rebuilds it."""
    cache = getattr(offsets_E, "_moe_tile_maps", None)
    if cache is None or cache[0] != offsets_E._version:
        cache = (offsets_E._version, {})
        offsets_E._moe_tile_maps = cache
    maps = cache[1]
    if (num_rows, BM) not in maps:
        maps[(num_rows, BM)] = tile_map(offsets_E, num_rows, BM)
    return maps[(num_rows, BM)]


def grouped_mm_fwd(x_NI, w_EIO, offsets_E, x2_NR=None, w2_ERO=None, alpha=1.0, beta=1.0, out_dtype=None):
    """y = alpha·x@w[e] (+ beta·x2@w2[e]) per expert group; rows past offsets[-1] are left unwritten."""
    N, I = x_NI.shape
    E, _, O = w_EIO.shape
    y_NO = torch.empty(N, O, dtype=out_dtype or x_NI.dtype, device=x_NI.device)
    if N == 0 or O == 0:
        return y_NO
    BM = _row_block(N, E)
    expert_T, row_T = _cached_tile_map(offsets_E, N, BM)
    has_lora = x2_NR is not None
    R = x2_NR.shape[1] if has_lora else 16
    x2 = x2_NR if has_lora else x_NI
    w2 = w2_ERO if has_lora else w_EIO
    args = (
        x_NI, w_EIO, y_NO, x2, w2, expert_T, row_T, offsets_E, I, O, R, float(alpha), float(beta),
        x_NI.stride(0), x_NI.stride(1), *w_EIO.stride(),
        x2.stride(0), x2.stride(1), *(w2.stride() if has_lora else (0, 0, 0)),
    )
    meta = dict(HAS_LORA=has_lora, IEEE=x_NI.dtype == torch.float32, BM=BM,
                BR=max(16, triton.next_power_of_2(R)))
    if _interpreting():
        BN, BK, launch = 32, 32, {}
    else:
        BN, BK = _cols_block(O), 64
        launch = dict(num_warps=8 if BM == 128 and BN == 128 else 4, num_stages=3)
        if BM == 128 and O >= 128:
            plain16 = not has_lora and x_NI.element_size() == 2 and w_EIO.element_size() == 2 and O >= 256
            cfg = dict(FWD_WIDE_16BIT if plain16 else FWD_WIDE)
            BN, BK = cfg.pop("BN"), cfg.pop("BK")
            launch = cfg
    grid = (triton.cdiv(O, BN), len(expert_T))
    _grouped_mm_kernel[grid](*args, **meta, BN=BN, BK=BK, **launch)
    return y_NO


def wgrad_launch(I: int, O: int) -> dict:
    """grouped_wgrad's GPU launch for an [I, O] gradient, dict(BI, BO, BK, num_warps, num_stages): WGRAD_WIDE
    where both sides are >= 128 wide, else blocks as wide as the sides (16..128) with BK = 64."""
    if I >= 128 and O >= 128:
        return dict(WGRAD_WIDE)
    BI, BO = _cols_block(I), _cols_block(O)
    return dict(BI=BI, BO=BO, BK=64, num_warps=8 if BI * BO >= 128 * 128 else 4, num_stages=3)


def grouped_wgrad(x_NI, dy_NO, offsets_E, like_w_EIO, alpha=1.0, out_EIO=None, launch=None):
    """dW[e] = alpha·x_eᵀ@dy_e in the layout (strides) and dtype of like_w (written into out_EIO when given:
    like_w is then ignored). Accumulates in fp32 and rounds once to the output's dtype.
    launch: an explicit launch dict(BI, BO, BK, num_warps, num_stages), taken as given on any device; None:
    wgrad_launch(I, O) on the GPU, 32 x 32 x 16 tiles in the interpreter."""
    dw_EIO = torch.empty_like(like_w_EIO) if out_EIO is None else out_EIO
    E, I, O = dw_EIO.shape
    if E == 0 or I == 0 or O == 0:
        return dw_EIO
    args = (x_NI, dy_NO, dw_EIO, offsets_E, I, O, float(alpha),
            x_NI.stride(0), x_NI.stride(1), dy_NO.stride(0), dy_NO.stride(1), *dw_EIO.stride())
    ieee = x_NI.dtype == torch.float32
    if launch is None and _interpreting():
        BI, BO, BK, launch = 32, 32, 16, {}
    else:
        launch = dict(wgrad_launch(I, O) if launch is None else launch)
        BI, BO, BK = launch.pop("BI"), launch.pop("BO"), launch.pop("BK")
    grid = (triton.cdiv(I, BI) * triton.cdiv(O, BO), E)
    _grouped_wgrad_kernel[grid](*args, IEEE=ieee, BI=BI, BO=BO, BK=BK, **launch)
    return dw_EIO


def _t(w_EIO: torch.Tensor) -> torch.Tensor:
    return w_EIO.transpose(1, 2)


def _none(like: torch.Tensor) -> torch.Tensor:
    """The shape-[0] stand-in for a gradient not asked for (a custom op returns tensors)."""
    return torch.empty(0, device=like.device, dtype=like.dtype)


def _grouped_mm_op_impl(x_NI: Tensor, w_EIO: Tensor, offsets_E: Tensor) -> Tensor:
    """y [N, O] = x @ w[e] per expert group (grouped_mm_fwd); rows past offsets[-1] are left unwritten."""
    return grouped_mm_fwd(x_NI, w_EIO, offsets_E)


grouped_mm_op = torch.library.custom_op("moeadapt::grouped_mm_fwd", mutates_args=())(_grouped_mm_op_impl)


@grouped_mm_op.register_fake
def _(x_NI, w_EIO, offsets_E):
    return x_NI.new_empty(x_NI.shape[0], w_EIO.shape[2])


def _grouped_mm_bwd_impl(dy_NO: Tensor, x_NI: Tensor, w_EIO: Tensor, offsets_E: Tensor, need_x: bool,
                         need_w: bool) -> tuple[Tensor, Tensor]:
    """(dx [N, I] in x's dtype, dw in w's layout and dtype) of grouped_mm_op; shape [0] where not needed."""
    dy_NO = dy_NO.contiguous()
    dx = grouped_mm_fwd(dy_NO, _t(w_EIO), offsets_E, out_dtype=x_NI.dtype) if need_x else _none(x_NI)
    dw = grouped_wgrad(x_NI, dy_NO, offsets_E, w_EIO) if need_w else _none(w_EIO)
    return dx, dw


grouped_mm_bwd = torch.library.custom_op("moeadapt::grouped_mm_bwd", mutates_args=())(_grouped_mm_bwd_impl)
grouped_mm_bwd_fast = impl_or_op(grouped_mm_bwd, _grouped_mm_bwd_impl)  # the implementation itself in eager


@grouped_mm_bwd.register_fake
def _(dy_NO, x_NI, w_EIO, offsets_E, need_x, need_w):
    return (torch.empty_like(x_NI, memory_format=torch.contiguous_format) if need_x else _none(x_NI),
            torch.empty_like(w_EIO) if need_w else _none(w_EIO))


def _mm_setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs)


def _mm_backward(ctx, dy_NO):
    x_NI, w_EIO, offsets_E = ctx.saved_tensors
    need_x, need_w = ctx.needs_input_grad[:2]
    dx, dw = grouped_mm_bwd_fast(dy_NO, x_NI, w_EIO, offsets_E, need_x, need_w)
    return (dx if need_x else None), (dw if need_w else None), None


grouped_mm_op.register_autograd(_mm_backward, setup_context=_mm_setup_context)
# what grouped_mm_triton calls: the op where traced, in eager an autograd.Function of the same functions
# (ops/custom.py)
grouped_mm_fast = eager_or_op(grouped_mm_op, _grouped_mm_op_impl, _mm_setup_context, _mm_backward)


def _grouped_lora_op_impl(x_NI: Tensor, A_EIR: Tensor, B_ERO: Tensor, offsets_E: Tensor, scaling: float,
                          w_EIO: Tensor | None) -> tuple[Tensor, Tensor]:
    """(y [N, O] = scaling·(x·A_e)·B_e (+ x·W_e with w_EIO), h = x·A_e [N, R], which the backward reads)."""
    h_NR = grouped_mm_fwd(x_NI, A_EIR, offsets_E)
    if w_EIO is None:
        y_NO = grouped_mm_fwd(h_NR, B_ERO, offsets_E, alpha=scaling)
    else:
        y_NO = grouped_mm_fwd(x_NI, w_EIO, offsets_E, x2_NR=h_NR, w2_ERO=B_ERO, beta=scaling)
    return y_NO, h_NR


grouped_lora_op = torch.library.custom_op("moeadapt::grouped_lora_fwd", mutates_args=())(_grouped_lora_op_impl)


@grouped_lora_op.register_fake
def _(x_NI, A_EIR, B_ERO, offsets_E, scaling, w_EIO):
    return x_NI.new_empty(x_NI.shape[0], B_ERO.shape[2]), x_NI.new_empty(x_NI.shape[0], A_EIR.shape[2])


def _grouped_lora_bwd_impl(dy_NO: Tensor, x_NI: Tensor, A_EIR: Tensor, B_ERO: Tensor, offsets_E: Tensor,
                           h_NR: Tensor, w_EIO: Tensor | None, scaling: float, need_x: bool, need_a: bool,
                           need_b: bool, need_w: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(dx, dA, dB, dW) of grouped_lora_op, each in its input's layout and dtype; shape [0] where not needed
    (dW also without w_EIO)."""
    s = scaling
    dy_NO = dy_NO.contiguous()
    dh_NR = grouped_mm_fwd(dy_NO, _t(B_ERO), offsets_E, alpha=s, out_dtype=x_NI.dtype)
    dx = _none(x_NI)
    if need_x:
        if w_EIO is None:
            dx = grouped_mm_fwd(dh_NR, _t(A_EIR), offsets_E)
        else:
            dx = grouped_mm_fwd(dy_NO, _t(w_EIO), offsets_E, x2_NR=dh_NR, w2_ERO=_t(A_EIR), out_dtype=x_NI.dtype)
    dA = grouped_wgrad(x_NI, dh_NR, offsets_E, A_EIR) if need_a else _none(A_EIR)
    dB = grouped_wgrad(h_NR, dy_NO, offsets_E, B_ERO, alpha=s) if need_b else _none(B_ERO)
    dW = grouped_wgrad(x_NI, dy_NO, offsets_E, w_EIO) if (need_w and w_EIO is not None) else _none(x_NI)
    return dx, dA, dB, dW


grouped_lora_bwd = torch.library.custom_op("moeadapt::grouped_lora_bwd", mutates_args=())(_grouped_lora_bwd_impl)
grouped_lora_bwd_fast = impl_or_op(grouped_lora_bwd, _grouped_lora_bwd_impl)  # the implementation itself in eager


@grouped_lora_bwd.register_fake
def _(dy_NO, x_NI, A_EIR, B_ERO, offsets_E, h_NR, w_EIO, scaling, need_x, need_a, need_b, need_w):
    # dx of the no-base path is grouped_mm_fwd's output: x's dtype when x, A agree (the kernels' inputs do)
    return (torch.empty_like(x_NI, memory_format=torch.contiguous_format) if need_x else _none(x_NI),
            torch.empty_like(A_EIR) if need_a else _none(A_EIR), torch.empty_like(B_ERO) if need_b else _none(B_ERO),
            torch.empty_like(w_EIO) if (need_w and w_EIO is not None) else _none(x_NI))


def _lora_setup_context(ctx, inputs, output) -> None:
    x_NI, A_EIR, B_ERO, offsets_E, scaling, w_EIO = inputs
    ctx.scaling = scaling
    ctx.save_for_backward(x_NI, A_EIR, B_ERO, offsets_E, output[1], w_EIO)
    ctx.mark_non_differentiable(output[1])
    ctx.set_materialize_grads(False)


def _lora_backward(ctx, dy_NO, _dh):
    x_NI, A_EIR, B_ERO, offsets_E, h_NR, w_EIO = ctx.saved_tensors
    need_x, need_a, need_b, _, _, need_w = ctx.needs_input_grad
    if dy_NO is None:
        return None, None, None, None, None, None
    dx, dA, dB, dW = grouped_lora_bwd_fast(dy_NO, x_NI, A_EIR, B_ERO, offsets_E, h_NR, w_EIO, ctx.scaling, need_x,
                                           need_a, need_b, need_w and w_EIO is not None)
    return (dx if need_x else None, dA if need_a else None, dB if need_b else None, None, None,
            dW if (need_w and w_EIO is not None) else None)


grouped_lora_op.register_autograd(_lora_backward, setup_context=_lora_setup_context)
# what grouped_lora_triton calls, as grouped_mm_fast
grouped_lora_fast = eager_or_op(grouped_lora_op, _grouped_lora_op_impl, _lora_setup_context, _lora_backward)


def grouped_mm_triton(x_sorted_NI, w_EIO, offsets_E):
    return grouped_mm_fast(x_sorted_NI, w_EIO, offsets_E)


def grouped_lora_triton(x_sorted_NI, A_EIR, B_ERO, offsets_E, scaling, w_EIO=None):
    return grouped_lora_fast(x_sorted_NI, A_EIR, B_ERO, offsets_E, float(scaling), w_EIO)[0]
