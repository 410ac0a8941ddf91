"""CopyAdamW (parallel/optim.py) through a one-rank DCP checkpoint, as `torchrun --nproc_per_node 1` saves and
resumes it (parallel/checkpoint.py writes the loaded AdamW state straight into optimizer.state): the resumed run's
losses are the unbroken run's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from _harness import spawn
from test_checkpoint import MORE, SAVE_AT, _steps

pytestmark = pytest.mark.dist


def _setup(moments: str):
    from test_checkpoint import _setup as setup

    from moeadapt.parallel.optim import CopyAdamW

    spec, model, dims, params, _, _ = setup(dict(dp_shard=1), False)
    opt = CopyAdamW(params, None, lr=3e-3, weight_decay=0.01, moment_dtype=getattr(torch, moments))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    return spec, model, dims, params, opt, sched


def _run(rank, world, root: str, moments: str):
    from moeadapt.parallel.checkpoint import load_distributed, save_distributed

    spec, model, dims, params, opt, sched = _setup(moments)
    _steps(spec, model, dims, params, opt, sched, 0, SAVE_AT)
    save_distributed(Path(root) / "ckpt", SAVE_AT, model, opt, sched, {"pos": SAVE_AT}, dims)
    after = _steps(spec, model, dims, params, opt, sched, SAVE_AT, MORE)
    spec, model, dims, params, opt, sched = _setup(moments)
    load_distributed(Path(root) / "ckpt" / f"step_{SAVE_AT:07d}", model, opt, sched, dims)
    resumed = _steps(spec, model, dims, params, opt, sched, SAVE_AT, MORE)
    (Path(root) / "losses.json").write_text(json.dumps([after, resumed]))


@pytest.mark.parametrize("moments", ["float32", "bfloat16"])
def test_copy_adamw_resumes_from_a_one_rank_dcp_checkpoint(tmp_path, moments):
    spawn(_run, 1, str(tmp_path), moments)
    after, resumed = json.loads((tmp_path / "losses.json").read_text())
    assert resumed == pytest.approx(after, rel=1e-6, abs=1e-7), (after, resumed)
