"""Triton token permutation for MoE: expert-major sort without a full sort, and the weighted combine.

Owns the kernels behind `permute(..., backend="triton")` and `unpermute(..., backend="triton")`.

Index computation (no argsort): the T*K token choices are cut into blocks of BLOCK choices.
  1. `_rank_hist_kernel`: per block, each choice's rank among earlier choices of the same expert in
     that block (a BLOCK×BLOCK compare), and the block's histogram (written by the last choice of each
     expert in the block, so no atomics; deterministic).
  2. torch: counts = Σ_blocks hist; base[b, e] = start of expert e + choices of e in blocks < b
     (an exclusive cumsum over blocks).
  3. `_scatter_index_kernel`: destination row = base[b, e] + rank; row_index[dest] = t*K+k.
The result is stable in t*K+k within each expert, like a stable argsort.

Data movement (one program per tile of rows × hidden chunk, fp32 accumulation):
  - `_gather_rows_kernel`: out[n] = scale[m] · src[m // K] with m = row_index[n], optionally also
    dscale[m] = <src[m // K], other[n]>. Serves permute forward (no scale) and unpermute backward
    (scale = routing weight; dweights from the dot with y_sorted).
  - `_combine_rows_kernel`: out[t] = Σ_k w[t,k] · src[inv[t*K+k]] (skipping inv = -1). Serves
    unpermute forward (with weights) and permute backward (without). A gather-sum, so the backward
    "scatter" is deterministic and needs no atomics.
  - `_scatter_rows_kernel`: the gather in token order from the inverse index, out[inv[m]] = scale[m] · src[m // K]
    (each src row read once, written to its K rows); an alternative launch of the same op, timed by
    benchmarks/bench_permute.py, not yet used by permute / unpermute.
Launch parameters: GatherLaunch / CombineLaunch (the `launch=` of gather_rows, scatter_rows, combine_rows), whose
defaults are the constants beside the kernels.

Shape suffixes: T tokens, K choices per token, M = T*K choices, N routed rows, E experts, D hidden,
B blocks of choices.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

_BLOCK_CHOICES = 128


@triton.jit
def _rank_hist_kernel(ids_ptr, rank_ptr, hist_ptr, M, E, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    local = tl.arange(0, BLOCK)
    offs = pid * BLOCK + local
    in_range = offs < M
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    # bins: 0..E-1 experts, E dropped (-1), E+1 invalid id (caught by the caller)
    is_expert = (ids >= 0) & (ids < E)
    bins = tl.where(is_expert, ids, tl.where(ids == -1, E, E + 1))
    bins = tl.where(in_range, bins, E + 2)  # padding lanes match nothing real
    same = bins[:, None] == bins[None, :]
    earlier = local[None, :] < local[:, None]
    later = local[None, :] > local[:, None]
    rank = tl.sum((same & earlier).to(tl.int32), axis=1)
    n_later = tl.sum((same & later).to(tl.int32), axis=1)
    tl.store(rank_ptr + offs, rank, mask=in_range)
    # the last choice of each bin in this block writes the bin's count (unique addresses)
    tl.store(hist_ptr + pid * (E + 2) + bins, rank + 1, mask=in_range & (n_later == 0))


@triton.jit
def _scatter_index_kernel(ids_ptr, rank_ptr, base_ptr, row_index_ptr, M, E, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < M
    ids = tl.load(ids_ptr + offs, mask=in_range, other=-1).to(tl.int32)
    valid = in_range & (ids >= 0) & (ids < E)
    rank = tl.load(rank_ptr + offs, mask=valid, other=0)
    base = tl.load(base_ptr + pid * E + ids, mask=valid, other=0)
    tl.store(row_index_ptr + base + rank, offs.to(tl.int64), mask=valid)


# Launch of the data-movement kernels. The rules as they stood before any launch was timed (bench_permute.py times
# the variants GatherLaunch / CombineLaunch offer against them): gather_rows covers up to GATHER_MAX_BLOCK_D
# columns per step of its loop over D and GATHER_TILE elements per program (BLOCK_R = GATHER_TILE // BLOCK_D rows);
# combine_rows one BLOCK_D <= COMBINE_MAX_BLOCK_D chunk of COMBINE_TILE elements per program on a 2-D grid.
GATHER_MAX_BLOCK_D = 1024
GATHER_TILE = 4096
GATHER_NUM_WARPS = 4
COMBINE_MAX_BLOCK_D = 256
COMBINE_TILE = 2048
COMBINE_NUM_WARPS = 4
_EVICTION = ("", "evict_first", "evict_last")  # "" leaves the load / store at the hardware's default policy
_K_MODES = {"loop": 0, "unroll": 1, "tile": 2}  # CombineLaunch.k_mode -> _combine_rows_kernel's K_MODE


@dataclasses.dataclass(frozen=True)
class GatherLaunch:
    """How gather_rows (and scatter_rows, the same op in token order) launch. Frozen: pass a changed copy
    (`dataclasses.replace(GATHER_LAUNCH, ...)`) to try another one.

    block_r: rows per program (scatter_rows: tokens); None: max(1, GATHER_TILE // block_d).
    block_d: columns per step over D; None: min(next_pow2(D), GATHER_MAX_BLOCK_D).
    split_d: gather_rows on a 2-D grid (row blocks x D chunks), one chunk per program and no loop over D; not with
        `other` (the dot spans D).
    d_fast: with split_d, consecutive programs take the D chunks of one row block (a 1-D grid, chunk = pid % chunks),
        so a row's chunks are read and written together rather than one grid column apart.
    int32_index: row and element offsets in 32 bits where every offset fits (else 64, as by default).
    unroll_k: scatter_rows only: its K destinations as an unrolled loop (K a compile-time constant).
    evict_src / evict_other / evict_out: L2 eviction hint ("", "evict_first", "evict_last") of the load of src
        (re-read K times by gather_rows), of other, and of the store of out."""

    block_r: int | None = None
    block_d: int | None = None
    num_warps: int = GATHER_NUM_WARPS
    split_d: bool = False
    d_fast: bool = False
    int32_index: bool = False
    unroll_k: bool = False
    evict_src: str = ""
    evict_other: str = ""
    evict_out: str = ""

    def __post_init__(self):
        for name in ("evict_src", "evict_other", "evict_out"):
            if getattr(self, name) not in _EVICTION:
                raise ValueError(f"{name} must be one of {_EVICTION}; got {getattr(self, name)!r}")

    def blocks(self, D: int) -> tuple[int, int]:
        block_d = self.block_d or min(triton.next_power_of_2(D), GATHER_MAX_BLOCK_D)
        return self.block_r or max(1, GATHER_TILE // block_d), block_d


@dataclasses.dataclass(frozen=True)
class CombineLaunch:
    """How combine_rows launches (a 2-D grid: token blocks x D chunks). Frozen, as GatherLaunch.

    block_t: tokens per program; None: max(1, COMBINE_TILE // block_d).
    block_d: columns per program; None: min(next_pow2(D), COMBINE_MAX_BLOCK_D).
    d_fast: consecutive programs take the D chunks of one token block (a 1-D grid, chunk = pid % chunks) rather than
        the same chunk of consecutive token blocks, so each source row's chunks are read together.
    k_mode: how the K choices of a token are summed: "loop" (a loop over the runtime K, one index load per choice),
        "unroll" (K a compile-time constant, the loop unrolled so the K row loads can be in flight together) or
        "tile" (the [block_t, next_pow2(K)] index tile loaded once, the K rows as one [block_t, K, block_d] load,
        summed along K).
    int32_index, evict_src, evict_out: as GatherLaunch (src rows are read once here: "evict_first" fits)."""

    block_t: int | None = None
    block_d: int | None = None
    num_warps: int = COMBINE_NUM_WARPS
    d_fast: bool = False
    k_mode: str = "loop"
    int32_index: bool = False
    evict_src: str = ""
    evict_out: str = ""

    def __post_init__(self):
        if self.k_mode not in _K_MODES:
            raise ValueError(f"k_mode must be one of {tuple(_K_MODES)}; got {self.k_mode!r}")
        for name in ("evict_src", "evict_out"):
            if getattr(self, name) not in _EVICTION:
                raise ValueError(f"{name} must be one of {_EVICTION}; got {getattr(self, name)!r}")

    def blocks(self, D: int) -> tuple[int, int]:
        block_d = self.block_d or min(triton.next_power_of_2(D), COMBINE_MAX_BLOCK_D)
        return self.block_t or max(1, COMBINE_TILE // block_d), block_d


# The defaults, from bench_permute.py on an H100 (T 8192, K 8, D 1024: the `small` step's; RESULTS.md, MoE section):
# gather_rows with its out rows stored evict_first (written once, read by the next GEMM long after): 71.8 -> 60.0 us
# plain, 126.2 -> 111.6 us with scale and dot (the unpermute backward, 15 a step); combine_rows with 4 tokens x 512
# columns on 8 warps, K unrolled, 32-bit offsets and the source rows read evict_first: 64.2 -> 58.5 us weighted,
# 63.6 -> 59.0 us plain (30 a step). The rules above stay the blocks' defaults for other launches.
GATHER_LAUNCH = GatherLaunch(evict_out="evict_first")
COMBINE_LAUNCH = CombineLaunch(block_t=4, block_d=512, num_warps=8, k_mode="unroll", int32_index=True,
                               evict_src="evict_first")


def _fits_int32(*extents: int) -> bool:
    """Every offset below each extent (elements of one tensor) fits a signed 32-bit integer."""
    return max(extents, default=0) < 2**31


@triton.jit
def _gather_chunk(
    src_ptr, out_ptr, other_ptr, src_rows, out_rows, row_ok, scale, d0, D,
    HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, BLOCK_D: tl.constexpr,
    EVICT_SRC: tl.constexpr, EVICT_OTHER: tl.constexpr, EVICT_OUT: tl.constexpr,
):
    """Columns [d0, d0 + BLOCK_D) of gather_rows' tile: out[out_rows] = scale·src[src_rows]; returns the partial
    dot <src[src_rows], other[out_rows]> over these columns (zeros without HAS_DOT)."""
    cols = d0 + tl.arange(0, BLOCK_D)
    mask = row_ok[:, None] & (cols[None, :] < D)
    v = tl.load(src_ptr + src_rows[:, None] * D + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICT_SRC)
    dot = tl.zeros_like(scale)
    if HAS_DOT:
        o = tl.load(other_ptr + out_rows[:, None] * D + cols[None, :], mask=mask, other=0.0,
                    eviction_policy=EVICT_OTHER)
        dot = tl.sum(v.to(tl.float32) * o.to(tl.float32), axis=1)
    if HAS_SCALE:
        v = v.to(tl.float32) * scale[:, None]
    tl.store(out_ptr + out_rows[:, None] * D + cols[None, :], v.to(out_ptr.dtype.element_ty), mask=mask,
             eviction_policy=EVICT_OUT)
    return dot


@triton.jit
def _gather_rows_kernel(
    src_ptr, row_index_ptr, out_ptr, scale_ptr, other_ptr, dscale_ptr,
    N, D, K,
    HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
    SPLIT_D: tl.constexpr = False, D_FAST: tl.constexpr = False, INT32_INDEX: tl.constexpr = False,
    EVICT_SRC: tl.constexpr = "", EVICT_OTHER: tl.constexpr = "", EVICT_OUT: tl.constexpr = "",
):
    pid = tl.program_id(0)
    pid_d = tl.program_id(1)
    if D_FAST:  # SPLIT_D on a 1-D grid, the D chunks of a row block on consecutive programs
        n_d = tl.cdiv(D, BLOCK_D)
        pid_d = pid % n_d
        pid = pid // n_d
    rows = pid * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < N
    m = tl.load(row_index_ptr + rows, mask=row_ok, other=0)
    if INT32_INDEX:  # the caller checked that every offset fits: 32-bit division and multiplies
        m = m.to(tl.int32)
        src_rows = m // K
        out_rows = rows
    else:
        src_rows = (m // K).to(tl.int64)
        out_rows = rows.to(tl.int64)
    scale = tl.full([BLOCK_R], 1.0, tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + m, mask=row_ok, other=0.0).to(tl.float32)
    if SPLIT_D:  # program_id(1) picks the one chunk of columns (no dot: the caller refuses SPLIT_D with HAS_DOT)
        _gather_chunk(src_ptr, out_ptr, other_ptr, src_rows, out_rows, row_ok, scale, pid_d * BLOCK_D, D,
                      HAS_SCALE, False, BLOCK_D, EVICT_SRC, EVICT_OTHER, EVICT_OUT)
    else:
        dot = tl.zeros([BLOCK_R], dtype=tl.float32)
        for d0 in range(0, D, BLOCK_D):
            dot += _gather_chunk(src_ptr, out_ptr, other_ptr, src_rows, out_rows, row_ok, scale, d0, D,
                                 HAS_SCALE, HAS_DOT, BLOCK_D, EVICT_SRC, EVICT_OTHER, EVICT_OUT)
        if HAS_DOT:
            tl.store(dscale_ptr + m, dot.to(dscale_ptr.dtype.element_ty), mask=row_ok)


@triton.jit
def _scatter_choice(
    src_ptr, inv_ptr, out_ptr, scale_ptr, other_ptr, dscale_ptr, toks, tok_ok, v, k, D, K,
    HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, BLOCK_D: tl.constexpr, WHOLE_ROW: tl.constexpr,
    INT32_INDEX: tl.constexpr, EVICT_SRC: tl.constexpr, EVICT_OTHER: tl.constexpr, EVICT_OUT: tl.constexpr,
):
    """Choice k of each token in `toks`: out[inv[t*K+k]] = scale·src[t] (skipped where dropped, inv = -1), and with
    HAS_DOT dscale[t*K+k] = <src[t], other[inv[t*K+k]]> (0 where dropped). `v`: the src rows when WHOLE_ROW."""
    m = toks * K + k
    r = tl.load(inv_ptr + m, mask=tok_ok, other=-1)
    ok = tok_ok & (r >= 0)
    if not INT32_INDEX:
        r = r.to(tl.int64)
    scale = tl.full(toks.shape, 1.0, tl.float32)
    if HAS_SCALE:
        scale = tl.load(scale_ptr + m, mask=ok, other=0.0).to(tl.float32)
    dot = tl.zeros(toks.shape, dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        cols = d0 + tl.arange(0, BLOCK_D)
        col_ok = cols[None, :] < D
        if WHOLE_ROW:  # one chunk: the rows loaded once by the caller
            x = v
        else:  # re-read per choice (from cache: the same rows a moment ago)
            x = tl.load(src_ptr + toks[:, None] * D + cols[None, :], mask=tok_ok[:, None] & col_ok, other=0.0,
                        eviction_policy=EVICT_SRC)
        mask = ok[:, None] & col_ok
        if HAS_DOT:
            o = tl.load(other_ptr + r[:, None] * D + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICT_OTHER)
            dot += tl.sum(x.to(tl.float32) * o.to(tl.float32), axis=1)
        if HAS_SCALE:
            x = x.to(tl.float32) * scale[:, None]
        tl.store(out_ptr + r[:, None] * D + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=mask,
                 eviction_policy=EVICT_OUT)
    if HAS_DOT:
        tl.store(dscale_ptr + m, dot.to(dscale_ptr.dtype.element_ty), mask=tok_ok)


@triton.jit
def _scatter_rows_kernel(
    src_ptr, inv_ptr, out_ptr, scale_ptr, other_ptr, dscale_ptr,
    T, D, K,
    HAS_SCALE: tl.constexpr, HAS_DOT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    WHOLE_ROW: tl.constexpr, UNROLL_K: tl.constexpr, INT32_INDEX: tl.constexpr,
    EVICT_SRC: tl.constexpr, EVICT_OTHER: tl.constexpr, EVICT_OUT: tl.constexpr,
):
    """gather_rows in token order: each program reads BLOCK_T src rows and writes each to its K destination rows, so
    src crosses from memory once rather than K times through L2. WHOLE_ROW (BLOCK_D >= D): the rows are loaded into
    registers once for all K choices. UNROLL_K > 0: the loop over the K (= UNROLL_K) choices unrolled."""
    pid = tl.program_id(0)
    toks = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    if not INT32_INDEX:
        toks = toks.to(tl.int64)
    v = tl.zeros([BLOCK_T, BLOCK_D], dtype=src_ptr.dtype.element_ty)
    if WHOLE_ROW:
        cols = tl.arange(0, BLOCK_D)
        v = tl.load(src_ptr + toks[:, None] * D + cols[None, :], mask=tok_ok[:, None] & (cols[None, :] < D),
                    other=0.0, eviction_policy=EVICT_SRC)
    if UNROLL_K > 0:
        for k in tl.static_range(UNROLL_K):
            _scatter_choice(src_ptr, inv_ptr, out_ptr, scale_ptr, other_ptr, dscale_ptr, toks, tok_ok, v, k, D, K,
                            HAS_SCALE, HAS_DOT, BLOCK_D, WHOLE_ROW, INT32_INDEX, EVICT_SRC, EVICT_OTHER, EVICT_OUT)
    else:
        for k in range(0, K):
            _scatter_choice(src_ptr, inv_ptr, out_ptr, scale_ptr, other_ptr, dscale_ptr, toks, tok_ok, v, k, D, K,
                            HAS_SCALE, HAS_DOT, BLOCK_D, WHOLE_ROW, INT32_INDEX, EVICT_SRC, EVICT_OTHER, EVICT_OUT)


@triton.jit
def _combine_choice(src_ptr, inv_ptr, w_ptr, toks, tok_ok, cols, col_ok, k, D, K,
                    HAS_W: tl.constexpr, INT32_INDEX: tl.constexpr, EVICT_SRC: tl.constexpr):
    """w[t,k]·src[inv[t*K+k]] in fp32 for the tokens `toks` and columns `cols` (0 where dropped, inv = -1)."""
    r = tl.load(inv_ptr + toks * K + k, mask=tok_ok, other=-1)
    if not INT32_INDEX:
        r = r.to(tl.int64)
    ok = tok_ok & (r >= 0)
    v = tl.load(src_ptr + r[:, None] * D + cols[None, :], mask=ok[:, None] & col_ok[None, :], other=0.0,
                eviction_policy=EVICT_SRC)
    v = v.to(tl.float32)
    if HAS_W:
        w = tl.load(w_ptr + toks * K + k, mask=ok, other=0.0).to(tl.float32)
        v = v * w[:, None]
    return v


@triton.jit
def _combine_rows_kernel(
    src_ptr, inv_ptr, w_ptr, out_ptr, T, D, K,
    HAS_W: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    D_FAST: tl.constexpr = False, K_MODE: tl.constexpr = 0, KC: tl.constexpr = 1, INT32_INDEX: tl.constexpr = False,
    EVICT_SRC: tl.constexpr = "", EVICT_OUT: tl.constexpr = "",
):
    """K_MODE (CombineLaunch.k_mode): 0 a loop over the runtime K; 1 unrolled over KC = K; 2 the [BLOCK_T, KC, BLOCK_D]
    rows in one load, KC = next_pow2(K). D_FAST: a 1-D grid, the D chunks of a token block on consecutive programs."""
    pid_t = tl.program_id(0)
    pid_d = tl.program_id(1)
    if D_FAST:
        n_d = tl.cdiv(D, BLOCK_D)
        pid_d = pid_t % n_d
        pid_t = pid_t // n_d
    toks = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = toks < T
    cols = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    col_ok = cols < D
    if K_MODE == 2:
        kk = tl.arange(0, KC)
        m = toks[:, None] * K + kk[None, :]
        r = tl.load(inv_ptr + m, mask=tok_ok[:, None] & (kk[None, :] < K), other=-1)
        if not INT32_INDEX:
            r = r.to(tl.int64)
        ok = r >= 0
        v = tl.load(src_ptr + r[:, :, None] * D + cols[None, None, :], mask=ok[:, :, None] & col_ok[None, None, :],
                    other=0.0, eviction_policy=EVICT_SRC).to(tl.float32)
        if HAS_W:
            w = tl.load(w_ptr + m, mask=ok, other=0.0).to(tl.float32)
            v = v * w[:, :, None]
        acc = tl.sum(v, axis=1)
    else:
        acc = tl.zeros([BLOCK_T, BLOCK_D], dtype=tl.float32)
        if K_MODE == 1:
            for k in tl.static_range(KC):
                acc += _combine_choice(src_ptr, inv_ptr, w_ptr, toks, tok_ok, cols, col_ok, k, D, K,
                                       HAS_W, INT32_INDEX, EVICT_SRC)
        else:
            for k in range(0, K):
                acc += _combine_choice(src_ptr, inv_ptr, w_ptr, toks, tok_ok, cols, col_ok, k, D, K,
                                       HAS_W, INT32_INDEX, EVICT_SRC)
    if not INT32_INDEX:
        toks = toks.to(tl.int64)
    out_ptrs = out_ptr + toks[:, None] * D + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=tok_ok[:, None] & col_ok[None, :],
             eviction_policy=EVICT_OUT)


def compute_permutation(
    expert_ids_TK: torch.Tensor, num_experts: int, num_routed: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Row index of each expert-major row and tokens per expert, by histogram + prefix sum.

    One host sync (the number of routed rows N, which sizes the output, and the count of bad ids),
    none when the caller knows N (`num_routed`): then both are checked by device-side asserts.
    """
    ids_M = expert_ids_TK.reshape(-1).contiguous()
    M, E = ids_M.numel(), num_experts
    num_blocks = triton.cdiv(M, _BLOCK_CHOICES)
    rank_M = torch.empty(M, dtype=torch.int32, device=ids_M.device)
    hist_BE = torch.zeros(max(num_blocks, 1), E + 2, dtype=torch.int32, device=ids_M.device)
    if M > 0:
        _rank_hist_kernel[(num_blocks,)](ids_M, rank_M, hist_BE, M, E, BLOCK=_BLOCK_CHOICES)
    counts_all = hist_BE.sum(0)  # int64
    if num_routed is not None:
        n_routed, n_bad = num_routed, 0
        torch._assert_async(counts_all[E + 1] == 0, "expert ids outside [0, E) other than -1")
        torch._assert_async(counts_all[:E].sum() == num_routed, "num_routed differs from the routed choices")
    else:
        n_routed, n_bad = torch.stack([counts_all[:E].sum(), counts_all[E + 1]]).tolist()
    if n_bad:
        bad = ids_M[(ids_M < -1) | (ids_M >= E)][:5].tolist()
        raise ValueError(
            f"expert_ids_TK holds {n_bad} ids outside [0, {E}) other than -1 (e.g. {bad}); "
            f"ids must be expert indices or -1 for a dropped choice"
        )
    counts_E = counts_all[:E]
    starts_E = torch.cumsum(counts_E, 0) - counts_E
    # the exclusive prefix over blocks along the last dim: CUDA's scan along a leading dim of [blocks, E] runs
    # E columns serially (~95 us at 512 x 64 on the H200)
    hist_EB = hist_BE[:, :E].t().to(torch.int64, memory_format=torch.contiguous_format)
    base_BE = (torch.cumsum(hist_EB, 1) - hist_EB + starts_E[:, None]).t().to(
        torch.int32, memory_format=torch.contiguous_format)
    row_index_N = torch.empty(n_routed, dtype=torch.int64, device=ids_M.device)
    if M > 0:
        _scatter_index_kernel[(num_blocks,)](ids_M, rank_M, base_BE, row_index_N, M, E, BLOCK=_BLOCK_CHOICES)
    return row_index_N, counts_E


def inverse_index(row_index_N: torch.Tensor, num_choices: int) -> torch.Tensor:
    """inv[t*K+k] = sorted row of that choice, -1 when dropped."""
    inv_M = torch.full((num_choices,), -1, dtype=torch.int32, device=row_index_N.device)
    inv_M[row_index_N] = torch.arange(len(row_index_N), dtype=torch.int32, device=row_index_N.device)
    return inv_M


def gather_rows(src_TD, row_index_N, K, scale_M=None, other_ND=None, out_dtype=None, launch=GATHER_LAUNCH):
    """out[n] = scale[m]·src[m // K] (m = row_index[n]); with other, also dscale[m] = <src[m//K], other[n]>."""
    src_TD = src_TD.contiguous()
    N, D = len(row_index_N), src_TD.shape[1]
    out_ND = torch.empty(N, D, dtype=out_dtype or src_TD.dtype, device=src_TD.device)
    dscale_M = None
    if other_ND is not None:
        if launch.split_d:
            raise ValueError("GatherLaunch.split_d cannot make the dot with `other` (it spans all of D)")
        other_ND = other_ND.contiguous()
        dscale_M = torch.zeros_like(scale_M)
    if launch.unroll_k:
        raise ValueError("GatherLaunch.unroll_k applies to scatter_rows only")
    if N > 0 and D > 0:
        BLOCK_R, BLOCK_D = launch.blocks(D)
        if launch.d_fast and not launch.split_d:
            raise ValueError("GatherLaunch.d_fast orders split_d's chunks: set split_d too")
        n_r, n_d = triton.cdiv(N, BLOCK_R), triton.cdiv(D, BLOCK_D) if launch.split_d else 1
        grid = (n_r * n_d,) if launch.d_fast else (n_r, n_d)
        _gather_rows_kernel[grid](
            src_TD, row_index_N, out_ND,
            scale_M if scale_M is not None else src_TD, other_ND if other_ND is not None else src_TD,
            dscale_M if dscale_M is not None else src_TD,
            N, D, K,
            HAS_SCALE=scale_M is not None, HAS_DOT=other_ND is not None, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D,
            SPLIT_D=launch.split_d, D_FAST=launch.d_fast,
            INT32_INDEX=launch.int32_index and _fits_int32(src_TD.numel(), N * D, src_TD.shape[0] * K),
            EVICT_SRC=launch.evict_src, EVICT_OTHER=launch.evict_other, EVICT_OUT=launch.evict_out,
            num_warps=launch.num_warps,
        )
    return out_ND, dscale_M


def scatter_rows(src_TD, inv_M, K, num_rows, scale_M=None, other_ND=None, out_dtype=None, launch=GATHER_LAUNCH):
    """gather_rows' result, computed in token order from the inverse index (inv[t*K+k] = destination row, -1 where
    dropped): out[inv[m]] = scale[m]·src[m // K]; with other, dscale[m] = <src[m // K], other[inv[m]]> (0 where
    dropped). Each src row is read once and written to its K rows. `num_rows` = N, the routed rows."""
    src_TD = src_TD.contiguous()
    T, D = src_TD.shape
    if len(inv_M) != T * K:
        raise ValueError(f"inv_M holds {len(inv_M)} choices; src has {T} tokens x K={K}")
    if launch.split_d or launch.d_fast:
        raise ValueError("GatherLaunch.split_d / d_fast apply to gather_rows only")
    out_ND = torch.empty(num_rows, D, dtype=out_dtype or src_TD.dtype, device=src_TD.device)
    dscale_M = None
    if other_ND is not None:
        other_ND = other_ND.contiguous()
        dscale_M = torch.empty_like(scale_M)  # every choice written (0 where dropped)
    if T > 0 and D > 0:
        BLOCK_T, BLOCK_D = launch.blocks(D)
        _scatter_rows_kernel[(triton.cdiv(T, BLOCK_T),)](
            src_TD, inv_M, out_ND,
            scale_M if scale_M is not None else src_TD, other_ND if other_ND is not None else src_TD,
            dscale_M if dscale_M is not None else src_TD,
            T, D, K,
            HAS_SCALE=scale_M is not None, HAS_DOT=other_ND is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D,
            WHOLE_ROW=BLOCK_D >= D, UNROLL_K=K if launch.unroll_k else 0,
            INT32_INDEX=launch.int32_index and _fits_int32(src_TD.numel(), num_rows * D, T * K),
            EVICT_SRC=launch.evict_src, EVICT_OTHER=launch.evict_other, EVICT_OUT=launch.evict_out,
            num_warps=launch.num_warps,
        )
    elif dscale_M is not None:
        dscale_M.zero_()
    return out_ND, dscale_M


def combine_rows(src_ND, inv_M, K, weights_M=None, out_dtype=None, launch=COMBINE_LAUNCH):
    """out[t] = Σ_k w[t,k]·src[inv[t*K+k]] accumulated in fp32 (dropped choices skipped)."""
    src_ND = src_ND.contiguous()
    T, D = len(inv_M) // K, src_ND.shape[1]
    out_TD = torch.empty(T, D, dtype=out_dtype or src_ND.dtype, device=src_ND.device)
    if T > 0 and D > 0:
        BLOCK_T, BLOCK_D = launch.blocks(D)
        k_mode = _K_MODES[launch.k_mode]
        n_t, n_d = triton.cdiv(T, BLOCK_T), triton.cdiv(D, BLOCK_D)
        grid = (n_t * n_d,) if launch.d_fast else (n_t, n_d)
        _combine_rows_kernel[grid](
            src_ND, inv_M, weights_M if weights_M is not None else src_ND, out_TD, T, D, K,
            HAS_W=weights_M is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, D_FAST=launch.d_fast,
            K_MODE=k_mode, KC={0: 1, 1: K, 2: triton.next_power_of_2(K)}[k_mode],
            INT32_INDEX=launch.int32_index and _fits_int32(src_ND.numel(), T * D, T * K),
            EVICT_SRC=launch.evict_src, EVICT_OUT=launch.evict_out,
            num_warps=launch.num_warps,
        )
    return out_TD


class _PermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_TD, row_index_N, K):
        ctx.K, ctx.T = K, x_TD.shape[0]
        ctx.save_for_backward(row_index_N)
        x_sorted_ND, _ = gather_rows(x_TD, row_index_N, K)
        return x_sorted_ND

    @staticmethod
    def backward(ctx, dx_sorted_ND):
        (row_index_N,) = ctx.saved_tensors
        inv_M = inverse_index(row_index_N, ctx.T * ctx.K)
        return combine_rows(dx_sorted_ND, inv_M, ctx.K), None, None


class _UnpermuteFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y_sorted_ND, row_index_N, weights_TK, num_tokens):
        T, K = weights_TK.shape
        w_M = weights_TK.reshape(-1).contiguous()
        inv_M = inverse_index(row_index_N, T * K)
        ctx.save_for_backward(y_sorted_ND, row_index_N, w_M)
        ctx.K, ctx.w_shape, ctx.w_dtype = K, weights_TK.shape, weights_TK.dtype
        return combine_rows(y_sorted_ND, inv_M, K, weights_M=w_M)

    @staticmethod
    def backward(ctx, dy_TD):
        y_sorted_ND, row_index_N, w_M = ctx.saved_tensors
        need_dy, _, need_dw, _ = ctx.needs_input_grad
        dy_sorted_ND, dw_M = gather_rows(
            dy_TD, row_index_N, ctx.K, scale_M=w_M,
            other_ND=y_sorted_ND if need_dw else None, out_dtype=y_sorted_ND.dtype,
        )
        dw_TK = dw_M.view(ctx.w_shape).to(ctx.w_dtype) if need_dw else None
        return (dy_sorted_ND if need_dy else None), None, dw_TK, None


def permute_triton(x_TD, expert_ids_TK, num_experts, num_routed=None):
    row_index_N, counts_E = compute_permutation(expert_ids_TK, num_experts, num_routed)
    x_sorted_ND = _PermuteFn.apply(x_TD, row_index_N, expert_ids_TK.shape[1])
    return x_sorted_ND, row_index_N, counts_E


def unpermute_triton(y_sorted_ND, row_index_N, weights_TK, num_tokens):
    return _UnpermuteFn.apply(y_sorted_ND, row_index_N, weights_TK, num_tokens)
