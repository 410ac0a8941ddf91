"""Selected-key attention with one K/V head per query head (the MHA layout) on dense tiles, by FlexAttention.

MLA can attend in two forms with the same result:
- absorbed (MQA form): W_uk folded into the query; one latent key of kv_lora_rank + rope channels per token,
  shared by every head, and DV = kv_lora_rank. 2 * (576 + 512) FLOPs per (query, key, head) at DeepSeek's dims.
- decompressed (MHA form): per-head keys of nope + rope channels and per-head values of v_head_dim, made by one
  [tokens, kv_lora_rank] x [kv_lora_rank, H * (nope + vd)] GEMM: 2 * (192 + 128) FLOPs per (query, key, head),
  3.4x fewer.
The gathering kernels (triton_sparse_attn.py) need the absorbed form: one gathered latent row serves every head.
Walking a query block's key range in dense tiles, with the selection as a mask, needs no gather. Where the
selection covers most of that range (short contexts: top-2048 of T = 4096 is 0.75 of the causal pairs) the MHA
form on dense tiles does less work than the absorbed form on the selected pairs alone. DeepSeek-V3.2 trains
short sequences the same way (its "masked MHA mode").

FlexAttention (torch.nn.attention.flex_attention, compiled by inductor) runs the tiles. Its BlockMask lists, per
128-query block, the key blocks holding a selected pair (`_mark_selected` writes a byte mask of the selected keys,
`_tile_flags_kernel` flags each 128 x 128 tile, `_block_lists_kernel` orders the lists); blocks whose every pair
is selected are listed as full (no mask read), the others as partial, where mask_mod reads the byte mask.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import triton_tile_attn

BLOCK = 128  # FlexAttention's query and key block
# MIN_DENSITY: selected pairs / causal pairs (from T and top-k) at or above which an MHA-layout call takes the
# dense tiles (top-2048 of T = 16384: 0.23, where the tiles ran 15.8 ms fwd + bwd against the MHA-layout sparse
# kernel's 312 ms, 16 heads, H100); MHA_FORM: whether an MLA layer may pick the MHA form by itself (form="auto"),
# which it does where its dense-tile FLOPs (every causal pair, nope + rope and vd channels) are at most
# MHA_FORM_COST times the absorbed form's on the selected pairs (top-2048 of T = 4096: 0.39; 8192: 0.67; 12288:
# 0.96; 16384: 1.25; 32768: 2.43), MHA_FORM_COST_FEW_HEADS times at <= FEW_HEADS query heads. The absorbed form
# shares one latent KV head over the query heads, so it costs less per head as heads grow; the tiles cost the same
# per head. Measured fwd + bwd, absorbed / MHA form (bench_dsa.py --forms, H100, RESULTS.md): T 8192 at 16 / 64 /
# 128 heads 3.45x / 1.79x / 1.69x, T 12288 2.81x / 1.32x / 1.24x; T 16384 2.44x at 16 heads, a tie at 64 and 128
# (tiles alone 1.16x / 1.08x); T 32768, 16 heads, tiles alone 1.49x; at 32 heads T 8192 2.64x, T 16384 1.75x. So
# 1.0 (to T ~12.5k at top-2048) where the MHA form wins at every head count, 2.0 at <= 32 heads (MIN_DENSITY binds
# first there: to T ~19k). AUTOTUNE:
# compile FlexAttention with inductor's max-autotune (it times its launch configurations once per shape) instead
# of its heuristics. KERNEL_OPTIONS: FlexAttention's kernel_options (None: inductor's heuristics): the backward's
# tiles BLOCK_M1 x BLOCK_N1 (dk, dv: queries x keys) and BLOCK_M2 x BLOCK_N2 (dq), bwd_num_warps, bwd_num_stages.
# For q/k head dim 192 inductor launches the backward on 64 x 64 tiles with 4 warps; 64 x 128 (dk, dv) and
# 128 x 64 (dq) with 8 warps run it 1.83x faster (4.22 -> 2.30 ms at B 2, T 4096, 16 heads; bench_dsa.py
# --forms, H100, RESULTS.md), same gradients to the bit; max-autotune found 3.70 ms. In the `small` steps
# (H100, seq 4096 x 2) the MHA form with these tiles: full FT 217.2 -> 192.3 ms, LoRA 174.9 -> 150.6 ms.
# KERNEL: "triton" (the default) runs the tiles on CUDA with triton_tile_attn.py's kernels where they take the
# head dims (no padding of D = 192 to 256), "flex" with FlexAttention. At B 2, T 4096, 16 heads on an H100 the
# Triton kernels take 2.30 ms fwd + bwd against FlexAttention's 3.28 (1.43x; bench_dsa.py --forms, RESULTS.md);
# the `small` steps: full FT 171.6 -> 168.7 ms, LoRA 128.7 -> 124.9 ms. On the CPU FlexAttention runs either way.
FLEX_CONFIG = {"KERNEL": "triton", "FULL_BLOCKS": True, "MIN_DENSITY": 0.2, "MHA_FORM": True, "MHA_FORM_COST": 1.0,
               "MHA_FORM_COST_FEW_HEADS": 2.0, "FEW_HEADS": 32,
               "AUTOTUNE": False, "KERNEL_OPTIONS": {"BLOCK_M1": 64, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 64,
                                  "bwd_num_warps": 8, "bwd_num_stages": 2}}
_compiled: dict = {}  # compiled FlexAttention by AUTOTUNE


def selected_pairs(T: int, topk: int) -> int:
    """Pairs a causal top-k selection of T queries holds: query t selects min(topk, t + 1) keys."""
    n = min(T, topk)
    return n * (n + 1) // 2 + (T - n) * topk


def _dense_enough(T: int, topk: int, cfg: dict) -> bool:
    """A causal top-k selection of T queries covers at least MIN_DENSITY of the causal pairs."""
    return selected_pairs(T, topk) >= cfg["MIN_DENSITY"] * T * (T + 1) / 2


def dense_tiles_apply(q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor, cfg: dict | None = None) -> bool:
    """Whether an MHA-layout call (HK = HQ) takes the dense tiles: CUDA, one selection per token, T = Tk a
    multiple of BLOCK, and a selection dense enough (top-k of T vs every causal pair); not under a
    TorchDispatchMode (selective activation checkpointing's: it must see the attention as one op, which neither
    the compiled FlexAttention nor the tile kernels' autograd Function is, and FlexAttention's eager path would
    materialise every score)."""
    cfg = FLEX_CONFIG if cfg is None else cfg
    B, T, HQ, _ = q.shape
    if not (q.is_cuda and _get_current_dispatch_mode() is None and k.shape[2] == HQ and indices.dim() == 3
            and k.shape[1] == T and T % BLOCK == 0):
        return False
    return _dense_enough(T, indices.shape[-1], cfg)


def mha_form_pays(T: int, topk: int, d_mha: int, dv_mha: int, d_abs: int, dv_abs: int, is_cuda: bool,
                  cfg: dict | None = None, *, heads: int) -> bool:
    """Whether an MLA layer of `heads` query heads should attend in the MHA form (per-head d_mha / dv_mha channels
    over dense tiles of every causal pair) rather than the absorbed one (d_abs / dv_abs channels over the selected
    pairs). Not under a TorchDispatchMode (selective recompute), where the dense tiles do not run
    (`dense_tiles_apply`)."""
    cfg = FLEX_CONFIG if cfg is None else cfg
    if not cfg["MHA_FORM"] or not is_cuda or T % BLOCK or _get_current_dispatch_mode() is not None:
        return False
    if not _dense_enough(T, topk, cfg):
        return False
    cost = cfg["MHA_FORM_COST_FEW_HEADS"] if heads <= cfg["FEW_HEADS"] else cfg["MHA_FORM_COST"]
    return T * (T + 1) / 2 * (d_mha + dv_mha) <= cost * selected_pairs(T, topk) * (d_abs + dv_abs)


@triton.jit
def _tile_flags_kernel(SEL, FLAGS, T, TK, NQB, NKB, FULL: tl.constexpr, BLOCK: tl.constexpr):
    """FLAGS[b, qb, kb] = 0 (no selected pair in the tile), 1 (some), 2 (all; with FULL) from the byte mask SEL
    [B * T, TK]; program (b * NQB + qb, kb)."""
    bq = tl.program_id(0)
    kb = tl.program_id(1)
    b = bq // NQB
    qb = bq % NQB
    rows = (b * T + qb * BLOCK + tl.arange(0, BLOCK)).to(tl.int64)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(SEL + rows[:, None] * TK + cols[None, :], mask=cols[None, :] < TK, other=0)
    n = tl.sum(tl.sum((x != 0).to(tl.int32), 1), 0)
    flag = (n > 0).to(tl.int32)
    if FULL:
        flag += (n == BLOCK * BLOCK).to(tl.int32)
    tl.store(FLAGS + bq * NKB + kb, flag.to(tl.int8))


@triton.jit
def _write_list(f, flag, cols, ok, NUM, IDX, out, at):
    """The columns whose flag is `flag` first in IDX[out:], in column order, then the other columns; their count
    at NUM[at]."""
    hit = ((f == flag) & ok).to(tl.int32)
    n = tl.sum(hit, 0)
    rest = (ok & (f != flag)).to(tl.int32)
    pos = tl.where(hit != 0, tl.cumsum(hit, 0) - 1, n + tl.cumsum(rest, 0) - 1)
    tl.store(IDX + out + pos, cols, mask=ok)
    tl.store(NUM + at, n)


@triton.jit
def _block_lists_kernel(FLAGS, NUM, IDX, FNUM, FIDX, s_b, s_row, s_col, NROWS, NCOLS, FULL: tl.constexpr,
                        NC: tl.constexpr):
    """One row of a BlockMask's lists from the tile flags (read with strides: rows are query blocks for the key
    lists, key blocks for the query lists): NUM[b, row] partial blocks (flag 1) listed first in IDX[b, row, :] in
    column order, then the row's other columns; with FULL the same for the full blocks (flag 2) in FNUM / FIDX.
    Program (b, row)."""
    b = tl.program_id(0)
    row = tl.program_id(1)
    cols = tl.arange(0, NC)
    ok = cols < NCOLS
    f = tl.load(FLAGS + b * s_b + row * s_row + cols * s_col, mask=ok, other=0).to(tl.int32)
    out = (b * NROWS + row) * NCOLS
    _write_list(f, 1, cols, ok, NUM, IDX, out, b * NROWS + row)
    if FULL:
        _write_list(f, 2, cols, ok, FNUM, FIDX, out, b * NROWS + row)


def _lists(flags, rows, cols, transpose, full):
    """(num, indices, full num, full indices) of flags [B, nqb, nkb]: int32 [B, 1, rows] and [B, 1, rows, cols],
    the full pair None unless `full`; the key lists (rows = query blocks) or, with transpose, the query lists
    (rows = key blocks). One int32 buffer holds them all."""
    B = flags.shape[0]
    buf = torch.empty(2 if full else 1, B * rows * (cols + 1), device=flags.device, dtype=torch.int32)
    num, idx = buf[:, : B * rows].view(-1, B, 1, rows), buf[:, B * rows:].view(-1, B, 1, rows, cols)
    s_b, s_q, s_k = flags.stride()
    s_row, s_col = (s_k, s_q) if transpose else (s_q, s_k)
    _block_lists_kernel[(B, rows)](flags, num[0], idx[0], num[-1], idx[-1], s_b, s_row, s_col, rows, cols,
                                   FULL=full, NC=triton.next_power_of_2(cols), num_warps=1)
    return num[0], idx[0], (num[1] if full else None), (idx[1] if full else None)


class SelectionTiles(NamedTuple):
    """A selection's tiles: the byte mask sel [B * T, Tk] (uint8, 1 = selected) and both sides' block lists (int32):
    per query block the key blocks holding a selected pair, kv_num [B, 1, nqb] and kv_idx [B, 1, nqb, nkb] (the
    partial blocks first, in key order), and per key block the query blocks, q_num / q_idx; the *_full_* lists hold
    the blocks whose every pair is selected (None without full blocks: then every block is partial)."""
    sel: torch.Tensor
    kv_num: torch.Tensor
    kv_idx: torch.Tensor
    kv_full_num: torch.Tensor | None
    kv_full_idx: torch.Tensor | None
    q_num: torch.Tensor
    q_idx: torch.Tensor
    q_full_num: torch.Tensor | None
    q_full_idx: torch.Tensor | None


def selection_tiles(indices: torch.Tensor, T: int, Tk: int, full_blocks: bool = True) -> SelectionTiles:
    """The tiles of a selection: indices [B, T, K] (-1 unused) -> per 128-query block the key blocks holding a
    selected pair; with full_blocks those whose every pair is selected are listed apart (no mask read there).
    The byte mask, the tile flags and both sides' lists (the backward walks the query lists) are four kernels:
    no host synchronisation (the step can be captured in a CUDA graph), little host time (the eager step)."""
    from .triton_sparse_attn import _mark_selected

    B = indices.shape[0]
    sel, _, _ = _mark_selected(indices.contiguous(), B, T, Tk)
    nqb, nkb = T // BLOCK, -(-Tk // BLOCK)
    full = bool(full_blocks and Tk % BLOCK == 0)
    flags = torch.empty(B, nqb, nkb, device=indices.device, dtype=torch.int8)
    _tile_flags_kernel[(B * nqb, nkb)](sel, flags, T, Tk, nqb, nkb, FULL=full, BLOCK=BLOCK, num_warps=4)
    return SelectionTiles(sel, *_lists(flags, nqb, nkb, False, full), *_lists(flags, nkb, nqb, True, full))


def tiles_block_mask(tiles: SelectionTiles, T: int, Tk: int) -> BlockMask:
    """FlexAttention's BlockMask of a selection's tiles (mask_mod reads the byte mask in the partial blocks)."""
    B = tiles.kv_num.shape[0]
    sel = tiles.sel.view(B, T, Tk)

    def keep(b, h, q_idx, kv_idx):
        return sel[b, q_idx, kv_idx] != 0

    bm = BlockMask.from_kv_blocks(tiles.kv_num, tiles.kv_idx, tiles.kv_full_num, tiles.kv_full_idx,
                                  BLOCK_SIZE=BLOCK, mask_mod=keep, seq_lengths=(T, Tk), compute_q_blocks=False)
    bm.q_num_blocks, bm.q_indices, bm.full_q_num_blocks, bm.full_q_indices = (
        tiles.q_num, tiles.q_idx, tiles.q_full_num, tiles.q_full_idx)
    return bm


def selection_block_mask(indices: torch.Tensor, T: int, Tk: int, full_blocks: bool = True) -> BlockMask:
    """The BlockMask of a selection (`selection_tiles`, then `tiles_block_mask`)."""
    return tiles_block_mask(selection_tiles(indices, T, Tk, full_blocks), T, Tk)


def sparse_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                          scale: float | None = None, cfg: dict | None = None) -> torch.Tensor:
    """`sparse_attention` for the MHA layout on dense tiles: q, k [B, T, H, D], v [B, T, H, DV], indices [B, T, K]
    -> o [B, T, H, DV] (0 for a query that selects nothing). Differentiable in q, k, v. On CUDA FlexAttention is
    compiled (once per shape), or with cfg["KERNEL"] = "triton" triton_tile_attn.py's kernels run the same tiles
    where they take the head dims; elsewhere FlexAttention runs eagerly (its reference math, forward only)."""
    cfg = FLEX_CONFIG if cfg is None else cfg
    T, Tk = q.shape[1], k.shape[1]
    tiles = selection_tiles(indices, T, Tk, cfg["FULL_BLOCKS"])
    if cfg["KERNEL"] == "triton" and q.is_cuda and triton_tile_attn.supported(q, v):
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        return triton_tile_attn.tile_attention(q, k, v, tiles, scale)
    return flex_on_mask(q, k, v, tiles_block_mask(tiles, T, Tk), scale, cfg)


def flex_on_mask(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bm: BlockMask, scale: float | None = None,
                 cfg: dict | None = None) -> torch.Tensor:
    """FlexAttention of q, k [B, T, H, D], v [B, T, H, DV] over a BlockMask from `selection_block_mask`."""
    cfg = FLEX_CONFIG if cfg is None else cfg
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    fn = flex_attention
    opts = cfg.get("KERNEL_OPTIONS")
    if q.is_cuda:
        tune = bool(cfg.get("AUTOTUNE"))
        if tune not in _compiled:
            mode = "max-autotune-no-cudagraphs" if tune else None
            _compiled[tune] = torch.compile(flex_attention, dynamic=False, mode=mode)
        fn = _compiled[tune]
    else:
        opts = None  # the eager path takes no launch options
    o = fn(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm, scale=scale,
           kernel_options=dict(opts) if opts else None)
    return o.transpose(1, 2)
