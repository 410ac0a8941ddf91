"""Per-GPU memory model of one training step (DESIGN.md §7), term by term.

Owns: parameter accounting (counted on the meta device, LoRA adapters counted analytically, nothing
allocated), and the bytes each rank holds at the step's peak:
  weights     every parameter sharded over dp_shard * cp (FSDP2; experts: E/ep whole experts per EP rank,
              further sharded over dp_shard_in_ep = dp_shard * cp / ep, which gives the same 1/(dp_shard*cp));
              frozen base in bf16 (LoRA), trainable parameters in fp32 (the master copy);
  grads       fp32, trainable parameters only, sharded like the weights;
  optimizer   AdamW m and v, fp32, trainable parameters only, sharded;
  gathered    FSDP all-gather buffers: the root module (embedding, final norm, LM head: kept gathered for the
              whole step, reshard_after_forward=False) + two blocks (current + prefetched) unsharded in bf16,
              a block's experts being its E/ep local experts + one fp32 reduce-scatter buffer for the block's
              trainable gradients;
  activations per layer type, per token, with recompute none / selective (GEMM outputs kept) / full (block
              inputs kept); plus the larger of the loss phase (logits, fp32 copy, log-softmax) and one
              block recomputed in backward (the two are never alive together);
  a2a         dispatch + combine send/receive buffers of one MoE layer, latent width, times the routing
              straggler factor (max/mean rank load);
  reserve     allocator fragmentation and workspaces: a fraction of the rest plus a fixed CUDA context.
Element sizes: bf16 activations on GPU (`act_bytes=2`), fp32 on CPU (`act_bytes=4`); norms and the
router work in fp32 internally whatever the activation dtype.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ..config import LoRASpec, ModelSpec

GiB = 1024**3
RECOMPUTE_GRAD_FACTOR = 1.3  # recomputed block + the gradients of its activations alive during its backward
# full recompute: the block's backward frees its recomputed activations as their gradients appear, so less
# overlaps (fitted on CPU: 1.04 measured on the micro model after the KDA reference stopped keeping
# non-contiguous copies; 1.1 keeps a margin)
FULL_RECOMPUTE_GRAD_FACTOR = 1.1


@dataclass(frozen=True)
class Plan:
    gpus: int
    dp_replicate: int
    dp_shard: int
    cp: int
    ep: int
    recompute: str  # none | selective | full
    micro_batch: int
    seq_len: int

    @property
    def shard(self) -> int:
        return self.dp_shard * self.cp

    def label(self) -> str:
        """e.g. 'FSDP128(dp64xcp2) EP64 AC=full mb=1 seq=4096' (FSDP spans dp_shard * cp ranks)."""
        rep = f"{self.dp_replicate}xHSDP" if self.dp_replicate > 1 else "FSDP"
        split = f"(dp{self.dp_shard}xcp{self.cp})" if self.cp > 1 else ""
        return f"{rep}{self.shard}{split} EP{self.ep} AC={self.recompute} mb={self.micro_batch} seq={self.seq_len}"


@dataclass(frozen=True)
class ParamCounts:
    root: int  # embedding + final norm + LM head (FSDP root, gathered for the whole step)
    block_dense: tuple[int, ...]  # per layer: non-expert parameters
    block_experts: tuple[int, ...]  # per layer: routed-expert parameters (all experts)
    lora_dense: tuple[int, ...]  # per layer: adapter parameters on non-expert modules
    lora_experts: tuple[int, ...]  # per layer: grouped adapter parameters (all experts)
    lora_act: tuple[tuple[int, int, int, int], ...] = ()  # per layer: sum r, sum (out + r) over dense targets,
    #                                                       and the same per token-choice over grouped targets

    @property
    def total(self) -> int:
        return self.root + sum(self.block_dense) + sum(self.block_experts)

    @property
    def lora(self) -> int:
        return sum(self.lora_dense) + sum(self.lora_experts)


@functools.lru_cache(maxsize=16)
def _count(spec_json: str, lora_json: str | None) -> ParamCounts:
    from torch import nn

    from ..lora.inject import _matches
    from ..models.model import build_model
    from ..models.moe import GroupedLinear

    spec = ModelSpec.model_validate_json(spec_json)
    lora = LoRASpec.model_validate_json(lora_json) if lora_json else None
    m = build_model(spec, "meta")
    L = spec.n_layers
    dense, experts, ld, le = [0] * L, [0] * L, [0] * L, [0] * L
    act = [[0, 0, 0, 0] for _ in range(L)]
    root = 0
    seen = set()
    for name, p in m.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        if name.startswith("layers."):
            i = int(name.split(".")[1])
            (experts if ".ffn.experts." in name else dense)[i] += p.numel()
        else:
            root += p.numel()
    if lora is not None:
        r = lora.rank
        for name, mod in m.named_modules():
            if not name.startswith("layers.") or not _matches(name, lora.targets):
                continue
            i = int(name.split(".")[1])
            if isinstance(mod, GroupedLinear):
                le[i] += mod.n_experts * r * (mod.in_features + mod.out_features)
                act[i][2] += r
                act[i][3] += r + mod.out_features
            elif isinstance(mod, nn.Linear):
                ld[i] += r * (mod.in_features + mod.out_features)
                act[i][0] += r
                act[i][1] += r + mod.out_features
    return ParamCounts(root, tuple(dense), tuple(experts), tuple(ld), tuple(le), tuple(tuple(a) for a in act))


def param_counts(spec: ModelSpec, lora: LoRASpec | None) -> ParamCounts:
    return _count(spec.model_dump_json(), lora.model_dump_json() if lora else None)


# -- activations -------------------------------------------------------------------------------------------
def _attn_elems(spec: ModelSpec, kind: str, seq: int, backend: str) -> tuple[float, float, float]:
    """Per-token elements saved by one attention layer: (GEMM / kernel outputs, other act-dtype, fp32)."""
    d = spec.hidden_size
    if kind == "kda":
        H, K = spec.kda_n_heads, spec.kda_head_dim
        HK = H * K
        gemm = 3 * HK + 2 * K + 2 * HK + H + HK + d  # q,k,v, f_a,g_a, f_b,g_b, beta, kernel out, o_proj
        other = 3 * HK + 3 * HK + 2 * HK + 2 * HK  # conv in/out, l2-normed q,k, gate sigmoid + gated out
        f32 = HK * 2 + H + HK  # decay g (fp32), beta, o_norm internals
        f32 += H * K * K / 64  # chunk states (chunk 64)
        if backend == "reference":  # the reference's chunk (64) / sub-chunk (16) WY-UT intermediates:
            f32 += 64 * HK + 195 * H  # measured with saved-tensor hooks, exact to 0.1% on 4 (H, K, T) shapes
        return gemm, other, f32
    if kind == "gqa":
        H, HK, Dh = spec.n_heads, spec.gqa_n_kv_heads, spec.gqa_head_dim
        gemm = (H + 2 * HK) * Dh + H * Dh + d
        other = 2 * (H + HK) * Dh + 2 * H * Dh  # normed + rotated q, k; repeated k, v
        f32 = (H + HK) * Dh + H  # qk-norm internals, lse
        if backend == "reference":
            f32 += H * seq  # math SDPA keeps the probabilities
        return gemm, other, f32
    # dsa: MLA absorbed into MQA over the kv latent + lightning indexer
    H, n, r, vd, c = spec.n_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    qr = spec.q_lora_rank or 0
    HI, DI, k = spec.index_n_heads, spec.index_head_dim, min(spec.index_topk, seq)
    gemm = qr + H * (n + r) + (c + r) + H * c + H * c + H * vd + d + (H if spec.attn_output_gate else 0)
    other = H * (c + r) + (c + r) + H * r + H * vd + HI * DI + DI + HI
    f32 = qr + c + H + k * 1.0  # norm internals, lse, int32 indices (4 bytes each)
    if backend == "reference":  # the reference gathers the selected keys/values per query and keeps probs
        f32 += k * (2 * c + r) + 2 * H * k
    return gemm, other, f32


def _ffn_elems(spec: ModelSpec, moe: bool) -> tuple[float, float, float]:
    d = spec.hidden_size
    if not moe:
        inter = spec.intermediate_size
        return 2 * inter + d, 2 * inter, 0.0
    E, K, F = spec.n_routed_experts, spec.n_experts_per_tok, spec.moe_intermediate_size
    L = spec.latent_dim or d
    S = spec.n_shared_experts * (spec.shared_intermediate_size or F)
    gemm = K * (2 * F + L) + (2 * S + d if S else 0) + ((L + d) if spec.latent_dim else 0)
    other = K * (2 * F + L) + (2 * S if S else 0) + (L if spec.latent_dim else 0)  # permuted x, silu, prod
    f32 = 3 * E + 3 * K + (L if spec.latent_dim and spec.latent_norm else 0)  # logits, scores, selection
    f32 += 20 * K  # int64 permutation / offset vectors of permute-unpermute (~10 per token-choice)
    return gemm, other, f32


def layer_activation_bytes(spec: ModelSpec, i: int, tokens: int, seq: int, recompute: str, act_bytes: int,
                           backend: str = "kernel", lora_act: tuple[int, int, int, int] = (0, 0, 0, 0)) -> float:
    """Bytes one layer keeps for backward for `tokens` local tokens (recompute none / selective). LoRA adds
    the adapter's x A (r per token, per token-choice for experts) and, under selective, x A B (a GEMM output)."""
    K = spec.n_experts_per_tok if spec.is_moe_layer(i) else 0
    lo_none = lora_act[0] + K * lora_act[2]
    lo_sel = lora_act[1] + K * lora_act[3]
    kind = spec.resolved_layer_types()[i]
    ag, ao, af = _attn_elems(spec, kind, seq, backend)
    fg, fo, ff = _ffn_elems(spec, spec.is_moe_layer(i))
    d = spec.hidden_size
    norms_a, norms_f = 2 * d, 2 * d  # two RMSNorms: input and fp32 normalised copy
    if recompute == "selective":  # GEMM / kernel outputs only (the router logits are an fp32 GEMM output)
        return tokens * (act_bytes * (ag + fg + d + lo_sel) + 4 * (spec.n_routed_experts if spec.is_moe_layer(i) else 0))
    return tokens * (act_bytes * (ag + ao + fg + fo + norms_a + d + lo_none) + 4 * (af + ff + norms_f))


