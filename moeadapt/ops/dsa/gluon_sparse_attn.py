"""Warp-specialised SFA kernels for Hopper (sm_90), written in Gluon (Triton's explicit-layout dialect):
the forward, and pass 1 (P and dS) of the P/dS backward.

Same contracts as `triton_sparse_attn.sfa_forward` and its `_sfa_bwd_pds_kernel`, for the MLA shape only: bf16,
one KV head, D = 576 (512 latent + 64 rope), DV = 512 with ``v = kv[..., :512]``, a multiple of 64 query heads.
`supported()` says when they apply; everything else (and every CPU run) uses the Triton kernels.
The backward pass 1 is described at `_sfa_bwd_p1_ws_kernel`; the forward below.

Why a second kernel: the Triton forward reaches ~295 TFLOP/s on the H200 and is stuck at the register
limit. Its 8 warps split every product along N, so both warp groups read all of Q for
S = Q K^T (N = 32 per group), and the gathers, softmax and MMAs of one program run one after the other.
Here one CTA (one query row, 64 heads) has three warp groups:

- producer (4 warps): cp.async gathers of the selected K rows (64 keys x 576) into two buffers,
  one per consumer, completion signalled on mbarriers; Q once.
- consumer c = 0, 1 (4 warps each): takes key blocks 2i + c, computes S = Q K^T for its block
  (M = 64 heads, N = 64 keys: a full-width wgmma), and owns half of the output, O[:, 256c : 256c + 256].
  Per pair of blocks the two consumers swap their row maxima (so both use the same running max),
  each writes its P (bf16) into its block's rope buffer (free once S is done) and both add
  P_0 V_0[:, half] + P_1 V_1[:, half] to their half of O. The row sums are added at the end.

The buffers are released by halves of the channels: consumer c frees half c of its own block right after
its first P V product and half c of the other block (with the rope part, which holds that block's P) after
its second. The producer refills the halves in that order, and a consumer starts S on its own half while
the other half is still in flight (3% faster than releasing whole buffers on the H200).

Keys past the row's last valid slot are never walked (the causal ramp t < topk); -1 slots are
gathered as zero rows and masked to -inf in S. lse is saved in natural log, as the Triton kernel does.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

# Triton 3.9 renamed the cp.async copy to async_load (the old name stays as an alias).
_cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared
# ... and thread_barrier to barrier (a bar.sync of the calling warp group inside a partition).
_sync = getattr(gl, "barrier", None) or gl.thread_barrier

BLOCK_H = 64  # query heads per CTA (the wgmma M of one warp group); the forward walks 64-key blocks
D1, D2, DV = 512, 64, 512
# mbarrier slots: Q ready; K ready [buffer w, half h] (at 2w + h); K free [w, h]; row max / row sum posted by
# consumer c; P posted by consumer c
_Q, _READY, _FREE, _MAX, _P = gl.constexpr(0), gl.constexpr(1), gl.constexpr(5), gl.constexpr(9), gl.constexpr(11)
# setmaxnreg per warp group: 2 * 128 * 232 + 128 * 40 <= 65536 registers of an SM
CONSUMER_REGS, PRODUCER_REGS = gl.constexpr(232), gl.constexpr(40)


@gluon.jit
def _key_ptrs(kb, idx_row, slot, offs_c, TOPK, sk_t):
    """Pointers to channels 0..63 of the key rows named by index slots `slot` (-1 slots: row 0, masked)."""
    ix = gl.load(idx_row + slot, mask=slot < TOPK, other=-1)
    valid = (ix >= 0)[:, None] & (offs_c[None, :] >= 0)
    return kb + gl.where(ix >= 0, ix, 0)[:, None] * sk_t + offs_c[None, :], valid


@gluon.jit
def _gather_half(k1_s, k2_s, bars, kb, idx_row, blk, offs_c, i, TOPK, sk_t, w: gl.constexpr, h: gl.constexpr):
    """Channels 256h..256h+255 of block 2i + w into buffer w, once consumer h has freed them. The rope
    part (later P_w) goes with the half the other consumer frees, so h != w also gathers it."""
    mbarrier.wait(bars.index(_FREE + 2 * w + h), (i + 1) & 1, pred=i > 0)
    kp, valid = _key_ptrs(kb, idx_row, blk + w * 64, offs_c, TOPK, sk_t)
    for c in gl.static_range(4):
        _cp_async(k1_s.index(w).slice((4 * h + c) * 64, 64, dim=1), kp + (4 * h + c) * 64, mask=valid)
    if h != w:
        _cp_async(k2_s.index(w), kp + 512, mask=valid)
    async_copy.mbarrier_arrive(bars.index(_READY + 2 * w + h), increment_count=False)


@gluon.jit
def _load_q(Q, q1_s, q2_s, bars, row, h0, sq_t, sq_h, offs_r, offs_c):
    """Q [64 heads, 576] of this row into shared memory, completion on the _Q barrier."""
    qp = Q + row * sq_t + (h0 + offs_r)[:, None] * sq_h + offs_c[None, :]
    for c in gl.static_range(8):
        _cp_async(q1_s.slice(c * 64, 64, dim=1), qp + c * 64)
    _cp_async(q2_s, qp + 512)
    async_copy.mbarrier_arrive(bars.index(_Q), increment_count=False)


@gluon.jit
def _row_span(IDX, row, si_t, TOPK, TOPK_P2: gl.constexpr):
    """Last valid slot + 1 of an index row (the causal ramp t < topk walks fewer blocks)."""
    SPAN_L: gl.constexpr = gl.BlockedLayout([TOPK_P2 // 128], [32], [4], [0])
    offs = gl.arange(0, TOPK_P2, layout=SPAN_L)
    ix = gl.load(IDX + row * si_t + offs, mask=offs < TOPK, other=-1)
    return gl.max(gl.where(ix >= 0, offs + 1, 0), axis=0)


@gluon.jit
def _producer(Q, K, IDX, q1_s, q2_s, k1_s, k2_s, bars, row, h0, kb_off, n_pairs, TOPK, sq_t, sq_h, sk_t, si_t):
    """Gather Q once, then the selected K rows of blocks 2i (buffer 0) and 2i + 1 (buffer 1)."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])  # [64, 64] tile, 16 B per cp.async
    offs_r = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    offs_c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    _load_q(Q, q1_s, q2_s, bars, row, h0, sq_t, sq_h, offs_r, offs_c)
    idx_row = IDX + row * si_t
    kb = K + kb_off
    for i in range(n_pairs):  # each consumer frees its own block's half first: gather those first
        blk = 2 * i * 64 + offs_r
        _gather_half(k1_s, k2_s, bars, kb, idx_row, blk, offs_c, i, TOPK, sk_t, 0, 0)
        _gather_half(k1_s, k2_s, bars, kb, idx_row, blk, offs_c, i, TOPK, sk_t, 1, 1)
        _gather_half(k1_s, k2_s, bars, kb, idx_row, blk, offs_c, i, TOPK, sk_t, 0, 1)
        _gather_half(k1_s, k2_s, bars, kb, idx_row, blk, offs_c, i, TOPK, sk_t, 1, 0)


