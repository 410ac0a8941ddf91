"""Numerical validation of an onboarded family: a tiny random-weight model of the same architecture, built by
transformers, saved as a checkpoint, onboarded by us, and compared logit for logit (float32, reference ops).

Owns: shrinking a family's config to a tiny one that keeps its features (dense prefix, q-LoRA or not, group
routing, RoPE layout, top-k normalisation, indexer) and the comparison. Families transformers lacks (or that we
do not map faithfully) get a forward-only smoke check of the tiny spec instead.
"""

from __future__ import annotations

import tempfile

import torch

from .families import Family

TOL = 1e-4  # max |logit difference| in float32


def _tiny_hf_config(fam: Family):
    import transformers

    s = fam.spec
    rope = {"rope_type": "default", "rope_theta": s.rope_theta}
    if s.rope_scaling is not None:  # YaRN with the checkpoint's factor / betas / mscales; the original context
        # shrunk with the tiny model (64 positions) so the ramp splits its 4 rope frequencies
        y = s.rope_scaling
        rope = {"rope_type": "yarn", "rope_theta": s.rope_theta, "factor": y.factor,
                "original_max_position_embeddings": 16, "beta_fast": y.beta_fast, "beta_slow": y.beta_slow,
                **{k: getattr(y, k) for k in ("mscale", "mscale_all_dim", "attention_factor") if getattr(y, k) is not None}}
    common = dict(vocab_size=128, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                  max_position_embeddings=64, rms_norm_eps=s.norm_eps, tie_word_embeddings=s.tie_word_embeddings,
                  rope_parameters=rope, num_experts_per_tok=2)
    if fam.model_type == "qwen3_moe":
        kv = 2 if s.gqa_n_kv_heads < s.n_heads else 4
        return transformers.Qwen3MoeConfig(
            num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=kv, head_dim=16, num_experts=8,
            norm_topk_prob=s.norm_topk_prob, mlp_only_layers=[0] if s.first_k_dense else [], **common)
    kw = dict(num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
              n_shared_experts=min(s.n_shared_experts, 1), routed_scaling_factor=s.routed_scaling_factor,
              kv_lora_rank=32, q_lora_rank=24 if s.q_lora_rank else None, qk_rope_head_dim=8, qk_nope_head_dim=16,
              v_head_dim=16, n_group=2 if s.n_group > 1 else 1, topk_group=1, norm_topk_prob=s.norm_topk_prob,
              first_k_dense_replace=min(s.first_k_dense, 1), rope_interleave=fam.rope_interleave,
              num_nextn_predict_layers=0, **common)
    if fam.model_type == "deepseek_v32":
        # 32 indexer heads: a key scores exactly 0 (a tie broken differently by transformers) only if all 32 ReLUs
        # are 0; top-8 of 16 keys exercises the sparse selection
        return transformers.DeepseekV32Config(index_n_heads=32, index_head_dim=16, index_topk=8, **kw)
    return transformers.DeepseekV3Config(**kw)


def _randomise(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if "norm" in n or "layernorm" in n:
                p.copy_(1.0 + 0.1 * noise if n.endswith("weight") else 0.1 * noise)
            else:
                p.copy_(0.08 * noise)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=g))


def validate_family(fam: Family, seed: int = 0, seq_len: int = 16, batch: int = 2) -> dict:
    """Compare our logits with transformers' on a tiny random model of fam's architecture. Returns a dict with
    max_abs_diff, tolerance, passed (or a smoke-test result where transformers has no faithful reference)."""
    from . import onboard_model

    if fam.hf_class is None or fam.model_type == "kimi_linear":
        return _smoke(fam, seed, seq_len)
    try:
        import transformers
    except ImportError as e:
        raise ImportError("--validate needs transformers (pip install 'moeadapt[dev]')") from e
    cfg = _tiny_hf_config(fam)
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    hf = getattr(transformers, fam.hf_class)(cfg).float().eval()
    _randomise(hf, seed)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(seed + 1))
    with tempfile.TemporaryDirectory() as tmp:
        hf.save_pretrained(tmp)
        ours, res = onboard_model(tmp, dtype=torch.float32, device="cpu")
        with torch.no_grad():
            ref = hf(input_ids=ids).logits.float()
            got = ours(ids).logits.float()
    diff = (ref - got).abs().max().item()
    return {"family": fam.model_type, "reference": f"transformers {transformers.__version__} {fam.hf_class}",
            "tiny": {"layers": cfg.num_hidden_layers, "hidden": cfg.hidden_size, "seq_len": seq_len,
                     "rope": cfg.rope_parameters.get("rope_type", "default")},
            "max_abs_diff": diff, "max_abs_logit": ref.abs().max().item(), "tolerance": TOL,
            "passed": bool(diff <= TOL), "tensors": res["tensors"]}


def _smoke(fam: Family, seed: int, seq_len: int) -> dict:
    from ..models.model import build_model, materialize

    s = fam.spec
    types = s.resolved_layer_types()
    keep = sorted(set(types), key=types.index)
    tiny_types = (keep * 2)[:max(2, len(keep))]
    spec = s.model_copy(update=dict(
        vocab_size=128, hidden_size=64, n_layers=len(tiny_types), layer_types=tiny_types, kda_n_heads=2,
        kda_head_dim=16, n_heads=4, q_lora_rank=24 if s.q_lora_rank else None, kv_lora_rank=32, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, index_n_heads=2, index_head_dim=16,
        index_topk=min(s.index_topk, 64), max_position_embeddings=64, first_k_dense=min(s.first_k_dense, 1),
        intermediate_size=96, n_routed_experts=8, n_experts_per_tok=2, n_group=1, topk_group=1,
        moe_intermediate_size=32, latent_dim=32 if s.latent_dim else None, shared_intermediate_size=None,
        gqa_n_kv_heads=2, gqa_head_dim=16))
    m = materialize(build_model(type(s)(**spec.model_dump()), "meta"), "cpu", seed=seed)
    m.set_backend("reference")
    with torch.no_grad():
        logits = m(torch.randint(0, 128, (1, seq_len))).logits
    ok = bool(torch.isfinite(logits).all())
    return {"family": fam.model_type, "reference": None, "passed": ok, "max_abs_diff": None,
            "note": "no faithful transformers reference for this family: forward smoke test of the tiny spec only"}

