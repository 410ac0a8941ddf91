"""AdamW and the gradient norm over a whole list of tensors, one Triton launch each (math: `reference.py`).

Why: full fine-tuning keeps fp32 weights and lets the step's matmuls read a bf16 copy (train/copies.py), so the
gradients arrive in bf16 and each optimizer step must also write that copy. torch's fused AdamW takes neither a
bf16 gradient for an fp32 weight nor a second output. Here each step reads the gradient (2 bytes), the weight and
both moments (12) and writes them back (12) plus the bf16 copy (2): 28 bytes a parameter, where autocast's cast
of every weight (6), the cast of every gradient back to fp32 (6) and the fp32 AdamW (28) took 40. With the
moments in bf16 (`train.moment_dtype: bf16`, stochastically rounded: reference.py) a step moves 20 bytes; with
the weights in bf16 as well (`train.weight_dtype: bf16`: no fp32 weight, no copy; the weight stochastically
rounded too) 14; with the weights split (`train.weight_dtype: fp32_split`: the fp32 weight as its bf16 rounding,
which is the parameter, plus an int16 remainder in the optimizer state; reference.py) 26 with fp32 moments and 18
with bf16 ones, and the update is the fp32 one bit for bit.

How: the tensors stay where they are (the module's weights, autograd's gradients, the optimizer's state). A
`TensorBlocks` cuts their elements into BLOCK-sized pieces that never straddle two tensors; program i works on
tensor `tensor_id[i]` from element `start[i]`, and finds that tensor through an int64 table per role (weight,
gradient, moments, step count, copy): `TensorTable`, each tensor's element offset from an anchor tensor. Every
tensor must be contiguous (a weight or its copy may be a block of rows: TensorTable's row_blocks) and start on
a 16-element boundary (any allocation of the caching allocator does); whole blocks run unmasked, so their loads and stores are
16-byte vectors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..host import host_tensor, to_device

BLOCK = 4096  # elements per program: 2.9B parameters make ~0.7M programs, each a few 16-byte vectors per lane
NUM_WARPS = 4
# Elements a program updates at once, looping over its block (benchmarks/bench_adamw.py, one H100, ~0.9B
# parameters): with bf16 moments the whole block at once spills (255 registers on sm_90) and runs at 2.39 TB/s,
# 1024 at a time at 2.96 TB/s; with fp32 moments every step size is within 3% (2.85-2.98 TB/s), and the whole
# block keeps the update bit for bit torch's fused AdamW's, which the loop's code does not.
SUB_FP32_MOMENTS = BLOCK
SUB_BF16_MOMENTS = 1024


class TensorBlocks:
    """The block map of tensors with the given element counts: `tensor_id` [nb] int32 and `start` [nb] int64,
    on `device`. Made once per list of shapes (the optimizer keeps it)."""

    def __init__(self, numels: list[int], device: torch.device):
        per = [math.ceil(n / BLOCK) for n in numels]
        self.n_blocks = sum(per)
        ids = torch.repeat_interleave(torch.arange(len(numels), dtype=torch.int32), torch.tensor(per),
                                      output_size=self.n_blocks)
        first = torch.tensor([0] + per[:-1]).cumsum(0)  # each tensor's first block
        start = (torch.arange(self.n_blocks) - first[ids.long()]) * BLOCK
        self.tensor_id = to_device(ids, device)  # sent without waiting for the device, like every table here
        self.start = to_device(start, device)
        self.numel = host_tensor(numels, device)


ALIGN = 16  # elements: every tensor must start at a multiple of this from its table's anchor (vector loads)


class TensorTable:
    """Where a list of tensors of one dtype lie: an anchor tensor (the first; its address is a kernel argument,
    which Triton knows is 16-byte aligned) and each tensor's start as an element offset from it (int64 on the
    device), sent without waiting for the device. The offsets are multiples of ALIGN elements (the caching allocator aligns to 512 bytes), which the
    kernels assume so that their loads and stores are 16-byte vectors.

    row_blocks (weights and bf16 copies): a tensor may also be a block of rows of a bigger one (w1's weight or
    copy, the first F rows of each expert's [2F, L] in one gate/up buffer, train/copies.py): dim 0's slices each contiguous,
    `chunk` elements apart `stride`, with chunk a multiple of BLOCK so that no block straddles two. Element i of
    the tensor then lies at offset + (i // chunk) * stride + i % chunk; a contiguous tensor has stride = chunk."""

    def __init__(self, tensors: list[torch.Tensor], device: torch.device, row_blocks: bool = False):
        self.anchor = tensors[0]
        base, size = self.anchor.data_ptr(), self.anchor.element_size()
        offs, chunks, strides = [], [], []
        for t in tensors:
            chunk = stride = max(t.numel(), 1)
            if row_blocks and t.dim() > 1 and not t.is_contiguous() and t[0].is_contiguous():
                chunk, stride = t[0].numel(), t.stride(0)
                if chunk % BLOCK or stride < chunk or stride % ALIGN:
                    raise ValueError(f"a row block of shape {list(t.shape)}, strides {t.stride()}: each dim-0 slice "
                                     f"({chunk} elements) must be a whole number of {BLOCK}-element blocks, the "
                                     f"slices {ALIGN}-element aligned and apart by at least their size")
            elif not t.is_contiguous():
                raise ValueError(f"the multi-tensor AdamW needs contiguous tensors of one dtype; got one of shape "
                                 f"{list(t.shape)}, strides {t.stride()}, {t.dtype} next to {self.anchor.dtype}")
            if t.dtype != self.anchor.dtype:
                raise ValueError(f"the multi-tensor AdamW needs tensors of one dtype; got {t.dtype} next to "
                                 f"{self.anchor.dtype}")
            d = t.data_ptr() - base if t.numel() else 0  # no block reads an empty tensor (an empty FSDP2 shard)
            if d % (ALIGN * size):
                raise ValueError(f"the multi-tensor AdamW needs tensors that start on {ALIGN * size}-byte "
                                 f"boundaries; one of shape {list(t.shape)} starts at {t.data_ptr():#x} (a view into "
                                 "another tensor? give the parameter its own storage)")
            offs.append(d // size)
            chunks.append(chunk)
            strides.append(stride)
        self.offsets = host_tensor(offs, device)
        self.chunk = host_tensor(chunks, device)
        self.stride = host_tensor(strides, device)


@triton.jit
def _sq_sum_kernel(g_ptr, g_off, tid_ptr, start_ptr, numel_ptr, out_ptr, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(tid_ptr + pid)
    start = tl.multiple_of(tl.load(start_ptr + pid), BLOCK)
    n = tl.load(numel_ptr + t)
    g_ptr += tl.multiple_of(tl.load(g_off + t), ALIGN) + start
    idx = tl.arange(0, BLOCK)
    if start + BLOCK <= n:  # a whole block: unmasked, so the loads are vectors
        g = tl.load(g_ptr + idx).to(tl.float32)
    else:
        g = tl.load(g_ptr + idx, mask=start + idx < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(g * g, axis=0))


def grad_sq_sum(g_tab: TensorTable, blocks: TensorBlocks) -> torch.Tensor:
    """sum(g^2) over every tensor of the table (float32 accumulation): a float32 scalar on the device."""
    part = torch.empty(blocks.n_blocks, dtype=torch.float32, device=blocks.start.device)
    if blocks.n_blocks:
        _sq_sum_kernel[(blocks.n_blocks,)](g_tab.anchor, g_tab.offsets, blocks.tensor_id, blocks.start, blocks.numel,
                                          part, ALIGN=ALIGN, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return part.sum()


@triton.jit
def _hash32(x):
    """A bijective 32-bit integer hash of a uint32 tensor (`reference.hash32`)."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


@triton.jit
def _round_bf16(x, r):
    """fp32 x rounded to bf16 stochastically (`reference.stochastic_round_bf16`): r (uint32, < 2^16) added to the
    16 bits bf16 drops, which are then cut, so x rounds up in magnitude with probability equal to the dropped
    fraction. The cut value is a bf16 exactly, so the final cast is exact."""
    bits = (x.to(tl.uint32, bitcast=True) + r) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True).to(tl.bfloat16)


@triton.jit
def _join_fp32(hi, lo):
    """The fp32 weight of its bf16 high half and int16 remainder (`reference.join_fp32`)."""
    bits = (hi.to(tl.int16, bitcast=True).to(tl.int32) << 16) + lo.to(tl.int32)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _split_fp32(x):
    """fp32 x -> (bf16 rounded to nearest, ties away from zero; int16 remainder of the bit patterns), as
    `reference.split_fp32`."""
    bits = x.to(tl.int32, bitcast=True)
    hb = (bits + 0x8000) & -65536  # 0xFFFF0000
    lo = (bits - hb).to(tl.int16)
    return (hb >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True), lo


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, l_ptr, idx, mask, elem, key, scale_ptr, lr, beta1, beta2, eps,
                 decay, bc1, bc2_sqrt, HAS_SCALE: tl.constexpr, HAS_COPY: tl.constexpr, M_BF16: tl.constexpr,
                 P_BF16: tl.constexpr, P_SPLIT: tl.constexpr):
    # lanes outside the tensor (mask False) compute garbage that is never stored
    g = tl.load(g_ptr + idx, mask=mask).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    if P_SPLIT:  # the fp32 weight from its bf16 high half and int16 remainder
        p = _join_fp32(tl.load(p_ptr + idx, mask=mask), tl.load(l_ptr + idx, mask=mask))
    else:
        p = tl.load(p_ptr + idx, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + idx, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + idx, mask=mask).to(tl.float32)
    p = p * (1.0 - lr * decay)
    m = m + (1.0 - beta1) * (g - m)  # torch's lerp
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    r = 0
    if M_BF16 or (P_BF16 and not P_SPLIT):
        r = _hash32(elem.to(tl.uint32) ^ key)
    if P_SPLIT:  # split again: the exact fp32 weight
        hi, lo = _split_fp32(p)
        tl.store(p_ptr + idx, hi, mask=mask)
        tl.store(l_ptr + idx, lo, mask=mask)
    elif P_BF16:  # the weight kept in bf16, stochastically rounded
        tl.store(p_ptr + idx, _round_bf16(p, _hash32(r) & 0xFFFF), mask=mask)
    else:
        tl.store(p_ptr + idx, p, mask=mask)
    if M_BF16:  # the moments kept in bf16, stochastically rounded (the update above used them unrounded)
        tl.store(m_ptr + idx, _round_bf16(m, r & 0xFFFF), mask=mask)
        tl.store(v_ptr + idx, _round_bf16(v, r >> 16), mask=mask)
    else:
        tl.store(m_ptr + idx, m, mask=mask)
        tl.store(v_ptr + idx, v, mask=mask)
    if HAS_COPY:
        tl.store(c_ptr + idx, p.to(tl.bfloat16), mask=mask)


@triton.jit
def _row_block_offset(off_ptr, chunk_ptr, stride_ptr, t, start, ALIGN: tl.constexpr, BLOCK: tl.constexpr):
    """Element `start` of tensor t from its table's anchor: t may be a block of rows of a bigger tensor
    (TensorTable's row_blocks); its chunk is a multiple of BLOCK, or the whole tensor, so start % chunk is one too."""
    chunk = tl.load(chunk_ptr + t)
    rows = tl.multiple_of((start // chunk) * tl.load(stride_ptr + t), ALIGN)
    return tl.multiple_of(tl.load(off_ptr + t), ALIGN) + rows + tl.multiple_of(start % chunk, BLOCK)


@triton.jit(do_not_specialize=["seed"])
def _adamw_kernel(p_ptr, p_off, p_chunk, p_stride, g_ptr, g_off, m_ptr, m_off, v_ptr, v_off, step_ptr, step_off,
                  c_ptr, c_off, c_chunk, c_stride, l_ptr, l_off, tid_ptr, start_ptr, numel_ptr, scale_ptr, skip_ptr,
                  lr, beta1, beta2, log2_beta1, log2_beta2, eps, decay, seed,
                  HAS_SCALE: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_COPY: tl.constexpr, M_BF16: tl.constexpr,
                  P_BF16: tl.constexpr, P_SPLIT: tl.constexpr, ALIGN: tl.constexpr, BLOCK: tl.constexpr,
                  SUB: tl.constexpr):
    if HAS_SKIP:
        if tl.load(skip_ptr) != 0:  # the step is skipped: nothing changes
            return
    pid = tl.program_id(0)
    t = tl.load(tid_ptr + pid)
    start = tl.multiple_of(tl.load(start_ptr + pid), BLOCK)
    n = tl.load(numel_ptr + t)
    p_ptr += _row_block_offset(p_off, p_chunk, p_stride, t, start, ALIGN, BLOCK)  # (TensorTable's row_blocks)
    g_ptr += tl.multiple_of(tl.load(g_off + t), ALIGN) + start
    m_ptr += tl.multiple_of(tl.load(m_off + t), ALIGN) + start
    v_ptr += tl.multiple_of(tl.load(v_off + t), ALIGN) + start
    if HAS_COPY:
        c_ptr += _row_block_offset(c_off, c_chunk, c_stride, t, start, ALIGN, BLOCK)
    if P_SPLIT:
        l_ptr += tl.multiple_of(tl.load(l_off + t), ALIGN) + start
    step = tl.load(step_ptr + tl.load(step_off + t))  # this step's count (1 on the first)
    bc1 = 1.0 - tl.exp2(step * log2_beta1)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))
    key = 0
    # the stochastic rounding's random bits: a hash of (seed, tensor, step), then the element's index
    if M_BF16 or (P_BF16 and not P_SPLIT):
        key = _hash32(_hash32(t.to(tl.uint32) ^ seed.to(tl.uint32)) ^ step.to(tl.uint32))
    # the block in SUB-element pieces, one after another (SUB_FP32_MOMENTS / SUB_BF16_MOMENTS say why)
    for i in range(0, BLOCK, SUB):
        idx = i + tl.arange(0, SUB)
        elem = start + idx
        if start + BLOCK <= n:  # a whole block: unmasked, so the loads and stores are vectors
            _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, l_ptr, idx, None, elem, key, scale_ptr, lr, beta1,
                         beta2, eps, decay, bc1, bc2_sqrt, HAS_SCALE, HAS_COPY, M_BF16, P_BF16, P_SPLIT)
        else:
            _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, l_ptr, idx, elem < n, elem, key, scale_ptr, lr, beta1,
                         beta2, eps, decay, bc1, bc2_sqrt, HAS_SCALE, HAS_COPY, M_BF16, P_BF16, P_SPLIT)


def adamw_(tabs: dict[str, TensorTable], blocks: TensorBlocks, *, lr: float,
           betas: tuple[float, float], eps: float, weight_decay: float, grad_scale: torch.Tensor | None = None,
           found_inf: torch.Tensor | None = None, seed: int = 0, sub: int | None = None,
           num_warps: int = NUM_WARPS) -> None:
    """One AdamW step in place over the tensors of `tabs` ("p", "g", "m", "v", "step": weights in fp32 or bf16,
    gradients in any float dtype, moments in fp32 or bf16 (both the same), fp32 step counts already advanced to
    this step; "c": optional bf16 copies of fp32 weights, written from the new weights; "lo": optional int16
    remainders of bf16 weights, which then hold fp32 weights split in two: `reference.split_fp32`). Weights and
    copies may be row blocks (TensorTable's row_blocks). grad_scale (device scalar): every gradient is divided by
    it; found_inf (device scalar): nonzero skips the whole step. bf16 moments and bf16 weights without a remainder
    are stored stochastically rounded, their random bits drawn from `seed`, the tensor's index and its step count
    (`reference.moment_bits`, `reference.weight_bits`): the same inputs give the same result.
    sub: elements per loop step of a program (a power of two dividing BLOCK; default SUB_FP32_MOMENTS or
    SUB_BF16_MOMENTS, the latter for bf16 moments and stochastically rounded bf16 weights); num_warps: the
    launch's warps (NUM_WARPS)."""
    if not blocks.n_blocks:
        return
    b1, b2 = betas
    p, c = tabs["p"], tabs.get("c")
    m_dtype, p_dtype = tabs["m"].anchor.dtype, p.anchor.dtype
    if m_dtype not in (torch.float32, torch.bfloat16) or tabs["v"].anchor.dtype != m_dtype:
        raise ValueError(f"AdamW moments must both be float32 or both bfloat16; got {m_dtype} and "
                         f"{tabs['v'].anchor.dtype}")
    if p_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"AdamW weights must be float32 or bfloat16; got {p_dtype}")
    if c is not None and p_dtype != torch.float32:
        raise ValueError("a bf16 copy is made of fp32 weights; these weights are bf16 already (drop the copies)")
    lo = tabs.get("lo")
    if lo is not None and (p_dtype != torch.bfloat16 or lo.anchor.dtype != torch.int16):
        raise ValueError(f"split weights are a bf16 high half and an int16 remainder; got {p_dtype} and "
                         f"{lo.anchor.dtype}")
    c = c if c is not None else p
    lt = lo if lo is not None else p  # an unread pointer without split weights
    if sub is None:  # split weights with fp32 moments: the fp32 weights' code, whose update they reproduce
        low = m_dtype == torch.bfloat16 or (p_dtype == torch.bfloat16 and lo is None)
        sub = SUB_BF16_MOMENTS if low else SUB_FP32_MOMENTS
    _adamw_kernel[(blocks.n_blocks,)](
        p.anchor, p.offsets, p.chunk, p.stride, tabs["g"].anchor, tabs["g"].offsets, tabs["m"].anchor,
        tabs["m"].offsets, tabs["v"].anchor, tabs["v"].offsets, tabs["step"].anchor, tabs["step"].offsets,
        c.anchor, c.offsets, c.chunk, c.stride, lt.anchor, lt.offsets,
        blocks.tensor_id, blocks.start, blocks.numel,
        p.anchor if grad_scale is None else grad_scale, p.anchor if found_inf is None else found_inf,
        float(lr), float(b1), float(b2), math.log2(b1) if b1 > 0 else -math.inf,
        math.log2(b2) if b2 > 0 else -math.inf, float(eps), float(weight_decay), seed & 0x7FFFFFFF,
        HAS_SCALE=grad_scale is not None, HAS_SKIP=found_inf is not None, HAS_COPY="c" in tabs,
        M_BF16=m_dtype == torch.bfloat16, P_BF16=p_dtype == torch.bfloat16, P_SPLIT=lo is not None, ALIGN=ALIGN,
        BLOCK=BLOCK, SUB=sub,
        num_warps=num_warps)
