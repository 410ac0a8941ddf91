"""CopyAdamW (parallel/optim.py) through a DCP checkpoint, as `torchrun` saves and resumes it (parallel/checkpoint.py
writes the loaded AdamW state straight into optimizer.state): the resumed run's losses are the unbroken run's, at one
rank and, with bf16 moments, at two FSDP2 ranks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _harness import spawn
from test_checkpoint import MORE, SAVE_AT, _steps

pytestmark = pytest.mark.dist


def _setup(moments: str, world: int):
    from test_checkpoint import _setup as setup

    from moeadapt.parallel.optim import CopyAdamW

    spec, model, dims, params, _, _ = setup(dict(dp_shard=world), False)
    opt = CopyAdamW(params, None, lr=3e-3, weight_decay=0.01, moment_dtype=getattr(torch, moments))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return spec, model, dims, params, opt, sched


def _run(rank, world, root: str, moments: str):
    from torch.distributed.tensor import DTensor

    from moeadapt.parallel.checkpoint import load_distributed, save_distributed

    spec, model, dims, params, opt, sched = _setup(moments, world)
    before = _steps(spec, model, dims, params, opt, sched, 0, SAVE_AT)
    save_distributed(Path(root) / "ckpt", SAVE_AT, model, opt, sched, {"pos": SAVE_AT}, dims)
    after = _steps(spec, model, dims, params, opt, sched, SAVE_AT, MORE)
    st = opt.state[params[0]]
    assert st["exp_avg"].dtype == getattr(torch, moments) and isinstance(st["exp_avg"], DTensor) == (world > 1)
    spec, model, dims, params, opt, sched = _setup(moments, world)
    load_distributed(Path(root) / "ckpt" / f"step_{SAVE_AT:07d}", model, opt, sched, dims)
    resumed = _steps(spec, model, dims, params, opt, sched, SAVE_AT, MORE)
    if rank == 0:
        (Path(root) / "losses.json").write_text(json.dumps([before + after, resumed]))


def test_copy_adamw_resumes_from_a_dcp_checkpoint(tmp_path):
    """One rank (torchrun world 1) with fp32 moments, and two FSDP2 ranks with bf16 moments (CopyAdamW steps the
    local shards; its DTensor states go through DCP): each resumed run's losses are its unbroken run's, and the
    two-rank bf16 run trains as the one-rank fp32 run does (its rounding draws other bits: to 1e-4). bf16 moments
    through the one-process checkpoint: tests/train/test_copies.py."""
    runs = {}
    for moments, world in (("float32", 1), ("bfloat16", 2)):
        root = tmp_path / f"{moments}_{world}"
        root.mkdir()
        spawn(_run, world, str(root), moments)
        run, resumed = json.loads((root / "losses.json").read_text())
        assert resumed == pytest.approx(run[SAVE_AT:], rel=1e-6, abs=1e-7), (moments, world, run, resumed)
        runs[moments, world] = run
    assert runs["bfloat16", 2] == pytest.approx(runs["float32", 1], rel=1e-4)
