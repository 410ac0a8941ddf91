"""Tiny transformers checkpoints for the onboarding tests (never downloads)."""

import json
import os
import random

import torch
import transformers


def _glm5_next_cfg(text: dict, vision: dict | None = None):
    """GLM-5.3-Flash (glm5_next): a text config plus a one-block vision tower, its placeholder tokens (image, the
    image span's start / end, video ones) the last ids of the vocabulary."""
    vc = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=text["hidden_size"],
              projection_intermediate_size=32)
    vc.update(vision or {})
    V = text["vocab_size"]
    return transformers.Glm5NextConfig(text_config=text, vision_config=vc, image_token_id=V - 4,
                                       video_token_id=V - 3, image_start_token_id=V - 2, image_end_token_id=V - 1,
                                       video_start_token_id=V - 6, video_end_token_id=V - 5)


def tiny_cfg(model_type: str, **kw):
    """A tiny transformers config of a family (never downloads)."""
    if model_type == "glm5_next":
        base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
                    num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                    n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=0, qk_nope_head_dim=8,
                    v_head_dim=8, index_topk=8, index_head_dim=16, index_n_heads=16, index_kpool=4,
                    layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
                    indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense"] + ["sparse"] * 3,
                    linear_head_dim=8, linear_num_heads=2, hc_mult=3, hc_sinkhorn_iters=5,
                    max_position_embeddings=128, pad_token_id=0)
        base.update(kw)
        return _glm5_next_cfg(base)
    if model_type == "qwen3_moe":
        base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=8, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                    max_position_embeddings=64)
        base.update(kw)
        return transformers.Qwen3MoeConfig(**base)
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=2,
                num_attention_heads=2, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2,
                n_shared_experts=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4, qk_nope_head_dim=8,
                v_head_dim=8, n_group=1, topk_group=1, first_k_dense_replace=1, max_position_embeddings=64,
                num_nextn_predict_layers=0)
    base.update(kw)
    return transformers.DeepseekV3Config(**base)


def save_tiny(model_type: str, out, seed: int | None = None, **kw):
    """A tiny checkpoint written by transformers: fixed shapes for qwen3_moe, deepseek_v3 and glm5_next; kimi_k25
    (vision + text) takes its shapes and weights from `seed` (random_checkpoint); qwen3_5_moe (multimodal, with its
    vision tower) is `random_checkpoint` of seed 0."""
    if model_type == "kimi_k25":
        return random_checkpoint(model_type, out, fresh_seed() if seed is None else seed, **kw)
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):
        return random_checkpoint(model_type, out, 0 if seed is None else seed, **kw)
    cfg = tiny_cfg(model_type, **kw)
    cls = {"qwen3_moe": transformers.Qwen3MoeForCausalLM, "glm5_next": transformers.Glm5NextForConditionalGeneration
           }.get(model_type, transformers.DeepseekV3ForCausalLM)
    m = cls(cfg).float()
    m.save_pretrained(str(out))
    return out


def hf_model(d, **kw):
    """transformers' model of a checkpoint directory: the multimodal class where the checkpoint is multimodal (its
    module names are the checkpoint's: model.language_model.*), else the causal LM."""
    multimodal = "vision_config" in json.loads((d / "config.json").read_text())
    cls = transformers.AutoModelForImageTextToText if multimodal else transformers.AutoModelForCausalLM
    return cls.from_pretrained(str(d), **kw)


def fused_copy(src, dst):
    """The checkpoint at `src` re-saved as transformers holds it in memory (routed experts fused:
    experts.gate_up_proj [E, 2I, D], experts.down_proj [E, D, I]), the layout of Qwen3.5's release;
    save_pretrained would write them back per expert."""
    import shutil

    from safetensors.torch import save_file

    m = hf_model(src, dtype=torch.float32)
    dst.mkdir(parents=True)
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(dst / "model.safetensors"),
              metadata={"format": "pt"})
    shutil.copy(src / "config.json", dst / "config.json")
    return dst