@gluon.jit
def _consumer(IDX, O, LSE, q1_s, q2_s, k1_s, k2_s, x_s, bars, row, h0, n_pairs, TOPK, qk_scale, si_t, so_t, so_h,
              sl_t, W: gl.constexpr):
    """Blocks 2i + W: S = Q K^T, the shared online softmax, O[:, W half] += P_0 V_0 + P_1 V_1."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    P_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    ROW_O: gl.constexpr = gl.SliceLayout(1, O_L)
    U: gl.constexpr = 1 - W  # the other consumer
    m_i = gl.full([64], -1.0e30, gl.float32, ROW_S)
    l_i = gl.zeros([64], gl.float32, ROW_S)
    acc = gl.zeros([64, 256], gl.float32, O_L)
    offs_k = gl.arange(0, 64, layout=gl.SliceLayout(0, S_L))
    idx_row = IDX + row * si_t
    mbarrier.wait(bars.index(_Q), 0)
    for i in range(n_pairs):
        ph = i & 1
        # S over this consumer's own half of the channels while the rest may still be arriving
        mbarrier.wait(bars.index(_READY + 3 * W), ph)
        s = hopper.warpgroup_mma(q1_s.slice(W * 256, 256, dim=1), k1_s.index(W).slice(W * 256, 256, dim=1).permute((1, 0)),
                                 gl.zeros([64, 64], gl.float32, S_L), use_acc=False)
        mbarrier.wait(bars.index(_READY + 2 * W + U), ph)
        s = hopper.warpgroup_mma(q1_s.slice(U * 256, 256, dim=1), k1_s.index(W).slice(U * 256, 256, dim=1).permute((1, 0)), s)
        s = hopper.warpgroup_mma(q2_s, k2_s.index(W).permute((1, 0)), s)
        slot = (2 * i + W) * 64 + offs_k
        ix = gl.load(idx_row + slot, mask=slot < TOPK, other=-1)
        s = gl.where((ix >= 0)[None, :], s * qk_scale, float("-inf"))
        # both consumers use max(m_i, rowmax S_0, rowmax S_1)
        rm = gl.max(s, axis=1)
        x_s.index(W).store(rm)
        _sync()
        mbarrier.arrive(bars.index(_MAX + W))
        mbarrier.wait(bars.index(_MAX + U), ph)
        m_new = gl.maximum(m_i, gl.maximum(rm, x_s.index(U).load(ROW_S)))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + gl.sum(p, axis=1)
        acc = acc * gl.convert_layout(alpha, ROW_O)[:, None]
        p16 = p.to(gl.bfloat16)
        # P into this block's rope buffer (S is done with it) for the other consumer
        k2_s.index(W).store(p16)
        hopper.fence_async_shared()
        _sync()
        mbarrier.arrive(bars.index(_P + W))
        acc = hopper.warpgroup_mma(gl.convert_layout(p16, P_L), k1_s.index(W).slice(W * 256, 256, dim=1), acc,
                                   is_async=True)
        mbarrier.wait(bars.index(_P + U), ph)
        acc = hopper.warpgroup_mma(k2_s.index(U), k1_s.index(U).slice(W * 256, 256, dim=1), acc, is_async=True)
        # own block's half W is free after the first product, the other block's half W (and P_U) after both
        acc = hopper.warpgroup_mma_wait(1, deps=[acc])
        _sync()
        mbarrier.arrive(bars.index(_FREE + 3 * W))
        acc = hopper.warpgroup_mma_wait(0, deps=[acc])
        _sync()
        mbarrier.arrive(bars.index(_FREE + 2 * U + W))
        m_i = m_new
    # row sums: each consumer summed its own blocks (against the same running max)
    x_s.index(W).store(l_i)
    _sync()
    mbarrier.arrive(bars.index(_MAX + W))
    mbarrier.wait(bars.index(_MAX + U), n_pairs & 1)
    l_tot = l_i + x_s.index(U).load(ROW_S)
    has = l_tot > 0
    inv = gl.where(has, 1.0 / gl.where(has, l_tot, 1.0), 0.0)
    o = acc * gl.convert_layout(inv, ROW_O)[:, None]
    offs_h = gl.arange(0, 64, layout=ROW_O)
    offs_d = gl.arange(0, 256, layout=gl.SliceLayout(0, O_L))
    gl.store(O + row * so_t + (h0 + offs_h)[:, None] * so_h + W * 256 + offs_d[None, :], o.to(gl.bfloat16))
    if W == 0:
        lse = gl.where(has, (m_i + gl.log2(gl.where(has, l_tot, 1.0))) * 0.6931471805599453, float("-inf"))
        gl.store(LSE + row * sl_t + h0 + gl.arange(0, 64, layout=ROW_S), lse)


@gluon.jit
def _sfa_fwd_ws_kernel(Q, K, IDX, O, LSE, sq_t, sq_h, sk_b, sk_t, si_t, so_t, so_h, sl_t, T, TOPK, NHB, qk_scale,
                       TOPK_P2: gl.constexpr):
    pid = gl.program_id(0)
    n_rows = gl.num_programs(0) // NHB
    row = (n_rows - 1 - pid // NHB).to(gl.int64)  # full rows (t >= topk) first; the head blocks of a row adjacent
    h0 = (pid % NHB) * 64
    kb_off = (row // T) * sk_b
    n_pairs = (_row_span(IDX, row, si_t, TOPK, TOPK_P2) + 127) // 128  # walk only up to the last valid slot

    KL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q1_s = gl.allocate_shared_memory(gl.bfloat16, [64, 512], KL)
    q2_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], KL)
    k1_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 512], KL)
    k2_s = gl.allocate_shared_memory(gl.bfloat16, [2, 64, 64], KL)
    x_s = gl.allocate_shared_memory(gl.float32, [2, 64], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    bars = gl.allocate_shared_memory(gl.int64, [13, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(_Q), count=128)  # one cp.async arrive per producer thread
    for j in gl.static_range(4):
        mbarrier.init(bars.index(_READY + j), count=128)
        mbarrier.init(bars.index(_FREE + j), count=1)  # the consumer that last reads that half
    for j in gl.static_range(4):
        mbarrier.init(bars.index(_MAX + j), count=1)
    gl.warp_specialize(
        [
            (_consumer, (IDX, O, LSE, q1_s, q2_s, k1_s, k2_s, x_s, bars, row, h0, n_pairs, TOPK, qk_scale, si_t,
                         so_t, so_h, sl_t, 0)),
            (_consumer, (IDX, O, LSE, q1_s, q2_s, k1_s, k2_s, x_s, bars, row, h0, n_pairs, TOPK, qk_scale, si_t,
                         so_t, so_h, sl_t, 1)),
            (_producer, (Q, K, IDX, q1_s, q2_s, k1_s, k2_s, bars, row, h0, kb_off, n_pairs, TOPK, sq_t, sq_h,
                         sk_t, si_t)),
        ],
        [4, 4],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor) -> bool:
    """The shapes and devices these kernels are written for (else the Triton kernels run)."""
    if not (q.is_cuda and torch.cuda.get_device_capability(q.device) == (9, 0)):
        return False
    B, T, HQ, D = q.shape
    return (
        q.dtype == k.dtype == torch.bfloat16 and D == D1 + D2 and k.shape[2] == 1 and v.shape[-1] == DV
        and HQ % BLOCK_H == 0 and v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
        and k.stride(-1) == 1 and indices.shape[-1] <= 8192
        and max(T, k.shape[1]) * k.stride(1) < 2**31  # key row offsets are int32 inside one sequence
        # 16-byte cp.async: aligned bases, strides Triton specialises as multiples of 16 elements
        # (q is made contiguous: [.., 576] rows; a copy is aligned)
        and k.data_ptr() % 16 == 0 and k.stride(0) % 16 == 0 and k.stride(1) % 16 == 0
        and (q.data_ptr() % 16 == 0 or not q.is_contiguous())
    )


def sfa_forward_ws(q, k, indices, scale):
    """o [B, T, HQ, 512], lse [B, T, HQ] (natural log) of sparse attention with v = k[..., :512]."""
    B, T, HQ, D = q.shape
    q = q.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    idx = indices.reshape(B, T, indices.shape[-1]).contiguous()
    topk = idx.shape[-1]
    o = torch.empty(B, T, HQ, DV, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, T, HQ, device=q.device, dtype=torch.float32)
    nhb = HQ // BLOCK_H
    _sfa_fwd_ws_kernel[(B * T * nhb,)](
        q, k, idx, o, lse, q.stride(1), q.stride(2), k.stride(0), k.stride(1), idx.stride(1),
        o.stride(1), o.stride(2), lse.stride(1), T, topk, nhb, scale * 1.4426950408889634,
        TOPK_P2=max(128, triton.next_power_of_2(topk)), num_warps=4,
    )
    return o, lse


# ------------------------------------------------------------------ backward pass 1 (P and dS)
P1_BK = gl.constexpr(32)  # keys per block: Q, dO and two K buffers fit in shared memory (72 + 64 + 2 x 36 KB)


@gluon.jit
def _p1_producer(Q, K, IDX, DO, q1_s, q2_s, do_s, k1_s, k2_s, bars, row, h0, kb_off, n_blocks, TOPK, sq_t, sq_h,
                 so_t, so_h, sk_t, si_t):
    """Q and dO once, then block j's selected K rows into buffer j % 2 (consumer j % 2's) once that one freed it."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs_r = gl.arange(0, 64, layout=gl.SliceLayout(1, L))
    offs_c = gl.arange(0, 64, layout=gl.SliceLayout(0, L))
    dp_ = DO + row * so_t + (h0 + offs_r)[:, None] * so_h + offs_c[None, :]
    for c in gl.static_range(8):
        _cp_async(do_s.slice(c * 64, 64, dim=1), dp_ + c * 64)
    _load_q(Q, q1_s, q2_s, bars, row, h0, sq_t, sq_h, offs_r, offs_c)  # its arrive covers dO's copies too
    offs_b = gl.arange(0, P1_BK, layout=gl.SliceLayout(1, L))
    idx_row = IDX + row * si_t
    kb = K + kb_off
    for j in range(n_blocks):
        w = j % 2
        n = j // 2
        mbarrier.wait(bars.index(_FREE + w), (n + 1) & 1, pred=n > 0)
        kp, valid = _key_ptrs(kb, idx_row, j * P1_BK + offs_b, offs_c, TOPK, sk_t)
        for c in gl.static_range(8):
            _cp_async(k1_s.index(w).slice(c * 64, 64, dim=1), kp + c * 64, mask=valid)
        _cp_async(k2_s.index(w), kp + 512, mask=valid)
        async_copy.mbarrier_arrive(bars.index(_READY + w), increment_count=False)


