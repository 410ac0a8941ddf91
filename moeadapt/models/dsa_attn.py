"""DSAAttention: gated DeepSeek Sparse Attention (as in DeepSeek-V3.2, plus a sigmoid output gate).

MLA projections (q through a q_lora_rank latent, a shared kv latent of kv_lora_rank + a RoPE part; with
spec.mla_rope = False that part is not rotated: NoPE MLA as in Kimi Linear);
the lightning indexer (queries from the q latent, one LayerNorm'd key per token, RoPE on the first
rope-dim channels, not interleaved) selects min(index_topk, t+1) past keys per query (with spec.index_kpool:
whole blocks of keys by their pooled keys, plus the query's own incomplete block: ops.dsa.kpool_indexer);
attention runs over those keys only, in one of MLA's two forms (same result): absorbed, MQA on the kv latent (D =
kv_lora_rank + rope, DV = kv_lora_rank; the gathering kernels), or MHA, per-head keys and values from wkv_b over
dense tiles of the selection (fewer FLOPs where the selection is dense, i.e. short contexts: `form`,
ops/dsa/flex_attn.py; on CUDA the tiles run in ops/dsa/triton_tile_attn.py); then o <- o * sigmoid(x W_gate) per
head and the output projection.
The indexer sees detached inputs and is trained only by the KL loss (index_loss_coef).
Under context parallelism (`cp` set by parallel/) only the key side is gathered (ops/dsa/cp.py).
Packed documents (`docs`, models/documents.py): RoPE restarts per document (the model's cos / sin) and a query
selects keys of its own document only (the ops' cu_seqlens: one process runs the batch as one varlen row).
"""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelSpec
from ..ops.custom import traced
from ..ops.dsa import indexer_kl_loss, kpool_indexer, lightning_indexer, sparse_attention
from ..ops.dsa.cp import dsa_attention_cp
from ..ops.dsa.flex_attn import mha_form_pays
from .common import RMSNorm, apply_rope, compiled_for, rope_softmax_mscale
from .documents import Documents, flat_rows
from .shared_input import shared_input_linears

# How the layer's elementwise glue (mha_inputs, rope_first, gate_heads below) runs on CUDA: "compile" (the torch
# functions through torch.compile with dynamic shapes, models/common.py `compiled_for`) or "triton" (the hand-written
# kernels of ops/dsa/triton_glue.py, one pass each way, custom ops under a dispatch mode or torch.compile). On CPU, and
# under a TorchDispatchMode with "compile", the torch functions run as they are. Timing: benchmarks/bench_dsa_glue.py
# (H100, B 2, T 4096, 16 heads, forward + backward): mha_inputs 584.7 us compiled (dynamic) vs 185.9 Triton,
# gate_heads 86.9 vs 62.6, rope_first of the indexer's queries 256.3 vs 52.0 (RESULTS.md, DSA section).
GLUE_IMPL = "triton"


def _triton_glue(x: torch.Tensor) -> bool:
    """Whether glue on x runs through ops/dsa/triton_glue.py (GLUE_IMPL "triton" and CUDA)."""
    if GLUE_IMPL not in ("compile", "triton"):
        raise ValueError(f"dsa_attn.GLUE_IMPL = {GLUE_IMPL!r} is not one of 'compile', 'triton'")
    return GLUE_IMPL == "triton" and x.is_cuda


def glue(x: torch.Tensor, fn):
    """The implementation of fn (mha_inputs, rope_first or gate_heads) for glue on x: its Triton op
    (`<name>_triton`, same arguments) where `_triton_glue`, else fn compiled where glue on x compiles
    (models/common.py `compiled_for`), else fn."""
    if _triton_glue(x):
        from ..ops.dsa import triton_glue

        return getattr(triton_glue, f"{fn.__name__}_triton")
    return compiled_for(x, fn)


