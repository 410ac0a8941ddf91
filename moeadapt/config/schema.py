"""Pydantic schemas for everything a run is configured by.

Owns: ModelSpec, LoRASpec, TrainSpec, DataSpec, ParallelSpec and RunConfig, and their validation.
Every check lives here, where a bad value enters, and raises one sentence naming the field and the fix.
Must not import torch or any other part of moeadapt (config is the root of the import graph).
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Strict(BaseModel):
    """Unknown keys are errors: a typo in a YAML file must not be silently ignored."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, protected_namespaces=())


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


class RopeScaling(_Strict):
    """YaRN RoPE scaling (arXiv 2309.00071) as DeepSeek-V3 / Kimi K2 checkpoints ship it, with transformers'
    semantics: inverse frequencies blended between theta^(-2i/d) (fast dims, extrapolated) and that / factor
    (slow dims, interpolated) by a linear ramp over the dims whose rotation count at
    original_max_position_embeddings lies between beta_fast and beta_slow; cos/sin multiplied by
    attention_factor (default mscale(factor, mscale) / mscale(factor, mscale_all_dim), or mscale(factor) when
    either is unset); MLA softmax scale multiplied by mscale(factor, mscale_all_dim)^2 when mscale_all_dim is
    set; mscale(s, m) = 0.1 m ln s + 1 for s > 1, else 1."""

    type: Literal["yarn"] = "yarn"
    factor: float = Field(gt=0)
    original_max_position_embeddings: int = Field(gt=0)
    beta_fast: float = Field(default=32.0, gt=0)
    beta_slow: float = Field(default=1.0, gt=0)
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


