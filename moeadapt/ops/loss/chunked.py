"""Chunked linear + cross-entropy: the logits exist one row chunk at a time in the inputs' dtype, never in fp32.

Forward walks the rows in chunks of rows_per_chunk(V) (2**28 logits: all 8192 rows of a 32768 vocabulary in
one chunk, 512 MiB of bf16) and, for each, makes the chunk's logits (one GEMM), its fp32 log-sum-exp and loss,
and at once the chunk's logit gradient (softmax - onehot) * weight, in place over the logits (triton_ce's
kernel; the torch path makes an fp32 copy of the chunk), turned into dh (one GEMM) and added into dW (fp32). The loss is a weighted sum, so its gradient is known up to the scalar upstream gradient: backward only
scales dh and dW. Saves dh [N, D] and dW [V, D] (fp32), not the logits. Gradients only for the inputs that
need them (a frozen LM head under LoRA skips the dW GEMMs).
"""

from __future__ import annotations

import torch

# logits of one chunk: 2**28 elements at most (512 MiB in bf16; the torch path's fp32 copy is 1 GiB). Few, large
# chunks keep the GEMMs large (K = rows for dW); a 131072-token batch at V = 32768 takes 16.
CHUNK_ELEMENTS = 1 << 28


def rows_per_chunk(vocab: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(vocab, 1))


def _chunk_loss_and_grad(h_cD, w_VD, lab_c, wt_c, want_grad: bool, use_triton: bool):
    logits = h_cD @ w_VD.t()
    if use_triton:
        from .triton_ce import ce_rows_

        loss = ce_rows_(logits, lab_c, wt_c, want_grad).sum()
        return loss, (logits if want_grad else None)
    lf = logits.float() if logits.dtype != torch.float64 else logits
    del logits
    lse = torch.logsumexp(lf, dim=-1)
    tgt = lab_c.clamp(min=0)[:, None]
    wt_c = torch.where(lab_c == -100, 0.0, wt_c.to(lf.dtype))  # ignored rows: no loss, no gradient
    loss = ((lse - lf.gather(1, tgt).squeeze(1)) * wt_c).sum()
    if not want_grad:
        return loss, None
    lf.sub_(lse[:, None]).exp_()  # softmax, in place
    lf.scatter_add_(1, tgt, torch.full_like(tgt, -1, dtype=lf.dtype))  # scaled by weight 0 where label = -100
    lf.mul_(wt_c[:, None])
    return loss, lf.to(h_cD.dtype)


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h_ND, w_VD, labels_N, weight_N, use_triton):
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        N, V = h_ND.shape[0], w_VD.shape[0]
        step = rows_per_chunk(V)
        acc = torch.float64 if h_ND.dtype == torch.float64 else torch.float32
        loss = torch.zeros((), device=h_ND.device, dtype=acc)
        dh = torch.empty_like(h_ND) if need_dh else None
        dw = None
        for s in range(0, N, step):
            e = min(N, s + step)
            part, g_cV = _chunk_loss_and_grad(h_ND[s:e], w_VD, labels_N[s:e], weight_N[s:e], need_dh or need_dw,
                                             use_triton)
            loss += part
            if need_dh:
                torch.mm(g_cV, w_VD, out=dh[s:e])
            if need_dw:
                part_VD = g_cV.t() @ h_ND[s:e]
                dw = part_VD.to(acc) if dw is None else dw.add_(part_VD)
        ctx.save_for_backward(dh, dw)
        ctx.w_dtype = w_VD.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        dh, dw = ctx.saved_tensors
        dh_out = dh * g.to(dh.dtype) if dh is not None else None
        dw_out = (dw * g.to(dw.dtype)).to(ctx.w_dtype) if dw is not None else None
        return dh_out, dw_out, None, None, None


def linear_cross_entropy_chunked(h_ND: torch.Tensor, w_VD: torch.Tensor, labels_N: torch.Tensor,
                                 weight_N: torch.Tensor, use_triton: bool = False) -> torch.Tensor:
    """sum_i weight_i * CE(h_i W^T, label_i) (-100 = no loss) in row chunks; h and W already in compute dtype.
    use_triton: each chunk's softmax / loss / gradient in triton_ce's one-program-per-row kernel (fp32 math;
    not for float64 inputs), else in torch ops."""
    use_triton = use_triton and h_ND.dtype != torch.float64
    if not (torch.is_grad_enabled() and (h_ND.requires_grad or w_VD.requires_grad)):
        with torch.no_grad():
            return _ChunkedLinearCE.forward(_NoGradCtx(), h_ND, w_VD, labels_N, weight_N, use_triton)
    return _ChunkedLinearCE.apply(h_ND, w_VD, labels_N, weight_N, use_triton)


class _NoGradCtx:
    """Stands in for autograd's ctx when no gradient is wanted (evaluation): nothing is kept."""

    needs_input_grad = (False, False, False, False, False)

    def save_for_backward(self, *_):
        pass
