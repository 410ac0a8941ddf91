"""GPU: `train.cuda_graph` (train/graph.py) trains as the eager step does. The tiny model (KDA, gated DSA,
LatentMoE), full fine-tuning and LoRA, runs the trainer's steps both ways from the same weights on the same
batches, a different batch each step: the losses, gradient norms and the weights' updates must agree (a replay
that kept the captured step's inputs, gradients or statistics would not). The DSA backward adds with atomics, so
the two runs agree to rounding, not bit for bit, and Adam's first steps move each weight by about lr whatever its
gradient's size (a near-zero gradient whose sign differs by rounding moves it the other way): the lr is small,
so that the losses are compared on near-equal weights, and the updates are compared as a whole."""

import copy
import os

import pytest
import torch

from tests.conftest import ListBatches

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0"),
]

ROWS, SEQ, STEPS, LR = 2, 256, 6, 1e-4


def _loops(seed, lora, ac="none"):
    from moeadapt.config import RunConfig, get_preset
    from moeadapt.lora import inject_lora
    from moeadapt.models.model import build_model, materialize
    from moeadapt.train import trainer
    from moeadapt.train.local import LocalRun
    from moeadapt.train.metrics import NullLogger

    spec = get_preset("tiny")
    raw = {"model": spec.model_dump(), "train": {"seed": seed % 1000, "device": "cuda", "micro_batch_size": ROWS,
                                                 "seq_len": SEQ, "grad_accum_steps": 2, "steps": STEPS,
                                                 "log_every": 2, "lr": LR, "warmup_steps": 0}}
    if lora:
        raw["lora"] = {"rank": 8, "alpha": 16}
    cfg = RunConfig.model_validate(raw)
    model = build_model(spec, "meta")
    if lora:
        inject_lora(model, cfg.lora)
    model = materialize(model, "cuda", seed=seed % 1000)
    if lora:  # B = 0 at init: give the adapters a value so that their gradients reach A too
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0, 0.02)
    model.set_backend("auto")
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(3, spec.vocab_size, (ROWS, SEQ + 1), generator=g) for _ in range(2 * STEPS)]

    out = []
    for graphed in (False, True):
        m = copy.deepcopy(model).train()
        if ac != "none":  # recompute inside the capture: checkpoint's forward and backward hooks run in it
            from moeadapt.parallel.activation import apply_activation_checkpointing

            apply_activation_checkpointing(m, ac)
        params = [p for p in m.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=LR, fused=True)
        lp = trainer.Loop(cfg, LocalRun(cfg, torch.device("cuda")), m, params, opt,
                          torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0), ListBatches(data), NullLogger(), None,
                          1.0, True)
        if graphed:
            trainer.use_cuda_graph(lp)
        out.append(lp)
    return out


@pytest.mark.parametrize("lora,ac", [(False, "none"), (True, "none"), (False, "full"), (True, "selective")],
                         ids=["full", "lora", "full-recompute", "lora-selective"])
def test_replayed_steps_match_the_eager_ones(seed, lora, ac):
    from moeadapt.train import graph, trainer

    runs = []
    for lp in _loops(seed, lora, ac):
        start = [p.detach().clone() for p in lp.params]
        stats = []
        for step in range(STEPS):
            lp.step = step
            stats.append(trainer.train_step(lp))
        stats.append(trainer.settle(lp))
        runs.append((lp, [s for s in stats if s is not None], start))
    (eager, se, start_e), (graphed, sg, start_g) = runs
    assert graphed.graph.graph is not None and graphed.graph.calls == STEPS > graph.WARMUP
    assert [s.step for s in se] == [s.step for s in sg] == list(range(STEPS))
    assert all(s.skipped is None for s in se + sg), [(s.step, s.skipped) for s in se + sg]
    losses = [s.loss for s in se]
    assert len(set(losses)) == STEPS, losses  # a different batch each step
    for a, b in zip(se, sg):
        assert abs(a.loss - b.loss) < 1e-3 * abs(a.loss), (a.step, a.loss, b.loss)
        assert abs(a.grad_norm - b.grad_norm) < 2e-2 * a.grad_norm + 1e-6, (a.step, a.grad_norm, b.grad_norm)
    d_e = torch.cat([(p.detach() - s).flatten().float() for p, s in zip(eager.params, start_e)])
    d_g = torch.cat([(p.detach() - s).flatten().float() for p, s in zip(graphed.params, start_g)])
    assert d_e.norm() > 0
    rel = float((d_e - d_g).norm() / d_e.norm())
    assert rel < 0.25, f"the weights' updates differ by {rel:.3f} (relative)"
    # the logged step's statistics are the replay's own, not the captured step's
    logged = [s for s in sg if s.aux]
    assert logged and all(s.step % 2 == 1 or s.step == 0 for s in logged)


