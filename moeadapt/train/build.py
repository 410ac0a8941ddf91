"""Building the model a run trains, scale-true: no process ever allocates more than its own shards.

    model = build_meta(cfg, device)          # meta: LoRA injected, frozen base typed bf16 on GPU
    materialize_shards(model, cfg, run)      # run.parallelize on meta -> to_empty -> fill each local shard

The single process is the same path with a world of one (LocalRun.parallelize does nothing). The values
come from a fill function (parallel/shards.py states the contract): the seeded init of models/init.py, which
gives the same global weights at every world size and EP degree; then `init_from` is read into the shards,
each rank reading only the slices it holds (`run.load_init`: parallel/sharded_io.py; adapters, absent from a
base checkpoint, keep the init). The frozen base of a LoRA run on GPU is typed bf16 on meta, so its shards
are written in bf16 directly; trainable parameters stay fp32.
Must not know about ranks: the run object and parallel/ do.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..config import RunConfig
from ..lora import cast_frozen_, inject_lora
from ..models.init import Fill, init_fill
from ..models.model import HybridMoEModel, build_model
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
    from_ckpt = fill is None and bool(cfg.train.init_from)
    fill = fill or init_fill(model, cfg.train.seed, run.device)
    run.parallelize(model)
    model.to_empty(device=run.device)
    fill_shards(model, fill)
    if from_ckpt:  # every rank reads only the slices it holds (parallel/sharded_io.py); adapters keep the init
        run.load_init(model, cfg.train.init_from)
    return model


def load_model(model_dir: str | Path, model: HybridMoEModel) -> dict:
    """Weights from a model directory (ours or Hugging Face: one file or indexed shards, FP8 dequantised) or a
    full-training DCP checkpoint into a built model, tensor by tensor (the single-process case of
    `parallel.sharded_io.load_init_from`)."""
    from ..parallel.sharded_io import load_init_from

    return load_init_from(model, model_dir)