def read_cfg(d):
    return json.loads((d / "config.json").read_text())


def fresh_seed() -> int:
    """A new seed each run (MOEADAPT_TEST_SEED fixes it); tests print it so a failure can be replayed."""
    return int(os.environ.get("MOEADAPT_TEST_SEED") or random.SystemRandom().randrange(2 ** 31))


def _random_cfg(model_type: str, rnd: random.Random):
    c = rnd.choice
    tok = dict(pad_token_id=0, bos_token_id=1, eos_token_id=2)
    n = c([2, 3])
    common = dict(vocab_size=c([64, 96, 128]), hidden_size=c([32, 48, 64]), intermediate_size=c([48, 64, 96]),
                  moe_intermediate_size=c([16, 24, 32]), num_hidden_layers=n, max_position_embeddings=128,
                  rms_norm_eps=c([1e-5, 1e-6, 3e-6]), num_experts_per_tok=2, **tok)
    if model_type == "qwen3_moe":
        H = c([2, 4])
        return transformers.Qwen3MoeConfig(num_attention_heads=H, num_key_value_heads=c([1, 2]), head_dim=c([8, 16]),
                                           num_experts=c([4, 8]), norm_topk_prob=c([True, False]),
                                           mlp_only_layers=c([[], [0]]), **common)
    if model_type == "minimax_m2":  # q / k RMSNorm over all heads, partial RoPE, sigmoid router with a bias
        common.update(intermediate_size=common["moe_intermediate_size"])
        common.pop("moe_intermediate_size")
        return transformers.MiniMaxM2Config(
            num_attention_heads=c([2, 4]), num_key_value_heads=c([1, 2]), head_dim=c([8, 16]),
            num_local_experts=c([4, 8]),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": c([0.5, 1.0])},
            **common)
    if model_type == "qwen3_next":  # Gated DeltaNet : gated full attention, partial RoPE, gated shared expert
        kinds = ["linear_attention"] * c([1, 2]) + ["full_attention", "linear_attention"]
        HK = c([1, 2])
        common.update(num_hidden_layers=len(kinds))
        return transformers.Qwen3NextConfig(
            num_attention_heads=c([2, 4]), num_key_value_heads=c([1, 2]), head_dim=c([8, 16]), num_experts=c([4, 8]),
            norm_topk_prob=c([True, False]), layer_types=kinds, linear_num_key_heads=HK,
            linear_num_value_heads=HK * c([1, 2]), linear_key_head_dim=c([8, 16]), linear_value_head_dim=c([8, 16]),
            shared_expert_intermediate_size=c([16, 24]),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": c([0.25, 0.5])},
            **common)
    if model_type == "glm5_next":  # KDA : NoPE MLA with a KPool indexer, shared-indexer layers, mHC, clamped SwiGLU
        kinds = ["linear_attention"] * c([1, 2]) + ["indexed_attention"] * 2 + ["linear_attention"] * c([0, 1])
        first = kinds.index("indexed_attention")
        idx = ["full"] * len(kinds)
        idx[first + 1] = c(["full", "shared"])
        dense = c([0, 1])
        P = c([2, 4])
        E, groups = c([4, 8]), c([1, 2])
        common.update(num_hidden_layers=len(kinds))
        H = c([2, 4])
        # 16 / 32 indexer heads: a block's score is exactly 0 (a tie torch.topk breaks its own way) only when
        # every head's ReLU is 0
        text = dict(
            num_attention_heads=H, num_key_value_heads=H, kv_lora_rank=c([16, 32]), q_lora_rank=c([16, 24]),
            qk_rope_head_dim=0, qk_nope_head_dim=c([8, 16]), v_head_dim=c([8, 16]),
            index_n_heads=c([16, 32]), index_head_dim=c([16, 32]), index_kpool=P, index_topk=P * c([2, 3]),
            layer_types=kinds, indexer_types=idx,  # (the tail always selected: a KPool query then has a key)
            mlp_layer_types=["dense"] * dense + ["sparse"] * (len(kinds) - dense),
            linear_num_heads=c([2, 4]), linear_head_dim=c([8, 16]), linear_lower_bound=c([-5.0, -2.0, None]),
            hc_mult=c([2, 3, 4]), hc_sinkhorn_iters=c([3, 20]), swiglu_limit=c([0.3, 0.6]),
            n_routed_experts=E, n_shared_experts=1, n_group=groups, topk_group=1 if groups == 1 else c([1, 2]),
            routed_scaling_factor=c([1.0, 2.5]), norm_topk_prob=c([True, False]), **common)
        # the vision tower: SwiGLU limits the activations reach, with or without the qkv / proj / MLP biases
        D = c([16, 32])
        vision = dict(depth=c([1, 2]), hidden_size=D, num_heads=c([2, 4]), intermediate_size=c([24, 40]),
                      patch_size=c([14, 16]), projection_intermediate_size=c([32, 56]), swiglu_limit=c([0.5, 1.0]),
                      rms_norm_eps=c([1e-5, 1e-6]), attention_bias=c([True, False]),
                      rope_parameters={"rope_type": "axial", "rope_theta": c([100.0, 10000.0])})
        return _glm5_next_cfg(text, vision)
    if model_type in ("qwen3_5_moe", "qwen3_5_moe_text"):  # qwen3_next with split DeltaNet projections
        kinds = ["linear_attention"] * c([1, 2]) + ["full_attention", "linear_attention"]
        HK = c([1, 2])
        common.update(num_hidden_layers=len(kinds))
        common.pop("intermediate_size")
        text = dict(
            num_attention_heads=c([2, 4]), num_key_value_heads=c([1, 2]), head_dim=c([8, 16]), num_experts=c([4, 8]),
            layer_types=kinds, linear_num_key_heads=HK, linear_num_value_heads=HK * c([1, 2]),
            linear_key_head_dim=c([8, 16]), linear_value_head_dim=c([8, 16]), shared_expert_intermediate_size=c([16, 24]),
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": c([0.25, 0.5]),
                             "mrope_section": [1, 1, 0], "mrope_interleaved": True}, **common)
        if model_type == "qwen3_5_moe_text":
            return transformers.Qwen3_5MoeTextConfig(**text)
        vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"],
                      patch_size=4, num_position_embeddings=16)
        return transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision, **tok)
    mla = dict(num_attention_heads=c([2, 4]), kv_lora_rank=c([16, 32]), qk_rope_head_dim=c([4, 8]),
               qk_nope_head_dim=c([8, 16]), v_head_dim=c([8, 16]))
    mla["num_key_value_heads"] = mla["num_attention_heads"]
    if model_type == "kimi_linear":
        E = c([4, 8])
        kda = c([1, 2])  # KDA layers before each full-attention (MLA) layer
        types = (["linear_attention"] * kda + ["full_attention"]) * 2
        n = len(types)
        common.update(num_hidden_layers=n)
        dense = c([0, 1])
        return transformers.KimiLinearConfig(
            **mla, q_lora_rank=c([None, 16]), num_experts=E, num_shared_experts=1,
            linear_num_heads=c([2, 4]), linear_head_dim=c([8, 16]), layer_types=types,
            mlp_layer_types=["dense"] * dense + ["sparse"] * (n - dense), routed_scaling_factor=c([1.0, 2.5]),
            model_max_length=128, **{k: v for k, v in common.items() if k != "max_position_embeddings"})
    if model_type == "kimi_k25":  # MoonViT + projector in front of a deepseek_v3 text model
        V = common["vocab_size"]
        text = _random_cfg("deepseek_v3", rnd).to_dict()
        # a q_lora_rank: transformers 5.24's kimi_k25 save / load renames match the text model's
        # "self_attn.q_proj" as the vision "attn.q_proj" (the real checkpoints have a q latent)
        text.update(vocab_size=V, q_lora_rank=c([16, 24]))
        D, heads = c([16, 32]), c([2, 4])
        side = c([4, 6, 8])  # the position table: image grids (2..6 patches a side) above and below it
        vision = dict(patch_size=c([14, 16]), pos_emb_height=side, pos_emb_width=side, num_attention_heads=heads,
                      num_hidden_layers=c([1, 2]), hidden_size=D, intermediate_size=c([24, 40]),
                      hidden_act=c(["gelu_pytorch_tanh", "gelu"]),
                      rope_parameters={"rope_type": "axial", "rope_theta": c([100.0, 10000.0])})
        return transformers.Kimi_K25Config(
            text_config=text, vision_config=vision, projection_hidden_size=D,
            projection_layer_norm_eps=c([1e-5, 1e-3]), image_token_id=V - 4, video_token_id=V - 3,
            vision_start_token_id=V - 2, vision_end_token_id=V - 1, tie_word_embeddings=c([True, False]))
    E, groups = c([4, 8]), c([1, 2])
    q_ranks = [16, 24] if model_type in ("deepseek_v32", "glm_moe_dsa") else [None, 16, 24]  # indexer reads q latent
    kw = dict(**mla, q_lora_rank=c(q_ranks), n_routed_experts=E, n_shared_experts=1,
              n_group=groups, topk_group=1 if groups == 1 else c([1, 2]), first_k_dense_replace=c([0, 1]),
              routed_scaling_factor=c([1.0, 2.5]), norm_topk_prob=c([True, False]), num_nextn_predict_layers=0,
              **common)
    if model_type == "deepseek_v32":
        # 32 indexer heads: a key's score is exactly 0 (a tie broken differently by transformers' topk) only when
        # all 32 ReLUs are 0
        return transformers.DeepseekV32Config(index_n_heads=32, index_head_dim=c([16, 32]),
                                              index_topk=c([8, 12, 16]), **kw)
    if model_type == "glm_moe_dsa":  # every other layer reuses the previous indexer's top-k ("shared")
        n = kw["num_hidden_layers"] = c([3, 4])
        kinds = ["full"] + [c(["full", "shared"]) for _ in range(n - 2)] + ["shared"]
        return transformers.GlmMoeDsaConfig(index_n_heads=c([4, 32]), index_head_dim=c([16, 32]),
                                            index_topk=c([8, 12, 16]), indexer_types=kinds,
                                            head_dim=mla["qk_rope_head_dim"], **kw)
    return transformers.DeepseekV3Config(**kw)