class VisionSpec(_Strict):
    """The vision tower in front of the language model (models/vision/): a ViT over variable-resolution images
    (patches of `patch_size` pixels, 2-D rotary positions, images packed by cu_seqlens), a merge_size x merge_size
    patch merger and an MLP projector into the language model's hidden size. Every image placeholder token
    (`image_token_id`) in the text is replaced by one projected image token; an image of H x W pixels (multiples
    of patch_size * merge_size after resizing) gives (H / patch / merge) * (W / patch / merge) tokens."""

    patch_size: Literal[14, 16] = 14
    in_channels: int = Field(default=3, gt=0)
    hidden_size: int = Field(default=64, gt=0)
    n_layers: int = Field(default=2, gt=0)
    n_heads: int = Field(default=4, gt=0)
    intermediate_size: int = Field(default=256, gt=0)
    merge_size: Literal[2] = 2
    projector_hidden_size: int | None = Field(default=None, gt=0, description="None = the LM's hidden_size")
    rope_theta: float = Field(default=10000.0, gt=0)
    norm_eps: float = Field(default=1e-6, gt=0)
    image_token_id: int = Field(default=263, ge=0, description="placeholder token (byte tokenizer: <|image|> = 263)")
    image_mean: tuple[float, float, float] = (0.5, 0.5, 0.5)
    image_std: tuple[float, float, float] = (0.5, 0.5, 0.5)
    # layout options of onboarded towers (MoonViT, models/vision/tower.py); the defaults are the tower above
    pos_embed_grid: tuple[int, int] | None = Field(
        default=None, description="(rows, cols) of a learned absolute position table added after the patch "
        "embedding, resampled bicubically (align_corners=False) to each image's patch grid; None = none")
    mlp_act: Literal["gelu", "gelu_tanh", "swiglu"] = Field(
        default="gelu", description="block MLP: fc2(GELU(fc1 x)) with exact GELU or its tanh approximation, or "
        "fc2(SiLU(fc1 x) * fc3 x)")
    swiglu_limit: float | None = Field(default=None, gt=0, description="SwiGLU clamps (GLM): gate <= limit, "
                                       "|up| <= limit; None = no clamp")
    norm: Literal["layernorm", "rmsnorm"] = Field(default="layernorm", description="the blocks' and the tower's "
                                                   "final norm")
    qk_norm: bool = Field(default=False, description="RMSNorm over each head's q and k before RoPE")
    temporal_patch_size: int = Field(default=1, ge=1, description="frames a patch kernel spans (Conv3d "
                                     "towers); an image fills them all, so the kernel's frames are summed")
    projector: Literal["mlp", "glm"] = Field(
        default="mlp", description="mlp: LayerNorm per patch, 2 x 2 concat, fc2(GELU(fc1 x)); glm: 2 x 2 concat "
        "(no norm), a linear 4 D -> lm_hidden stored as a Conv2d kernel, proj, LayerNorm, GELU, then a SwiGLU "
        "through projector_hidden_size (clamped by swiglu_limit)")
    merger_norm_eps: float | None = Field(default=None, gt=0, description="the merger LayerNorm's epsilon; "
                                          "None = norm_eps")
    patch_embed_conv: bool = Field(default=False, description="patch embedding weight stored as a Conv2d kernel "
                                   "[hidden, channels, patch, patch] (same math as the [hidden, C * p * p] linear)")

    @model_validator(mode="after")
    def _check(self) -> VisionSpec:
        if self.hidden_size % self.n_heads:
            raise ValueError(f"vision.n_heads={self.n_heads} does not divide vision.hidden_size={self.hidden_size}; "
                             f"choose n_heads in {_divisors(self.hidden_size)}")
        if self.temporal_patch_size > 1 and not self.patch_embed_conv:
            raise ValueError(f"vision.temporal_patch_size={self.temporal_patch_size} needs patch_embed_conv: true "
                             "(the kernel is kept as [hidden, channels, frames, patch, patch])")
        if self.pos_embed_grid is not None and min(self.pos_embed_grid) < 1:
            raise ValueError(f"vision.pos_embed_grid={self.pos_embed_grid} must hold two positive sizes")
        if (self.hidden_size // self.n_heads) % 4:
            raise ValueError(f"vision head dim {self.hidden_size // self.n_heads} must be a multiple of 4 (2-D RoPE "
                             "rotates pairs on a row half and a column half); change vision.hidden_size or n_heads")
        return self


class ModelSpec(_Strict):
    """The architecture: a hybrid KDA / gated-DSA transformer with a (latent) MoE FFN.

    Layer i is attention type `layer_types[i]`; by default every `dsa_every`-th layer is DSA
    (3 KDA : 1 DSA for dsa_every=4). FFN is dense for the first `first_k_dense` layers, MoE after.
    """

    name: str = "custom"
    vocab_size: int = Field(gt=0)
    hidden_size: int = Field(gt=0)
    n_layers: int = Field(gt=0)
    layer_types: list[Literal["kda", "dsa", "gqa", "gdn"]] | None = None
    dsa_every: int = Field(default=4, ge=1)
    max_position_embeddings: int = Field(default=4096, gt=0)
    rope_theta: float = Field(default=10000.0, gt=0)
    rope_scaling: RopeScaling | None = None  # None: plain RoPE
    norm_eps: float = Field(default=1e-6, gt=0)
    tie_word_embeddings: bool = False
    initializer_range: float = Field(default=0.02, gt=0)

    # KDA (Kimi Delta Attention)
    kda_n_heads: int = Field(default=4, gt=0)
    kda_head_dim: int = Field(default=32, gt=0)
    kda_conv_size: int = Field(default=4, ge=1)
    kda_gate_lower_bound: float | None = Field(default=None, lt=0, description="lower-bounded decay gate "
                                               "g = bound * sigmoid(exp(A_log) * (x W_f + dt_bias)) in [bound, 0] "
                                               "instead of -exp(A_log) * softplus(...) (GLM-5.3-Flash: -5)")

    # gated DSA = MLA projections + lightning indexer + sparse attention + sigmoid output gate
    n_heads: int = Field(default=4, gt=0)
    q_lora_rank: int | None = Field(default=64, gt=0)
    kv_lora_rank: int = Field(default=64, gt=0)
    qk_nope_head_dim: int = Field(default=32, gt=0)
    qk_rope_head_dim: int = Field(default=16, ge=0, description="0 = no rope part (GLM-5.3-Flash's NoPE MLA)")
    v_head_dim: int = Field(default=32, gt=0)
    index_n_heads: int = Field(default=4, gt=0)
    index_head_dim: int = Field(default=32, gt=0)
    index_topk: int = Field(default=2048, gt=0)
    index_loss_coef: float = Field(default=0.0, ge=0)
    index_norm_eps: float = Field(default=1e-5, gt=0, description="epsilon of the indexer key LayerNorm "
                                  "(DeepSeek-V3.2 checkpoints: 1e-6)")
    index_shared_layers: list[int] = Field(default_factory=list, description="DSA layers without an indexer of "
                                           "their own: they reuse the top-k of the nearest earlier DSA layer that "
                                           "has one (GLM-5's 'shared' indexer layers)")
    index_kpool: int | None = Field(default=None, gt=0, description="KPool indexer: the keys of each complete "
                                    "block of index_kpool tokens are pooled (a softmax over the block, per channel, "
                                    "of x W_pool + ape) and the indexer selects index_topk / index_kpool blocks; "
                                    "None = a per-token indexer (DeepSeek-V3.2)")
    index_kpool_select_tail: bool = Field(default=True, description="KPool: every query also attends to the "
                                          "tokens of its own incomplete block")
    mla_rope: bool = Field(default=True, description="rotate the qk_rope_head_dim channels of the MLA query and "
                           "shared key; False = NoPE MLA (Kimi Linear): those channels are used unrotated")
    mla_norm_eps: float | None = Field(default=None, gt=0, description="epsilon of the MLA q / kv latent RMSNorms; "
                                       "None = norm_eps (DeepSeek / Kimi checkpoints fix it at 1e-6)")

    attn_output_gate: bool = Field(default=True, description="sigmoid(x W_gate) head-wise output gate on DSA")

    # plain grouped-query attention ("gqa" layers; query heads = n_heads), for onboarded families such as
    # qwen3_moe: q/k/v/o projections, optional per-head RMSNorm on q and k, half-split RoPE on the head dim
    gqa_n_kv_heads: int = Field(default=2, gt=0)
    gqa_head_dim: int = Field(default=32, gt=0)
    gqa_qk_norm: bool = True
    gqa_qk_norm_full: bool = Field(default=False, description="the q / k RMSNorm spans all heads' channels "
                                   "together (MiniMax-M2) instead of each head")
    gqa_output_gate: bool = Field(default=False, description="q_proj also gives a per-channel gate per head "
                                  "([q_h | gate_h]); the attention output is multiplied by sigmoid(gate) (Qwen3-Next)")
    gqa_rope_dim: int | None = Field(default=None, gt=0, description="partial RoPE: rotate only the first "
                                     "gqa_rope_dim channels of each head; None = the whole head")

    # Gated DeltaNet ("gdn" layers, Qwen3-Next): KDA with one decay per head and grouped value heads
    gdn_n_key_heads: int = Field(default=2, gt=0)
    gdn_n_value_heads: int = Field(default=4, gt=0)
    gdn_key_head_dim: int = Field(default=32, gt=0)
    gdn_value_head_dim: int = Field(default=32, gt=0)
    gdn_proj_layout: Literal["grouped", "split"] = Field(
        default="grouped", description="the input projections of a gdn layer: 'grouped' = one in_proj_qkvz and one "
        "in_proj_ba, rows grouped per key head (Qwen3-Next); 'split' = in_proj_qkv ([q | k | v], head-major), "
        "in_proj_z, in_proj_b, in_proj_a (Qwen3.5)")

    # FFN / MoE
    first_k_dense: int = Field(default=1, ge=0)
    intermediate_size: int = Field(default=256, gt=0, description="dense FFN width")
    n_routed_experts: int = Field(default=8, ge=0)
    n_experts_per_tok: int = Field(default=2, ge=1)
    n_shared_experts: int = Field(default=1, ge=0)
    moe_intermediate_size: int = Field(default=64, gt=0)
    shared_intermediate_size: int | None = Field(default=None, gt=0, description="per shared expert; None = moe_intermediate_size")
    shared_expert_gate: bool = Field(default=False, description="multiply the shared expert's output by "
                                     "sigmoid(x W_g), one scalar per token (Qwen3-Next)")
    swiglu_limit: float | None = Field(default=None, gt=0, description="clamped SwiGLU in every FFN and expert: "
                                       "silu(min(gate, limit)) * clamp(up, -limit, limit); None = unclamped")
    latent_dim: int | None = Field(default=None, gt=0, description="LatentMoE width; None = plain MoE")
    latent_norm: bool = True
    score_func: Literal["sigmoid", "softmax"] = "sigmoid"
    router_matmul: Literal["bf16x2", "fp32", "tf32", "bf16"] = Field(
        default="bf16x2", description="the router's logit GEMM under bf16 autocast (logits and scores stay fp32): "
        "bf16x2 = bf16 tensor cores with the fp32 weight (and, backward, the fp32 gradient) split into two bf16 "
        "terms, 16 mantissa bits, and the bf16 input exact, fp32 sums (no fp32 copy of the input; an input that "
        "is not bf16, or torch < 2.8, runs as tf32); tf32 = tensor cores, inputs rounded to 10 mantissa bits "
        "(H200: within 3% of bf16's layer time); fp32 = full precision (+31% on a frozen E=896 layer); "
        "bf16 = bf16 inputs. Where the weight itself is bf16 (train.weight_dtype fp32_split, the one-GPU "
        "full fine-tuning default, or bf16; FSDP2's bf16 gathers under torchrun) its low term is zero: the "
        "logits of the bf16-rounded weight")
    n_group: int = Field(default=1, ge=1)
    topk_group: int = Field(default=1, ge=1)
    routed_scaling_factor: float = Field(default=1.0, gt=0)
    norm_topk_prob: bool = True
    aux_loss_coef: float = Field(default=0.0, ge=0, description="global-batch load-balance loss")
    seq_aux_loss_coef: float = Field(default=0.0, ge=0, description="sequence-level load-balance loss")
    z_loss_coef: float = Field(default=0.0, ge=0)
    bias_update_rate: float = Field(default=1e-3, ge=0, description="aux-loss-free balancing; 0 = off")
    capacity_factor: float | None = Field(default=None, gt=0, description="None = dropless")
    drop_policy: Literal["probs", "position", "reroute"] = "probs"
    vision: VisionSpec | None = Field(default=None, description="vision tower (image understanding); None = text")

    # hyper-connections (mHC, as in GLM-5.3-Flash): hc_mult residual streams; before each attention / FFN sublayer
    # they are collapsed into its input, its output is expanded back and the streams are mixed by a
    # Sinkhorn-normalised (doubly stochastic) matrix, all weights computed per token (models/hyper.py)
    hc_mult: int = Field(default=1, ge=1, description="residual streams; 1 = a plain residual stream (off)")
    hc_sinkhorn_iters: int = Field(default=20, ge=1)
    hc_eps: float = Field(default=1e-6, gt=0, description="floor added to the hyper-connection weights and the "
                          "Sinkhorn normalisers")

    @model_validator(mode="after")
    def _check(self) -> ModelSpec:
        if self.layer_types is not None and len(self.layer_types) != self.n_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but n_layers={self.n_layers}; "
                "give one 'kda', 'dsa' or 'gqa' per layer, or drop layer_types to use dsa_every"
            )
        if self.layer_types is not None and "gqa" in self.layer_types:
            if self.n_heads % self.gqa_n_kv_heads:
                raise ValueError(f"gqa_n_kv_heads={self.gqa_n_kv_heads} does not divide n_heads={self.n_heads}; "
                                 "choose a divisor of n_heads")
            if self.gqa_head_dim % 2:
                raise ValueError(f"gqa_head_dim={self.gqa_head_dim} must be even (RoPE rotates pairs)")
            rd = self.gqa_rope_dim
            if rd is not None and (rd % 2 or rd > self.gqa_head_dim):
                raise ValueError(f"gqa_rope_dim={rd} must be even and at most gqa_head_dim={self.gqa_head_dim}")
        if self.layer_types is not None and "gdn" in self.layer_types and self.gdn_n_value_heads % self.gdn_n_key_heads:
            raise ValueError(f"gdn_n_key_heads={self.gdn_n_key_heads} does not divide gdn_n_value_heads="
                             f"{self.gdn_n_value_heads}; value heads are grouped over the key heads")
        if self.first_k_dense > self.n_layers:
            raise ValueError(f"first_k_dense={self.first_k_dense} exceeds n_layers={self.n_layers}")
        if self.first_k_dense < self.n_layers:
            e, k = self.n_routed_experts, self.n_experts_per_tok
            if e < 1:
                raise ValueError("n_routed_experts must be >= 1 when any layer is MoE (first_k_dense < n_layers)")
            if k > e:
                raise ValueError(f"n_experts_per_tok={k} exceeds n_routed_experts={e}; lower n_experts_per_tok")
            if e % self.n_group:
                raise ValueError(
                    f"n_group={self.n_group} does not divide n_routed_experts={e}; choose n_group in {_divisors(e)}"
                )
            if self.topk_group > self.n_group:
                raise ValueError(f"topk_group={self.topk_group} exceeds n_group={self.n_group}")
            if self.n_group > 1 and self.topk_group * (e // self.n_group) < k:
                raise ValueError(
                    f"topk_group={self.topk_group} groups of {e // self.n_group} experts cannot supply "
                    f"n_experts_per_tok={k} experts; raise topk_group"
                )
        if self.index_shared_layers:
            types = self.resolved_layer_types()
            bad = [i for i in self.index_shared_layers if not 0 <= i < self.n_layers or types[i] != "dsa"]
            if bad:
                raise ValueError(f"index_shared_layers {bad} are not DSA layers; list only 'dsa' layers")
            first = next(i for i, t in enumerate(types) if t == "dsa")
            if first in self.index_shared_layers:
                raise ValueError(f"index_shared_layers holds layer {first}, the first DSA layer: it has no earlier "
                                 "indexer to share; remove it")
        if self.index_kpool is not None and "dsa" in self.resolved_layer_types():
            if self.index_topk % self.index_kpool:
                raise ValueError(f"index_topk={self.index_topk} is not a multiple of index_kpool={self.index_kpool}; "
                                 "the KPool indexer selects index_topk / index_kpool whole blocks")
            if self.index_loss_coef > 0:
                raise ValueError("index_loss_coef > 0 trains the indexer by its KL loss, which the KPool indexer "
                                 "(index_kpool) does not implement; set index_loss_coef: 0")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.qk_rope_head_dim > self.index_head_dim:
            raise ValueError(
                f"index_head_dim={self.index_head_dim} must be >= qk_rope_head_dim={self.qk_rope_head_dim} "
                "(the indexer applies RoPE to its first rope-dim channels)"
            )
        if self.vision is not None and self.vision.image_token_id >= self.vocab_size:
            raise ValueError(f"vision.image_token_id={self.vision.image_token_id} is outside vocab_size="
                             f"{self.vocab_size}; give the tokenizer's image placeholder id")
        return self

    def resolved_layer_types(self) -> list[str]:
        if self.layer_types is not None:
            return list(self.layer_types)
        return ["dsa" if (i + 1) % self.dsa_every == 0 else "kda" for i in range(self.n_layers)]

    def is_moe_layer(self, i: int) -> bool:
        return i >= self.first_k_dense and self.n_routed_experts > 0


DEFAULT_LORA_TARGETS = [
    # attention projections (KDA and DSA)
    "attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.o_proj",
    "attn.wq_b", "attn.wkv_a", "attn.wo",
    # routed experts (grouped adapters) and the latent projections
    "experts.w1", "experts.w2", "experts.w3",
]


class LoRASpec(_Strict):
    """Low-rank adapters. `targets` are module-name suffixes (fnmatch patterns allowed)."""

    rank: int = Field(default=16, gt=0)
    alpha: float = Field(default=32.0, gt=0)
    dropout: float = Field(default=0.0, ge=0, lt=1)
    targets: list[str] = Field(default_factory=lambda: list(DEFAULT_LORA_TARGETS))
    # vision-language models (ms-swift / LLaMA-Factory defaults: tower and projector frozen, LoRA on the LM only).
    # `targets` apply to the language model; these switches add the vision side.
    vision_tower: Literal["frozen", "lora"] = Field(default="frozen", description="lora: adapters on every "
                                                    "linear of the ViT blocks (qkv, proj, fc1, fc2)")
    projector: Literal["frozen", "lora", "full"] = Field(default="frozen", description="lora: adapters on the "
                                                         "projector's linears; full: train it fully (PEFT "
                                                         "modules_to_save)")

    @field_validator("targets")
    @classmethod
    def _nonempty(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("targets is empty; list module-name patterns such as 'attn.q_proj' or 'experts.w1'")
        return v

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class TrainSpec(_Strict):
    steps: int = Field(default=200, gt=0)
    lr: float = Field(default=1e-3, gt=0)
    min_lr_ratio: float = Field(default=0.1, ge=0, le=1)
    warmup_steps: int | None = Field(default=None, ge=0, description="None = 5% of steps")
    weight_decay: float = Field(default=0.0, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float | None = Field(default=1.0, gt=0)
    micro_batch_size: int = Field(default=8, gt=0)
    grad_accum_steps: int = Field(default=1, gt=0)
    merge_microbatches: bool = Field(default=False, description="run the grad_accum_steps micro-batches as one "
                                     "forward whose experts see all their tokens at once (attention stays per "
                                     "micro-batch; the loss is the mean of per-micro-batch means)")
    seq_len: int = Field(default=256, gt=1)
    seed: int = 0
    log_every: int = Field(default=10, gt=0)
    eval_every: int | None = Field(default=None, gt=0)
    eval_batches: int = Field(default=8, gt=0)
    save_every: int | None = Field(default=None, gt=0)
    output_dir: str = "runs/run"
    dtype: Literal["auto", "bf16", "fp32"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    init_from: str | None = Field(default=None, description="a model directory (config.json + safetensors, ours "
                                  "or Hugging Face, one file or indexed shards) or a full-training DCP step_N "
                                  "directory; every rank reads only its shards")
    export_shard_gb: float = Field(default=5.0, gt=0, description="largest safetensors file of the exported "
                                   "model/ (sharded as model-0000k-of-0000n.safetensors beyond it)")
    resume: bool = Field(default=False, description="resume from output_dir/checkpoints/latest")
    max_bad_steps: int = Field(default=5, gt=0, description="stop after this many steps in a row with a NaN/Inf "
                               "loss or gradient norm")
    keep_last_checkpoints: int | None = Field(default=None, gt=0, description="delete older step_* checkpoints "
                                              "beyond the newest N after each save; None = keep all")
    tensorboard: bool = False
    kernel_backend: Literal["auto", "reference", "triton"] = "auto"
    weight_copies: bool = Field(default=True, description="one-process bf16 training (LoRA, or full fine-tuning "
                                "with train.weight_dtype fp32): the matmuls read bf16 copies of the fp32 weights / "
                                "adapters that the optimizer rewrites each step, and the gradients stay bf16 "
                                "(train/copies.py; the same values as autocast's casts); taken where the step has "
                                "one forward and no recompute. Off, train.weight_dtype auto is fp32 too: autocast's "
                                "per-use casts")
    moment_dtype: Literal["fp32", "bf16"] = Field(default="fp32", description="dtype of AdamW's two moments: "
                                                  "bf16 keeps them in 4 bytes a parameter instead of 8, stored "
                                                  "stochastically rounded (ops/optim/reference.py); on a GPU "
                                                  "(the trainer's CopyAdamW, which under FSDP2 steps the local "
                                                  "shards)")
    weight_dtype: Literal["auto", "fp32", "bf16", "fp32_split"] = Field(
        default="auto", description="how the trained weights are kept: fp32; bf16 (full fine-tuning, one GPU) "
        "stores them in 2 bytes a parameter with no fp32 weight and no compute copy, updated in fp32 and stored "
        "stochastically rounded; fp32_split (full fine-tuning, one GPU) keeps the fp32 weight exactly as its "
        "bf16 rounding (the parameter the matmuls read: no copy) and the 16 bits it drops (int16, in the "
        "optimizer's state), so the update is fp32's bit for bit with 2 bytes a parameter less memory and "
        "traffic than fp32 + copy (ops/optim/reference.py); with bf16 and fp32_split the gradients are bf16 and "
        "the residual stream runs in bf16; the MoE routers' weights stay fp32 under both. auto: fp32_split where it "
        "runs (train/copies.py resolve_weight_dtype), else fp32")
    cuda_graph: bool | Literal["auto"] = Field(
        default="auto", description="capture the step's forwards and backwards once as a CUDA graph and replay it "
        "(train/graph.py), so that the host no longer bounds the step. auto (the default): on where the run allows "
        "it (one process on a GPU; fixed shapes: no packed documents or images; dropless experts; no offloaded "
        "activations, nor LoRA dropout under recompute; the Triton kernels), eager elsewhere; true: required (a "
        "run it cannot serve is refused, with the reason); false: eager steps")

    @field_validator("betas")
    @classmethod
    def _betas(cls, v: tuple[float, float]) -> tuple[float, float]:
        if not all(0.0 <= b < 1.0 for b in v):
            raise ValueError(f"betas={list(v)}: each Adam beta must be in [0, 1) (decay rates of the moment "
                             "averages); the usual values are [0.9, 0.95]")
        return v

    @model_validator(mode="after")
    def _check(self) -> TrainSpec:
        if self.warmup_steps is None:
            object.__setattr__(self, "warmup_steps", self.steps // 20)
        if self.warmup_steps > self.steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} exceeds steps={self.steps}; lower warmup_steps")
        return self


class DataSpec(_Strict):
    """`train` / `eval` are JSONL paths, or `builtin:NAME` for data shipped with the package."""

    train: str = "builtin:tinystories"
    eval: str | None = None
    format: Literal["auto", "text", "chat"] = "auto"
    tokenizer: str = Field(default="auto", description="'auto' (tokenizer.json of train.init_from if present, "
                           "else byte-level), 'byte', or a path holding tokenizer.json")
    eval_fraction: float = Field(default=0.05, ge=0, lt=1, description="held-out share when eval is unset")
    pack_documents: bool = Field(default=False, description="keep the documents packed into a row apart: each "
                                 "sees only itself (the model gets position_ids that restart per document) and "
                                 "a document's last token takes no loss; false: a row's documents see each other")
    # image + text records (a `vision:` model): each image is resized, aspect kept, to H x W multiples of
    # patch_size * merge_size with min_pixels <= H * W <= max_pixels
    min_pixels: int = Field(default=28 * 28, gt=0)
    max_pixels: int = Field(default=448 * 448, gt=0)
    skip_bad_images: bool = Field(default=False, description="drop records whose image is missing, unreadable or "
                                  "truncated (counted and reported) instead of stopping with an error")

    @model_validator(mode="after")
    def _check(self) -> DataSpec:
        if self.min_pixels > self.max_pixels:
            raise ValueError(f"data.min_pixels={self.min_pixels} exceeds data.max_pixels={self.max_pixels}")
        return self


class ParallelSpec(_Strict):
    dp_replicate: int = Field(default=1, ge=1)
    dp_shard: int = Field(default=1, ge=1)
    ep: int = Field(default=1, ge=1)
    cp: int = Field(default=1, ge=1)
    activation_checkpointing: Literal["none", "selective", "full"] = "none"
    offload_activations: bool = Field(default=False, description="full recompute only: keep each block's "
                                      "input in (pinned) host memory instead of on the GPU")
    reshard_after_forward: bool = True
    a2a_chunks: int = Field(default=1, ge=1)
    ep_capacity_factor: float = Field(default=1.5, description="EP exchange rows per rank pair and chunk, as a "
                                      "multiple of the balanced share T*K/ep (rounded up to 64); an overflow "
                                      "grows it and re-runs the step, so results stay exact")

    @property
    def world_size(self) -> int:
        return self.dp_replicate * self.dp_shard * self.cp

    @model_validator(mode="after")
    def _capacity_factor_positive(self) -> ParallelSpec:
        f = self.ep_capacity_factor
        if not (math.isfinite(f) and f > 0):
            raise ValueError(f"parallel.ep_capacity_factor={f} must be a finite number > 0 (the default 1.5 leaves "
                             "room for 1.5x the balanced share of rows per EP rank pair); e.g. 1.5 or 2.0")
        return self

    @model_validator(mode="after")
    def _offload_needs_full(self) -> ParallelSpec:
        if self.offload_activations and self.activation_checkpointing != "full":
            raise ValueError(f"parallel.offload_activations offloads the block inputs that full recompute keeps; "
                             f"set parallel.activation_checkpointing: full (got "
                             f"{self.activation_checkpointing!r}) or offload_activations: false")
        return self

    def validate_seq_len(self, seq_len: int) -> None:
        """Under cp every sequence is cut into 2 * cp equal pieces (rank r holds pieces r and 2cp-1-r)."""
        n = 2 * self.cp
        if self.cp > 1 and seq_len % n:
            lo, hi = seq_len // n * n, -(-seq_len // n) * n
            raise ValueError(f"train.seq_len={seq_len} does not split over cp={self.cp} into {n} equal pieces "
                             f"(each cp rank holds a head and a tail piece); use a multiple of {n}, e.g. "
                             f"{lo or n} or {hi}")

    def validate_for(self, model: ModelSpec, world_size: int | None = None) -> None:
        """Check the degrees against a model and (optionally) the launched world size."""
        e = model.n_routed_experts
        if e and e % self.ep:
            ok = ", ".join(str(d) for d in _divisors(e) if (self.dp_shard * self.cp) % d == 0)
            raise ValueError(f"ep={self.ep} does not divide n_routed_experts={e}; choose ep in {{{ok}}}")
        if (self.dp_shard * self.cp) % self.ep:
            raise ValueError(
                f"ep={self.ep} does not divide dp_shard*cp={self.dp_shard * self.cp}; experts are placed on the "
                "sharding ranks, so ep must divide dp_shard*cp"
            )
        if world_size is not None and world_size != self.world_size:
            raise ValueError(
                f"world size {world_size} != dp_replicate*dp_shard*cp = {self.dp_replicate}*{self.dp_shard}*{self.cp}"
                f" = {self.world_size}; launch {self.world_size} processes or change the degrees"
            )


class RunConfig(_Strict):
    """One YAML file = one RunConfig. `model` is a preset name, a model directory, or a ModelSpec mapping
    (optionally `preset: NAME` plus overrides)."""

    model: ModelSpec
    lora: LoRASpec | None = None
    train: TrainSpec = Field(default_factory=TrainSpec)
    data: DataSpec = Field(default_factory=DataSpec)
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        self.parallel.validate_for(self.model)
        self.parallel.validate_seq_len(self.train.seq_len)
        return self