def test_the_default_captures_a_one_gpu_run(tmp_path, monkeypatch):
    """train.cuda_graph: auto (the default) replays the step of a one-GPU run, with full recompute too, and says
    so in summary.json; the run trains (its eval loss falls) with an eval between the replays; the reference
    kernels stay eager, with the reason."""
    import json

    from moeadapt import api
    from moeadapt.config import build_run_config, get_preset

    def run(name, backend="auto", **parallel):
        cfg = build_run_config({"model": get_preset("tiny").model_dump(),
                                "train": {"steps": 8, "micro_batch_size": 2, "seq_len": 128, "device": "cuda",
                                          "eval_every": 4, "eval_batches": 2, "lr": 3e-3, "kernel_backend": backend,
                                          "output_dir": str(tmp_path / name)},
                                "data": {"train": "builtin:tinystories", "eval_fraction": 0.05},
                                "parallel": parallel})
        res = api.train(cfg, quiet=True)
        return res, json.loads((tmp_path / name / "summary.json").read_text())

    res, summary = run("auto")
    assert summary["cuda_graph"] is True and summary["cuda_graph_off"] is None, summary
    # the steady speed leaves out the eager warm-up and the capturing step (trainer.steady_skip)
    assert summary["steady_steps"] == 8 - 3, summary
    assert res.eval_after < res.eval_before, (res.eval_before, res.eval_after)
    res, summary = run("recompute", activation_checkpointing="full")
    assert summary["cuda_graph"] is True, summary
    assert res.eval_after < res.eval_before, (res.eval_before, res.eval_after)
    _, summary = run("reference", backend="reference")
    assert summary["cuda_graph"] is False and "reference" in summary["cuda_graph_off"], summary
    assert summary["steady_steps"] == 8 - 2, summary  # eager: the first two steps only

    # an eval that runs out of memory beside the graph's pool (the first after the capture, at step 4) releases
    # the graph, whose memory goes back to the device, and the run goes on eagerly
    from moeadapt.train import trainer

    evaluate, reserved = trainer.evaluate, []

    def tight_evaluate(*a, **k):
        reserved.append(torch.cuda.memory_reserved())
        if len(reserved) == 2:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return evaluate(*a, **k)

    monkeypatch.setattr(trainer, "evaluate", tight_evaluate)
    res, summary = run("released")
    assert summary["cuda_graph"] is False and "released after step 4" in summary["cuda_graph_off"], summary
    assert reserved[2] < reserved[1], reserved  # the graph's pool handed back
    assert res.eval_after < res.eval_before, (res.eval_before, res.eval_after)


_FAILING_CAPTURE = """
import os, sys, torch
from tests.gpu.test_cuda_graph_gpu import _loops
from moeadapt.train import graph, trainer
from moeadapt.train.errors import TrainingError

where, seed = sys.argv[1], int(sys.argv[2])

def read(t):
    float(t.float().sum())  # a host read: not capturable

def hook(mod, args, out):
    if torch.cuda.is_current_stream_capturing():
        if where == "forward":
            read(out[0])
        else:
            out[0].register_hook(read)

_, lp = _loops(seed, lora=False)
lp.model.layers[-1].register_forward_hook(hook)
try:
    for step in range(graph.WARMUP + 1):
        lp.step = step
        trainer.train_step(lp)
except TrainingError as e:
    print("ERROR:", e, flush=True)
else:
    print("NO ERROR", flush=True)
os._exit(0)  # no teardown of a process whose capture failed
"""


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_capture_that_fails_is_one_error_naming_the_op_and_the_fix(seed, where):
    """An op that reads a value on the host inside the captured step (from the last block's output in the forward,
    or from its gradient in the backward) makes the capture fail: under auto, the default, the run stops with the
    op's error and the fix. In a child process: a failed capture leaves the process's CUDA random-number state
    unusable (train/graph.py), which would break the tests after this one."""
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", _FAILING_CAPTURE, where, str(seed)], cwd=root, env=env,
                         capture_output=True, text=True, timeout=300)
    last = (out.stdout.strip().splitlines() or [""])[-1]
    assert last.startswith("ERROR: train.cuda_graph: capturing the step failed ("), (last, out.stderr[-2000:])
    assert "capturing" in last.split("(", 1)[1]  # the op's error (not permitted while capturing), not the end's
    assert last.endswith("set train.cuda_graph: false to run the steps eagerly"), last