# the placeholder tokens of glm5_next's multimodal config (random_checkpoint sets them on its top level)
_GLM5_NEXT_TOP = ("image_token_id", "video_token_id", "image_start_token_id", "image_end_token_id",
                  "video_start_token_id", "video_end_token_id")


def random_checkpoint(model_type: str, out, seed: int, **overrides):
    """A tiny random checkpoint written by transformers, its shapes and weights drawn from `seed`: norms away
    from 1, router biases non-zero, so a wrong epsilon, a missed norm or a swapped tensor shows in the logits.
    `overrides` are set on the drawn config (e.g. rope_parameters; a callable gets the config)."""
    rnd = random.Random(seed)
    cfg = _random_cfg(model_type, rnd)
    for k, v in overrides.items():  # onto the text config of a multimodal model; a value may be a function of it
        if model_type == "kimi_k25" and k == "text_config":
            for kk, vv in v.items():
                setattr(cfg.text_config, kk, vv)
            continue
        top = model_type == "kimi_k25" or (model_type == "glm5_next" and k in _GLM5_NEXT_TOP)
        target = cfg if top else (getattr(cfg, "text_config", None) or cfg)
        setattr(target, k, v(target) if callable(v) else v)
    torch.manual_seed(seed)
    if model_type == "glm5_next":
        m = transformers.Glm5NextForConditionalGeneration(cfg).float()
    elif model_type == "kimi_k25":
        m = transformers.Kimi_K25ForConditionalGeneration(cfg).float()
    elif getattr(cfg, "vision_config", None) is not None:  # the multimodal model: vision weights in the checkpoint
        m = transformers.AutoModelForImageTextToText.from_config(cfg).float()
    else:
        m = transformers.AutoModelForCausalLM.from_config(cfg).float()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in m.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.2 * noise if name.endswith("weight") else 0.1 * noise)
            elif name.endswith("_hc.scale"):  # hyper-connection logit scales: mixing well away from uniform
                p.copy_(1.0 + 0.5 * noise)
            elif "index_kpool_compress" in name:  # KPool pooling logits: far from a plain mean
                p.copy_(0.3 * noise)
            elif name.endswith(("A_log", "dt_bias")):
                p.copy_(0.5 * noise)
            else:
                p.copy_(0.1 * noise)
        for name, b in m.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))
    m.save_pretrained(str(out))
    return out


