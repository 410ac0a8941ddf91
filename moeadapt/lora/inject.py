"""Inject LoRA adapters into a built model, merge them back, and list the trainable parameters.

Owns: which modules get adapters (LoRASpec.targets: module-name suffixes or fnmatch patterns) and the
freezing of everything else. Must not touch the optimizer or checkpoints.

Vision-language models (a `vision` module): `targets` apply to the language model only; the tower and the
projector stay frozen unless `LoRASpec.vision_tower` / `projector` say "lora" (adapters on every linear of the
ViT blocks / of the projector) or, for the projector, "full" (all its parameters trained).
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from ..config import LoRASpec
from ..config.schema import DEFAULT_LORA_TARGETS
from ..models.moe import GroupedExperts, GroupedLinear
from .layers import GroupedLoRALinear, LoRALinear

LORA_TYPES = (LoRALinear, GroupedLoRALinear)


def _matches(name: str, patterns: list[str]) -> bool:
    for p in patterns:
        if any(ch in p for ch in "*?["):
            if fnmatch.fnmatch(name, p) or fnmatch.fnmatch(name, "*." + p):
                return True
        elif name == p or name.endswith("." + p):
            return True
    return False


def inject_lora(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Wrap every nn.Linear / GroupedLinear whose name matches a target; freeze all base parameters.
    Returns the wrapped module names. Raises if no module matches."""
    linears = [(n, m) for n, m in model.named_modules()
               if isinstance(m, (nn.Linear, GroupedLinear)) and not isinstance(m, LORA_TYPES)]
    targets = [(n, m) for n, m in linears if not n.startswith("vision.") and _matches(n, spec.targets)]
    vision = getattr(model, "vision", None)
    if vision is None and (spec.vision_tower != "frozen" or spec.projector != "frozen"):
        raise ValueError(f"lora.vision_tower={spec.vision_tower!r} / lora.projector={spec.projector!r} need a model "
                         "with a vision tower; leave them 'frozen' for a text model")
    if spec.vision_tower == "lora":
        targets += [(n, m) for n, m in linears if n.startswith("vision.tower.blocks.")]
    if spec.projector == "lora":
        targets += [(n, m) for n, m in linears if n.startswith("vision.projector.")]
    if not targets:
        examples = sorted({n.split(".", 2)[-1] for n, m in model.named_modules()
                           if isinstance(m, (nn.Linear, GroupedLinear))})[:12]
        raise ValueError(f"LoRA targets {spec.targets} matched no module; names look like {examples}")
    if list(spec.targets) != DEFAULT_LORA_TARGETS:  # the default list names every family's layers: some are absent
        linear = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, GroupedLinear))]
        unused = [p for p in spec.targets if not any(_matches(n, [p]) for n in linear)]
        if unused:
            examples = sorted({n.split(".", 2)[-1] for n in linear})[:12]
            raise ValueError(f"lora.targets {unused} match no module (the others do); fix or remove them - names "
                             f"look like {examples}")
    for p in model.parameters():
        p.requires_grad_(False)
    for name, mod in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        cls = GroupedLoRALinear if isinstance(mod, GroupedLinear) else LoRALinear
        setattr(parent, child, cls(mod, spec.rank, spec.alpha, spec.dropout))
    if spec.projector == "full":
        for p in vision.projector.parameters():
            p.requires_grad_(True)
    return [n for n, _ in targets]


def full_trained_modules(model: nn.Module, spec: LoRASpec) -> list[str]:
    """Modules trained in full beside the adapters (PEFT's modules_to_save)."""
    return ["vision.projector"] if spec.projector == "full" and getattr(model, "vision", None) is not None else []


def lora_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LORA_TYPES)}


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Adapter tensors only, keyed `<module>.lora_A` / `<module>.lora_B` (our names)."""
    out = {}
    for n, m in lora_modules(model).items():
        if isinstance(m, LoRALinear):
            out[f"{n}.lora_A"], out[f"{n}.lora_B"] = m.lora_A.weight, m.lora_B.weight
        else:
            out[f"{n}.lora_A"], out[f"{n}.lora_B"] = m.lora_A, m.lora_B
    return out


@torch.no_grad()
def merge_lora(model: nn.Module) -> int:
    """Fold every adapter into its base weight and put back the plain layer. Returns how many merged."""
    mods = lora_modules(model)
    for name, m in mods.items():
        m.weight.add_(m.delta_weight().to(m.weight.dtype))
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(m, LoRALinear):
            plain = nn.Linear(m.in_features, m.out_features, bias=m.bias is not None, device="meta")
            plain.weight, plain.bias = m.weight, m.bias
        else:
            m.weight.data = m.weight.data.contiguous()  # leave the [W | B] (or gate/up) buffer behind
            plain = GroupedLinear.__new__(GroupedLinear)
            nn.Module.__init__(plain)
            plain.n_experts, plain.in_features, plain.out_features = m.n_experts, m.in_features, m.out_features
            plain.weight, plain.backend = m.weight, m.backend
        setattr(parent, child, plain)
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.release_cat()
    return len(mods)


@torch.no_grad()
def cast_frozen_(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast every frozen parameter to `dtype` (the BF16 backbone of a LoRA run), adapters untouched.

    Grouped LoRA layers keep their base weight a view of the fused [W | B] buffer (no second copy)."""
    for m in model.modules():
        if isinstance(m, GroupedLoRALinear) and not m.weight.requires_grad:
            m.cast_base_(dtype)
    for p in model.parameters():
        if not p.requires_grad and p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)