def mha_inputs(q: torch.Tensor, kvb: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               nope: int, rotate: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MLA's MHA-form attention inputs (q, k, v), each a new contiguous tensor in q's dtype: q [B, T, H, nope + r]
    -> [q_nope, rope(q_pe)]; k = [kvb's key channels, rope(k_pe) for every head] (kvb [B, T, H, nope + vd] =
    wkv_b(kv latent), k_pe [B, T, r] shared by the heads); v = kvb's value channels. `rotate` False: the rope
    channels unrotated (NoPE MLA). On CUDA it runs compiled or as ops/dsa/triton_glue.py's kernels (`glue`), for
    which this is the reference: q's and kvb's gradients then come out whole from one pass, where autograd's route
    (slices, cats, the rotation's fp32 copies) makes a zero-filled buffer per slice and adds them."""
    B, T, H, _ = q.shape
    dt, r = q.dtype, k_pe.shape[-1]
    q_pe = q[..., nope:]
    if rotate:
        q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)
    q_full = torch.cat([q[..., :nope], q_pe], dim=-1)
    k_full = torch.cat([kvb[..., :nope].to(dt), k_pe.unsqueeze(2).expand(B, T, H, r).to(dt)], dim=-1)
    return q_full, k_full, kvb[..., nope:].to(dt).contiguous()


def rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int) -> torch.Tensor:
    """x with RoPE on its first r channels and the rest as they are (the lightning indexer's layout). The reference
    of ops/dsa/triton_glue.py's `rope_first_triton` (`glue`)."""
    return torch.cat([apply_rope(x[..., :r], cos, sin), x[..., r:]], dim=-1)


def gate_heads(o: torch.Tensor, gate_logits: torch.Tensor) -> torch.Tensor:
    """o [B, T, H, V] * sigmoid(gate_logits [B, T, H]) per head, as [B, T, H * V] (contiguous) in o's dtype. The
    reference of ops/dsa/triton_glue.py's `gate_heads_triton` (`glue`)."""
    B, T, H, V = o.shape
    return (o * torch.sigmoid(gate_logits).unsqueeze(-1).to(o.dtype)).reshape(B, T, H * V)


