"""Distributed checkpoints hold no pickle: a save writes metadata.json + safetensors RNG and loads back exactly;
a crafted pickled `.metadata` (what stock DCP reads with pickle.load) is refused without being run."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import pytest
import torch
from _harness import build, micro_spec, spawn

pytestmark = pytest.mark.dist


class _Payload:
    """Unpickling this creates the file named by `marker` (stands in for arbitrary code)."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def _setup():
    from moeadapt.config import ParallelSpec
    from moeadapt.parallel import build_parallel_dims, parallelize_model

    spec = micro_spec()
    model = build(spec, lora=False)
    dims = build_parallel_dims(ParallelSpec(dp_shard=2, ep=2), spec, "cpu")
    parallelize_model(model, dims)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return spec, model, dims, opt, sched


def _full(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    return {n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in model.named_parameters()}


def _save_then_load(rank, world, root: str):
    from moeadapt.parallel.checkpoint import load_distributed, save_distributed

    _, model, dims, opt, sched = _setup()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)  # differs from a fresh build
    want = _full(model)
    torch.manual_seed(1234 + rank)
    save_distributed(Path(root), 3, model, opt, sched, {"pos": 3}, dims)
    want_rng = torch.rand(4)
    _, fresh, dims, opt, sched = _setup()
    step, sampler = load_distributed(Path(root) / "step_0000003", fresh, opt, sched, dims)
    assert step == 3 and sampler == {"pos": 3}
    assert torch.equal(torch.rand(4), want_rng), "RNG state not restored from rng/rank_N.safetensors"
    for n, t in _full(fresh).items():
        assert torch.equal(t, want[n]), n


def _attacks(rank, world, root: str):
    """Save and load back, then the attacks on that checkpoint (rank 0 crafts the files between barriers)."""
    import torch.distributed as dist

    from moeadapt.parallel.checkpoint import load_distributed

    _save_then_load(rank, world, root)
    ck, marker = Path(root) / "step_0000003", Path(root) / "code_ran"
    if rank == 0:
        names = {p.relative_to(ck).as_posix() for p in ck.rglob("*") if p.is_file()}
        assert "metadata.json" in names and ".metadata" not in names, names
        assert {"rng/rank_0.safetensors", "rng/rank_1.safetensors"} <= names
        assert not any(n.endswith(".pt") for n in names), names
        md = json.loads((ck / "metadata.json").read_text())
        assert any(k.startswith("model.") for k in md["tensors"])
        # a stock-DCP checkpoint whose .metadata is a crafted pickle
        (ck / "metadata.json").unlink()
        (ck / ".metadata").write_bytes(pickle.dumps(_Payload(str(marker))))
    dist.barrier()
    _, model, dims, opt, sched = _setup()
    with pytest.raises(ValueError, match="as a pickle"):
        load_distributed(ck, model, opt, sched, dims)
    dist.barrier()
    if rank == 0:
        assert not marker.exists(), "the pickled .metadata was executed"
        # a metadata.json that points a tensor's storage outside the checkpoint
        (ck / ".metadata").unlink()
        md["storage"][0]["file"] = "../../etc/passwd"
        (ck / "metadata.json").write_text(json.dumps(md))
    dist.barrier()
    with pytest.raises(ValueError, match="outside the checkpoint"):
        load_distributed(ck, model, opt, sched, dims)


def test_dcp_checkpoint_has_no_pickle_and_refuses_a_pickled_metadata(tmp_path):
    spawn(_attacks, 2, str(tmp_path / "ckpt"))
    assert not (tmp_path / "ckpt" / "code_ran").exists()


def test_metadata_json_rejects_non_tensor_entries():
    from moeadapt.parallel.safe_dcp import UnsafeCheckpointError, metadata_from_json

    bad = {"format": "moeadapt-dcp-json-1", "version": "1.0.0", "mappings": {}, "storage": [],
           "tensors": {"x": {"dtype": "object", "size": [2], "chunks": [[[0], [2]]]}}}
    with pytest.raises(UnsafeCheckpointError, match="unsupported dtype"):
        metadata_from_json(bad, "m.json")
    bad["tensors"]["x"]["dtype"] = "float32"
    bad["tensors"]["x"]["size"] = ["2"]
    with pytest.raises(UnsafeCheckpointError, match="list of integers"):
        metadata_from_json(bad, "m.json")
    bad["tensors"]["x"]["size"] = [2]
    md = metadata_from_json(bad, "m.json")
    assert md.state_dict_metadata["x"].size == torch.Size([2])
