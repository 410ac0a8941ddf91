"""ShardedAdamW (parallel/optim.py) on FSDP2 over 2 gloo ranks: the same update as torch's AdamW on the same
DTensor parameters (every shard, every state), with a DCP optimizer state dict of the same keys and values."""

from __future__ import annotations

import copy

import pytest
import torch
from _harness import batch, build, micro_spec, spawn

pytestmark = pytest.mark.dist


def _same_update(rank, world):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    from moeadapt.config import ParallelSpec
    from moeadapt.parallel import build_parallel_dims, parallelize_model
    from moeadapt.parallel.optim import ShardedAdamW

    spec = micro_spec()
    dims = build_parallel_dims(ParallelSpec(dp_shard=2, ep=1), spec, "cpu")
    base = build(spec, lora=False)
    models = [parallelize_model(copy.deepcopy(base), dims) for _ in range(2)]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opts = [torch.optim.AdamW(models[0].parameters(), **kw), ShardedAdamW(models[1].parameters(), **kw)]
    x, y = batch(spec, 4, 16, seed=7 + rank)
    for _ in range(2):
        for m, o in zip(models, opts):
            out = m(x, y, return_logits=False)
            (out.loss + out.aux_loss).backward()
            o.step()
            o.zero_grad(set_to_none=True)
    moved = 0
    for (n, p), q, p0 in zip(models[0].named_parameters(), models[1].parameters(), base.parameters()):
        assert type(q) is type(p), f"{n}: the parameter is no longer a {type(p).__name__}"
        a, b = p.to_local(), q.to_local()
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7, msg=f"rank {rank} {n}: update differs")
        moved += int(not torch.equal(p.full_tensor(), p0))
    assert moved > 0.9 * len(list(base.parameters())), "the optimizer did not move the parameters"
    sds = [get_optimizer_state_dict(m, o) for m, o in zip(models, opts)]
    assert sds[0]["state"].keys() == sds[1]["state"].keys()
    for k, st in sds[0]["state"].items():
        for name, v in st.items():
            w = sds[1]["state"][k][name]
            assert type(w) is type(v), f"{k}.{name}: state type {type(w).__name__} vs {type(v).__name__}"
            lv, lw = (t.to_local() if hasattr(t, "to_local") else t for t in (v, w))
            torch.testing.assert_close(lw, lv, rtol=1e-6, atol=1e-7, msg=f"{k}.{name}: state differs")


def test_sharded_adamw_matches_adamw_on_dtensors():
    spawn(_same_update, 2)


def test_sharded_adamw_plain_tensors_match_adamw(seed):
    """One process: plain parameters pass through; the update equals torch's AdamW exactly."""
    from moeadapt.parallel.optim import ShardedAdamW

    ps = [torch.randn(5, 3, dtype=torch.float64), torch.randn(7, dtype=torch.float64)]
    a = [p.clone().requires_grad_() for p in ps]
    b = [p.clone().requires_grad_() for p in ps]
    oa, ob = torch.optim.AdamW(a, lr=0.1, weight_decay=0.1), ShardedAdamW(b, lr=0.1, weight_decay=0.1)
    for _ in range(3):
        g = [torch.randn_like(p) for p in ps]
        for ts, o in ((a, oa), (b, ob)):
            for t, gi in zip(ts, g):
                t.grad = gi.clone()
            o.step()
    for x, z, p in zip(a, b, ps):
        assert torch.equal(x, z) and not torch.equal(x, p)