def activation_bytes(spec: ModelSpec, plan: Plan, act_bytes: int = 2, backend: str = "kernel",
                     lora_act: tuple = ()) -> dict:
    """kept: what the layers keep from forward to backward; transient: the larger of the loss phase (logits,
    their fp32 copy and log-softmax, alive at the end of forward) and one block being recomputed in backward
    (by then the loss tensors are gone)."""
    t = plan.micro_batch * plan.seq_len // plan.cp
    la = lora_act or ((0, 0, 0, 0),) * spec.n_layers
    per = [layer_activation_bytes(spec, i, t, plan.seq_len, "none", act_bytes, backend, la[i])
           for i in range(spec.n_layers)]
    logits = t * spec.vocab_size * (act_bytes + 4 + 4)
    if plan.recompute == "none":
        kept, recompute = sum(per), 0.0
    elif plan.recompute == "selective":
        sel = [layer_activation_bytes(spec, i, t, plan.seq_len, "selective", act_bytes, backend, la[i])
               for i in range(spec.n_layers)]
        kept, recompute = sum(sel), max(p - s for p, s in zip(per, sel))
    else:  # full: block inputs only, one block recomputed at a time
        kept, recompute = spec.n_layers * t * spec.hidden_size * act_bytes, max(per)
    # a block's backward holds the gradients of its activations while they are still alive
    recompute *= FULL_RECOMPUTE_GRAD_FACTOR if plan.recompute == "full" else RECOMPUTE_GRAD_FACTOR
    return {"layers": kept, "transient": max(logits, recompute), "logits": logits, "tokens_per_gpu": t}