def present_targets(model, targets: list[str]) -> list[str]:
    """The LoRA target patterns that name a layer of `model` (a built model, or a model directory): the random
    shapes decide whether, e.g., the MLA query is one `wq` or `wq_a` / `wq_b`, and a target that matches
    nothing is an error."""
    from moeadapt.lora.inject import _matches
    from moeadapt.models.model import build_model
    from moeadapt.models.moe import GroupedLinear
    from moeadapt.onboard import model_spec_from_dir

    if not isinstance(model, torch.nn.Module):
        model = build_model(model_spec_from_dir(model), "meta")
    names = [n for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, GroupedLinear))]
    return [t for t in targets if any(_matches(n, [t]) for n in names)]


def perturb(name: str, scale: float = 0.05):
    """A `tamper` for the validators: fixed noise added to our parameter `name` (a broken copy of a checkpoint)."""
    def tamper(m):
        with torch.no_grad():
            p = m.get_parameter(name)
            p.add_(scale * torch.randn(p.shape, generator=torch.Generator().manual_seed(0)))
    return tamper


def random_adapters(model, lora, generator: torch.Generator | None = None, scale: float | None = None):
    """Inject `lora` into `model` and fill every adapter tensor with noise (scale * N(0, 1); N(0, 1) when scale is
    None), so that the adapter really changes the model."""
    from moeadapt.lora import inject_lora

    inject_lora(model, lora)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=generator) * (1.0 if scale is None else scale))


