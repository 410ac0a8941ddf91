"""HybridMoEModel: embeddings -> N blocks -> RMSNorm -> LM head (DESIGN.md §3).

Block i = x + attn_i(norm(x)), then x + ffn_i(norm(x)) (with spec.hc_mult = N > 1, hyper-connections: x holds N
residual streams [B, T, N, D] that each sublayer collapses, writes back and mixes; hyper.py); attn is KDA or
gated DSA by spec.layer_types
(or plain GQA, "gqa", for onboarded families such as qwen3_moe: see gqa_attn.py; or Gated DeltaNet, "gdn",
for Qwen3-Next: gdn_attn.py),
ffn is a dense SwiGLU for the first `first_k_dense` layers and LatentMoE after.
Buildable on the meta device (`build_model(spec, device="meta")`) and materialised later with
`materialize(model, device)`. Never imports parallel/: parallelism is applied to a built model.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from ..config import ModelSpec
from ..ops.loss import linear_cross_entropy
from .common import CausalConv1d, RMSNorm, SwiGLU, rope_cos_sin
from .documents import Documents
from .dsa_attn import DSAAttention
from .gdn_attn import GatedDeltaNet
from .gqa_attn import GQAAttention
from .hyper import HyperConnection
from .kda_attn import KDAAttention
from .moe import GroupedLinear, LatentMoE
from .router import Router
from .vision import ImageBatch, VisionModel


def _user_hooks(m: nn.Module) -> bool:
    """Whether m has forward (pre-)hooks, its own or global ones, other than FSDP2's (which gather and free its
    parameters and cast its inputs but read nothing of the stream)."""
    from torch.nn.modules import module as _module

    hooks = (m._forward_hooks, m._forward_pre_hooks, _module._global_forward_hooks,
             _module._global_forward_pre_hooks)
    return any(type(getattr(h, "__self__", None)).__name__ != "FSDPState" for hs in hooks for h in hs.values())


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.attn_type = spec.resolved_layer_types()[layer_id]
        self.attn_norm = RMSNorm(spec.hidden_size, eps=spec.norm_eps)
        self.attn = DSAAttention(spec, layer_id) if self.attn_type == "dsa" else \
            {"kda": KDAAttention, "gqa": GQAAttention, "gdn": GatedDeltaNet}[self.attn_type](spec)
        self.ffn_norm = RMSNorm(spec.hidden_size, eps=spec.norm_eps)
        self.is_moe = spec.is_moe_layer(layer_id)
        self.ffn = LatentMoE(spec) if self.is_moe else SwiGLU(spec.hidden_size, spec.intermediate_size,
                                                               spec.swiglu_limit)
        hc = spec.hc_mult > 1
        self.attn_hc = HyperConnection(spec) if hc else None
        self.ffn_hc = HyperConnection(spec) if hc else None

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                micro_batches: int = 1, shared: dict | None = None,
                docs: Documents | None = None, branch: tuple[torch.Tensor, ...] = (),
                defer: bool = False) -> tuple[torch.Tensor, dict]:
        """micro_batches > 1: x holds several micro-batches along B; attention (and its aux losses) runs per
        micro-batch, the FFN / MoE once over all of them (small-batch merging for the experts). `shared`: the
        forward's DSA top-k selections, for layers that reuse an earlier layer's (spec.index_shared_layers).
        docs: the batch's packed documents (models/documents.py; cos / sin are then per row, [B, T, R]).
        The residual add of the FFN's output can move into the next norm (`HybridMoEModel.forward` decides;
        without hyper-connections only): `defer` leaves this block's FFN output(s) out of the returned stream and
        hands them back in info["branch"], and `branch` takes the previous block's, added here by the attention
        norm in the same pass (RMSNorm.after_add) instead of by a separate add each way."""
        if branch:
            x, h = self.attn_norm.after_add(x, *branch)
            mix = None
        else:
            h, mix = self.attn_hc(x) if self.attn_hc is not None else (x, None)
            h = self.attn_norm(h)
        if micro_batches == 1:
            a, attn_aux = self.attn(h, cos=cos, sin=sin, shared=shared, docs=docs)
        else:
            m = micro_batches

            def rows(t):  # RoPE tables per row (packed documents) split with the rows; shared ones are shared
                return t.chunk(m) if t.dim() == 3 else [t] * m

            mbs = zip(h.chunk(m), rows(cos), rows(sin), docs.chunk(m) if docs is not None else [None] * m)
            parts = [self.attn(c, cos=co, sin=si, shared=shared, chunk=j, docs=d)
                     for j, (c, co, si, d) in enumerate(mbs)]
            a = torch.cat([p[0] for p in parts], dim=0)
            attn_aux = {k: sum(p[1][k] for p in parts) / micro_batches for k in parts[0][1]}
        info: dict = {"aux": dict(attn_aux)}
        if mix is None and self.ffn_hc is None:  # the residual add and the FFN's norm in one pass
            x, h = self.ffn_norm.after_add(x, a)
        else:
            x = x + a if mix is None else self.attn_hc.merge(a, x, mix)
            h, mix = self.ffn_hc(x) if self.ffn_hc is not None else (x, None)
            h = self.ffn_norm(h)
        if self.is_moe:
            f, moe_info = self.ffn(h, parts=defer)
            info["aux"].update(moe_info["aux"])
            info["moe"] = moe_info["moe"]
        else:
            f = self.ffn(h)
        if defer:
            info["branch"] = f if isinstance(f, tuple) else (f,)
            return x, info
        return (x + f if mix is None else self.ffn_hc.merge(f, x, mix)), info


@dataclass
class ModelOutput:
    logits: torch.Tensor | None
    loss: torch.Tensor | None = None  # language-model loss (mean over target tokens)
    aux_loss: torch.Tensor | None = None  # sum of all weighted aux losses
    aux: dict[str, float] = field(default_factory=dict)  # each aux loss summed over layers (for logging)
    moe: list[dict] = field(default_factory=list)  # per MoE layer: counts [E], drop_rate


class HybridMoEModel(nn.Module):
    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.embed = nn.Embedding(spec.vocab_size, spec.hidden_size)
        # vision-language: projected image tokens replace the placeholder embeddings before the first block
        self.vision = VisionModel(spec.vision, spec.hidden_size) if spec.vision is not None else None
        self.layers = nn.ModuleList(Block(spec, i) for i in range(spec.n_layers))
        self.norm = RMSNorm(spec.hidden_size, eps=spec.norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.embed.weight
        self.backend = "auto"  # of the loss (ops.loss); set_backend sets it with the others
        self.cp = None  # an ops.cp_comm.CPLayout, set by `set_context_parallel`

    def set_backend(self, backend: str) -> None:
        """Kernel backend for every op ("auto", "reference", "triton")."""
        for m in self.modules():
            if hasattr(m, "backend"):
                m.backend = backend

    @torch.no_grad()
    def init_weights(self, seed: int | None = None) -> None:
        """Per-module init of an unsharded model (`materialize`: tools and tests). The trainer's scale-true build
        draws from models/init.py instead (same rules, per row block, so any world size gives the same values)."""
        if seed is not None:
            torch.manual_seed(seed)
        std = self.spec.initializer_range
        if self.vision is not None:
            self.vision.init_weights(std)
        for name, m in self.named_modules():
            if name.startswith("vision."):
                continue
            if isinstance(m, nn.Linear):
                s = std / (2 * self.spec.n_layers) ** 0.5 if name.endswith(("o_proj", "wo", "w2")) else std
                nn.init.normal_(m.weight, std=s)
            elif isinstance(m, GroupedLinear):
                nn.init.normal_(m.weight, std=std / (2 * self.spec.n_layers) ** 0.5 if name.endswith("w2") else std)
            elif isinstance(m, nn.Embedding):
                nn.init.normal_(m.weight, std=std)
            elif isinstance(m, nn.LayerNorm):
                m.reset_parameters()
            elif isinstance(m, (RMSNorm, CausalConv1d, KDAAttention, GatedDeltaNet, Router, HyperConnection,
                                DSAAttention)):
                m.reset_parameters()

    def _defers_residual(self, block: Block, receiver: nn.Module) -> bool:
        """Whether `block` hands its FFN output to `receiver` (the next block, or the final norm) to add into the
        stream: not with hyper-connections (their merge mixes the streams), not where a hook on the block would
        see its output without that add (onboard --validate records each block's output), and not into a
        checkpointed block, whose saved inputs would then be the stream and one or two branch outputs instead of
        the stream alone."""
        if self.spec.hc_mult > 1 or _user_hooks(block):
            return False
        return not (isinstance(receiver, Block) and getattr(receiver, "_moeadapt_ac", None))

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                return_logits: bool = True, micro_batches: int = 1, images: ImageBatch | None = None,
                position_ids: torch.Tensor | None = None) -> ModelOutput:
        """input_ids [B, T]; labels [B, T] with -100 where no loss is taken (already shifted: label[t] is
        the target for position t). micro_batches = M > 1 merges M micro-batches stacked along B: the experts
        see all their tokens in one grouped GEMM, while the loss is the mean of the M per-micro-batch means
        (what gradient accumulation over them would optimise). images: the batch's pictures, packed, in the order of
        their placeholder tokens in input_ids (row by row); a model with a vision tower only.
        position_ids [B, T]: packed documents (models/documents.py): each token's position inside its document,
        0 where one starts; each document then sees only itself (KDA state, convs, attention and RoPE restart
        at its start). Under context parallelism they are split like input_ids. None: one document per row.
        They may stay on the host (a CUDA model then reads the documents' boundaries without a device sync).
        The labels are the caller's: the last token of a document should not target the next one's first
        (data.pack_documents masks it)."""
        B, T = input_ids.shape
        cp = self.cp  # under context parallelism input_ids / labels are this rank's pieces of each sequence
        T_seq = T * cp.size if cp is not None else T
        if B % micro_batches:
            raise ValueError(f"batch of {B} rows does not split into micro_batches={micro_batches}")
        if T_seq > self.spec.max_position_embeddings:
            raise ValueError(f"sequence length {T_seq} exceeds max_position_embeddings="
                             f"{self.spec.max_position_embeddings}; shorten train.seq_len")
        x = self.embed(input_ids)
        if self.vision is not None:
            x = self.vision.embed_images(x, input_ids, images)
        elif images is not None:
            raise ValueError(f"model {self.spec.name!r} has no vision tower but the batch holds images; "
                             "use a model with a `vision:` section (e.g. the tiny-vl preset)")
        docs = None
        if position_ids is not None:
            if position_ids.shape != input_ids.shape:
                raise ValueError(f"position_ids {list(position_ids.shape)} must have input_ids' shape "
                                 f"{list(input_ids.shape)} (under context parallelism: this rank's pieces of both)")
            docs = Documents.from_position_ids(position_ids, T_seq, cp, device=x.device)
            pos = docs.position_ids
        elif cp is not None:
            pos = cp.local_positions(T_seq, input_ids.device)
        else:
            pos = torch.arange(T, device=x.device)
        cos, sin = rope_cos_sin(pos, self.spec.qk_rope_head_dim, self.spec.rope_theta, self.spec.rope_scaling)
        aux_total = x.new_zeros((), dtype=torch.float32)
        aux_log: dict[str, float] = {}
        moe_stats: list[dict] = []
        shared: dict = {}  # DSA top-k selections by (layer, micro-batch), for spec.index_shared_layers
        if self.spec.hc_mult > 1:  # hyper-connections: N copies of the embedding as the residual streams
            x = x.unsqueeze(2).expand(-1, -1, self.spec.hc_mult, -1)
        branch: tuple[torch.Tensor, ...] = ()  # the last block's FFN output(s), not yet added to x
        for i, layer in enumerate(self.layers):
            receiver = self.layers[i + 1] if i + 1 < len(self.layers) else self.norm
            x, info = layer(x, cos, sin, micro_batches, shared, docs, branch=branch,
                            defer=self._defers_residual(layer, receiver))
            branch = info.pop("branch", ())
            for k, v in info["aux"].items():
                aux_total = aux_total + v.float()
                aux_log[k] = aux_log.get(k, 0.0) + v.detach().float()
            if "moe" in info:
                moe_stats.append({"layer": layer.layer_id, **info["moe"]})
        h = self.norm.after_add(x, *branch)[1] if branch else self.norm(x if self.spec.hc_mult == 1 else x.mean(2))
        logits, loss, weight = None, None, None
        if labels is not None:
            # per-token loss weights: the mean of the M per-micro-batch means, each over every token of the
            # sequence whichever cp rank holds it; under cp x cp.size, so that the mean over ranks' losses that
            # the gradient reduction takes is the global loss
            acc = torch.promote_types(h.dtype, torch.float32)  # the loss's precision: fp32, or fp64 for fp64 models
            valid = (labels.reshape(micro_batches, -1) != -100).to(acc)
            count = valid.sum(1, keepdim=True)
            if cp is not None and cp.size > 1:
                count = count.detach().clone()
                dist.all_reduce(count, group=cp.group)
            weight = (valid / count.clamp(min=1) / micro_batches * (cp.size if cp is not None else 1)).reshape(-1)
        if labels is not None and not return_logits and type(self.lm_head) is nn.Linear:
            # the loss straight from h: ops.loss never holds the [tokens x vocab] logits whole (chunked on CUDA)
            loss = linear_cross_entropy(h.reshape(-1, h.shape[-1]), self.lm_head.weight, labels.reshape(-1),
                                        weight, backend=self.backend)
        else:
            logits = self.lm_head(h)
            if labels is not None:
                per_tok = F.cross_entropy(logits.to(acc).view(-1, logits.shape[-1]), labels.reshape(-1),
                                          ignore_index=-100, reduction="none")
                loss = (per_tok * weight).sum()
        return ModelOutput(logits if return_logits else None, loss, aux_total, aux_log, moe_stats)


def checkpoint_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """What a training checkpoint holds of the model: the trainable parameters (only the adapters in a LoRA
    run) and the router biases (state that training changes without a gradient). Live tensors, not copies."""
    out = {n: p for n, p in model.named_parameters() if p.requires_grad}
    out.update({n: b for n, b in model.named_buffers() if n.endswith("expert_bias")})
    return out


def set_context_parallel(model: nn.Module, layout) -> None:
    """Split every sequence over the cp group of `layout` (an ops.cp_comm.CPLayout, or None to undo): the
    model then takes each rank's pieces of the sequence (`layout.split(input_ids)`), KDA passes its state
    and conv tails across ranks, DSA gathers the key side, and the loss is token-weighted over the group."""
    if layout is not None and any(isinstance(m, (GQAAttention, GatedDeltaNet)) for m in model.modules()):
        raise ValueError("context parallelism covers KDA and DSA layers; this model has GQA / Gated DeltaNet "
                         "layers (an onboarded family): set parallel.cp: 1")
    for m in model.modules():
        if isinstance(m, (HybridMoEModel, KDAAttention, DSAAttention, CausalConv1d, Router)):
            m.cp = layout


def build_model(spec: ModelSpec, device: str | torch.device = "meta") -> HybridMoEModel:
    with torch.device(device):
        return HybridMoEModel(spec)


def materialize(model: HybridMoEModel, device: str | torch.device = "cpu", seed: int | None = 0,
                dtype: torch.dtype = torch.float32) -> HybridMoEModel:
    """Allocate a meta-built model on `device` and initialise it."""
    model.to_empty(device=device)
    model.to(dtype)
    for m in model.modules():  # buffers are not parameters: re-create them
        if isinstance(m, Router):
            m.expert_bias = torch.zeros_like(m.expert_bias, dtype=torch.float32)
            m.tokens_per_expert = torch.zeros_like(m.tokens_per_expert, dtype=torch.float32)
    model.init_weights(seed)
    return model
