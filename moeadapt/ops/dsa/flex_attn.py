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
128-query block, the key blocks from the block's smallest to its largest selected key (`_mark_selected` writes a
byte mask of the selected keys and each row's range); blocks whose every pair is selected are listed as full
(no mask read), the others as partial, where mask_mod reads the byte mask.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils._python_dispatch import _get_current_dispatch_mode

BLOCK = 128  # FlexAttention's query and key block
# MIN_DENSITY: selected pairs / causal pairs (from T and top-k) at or above which an MHA-layout call takes the
# dense tiles; MHA_FORM: whether an MLA layer may pick the MHA form by itself (form="auto"), which it does where
# its dense-tile FLOPs (every causal pair, nope + rope and vd channels) are at most MHA_FORM_COST times the
# absorbed form's on the selected pairs. At T = 4096, top-2048, 16 heads the MHA form has 0.39 of the absorbed
# form's FLOPs and runs 1.33x faster (bench_dsa.py --forms, H100): FlexAttention reaches ~0.5 of the absorbed
# kernels' FLOP rate, hence MHA_FORM_COST 0.5 (T = 8192: 0.67, absorbed). In the `small` full fine-tuning step
# (H100, seq 4096 x 2) the MHA form took 216.4 -> 199.8 ms. AUTOTUNE: compile FlexAttention with inductor's
# max-autotune (it times its launch configurations once per shape, forward and backward), not its heuristics.
# KERNEL_OPTIONS: FlexAttention's kernel_options (None: inductor's heuristics), e.g. the backward's tiles
# BLOCK_M1 / BLOCK_N1 (dk, dv: query x key) and BLOCK_M2 / BLOCK_N2 (dq) and its bwd_num_warps / bwd_num_stages
FLEX_CONFIG = {"FULL_BLOCKS": True, "MIN_DENSITY": 0.4, "MHA_FORM": True, "MHA_FORM_COST": 0.5, "AUTOTUNE": False,
               "KERNEL_OPTIONS": None}
_ONES = 0x0101010101010101  # eight selected keys (bytes of 1) as one int64
_compiled: dict = {}  # compiled FlexAttention by AUTOTUNE


def selected_pairs(T: int, topk: int) -> int:
    """Pairs a causal top-k selection of T queries holds: query t selects min(topk, t + 1) keys."""
    n = min(T, topk)
    return n * (n + 1) // 2 + (T - n) * topk


def _dense_enough(T: int, topk: int, cfg: dict) -> bool:
    """A causal top-k selection of T queries covers at least MIN_DENSITY of the causal pairs."""
    return selected_pairs(T, topk) >= cfg["MIN_DENSITY"] * T * (T + 1) / 2


def dense_tiles_apply(q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor, cfg: dict | None = None) -> bool:
    """Whether an MHA-layout call (HK = HQ) takes FlexAttention's dense tiles: CUDA, one selection per token,
    T = Tk a multiple of BLOCK, and a selection dense enough (top-k of T vs every causal pair); not under a
    TorchDispatchMode (selective activation checkpointing's: it must see each op, which the compiled kernel
    hides, and FlexAttention's eager path materialises every score)."""
    cfg = FLEX_CONFIG if cfg is None else cfg
    B, T, HQ, _ = q.shape
    if not (q.is_cuda and _get_current_dispatch_mode() is None and k.shape[2] == HQ and indices.dim() == 3
            and k.shape[1] == T and T % BLOCK == 0):
        return False
    return _dense_enough(T, indices.shape[-1], cfg)


def mha_form_pays(T: int, topk: int, d_mha: int, dv_mha: int, d_abs: int, dv_abs: int, is_cuda: bool,
                  cfg: dict | None = None) -> bool:
    """Whether an MLA layer should attend in the MHA form (per-head d_mha / dv_mha channels over dense tiles of
    every causal pair) rather than the absorbed one (d_abs / dv_abs channels over the selected pairs). Not under a
    TorchDispatchMode (selective recompute), where the dense tiles do not run (`dense_tiles_apply`)."""
    cfg = FLEX_CONFIG if cfg is None else cfg
    if not cfg["MHA_FORM"] or not is_cuda or T % BLOCK or _get_current_dispatch_mode() is not None:
        return False
    if not _dense_enough(T, topk, cfg):
        return False
    return T * (T + 1) / 2 * (d_mha + dv_mha) <= cfg["MHA_FORM_COST"] * selected_pairs(T, topk) * (d_abs + dv_abs)


def selection_block_mask(indices: torch.Tensor, T: int, Tk: int, full_blocks: bool = True) -> BlockMask:
    """The BlockMask of a selection: indices [B, T, K] (-1 unused) -> per 128-query block the key blocks from its
    smallest to its largest selected key; with full_blocks those whose every pair is selected are listed apart.
    No host synchronisation (the step can be captured in a CUDA graph)."""
    from .triton_sparse_attn import _mark_selected

    B = indices.shape[0]
    sel, lo, hi = _mark_selected(indices.contiguous(), B, T, Tk)
    nqb, nkb = T // BLOCK, -(-Tk // BLOCK)
    lo_b = lo.view(B, nqb, BLOCK).amin(-1).long() // BLOCK  # (2^31 - 1) // BLOCK where a block selects nothing
    hi_b = hi.view(B, nqb, BLOCK).amax(-1).long() // BLOCK  # -1 there
    kb = torch.arange(nkb, device=indices.device)
    walk = (kb >= lo_b[..., None]) & (kb <= hi_b[..., None])  # [B, nqb, nkb]
    full = None
    if full_blocks and Tk % BLOCK == 0:
        words = sel.view(torch.int64).view(B, nqb, BLOCK, nkb, BLOCK // 8)
        full = (words == _ONES).all(-1).all(2) & walk
        walk = walk & ~full
    sel = sel.view(B, T, Tk)

    def ordered(flags):  # listed blocks first, in key order: (count [B, 1, nqb], indices [B, 1, nqb, nkb])
        num = flags.sum(-1, dtype=torch.int32)
        order = torch.argsort((~flags).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return num.unsqueeze(1), order.unsqueeze(1)

    def keep(b, h, q_idx, kv_idx):
        return sel[b, q_idx, kv_idx] != 0

    num, idx = ordered(walk)
    fnum, fidx = ordered(full) if full is not None else (None, None)
    return BlockMask.from_kv_blocks(num, idx, fnum, fidx, BLOCK_SIZE=BLOCK, mask_mod=keep, seq_lengths=(T, Tk))


def sparse_attention_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, indices: torch.Tensor,
                          scale: float | None = None, cfg: dict | None = None) -> torch.Tensor:
    """`sparse_attention` for the MHA layout on dense tiles: q, k [B, T, H, D], v [B, T, H, DV], indices [B, T, K]
    -> o [B, T, H, DV] (0 for a query that selects nothing). Differentiable in q, k, v. On CUDA FlexAttention is
    compiled (once per shape); elsewhere it runs eagerly (its reference math, forward only)."""
    cfg = FLEX_CONFIG if cfg is None else cfg
    bm = selection_block_mask(indices, q.shape[1], k.shape[1], cfg["FULL_BLOCKS"])
    return flex_on_mask(q, k, v, bm, scale, cfg)


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
