"""The trainer's model/ export is sharded safetensors above `train.export_shard_gb`, and every reader loads it:
`api.load_model_dir` (eval gives the run's own eval loss) and a new run's `init_from`."""

import json

import pytest

from moeadapt import api
from moeadapt.config import build_run_config
from tests.conftest import micro_spec


def _cfg(out, **train):
    t = dict(steps=2, lr=3e-3, warmup_steps=1, micro_batch_size=4, seq_len=32, eval_batches=1, output_dir=str(out),
             seed=3, export_shard_gb=4e-5)  # 40 kB files: the micro model needs several
    t.update(train)
    return build_run_config({"model": micro_spec().model_dump(), "train": t,
                             "data": {"train": "builtin:tinystories", "eval_fraction": 0.01}})


@pytest.mark.slow
def test_full_training_export_is_sharded_and_loads(tmp_path):
    r = api.train(_cfg(tmp_path / "run"), quiet=True)
    model = r.output_dir / "model"
    index = json.loads((model / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in model.glob("model-*-of-*.safetensors"))
    assert len(files) > 2 and set(index["weight_map"].values()) == set(files)
    ev = api.evaluate(model, "builtin:tinystories", seq_len=32, batch_size=4, max_batches=1)  # load_model_dir
    assert ev["loss"] < r.eval_before
    again = api.train(_cfg(tmp_path / "again", steps=1, init_from=str(model), lr=1e-9), quiet=True)
    assert again.eval_before == pytest.approx(r.eval_after, rel=1e-5)
