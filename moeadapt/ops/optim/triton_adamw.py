"""AdamW and the gradient norm over a whole list of tensors, one Triton launch each (math: `reference.py`).

Why: full fine-tuning keeps fp32 weights and lets the step's matmuls read a bf16 copy (train/copies.py), so the
gradients arrive in bf16 and each optimizer step must also write that copy. torch's fused AdamW takes neither a
bf16 gradient for an fp32 weight nor a second output. Here each step reads the gradient (2 bytes), the weight and
both moments (12) and writes them back (12) plus the bf16 copy (2): 28 bytes a parameter, where autocast's cast
of every weight (6), the cast of every gradient back to fp32 (6) and the fp32 AdamW (28) took 40.

How: the tensors stay where they are (the module's weights, autograd's gradients, the optimizer's state). A
`TensorBlocks` cuts their elements into BLOCK-sized pieces that never straddle two tensors; program i works on
tensor `tensor_id[i]` from element `start[i]`, and finds that tensor through int64 tables of addresses
(`ptr_table`), one per role (weight, gradient, moments, step count, copy). Every tensor must be contiguous.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..host import host_tensor

BLOCK = 4096  # elements per program: 2.9B parameters make ~0.7M programs, each a few 16-byte vectors per lane
NUM_WARPS = 4


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
        self.tensor_id = ids.to(device)
        self.start = start.to(device)
        self.numel = host_tensor(numels, device)


def ptr_table(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The tensors' addresses as an int64 tensor on `device` (sent without waiting for the device)."""
    for t in tensors:
        if not t.is_contiguous():
            raise ValueError(f"the multi-tensor AdamW needs contiguous tensors; got one of shape {list(t.shape)} "
                             f"with strides {t.stride()}")
    return host_tensor([t.data_ptr() for t in tensors], device)


@triton.jit
def _sq_sum_kernel(g_tab, tid_ptr, start_ptr, numel_ptr, out_ptr, G_DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    t = tl.load(tid_ptr + pid)
    offs = tl.load(start_ptr + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numel_ptr + t)
    g_base = tl.load(g_tab + t).to(tl.pointer_type(G_DTYPE))
    g = tl.load(g_base + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(g * g, axis=0))


def grad_sq_sum(g_tab: torch.Tensor, blocks: TensorBlocks, grad_dtype: torch.dtype) -> torch.Tensor:
    """sum(g^2) over every tensor of the table (float32 accumulation): a float32 scalar on the device."""
    part = torch.empty(blocks.n_blocks, dtype=torch.float32, device=blocks.start.device)
    if blocks.n_blocks:
        _sq_sum_kernel[(blocks.n_blocks,)](g_tab, blocks.tensor_id, blocks.start, blocks.numel, part,
                                          G_DTYPE=_TL[grad_dtype], BLOCK=BLOCK, num_warps=NUM_WARPS)
    return part.sum()


@triton.jit
def _adamw_kernel(p_tab, g_tab, m_tab, v_tab, step_tab, c_tab, tid_ptr, start_ptr, numel_ptr, scale_ptr, skip_ptr,
                  lr, beta1, beta2, log2_beta1, log2_beta2, eps, decay,
                  G_DTYPE: tl.constexpr, HAS_SCALE: tl.constexpr, HAS_SKIP: tl.constexpr, HAS_COPY: tl.constexpr,
                  BLOCK: tl.constexpr):
    if HAS_SKIP:
        if tl.load(skip_ptr) != 0:  # the step is skipped: nothing changes
            return
    pid = tl.program_id(0)
    t = tl.load(tid_ptr + pid)
    offs = tl.load(start_ptr + pid) + tl.arange(0, BLOCK)
    mask = offs < tl.load(numel_ptr + t)
    p_base = tl.load(p_tab + t).to(tl.pointer_type(tl.float32))
    g_base = tl.load(g_tab + t).to(tl.pointer_type(G_DTYPE))
    m_base = tl.load(m_tab + t).to(tl.pointer_type(tl.float32))
    v_base = tl.load(v_tab + t).to(tl.pointer_type(tl.float32))
    step = tl.load(tl.load(step_tab + t).to(tl.pointer_type(tl.float32)))  # this step's count (1 on the first)
    bc1 = 1.0 - tl.exp2(step * log2_beta1)
    bc2_sqrt = tl.sqrt(1.0 - tl.exp2(step * log2_beta2))

    g = tl.load(g_base + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_SCALE:
        g = g / tl.load(scale_ptr)
    p = tl.load(p_base + offs, mask=mask, other=0.0)
    m = tl.load(m_base + offs, mask=mask, other=0.0)
    v = tl.load(v_base + offs, mask=mask, other=0.0)
    p = p * (1.0 - lr * decay)
    m = m + (1.0 - beta1) * (g - m)  # torch's lerp
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - (lr / bc1) * m / (tl.sqrt(v) / bc2_sqrt + eps)
    tl.store(p_base + offs, p, mask=mask)
    tl.store(m_base + offs, m, mask=mask)
    tl.store(v_base + offs, v, mask=mask)
    if HAS_COPY:
        c_base = tl.load(c_tab + t).to(tl.pointer_type(tl.bfloat16))
        tl.store(c_base + offs, p.to(tl.bfloat16), mask=mask)


_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def adamw_(tabs: dict[str, torch.Tensor], blocks: TensorBlocks, grad_dtype: torch.dtype, *, lr: float,
           betas: tuple[float, float], eps: float, weight_decay: float, grad_scale: torch.Tensor | None = None,
           found_inf: torch.Tensor | None = None) -> None:
    """One AdamW step in place over the tensors of `tabs` ("p", "g", "m", "v", "step": fp32 weights, gradients
    in grad_dtype, fp32 moments, fp32 step counts already advanced to this step; "c": optional bf16 copies written
    from the new weights). grad_scale (device scalar): every gradient is divided by it; found_inf (device scalar):
    nonzero skips the whole step."""
    if not blocks.n_blocks:
        return
    b1, b2 = betas
    dummy = tabs["p"]
    c = tabs.get("c")
    _adamw_kernel[(blocks.n_blocks,)](
        tabs["p"], tabs["g"], tabs["m"], tabs["v"], tabs["step"], dummy if c is None else c,
        blocks.tensor_id, blocks.start, blocks.numel,
        dummy if grad_scale is None else grad_scale, dummy if found_inf is None else found_inf,
        float(lr), float(b1), float(b2), math.log2(b1) if b1 > 0 else -math.inf,
        math.log2(b2) if b2 > 0 else -math.inf, float(eps), float(weight_decay),
        G_DTYPE=_TL[grad_dtype], HAS_SCALE=grad_scale is not None, HAS_SKIP=found_inf is not None,
        HAS_COPY=c is not None, BLOCK=BLOCK, num_warps=NUM_WARPS)
