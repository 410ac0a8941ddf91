"""`train.cuda_graph` is refused, with the reason and the fix, where a replay could not repeat the step; `auto`
(the default) captures where `true` would be accepted, except the reference kernels; eager elsewhere."""

import json
from types import SimpleNamespace

import pytest
import torch

from moeadapt import api
from moeadapt.config import build_run_config
from moeadapt.train.graph import check_graphable, resolve_cuda_graph
from moeadapt.train.trainer import TrainingError
from tests.conftest import micro_spec


def _cfg(tmp_path, graph=True, parallel=None, train=None, lora=None, model=None, **data):
    return build_run_config({"model": {**micro_spec().model_dump(), **(model or {})}, **({"lora": lora} if lora else {}),
                             "train": {"steps": 2, "micro_batch_size": 2, "seq_len": 32, "device": "cpu",
                                       "cuda_graph": graph, "output_dir": str(tmp_path / "run"), **(train or {})},
                             "data": {"train": "builtin:tinystories", "eval_fraction": 0.01, **data},
                             "parallel": parallel or {}})


def test_cuda_graph_on_cpu_is_one_clear_error(tmp_path):
    with pytest.raises(TrainingError, match="train.cuda_graph: it needs a CUDA device"):
        api.train(_cfg(tmp_path), quiet=True)
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.parametrize("what", ["packed", "torchrun", "ok"])
def test_cuda_graph_refuses_what_a_replay_cannot_repeat(tmp_path, what):
    cfg = _cfg(tmp_path, pack_documents=what == "packed")
    run = SimpleNamespace(world=2 if what == "torchrun" else 1, device=torch.device("cuda"))
    why = check_graphable(cfg, run)
    if what == "ok":
        assert why is None
    else:
        assert why and ("pack_documents: false" in why if what == "packed" else "without torchrun" in why), why


def test_auto_is_the_default_and_a_cpu_run_stays_eager(tmp_path):
    cfg = build_run_config({"model": micro_spec().model_dump(), "data": {"train": "builtin:tinystories"}})
    assert cfg.train.cuda_graph == "auto"
    cfg = _cfg(tmp_path, graph="auto")
    api.train(cfg, quiet=True)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["cuda_graph"] is False and "CUDA device" in summary["cuda_graph_off"], summary


GPU = SimpleNamespace(world=1, device=torch.device("cuda"))


@pytest.mark.parametrize("what", ["plain", "packed", "torchrun", "recompute", "selective", "offload", "reference",
                                  "off", "dropout", "dropout_recompute", "capacity"])
def test_auto_captures_what_a_replay_repeats(tmp_path, what):
    kw = {"packed": dict(pack_documents=True),
          "dropout": dict(lora={"rank": 4, "dropout": 0.1}),
          "capacity": dict(model={"capacity_factor": 1.25}),
          "dropout_recompute": dict(lora={"rank": 4, "dropout": 0.1}, parallel={"activation_checkpointing": "full"}),
          "recompute": dict(parallel={"activation_checkpointing": "full"}),
          "selective": dict(parallel={"activation_checkpointing": "selective"}),
          "offload": dict(parallel={"activation_checkpointing": "full", "offload_activations": True}),
          "reference": dict(train={"kernel_backend": "reference"})}.get(what, {})
    cfg = _cfg(tmp_path, graph=False if what == "off" else "auto", **kw)
    run = SimpleNamespace(world=2, device=GPU.device) if what == "torchrun" else GPU
    on, why = resolve_cuda_graph(cfg, run)
    assert on is (what in ("plain", "recompute", "selective", "dropout")), (what, why)
    want = {"plain": None, "packed": "pack_documents: false", "torchrun": "without torchrun",
            "recompute": None, "selective": None, "dropout": None, "dropout_recompute": "lora.dropout: 0",
            "capacity": "capacity_factor: null",
            "offload": "offload_activations: false", "reference": "kernel_backend", "off": "false"}[what]
    assert (why is None) if want is None else (want in why), (what, why)


