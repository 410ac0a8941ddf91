"""Onboarding (DESIGN.md §7): read a checkpoint's config.json + safetensors, map it onto our model.

`onboard(path)` recognises the family (families.py), maps every tensor name both ways (names.py), checks names
and shapes from the safetensors headers (loader.py), prints the operator mapping (opmap.py) and optionally
validates the checkpoint's own weights against transformers, block by block (validate.py).
`onboard_model(path)` / `StreamingLoader` load the weights shard by shard (only a rank's experts under EP).
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import ConfigError, ModelSpec, preset_names
from ..config import resolve_model as _resolve_model
from ..io import read_json_object
from ..ui import make_console
from .families import Family, OnboardError, family_names, read_family
from .loader import StreamingLoader, checkpoint_index, dequant_fp8, load_into_model
from .names import Rule, build_rules, reverse_module_map, reverse_row_perms
from .opmap import op_mapping, print_op_mapping

__all__ = [
    "Family", "OnboardError", "Rule", "StreamingLoader", "build_rules", "checkpoint_index", "dequant_fp8",
    "family_names", "load_into_model", "load_weights", "model_spec_from_dir", "onboard", "onboard_model",
    "op_mapping", "peft_maps", "peft_name_map", "resolve_model",
    "print_op_mapping", "read_family", "read_family_dir", "reverse_module_map", "reverse_row_perms",
]


# How peft (pinned 0.21.2) loads expert adapters onto each family's transformers model, which holds the experts
# fused (experts.gate_up_proj [E, 2I, D], experts.down_proj [E, D, I]); tested in tests/onboard/test_peft_real.py.
# - Families of transformers' qwen2_moe / mixtral conversion patterns: peft converts per-expert adapters itself
#   and re-targets every module named like an expert projection (the leaves below) onto the fused experts, so
#   dense-FFN / shared-expert adapters of those names cannot be placed (export warns and keeps them aside).
PEFT_FUSED_FFN_LEAVES = {"deepseek_v3": ("gate_proj", "up_proj", "down_proj"),
                         "deepseek_v32": ("gate_proj", "up_proj", "down_proj"),
                         "glm_moe_dsa": ("gate_proj", "up_proj", "down_proj"),
                         "qwen3_moe": ("gate_proj", "up_proj", "down_proj"),
                         "qwen3_next": ("gate_proj", "up_proj", "down_proj"),
                         "minimax_m2": ("w1", "w3", "w2")}
# - Families peft does not convert (no MoE target mapping for their pattern): expert adapters go in peft's
#   target_parameters form on the fused parameters; the checkpoint's (gate, up, down) expert leaves
# Module renames transformers applies on load (its conversion mapping), for target_modules given by full name
PEFT_RUNTIME_RENAMES = {
    "kimi_linear": ((".block_sparse_moe.", ".mlp."), (".self_attn.f_a_proj", ".self_attn.forget_gate.f_a_proj"),
                    (".self_attn.f_b_proj", ".self_attn.forget_gate.f_b_proj")),
    "minimax_m2": ((".block_sparse_moe.", ".mlp."),),
}
PEFT_TARGET_PARAMETERS = {"kimi_linear": ("w1", "w3", "w2"), "qwen3_5_moe": ("gate_proj", "up_proj", "down_proj"),
                          "qwen3_5_moe_text": ("gate_proj", "up_proj", "down_proj")}


def read_family_dir(path: str | Path, allow_unmapped: bool = False) -> Family:
    """The Family of a model directory: the one reader of its config.json (ours or a Hugging Face one)."""
    path = Path(path)
    f = path / "config.json"
    if not f.is_file():
        raise OnboardError(f"{path} has no config.json; give a Hugging Face model directory")
    cfg = read_json_object(f, "re-export the model", OnboardError)
    return read_family(cfg, name=path.name, allow_unmapped=allow_unmapped)


def model_spec_from_dir(path: str | Path) -> ModelSpec:
    """The ModelSpec of a model directory (ours or a Hugging Face family `moeadapt onboard` maps), with
    ConfigError messages for a `model:` entry of a run config."""
    path = Path(path)
    if not (path / "config.json").is_file():
        if (path / "config.yaml").is_file() and (path / "model" / "config.json").is_file():
            raise ConfigError(f"{path} is a run directory; point at its trained model, {path / 'model'}")
        if (path / "config.yaml").is_file() and (path / "adapter").is_dir():
            raise ConfigError(f"{path} is a LoRA run directory; give its base model and --adapter {path / 'adapter'}")
        raise ConfigError(f"{path} has no config.json; give a preset name ({', '.join(preset_names())}) "
                          "or a model directory")
    try:
        return read_family_dir(path).spec
    except OnboardError as e:
        raise ConfigError(f"{path / 'config.json'}: {e}; inspect it with `moeadapt onboard {path}`") from None


def resolve_model(value: str | dict | ModelSpec) -> ModelSpec:
    """config.resolve_model with model directories read by model_spec_from_dir."""
    return _resolve_model(value, from_dir=model_spec_from_dir)


def onboard(path: str | Path, validate: bool = False, allow_unmapped: bool = False, device: str = "auto",
            layers: int | None = None, seq_len: int | None = None, seed: int = 0, tolerance: float | None = None) -> dict:
    """Map a checkpoint directory: spec, name-map check, op mapping; with `validate`, the checkpoint's own weights
    (the first `layers` blocks, default all) run in transformers and in moeadapt and are compared (validate.py)."""
    fam = read_family_dir(path, allow_unmapped)
    rules = build_rules(fam, checkpoint_index(path))
    summary = StreamingLoader(path, fam, rules).check()
    out = {"family": fam.model_type, "spec": fam.spec, "notes": fam.notes, "check": summary,
           "ops": op_mapping(fam.spec, device), "rules": rules, "fam": fam}
    if validate:
        from .validate import validate_checkpoint

        out["validation"] = validate_checkpoint(path, fam, layers=layers, seq_len=seq_len, seed=seed,
                                                **({"tol": tolerance} if tolerance else {}))
    return out


def onboard_model(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str = "cpu",
                  allow_unmapped: bool = False):
    """Build our model for a checkpoint directory and stream its weights in (ep = 1). Returns (model, summary)."""
    from ..models.model import build_model, materialize

    fam = read_family_dir(path, allow_unmapped)
    loader = StreamingLoader(path, fam, build_rules(fam, checkpoint_index(path)), dtype=dtype)
    model = materialize(build_model(fam.spec, "meta"), device, dtype=dtype)
    summary = load_into_model(model, loader)
    model.set_backend("reference" if device == "cpu" else "auto")
    return model.eval(), summary


def load_weights(path: str | Path, model, allow_unmapped: bool = False) -> dict:
    """Stream a checkpoint directory's weights into an already built + materialised model of the mapped spec
    (what a trainer's `init_from` needs for a Hugging Face directory). Returns the check summary."""
    fam = read_family_dir(path, allow_unmapped)
    dtype = next(model.parameters()).dtype
    return load_into_model(model, StreamingLoader(path, fam, build_rules(fam, checkpoint_index(path)), dtype=dtype))


def peft_name_map(path: str | Path) -> dict[str, str]:
    """Our module names -> the checkpoint's, for `export_peft(..., name_map=...)`."""
    return reverse_module_map(build_rules(read_family_dir(path, allow_unmapped=True), checkpoint_index(path)))


def peft_maps(path: str | Path | None) -> dict:
    """`export_peft` keyword arguments for a model onboarded from the Hugging Face checkpoint directory `path`:
    name_map (ours -> checkpoint module names), row_perms (rows of lora_B back in checkpoint order),
    fused_ffn_leaves (module names peft takes for expert projections in this family) and fused_experts (the
    expert leaves to write in peft's target_parameters form, for families peft does not convert) and
    runtime_renames (checkpoint -> transformers module-name changes, for targets given by full name).
    Empty for anything else (our own format, a preset name, None)."""
    if not path or not (Path(path) / "config.json").is_file():
        return {}
    fam = read_family_dir(path, allow_unmapped=True)
    if fam.model_type == "moeadapt":
        return {}
    rules = build_rules(fam, checkpoint_index(path))
    return {"name_map": reverse_module_map(rules), "row_perms": reverse_row_perms(rules),
            "fused_ffn_leaves": PEFT_FUSED_FFN_LEAVES.get(fam.model_type, ()),
            "fused_experts": PEFT_TARGET_PARAMETERS.get(fam.model_type, ()),
            "runtime_renames": PEFT_RUNTIME_RENAMES.get(fam.model_type, ())}


def write_run_config(fam: Family, path: str | Path, out: str | Path) -> Path:
    """A run YAML a user can copy: the mapped ModelSpec spelled out, weights from the checkpoint directory."""
    import yaml

    from ..io import atomic_write_text

    spec = fam.spec.model_dump(mode="json")
    text = (f"# written by `moeadapt onboard {path}` (family {fam.model_type}); every field is a ModelSpec field\n"
            "# init_from: the trainer streams and name-maps the Hugging Face weights (moeadapt.onboard.load_weights)\n"
            + "".join(f"# note: {n}\n" for n in fam.notes)
            + yaml.safe_dump({"model": spec, "train": {"init_from": str(Path(path).resolve())}}, sort_keys=False))
    atomic_write_text(out, text)
    return Path(out)


def report(result: dict, console=None) -> None:
    """Print what `onboard` found: the mapping summary, the op table, the validation line."""
    console = console or make_console()
    c, s = result["check"], result["spec"]
    console.print(f"[bold]{result['family']}[/] -> ModelSpec {s.name!r}: {s.n_layers} layers "
                  f"({', '.join(f'{t}:{s.resolved_layer_types().count(t)}' for t in ('kda', 'dsa', 'gqa', 'gdn') if t in s.resolved_layer_types())}), "
                  f"{s.n_routed_experts} experts top-{s.n_experts_per_tok}")
    if s.vision is not None:
        v = s.vision
        console.print(f"vision tower: {v.n_layers} layers, width {v.hidden_size}, {v.n_heads} heads, patches of "
                      f"{v.patch_size} px, 2 x 2 merger, {v.projector} projector -> {s.hidden_size}; image "
                      f"placeholder token {v.image_token_id}")
    console.print(f"tensors: {c['tensors']} in {c['shards']} shard(s), {c['mapped']} mapped, "
                  f"{len(c['ignored'])} ignored, {len(c['absent_by_design'])} of ours absent by design")
    by_why: dict[str, list[str]] = {}
    for name, why in sorted(c["ignored"].items()):
        by_why.setdefault(why, []).append(name)
    for why, names in by_why.items():  # one line per reason (a vision tower is hundreds of tensors)
        console.print(f"  ignored {names[0]}: {why}" if len(names) == 1 else
                      f"  ignored {len(names)} tensors ({names[0]}, ...): {why}")
    reasons = sorted(set(c["absent_by_design"].values()))
    for why in reasons:
        n = sum(v == why for v in c["absent_by_design"].values())
        console.print(f"  {n} tensor(s) of ours not in the checkpoint: {why}")
    print_op_mapping(result["ops"], result["notes"], console)
    v = result.get("validation")
    if v:
        if v.get("max_abs_diff") is None:
            console.print(f"validate: skipped ({v['note']})")
            return
        console.print(f"validate: {v['layers']} of {v['of_layers']} layers of the checkpoint's weights, documents of "
                      f"{v['lengths']} random tokens (seed {v['seed']}), float32, vs {v['reference']}")
        if v.get("vision_parts"):
            console.print("  each document holds random images of different sizes, their placeholder tokens among "
                          "the text (the lengths are the text budgets); each vision part is compared, the text "
                          "model on transformers' image tokens")
        for part, d, m in v.get("vision_parts") or []:
            console.print(f"  vision {part}: max |Δh| = {d:.2e} (max |h| = {m:.2e})")
        for i, (d, m) in enumerate(v["per_layer"]):
            console.print(f"  layer {i}: max |Δh| = {d:.2e} (max |h| = {m:.2e})")
        if v.get("tie_aligned") and v["tie_aligned"][0]:
            console.print(f"  indexer: {v['tie_aligned'][0]} of {v['tie_aligned'][1]} query rows differed from "
                          "transformers only among keys of equal score (torch.topk breaks ties arbitrarily); "
                          "compared with our selection there")
        if v.get("max_abs_diff_end_to_end") is not None:
            console.print(f"  end to end (our image tokens into our text model, first document): max |logit diff| = "
                          f"{v['max_abs_diff_end_to_end']:.2e} (float32 rounding of the tokens, amplified by the "
                          "text model; not gated)")
        ok = "[green]PASS[/]" if v["passed"] else "[red]FAIL[/]"
        console.print(f"validate: {ok} max |logit diff| = {v['max_abs_diff']:.2e} (max |logit| = "
                      f"{v['max_abs_logit']:.2e}; tolerance {v['tolerance']:.0e} relative to max(1, max |logit|), "
                      f"per layer to max(1, max |h|)){'; ' + v['where'] if v['where'] else ''}")
