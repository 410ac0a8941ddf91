"""Per-GPU memory model of one training step (DESIGN.md §7), term by term.

Owns: parameter accounting (counted on the meta device, LoRA adapters counted analytically, nothing
allocated), and the bytes each rank holds at the step's peak:
  weights     every parameter sharded over dp_shard * cp (FSDP2; experts: E/ep whole experts per EP rank,
              further sharded over dp_shard_in_ep = dp_shard * cp / ep, which gives the same 1/(dp_shard*cp));
              frozen base in bf16 (LoRA), trainable parameters in fp32 (the master copy; bf16 with
              train.weight_dtype bf16 / fp32_split: Plan.weight_bytes, no copy, bf16 gradients); counted tensor by
              tensor for the rank holding the most (`state_bytes`: FSDP2's torch.chunk pieces of dim 0);
  grads       fp32, trainable parameters only, sharded like the weights (one GPU with train.weight_copies, full
              FT's weights or LoRA's adapters: bf16 gradients + a persistent bf16 copy of each in place of fp32
              gradients + autocast's per-layer casts; every phase's total is the same: at backward i, 2 B x all
              weights + 2 B x those >= i = 2 B x those < i + 4 B x those >= i, so the model below covers both;
              the lean experts path keeps its adapters' gradients fp32, 2 B a parameter more there);
  optimizer   AdamW m and v, fp32 (bf16: Plan.moment_bytes), and fp32_split's int16 low halves (Plan.lo_bytes),
              trainable parameters only, sharded;
  gathered    FSDP all-gather buffers: the root module (embedding, final norm, LM head: kept gathered for the
              whole step, reshard_after_forward=False) + two blocks (current + prefetched) unsharded in bf16,
              a block's experts being its E/ep local experts + one fp32 reduce-scatter buffer for the block's
              trainable gradients;
  activations what autograd saves, tensor by tensor, per layer type and per local token (`_layer_acc`: the
              rules are in the comment above it; LoRA changes what is saved, frozen linears save nothing),
              for recompute none (the whole saved set) / selective (every GEMM output of the block + its
              input) / full (block inputs); the reported value is what is kept at the step's peak phase;
  loss_or_recompute  what is alive on top of that in the peak phase: the loss at the end of forward
              (reference: logits, fp32 copy, log-softmax; kernel: ops.loss's one chunk of logits, dh and
              the LM head's fp32 gradient), a layer's largest forward transient (the reference DSA's
              KL target, the reference experts' padded buffers at their last GEMM) in its forward or
              recompute, or block i's recomputed activations + their gradients in its backward (blocks above
              i are freed by then, blocks below still kept). Phases are evaluated one by one with the parameter
              gradients alive in each (none in forward, blocks >= i in backward i) and the largest is the peak
              (`peak_phase` in the result);
  a2a         dispatch + combine send/receive buffers of one MoE layer, latent width: the runtime's fixed
              [ep, cap, L] per chunk (parallel/expert.py `capacity_rows`, from `ep_capacity_factor` and
              `a2a_chunks`), independent of the routing skew; under EP the experts' saved tensors also count
              those padded rows (`ep_rows_per_token`);
  reserve     allocator fragmentation and workspaces: a fraction of the rest plus a fixed CUDA context.
Element sizes: bf16 activations on GPU (`act_bytes=2`, autocast; the residual stream and norm outputs stay
fp32), fp32 on CPU (`act_bytes=4`). Two op paths: `backend="reference"` (CPU: the plain-PyTorch KDA / DSA / MoE
reference ops, whose einsums and padded expert bmm's save large intermediates) and `backend="kernel"` (GPU:
Triton KDA / sparse attention / KL custom ops and what their autograd saves, torch._grouped_mm or
fused Triton LoRA experts). docs/onboard_plan.md "Activation model" lists both.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from ..config import LoRASpec, ModelSpec
from ..ops.dsa.flex_attn import mha_form_pays
from ..ops.kda.reference import norm_fits_tile
from ..ops.moe import expert_lora_path

GiB = 1024**3
# Backward of one block: its saved activations plus the gradients of those activations that are alive together
# (dx of the op being differentiated, the reference ops' dense gradient buffers such as the gathered DSA keys).
# Not derived term by term: measured on CPU as (live bytes of the peak block at the step's peak) / (its saved
# set) = 1.07-1.17 over KDA and DSA blocks, full and LoRA, recompute none / selective / full
# (tests/plan/test_accuracy.py shapes); one value for every mode.
BACKWARD_GRAD_FACTOR = 1.15


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
    offload: bool = False  # full recompute only: block inputs in host memory (parallel.offload_activations)
    a2a_chunks: int = 1  # parallel.a2a_chunks
    ep_capacity_factor: float = 1.5  # parallel.ep_capacity_factor
    moment_bytes: int = 4  # bytes of each AdamW moment a parameter: 2 with train.moment_dtype bf16
    weight_bytes: int = 4  # bytes of a trainable weight and of its gradient: 2 with train.weight_dtype bf16
    lo_bytes: int = 0  # optimizer state bytes of a split weight's low half: 2 with train.weight_dtype fp32_split

    @staticmethod
    def state_dtypes(weight_dtype: str, moment_dtype: str) -> dict[str, int]:
        """moment_bytes / weight_bytes / lo_bytes for a run's settled train.weight_dtype ("fp32", "bf16",
        "fp32_split") and train.moment_dtype."""
        return {"moment_bytes": 2 if moment_dtype == "bf16" else 4, "weight_bytes": 4 if weight_dtype == "fp32" else 2,
                "lo_bytes": 2 if weight_dtype == "fp32_split" else 0}

    @property
    def shard(self) -> int:
        return self.dp_shard * self.cp

    def label(self) -> str:
        """e.g. 'FSDP128(dp64xcp2) EP64 AC=full mb=1 seq=4096' (FSDP spans dp_shard * cp ranks)."""
        rep = f"{self.dp_replicate}xHSDP" if self.dp_replicate > 1 else "FSDP"
        split = f"(dp{self.dp_shard}xcp{self.cp})" if self.cp > 1 else ""
        ac = self.recompute + ("+offload" if self.offload else "")
        return f"{rep}{self.shard}{split} EP{self.ep} AC={ac} mb={self.micro_batch} seq={self.seq_len}"


@dataclass(frozen=True)
class ParamCounts:
    root: int  # embedding + final norm + LM head (FSDP root, gathered for the whole step), and the vision tower
    # of a vision-language model (its own FSDP unit, counted here as gathered for the whole step: an upper bound)
    block_dense: tuple[int, ...]  # per layer: non-expert parameters
    block_experts: tuple[int, ...]  # per layer: routed-expert parameters (all experts)
    lora_dense: tuple[int, ...]  # per layer: adapter parameters on non-expert modules
    lora_experts: tuple[int, ...]  # per layer: grouped adapter parameters (all experts)
    lora_targets: tuple[frozenset, ...] = ()  # per layer: adapted module names relative to the block
    lora_rank: int = 0
    # every parameter tensor as the runtime holds it: (dim-0 rows, elements per row, is a routed-expert
    # tensor, trainable, kept fp32 where the trained weights are bf16: the routers', train/copies.py store_bf16);
    # LoRA adapters in the layout lora/layers.py gives them (dense A [r, in], B [out, r]; grouped A [E, in, r],
    # B [E, r, out]); tied weights once
    tensors: tuple[tuple[int, int, bool, bool, bool], ...] = ()

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
    from ..models.router import router_weight_ids

    spec = ModelSpec.model_validate_json(spec_json)
    lora = LoRASpec.model_validate_json(lora_json) if lora_json else None
    m = build_model(spec, "meta")
    L = spec.n_layers
    dense, experts, ld, le = [0] * L, [0] * L, [0] * L, [0] * L
    tg = [set() for _ in range(L)]
    root = 0
    seen = set()
    tensors = []
    whole = router_weight_ids(m)
    for name, p in m.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        is_exp = ".ffn.experts." in name
        tensors.append((p.shape[0] if p.dim() else 1, p[0].numel() if p.dim() else 1, is_exp, lora is None,
                        id(p) in whole))
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
                tg[i].add(name.split(".", 2)[2])
                tensors += [(mod.n_experts, mod.in_features * r, True, True, False),
                            (mod.n_experts, r * mod.out_features, True, True, False)]
            elif isinstance(mod, nn.Linear):
                ld[i] += r * (mod.in_features + mod.out_features)
                tg[i].add(name.split(".", 2)[2])
                tensors += [(r, mod.in_features, False, True, False), (mod.out_features, r, False, True, False)]
    return ParamCounts(root, tuple(dense), tuple(experts), tuple(ld), tuple(le), tuple(frozenset(t) for t in tg),
                       lora.rank if lora is not None else 0, tuple(tensors))


def param_counts(spec: ModelSpec, lora: LoRASpec | None) -> ParamCounts:
    return _count(spec.model_dump_json(), lora.model_dump_json() if lora else None)


def state_bytes(spec: ModelSpec, plan: Plan, lora: LoRASpec | None, base_bytes: int = 2) -> dict[str, float]:
    """Bytes of weights, gradients and AdamW state on the rank holding the most (rank 0), tensor by tensor as
    FSDP2 + EP shard them: a tensor's dim 0 (an expert tensor's E/ep local experts) is cut in torch.chunk
    pieces over the sharding ranks (dp_shard * cp; experts: dp_shard * cp / ep), rank 0 holding ceil(rows /
    ranks). Frozen base in `base_bytes` (LoRA; 2 = bf16 on GPU), trainable parameters and their gradients in
    `plan.weight_bytes` (fp32; bf16 with train.weight_dtype bf16 / fp32_split) and two AdamW states of
    `plan.moment_bytes` each (+ `plan.lo_bytes`: fp32_split's low halves); the routers' weights stay fp32 with
    fp32 gradients and no low half. parallel/shards.py `shard_bytes` measures the same on a built model; the dry
    run (train/dryrun.py) checks they agree."""
    pc = param_counts(spec, lora)
    n = plan.shard
    weights = grads = optimizer = 0.0
    for rows, row_numel, is_exp, tr, whole in pc.tensors:
        if is_exp:
            rows, ranks = rows // plan.ep, max(1, n // plan.ep)
        else:
            ranks = n
        local = min(rows, -(-rows // ranks)) * row_numel
        if not tr:
            weights += local * base_bytes
            continue
        wb = 4 if whole else plan.weight_bytes
        weights += local * wb
        grads += local * wb
        optimizer += local * (2 * plan.moment_bytes + (0 if whole else plan.lo_bytes))
    return {"weights": weights, "grads": grads, "optimizer": optimizer}


# -- activations -------------------------------------------------------------------------------------------
# What autograd keeps, tensor by tensor, per local token (docs/onboard_plan.md "Activation model"). The rules:
#   * a linear y = x W^T saves x only when W is trainable (or, for a LoRA target, for the adapter's A); it never
#     saves x for dx (that needs only W). A frozen base therefore saves nothing of its own.
#   * a LoRA adapter saves x (for A, shared with the base's input) and x A (r wide, for B); its outputs are not
#     saved. Grouped adapters: the same per token-choice.
#   * RMSNorm saves its input (for dx), 1/rms and, only when its weight is trainable, the normalised copy.
#   * convolution saves its input whatever requires grad (autograd's convolution formula saves both operands).
#   * selective recompute (parallel/activation.py) keeps the *output of every GEMM-like op* in the block
#     (mm / addmm / bmm / grouped mm / flash attention; the Triton KDA, sparse-attention and indexer-KL forward
#     ops), needed by backward or not, under no_grad too, plus the block input; on the CPU reference path that includes the bmm's inside the reference ops' einsums
#     (attention scores, the indexer's dense scores, the padded expert GEMMs).
# A linear's saved input is one tensor its consumers share (`_lin_in`). Under bf16 autocast a linear fed an fp32
# tensor would save its own bf16 cast of it, but none is: on the fp32 residual stream of one GPU the RMSNorm emits
# bf16, and LoRALinear takes its input as it comes.

REF_KDA_CHUNK = 64


class _Acc:
    """Per-token saved elements by class: 'a' activation dtype, 'f' fp32, 'b' bytes; gemm flags selective."""

    def __init__(self, act_bytes: int):
        self.ab = act_bytes
        self.none = 0.0  # bytes per token kept without recompute
        self.sel = 0.0  # bytes per token that selective recompute keeps (GEMM outputs)
        self.sel_needed = 0.0  # the part of `none` that is GEMM outputs (reused, not recomputed, by selective)
        self.work = 0.0  # bytes per token of the largest forward transient (freed before the layer ends)
        self.work_gemm = 0.0  # the part of `work` that is GEMM outputs
        self.work_at = (0.0, 0.0, 0.0)  # (none, sel, sel_needed) saved so far when it happens
        self.items: list[tuple[str, float, float]] = []

    def _b(self, n: float, kind: str) -> float:
        return n * {"a": self.ab, "f": 4, "b": 1}[kind]

    def set_work(self, b: float, gemm: float = 0.0) -> None:
        """A forward transient of b bytes per token, alive on top of what the layer saved so far; `gemm` of it
        are GEMM outputs (already in selective recompute's cache, so not counted again there)."""
        if b > self.work:
            self.work, self.work_gemm, self.work_at = b, gemm, (self.none, self.sel, self.sel_needed)

    def keep(self, name: str, n: float, kind: str = "a", gemm_out: float = 0.0) -> None:
        """Saved for backward (recompute none); gemm_out: the fraction of it that is GEMM outputs."""
        b = self._b(n, kind)
        self.none += b
        self.sel_needed += gemm_out * b
        self.items.append((name, b, 0.0))

    def gemm(self, name: str, n: float, kind: str = "a") -> None:
        """A GEMM output: kept by selective recompute whether backward needs it or not."""
        b = self._b(n, kind)
        self.sel += b
        self.items.append((name, 0.0, b))


def _lin_in(acc: _Acc, name: str, width: float, savers: int) -> None:
    """The input of `savers` linears that save it (trainable weight or LoRA A): one tensor they share. On GPU it is
    bf16 under autocast even on the fp32 residual stream of one GPU: the RMSNorm emits the autocast dtype, and
    LoRALinear takes its input as it comes."""
    if savers > 0:
        acc.keep(name, width, "a")


def _norm(acc: _Acc, name: str, width: float, trainable: bool, src_fp32: bool, compiled: bool = False) -> None:
    """RMSNorm internals (its input is counted by whoever produced it): 1/rms, normalised copy if the weight
    trains; on GPU a bf16 input is upcast (an fp32 copy saved). compiled: the CUDA RMSNorm's torch.compile graph
    (models/common.py), whose backward recomputes the normalised rows from its input and 1/rms: it saves only
    those (the input, a gate's logits: counted by their producers)."""
    acc.keep(name + ".rstd", 1, "f")
    if compiled:
        return
    if trainable:
        acc.keep(name + ".normed", width, "f")
    if not src_fp32 and acc.ab == 2:
        acc.keep(name + ".fp32_in", width, "f")


def _keep_swiglu(acc, who: str, S: float, ref: bool, ref_widths: int = 3) -> None:
    """The SwiGLU's saved inputs, S wide per row: torch's silu then mul (reference path) keeps w1 out, silu out and
    w3 out (ref_widths of them: the frozen shared expert without adapters measured 2), ops/moe swiglu_pair (kernel
    path) w1 out and w3 out, silu recomputed in the backward."""
    if ref:
        acc.keep(f"{who}w1 out, w3 out, silu out", ref_widths * S, gemm_out=2 / 3)
    else:
        acc.keep(f"{who}w1 out, w3 out (fused swiglu)", 2 * S, gemm_out=1.0)


def _layer_acc(spec: ModelSpec, i: int, seq: int, backend: str, act_bytes: int, full: bool,
               targets: frozenset, rank: int, tokens: int | None = None, fp32_stream: bool | None = None,
               expert_lora: str | None = None, fused_buffer: bool = True, expert_rows: float | None = None,
               cp: int = 1, selective: bool = False) -> _Acc:
    """Itemised saved tensors of layer i. full: full training; else LoRA on `targets` (names relative to the
    block, e.g. 'attn.q_proj', 'ffn.experts.w1') with rank `rank`. Kernel path: `expert_lora` forces the
    grouped LoRA backend ("lean" | "fused" | "triton" | "torch"; "fused" never lean); None = what ops/moe
    `expert_lora_path` picks on CUDA for these rows per expert (`fused_buffer`: the layer owns its [W | Bᵀ]
    buffer, i.e. no FSDP). expert_rows: rows the experts' GEMMs and SwiGLU run over per local token (None: K;
    under EP the fixed-capacity exchange's padded rows, `ep_rows_per_token`); the reference path's padded
    [E, C, in] buffers follow the real rows (K). cp, selective: the context-parallel degree and whether the
    recompute is selective (a DSA layer takes the MHA form only at cp = 1 without selective recompute, where
    `ops.dsa.flex_attn.mha_form_pays`)."""
    acc = _Acc(act_bytes)
    ref = backend == "reference"
    # the residual stream (and the norms' outputs): fp32 under autocast with fp32 parameters (one GPU), bf16
    # under FSDP's bf16 parameter policy, fp32 on CPU
    f32s = (act_bytes == 2) if fp32_stream is None else fp32_stream
    rk = "f" if f32s else "a"
    d = spec.hidden_size

    def tr(m):  # does this linear save its input?
        return full or m in targets

    def lora(name, out, per_choice=1.0):  # adapter: x A kept; selective keeps base out, x A, (x A) B
        if not full and name in targets:
            acc.keep(name + ".xA", per_choice * rank, "a")
            acc.gemm(name + ".lora_gemms", per_choice * (rank + out), "a")

    kind = spec.resolved_layer_types()[i]
    # the GPU's RMSNorms run compiled (RMSNorm._compiles: CUDA, not under selective recompute's dispatch mode)
    cn = not ref and act_bytes == 2 and not selective
    acc.keep("residual", 2 * d, rk)  # h = x + attn (ffn_norm input), block output
    _norm(acc, "attn_norm", d, full, f32s or act_bytes != 2, cn)
    acc.gemm("block_input", d, rk)
    if kind == "kda":
        H, K = spec.kda_n_heads, spec.kda_head_dim
        HK = H * K
        mods = ("attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.f_a", "attn.b_proj", "attn.g_a")
        _lin_in(acc, "attn_norm.out", d, sum(tr(m) for m in mods))
        for m in ("q_proj", "k_proj", "v_proj"):
            acc.gemm(m, HK)
            lora("attn." + m, HK)
        acc.keep("qkv_proj_out (conv input)", 3 * HK, gemm_out=1)  # convolution saves its input unconditionally
        acc.keep("conv_out (silu input)", 3 * HK * (1 + (spec.kda_conv_size - 1) / seq))  # padded T+k-1
        acc.gemm("f_a,g_a", 2 * K)
        acc.gemm("f_b,g_b", 2 * HK)
        acc.gemm("b_proj", H)
        acc.keep("f_a,g_a out", K * (tr("attn.f_b") + tr("attn.g_b")), gemm_out=1)
        if ref:
            acc.keep("q,k silu out (l2norm input)", 2 * HK)
            # chunk_kda_reference's own saved set (chunk 64, sub-chunk 16), measured alone with the live-storage
            # accounting on head dims 8-64 and T 128-256: per head 54.25 K + 196.5 + K^2/64 floats per token
            # (the sub-chunk decay products k e^(G_i-G_j) and their exponent: 2 x 16 K; the off-diagonal
            # row/column factors: ~9 K; G, e^G, q e^G, k e^(Glast-G), w | u: ~8 K; A_kk, A_qk: 2 x 64; the
            # 16x16 sub-chunk blocks: 64; masks and per-chunk states: K^2/64 ...); the decay's
            # softplus output (HK) only when A_log / dt_bias train
            acc.keep("chunk_kda reference internals", H * (54.25 * K + 196.5 + K * K / 64) - (0 if full else HK), "f")
            acc.gemm("chunk_kda reference bmm outputs", H * (2 * REF_KDA_CHUNK + 2.5 * K), "f")
        else:
            # q's and k's L2 norm: inside the convs' Triton passes at cp = 1 with a power-of-two head
            # (CausalConv1d.fuses_norm), which save only their input; otherwise moeadapt::l2norm_qk_fwd, which saves
            # its inputs q, k and their fp32 1/|x| (ops/kda/triton_l2norm.py).
            # moeadapt::chunk_kda_fwd's autograd saves q, k, v, g, beta (its inputs) and its outputs A_qk and T_inv
            # (64 per token per head, fp32), w, kd, qg, u, per-chunk gate, the chunk states h (K*V/64 per token per
            # head) and v_new; selective recompute keeps the op's outputs (parallel/activation.py), o included
            if cp > 1 or not norm_fits_tile(K):
                acc.keep("l2norm inputs q,k", 2 * HK)
                acc.keep("l2norm 1/|q|, 1/|k|", 2 * H, "f")
            acc.keep("kernel q,k,v,g,w,kd,qg,u,v_new", 9 * HK, gemm_out=5 / 9)
            nb = H * (2 * 64 + 1) + HK / 64 + H
            acc.keep("kernel A_qk,T_inv,beta,gate", nb, "f", gemm_out=(H * 2 * 64 + HK / 64) / nb)
            acc.keep("kernel chunk states", HK * K / 64, "f", gemm_out=1)
            acc.gemm("chunk_kda_fwd outputs o, w, kd, qg, u, v_new", 6 * HK)
            acc.gemm("chunk_kda_fwd outputs A_qk, T_inv, gate, chunk states", H * 2 * 64 + HK / 64 + HK * K / 64, "f")
        acc.keep("o (o_norm input)", HK, gemm_out=0 if ref else 1)
        _norm(acc, "o_norm", HK, full, act_bytes != 2, cn)
        if cn:  # the gate is inside the compiled norm: its logits are what it saves
            acc.keep("output gate logits (compiled o_norm input)", HK)
        else:
            acc.keep("o_norm out, sigmoid gate (mul inputs)", 2 * HK)
        acc.gemm("o_proj", d)
        lora("attn.o_proj", d)
        _lin_in(acc, "o_proj input", HK, int(tr("attn.o_proj")))
    elif kind == "gqa":
        H, HKV, Dh = spec.n_heads, spec.gqa_n_kv_heads, spec.gqa_head_dim
        mods = ("attn.q_proj", "attn.k_proj", "attn.v_proj")
        _lin_in(acc, "attn_norm.out", d, sum(tr(m) for m in mods))
        for m, w in (("q_proj", H * Dh), ("k_proj", HKV * Dh), ("v_proj", HKV * Dh)):
            acc.gemm(m, w)
            lora("attn." + m, w)
        if spec.gqa_qk_norm:
            acc.keep("q,k proj out (qk-norm inputs)", (H + HKV) * Dh, gemm_out=1)
            acc.keep("qk-norm rstd", H + HKV, "f")
            if full:
                acc.keep("qk-norm normed", (H + HKV) * Dh, "f")
        acc.keep("rotated q (sdpa input)", H * Dh)
        if HKV != H:  # repeat_interleave'd k, v are what SDPA saves (the repeat itself saves nothing)
            acc.keep("repeated k, v (sdpa inputs)", 2 * H * Dh)
        else:
            acc.keep("rotated k, v (sdpa inputs)", 2 * HKV * Dh, gemm_out=0.5)
        acc.keep("sdpa out + lse", H * Dh + H)  # flash attention (also the CPU flash kernel): no probabilities
        if not ref:  # aten flash attention is in the selective save list; the CPU flash op is not
            acc.gemm("sdpa", H * Dh)
        acc.gemm("o_proj", d)
        lora("attn.o_proj", d)
        _lin_in(acc, "o_proj input", H * Dh, int(tr("attn.o_proj")))
    else:  # dsa: MLA absorbed into MQA over the kv latent + lightning indexer
        H, n, r, vd, c = spec.n_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.kv_lora_rank
        qr = spec.q_lora_rank or 0
        HI, DI, k = spec.index_n_heads, spec.index_head_dim, min(spec.index_topk, seq)
        idx_train = full and spec.index_loss_coef > 0  # the indexer trains only through its KL loss
        qm = "attn.wq_b" if qr else "attn.wq"
        first = ("attn.wq_a",) if qr else (qm,)
        mods = (*first, "attn.wkv_a", *(("attn.w_gate",) if spec.attn_output_gate else ()))
        _lin_in(acc, "attn_norm.out", d, sum(tr(m) for m in mods) + (2 if idx_train else 0))
        if qr:
            acc.gemm("wq_a", qr)
            acc.keep("wq_a out (q_norm input)", qr, gemm_out=1)
            _norm(acc, "q_norm", qr, full, act_bytes != 2, cn)
            _lin_in(acc, "q_lat", qr, int(tr(qm)) + int(idx_train))
        acc.gemm("wq_b", H * (n + r))
        lora(qm, H * (n + r))
        mha = not ref and dsa_mha_form(spec, seq, cp, selective)
        if full and not mha:
            acc.keep("q (q_nope: absorb bmm input)", H * (n + r), gemm_out=1)
        acc.gemm("wkv_a", c + r)
        lora("attn.wkv_a", c + r)
        acc.keep("wkv_a out (kv_norm input)", c + r, gemm_out=1)
        _norm(acc, "kv_norm", c, full, act_bytes != 2, cn)
        if mha:  # MHA form (ops/dsa/flex_attn.py): per-head k, v from wkv_b; FlexAttention keeps q, k, v (a view
            # of wkv_b's output), o, lse and the mask_mod's selection bytes ([T, Tk])
            _lin_in(acc, "kv_lat (wkv_b input)", c, int(tr("attn.wkv_b")))
            acc.gemm("wkv_b", H * (n + vd))
            lora("attn.wkv_b", H * (n + vd))
            acc.keep("q, k (flex inputs), wkv_b out (v)", 2 * H * (n + r) + H * (n + vd),
                     gemm_out=(n + vd) / (2 * (n + r) + n + vd))
            acc.keep("flex lse", H, "f")
            acc.keep("selection mask", seq, "b")
            acc.gemm("flex o", H * vd)
        else:  # absorbed: W_uk into q, attention on the latent, W_uv after
            acc.gemm("q absorb bmm", H * c)
            acc.keep("q_full (attention input)", H * (c + r))
            if ref:  # sparse_attention_reference gathers k and v rows per query and keeps the scores/probs
                acc.keep("gathered k, v", k * (2 * c + r), "f")
                acc.keep("scores, probs, lse", 2 * H * k + H, "f", gemm_out=0.5)
                acc.keep("gather indices int64 x2, mask", 2 * k * 8 + k, "b")
                acc.gemm("attention bmm (scores, o)", H * k + H * c, "f")
                acc.gemm("indexer dense scores (no_grad bmm)", (HI + 1) * seq, "f")
            else:  # triton sparse attention: q, k, indices (int32), o, lse; selective keeps the op's o and lse
                acc.keep("k_full, indices, lse", (c + r) + H, "f")
                acc.keep("indices", k * 4, "b")
                acc.gemm("sparse_attn_fwd o", H * c)
                acc.gemm("sparse_attn_fwd lse", H, "f")
            if full:
                acc.keep("o_lat (o bmm input)", H * c, gemm_out=1)
            acc.gemm("o bmm", H * vd)
        if spec.attn_output_gate:
            acc.gemm("w_gate", H)
            acc.keep("o, sigmoid gate (mul inputs)", H * vd + H, gemm_out=vd / (vd + 1))
        acc.gemm("wo", d)
        lora("attn.wo", d)
        _lin_in(acc, "wo input", H * vd, int(tr("attn.wo")))
        acc.gemm("indexer projections", HI * DI + DI + HI)
        if ref and spec.index_loss_coef > 0:  # the KL target (no_grad, even with a frozen indexer) gathers the
            # selected latent keys per query and softmaxes the scores: freed before the layer ends
            acc.set_work(4 * (k * (c + r) + 3 * H * k))
        if idx_train:
            acc.keep("indexer k (LayerNorm input), stats, q_idx, w_idx", DI + HI * DI + HI)
            acc.keep("LayerNorm stats", 2, "f")
            if ref:  # indexer_kl_loss_reference: gathered k_idx, relu'd scores, log-softmax, target p
                acc.keep("kl: gathered k_idx, scores, log_softmax, p", k * DI + HI * k + 2 * k, "f")
                acc.keep("kl: indices int64, masks", k * 8 + 2 * k + 1, "b")
                acc.gemm("kl bmm (scores, weighted, target)", HI * k + k + H * k, "f")
            else:  # triton KL: gradients computed in forward and kept (dq, dk, dw)
                acc.keep("kl: dq_idx, dk_idx, dw_idx", HI * DI + DI + HI, "f", gemm_out=1)
        if not ref and spec.index_loss_coef > 0:  # moeadapt::indexer_kl_fwd's outputs: selective keeps them
            acc.gemm("indexer_kl_fwd dq_idx, dk_idx, dw_idx", HI * DI + DI + HI, "f")
    # FFN
    _norm(acc, "ffn_norm", d, full, f32s or act_bytes != 2, cn)
    if not spec.is_moe_layer(i):
        S = spec.intermediate_size
        _lin_in(acc, "ffn_norm.out", d, int(tr("ffn.w1")) + int(tr("ffn.w3")))
        acc.gemm("w1,w3", 2 * S)
        acc.gemm("w2", d)
        for m, w in (("ffn.w1", S), ("ffn.w3", S), ("ffn.w2", d)):
            lora(m, w)
        _keep_swiglu(acc, "", S, ref)
        _lin_in(acc, "w2 input", S, int(tr("ffn.w2")))
        return acc
    E, Kt, F = spec.n_routed_experts, spec.n_experts_per_tok, spec.moe_intermediate_size
    Kx = expert_rows or Kt
    L = spec.latent_dim or d
    S = spec.n_shared_experts * (spec.shared_intermediate_size or F)
    sh = ("ffn.shared.w1", "ffn.shared.w3")
    # the router saves its input only when its weight trains: a bf16 copy (router_matmul bf16x2 / tf32 / bf16, like
    # any autocast linear), or with router_matmul fp32 the input itself (its own fp32 tensor when the source is fp32)
    own_fp32 = full and spec.router_matmul == "fp32" and f32s and act_bytes == 2
    _lin_in(acc, "ffn_norm.out", d, int(full and not own_fp32) + int(tr("ffn.fc1_latent_proj")) * bool(spec.latent_dim)
            + sum(tr(m) for m in sh) * bool(S) + (0 if spec.latent_dim else int(tr("ffn.experts.w1") or tr("ffn.experts.w3"))))
    if own_fp32:
        acc.keep("router input (fp32, router_matmul fp32)", d, "f")
    acc.gemm("router logits", E, "f")
    acc.keep("router scores, top-k ids (int64), weights", E + 3 * Kt + 1, "f")
    if spec.latent_dim:
        acc.gemm("fc1_latent_proj", L)
        lora("ffn.fc1_latent_proj", L)
        if spec.latent_norm:
            acc.keep("fc1 out (latent_norm input)", L, gemm_out=1)
            _norm(acc, "latent_norm", L, full, act_bytes != 2, cn)
    acc.keep("permute indices", Kt * 8, "b")
    lean = False  # the kernel path's lean_lora experts (set below)
    if ref:
        # grouped_mm_reference: one padded [E, C, in] bmm per GroupedLinear; C = the largest expert's rows.
        # Expected largest of E multinomial loads of mean m = T K / E: m + sqrt(2 m ln E) (Gaussian tail)
        m = max((tokens or seq) * Kt / E, 1.0)
        pad = (m + math.sqrt(2 * m * math.log(max(E, 2)))) / m  # padded rows per token-choice
        ins = {"w1": L, "w3": L, "w2": F}
        outs = {"w1": F, "w3": F, "w2": L}
        for w in ("w1", "w3", "w2"):
            name = "ffn.experts." + w
            if full:
                acc.keep(f"experts.{w} padded input", Kt * pad * ins[w], "f")
                acc.keep(f"experts.{w} row/slot indices", Kt * 16, "b")
            elif name in targets:  # A saves the padded x, B the padded x A; the frozen base saves nothing
                acc.keep(f"experts.{w} padded input (lora A)", Kt * pad * (ins[w] + rank), "f")
                # each of the 3 padded GEMMs (A, B, base) saves its own int64 expert / slot row indices (the
                # index_put into the padded buffer and the row gather back both keep them, the frozen base too)
                acc.keep(f"experts.{w} row/slot indices", Kt * 48, "b")
            acc.gemm(f"experts.{w} padded bmm out", Kt * pad * outs[w], "f")
            if name in targets and not full:
                acc.gemm(f"experts.{w} lora padded bmm outs", Kt * pad * (rank + outs[w]), "f")
    else:
        # ops/moe "auto" on CUDA (expert_lora_path): the frozen / trained base is torch._grouped_mm (an aten
        # GEMM: selective keeps its output; it saves its input only when the weight trains). A LoRA target runs
        #   fused  (one device, >= FUSED_MIN_ROWS rows per expert): [x | s x A] is written into a new buffer
        #          xcat (J = in + rank rounded up to 8) and base + adapter are one torch._grouped_mm; xcat is what
        #          it saves, one per layer (w1 and w3 each keep their own copy of x), and SAC sees the aten GEMM
        #          inside the autograd Function, so selective keeps its output;
        #   triton (the Triton LoRA kernel, the custom op moeadapt::grouped_lora_fwd): saves x (w1 / w3 share
        #          it) and h = x A (rank wide); selective keeps the op's outputs y and h;
        #   torch: three torch._grouped_mm (x A, (x A) B, base): x shared, x A kept; selective keeps all 3 outs
        ins = {"w1": L, "w3": L, "w2": F}
        outs = {"w1": F, "w3": F, "w2": L}
        # expert_lora "fused" models the fused GEMM itself (no lean), as plan/accuracy.py runs it
        be = expert_lora_path((tokens or seq) * Kt / E, cuda=True, fused_buffer=fused_buffer, backend=expert_lora,
                              lean_layers=not full and expert_lora != "fused"
                              and all("ffn.experts." + w in targets for w in ("w1", "w3", "w2")))
        x_shared = False  # w1 and w3 read the same permuted rows: saved once by whichever non-fused layer keeps it
        lean = be == "lean"
        #   lean   (ops/moe/lean_lora.py, where fused would run and w1, w3, w2 all carry LoRA): the permuted rows x
        #          once, h = s x [A1 | A3] (2 rank wide, padded to 8), w1 / w3 outputs (the SwiGLU inputs, below),
        #          acat = [a | s a A2] (w2's input), and w2's GEMM output under selective
        if lean:
            acc.keep("experts x (permuted rows, lean)", Kx * L)
            acc.keep("experts h = s x [A1 | A3] (lean)", Kx * ((2 * rank + 7) // 8 * 8))
            acc.keep("experts.w2 acat [a | s a A] (lean)", Kx * (F + (rank + 7) // 8 * 8))
            # selective keeps the three torch._grouped_mm outputs inside lean's autograd Functions (w1 / w3 in
            # the gather Function, w2 in the SwiGLU one; with the experts' gate/up buffer, one process, w1 / w3
            # are one [rows, 2F] output of _LeanCatFn: the same bytes); measured on the H200: without the w1 / w3 ones the
            # selective + LoRA row missed by -13.6% (3.0 GiB = 8192 tokens x 15 layers x 8 x 2 x 768 x 2 B)
            acc.gemm("experts.w1, w3 grouped mm outs (lean)", Kx * 2 * F)
            acc.gemm("experts.w2 grouped mm out (lean)", Kx * L)
        for w in (() if lean else ("w1", "w3", "w2")):
            name = "ffn.experts." + w
            if name in targets and not full:
                if be == "fused":
                    acc.keep(f"experts.{w} xcat [x | s x A] (fused)", Kx * (ins[w] + (rank + 7) // 8 * 8))
                    acc.gemm(f"experts.{w} fused grouped mm out", Kx * outs[w])
                    continue
                acc.keep(f"experts.{w} x A", Kx * rank)
                if be == "triton":
                    acc.gemm(f"experts.{w} triton lora outs (y, x A)", Kx * (outs[w] + rank))
                if be == "torch":
                    acc.gemm(f"experts.{w} base + lora grouped mm outs", Kx * (2 * outs[w] + rank))
            else:
                acc.gemm(f"experts.{w} grouped mm out", Kx * outs[w])
                if not full:  # frozen base: torch._grouped_mm saves only the weight
                    continue
            if w == "w2" or not x_shared:
                acc.keep(f"experts.{w} input", Kx * ins[w])
                x_shared = x_shared or w != "w2"
    if lean:  # lean: the SwiGLU product is acat's first F columns (kept above)
        acc.keep("w1 out, w3 out (swiglu inputs, lean)", Kx * 2 * F, gemm_out=1.0)
    else:
        _keep_swiglu(acc, "experts ", Kx * F, ref)
    if ref:
        # forward transient of the reference experts at their last GEMM (w2), on top of everything saved so far:
        # the permuted rows z_NL (a local of the dispatcher; the padded copies, not z, are saved) and the swiglu
        # product (w2's input, saved only as its padded copy), and inside w2: the padded bmm output [E, C, L]
        # and its row gather (N, L); a LoRA w2 also holds x A (N, r), the scaled adapter rows (N, L) and the
        # base's own padded input [E, C, F] (not saved: the base is frozen) until base + adapter are added.
        # With full recompute this is the peak of block i's recompute (tests/plan/test_accuracy.py, gqa full
        # + LoRA: the backward x 1.15 allowance missed it by -13.6%)
        w2_lora = not full and "ffn.experts.w2" in targets
        acc.set_work(4 * Kt * (L + F + pad * L + L + ((rank + L + pad * F) if w2_lora else 0)), gemm=4 * Kt * pad * L)
    # the combine saves the expert output rows for the routing weights' gradient: the reference one only when
    # those train (full training), the Triton unpermute (kernel path) always (it checks at backward)
    acc.keep("expert out rows (combine input) + combine", Kt * L * (1 if full or not ref else 0) + L)
    if spec.latent_dim:
        acc.gemm("fc2_latent_proj", d)
        lora("ffn.fc2_latent_proj", d)
    if S:
        acc.gemm("shared w1,w3,w2", 2 * S + d)
        for m, w in (("ffn.shared.w1", S), ("ffn.shared.w3", S), ("ffn.shared.w2", d)):
            lora(m, w)
        _keep_swiglu(acc, "shared ", S, ref, ref_widths=3 if full or any(m in targets for m in sh) else 2)
        _lin_in(acc, "shared w2 input", S, int(tr("ffn.shared.w2")))
    return acc


def layer_activation_bytes(spec: ModelSpec, i: int, tokens: int, seq: int, recompute: str, act_bytes: int,
                           backend: str = "kernel", full: bool = True, targets: frozenset = frozenset(),
                           rank: int = 0, expert_lora: str | None = None) -> float:
    """Bytes layer i keeps from forward to backward for `tokens` local tokens: recompute 'none' (everything
    backward needs) or 'selective' (the block input and every GEMM output of the block)."""
    acc = _layer_acc(spec, i, seq, backend, act_bytes, full, targets, rank, tokens, expert_lora=expert_lora,
                     selective=recompute == "selective")
    return tokens * (acc.sel if recompute == "selective" else acc.none)


def ep_capacity(spec: ModelSpec, plan: Plan) -> int:
    """Rows per (source, destination, chunk) of the runtime's EP exchange for this plan (parallel/expert.py
    `capacity_rows`: the same rule); 0 without EP."""
    if plan.ep == 1 or not spec.n_routed_experts:
        return 0
    from ..parallel.expert import capacity_rows

    t = plan.micro_batch * plan.seq_len // plan.cp
    return capacity_rows(t, spec.n_experts_per_tok, plan.ep, plan.a2a_chunks, plan.ep_capacity_factor)


def ep_rows_per_token(spec: ModelSpec, plan: Plan) -> float | None:
    """Rows the experts run over per local token under EP: every chunk's [ep * cap] received buffer, padding
    included (the grouped GEMM skips rows past the real ones, the SwiGLU and the saved tensors do not);
    None without EP (K rows per token)."""
    cap = ep_capacity(spec, plan)
    if not cap:
        return None
    t = plan.micro_batch * plan.seq_len // plan.cp
    C = max(1, min(plan.a2a_chunks, t))
    return C * plan.ep * cap / t


def activation_bytes(spec: ModelSpec, plan: Plan, act_bytes: int = 2, backend: str = "kernel",
                     lora_targets: tuple = (), rank: int = 0, weight_casts: tuple = (),
                     fp32_stream: bool | None = None, expert_lora: str | None = None) -> dict:
    """The step's activation phases. 'forward end': every layer's kept set + the loss phase (logits, their
    fp32 copy and log-softmax); no parameter gradient exists yet (zero_grad(set_to_none=True)).
    'backward i' (blocks run backward from the last): blocks below i still kept, block i's activations
    (recomputed unless recompute is none) plus the gradients of its activations (x the factor), parameter
    gradients of blocks >= i and the root (see memory_breakdown). Layers above i are freed by then.
    A layer with a forward transient (`_Acc.set_work`) adds 'forward i' (what it saved so far + the transient)
    and, when recomputed, 'recompute i': blocks below i, what block i saved so far, the transient, the gradient
    of block i's output and (selective) the cached GEMM outputs the recompute has not reached yet.
    weight_casts: per layer, bytes of the bf16 copies autocast makes of the layer's fp32 weights; each matmul
    saves its copy for dx, so they live as long as the layer's activations (recompute none) or only while the
    block is recomputed (selective / full: the cast is not a GEMM, so it is recomputed).
    expert_lora: the grouped LoRA backend (kernel path); None = ops/moe's "auto" choice on CUDA, where the
    fused [W | Bᵀ] buffer exists only without FSDP (plan.shard == 1)."""
    t = plan.micro_batch * plan.seq_len // plan.cp
    full = not lora_targets
    tg = lora_targets or (frozenset(),) * spec.n_layers
    f32s = (act_bytes == 2) if fp32_stream is None else fp32_stream
    rows = ep_rows_per_token(spec, plan)
    accs = [_layer_acc(spec, i, plan.seq_len, backend, act_bytes, full, tg[i], rank, t, f32s, expert_lora,
                       fused_buffer=plan.shard == 1, expert_rows=rows, cp=plan.cp,
                       selective=plan.recompute == "selective") for i in range(spec.n_layers)]
    wc = weight_casts or (0.0,) * spec.n_layers
    per = [t * a.none + wc[i] for i, a in enumerate(accs)]
    if backend == "kernel":  # ops.loss chunked: one chunk of logits in the compute dtype (its gradient in
        # place), dh, and, when the LM head trains, its fp32 weight gradient made in the forward + one product
        from ..ops.loss.chunked import rows_per_chunk

        V, D = spec.vocab_size, spec.hidden_size
        logits = (min(t, rows_per_chunk(V)) * V * act_bytes + t * D * act_bytes
                  + (V * D * (4 + act_bytes) if full else 0))
    else:  # logits, their fp32 copy and log-softmax
        logits = t * spec.vocab_size * (act_bytes + 4 + 4)
    if plan.recompute == "none":
        kept = per
    elif plan.recompute == "selective":
        kept = [t * a.sel for a in accs]
    elif plan.offload:  # full + offload: block inputs wait in host memory; one comes back per recompute
        kept = [0.0] * spec.n_layers
    else:  # full: block inputs only, one block recomputed at a time
        kept = [t * spec.hidden_size * (4 if f32s else act_bytes)] * spec.n_layers
    f = BACKWARD_GRAD_FACTOR
    dout = t * spec.hidden_size * (4 if f32s else act_bytes)  # gradient of a block's output (residual stream)
    phases = [("forward end", sum(kept), logits, None)]
    dsa_ws = _dsa_backward_workspace(spec, plan, act_bytes, backend)
    for i, a in enumerate(accs):
        if a.work:  # the layer's largest forward transient, on top of what it saved so far
            n0, s0, sn0 = (t * x for x in a.work_at)
            so_far = {"none": n0, "selective": s0, "full": 0.0}[plan.recompute]
            # selective forward: the transient's GEMM outputs are cached ones (counted in s0)
            work = t * (a.work - (a.work_gemm if plan.recompute == "selective" else 0.0))
            phases.append((f"forward {i}", sum(kept[:i]) + so_far, work, -1))
            if plan.recompute != "none":  # in backward: the gradient of the block's output is alive too
                # selective: the cache is popped as the recompute consumes it, so block i holds what it saved
                # so far (GEMM outputs included) + the GEMM outputs not recomputed yet + the transient
                phases.append((f"recompute {i}", sum(kept[:i]) + (t * a.sel - s0 if plan.recompute == "selective"
                                                                 else 0.0),
                               n0 + t * a.work + dout * (2 if plan.offload else 1), i))  # + the input brought back
        # backward: the recompute has consumed the selective cache (GEMM outputs backward does not need, e.g.
        # the no_grad indexer scores, are freed after their use); the block holds its full saved set
        phases.append((f"backward {i}", sum(kept[:i]), f * per[i] + dsa_ws[i], i))
    # full recompute: the forward's top-k selections stay alive through every phase (kept_selections)
    sel = kept_selections(spec, plan, t) if plan.recompute == "full" else 0.0
    phases = [(name, k + sel, w, i) for name, k, w, i in phases]
    return {"layers": sum(kept) + sel, "phases": phases, "logits": logits, "tokens_per_gpu": t}


def _dsa_backward_workspace(spec: ModelSpec, plan: Plan, act_bytes: int, backend: str) -> list[float]:
    """Per layer: the P / dS buffer a DSA layer's Triton sparse-attention backward allocates (kernel backend;
    `triton_sparse_attn.backward_workspace_bytes`: the dense pass 2's [B, Tk, T, HQ] x 2 where it applies, else a
    chunk of <= 1 GiB); 0 for other layers and the reference backend (its autograd graph is in the layer's
    activations). Under context parallelism the keys are the whole sequence, the queries the local share."""
    if backend != "kernel":
        return [0.0] * spec.n_layers
    from ..ops.dsa.triton_sparse_attn import backward_workspace_bytes

    mb, seq = plan.micro_batch, plan.seq_len
    if dsa_mha_form(spec, seq, plan.cp, plan.recompute == "selective"):  # dense tiles (flex_attn.py): no P / dS buffer
        return [0.0] * spec.n_layers
    ws = backward_workspace_bytes(mb, seq // plan.cp, seq, spec.n_heads, min(spec.index_topk, seq), act_bytes)
    return [float(ws) if k == "dsa" else 0.0 for k in spec.resolved_layer_types()]


def dsa_mha_form(spec: ModelSpec, seq: int, cp: int, selective: bool) -> bool:
    """Whether the DSA layers on CUDA attend in MHA form (models/dsa_attn.py): never under context parallelism
    or selective recompute, else where `mha_form_pays` for the whole sequence."""
    if cp > 1 or selective:
        return False
    n, r, vd, c = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.kv_lora_rank
    return mha_form_pays(seq, spec.index_topk, n + r, vd, c + r, c, True, heads=spec.n_heads)


def kept_selections(spec: ModelSpec, plan: Plan, t: int) -> float:
    """Bytes of the DSA top-k selections a full recompute reuses: the model's forward keeps each indexer layer's
    [t, topk] int32 indices (its `shared` dict, referenced by every block's recompute) until the backward ends.
    Layers in index_shared_layers reuse another's; under context parallelism the selection is not kept."""
    if plan.cp > 1:
        return 0.0
    types = spec.resolved_layer_types()
    n = sum(1 for i, k in enumerate(types) if k == "dsa" and i not in spec.index_shared_layers)
    return float(n * t * min(spec.index_topk, plan.seq_len) * 4)


def cp_buffer_bytes(spec: ModelSpec, plan: Plan, act_bytes: int = 2) -> float:
    """What context parallelism adds per GPU (ops/kda/cp.py, ops/dsa/cp.py); 0 at cp = 1.

    One layer at a time (the larger of): a DSA layer's gathered key side of the whole sequence (kv latent +
    RoPE part + index key per token, act_bytes) plus, in its backward, that buffer's fp32 gradient before the
    reduce-scatter; a KDA layer's gathered fp32 (state, transition) of all 2 * cp pieces [H, K, V + K].
    Kept: without recompute every DSA layer keeps the other ranks' share of its gathered key rows for the
    backward, and every KDA layer its own 2 pieces' transition and incoming state."""
    if plan.cp == 1:
        return 0.0
    types = spec.resolved_layer_types()
    n_dsa, n_kda = types.count("dsa"), types.count("kda")
    seq, mb = plan.micro_batch * plan.seq_len, plan.micro_batch
    per_tok = spec.kv_lora_rank + spec.qk_rope_head_dim + spec.index_head_dim
    H, K = spec.kda_n_heads, spec.kda_head_dim
    dsa_transient = seq * per_tok * (act_bytes + 4) if n_dsa else 0.0
    kda_transient = 2 * plan.cp * mb * H * K * 2 * K * 4 if n_kda else 0.0
    kept = n_kda * 2 * mb * H * K * 2 * K * 4
    if plan.recompute == "none":
        kept += n_dsa * seq * (plan.cp - 1) / plan.cp * (spec.kv_lora_rank + spec.qk_rope_head_dim) * act_bytes
    return float(max(dsa_transient, kda_transient) + kept)


def memory_breakdown(spec: ModelSpec, plan: Plan, lora: LoRASpec | None, act_bytes: int = 2,
                     backend: str = "kernel", reserve_frac: float = 0.06,
                     context_bytes: float = 1.0 * GiB, base_bytes: int = 2, expert_lora: str | None = None) -> dict:
    """Per-GPU bytes at the peak of a step, by term (see the module docstring). base_bytes: frozen-base
    parameter bytes (2 = bf16 on GPU, 4 = fp32 on CPU). expert_lora: force the grouped LoRA backend of the
    kernel path (None: ops/moe's "auto" choice on CUDA)."""
    pc = param_counts(spec, lora)
    n = plan.shard
    total = pc.total
    trainable = pc.lora if lora is not None else total
    sb = state_bytes(spec, plan, lora, base_bytes)  # the runtime's shards, tensor by tensor (rank 0)
    weights, grads, optimizer = sb["weights"], sb["grads"], sb["optimizer"]
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
    # single GPU under autocast (no FSDP mixed precision): bf16 copies of the fp32 trainable weights (none with
    # bf16 weights, whose residual stream is bf16 too: the embedding's dtype)
    bf16_weights = plan.weight_bytes == 2
    casts = ()
    if act_bytes == 2 and n == 1 and not bf16_weights:
        casts = tuple(2.0 * (pc.lora_dense[i] + pc.lora_experts[i] if lora is not None else
                             pc.block_dense[i] + pc.block_experts[i]) for i in range(spec.n_layers))
    act = activation_bytes(spec, plan, act_bytes, backend, pc.lora_targets if lora is not None else (), pc.lora_rank,
                           casts, fp32_stream=act_bytes == 2 and n == 1 and not bf16_weights,
                           expert_lora=expert_lora)
    t = act["tokens_per_gpu"]
    a2a = 0.0
    if spec.n_routed_experts and plan.ep > 1:  # one layer's fixed [ep, cap, L] buffers, every chunk at once:
        L = spec.latent_dim or spec.hidden_size  # dispatch + combine, send + receive
        a2a = 4 * ep_rows_per_token(spec, plan) * t * L * act_bytes
    # parameter gradients alive in each phase (zero_grad(set_to_none=True): none in forward; in backward of
    # block i those of blocks >= i and of the root; all of them in the optimizer step)
    if lora is not None:
        tr_layer = [pc.lora_dense[i] + pc.lora_experts[i] for i in range(spec.n_layers)]
        tr_root = 0
    else:
        tr_layer = [pc.block_dense[i] + pc.block_experts[i] for i in range(spec.n_layers)]
        tr_root = pc.root
    best = None
    for name, kept, transient, i in act["phases"]:
        g = 0.0 if i is None or i < 0 else plan.weight_bytes * (tr_root + sum(tr_layer[i + 1:])) / n
        tot = g + kept + transient
        if best is None or tot > best[0]:
            best = (tot, name, g, kept, transient)
    if grads > best[0]:  # the optimizer step (all gradients, no activations) is the peak
        best = (grads, "optimizer step", grads, 0.0, 0.0)
    _, phase, grads_at_peak, kept, transient = best
    cp_buf = cp_buffer_bytes(spec, plan, act_bytes)
    sub = weights + grads_at_peak + optimizer + gathered + kept + transient + a2a + cp_buf
    reserve = reserve_frac * sub + context_bytes
    out = {"weights": weights, "grads": grads_at_peak, "optimizer": optimizer, "fsdp_gather": gathered,
           "activations": kept, "loss_or_recompute": transient, "a2a_buffers": a2a, "cp_buffers": cp_buf,
           "reserve": reserve}
    out["total"] = sum(out.values())
    out["params_total"], out["params_trainable"], out["tokens_per_gpu"] = total, trainable, t
    out["peak_phase"] = phase
    return out
