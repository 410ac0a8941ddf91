"""Reliability of a training run (micro model, CPU, a few steps each): nothing lost, nothing silent.

NaN/Inf gradients are skipped and never saved; a changed lr on resume takes effect; resume survives a
missing / dangling `latest` and a corrupt newest checkpoint and never overwrites a run unasked; a torn
metrics.jsonl line and a full disk are handled; zero-target batches are skipped and counted; activation
checkpointing applies in one process; interrupted saves are cleaned up, old checkpoints pruned, outputs
share one file mode; Ctrl-C exits 130 naming the step.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat

import pytest
import torch

from moeadapt import api
from moeadapt.config import build_run_config
from moeadapt.config.load import ConfigError
from moeadapt.train.metrics import read_metrics
from moeadapt.train.trainer import TrainingError
from tests.conftest import micro_spec


def cfg(tmp_path, lora=None, **train):
    t = dict(steps=4, lr=3e-3, warmup_steps=1, micro_batch_size=2, seq_len=32, log_every=1, eval_batches=1,
             output_dir=str(tmp_path / "run"), seed=3)
    t.update(train)
    raw = {"model": micro_spec().model_dump(), "train": t, "data": {"train": "builtin:tinystories",
                                                                    "eval_fraction": 0.01}}
    if lora:
        raw["lora"] = lora
    return build_run_config(raw)


def train_recs(run_dir):
    return {r["step"]: r for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"}


# ---------------------------------------------------------------- item 2: NaN/Inf gradient norm
def test_nonfinite_grad_norm_is_skipped_never_applied(tmp_path, monkeypatch):
    """A finite loss whose gradient is NaN: the update is skipped (counted in max_bad_steps), weights stay."""
    from moeadapt.train import trainer

    orig = trainer.train_step
    seen = {}

    def poisoned(lp):
        seen["w"] = lp.model.embed.weight.detach().clone()
        h = lp.params[0].register_hook(lambda g: g * float("nan"))
        try:
            return orig(lp)
        finally:
            h.remove()
            seen["after"] = lp.model.embed.weight.detach().clone()

    monkeypatch.setattr(trainer, "train_step", poisoned)
    with pytest.raises(TrainingError, match="3 steps in a row with a NaN/Inf loss or gradient norm at step 3"):
        api.train(cfg(tmp_path, max_bad_steps=3, save_every=1), quiet=True)
    assert torch.equal(seen["w"], seen["after"]) and torch.isfinite(seen["after"]).all()
    assert not (tmp_path / "run" / "checkpoints").exists() or not list((tmp_path / "run" / "checkpoints").glob("step_*"))


def test_nonfinite_weights_are_never_saved(tmp_path, monkeypatch):
    from moeadapt.train import trainer

    orig = trainer.update_expert_bias

    def break_weights(model, counts_reduce=None, apply=None):
        orig(model, counts_reduce, apply)
        with torch.no_grad():
            model.embed.weight[0, 0] = float("nan")

    monkeypatch.setattr(trainer, "update_expert_bias", break_weights)
    with pytest.raises(TrainingError, match="weights hold NaN/Inf at step 2; not saving"):
        api.train(cfg(tmp_path, save_every=2), quiet=True)
    assert not list((tmp_path / "run" / "checkpoints").glob("step_*"))


# ---------------------------------------------------------------- item 3: lr on resume
def test_changed_lr_on_resume_takes_effect(tmp_path):
    api.train(cfg(tmp_path, steps=4, save_every=2), quiet=True)
    (tmp_path / "run" / "checkpoints" / "latest").write_text("step_0000002")
    c = cfg(tmp_path, steps=4, save_every=2, resume=True, lr=3e-4)
    api.train(c, quiet=True)
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    change = [r for r in recs if r["kind"] == "lr_change"]
    assert change and change[0]["step"] == 2 and change[0]["train.lr"] == 3e-4
    from moeadapt.train.trainer import lr_lambda

    f = lr_lambda(c)
    logged = train_recs(tmp_path / "run")
    for step in (3, 4):  # the lr logged after step s is base * f(s)
        assert logged[step]["lr"] == pytest.approx(3e-4 * f(step), rel=1e-12)


# ---------------------------------------------------------------- item 4: resume candidates
def _run_with_checkpoints(tmp_path):
    api.train(cfg(tmp_path, steps=4, save_every=2), quiet=True)
    return tmp_path / "run" / "checkpoints"


@pytest.mark.parametrize("latest", ["missing", "dangling", "garbage"])
def test_resume_without_a_good_latest_takes_the_newest_complete_step(tmp_path, latest, capsys):
    ck = _run_with_checkpoints(tmp_path)
    if latest == "missing":
        (ck / "latest").unlink()
    elif latest == "dangling":
        (ck / "latest").write_text("step_0000099")
    else:
        (ck / "latest").write_bytes(b"\xff\xfe../../x")
    before = (ck / "step_0000004" / "model.safetensors").read_bytes()
    api.train(cfg(tmp_path, steps=6, save_every=2, resume=True), quiet=True)
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert {"kind": "resume", "step": 4} in recs
    assert sorted(train_recs(tmp_path / "run")) == [1, 2, 3, 4, 5, 6]  # the log was continued, not truncated
    assert (ck / "step_0000004" / "model.safetensors").read_bytes() == before


def test_corrupt_newest_checkpoint_falls_back_to_the_previous(tmp_path, capsys):
    ck = _run_with_checkpoints(tmp_path)
    f = ck / "step_0000004" / "model.safetensors"
    f.write_bytes(f.read_bytes()[:100])  # truncated
    api.train(cfg(tmp_path, steps=4, save_every=2, resume=True), quiet=True)
    out = capsys.readouterr().out
    assert "step_0000004 does not load" in out and "resumed from" in out and "step_0000002" in out
    assert {"kind": "resume", "step": 2} in read_metrics(tmp_path / "run" / "metrics.jsonl")


def test_nonfinite_checkpoint_is_not_resumed(tmp_path, capsys):
    from safetensors.torch import load_file, save_file

    ck = _run_with_checkpoints(tmp_path)
    f = ck / "step_0000004" / "model.safetensors"
    t = load_file(str(f))
    k = next(iter(t))
    t[k] = torch.full_like(t[k], float("nan"))
    save_file(t, str(f))
    api.train(cfg(tmp_path, steps=4, save_every=2, resume=True), quiet=True)
    assert "NaN/Inf" in capsys.readouterr().out
    assert {"kind": "resume", "step": 2} in read_metrics(tmp_path / "run" / "metrics.jsonl")


def test_fresh_start_never_overwrites_a_runs_checkpoints(tmp_path):
    ck = _run_with_checkpoints(tmp_path)
    metrics = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    with pytest.raises(ConfigError, match="already holds checkpoints .newest step_0000004.; set train.resume=true"):
        api.train(cfg(tmp_path, steps=4, save_every=2), quiet=True)
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == metrics
    assert {p.name for p in ck.glob("step_*")} == {"step_0000002", "step_0000004"}


def test_resume_with_another_lora_rank_is_one_clear_error(tmp_path):
    lo = {"rank": 4, "targets": ["attn.q_proj", "experts.w1"]}
    api.train(cfg(tmp_path, lora=lo, steps=2, save_every=2), quiet=True)
    with pytest.raises(TrainingError, match="no checkpoint under .* loads .step_0000002: .*shape.*lora.rank"):
        api.train(cfg(tmp_path, lora={**lo, "rank": 8}, steps=2, save_every=2, resume=True), quiet=True)


def test_optimizer_tensor_of_the_wrong_shape_is_named(tmp_path):
    from safetensors.torch import load_file, save_file

    from moeadapt.train.checkpoint import load_checkpoint

    ck = _run_with_checkpoints(tmp_path) / "step_0000004"
    f = ck / "optimizer.safetensors"
    t = load_file(str(f))
    k = next(k for k in t if k.endswith("exp_avg"))
    t[k] = torch.zeros(3)
    save_file(t, str(f))
    from moeadapt.models.model import build_model, materialize

    model = materialize(build_model(micro_spec(), "meta"), "cpu")
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    with pytest.raises(ValueError, match=f"{k} has shape \\(3,\\), its parameter has"):
        load_checkpoint(ck, model, opt, sched)


# ---------------------------------------------------------------- item 5: torn metrics, disk full
def test_torn_metrics_line_does_not_brick_the_run(tmp_path):
    _run_with_checkpoints(tmp_path)
    m = tmp_path / "run" / "metrics.jsonl"
    with m.open("a") as f:
        f.write('{"kind": "train", "step": 5, "loss": 1.2, "lr"')  # a write cut short
    assert read_metrics(m)[-1]["kind"] == "eval"  # tolerated on read
    api.train(cfg(tmp_path, steps=6, save_every=2, resume=True), quiet=True)
    assert sorted(train_recs(tmp_path / "run")) == [1, 2, 3, 4, 5, 6]
    lines = m.read_text().splitlines()
    assert all(json.loads(x) for x in lines)
    lines.insert(2, "{broken")
    m.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match="metrics.jsonl:3: not a JSON record"):
        read_metrics(m)


def test_disk_full_names_the_last_good_checkpoint(tmp_path, monkeypatch, capsys):
    from moeadapt.cli import main
    from moeadapt.train import checkpoint

    calls = {"n": 0}
    orig = checkpoint.save_tensors

    def full_after_first_save(tensors, path, metadata=None):
        calls["n"] += 1
        if calls["n"] > 3:  # the second checkpoint (3 safetensors files per save)
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return orig(tensors, path, metadata)

    monkeypatch.setattr(checkpoint, "save_tensors", full_after_first_save)
    c = tmp_path / "c.yaml"
    import yaml

    c.write_text(yaml.safe_dump(cfg(tmp_path, steps=4, save_every=2).model_dump(mode="json")))
    assert main(["train", str(c)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "disk full while writing" in err and "at step 4" in err and "step_0000002" in err
    ck = tmp_path / "run" / "checkpoints"
    assert [p.name for p in ck.iterdir() if p.name.startswith(".")] == []  # the torn save was removed


# ---------------------------------------------------------------- item 6: zero target tokens
def test_batches_without_targets_are_skipped_and_counted(tmp_path, monkeypatch):
    from moeadapt.data import dataset
    from moeadapt.train import trainer

    class MaskEveryOther(dataset.Sampler):
        n = 0

        def next(self):
            x, y, extra = super().next()
            MaskEveryOther.n += 1
            return (x, torch.full_like(y, -100), extra) if MaskEveryOther.n % 2 == 0 else (x, y, extra)

    monkeypatch.setattr(trainer, "Sampler", MaskEveryOther)
    r = api.train(cfg(tmp_path, steps=6), quiet=True)
    s = json.loads((r.output_dir / "summary.json").read_text())
    assert s["skipped_no_target_steps"] == 3 and s["skipped_nonfinite_steps"] == 0
    assert sorted(train_recs(r.output_dir)) == [1, 3, 5]
    assert all(rec["loss"] > 0.5 for rec in train_recs(r.output_dir).values())


def test_dataset_without_targets_is_an_error_naming_the_file(tmp_path):
    f = tmp_path / "chat.jsonl"
    f.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": "hello there " * 8}]})
                           for _ in range(40)) + "\n")
    c = cfg(tmp_path)
    c = c.model_copy(update={"data": c.data.model_copy(update={"train": str(f)})})
    with pytest.raises(ValueError, match=f"{f} has no target tokens"):
        api.train(c, quiet=True)
    base = api.train(cfg(tmp_path / "b", steps=1), quiet=True).output_dir / "model"
    with pytest.raises(ValueError, match="has no target tokens"):
        api.evaluate(base, str(f), seq_len=16)


# ---------------------------------------------------------------- item 8: single-process parallel settings
@pytest.mark.slow  # two short runs
def test_activation_checkpointing_applies_in_one_process(tmp_path, monkeypatch):
    from moeadapt.train import trainer

    seen = {}
    orig = trainer.fit

    def spy(lp, start):
        seen["ac"] = [getattr(b, "_moeadapt_ac", None) for b in lp.model.layers]
        return orig(lp, start)

    monkeypatch.setattr(trainer, "fit", spy)
    base = cfg(tmp_path / "a", steps=2)
    a = api.train(base, quiet=True)
    c = base.model_copy(update={"parallel": base.parallel.model_copy(update={"activation_checkpointing": "full"}),
                                "train": base.train.model_copy(update={"output_dir": str(tmp_path / "b")})})
    b = api.train(c, quiet=True)
    assert seen["ac"] == ["full"] * len(seen["ac"])
    la, lb = train_recs(a.output_dir), train_recs(b.output_dir)
    assert all(math.isclose(la[s]["loss"], lb[s]["loss"], rel_tol=1e-5) for s in la)


def test_parallel_degrees_without_torchrun_are_refused(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    base = cfg(tmp_path)
    c = base.model_copy(update={"parallel": base.parallel.model_copy(update={"dp_shard": 2})})
    with pytest.raises(ConfigError, match="need 2 processes; launch with `torchrun --nproc_per_node 2"):
        api.train(c, quiet=True)


# ---------------------------------------------------------------- item 11: housekeeping
def test_interrupted_saves_cleaned_old_checkpoints_pruned_modes_equal(tmp_path, capsys):
    ck = tmp_path / "run" / "checkpoints"
    (ck / ".step_0000002.tmp-abc123").mkdir(parents=True)
    (ck / ".step_0000002.tmp-abc123" / "model.safetensors").write_bytes(b"partial")
    (ck / ".step_0000004.tmp").mkdir()
    api.train(cfg(tmp_path, steps=6, save_every=1, keep_last_checkpoints=2, resume=True), quiet=True)
    assert "left by an interrupted save" in capsys.readouterr().out
    assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_0000005", "step_0000006"]
    run = tmp_path / "run"
    files = [p for p in run.rglob("*") if p.is_file()]
    modes = {stat.S_IMODE(p.stat().st_mode) for p in files}
    umask = os.umask(0)
    os.umask(umask)
    assert modes == {0o666 & ~umask}, {p.name: oct(stat.S_IMODE(p.stat().st_mode)) for p in files}


def test_skip_messages_number_steps_like_progress_lines(tmp_path, monkeypatch, capsys):
    from moeadapt.models import model as model_mod

    orig = model_mod.HybridMoEModel.forward
    n = {"calls": 0}

    def nan_on_second_step(self, *a, **k):
        out = orig(self, *a, **k)
        if self.training:
            n["calls"] += 1
            if n["calls"] == 2:
                out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(model_mod.HybridMoEModel, "forward", nan_on_second_step)
    api.train(cfg(tmp_path, steps=3), quiet=False)
    out = capsys.readouterr().out
    assert "step 2: loss is NaN/Inf - step skipped" in out
    assert "step     1 loss" in out and "step     3 loss" in out


def test_ctrl_c_exits_130_naming_the_step(tmp_path, monkeypatch, capsys):
    import yaml

    from moeadapt.cli import main
    from moeadapt.train import trainer

    orig = trainer.train_step
    n = {"k": 0}

    def interrupt_third(lp):
        n["k"] += 1
        if n["k"] == 3:
            raise KeyboardInterrupt
        return orig(lp)

    monkeypatch.setattr(trainer, "train_step", interrupt_third)
    c = tmp_path / "c.yaml"
    c.write_text(yaml.safe_dump(cfg(tmp_path, steps=4, save_every=2).model_dump(mode="json")))
    assert main(["train", str(c)]) == 130
    err = capsys.readouterr().err
    assert "interrupted at step 3 of 4" in err and "step_0000002" in err and "train.resume=true" in err
