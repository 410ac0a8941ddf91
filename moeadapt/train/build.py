"""Building the model a run trains, scale-true: no process ever allocates more than its own shards.

    model = build_meta(cfg, device)          # meta: LoRA injected, frozen base typed bf16 on GPU
    materialize_shards(model, cfg, run)      # run.parallelize on meta -> to_empty -> fill each local shard

The single process is the same path with a world of one (LocalRun.parallelize does nothing). The values
come from a fill function (parallel/shards.py states the contract): the seeded init of models/init.py, which
gives the same global weights at every world size and EP degree, or `init_from_fill`, which hands out the
slices of a checkpoint (adapters, absent from a base checkpoint, keep the init). The frozen base of a LoRA run
on GPU is typed bf16 on meta, so its shards are written in bf16 directly; trainable parameters stay fp32.

Today `init_from_fill` reads the whole checkpoint on every rank (`read_init_state`) and slices it; a sharded
reader (safetensors `get_slice`) is a drop-in `Fill` that reads only the slices asked for.
Must not know about ranks: the run object and parallel/ do.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..config import RunConfig
from ..io import load_state_into, load_tensors
from ..lora import cast_frozen_, inject_lora
from ..models.init import Fill, init_fill
from ..models.model import HybridMoEModel, build_model, materialize
from ..parallel.shards import fill_shards


def build_meta(cfg: RunConfig, device: torch.device) -> HybridMoEModel:
    """The run's model on meta (nothing allocated): LoRA injected; in a LoRA run on GPU the frozen base is
    typed bf16 here, so it is allocated and written in bf16 (adapters fp32)."""
    model = build_model(cfg.model, "meta")
    if cfg.lora is not None:
        inject_lora(model, cfg.lora)
        if device.type == "cuda":
            cast_frozen_(model, torch.bfloat16)
    model.set_backend(cfg.train.kernel_backend)
    return model


def materialize_shards(model: HybridMoEModel, cfg: RunConfig, run, fill: Fill | None = None) -> HybridMoEModel:
    """Parallelize the meta model (EP slicing + fully_shard: `run.parallelize`), allocate this rank's shards
    on `run.device` and fill them: from `fill` when given, else from cfg.train.init_from, else the seeded init."""
    if fill is None:
        fill = init_fill(model, cfg.train.seed, run.device)
        if cfg.train.init_from:
            fill = init_from_fill(cfg.train.init_from, model, fallback=fill)
    run.parallelize(model)
    model.to_empty(device=run.device)
    fill_shards(model, fill)
    return model


def _is_hf_dir(p: Path) -> bool:
    cfg_file = p / "config.json"
    return cfg_file.is_file() and "moeadapt" not in json.loads(cfg_file.read_text())


def read_init_state(path: str | Path, model: HybridMoEModel) -> tuple[dict[str, torch.Tensor], str]:
    """(name -> tensor in our names, source) of a moeadapt model directory or a Hugging Face one (streamed and
    name-mapped into a CPU model of the same spec). Reads the whole checkpoint."""
    p = Path(path)
    if _is_hf_dir(p):
        from ..onboard import load_weights

        plain = materialize(build_model(model.spec, "meta"), "cpu")
        load_weights(p, plain)
        return {k: v for k, v in plain.state_dict().items() if not k.endswith("tokens_per_expert")}, str(p)
    f = p / "model.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"{p} holds no model.safetensors; give a directory written by `moeadapt train`")
    return load_tensors(f), str(f)


def init_from_fill(path: str | Path, model: HybridMoEModel, fallback: Fill) -> Fill:
    """A fill serving each slice from the checkpoint at `path`; tensors a base checkpoint cannot hold (LoRA
    adapters) come from `fallback`. Fails before anything is allocated when names or shapes do not match."""
    state, source = read_init_state(path, model)
    own = {k: tuple(v.shape) for k, v in model.state_dict().items() if not k.endswith("tokens_per_expert")}
    adapter = (".lora_A", ".lora_B")
    missing = [k for k in own if k not in state and not any(a in k for a in adapter)]
    extra = [k for k in state if k not in own]
    if missing or extra:
        raise ValueError(f"{source} does not match the model: missing {missing[:8]}, unexpected {extra[:8]}; was "
                         "it saved from another model config?")
    for k, v in state.items():
        if tuple(v.shape) != own[k]:
            raise ValueError(f"{source}: tensor {k} has shape {tuple(v.shape)}, the model expects {own[k]}; the "
                             "checkpoint belongs to another model config")

    def fill(name: str, global_shape: tuple[int, ...], local_slices: tuple[slice, ...]) -> torch.Tensor:
        return state[name][local_slices] if name in state else fallback(name, global_shape, local_slices)

    return fill


def load_model(model_dir: str | Path, model: HybridMoEModel) -> None:
    """Weights from a moeadapt model directory, or (streamed and name-mapped) from a Hugging Face one, into an
    already materialised, unsharded model."""
    p = Path(model_dir)
    if _is_hf_dir(p):
        from ..onboard import load_weights

        load_weights(p, model)
        return
    state, source = read_init_state(p, model)
    load_state_into(model, {k: v.to(model.embed.weight.dtype) if v.is_floating_point() and "expert_bias" not in k
                            else v for k, v in state.items()}, source)
