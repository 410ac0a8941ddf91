"""The step's verdict read one step late: with a fused AdamW the trainer applies or skips each step on the device
(`found_inf`) and reads whether it did while the next step is queued. Compared with the optimizer that reads the
verdict before stepping (a non-fused AdamW), the run must be the same: the same losses, lr and skips at every
step, with a NaN-loss step and a step without targets among them (micro model, CPU)."""

from __future__ import annotations

import json

import torch

from moeadapt import api
from moeadapt.config import build_run_config
from moeadapt.data import dataset
from moeadapt.models import model as model_mod
from moeadapt.models.router import Router, update_expert_bias
from moeadapt.parallel.optim import ShardedAdamW
from moeadapt.train import trainer
from moeadapt.train.metrics import read_metrics
from tests.conftest import micro_spec


def _cfg(tmp_path, name, seed):
    t = dict(steps=7, lr=3e-3, warmup_steps=2, micro_batch_size=2, seq_len=32, log_every=1, eval_batches=1,
             output_dir=str(tmp_path / name), seed=seed, max_bad_steps=3)
    return build_run_config({"model": micro_spec().model_dump(), "train": t,
                             "data": {"train": "builtin:tinystories", "eval_fraction": 0.01}})


def _run(tmp_path, monkeypatch, name, seed, fused):
    """Steps 3 (NaN loss) and 5 (no target token) are skipped; the rest apply."""
    orig_fwd, calls = model_mod.HybridMoEModel.forward, {"n": 0, "rows": 0}

    def nan_on_third(self, *a, **k):
        out = orig_fwd(self, *a, **k)
        if self.training:
            calls["n"] += 1
            if calls["n"] == 3:
                out.loss = out.loss * float("nan")
        return out

    class NoTargetsFifth(dataset.Sampler):
        def next(self):
            x, y, extra = super().next()
            calls["rows"] += 1
            return (x, torch.full_like(y, -100), extra) if calls["rows"] == 5 else (x, y, extra)

    def build(params, train, device, copies=None):
        return ShardedAdamW(params, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay, fused=fused)

    monkeypatch.setattr(model_mod.HybridMoEModel, "forward", nan_on_third)
    monkeypatch.setattr(trainer, "Sampler", NoTargetsFifth)
    monkeypatch.setattr(trainer, "build_optimizer", build)
    r = api.train(_cfg(tmp_path, name, seed), quiet=True)
    recs = {x["step"]: x for x in read_metrics(r.output_dir / "metrics.jsonl") if x["kind"] == "train"}
    return r, recs, json.loads((r.output_dir / "summary.json").read_text())


def test_device_skip_matches_the_host_read(tmp_path, monkeypatch, seed):
    s = seed % 1000
    r_dev, dev, sum_dev = _run(tmp_path, monkeypatch, "deferred", s, fused=True)
    r_host, host, sum_host = _run(tmp_path, monkeypatch, "immediate", s, fused=False)
    assert sorted(dev) == sorted(host) == [1, 2, 4, 6, 7]
    for k in (sum_dev, sum_host):
        assert k["skipped_nonfinite_steps"] == 1 and k["skipped_no_target_steps"] == 1, k
    for step in dev:
        a, b = dev[step], host[step]
        assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(b["loss"])), (step, a["loss"], b["loss"])
        assert abs(a["lr"] - b["lr"]) <= 1e-12, (step, a["lr"], b["lr"])  # skipped steps do not advance it
        assert abs(a["grad_norm"] - b["grad_norm"]) < 1e-3 * max(1.0, b["grad_norm"]), step
    assert abs(r_dev.eval_after - r_host.eval_after) < 1e-4, (r_dev.eval_after, r_host.eval_after)
    # the fused run clips inside AdamW (grad_scale), the other in place first: the comparison covers a clipped step
    assert any(x["grad_norm"] > 1.0 for x in host.values()), [x["grad_norm"] for x in host.values()]


def test_a_skipped_step_keeps_the_router_biases():
    torch.manual_seed(0)
    model = model_mod.HybridMoEModel(micro_spec())
    routers = [m for m in model.modules() if isinstance(m, Router)]
    assert routers and all(m.spec.bias_update_rate > 0 for m in routers)
    for m in routers:
        m.tokens_per_expert.copy_(torch.arange(m.tokens_per_expert.numel(), dtype=m.tokens_per_expert.dtype))
    before = [m.expert_bias.clone() for m in routers]
    update_expert_bias(model, apply=torch.tensor(False))
    assert all(torch.equal(b, m.expert_bias) for b, m in zip(before, routers))
    assert all(not m.tokens_per_expert.any() for m in routers)  # the skipped step's counts are dropped
    for m in routers:
        m.tokens_per_expert.copy_(torch.arange(m.tokens_per_expert.numel(), dtype=m.tokens_per_expert.dtype))
    update_expert_bias(model, apply=torch.tensor(True))
    assert all(not torch.equal(b, m.expert_bias) for b, m in zip(before, routers))