def test_true_refuses_offloaded_activations_with_the_fix(tmp_path):
    cfg = _cfg(tmp_path, parallel={"activation_checkpointing": "full", "offload_activations": True})
    with pytest.raises(TrainingError, match="offload_activations: false"):
        resolve_cuda_graph(cfg, GPU)


class _Graph:
    """A StepGraph stand-in: captured (`graph` set) until released."""

    def __init__(self, captured=True):
        self.graph = object() if captured else None
        self.released = 0

    def release(self):
        self.released += 1
        self.graph = None


@pytest.mark.parametrize("captured", [True, False])
def test_an_eval_that_does_not_fit_beside_the_graph_releases_it(monkeypatch, captured):
    """An eval that runs out of device memory beside a captured graph's pool releases the graph, runs again and
    says so; without a captured graph the out-of-memory error is the user's to see."""
    from moeadapt.train import trainer

    calls = []

    def evaluate(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory")
        return 1.25

    monkeypatch.setattr(trainer, "evaluate", evaluate)
    said = []
    graph = _Graph(captured)
    lp = SimpleNamespace(graph=graph, graph_released=None, model=None, eval_ds=None, cfg=None,
                         run=SimpleNamespace(device=torch.device("cpu")), say=said.append)
    if not captured:
        with pytest.raises(torch.cuda.OutOfMemoryError):
            trainer._evaluate(lp, 7)
        assert graph.released == 0 and lp.graph is graph
        return
    assert trainer._evaluate(lp, 7) == 1.25 and len(calls) == 2
    assert graph.released == 1 and lp.graph is None
    assert "released after step 7" in lp.graph_released and said and lp.graph_released in said[0]


def test_summary_says_why_the_steps_were_not_replayed():
    from moeadapt.train.trainer import _why_not_replayed

    lp = SimpleNamespace(graph=None, graph_released=None)
    assert _why_not_replayed(lp, "it needs a CUDA device") == "it needs a CUDA device"
    lp.graph = _Graph(captured=False)  # a run shorter than the eager warm-up steps
    assert "warm-up steps, before the capture" in _why_not_replayed(lp, None)
    lp.graph = _Graph(captured=True)
    assert _why_not_replayed(lp, None) is None
    lp.graph, lp.graph_released = None, "released after step 4: ..."
    assert _why_not_replayed(lp, None).startswith("released after step 4")


class _FailingCapture:
    """torch.cuda.graph's stand-in on the CPU: the body runs, then ending the capture raises as CUDA does after an
    op that cannot be captured (the op's own error first, the end's error chained to it)."""

    def __init__(self, *a, **k):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        raise RuntimeError("CUDA error: operation failed due to a previous error during capture")


def test_a_failed_capture_is_one_error_naming_the_op_and_the_fix(monkeypatch):
    """StepGraph on the CPU with torch.cuda.graph's failure as CUDA raises it (the GPU test makes a real capture
    fail): the op's own error, not the capture's end, and the fix; the run does not go on eagerly (train/graph.py
    says why)."""
    from moeadapt.train import graph as graph_mod

    for name, fn in {"synchronize": lambda *a: None, "empty_cache": lambda: None, "CUDAGraph": object,
                     "graph": _FailingCapture}.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    w = torch.nn.Parameter(torch.ones(3))
    calls = []

    def fwd_bwd(batches):
        calls.append(batches)
        if len(calls) == graph_mod.WARMUP + 1:
            raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors ...")
        return "stats", True

    g = graph_mod.StepGraph([w], fwd_bwd, torch.device("cpu"))
    batch = [(torch.zeros(1, 4, dtype=torch.long), torch.zeros(1, 4, dtype=torch.long), {})]
    for _ in range(graph_mod.WARMUP):
        assert g(batch) == ("stats", True)
    with pytest.raises(TrainingError) as err:
        g(batch)
    assert str(err.value) == ("train.cuda_graph: capturing the step failed (RuntimeError: CUDA error: operation not "
                              "permitted when stream is capturing); set train.cuda_graph: false to run the steps "
                              "eagerly")
    assert len(calls) == graph_mod.WARMUP + 1 and g.graph is None