def routing_margin(model, ids: torch.Tensor) -> float:
    """The smallest gap, over every token and MoE layer of `model` run on `ids`, between the k-th and the
    (k+1)-th expert's selection score: two implementations that agree to rounding pick the same experts only
    where this gap is above their rounding difference."""
    from moeadapt.models.router import Router

    gaps, hooks = [], []

    def capture(router, args, _out):
        x = args[0].detach().double()
        logits = x @ router.weight.detach().double().t()
        scores = logits.sigmoid() if router.spec.score_func == "sigmoid" else logits.softmax(-1)
        top = router._select_scores(scores).sort(-1, descending=True).values
        K = router.top_k
        if K < top.shape[-1]:
            gaps.append((top[:, K - 1] - top[:, K]).min().item())

    for m in model.modules():
        if isinstance(m, Router):
            hooks.append(m.register_forward_hook(capture))
    try:
        with torch.no_grad():
            model(ids)
    finally:
        for h in hooks:
            h.remove()
    return min(gaps, default=float("inf"))


def decisive_ids(model, shape, vocab: int, generator: torch.Generator, margin: float = 1e-4) -> torch.Tensor:
    """Random token ids on which every routing decision of `model` is clear by `margin` (redrawn otherwise), so
    that a comparison against another implementation, or a merged checkpoint's float32 rounding, cannot flip an
    expert on a near-tie and fail a correct model."""
    for _ in range(100):
        ids = torch.randint(0, vocab, shape, generator=generator)
        if routing_margin(model, ids) > margin:
            return ids
    raise AssertionError(f"no draw of {shape} token ids routes every token clear of a tie by {margin}")
