"""PEFT-format adapter directories: adapter_config.json + adapter_model.safetensors.

Keys are `base_model.model.<module>.lora_A.weight` / `.lora_B.weight`, with <module> the name the module
has in the base checkpoint (ours: `layers.3.ffn.experts.w1`). Dense adapters use PEFT's layout
(lora_A [r, in], lora_B [out, r]). Grouped expert adapters are stored per expert in the same layout, stacked
on a leading expert axis (lora_A [E, r, in], lora_B [E, out, r]); `adapter_config.json` lists them under
`moeadapt.grouped_modules`. Written atomically.

For a model onboarded from a Hugging Face checkpoint (`moeadapt.onboard.peft_maps(dir)`), module names are the
checkpoint's and the rows of lora_B are put back in the checkpoint's row order where onboarding permuted the
base weight's rows (DeepSeek's interleaved RoPE rows of q_b_proj / q_proj / kv_a_proj_with_mqa): then
W_ckpt + scaling * B @ A is exactly the checkpoint-order form of our merged weight. adapter_config.json records
both (`moeadapt.modules`: checkpoint name -> ours, `moeadapt.row_perms`), so `load_peft` undoes them alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from pydantic import ValidationError
from torch import nn

from ..config import LoRASpec
from ..config.load import format_validation_error
from ..io import atomic_dir, load_tensors, save_tensors
from .inject import inject_lora, lora_modules
from .layers import LoRALinear

PREFIX = "base_model.model."


def export_peft(model: nn.Module, lora: LoRASpec, path: str | Path, base_model: str = "",
                name_map: dict[str, str] | None = None,
                row_perms: dict[str, torch.Tensor] | None = None) -> Path:
    """`name_map` maps our module names to the original checkpoint's (identity for our own format);
    `row_perms[ours]`: our base weight's rows = checkpoint rows[perm] (onboarding's permutation), undone on
    lora_B so the adapter is in the checkpoint's row order."""
    mods = lora_modules(model)
    if not mods:
        raise ValueError("the model has no LoRA adapters to export; run a fine-tune with a `lora:` section")
    name_map = name_map or {}
    row_perms = row_perms or {}
    tensors, grouped, targets, perms_out = {}, [], set(), {}
    for n, m in mods.items():
        out = name_map.get(n, n)
        targets.add(out.rsplit(".", 1)[-1])
        if isinstance(m, LoRALinear):
            a, b = m.lora_A.weight, m.lora_B.weight
            if n in row_perms:
                perm = row_perms[n].to(b.device)
                b = b.index_select(0, torch.argsort(perm))  # ours[i] = ckpt[perm[i]]  =>  ckpt = ours[argsort]
                perms_out[out] = perm.tolist()
        else:
            a, b = m.lora_A.transpose(1, 2), m.lora_B.transpose(1, 2)
            grouped.append(out)
        tensors[f"{PREFIX}{out}.lora_A.weight"] = a.float()
        tensors[f"{PREFIX}{out}.lora_B.weight"] = b.float()
    cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
        "target_modules": sorted(targets), "fan_in_fan_out": False, "inference_mode": True,
        "moeadapt": {"targets": lora.targets, "grouped_modules": sorted(grouped)},
    }
    if any(name_map.get(n, n) != n for n in mods):
        cfg["moeadapt"]["modules"] = {name_map.get(n, n): n for n in mods}
    if perms_out:
        cfg["moeadapt"]["row_perms"] = perms_out
    with atomic_dir(path) as tmp:
        save_tensors(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    return Path(path)


def read_adapter_config(path: str | Path) -> tuple[LoRASpec, dict]:
    path = Path(path)
    f = path / "adapter_config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{path} is not an adapter directory (no adapter_config.json)")
    try:
        cfg = json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{f} is not valid JSON ({e}); the adapter is corrupt - export it again") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{f} holds a {type(cfg).__name__}, not a JSON object; export the adapter again")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{f}: peft_type={cfg.get('peft_type')!r}; only LORA adapters are supported")
    missing = [k for k in ("r", "lora_alpha") if k not in cfg]
    own = cfg.get("moeadapt") if isinstance(cfg.get("moeadapt"), dict) else {}
    targets = own.get("targets") or cfg.get("target_modules")
    if missing or not targets:
        raise ValueError(f"{f} lacks {missing + ([] if targets else ['target_modules'])}; a PEFT LoRA adapter_config "
                         "needs r, lora_alpha and target_modules - export the adapter again")
    try:
        spec = LoRASpec(rank=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
                        targets=[targets] if isinstance(targets, str) else targets)
    except ValidationError as e:
        raise ValueError(format_validation_error(e, str(f)).replace("\n", "; ")) from None
    return spec, cfg


@torch.no_grad()
def load_peft(model: nn.Module, path: str | Path, name_map: dict[str, str] | None = None) -> LoRASpec:
    """Inject adapters as the directory describes (unless present) and load their weights strictly."""
    spec, cfg = read_adapter_config(path)
    if not lora_modules(model):
        inject_lora(model, spec)
    tensors = load_tensors(Path(path) / "adapter_model.safetensors")
    own = cfg.get("moeadapt", {})
    if name_map is None and own.get("modules"):  # written with checkpoint names: map them back
        name_map = {ours: ckpt for ckpt, ours in own["modules"].items()}
    name_map = name_map or {}
    perms = {k: torch.tensor(v) for k, v in own.get("row_perms", {}).items()}
    expected = {}
    for n, m in lora_modules(model).items():
        out = name_map.get(n, n)
        expected[f"{PREFIX}{out}.lora_A.weight"] = (m, "A")
        expected[f"{PREFIX}{out}.lora_B.weight"] = (m, "B")
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"adapter {path} does not fit this model: missing {missing[:6]}, unexpected {extra[:6]}")
    for key, (m, which) in expected.items():
        t = tensors[key]
        if isinstance(m, LoRALinear):
            dst = m.lora_A.weight if which == "A" else m.lora_B.weight
            mod = key[len(PREFIX):].rsplit(".", 2)[0]
            if which == "B" and mod in perms:
                t = t.index_select(0, perms[mod])  # checkpoint row order -> ours
        else:
            dst = m.lora_A if which == "A" else m.lora_B
            t = t.transpose(1, 2)
        if dst.shape != t.shape:
            raise ValueError(f"adapter {path}: tensor {key} has shape {tuple(t.shape)}, the model expects "
                             f"{tuple(dst.shape)}; the adapter belongs to another base model - give that model")
        dst.copy_(t)
    return spec
