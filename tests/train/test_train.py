import json

import pytest
import torch

from moeadapt import api
from moeadapt.config import build_run_config
from moeadapt.onboard import model_spec_from_dir
from moeadapt.train.metrics import load_quantiles, read_metrics
from moeadapt.train.trainer import TrainingError
from tests.conftest import micro_spec


def cfg(tmp_path, **train):
    t = dict(steps=12, lr=3e-3, warmup_steps=2, micro_batch_size=4, seq_len=32, log_every=1, eval_batches=2,
             output_dir=str(tmp_path / "run"), seed=3)
    t.update(train)
    t["warmup_steps"] = min(t["warmup_steps"], t["steps"])
    return build_run_config({"model": micro_spec().model_dump(), "train": t,
                             "data": {"train": "builtin:tinystories", "eval_fraction": 0.01}})


def losses(run_dir):
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if r["kind"] == "train"}


def test_loss_falls_and_outputs(tmp_path):
    r = api.train(cfg(tmp_path, steps=40), quiet=True)
    ls = losses(r.output_dir)
    assert sum(list(ls.values())[-5:]) / 5 < ls[1] - 1.0
    assert r.eval_after < r.eval_before - 0.5
    for f in ("model/model.safetensors", "model/config.json", "report.png", "summary.json", "config.yaml"):
        assert (r.output_dir / f).is_file(), f
    rec = [x for x in read_metrics(r.output_dir / "metrics.jsonl") if x["kind"] == "train"][-1]
    assert {"p50", "p90", "p99", "max", "min", "zero_frac", "drop_rate"} <= set(rec["moe"][0])
    assert rec["tokens_per_s"] > 0


def test_resume_reproduces_losses_exactly(tmp_path):
    c = cfg(tmp_path, save_every=6)
    api.train(c, quiet=True)
    full = losses(tmp_path / "run")
    ck = tmp_path / "run" / "checkpoints"
    (ck / "latest").write_text("step_0000006")
    c2 = cfg(tmp_path, save_every=6, resume=True)
    api.train(c2, quiet=True)
    recs = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert {"kind": "resume", "step": 6} in recs
    resumed = losses(tmp_path / "run")
    assert sorted(resumed) == list(range(1, 13))
    for s in range(7, 13):
        assert resumed[s] == full[s], (s, resumed[s], full[s])


def test_lora_finetune_from_base(tmp_path):
    base = api.train(cfg(tmp_path, steps=3), quiet=True).output_dir / "model"
    c = build_run_config({"model": str(base), "lora": {"rank": 4, "targets": ["attn.q_proj", "experts.w1"]},
                          "train": dict(steps=3, micro_batch_size=2, seq_len=32, init_from=str(base),
                                        output_dir=str(tmp_path / "ft"), eval_batches=1),
                          "data": {"train": "builtin:recall_qa", "eval_fraction": 0.01}},
                         from_dir=model_spec_from_dir)
    r = api.train(c, quiet=True)
    assert (r.output_dir / "adapter" / "adapter_model.safetensors").is_file()
    out = api.generate(base, "Lily has", adapter=r.output_dir / "adapter", max_new_tokens=5)
    assert isinstance(out, str)
    merged = api.merge_adapter(base, r.output_dir / "adapter", tmp_path / "merged")
    ev_a = api.evaluate(base, "builtin:recall_qa", adapter=r.output_dir / "adapter", seq_len=32, max_batches=2)
    ev_m = api.evaluate(merged, "builtin:recall_qa", seq_len=32, max_batches=2)
    assert ev_a["loss"] == pytest.approx(ev_m["loss"], rel=1e-4)


def test_nan_loss_skips_then_stops(tmp_path, monkeypatch):
    from moeadapt.models import model as model_mod

    orig = model_mod.HybridMoEModel.forward

    def nan_forward(self, *a, **k):
        out = orig(self, *a, **k)
        out.loss = out.loss * float("nan")
        return out

    monkeypatch.setattr(model_mod.HybridMoEModel, "forward", nan_forward)
    with pytest.raises(TrainingError, match="3 steps in a row with a NaN/Inf loss"):
        api.train(cfg(tmp_path, max_bad_steps=3), quiet=True)


def test_load_quantiles():
    q = load_quantiles(torch.tensor([0, 2, 2, 4, 12]))
    assert q["max"] == pytest.approx(3.0) and q["min"] == 0 and q["zero_frac"] == pytest.approx(0.2)
    assert q["p50"] == pytest.approx(0.5)