@gluon.jit
def _p1_consumer(IDX, O, DO, LSE, P_, DS_, q1_s, q2_s, do_s, k1_s, k2_s, bars, row, local, h0, n_blocks, TOPK,
                 qk_scale, scale, si_t, so_t, so_h, sl_t, sp_t, sp_h, W: gl.constexpr):
    """Blocks j = W, W + 2, ...: S = Q K^T, dP = dO V^T, P = exp2(S - lse), dS = P (dP - delta) * scale (bf16)."""
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 32, 16])
    ROW_S: gl.constexpr = gl.SliceLayout(1, S_L)
    COL_S: gl.constexpr = gl.SliceLayout(0, S_L)
    # delta = rowsum(dO * O) per head, 128 channels at a time
    B_L: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    offs_hb = gl.arange(0, 64, layout=gl.SliceLayout(1, B_L))
    offs_db = gl.arange(0, 128, layout=gl.SliceLayout(0, B_L))
    o_off = row * so_t + (h0 + offs_hb)[:, None] * so_h + offs_db[None, :]
    delta = gl.zeros([64], gl.float32, gl.SliceLayout(1, B_L))
    for c in gl.static_range(4):
        delta += gl.sum(gl.load(DO + o_off + c * 128).to(gl.float32) * gl.load(O + o_off + c * 128).to(gl.float32), 1)
    delta = gl.convert_layout(delta, ROW_S)
    offs_h = gl.arange(0, 64, layout=ROW_S)
    lse2 = gl.load(LSE + row * sl_t + h0 + offs_h) * 1.4426950408889634
    offs_k = gl.arange(0, P1_BK, layout=COL_S)
    idx_row = IDX + row * si_t
    st_base = local * sp_t + (h0 + offs_h)[:, None] * sp_h
    mbarrier.wait(bars.index(_Q), 0)
    for n in range((n_blocks - W + 1) // 2):
        j = 2 * n + W
        mbarrier.wait(bars.index(_READY + W), n & 1)
        kt = k1_s.index(W).permute((1, 0))
        zero = gl.zeros([64, P1_BK], gl.float32, S_L)
        s = hopper.warpgroup_mma(q1_s, kt, zero, use_acc=False, is_async=True)
        s = hopper.warpgroup_mma(q2_s, k2_s.index(W).permute((1, 0)), s, is_async=True)
        dp = hopper.warpgroup_mma(do_s, kt, zero, use_acc=False, is_async=True)
        s, dp = hopper.warpgroup_mma_wait(0, deps=[s, dp])
        _sync()
        mbarrier.arrive(bars.index(_FREE + W))  # the producer refills while P and dS are formed
        slot = j * P1_BK + offs_k
        ix = gl.load(idx_row + slot, mask=slot < TOPK, other=-1)
        p = gl.where((ix >= 0)[None, :], gl.exp2(s * qk_scale - lse2[:, None]), 0.0)
        ds = p * (dp - delta[:, None]) * scale
        st = st_base + slot[None, :]
        st_mask = (slot < TOPK)[None, :] & (offs_h >= 0)[:, None]
        gl.store(P_ + st, p.to(gl.bfloat16), mask=st_mask)
        gl.store(DS_ + st, ds.to(gl.bfloat16), mask=st_mask)


@gluon.jit
def _sfa_bwd_p1_ws_kernel(Q, K, IDX, O, DO, LSE, P_, DS_, sq_t, sq_h, sk_b, sk_t, si_t, so_t, so_h, sl_t, sp_t, sp_h,
                          T, TOPK, NHB, ROW0, NROWS, qk_scale, scale, TOPK_P2: gl.constexpr):
    """P/dS backward, pass 1, for rows ROW0 .. ROW0 + NROWS (the chunk the P/dS buffers hold). One CTA per
    (row, 64 heads): a producer gathers 32-key K blocks into two buffers (Q and dO stay in shared memory: 72 + 64
    + 2 x 36 KB); consumer c takes blocks c, c + 2, ... with no exchange: S = Q K^T, dP = dO V^T (N = 32 wgmmas),
    frees the buffer, then P = exp2(S - lse) and dS = P (dP - delta) * scale go to global memory in bf16.
    1.23-1.29x the Triton pass 1 at T = 32768 on the H200; holding dO in registers with 64-key blocks spilled."""
    pid = gl.program_id(0)
    local = (NROWS - 1 - pid // NHB).to(gl.int64)  # full rows first
    row = ROW0 + local
    h0 = (pid % NHB) * 64
    kb_off = (row // T) * sk_b
    n_blocks = (_row_span(IDX, row, si_t, TOPK, TOPK_P2) + P1_BK - 1) // P1_BK
    KL: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    q1_s = gl.allocate_shared_memory(gl.bfloat16, [64, 512], KL)
    q2_s = gl.allocate_shared_memory(gl.bfloat16, [64, 64], KL)
    do_s = gl.allocate_shared_memory(gl.bfloat16, [64, 512], KL)
    k1_s = gl.allocate_shared_memory(gl.bfloat16, [2, P1_BK, 512], KL)
    k2_s = gl.allocate_shared_memory(gl.bfloat16, [2, P1_BK, 64], KL)
    bars = gl.allocate_shared_memory(gl.int64, [13, 1], mbarrier.MBarrierLayout())
    mbarrier.init(bars.index(_Q), count=128)
    for j in gl.static_range(2):
        mbarrier.init(bars.index(_READY + j), count=128)
        mbarrier.init(bars.index(_FREE + j), count=1)
    gl.warp_specialize(
        [
            (_p1_consumer, (IDX, O, DO, LSE, P_, DS_, q1_s, q2_s, do_s, k1_s, k2_s, bars, row, local, h0, n_blocks,
                            TOPK, qk_scale, scale, si_t, so_t, so_h, sl_t, sp_t, sp_h, 0)),
            (_p1_consumer, (IDX, O, DO, LSE, P_, DS_, q1_s, q2_s, do_s, k1_s, k2_s, bars, row, local, h0, n_blocks,
                            TOPK, qk_scale, scale, si_t, so_t, so_h, sl_t, sp_t, sp_h, 1)),
            (_p1_producer, (Q, K, IDX, DO, q1_s, q2_s, do_s, k1_s, k2_s, bars, row, h0, kb_off, n_blocks, TOPK,
                            sq_t, sq_h, so_t, so_h, sk_t, si_t)),
        ],
        [4, 4],
        [CONSUMER_REGS, PRODUCER_REGS],
    )


def pds_pass1_ws(q, k, idx, o, do, lse, p_buf, ds_buf, scale, row0, n):
    """Pass 1 of the P/dS backward for rows [row0, row0 + n) into p_buf / ds_buf [n', HQ, topk] (n' >= n);
    q, k, idx, o, do, lse as `triton_sparse_attn._backward_pds` holds them (q, o, do contiguous; idx [B, T, 1, topk]
    or [B, T, topk]). Writes slots [0, P1_BK * ceil(span / P1_BK)) of each row, P = dS = 0 at -1 slots."""
    B, T, HQ, _ = q.shape
    topk = idx.shape[-1]
    idx = idx.reshape(B, T, topk)
    nhb = HQ // BLOCK_H
    _sfa_bwd_p1_ws_kernel[(n * nhb,)](
        q, k, idx, o, do, lse, p_buf, ds_buf, q.stride(1), q.stride(2), k.stride(0), k.stride(1), idx.stride(1),
        do.stride(1), do.stride(2), lse.stride(1), p_buf.stride(0), p_buf.stride(1),
        T, topk, nhb, row0, n, scale * 1.4426950408889634, scale,
        TOPK_P2=max(128, triton.next_power_of_2(topk)), num_warps=4,
    )


def compile_sm90(name: str):
    """Compile "fwd" or "bwd_p1" ahead of time for sm_90 (no GPU needed) with the signature a launch at the
    issue's shapes gets: bf16 / int32 / fp32 pointers, 16-byte alignment and the strides supported() requires
    divisible by 16 (the 16-byte cp.async copies need them), topk = 2048. Used by tests/ops/test_dsa_gluon.py;
    the interpreter cannot run Gluon, so call it with TRITON_INTERPRET unset."""
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    fn = {"fwd": _sfa_fwd_ws_kernel, "bwd_p1": _sfa_bwd_p1_ws_kernel}[name]
    ptrs = dict(Q="*bf16", K="*bf16", IDX="*i32", O="*bf16", DO="*bf16", LSE="*fp32", P_="*bf16", DS_="*bf16")
    div = ("sq_t", "sq_h", "sk_t", "sk_b", "so_t", "so_h")
    sig = {n: "constexpr" if n == "TOPK_P2" else ptrs.get(n, "fp32" if n in ("qk_scale", "scale") else "i32")
           for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names if n in ptrs or n in div}
    src = GluonASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index("TOPK_P2"),): 2048}, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})
