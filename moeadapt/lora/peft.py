"""PEFT-format adapter directories: adapter_config.json + adapter_model.safetensors (+ our side file).

Keys are `base_model.model.<module>.lora_A.weight` / `.lora_B.weight` in PEFT's layout (lora_A [r, in], lora_B
[out, r]), <module> the name the module has in the base model. adapter_config.json holds only fields `peft`
knows; our own metadata (the LoRASpec targets, the module-name map, row permutations, the layout of expert
adapters, adapters peft cannot place) goes to `moeadapt_adapter.json` beside it. Written atomically.

Expert adapters (one grouped adapter per projection, A [E, in, r], B [E, r, out] in our model):
- for a model onboarded from a Hugging Face checkpoint (`name_map` given) they are written one tensor per expert,
  `<...>.experts.<e>.<proj>.lora_A.weight`: the transformers-v4 per-expert layout that peft (pinned 0.21.2)
  converts itself onto transformers-v5 fused experts (gate_up_proj / down_proj parameters, via
  `target_parameters`, tested in tests/onboard/test_peft_real.py). peft fuses gate and up and places their
  adapter by the down projection's: where gate or up is adapted, the others of the three are written as zero
  adapters (exactly no change) so the conversion has all its parts;
- with `fused_experts` (families whose transformers model holds fused 3-D experts that peft does not convert
  per-expert adapters onto: Kimi Linear, Qwen3.5-MoE) they are written in peft's `target_parameters` form for
  transformers' `experts.gate_up_proj` [E, 2I, D] and `experts.down_proj` [E, D, I] parameters (a LoRA
  ParamWrapper each; gate_up nested inside down as `experts.base_layer`): lora_A [E * r', in] expert-major,
  lora_B [out, r' * E] rank-major, as peft's ParamWrapper reads them. gate and up share one wrapper of rank
  r' = r * (number of the two adapted), A stacked over the rank, B block-diagonal (rank_pattern / alpha_pattern
  keep alpha / r), so the delta of each is exactly ours;
- for our own format they stay stacked (lora_A [E, r, in], lora_B [E, out, r]).

With `fused_ffn_leaves` (families whose transformers model fuses experts), peft's MoE conversion re-targets every
module named like an expert projection (gate_proj / up_proj / down_proj), so adapters on the dense FFN layers and
the shared expert cannot be placed by peft. They are left out of adapter_model.safetensors with a warning and kept
in `moeadapt_extra.safetensors`, so `load_peft` (and merge-adapter) still restore the whole adapter.

For a model onboarded from a Hugging Face checkpoint (`moeadapt.onboard.peft_maps(dir)`) the rows of lora_B are
put back in the checkpoint's row order where onboarding permuted the base weight's rows (DeepSeek's interleaved
RoPE rows of q_b_proj / q_proj / kv_a_proj_with_mqa): W_ckpt + scaling * B @ A is then exactly the checkpoint-order
form of our merged weight.

Modules trained in full beside the adapters (a vision-language model's projector with `lora.projector: full`)
are listed in `modules_to_save` and stored as PEFT stores them: `base_model.model.<module>.<param>`.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import torch
from pydantic import ValidationError
from torch import nn

from ..config import LoRASpec
from ..config.load import format_validation_error
from ..io import atomic_dir, load_tensors, read_json_object, save_tensors
from .inject import full_trained_modules, inject_lora, lora_modules
from .layers import LoRALinear

PREFIX = "base_model.model."
SIDE = "moeadapt_adapter.json"
EXTRA = "moeadapt_extra.safetensors"


def export_peft(model: nn.Module, lora: LoRASpec, path: str | Path, base_model: str = "",
                name_map: dict[str, str] | None = None, row_perms: dict[str, torch.Tensor] | None = None,
                fused_ffn_leaves: tuple[str, ...] = (), fused_experts: tuple[str, str, str] = (),
                runtime_renames: tuple[tuple[str, str], ...] = ()) -> Path:
    """`name_map` maps our module names to the original checkpoint's (identity for our own format);
    `row_perms[ours]`: our base weight's rows = checkpoint rows[perm] (onboarding's permutation), undone on
    lora_B so the adapter is in the checkpoint's row order; `fused_ffn_leaves`: module leaf names that peft's MoE
    conversion takes for expert projections (dense adapters with such names go to the side file, with a warning);
    `fused_experts`: the checkpoint's (gate, up, down) expert leaf names where expert adapters are to be written
    in peft's target_parameters form for fused experts (see the module docstring); `runtime_renames`: (old, new)
    substrings taking a checkpoint module name to the transformers model's (peft matches target_modules there;
    the adapter keys keep the checkpoint's names, which peft converts itself)."""
    mods = lora_modules(model)
    if not mods:
        raise ValueError("the model has no LoRA adapters to export; run a fine-tune with a `lora:` section")
    per_expert = name_map is not None
    name_map = name_map or {}
    row_perms = row_perms or {}
    tensors, extra, grouped, targets, perms_out, dropped, unmapped = {}, {}, [], set(), {}, [], []
    dense: dict[str, list[str]] = {}  # leaf name -> the adapted (non-expert) modules of that name
    expert_heads: dict[str, set[str]] = {}  # ...mlp.experts -> projections written
    for n, m in mods.items():
        out = name_map.get(n, n)
        leaf = out.rsplit(".", 1)[-1]
        if per_expert and n not in name_map:  # a module the checkpoint does not have (e.g. an unused indexer)
            unmapped.append(n)
            for w in "AB":
                t = getattr(m, f"lora_{w}")
                extra[f"{PREFIX}{n}.lora_{w}.weight"] = (t.weight if isinstance(m, LoRALinear) else t).float()
            continue
        if isinstance(m, LoRALinear):
            a, b = m.lora_A.weight.float(), m.lora_B.weight.float()
            if n in row_perms:
                perm = row_perms[n].to(b.device)
                b = b.index_select(0, torch.argsort(perm))  # ours[i] = ckpt[perm[i]]  =>  ckpt = ours[argsort]
                perms_out[out] = perm.tolist()
            dst = tensors
            if leaf in fused_ffn_leaves:
                dst = extra
                dropped.append(out)
            else:
                dense.setdefault(leaf, []).append(out)
            dst[f"{PREFIX}{out}.lora_A.weight"], dst[f"{PREFIX}{out}.lora_B.weight"] = a, b
            continue
        a, b = m.lora_A.transpose(1, 2).float(), m.lora_B.transpose(1, 2).float()  # [E, r, in], [E, out, r]
        grouped.append(out)
        if not (per_expert and fused_experts):  # fused: target_parameters instead
            targets.add(leaf)
        if not per_expert:
            tensors[f"{PREFIX}{out}.lora_A.weight"], tensors[f"{PREFIX}{out}.lora_B.weight"] = a, b
            continue
        head = out.rsplit(".", 1)[0]
        expert_heads.setdefault(head, set()).add(leaf)
        for e in range(a.shape[0]):
            tensors[f"{PREFIX}{head}.{e}.{leaf}.lora_A.weight"] = a[e]
            tensors[f"{PREFIX}{head}.{e}.{leaf}.lora_B.weight"] = b[e]
    zero_filled, fused_info, patterns = [], {}, {}
    if per_expert and fused_experts:
        fused_info, patterns = _fuse_experts(tensors, expert_heads, fused_experts, lora.rank, lora.alpha)
    elif per_expert:
        zero_filled = _fill_fused_partners(model, mods, name_map, expert_heads, tensors, targets)
    targets |= _target_modules(dense, set(name_map.values()) if per_expert else set(), runtime_renames)
    if dropped:
        warnings.warn(f"{len(dropped)} adapter(s) cannot be represented for peft and are left out of "
                      f"adapter_model.safetensors: {dropped[:4]}{' ...' if len(dropped) > 4 else ''} (peft maps every "
                      f"{'/'.join(fused_ffn_leaves)} target onto the fused experts of this model, so dense-FFN and "
                      f"shared-expert adapters would be dropped); they are kept in {EXTRA} for moeadapt "
                      "(load, merge-adapter). Leave dense FFN / shared experts out of lora.targets for a peft-only "
                      "adapter.", stacklevel=2)
    if unmapped:
        warnings.warn(f"{len(unmapped)} adapter(s) cannot be represented for peft: the checkpoint has no such "
                      f"module ({unmapped[:4]}{' ...' if len(unmapped) > 4 else ''}); they are kept in {EXTRA} for "
                      "moeadapt only. Remove them from lora.targets for a peft-only adapter.", stacklevel=2)
    to_save = full_trained_modules(model, lora)  # trained in full beside the adapters: PEFT's modules_to_save
    for mod in to_save:
        for pn, p in model.get_submodule(mod).named_parameters():
            tensors[f"{PREFIX}{mod}.{pn}"] = p.detach().float().contiguous()
    cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
        "target_modules": sorted(targets) or None, "fan_in_fan_out": False, "inference_mode": True,
        "modules_to_save": to_save or None,
    }
    if fused_info:
        cfg["target_parameters"] = sorted({f"experts.{p}" for info in fused_info.values()
                                           for p, on in zip(FUSED_PARAMS, (info["gate_up"], info["down"])) if on})
        cfg["rank_pattern"], cfg["alpha_pattern"] = patterns.get("rank", {}), patterns.get("alpha", {})
    side = {"targets": lora.targets, "grouped_modules": sorted(grouped),
            "expert_layout": ("peft_fused" if fused_info else "per_expert") if per_expert else "stacked",
            "zero_filled": zero_filled, "fused_experts": fused_info,
            "not_in_peft": sorted(dropped + unmapped), "vision_tower": lora.vision_tower, "projector": lora.projector}
    if any(name_map.get(n, n) != n for n in mods):
        side["modules"] = {name_map.get(n, n): n for n in mods}
    if perms_out:
        side["row_perms"] = perms_out
    with atomic_dir(path) as tmp:
        save_tensors(tensors, tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        if extra:
            save_tensors(extra, tmp / EXTRA, metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
        (tmp / SIDE).write_text(json.dumps(side, indent=2))
    return Path(path)


def _target_modules(dense: dict[str, list[str]], ckpt_modules: set[str],
                    renames: tuple[tuple[str, str], ...] = ()) -> set[str]:
    """peft's target_modules for the dense adapters: a leaf name where every checkpoint module of that name is
    adapted, else the adapted modules' full names as the transformers model spells them (peft matches a target
    by the name's suffix: a bare `o_proj` would also adapt, e.g., the MLA layers' o_proj when only the KDA
    layers' is ours)."""
    def runtime(name: str) -> str:
        for a, b in renames:
            name = name.replace(a, b)
        return name

    out: set[str] = set()
    for leaf, mods in dense.items():
        others = {m for m in ckpt_modules if m.rsplit(".", 1)[-1] == leaf} - set(mods)
        out |= {runtime(m) for m in mods} if others else {leaf}
    return out


FUSED_PARAMS = ("gate_up_proj", "down_proj")  # transformers' fused expert parameters ([E, 2I, D], [E, D, I])


def _fuse_experts(tensors: dict, expert_heads: dict[str, set[str]], leaves: tuple[str, str, str], r: int,
                  alpha: float) -> tuple[dict, dict]:
    """Per-expert adapter tensors (`<head>.<e>.<leaf>.lora_A/B.weight`) -> peft's target_parameters form for
    fused experts, in place. Returns (per head: which leaves went where, {"rank": .., "alpha": ..} patterns)."""
    gate, up, down = leaves
    info, rank_pat, alpha_pat = {}, {}, {}

    def take(head: str, leaf: str) -> tuple[torch.Tensor, torch.Tensor]:  # [E, r, in], [E, out, r]
        n = sum(1 for k in tensors if k.startswith(f"{PREFIX}{head}.") and k.endswith(f".{leaf}.lora_A.weight"))
        a = torch.stack([tensors.pop(f"{PREFIX}{head}.{e}.{leaf}.lora_A.weight") for e in range(n)])
        b = torch.stack([tensors.pop(f"{PREFIX}{head}.{e}.{leaf}.lora_B.weight") for e in range(n)])
        return a, b

    for head, have in expert_heads.items():
        parts = [leaf for leaf in (gate, up) if leaf in have]
        both = bool(parts) and down in have
        if parts:
            ab = {leaf: take(head, leaf) for leaf in parts}
            E, _, D = next(iter(ab.values()))[0].shape
            inter = next(iter(ab.values()))[1].shape[1]
            rank = r * len(parts)
            a = torch.cat([ab[leaf][0] for leaf in parts], dim=1)  # [E, rank, D]
            b = torch.zeros(E, 2 * inter, rank)
            for j, leaf in enumerate(parts):
                row = 0 if leaf == gate else inter
                b[:, row:row + inter, j * r:(j + 1) * r] = ab[leaf][1]
            key = f"{PREFIX}{head}.base_layer" if both else f"{PREFIX}{head}"
            tensors[f"{key}.lora_A.weight"] = a.reshape(E * rank, D)
            tensors[f"{key}.lora_B.weight"] = b.permute(1, 2, 0).reshape(2 * inter, rank * E)
            if rank != r:
                rank_pat[r".*\.gate_up_proj"], alpha_pat[r".*\.gate_up_proj"] = rank, alpha * len(parts)
        if down in have:
            a, b = take(head, down)  # [E, r, I], [E, D, r]
            E, _, inter = a.shape
            tensors[f"{PREFIX}{head}.lora_A.weight"] = a.reshape(E * r, inter)
            tensors[f"{PREFIX}{head}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * E)
        info[head] = {"gate_up": parts, "halves": [0 if leaf == gate else 1 for leaf in parts],
                      "down": down if down in have else None}
    return info, {"rank": rank_pat, "alpha": alpha_pat}


def _unfuse_experts(tensors: dict, info: dict, r: int) -> None:
    """The inverse of `_fuse_experts`, in place: back to per-expert tensors."""
    for head, parts in info.items():
        gu, down = parts["gate_up"], parts["down"]
        if gu:
            key = f"{PREFIX}{head}.base_layer" if down else f"{PREFIX}{head}"
            a, b = tensors.pop(f"{key}.lora_A.weight"), tensors.pop(f"{key}.lora_B.weight")
            rank = r * len(gu)
            E = a.shape[0] // rank
            a = a.reshape(E, rank, -1)
            b = b.reshape(b.shape[0], rank, E).permute(2, 0, 1)  # [E, 2I, rank]
            inter = b.shape[1] // 2
            for j, (leaf, half) in enumerate(zip(gu, parts["halves"])):
                row = half * inter  # gate: the first half of gate_up's rows, up: the second
                for e in range(E):
                    tensors[f"{PREFIX}{head}.{e}.{leaf}.lora_A.weight"] = a[e, j * r:(j + 1) * r]
                    tensors[f"{PREFIX}{head}.{e}.{leaf}.lora_B.weight"] = b[e, row:row + inter, j * r:(j + 1) * r]
        if down:
            a, b = tensors.pop(f"{PREFIX}{head}.lora_A.weight"), tensors.pop(f"{PREFIX}{head}.lora_B.weight")
            E = a.shape[0] // r
            a = a.reshape(E, r, -1)
            b = b.reshape(b.shape[0], r, E).permute(2, 0, 1)
            for e in range(E):
                tensors[f"{PREFIX}{head}.{e}.{down}.lora_A.weight"] = a[e]
                tensors[f"{PREFIX}{head}.{e}.{down}.lora_B.weight"] = b[e]


def _fill_fused_partners(model, mods, name_map, expert_heads, tensors, targets) -> list[str]:
    """peft fuses the experts' gate and up projections into one adapted parameter and places the pair's adapter
    by the presence of the down projection's: where gate or up is adapted, every one of gate, up and down that is
    not gets a zero adapter of the same rank (B = 0: no change)."""
    ours_of = {name_map.get(n, n): n for n in mods}
    filled = []
    for head, leaves in expert_heads.items():
        some = ours_of[f"{head}.{next(iter(leaves))}"]
        stem = some.rsplit(".", 1)[0]  # layers.i.ffn.experts
        names = {w: name_map.get(f"{stem}.{w}", f"{stem}.{w}").rsplit(".", 1)[-1] for w in ("w1", "w3", "w2")}
        if names["w1"] not in leaves and names["w3"] not in leaves:
            continue
        r = mods[some].lora_A.shape[-1]
        for w, leaf in names.items():
            if leaf in leaves:
                continue
            base = model.get_submodule(f"{stem}.{w}").weight  # [E, out, in]
            for e in range(base.shape[0]):
                tensors[f"{PREFIX}{head}.{e}.{leaf}.lora_A.weight"] = torch.zeros(r, base.shape[2])
                tensors[f"{PREFIX}{head}.{e}.{leaf}.lora_B.weight"] = torch.zeros(base.shape[1], r)
            targets.add(leaf)
            filled.append(f"{head}.{leaf}")
    return filled


def read_adapter_config(path: str | Path) -> tuple[LoRASpec, dict]:
    """(LoRASpec, our metadata) of an adapter directory: moeadapt_adapter.json when present (older adapters kept
    it under adapter_config.json's "moeadapt" key)."""
    path = Path(path)
    f = path / "adapter_config.json"
    if not f.is_file():
        raise FileNotFoundError(f"{path} is not an adapter directory (no adapter_config.json)")
    cfg = read_json_object(f, "the adapter is corrupt - export it again")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{f}: peft_type={cfg.get('peft_type')!r}; only LORA adapters are supported")
    missing = [k for k in ("r", "lora_alpha") if k not in cfg]
    try:
        side = json.loads((path / SIDE).read_text()) if (path / SIDE).is_file() else cfg.get("moeadapt", {})
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"{path / SIDE} is not valid JSON ({e}); the adapter is corrupt - export it again") from None
    side = side if isinstance(side, dict) else {}
    targets = side.get("targets") or cfg.get("target_modules")
    if missing or not targets:
        raise ValueError(f"{f} lacks {missing + ([] if targets else ['target_modules'])}; a PEFT LoRA adapter_config "
                         "needs r, lora_alpha and target_modules - export the adapter again")
    try:
        spec = LoRASpec(rank=cfg["r"], alpha=cfg["lora_alpha"], dropout=cfg.get("lora_dropout", 0.0),
                        targets=[targets] if isinstance(targets, str) else targets,
                        vision_tower=side.get("vision_tower", "frozen"), projector=side.get("projector", "frozen"))
    except ValidationError as e:
        raise ValueError(format_validation_error(e, str(f)).replace("\n", "; ")) from None
    return spec, side


@torch.no_grad()
def load_peft(model: nn.Module, path: str | Path, name_map: dict[str, str] | None = None) -> LoRASpec:
    """Inject adapters as the directory describes (unless present) and load their weights strictly."""
    spec, own = read_adapter_config(path)
    if not lora_modules(model):
        inject_lora(model, spec)
    tensors = load_tensors(Path(path) / "adapter_model.safetensors")
    if (Path(path) / EXTRA).is_file():
        tensors.update(load_tensors(Path(path) / EXTRA))
    if name_map is None and own.get("modules"):  # written with checkpoint names: map them back
        name_map = {ours: ckpt for ckpt, ours in own["modules"].items()}
    name_map = name_map or {}
    perms = {k: torch.tensor(v) for k, v in own.get("row_perms", {}).items()}
    per_expert = own.get("expert_layout") in ("per_expert", "peft_fused")
    if own.get("expert_layout") == "peft_fused":
        _unfuse_experts(tensors, own.get("fused_experts", {}), spec.rank)
    for z in own.get("zero_filled", []):  # the zero partners of a fused pair: not ours
        head, leaf = z.rsplit(".", 1)
        for k in [k for k in tensors if k.startswith(f"{PREFIX}{head}.") and f".{leaf}.lora_" in k]:
            tensors.pop(k)
    expected: dict[str, tuple[nn.Module | None, str | None, int | None]] = {}
    for n, m in lora_modules(model).items():
        out = name_map.get(n, n)
        if per_expert and not isinstance(m, LoRALinear):
            head, leaf = out.rsplit(".", 1)
            for e in range(m.lora_A.shape[0]):
                for w in "AB":
                    expected[f"{PREFIX}{head}.{e}.{leaf}.lora_{w}.weight"] = (m, w, e)
        else:
            for w in "AB":
                expected[f"{PREFIX}{out}.lora_{w}.weight"] = (m, w, None)
    full = {f"{PREFIX}{mod}.{pn}": p for mod in full_trained_modules(model, spec)
            for pn, p in model.get_submodule(mod).named_parameters()}
    expected.update({k: (None, None, None) for k in full})
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ValueError(f"adapter {path} does not fit this model: missing {missing[:6]}, unexpected {extra[:6]}")
    for key, (m, which, e) in expected.items():
        t = tensors[key]
        if m is None:  # a module trained in full
            dst = full[key]
        elif isinstance(m, LoRALinear):
            dst = m.lora_A.weight if which == "A" else m.lora_B.weight
            mod = key[len(PREFIX):].rsplit(".", 2)[0]
            if which == "B" and mod in perms:
                t = t.index_select(0, perms[mod])  # checkpoint row order -> ours
        else:
            dst = m.lora_A if which == "A" else m.lora_B
            t = t.transpose(-1, -2)
            if e is not None:
                dst = dst[e]
        if dst.shape != t.shape:
            raise ValueError(f"adapter {path}: tensor {key} has shape {tuple(t.shape)}, the model expects "
                             f"{tuple(dst.shape)}; the adapter belongs to another base model - give that model")
        dst.copy_(t)
    return spec
