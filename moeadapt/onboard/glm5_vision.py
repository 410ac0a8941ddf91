"""The vision tower of glm5_next (GLM-5.3-Flash): its `vision_config` -> VisionSpec, the name map of the tower's
tensors (`model.visual.*`), and a validation of the tower + projector alone against transformers'
Glm5NextVisionModel on random images.

Owns only the vision side: the text model of glm5_next is mapped in families.py / names.py; `_glm5_next` attaches
`read_glm5_next_vision(reader)` as its spec's `vision` (the vision fields reported with the rest of the config)
and `build_rules` adds `glm5_next_vision_rules(spec)` under `vision.`, so onboarding, training and
`validate.validate_checkpoint` (image + text documents) see the whole model; `validate_glm5_next_vision` checks
the tower + projector alone. The tower: a Conv3d patch kernel over `temporal_patch_size` frames (an image fills them all), RMSNorms,
per-head q / k RMSNorm, 2-D RoPE with the row and column frequencies in consecutive quarters of the head
(`_glm_rope_rows` permutes q / k rows and the q / k norm weights onto our layout), clamped SwiGLU MLPs; the
projector: post-norm, a 2 x 2 stride-2 convolution, proj, LayerNorm, GELU, clamped SwiGLU (tower.py
`GLMProjector`). Patches come in the merge-block order of its processor, which is ours (data/multimodal.py).
transformers is imported only by `validate_glm5_next_vision`.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import torch
from pydantic import ValidationError
from torch import nn

from ..config import VisionSpec
from ..config.load import format_validation_error
from .families import HARMLESS, OnboardError, _Reader, _sub_reader
from .names import Rule

PREFIX = "model.visual."
_VISION_HARMLESS = {"attention_dropout", "image_size", "initializer_range"}  # image_size: no position table


def glm5_next_vision_spec(cfg: dict, allow_unmapped: bool = False) -> VisionSpec:
    """The VisionSpec of a glm5_next config.json (its `vision_config`, the image token, the text hidden size).
    Raises OnboardError naming every vision field that is not understood or cannot be honoured."""
    r = _Reader(cfg, "glm5_next")
    spec = read_glm5_next_vision(r)
    v = r.children[-1]
    left = sorted(k for k in v.cfg if k not in v.used and k not in HARMLESS)
    problems = [f"vision_config.{k} (not understood)" for k in left] + [f"vision_config.{p}" for p in v.unsupported]
    if problems and not allow_unmapped:
        raise OnboardError(f"glm5_next config: {len(problems)} vision field(s) cannot be mapped onto VisionSpec: "
                           + "; ".join(problems) + ". Fix the config or pass --allow-unmapped")
    return spec


def read_glm5_next_vision(r: _Reader) -> VisionSpec:
    """The VisionSpec read through `r`, the reader of the config's top level: its `vision_config` becomes a child
    reader of `r`, so the fields it leaves unread (or cannot honour) are reported when `r` finishes (families.py
    `_glm5_next`); `image_token_id` is read from the top level."""
    cfg = r.cfg
    v = _sub_reader(r, "vision_config")
    text = cfg.get("text_config") or cfg  # flat (text-only layout) configs keep the text fields at the top
    D, H = v.need("hidden_size"), v.need("num_heads", "num_attention_heads")
    v.expect("hidden_act", lambda x: x == "silu", "the MLPs are SwiGLU")
    v.expect("spatial_merge_size", lambda x: x == 2, "the merger joins 2 x 2 patches")
    v.expect("head_dim", lambda x: x == D // H, "attention heads of hidden_size / num_heads")
    v.expect("in_channels", lambda x: x == 3, "RGB images")
    v.expect("out_hidden_size", lambda x: x == text.get("hidden_size"), "the projector ends in the LM width")
    vp = v.get("rope_parameters") or {}
    if vp.get("rope_type", "axial") != "axial" or set(vp) - {"rope_type", "rope_theta"}:
        v.unsupported.append(f"rope_parameters={vp} (axial 2-D RoPE)")
    kw = dict(patch_size=v.need("patch_size"), n_layers=v.need("depth", "num_hidden_layers"),
              intermediate_size=v.need("intermediate_size"), temporal_patch_size=v.get("temporal_patch_size",
                                                                                     default=2),
              projector_hidden_size=v.need("projection_intermediate_size"),
              swiglu_limit=v.get("swiglu_limit", default=10.0), norm_eps=float(v.get("rms_norm_eps", default=1e-5)))
    v.get("attention_bias")  # biases of qkv / proj / MLP: absent ones are zeros (glm5_next_vision_rules)
    v.used |= _VISION_HARMLESS
    try:
        return VisionSpec(**kw, hidden_size=D, n_heads=H, rope_theta=float(vp.get("rope_theta", 10000.0)),
                          image_token_id=r.need("image_token_id"), norm="rmsnorm", qk_norm=True, mlp_act="swiglu",
                          patch_embed_conv=True, projector="glm")
    except ValidationError as e:
        raise OnboardError(format_validation_error(e, "glm5_next vision_config -> VisionSpec")) from None


def _glm_rope_rows(heads: int, head: int) -> torch.Tensor:
    """GLM's q / k rows -> ours, per head: it rotates (m, m + Dh/2) by the row for m < Dh/4 and by the column
    for Dh/4 <= m < Dh/2; ours (j, j + Dh/4) by the row and (Dh/2 + j, 3 Dh/4 + j) by the column."""
    q = head // 4
    j = torch.arange(q)
    per = torch.cat([j, 2 * q + j, q + j, 3 * q + j])
    return torch.cat([h * head + per for h in range(heads)])


_BLOCK = {"norm1.weight": "norm1.weight", "norm2.weight": "norm2.weight", "attn.qkv.": "attn.qkv.",
          "attn.proj.": "attn.proj.", "attn.q_norm.weight": "attn.q_norm.weight",
          "attn.k_norm.weight": "attn.k_norm.weight", "fc1.": "mlp.gate_proj.", "fc3.": "mlp.up_proj.",
          "fc2.": "mlp.down_proj."}
_TOP = {"tower.patch_embed.": "patch_embed.proj.", "tower.norm.weight": "post_layernorm.weight",
        "projector.downsample.": "downsample.", "projector.proj.": "merger.proj.",
        "projector.norm.": "merger.post_projection_norm.", "projector.fc1.": "merger.gate_proj.",
        "projector.fc3.": "merger.up_proj.", "projector.fc2.": "merger.down_proj."}


def glm5_next_vision_rules(spec: VisionSpec, lm_hidden: int, attention_bias: bool = True,
                           prefix: str = "vision.") -> list[Rule]:
    """One rule per tensor of our VisionModel (named `prefix` + its own names): its `model.visual.*` source."""
    from ..models.vision import VisionModel

    with torch.device("meta"):
        model = VisionModel(spec, lm_hidden)
    D, H = spec.hidden_size, spec.n_heads
    qk = _glm_rope_rows(H, D // H)
    rules = []
    for name, t in model.state_dict().items():
        table = _TOP
        rel = name
        if name.startswith("tower.blocks."):
            i, rel = name.split(".", 3)[2:]
            table = {k: f"blocks.{i}.{v}" for k, v in _BLOCK.items()}
        src = next((v + rel[len(k):] for k, v in table.items() if rel.startswith(k)), None)
        if src is None:
            raise KeyError(f"no checkpoint name for our tensor {name}; the glm5_next vision name map is incomplete")
        r = Rule(prefix + name, [PREFIX + src], tuple(t.shape))
        if rel.startswith("attn.qkv."):
            r.row_perm = torch.cat([qk, D + qk, 2 * D + torch.arange(D)])
        elif rel in ("attn.q_norm.weight", "attn.k_norm.weight"):  # RMSNorm commutes with a channel permutation
            r.row_perm = _glm_rope_rows(1, D // H)
        if not attention_bias and name.startswith("tower.blocks.") and rel.endswith(".bias"):
            r.absent_ok, r.init = "the tower has no qkv / proj / MLP biases (attention_bias: false)", "zeros"
        rules.append(r)
    return rules


def glm5_next_pixel_values(images: torch.Tensor, spec: VisionSpec) -> torch.Tensor:
    """Our packed patches [N, C * p * p] -> the processor's pixel_values [N, C * T * p * p]: the same patch
    order (merge blocks, then their patches), each patch repeated over the T frames after its channel."""
    N = images.shape[0]
    p, T, C = spec.patch_size, spec.temporal_patch_size, spec.in_channels
    return images.view(N, C, 1, p, p).expand(N, C, T, p, p).reshape(N, C * T * p * p)


@contextlib.contextmanager
def _hooks(pairs: list[tuple[nn.Module, bool]], out: list[torch.Tensor]):
    def keep(_m, args, output=None):
        t = args[0] if output is None else output
        out.append((t[0] if isinstance(t, tuple) else getattr(t, "pooler_output", t)).detach().float())

    handles = [m.register_forward_pre_hook(keep) if pre else m.register_forward_hook(keep) for m, pre in pairs]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def validate_glm5_next_vision(path: str | Path, seed: int = 0, tol: float = 1e-4,
                              tamper: Callable[[nn.Module], None] | None = None) -> dict:
    """The checkpoint's vision tower + projector in transformers (Glm5NextVisionModel, eager attention, float32)
    and in moeadapt (the reference attention), on two random images of different sizes packed together:
    the patch embedding, every block, the final norm and the projected tokens compared (max |Δ| relative to
    max(1, max |h|)); the first part that differs by more than `tol` is named. `tamper(our VisionModel)` runs
    after loading (tests break our side on purpose)."""
    import transformers
    from safetensors import safe_open
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextVisionModel

    from ..models.vision import ImageBatch, VisionModel, patchify
    from .loader import checkpoint_index

    path = Path(path)
    cfg = json.loads((path / "config.json").read_text())
    spec = glm5_next_vision_spec(cfg)
    vc = cfg["vision_config"]
    lm_hidden = vc["out_hidden_size"]
    rules = glm5_next_vision_rules(spec, lm_hidden, vc.get("attention_bias", True), prefix="")
    index = checkpoint_index(path)
    missing = [s for r in rules if not r.absent_ok for s in r.sources if s not in index]
    if missing:
        raise OnboardError(f"{path}: {len(missing)} vision tensor(s) are missing: {missing[:5]}")
    hf_cfg = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False).vision_config
    hf_cfg._attn_implementation = "eager"
    hf = Glm5NextVisionModel(hf_cfg).float().eval()
    ours = VisionModel(spec, lm_hidden).float().eval()
    hf_state, our_state = {}, ours.state_dict()
    for shard in sorted({index[k] for k in index if k.startswith(PREFIX)}):
        with safe_open(str(path / shard), "pt") as f:
            for k in f.keys():
                if k.startswith(PREFIX):
                    hf_state[k[len(PREFIX):]] = f.get_tensor(k).float()
    hf.load_state_dict(hf_state, strict=True)
    with torch.no_grad():
        for r in rules:
            if r.absent_ok and r.sources[0] not in index:
                our_state[r.ours].zero_()
            else:
                our_state[r.ours].copy_(r.to_ours(hf_state[r.sources[0][len(PREFIX):]]))
    for m in ours.modules():
        if hasattr(m, "backend"):
            m.backend = "reference"
    if tamper is not None:
        tamper(ours)
    g = torch.Generator().manual_seed(seed)
    grids = [(2, 4), (4, 2), (6, 4), (4, 6), (2, 2), (6, 6)]
    pick = torch.randperm(len(grids), generator=g)[:2].tolist()
    images = [torch.randn(3, grids[i][0] * spec.patch_size, grids[i][1] * spec.patch_size, generator=g) for i in pick]
    batch = ImageBatch(torch.cat([patchify(im, spec.patch_size) for im in images]),
                       torch.tensor([grids[i] for i in pick], dtype=torch.long))
    thw = torch.cat([torch.ones(len(pick), 1, dtype=torch.long), batch.grid_hw], 1)
    labels = (["patch embedding"] + [f"block {i}" for i in range(spec.n_layers)] + ["final norm", "projector"])
    got_hf, got_ours = [], []
    hf_mods = [(hf.patch_embed, False)] + [(b, False) for b in hf.blocks] + [(hf.post_layernorm, False), (hf, False)]
    our_mods = ([(ours.tower.blocks[0], True)] + [(b, False) for b in ours.tower.blocks]
                + [(ours.tower, False), (ours.projector, False)])
    with torch.no_grad(), _hooks(hf_mods, got_hf), _hooks(our_mods, got_ours):
        ours(batch)
        hf(glm5_next_pixel_values(batch.pixel_values, spec), grid_thw=thw)
    parts = [(lab, (a - b).abs().max().item(), a.abs().max().item())
             for lab, a, b in zip(labels, got_hf, got_ours, strict=True)]
    bad = [p for p in parts if not p[1] / max(1.0, p[2]) <= tol]  # NaN counts as bad
    where = (f"the vision {bad[0][0]} is the first part to diverge: max |Δh| = {bad[0][1]:.3g} "
             f"(max |h| = {bad[0][2]:.3g})" if bad else "")
    return {"family": "glm5_next (vision tower)", "reference": f"transformers {transformers.__version__} "
            "Glm5NextVisionModel", "passed": not bad, "max_abs_diff": parts[-1][1], "max_abs_out": parts[-1][2],
            "parts": parts, "first_bad_part": bad[0][0] if bad else None, "where": where, "seed": seed,
            "grids": batch.grid_hw.tolist(), "tolerance": tol}
