"""Cross-entropy rows of a logits chunk in one Triton program per row: loss and, in place, the logit gradient.

Owns `ce_rows_(logits_cV, labels_c, weight_c) -> loss_c`: pass 1 streams the row once for its log-sum-exp
(per-lane running max and sum, fp32), pass 2 streams it again and overwrites it with
weight * (softmax - onehot(label)) in the logits' dtype. Bytes: two reads and one write of the bf16 chunk,
where the torch composition (fp32 copy, log-sum-exp, exp, scale, cast back) moves about eight times that.
Rows with label -100 get loss 0 and gradient 0. Used by chunked.py for CUDA tensors (and on CPU under
TRITON_INTERPRET=1 in tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK_V = 1024
NUM_WARPS = 4


@triton.jit
def _ce_rows_kernel(x_ptr, lab_ptr, wt_ptr, loss_ptr, V, s_row, WANT_GRAD: tl.constexpr, BV: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = x_ptr + row * s_row
    cols = tl.arange(0, BV)
    m = tl.full([BV], -1e30, dtype=tl.float32)  # finite start: exp(-inf - m) = 0 for masked lanes
    s = tl.zeros([BV], dtype=tl.float32)
    for off in range(0, V, BV):
        x = tl.load(base + off + cols, mask=off + cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, x)
        s = s * tl.exp(m - m_new) + tl.exp(x - m_new)
        m = m_new
    mx = tl.max(m, axis=0)
    lse = mx + tl.log(tl.sum(s * tl.exp(m - mx), axis=0))
    lab = tl.load(lab_ptr + row)
    w = tl.where(lab == -100, 0.0, tl.load(wt_ptr + row).to(tl.float32))
    tgt = tl.maximum(lab, 0)
    x_t = tl.load(base + tgt).to(tl.float32)
    tl.store(loss_ptr + row, (lse - x_t) * w)
    if WANT_GRAD:
        for off in range(0, V, BV):
            c = off + cols
            x = tl.load(base + c, mask=c < V, other=0.0).to(tl.float32)
            g = tl.exp(x - lse) * w
            g = tl.where(c == tgt, g - w, g)
            tl.store(base + c, g.to(x_ptr.dtype.element_ty), mask=c < V)


def ce_rows_(logits_cV: torch.Tensor, labels_c: torch.Tensor, weight_c: torch.Tensor,
             want_grad: bool = True) -> torch.Tensor:
    """Per-row weighted losses [c] (fp32); with want_grad, logits_cV (unit column stride) becomes the gradient."""
    assert logits_cV.stride(1) == 1
    rows, V = logits_cV.shape
    loss = torch.empty(rows, device=logits_cV.device, dtype=torch.float32)
    if rows:
        _ce_rows_kernel[(rows,)](logits_cV, labels_c, weight_c, loss, V, logits_cV.stride(0),
                                 WANT_GRAD=want_grad, BV=BLOCK_V, num_warps=NUM_WARPS)
    return loss