@pytest.mark.parametrize("steps", [[5], [2, 4, 6]])
def test_report_heat_map_centres_each_logged_step(tmp_path, monkeypatch, steps):
    """report.png's layer x step heat map: one column per logged step, centred on it (one step too, which
    left the map's extent empty)."""
    import warnings

    from matplotlib.axes import Axes

    from moeadapt.train.metrics import plot_report

    moe = [{"layer": layer, "p50": 1.0, "p90": 1.2, "p99": 1.5, "max": 2.0} for layer in (1, 3)]
    path = tmp_path / "metrics.jsonl"
    path.write_text("".join(json.dumps({"kind": "train", "step": s, "loss": 3.0, "moe": moe}) + "\n" for s in steps))
    seen, imshow = {}, Axes.imshow

    def spy(self, *a, **k):
        seen["extent"] = k["extent"]
        return imshow(self, *a, **k)

    monkeypatch.setattr(Axes, "imshow", spy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_report(path, tmp_path / "report.png")
    lo, hi = seen["extent"][:2]
    width = (hi - lo) / len(steps)
    assert [lo + width * (i + 0.5) for i in range(len(steps))] == pytest.approx(steps)
    assert (tmp_path / "report.png").stat().st_size > 0


def test_init_from_wrong_model_is_clear(tmp_path):
    base = api.train(cfg(tmp_path, steps=1), quiet=True).output_dir / "model"
    c = build_run_config({"model": micro_spec(hidden_size=48).model_dump(),
                          "train": dict(steps=1, micro_batch_size=2, seq_len=32, init_from=str(base),
                                        output_dir=str(tmp_path / "x"))})
    with pytest.raises(ValueError, match="has shape"):
        api.train(c, quiet=True)
    assert json.loads((base / "config.json").read_text())["moeadapt"]["hidden_size"] == 32


def test_merge_microbatches_matches_accumulation(tmp_path):
    a = api.train(cfg(tmp_path / "a", steps=4, grad_accum_steps=2, micro_batch_size=2), quiet=True)
    b = api.train(cfg(tmp_path / "b", steps=4, grad_accum_steps=2, micro_batch_size=2, merge_microbatches=True),
                  quiet=True)
    la, lb = losses(a.output_dir), losses(b.output_dir)
    assert la.keys() == lb.keys()
    for s in la:
        assert lb[s] == pytest.approx(la[s], rel=1e-4), s


def test_steady_state_speed_leaves_out_first_steps_and_evals(tmp_path, monkeypatch):
    """summary.json reports the steady-state tokens/s (train steps after the first STEADY_SKIP) next to the wall
    clock figure; an eval made 0.4 s slower must lower the wall-clock figure and not the steady one."""
    import time

    from moeadapt.train import trainer

    slow = trainer.evaluate

    def slow_eval(*a, **k):
        time.sleep(0.4)
        return slow(*a, **k)

    monkeypatch.setattr(trainer, "evaluate", slow_eval)
    monkeypatch.setattr(trainer, "peak_flops", lambda device: 2.0e9)  # the CPU has no peak: MFU against a made-up one
    r = api.train(cfg(tmp_path, steps=8, eval_every=2), quiet=True)
    s = json.loads((r.output_dir / "summary.json").read_text())
    assert s["steady_steps"] == 8 - trainer.STEADY_SKIP
    assert s["tokens_per_s_steady"] == r.tokens_per_s_steady
    # MFU of the steady speed on the 6 x active non-embedding parameters basis (full fine-tuning here)
    from moeadapt.models.model import build_model
    from moeadapt.models.stats import count_parameters

    spec = micro_spec()
    counts = count_parameters(build_model(spec, "meta"), spec)
    assert s["flops_per_token"] == 6 * (counts["active_per_token"] - counts["by_component"]["embeddings"])
    assert s["mfu_steady"] == pytest.approx(s["tokens_per_s_steady"] * s["flops_per_token"] / 2.0e9, rel=1e-9)
    # and with attention's own FLOPs for the run's seq_len (models.stats; its products checked there)
    from moeadapt.models.stats import attention_flops_per_token

    attn = attention_flops_per_token(spec, 32)
    assert attn > 0 and s["attention_flops_per_token"] == attn
    assert s["mfu_steady_with_attention"] == pytest.approx(
        s["tokens_per_s_steady"] * (s["flops_per_token"] + attn) / 2.0e9, rel=1e-9)
    logged = [json.loads(x) for x in (r.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(x["mfu"] == pytest.approx(x["tokens_per_s"] * s["flops_per_token"] / 2.0e9)
               for x in logged if x["kind"] == "train")
    assert all(x["mfu_with_attention"] == pytest.approx(x["tokens_per_s"] * (s["flops_per_token"] + attn) / 2.0e9)
               for x in logged if x["kind"] == "train")
    # the 3 periodic evals (1.2 s of sleep) fall inside the loop's wall clock, not inside the steady steps: the
    # loop's wall clock holds the steady steps' own seconds plus those sleeps (and the first steps), whatever
    # speed a loaded box runs the steps at
    steady_tokens = s["tokens_per_s"] * s["elapsed_s"] * s["steady_steps"] / 8
    assert s["elapsed_s"] - steady_tokens / s["tokens_per_s_steady"] > 1.1, s
    monkeypatch.undo()
    short = api.train(cfg(tmp_path / "short", steps=trainer.STEADY_SKIP), quiet=True)
    assert short.tokens_per_s_steady is None
    assert json.loads((short.output_dir / "summary.json").read_text())["mfu_steady"] is None  # no steady steps, CPU


def test_the_steady_speed_leaves_out_a_cuda_graphs_capture():
    """With a CUDA graph the step after its eager warm-up captures (~3x a replayed step): the steady speed starts
    after it; eager runs skip only the compiling first steps."""
    from types import SimpleNamespace

    from moeadapt.train import graph, trainer

    assert trainer.steady_skip(SimpleNamespace(graph=None)) == trainer.STEADY_SKIP
    assert trainer.steady_skip(SimpleNamespace(graph=object())) == graph.WARMUP + 1 > trainer.STEADY_SKIP


def test_logged_tokens_per_s_is_each_steps_own(tmp_path, monkeypatch):
    """Each train line's tokens/s covers its own step's work and nothing else: every step made 0.1 s slower and
    every eval 1 s slower, the lines (one per step, read one step late) must each imply a step of 0.1-0.9 s: not
    ~0 for the last step (read right after the step before it) nor over 1 s for the step after an eval."""
    import time

    from moeadapt.train import trainer

    fwd_bwd, slow = trainer._forward_backward, trainer.evaluate

    def slow_step(*a, **k):
        time.sleep(0.1)
        return fwd_bwd(*a, **k)

    def slow_eval(*a, **k):
        time.sleep(1.0)
        return slow(*a, **k)

    monkeypatch.setattr(trainer, "_forward_backward", slow_step)
    monkeypatch.setattr(trainer, "evaluate", slow_eval)
    r = api.train(cfg(tmp_path, steps=7, eval_every=3), quiet=True)
    recs = [x for x in read_metrics(r.output_dir / "metrics.jsonl") if x["kind"] == "train"]
    assert [x["step"] for x in recs] == list(range(1, 8))
    step_s = {x["step"]: 4 * 32 / x["tokens_per_s"] for x in recs}  # micro-batch 4 x seq 32 tokens a step
    assert all(0.1 <= v < 0.9 for s, v in step_s.items() if s > 1), step_s


def test_a_steps_end_is_its_queuing_or_the_reads_wait():
    """A GPU step the device had finished before the host read it (a host-bound step) ends when its queuing did;
    one still running ends when the read's wait does (the event's synchronize); one read without an event (no
    deferred read) ends at its read."""
    import time

    from moeadapt.train.trainer import StepStats, _Queued, _read

    class Event:
        def __init__(self, finished):
            self.finished, self.waited = finished, False

        def query(self):
            return self.finished

        def synchronize(self):
            self.waited = True

    verdict = torch.tensor([1.5, 1.0, 0.5, 10.0])
    for finished in (True, False):
        st = StepStats(loss=0.0, grad_norm=0.0, tokens=1, done_at=time.perf_counter() - 5.0)
        queued, ev = st.done_at, Event(finished)
        t = time.perf_counter()
        got = _read(_Queued(st, verdict, ev))
        assert ev.waited is not finished and got.loss == 1.5 and got.skipped is None
        assert (got.done_at == queued) if finished else (got.done_at >= t), (finished, got.done_at, queued, t)
    t = time.perf_counter()
    assert _read(_Queued(StepStats(loss=0.0, grad_norm=0.0, tokens=1), verdict)).done_at >= t


def test_pack_documents_reach_the_model(tmp_path, monkeypatch):
    """data.pack_documents: every train and eval forward gets position_ids of its rows (merged micro-batches
    included) that restart inside rows."""
    from moeadapt.models.model import HybridMoEModel

    seen, orig = [], HybridMoEModel.forward

    def spy(self, input_ids, *a, **kw):
        seen.append((input_ids.shape, kw.get("position_ids")))
        return orig(self, input_ids, *a, **kw)

    monkeypatch.setattr(HybridMoEModel, "forward", spy)
    data = tmp_path / "short.jsonl"
    data.write_text("".join(json.dumps({"text": "ab" * (i % 7 + 1)}) + "\n" for i in range(80)))
    c = cfg(tmp_path, steps=2, eval_batches=1, micro_batch_size=2, grad_accum_steps=2, merge_microbatches=True)
    c = c.model_copy(update={"data": c.data.model_copy(update={"pack_documents": True, "train": str(data),
                                                                "eval_fraction": 0.25})})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny shapes: one thread is many times faster on a loaded machine
    try:
        r = api.train(c, quiet=True)
    finally:
        torch.set_num_threads(threads)
    assert r.final_loss == r.final_loss and len(seen) == 4  # eval, 2 steps, eval
    assert all(p is not None and p.shape == s for s, p in seen)
    assert all(bool((p[:, 1:] == 0).any()) for _, p in seen)  # documents start inside rows


def test_pack_documents_with_a_vision_model_is_an_error(tmp_path):
    from moeadapt.config.presets import get_preset

    c = cfg(tmp_path, steps=1)
    c = c.model_copy(update={"model": get_preset("tiny-vl"),
                             "data": c.data.model_copy(update={"pack_documents": True})})
    with pytest.raises(TrainingError, match="data.pack_documents: false"):
        api.train(c, quiet=True)
