"""`train.cuda_graph` is refused, with the reason and the fix, where a replay could not repeat the step."""

from types import SimpleNamespace

import pytest
import torch

from moeadapt import api
from moeadapt.config import build_run_config
from moeadapt.train.graph import check_graphable
from moeadapt.train.trainer import TrainingError
from tests.conftest import micro_spec


def _cfg(tmp_path, **data):
    return build_run_config({"model": micro_spec().model_dump(),
                             "train": {"steps": 2, "micro_batch_size": 2, "seq_len": 32, "device": "cpu",
                                       "cuda_graph": True, "output_dir": str(tmp_path / "run")},
                             "data": {"train": "builtin:tinystories", "eval_fraction": 0.01, **data}})


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
