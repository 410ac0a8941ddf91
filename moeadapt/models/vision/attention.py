"""Bidirectional attention over images packed along one axis (block-diagonal by cu_seqlens).

Layout [N, H, Dh] (N = patches of all images), `cu_seqlens` [n_images + 1] int32 offsets. Backends:
- "varlen": PyTorch's flash varlen attention (`torch.nn.attention.varlen.varlen_attn`), CUDA, bf16 / fp16;
- "sdpa": `scaled_dot_product_attention` once per image (any device and dtype; no [N, N] mask is formed);
- "reference": the math, softmax(q kᵀ · scale) v per image, in the input dtype (the CPU specification);
- "auto": varlen on CUDA in half precision, else sdpa.
No kernel of our own: both fast paths are PyTorch's.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

BACKENDS = ("auto", "varlen", "sdpa", "reference")


def _segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    cu = cu_seqlens.tolist()
    return list(zip(cu[:-1], cu[1:]))


def attention_reference(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor,
                        cu_seqlens: torch.Tensor) -> torch.Tensor:
    scale = q_NHD.shape[-1] ** -0.5
    out = []
    for s, e in _segments(cu_seqlens):
        scores_HNN = torch.einsum("nhd,mhd->hnm", q_NHD[s:e], k_NHD[s:e]) * scale
        out.append(torch.einsum("hnm,mhd->nhd", scores_HNN.softmax(-1), v_NHD[s:e]))
    return torch.cat(out, 0)


def _sdpa(q_NHD, k_NHD, v_NHD, cu_seqlens):
    out = []
    for s, e in _segments(cu_seqlens):
        q, k, v = (t[s:e].transpose(0, 1).unsqueeze(0) for t in (q_NHD, k_NHD, v_NHD))  # [1, H, n, Dh]
        out.append(F.scaled_dot_product_attention(q, k, v)[0].transpose(0, 1))
    return torch.cat(out, 0)


def _varlen(q_NHD, k_NHD, v_NHD, cu_seqlens, max_len: int):
    from torch.nn.attention.varlen import varlen_attn

    cu = cu_seqlens.to(device=q_NHD.device, dtype=torch.int32)
    return varlen_attn(q_NHD, k_NHD, v_NHD, cu, cu, max_len, max_len)


def _can_varlen(q: torch.Tensor) -> bool:
    if q.device.type != "cuda" or q.dtype not in (torch.bfloat16, torch.float16):
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def packed_attention(q_NHD: torch.Tensor, k_NHD: torch.Tensor, v_NHD: torch.Tensor, cu_seqlens: torch.Tensor,
                     max_len: int, backend: str = "auto") -> torch.Tensor:
    """Attention within each image: token i of image j attends to every token of image j only.
    q, k, v [N, H, Dh]; cu_seqlens [n_images + 1]; max_len = the longest image (patches). -> [N, H, Dh]."""
    if backend not in BACKENDS:
        raise ValueError(f"vision attention backend {backend!r} is not one of {BACKENDS}")
    if backend == "auto":
        backend = "varlen" if _can_varlen(q_NHD) else "sdpa"
    if backend == "varlen":
        if not _can_varlen(q_NHD):
            raise ValueError("vision attention backend 'varlen' needs CUDA tensors in bf16 / fp16; use 'auto'")
        return _varlen(q_NHD, k_NHD, v_NHD, cu_seqlens, max_len)
    if backend == "sdpa":
        return _sdpa(q_NHD, k_NHD, v_NHD, cu_seqlens)
    return attention_reference(q_NHD, k_NHD, v_NHD, cu_seqlens)