class DSAAttention(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int = 0):
        super().__init__()
        self.layer_id = layer_id
        # a layer in spec.index_shared_layers has no indexer: it reuses the nearest earlier indexer's top-k
        self.index_from = None
        if layer_id in spec.index_shared_layers:
            types = spec.resolved_layer_types()
            self.index_from = max(i for i in range(layer_id) if types[i] == "dsa" and i not in spec.index_shared_layers)
        d = spec.hidden_size
        self.spec = spec
        H, nope, rope, vd = spec.n_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim
        self.n_heads, self.nope, self.rope, self.vd, self.kvl = H, nope, rope, vd, spec.kv_lora_rank
        q_in = spec.q_lora_rank or d
        lat_eps = spec.mla_norm_eps or spec.norm_eps
        if spec.q_lora_rank:
            self.wq_a = nn.Linear(d, spec.q_lora_rank, bias=False)
            self.q_norm = RMSNorm(spec.q_lora_rank, eps=lat_eps)
            self.wq_b = nn.Linear(spec.q_lora_rank, H * (nope + rope), bias=False)
        else:
            self.wq = nn.Linear(d, H * (nope + rope), bias=False)
        self.wkv_a = nn.Linear(d, spec.kv_lora_rank + rope, bias=False)
        self.kv_norm = RMSNorm(spec.kv_lora_rank, eps=lat_eps)
        self.wkv_b = nn.Linear(spec.kv_lora_rank, H * (nope + vd), bias=False)
        self.wo = nn.Linear(H * vd, d, bias=False)
        self.w_gate = nn.Linear(d, H, bias=False) if spec.attn_output_gate else None
        # lightning indexer
        HI, DI = spec.index_n_heads, spec.index_head_dim
        self.HI, self.DI = HI, DI
        if self.index_from is None:
            self.wq_idx = nn.Linear(q_in, HI * DI, bias=False)
            self.wk_idx = nn.Linear(d, DI, bias=False)
            self.k_idx_norm = nn.LayerNorm(DI, eps=spec.index_norm_eps)
            self.w_idx = nn.Linear(d, HI, bias=False)
        self.kpool = spec.index_kpool if self.index_from is None else None
        if self.kpool:  # KPool: per-token, per-channel pooling logits x W_pool + ape[position in the block]
            self.kpool_gate = nn.Linear(d, DI, bias=False)
            self.kpool_ape = nn.Parameter(torch.zeros(self.kpool, DI))
        # YaRN (DeepSeek): the softmax scale carries mscale(factor, mscale_all_dim)^2 as well
        self.softmax_scale = (nope + rope) ** -0.5 * rope_softmax_mscale(spec.rope_scaling)
        self.backend = "auto"
        # "absorbed" (MQA form on the kv latent), "mha" (per-head keys and values) or "auto": the MHA form where
        # ops.dsa.flex_attn.mha_form_pays (short contexts, dense selections, CUDA)
        self.form = "auto"
        self.cp = None  # an ops.cp_comm.CPLayout when parallel/ splits the sequence over a cp group

    def _absorbed(self, q_nope, q_pe, kv_lat, k_pe):
        """MLA's absorbed form: (wkv_b as [H, nope + vd, kvl], q = [q_nope W_uk, q_pe] [B, T, H, kvl + r],
        k = [kv_lat, k_pe] [B, T, 1, kvl + r])."""
        w = self.wkv_b.weight
        if hasattr(self.wkv_b, "lora_A"):  # a LoRA on wkv_b: the absorbed form needs the adapted weight itself
            w = w + (self.wkv_b.lora_B.weight @ self.wkv_b.lora_A.weight).to(w.dtype) * self.wkv_b.scaling
        wkv_b = w.view(self.n_heads, self.nope + self.vd, self.kvl)
        q_abs = torch.einsum("bthn,hnc->bthc", q_nope, wkv_b[:, :self.nope].to(q_nope.dtype))
        return wkv_b, torch.cat([q_abs, q_pe], dim=-1), torch.cat([kv_lat, k_pe], dim=-1).unsqueeze(2)

    def _mha_form(self, T: int, is_cuda: bool) -> bool:
        if self.form not in ("auto", "absorbed", "mha"):
            raise ValueError(f"DSA layer {self.layer_id}: form={self.form!r} is not one of 'auto', 'absorbed', 'mha'")
        if self.form != "auto":
            return self.form == "mha"
        nope, r, vd, kvl = self.nope, self.rope, self.vd, self.kvl
        return mha_form_pays(T, self.spec.index_topk, nope + r, vd, kvl + r, kvl, is_cuda, heads=self.n_heads)

    def reset_parameters(self) -> None:
        if self.kpool:
            nn.init.zeros_(self.kpool_ape)

    def init_rules(self) -> dict:
        from .init import Rule

        return {"kpool_ape": Rule("const", 0.0)} if self.kpool else {}

    def _queries(self, x_BTD: torch.Tensor, q_in: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(q, q latent) of x; q_in: x's first query projection (wq_a or wq) when already computed."""
        if self.spec.q_lora_rank:
            q_lat = self.q_norm(self.wq_a(x_BTD) if q_in is None else q_in)
            return self.wq_b(q_lat), q_lat
        return (self.wq(x_BTD) if q_in is None else q_in), x_BTD

    @property
    def _x_projections(self) -> tuple[nn.Module, ...]:
        """The layers whose gradient reaches x (looked up at each call: LoRA injection replaces them)."""
        first = (self.wq_a if self.spec.q_lora_rank else self.wq, self.wkv_a)
        return first if self.w_gate is None else (*first, self.w_gate)

    def indexer(self, x_BTD, q_lat, cos, sin) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, _ = x_BTD.shape
        r = self.rope
        rot = glue(x_BTD, rope_first)
        q_idx = rot(self.wq_idx(q_lat).view(B, T, self.HI, self.DI), cos, sin, r)
        k_idx = self.k_idx_norm(self.wk_idx(x_BTD)).to(q_idx.dtype)  # LayerNorm runs in fp32 under autocast
        k_idx = rot(k_idx, cos, sin, r)
        w_idx = (self.w_idx(x_BTD) * (self.HI ** -0.5 * self.DI ** -0.5)).to(q_idx.dtype)
        return q_idx, k_idx, w_idx

    def forward(self, x_BTD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, shared: dict | None = None,
                chunk: int = 0, docs: Documents | None = None, **_) -> tuple[torch.Tensor, dict]:
        """shared: the forward's {(layer, micro-batch chunk): top-k indices} of the layers with an indexer, read
        by the index_shared_layers (keyed by layer, so a recompute under activation checkpointing reads the
        same selection). docs: packed documents (cos / sin are then per row, [B, T, rope / 2])."""
        B, T, _ = x_BTD.shape
        H, nope, r, kvl = self.n_heads, self.nope, self.rope, self.kvl
        # the projections of x as one autograd node (models/shared_input.py): one dx buffer for their gradients
        q_in, kv, *out_gate = shared_input_linears(x_BTD, self._x_projections)
        q, q_lat = self._queries(x_BTD, q_in)
        q = q.view(B, T, H, nope + r)
        kv_lat, k_pe = self.kv_norm(kv[..., :kvl]), kv[..., kvl:]
        flat = docs is not None and self.cp is None  # packed documents, one process: one varlen row of B * T
        cu = docs.flat_cu_seqlens if flat else None
        mha = self._mha_form(T, x_BTD.is_cuda) and self.cp is None and not flat
        if mha:  # per-head keys and values, attention over dense tiles of the selection (ops/dsa/flex_attn.py)
            kvb = self.wkv_b(kv_lat).view(B, T, H, nope + self.vd)
            q_full, k_full, v_lat = glue(q, mha_inputs)(q, kvb, k_pe, cos, sin, nope, self.spec.mla_rope)
        else:  # absorb W_uk into the query and W_uv after attention: attention runs in MQA form on the latent
            q_nope, q_pe = q[..., :nope], q[..., nope:]
            if self.spec.mla_rope:  # NoPE MLA (mla_rope=False) uses the rope channels unrotated
                q_pe, k_pe = apply_rope(q_pe, cos, sin), apply_rope(k_pe, cos, sin)
            wkv_b, q_full, k_full = self._absorbed(q_nope, q_pe, kv_lat, k_pe)
            if flat:
                q_full, k_full = flat_rows(q_full), flat_rows(k_full)
            v_lat = k_full[..., :kvl]  # a view: the fused kernel reads each selected row once for k and v

        want_kl = (self.training and self.spec.index_loss_coef > 0 and torch.is_grad_enabled()
                   and self.index_from is None)
        kl = None
        if self.index_from is not None:
            if self.cp is not None:
                raise ValueError(f"DSA layer {self.layer_id} reuses layer {self.index_from}'s top-k, which context "
                                 "parallelism does not cover yet; set parallel.cp: 1")
            if shared is None or (self.index_from, chunk) not in shared:
                raise RuntimeError(f"DSA layer {self.layer_id} reuses layer {self.index_from}'s top-k; run it "
                                   "inside the model's forward, which passes the selections along")
            indices = shared[(self.index_from, chunk)]
            o_lat = sparse_attention(q_full, k_full, v_lat, indices, scale=self.softmax_scale, backend=self.backend)
        else:
            q_idx, k_idx, w_idx = self.indexer(x_BTD.detach(), q_lat.detach(), cos, sin)
            if flat:
                q_idx, k_idx, w_idx = flat_rows(q_idx), flat_rows(k_idx), flat_rows(w_idx)
            if self.kpool and self.cp is not None:
                raise NotImplementedError(f"DSA layer {self.layer_id} has a KPool indexer (index_kpool), which "
                                          "context parallelism does not cover yet; set parallel.cp: 1")
            # a full recompute (the block's forward run again in backward, with this forward's `shared`) takes
            # the selection the forward made: the same indices, without running the indexer again (at 131k
            # tokens the indexer is 42% of the step). Not under a dispatch mode: selective checkpointing's
            # recompute replays the saved op outputs in call order, so it must make the forward's calls; the
            # Triton indexer is the op moeadapt::lightning_indexer, whose selection SAC keeps (not run again)
            indices = shared.get((self.layer_id, chunk)) if shared is not None and not traced() else None
            if self.kpool:
                gate = self.kpool_gate(x_BTD.detach())
                gate = flat_rows(gate) if flat else gate
                if indices is None:
                    with torch.no_grad():
                        indices = kpool_indexer(q_idx, k_idx, w_idx, gate, self.kpool_ape, self.spec.index_topk,
                                                self.spec.index_kpool_select_tail, cu, backend=self.backend)
                if shared is not None:
                    shared[(self.layer_id, chunk)] = indices
                o_lat = sparse_attention(q_full, k_full, v_lat, indices, scale=self.softmax_scale,
                                         backend=self.backend)
            elif self.cp is not None:  # this rank's queries over every rank's keys (ops/dsa/cp.py)
                o_lat, kl = self._attend_cp(q_full, k_full, q_idx, k_idx, w_idx, want_kl, docs)
            else:
                if indices is None:
                    with torch.no_grad():
                        indices = lightning_indexer(q_idx, k_idx, w_idx, self.spec.index_topk, cu,
                                                    backend=self.backend)
                if shared is not None:
                    shared[(self.layer_id, chunk)] = indices
                o_lat = sparse_attention(q_full, k_full, v_lat, indices, scale=self.softmax_scale,
                                         backend=self.backend)
                if want_kl:  # the KL target in absorbed form (one latent key for all heads: the gathering
                    # kernel reads 576 channels a pair, not H x 192), on detached inputs
                    with torch.no_grad():  # (in MHA form q_full / k_full hold the rotated q_pe / k_pe)
                        q_kl, k_kl = (self._absorbed(q_full[..., :nope], q_full[..., nope:], kv_lat,
                                                     k_full[:, :, 0, nope:])[1:] if mha else (q_full, k_full))
                    kl = indexer_kl_loss(q_kl, k_kl, indices, q_idx, k_idx, w_idx, scale=self.softmax_scale,
                                         backend=self.backend)
        if mha:
            o = o_lat
        else:
            o_lat = o_lat.reshape(B, T, H, kvl)
            o = torch.einsum("bthc,hvc->bthv", o_lat, wkv_b[:, nope:].to(o_lat.dtype))
        if out_gate:  # the sigmoid gate per head, and o made contiguous for wo in the same pass
            o = glue(o, gate_heads)(o, out_gate[0])
        aux = {} if kl is None else {"index_kl": kl}
        return self.wo(o.reshape(B, T, H * self.vd)), aux

    def _attend_cp(self, q_full, k_full, q_idx, k_idx, w_idx, want_kl: bool, docs: Documents | None):
        """dsa_attention_cp over the batch; with packed documents row by row, each with its global boundaries
        (the KL loss: the mean of the rows' means, all rows having the same number of queries)."""
        run = dict(scale=self.softmax_scale, backend=self.backend, kl_loss=want_kl)
        topk, cp, kvl = self.spec.index_topk, self.cp, self.kvl
        if docs is None:
            o_lat, _, kl = dsa_attention_cp(q_full, k_full, q_idx, k_idx, w_idx, topk, cp, kvl, **run)
            return o_lat, kl
        rows = [dsa_attention_cp(q_full[b:b + 1], k_full[b:b + 1], q_idx[b:b + 1], k_idx[b:b + 1], w_idx[b:b + 1],
                                 topk, cp, kvl, cu_seqlens=cu, **run) for b, cu in enumerate(docs.cu_rows)]
        kl = sum(r[2] for r in rows) / len(rows) if want_kl else None
        return torch.cat([r[0] for r in rows]), kl
