"""DCP checkpoints: save at 4 ranks (ep=4; LoRA at ep=2), resume at 2 ranks (ep=2) and at 1 rank with the same
losses as the run that went on without stopping."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _harness import batch, build, micro_spec, spawn

pytestmark = pytest.mark.dist

ROWS, SEQ, SAVE_AT, MORE = 8, 16, 2, 2


def _setup(par: dict, lora: bool):
    from moeadapt.config import ParallelSpec
    from moeadapt.parallel import build_parallel_dims, parallelize_model

    spec = micro_spec(bias_update_rate=0.05)
    model = build(spec, lora)
    dims = build_parallel_dims(ParallelSpec(**par), spec, "cpu")
    parallelize_model(model, dims)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return spec, model, dims, params, opt, sched


def _steps(spec, model, dims, params, opt, sched, start: int, n: int) -> list[float]:
    from moeadapt.models.router import update_expert_bias
    from moeadapt.parallel import clip_grad_norm_, counts_reduce

    rank, world = dist.get_rank(), dist.get_world_size()
    per, losses = ROWS // world, []
    for step in range(start, start + n):
        x, y = batch(spec, ROWS, SEQ, seed=1000 + step)  # the global batch of this step
        out = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per], return_logits=False)
        (out.loss + out.aux_loss).backward()
        clip_grad_norm_(params, 0.5, dims)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        update_expert_bias(model, counts_reduce=counts_reduce)
        loss = out.loss.detach().clone()
        dist.all_reduce(loss)
        losses.append(float(loss) / world)
    return losses


def _save_run(rank, world, root: str):
    # full: ep=4 (one expert shard per rank); LoRA: ep=2 x dp_shard_in_ep=2 (each ep shard FSDP-sharded over
    # two ranks: the save gathers it and DCP writes it once)
    _save_one(rank, world, str(Path(root) / "full"), False, dict(dp_shard=4, ep=4))
    _save_one(rank, world, str(Path(root) / "lora"), True, dict(dp_shard=4, ep=2))


def _resume_run(rank, world, root: str, par: dict):
    for lora in (False, True):
        _resume_one(rank, world, str(Path(root) / ("lora" if lora else "full")), lora, par)


def _save_one(rank, world, root: str, lora: bool, par: dict):
    from moeadapt.parallel.checkpoint import save_distributed

    spec, model, dims, params, opt, sched = _setup(par, lora)
    _steps(spec, model, dims, params, opt, sched, 0, SAVE_AT)
    save_distributed(Path(root) / "ckpt", SAVE_AT, model, opt, sched, {"pos": SAVE_AT}, dims)
    after = _steps(spec, model, dims, params, opt, sched, SAVE_AT, MORE)
    if rank == 0:
        (Path(root) / "expected.json").write_text(json.dumps(after))


def _resume_one(rank, world, root: str, lora: bool, par: dict):
    from moeadapt.parallel.checkpoint import load_distributed
    from moeadapt.train.checkpoint import latest_checkpoint

    spec, model, dims, params, opt, sched = _setup(par, lora)
    last = latest_checkpoint(Path(root) / "ckpt")
    assert last is not None and last.name == f"step_{SAVE_AT:07d}"
    step, sampler = load_distributed(last, model, opt, sched, dims)
    assert step == SAVE_AT and sampler == {"pos": SAVE_AT}
    got = _steps(spec, model, dims, params, opt, sched, step, MORE)
    want = json.loads((Path(root) / "expected.json").read_text())
    for g, w in zip(got, want):
        assert abs(g - w) < 1e-5, f"resumed at world {world} {par} lora={lora}: losses {got} vs {want}"


def test_checkpoint_reshards_across_world_and_ep(tmp_path):
    """Full fine-tuning (4 ranks ep=4) and LoRA (adapters only, 4 ranks ep=2) -> 2 ranks ep=2 -> 1 rank."""
    spawn(_save_run, 4, str(tmp_path))
    for kind in ("full", "lora"):
        assert not list((tmp_path / kind / "ckpt").glob(".*tmp*")), "temporary checkpoint directory left behind"
    spawn(_resume_run, 2, str(tmp_path), dict(dp_shard=2, ep=2))
    spawn(_resume_run, 1, str(tmp_path), dict(dp_shard=1, ep=1))