def memory_breakdown(spec: ModelSpec, plan: Plan, lora: LoRASpec | None, act_bytes: int = 2,
                     straggler: float = 1.3, backend: str = "kernel", reserve_frac: float = 0.06,
                     context_bytes: float = 1.0 * GiB, base_bytes: int = 2) -> dict:
    """Per-GPU bytes at the peak of a step, by term (see the module docstring). base_bytes: frozen-base
    parameter bytes (2 = bf16 on GPU, 4 = fp32 on CPU)."""
    pc = param_counts(spec, lora)
    n = plan.shard
    total = pc.total
    if lora is not None:
        trainable = pc.lora
        weights = (total * base_bytes + trainable * 4) / n
    else:
        trainable = total
        weights = total * 4 / n
    grads = trainable * 4 / n
    optimizer = trainable * 8 / n
    # FSDP all-gather buffers (bf16 compute copies): root for the whole step + 2 blocks (current + prefetch)
    gathered = 0.0
    if n > 1:
        gb = 2
        blocks = sorted((pc.block_dense[i] + pc.lora_dense[i] + (pc.block_experts[i] + pc.lora_experts[i]) / plan.ep)
                        for i in range(spec.n_layers))
        gathered = gb * (pc.root + sum(blocks[-2:]))
        tr_block = max((pc.lora_dense[i] + pc.lora_experts[i] / plan.ep) if lora else
                       (pc.block_dense[i] + pc.block_experts[i] / plan.ep) for i in range(spec.n_layers))
        gathered += 4 * tr_block  # one unsharded fp32 gradient block before reduce-scatter
    act = activation_bytes(spec, plan, act_bytes, backend, pc.lora_act if lora is not None else ())
    t = act["tokens_per_gpu"]
    a2a = 0.0
    if spec.n_routed_experts and plan.ep > 1:
        L = spec.latent_dim or spec.hidden_size
        a2a = 4 * t * spec.n_experts_per_tok * L * act_bytes * straggler  # dispatch+combine, send+recv
    sub = weights + grads + optimizer + gathered + act["layers"] + act["transient"] + a2a
    reserve = reserve_frac * sub + context_bytes
    out = {"weights": weights, "grads": grads, "optimizer": optimizer, "fsdp_gather": gathered,
           "activations": act["layers"], "loss_or_recompute": act["transient"], "a2a_buffers": a2a,
           "reserve": reserve}
    out["total"] = sum(out.values())
    out["params_total"], out["params_trainable"], out["tokens_per_gpu"] = total, trainable, t
    return out
