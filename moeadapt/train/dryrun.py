"""Dry run of a parallel plan: the trainer's own build path on the meta device, one simulated rank at a time.

`dry_run(cfg, world)` and `moeadapt train CONFIG --dry-run --world N`: for each simulated rank it joins
PyTorch's fake process group of N ranks (collectives do nothing; no data exists), makes the run's real
`DistributedRun` (meshes, degree checks), runs `build_meta` + `DistributedRun.parallelize` (EP slicing,
activation checkpointing, fully_shard) exactly as `train()` does, and measures what this rank's shards
would occupy (`parallel.shards.shard_bytes`) without allocating them. Beside it: the planner's count for the
same plan (`plan.memory.state_bytes`), which must agree (the test holds them to 2%).

Simulated ranks: by default rank 0 only (under torch.chunk sharding it holds the most; every EP rank holds
E/ep experts); `ranks=[0, N - 1]` adds the one holding the least. One rank of hybrid-2.8t at 128 ranks is
~2,500 fully_shard'ed parameters: FSDP2's own per-parameter set-up on meta is most of the time. Reported: parameter / gradient / optimizer bytes, the
largest local shard, and the largest transient the initialisation draws (one fp32 row block, models/init.py).
The target is a GPU run (frozen LoRA base in bf16) unless `device="cpu"`.
Must not allocate parameter storage or talk to a real process group.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch
import torch.distributed as dist

from ..config import RunConfig
from ..models.init import init_block_bytes
from ..parallel.shards import global_layout, named_tensors, shard_bytes
from ..plan.memory import Plan, state_bytes
from ..ui import make_console
from .build import build_meta
from .copies import resolve_weight_dtype, store_bf16, why_not_bf16

console = make_console()


def _simulate_rank(cfg: RunConfig, world: int, rank: int, device: torch.device) -> dict:
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from ..parallel import DistributedRun

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        run = DistributedRun(cfg, torch.device("cpu"))  # fake group: the meshes are real, the traffic is not
        model = build_meta(cfg, device)
        run.parallelize(model)
        if cfg.train.weight_dtype != "fp32":  # as the trainer stores them (one process: train/copies.py)
            store_bf16(model)
        b = Plan.state_dtypes(cfg.train.weight_dtype, cfg.train.moment_dtype)
        out = shard_bytes(model, moment_bytes=b["moment_bytes"], lo_bytes=b["lo_bytes"])
        out["init_block"] = max(init_block_bytes(global_layout(t, m)[0]) for _, t, m in named_tensors(model))
        out["rank"] = rank
        return out
    finally:
        dist.destroy_process_group()


def dry_run(cfg: RunConfig, world: int | None = None, ranks: list[int] | None = None, device: str = "cuda",
            quiet: bool = False) -> dict:
    """Per-rank bytes of the plan in `cfg.parallel` at `world` ranks (default: the plan's world size), with
    the planner's figures for the same plan. Runs in this process; needs no GPU."""
    if dist.is_initialized():
        raise RuntimeError("dry_run simulates its own process group; call it outside torchrun / an initialised group")
    par = cfg.parallel
    world = world or par.world_size
    if world != par.world_size:
        raise ValueError(f"--world {world} but the config's parallel section gives dp_replicate*dp_shard*cp = "
                         f"{par.world_size}; set parallel.dp_shard (e.g. --set parallel.dp_shard={world // par.cp})")
    cfg = resolve_weight_dtype(cfg, SimpleNamespace(world=world), torch.device("cuda"))  # as the trainer settles it
    why = why_not_bf16(cfg, SimpleNamespace(world=world), torch.device("cuda"))  # the trainer's refusals
    if why:
        raise ValueError(why)
    t0 = time.perf_counter()
    dev = torch.device(device)
    rows = [_simulate_rank(cfg, world, r, dev) for r in (ranks if ranks is not None else [0])]
    plan = Plan(world, par.dp_replicate, par.dp_shard, par.cp, par.ep, par.activation_checkpointing,
                cfg.train.micro_batch_size, cfg.train.seq_len, a2a_chunks=par.a2a_chunks,
                ep_capacity_factor=par.ep_capacity_factor,
                **Plan.state_dtypes(cfg.train.weight_dtype, cfg.train.moment_dtype))
    base_bytes = 2 if (cfg.lora is not None and dev.type == "cuda") else 4
    planned = state_bytes(cfg.model, plan, cfg.lora, base_bytes)
    r0 = next((r for r in rows if r["rank"] == 0), None)
    ratio = {k: r0[k] / planned[k] for k in ("weights", "grads", "optimizer") if r0 and planned[k]}
    res = {"model": cfg.model.name, "world": world, "plan": plan.label(), "lora": cfg.lora is not None,
           "ranks": rows, "planner_rank0": planned, "runtime_over_planner": ratio,
           "seconds": time.perf_counter() - t0}
    if not quiet:
        _print(res)
    return res


def _print(res: dict) -> None:
    from rich.table import Table

    def b(n: float) -> str:
        return f"{n / 2**30:.3f} GiB" if n >= 2**30 else f"{n / 2**20:.3f} MiB"

    t = Table(title=f"dry run: {res['model']} {'LoRA' if res['lora'] else 'full'}, {res['world']} ranks, "
                    f"{res['plan']} ({res['seconds']:.1f} s)")
    for c in ("rank", "params", "grads", "optimizer", "largest shard", "init block"):
        t.add_column(c, justify="right")
    for r in res["ranks"]:
        t.add_row(str(r["rank"]), b(r["weights"]), b(r["grads"]), b(r["optimizer"]), b(r["largest_tensor"]),
                  b(r["init_block"]))
    p = res["planner_rank0"]
    t.add_row("plan", b(p["weights"]), b(p["grads"]), b(p["optimizer"]), "", "")
    console.print(t)
    console.print("runtime / planner (rank 0): " + ", ".join(f"{k} {v:.4f}" for k, v in res["runtime_over_planner"].items()))
