"""The scale-true build (train/build.py: meta -> LoRA -> parallelize on meta -> to_empty -> fill each shard)
on 4 gloo ranks: the gathered weights equal the single-process build bit for bit, loss and gradients equal
the single-process run (fp32, 1e-5), and no rank's host memory grows past its share of the training state."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import batch, expert_names, full_grads, micro_spec, spawn

pytestmark = pytest.mark.dist

TOL = 1e-5


def _cfg(spec, lora: bool, par: dict, seed: int, **train):
    from moeadapt.config import RunConfig

    return RunConfig.model_validate({"model": spec.model_dump(), "lora": {"rank": 4, "alpha": 8.0} if lora else None,
                                     "train": {"seed": seed, "device": "cpu", "kernel_backend": "reference", **train},
                                     "parallel": par})


def _fill(model, seed: int):
    """The seeded init, with non-zero LoRA B (so every adapter gets a gradient): a fill a test can write."""
    from moeadapt.models.init import Rule, init_fill, init_slice

    base = init_fill(model, seed)

    def fill(name, shape, slices):
        if name.endswith(("lora_B", "lora_B.weight")):
            return init_slice(Rule("normal", 0.05), seed, name, shape, slices)
        return base(name, shape, slices)

    return fill


def _build(cfg, run):
    from moeadapt.train.build import build_meta, materialize_shards

    model = build_meta(cfg, run.device)
    return materialize_shards(model, cfg, run, fill=_fill(model, cfg.train.seed))


def _same_as_world1(rank, world, seed):
    from moeadapt.parallel import DistributedRun, gather_full_state
    from moeadapt.train.local import LocalRun

    spec = micro_spec()
    x, y = batch(spec, 8, 16, seed=seed)
    for lora in (False, True):
        for ep in (1, 2):
            cfg = _cfg(spec, lora, dict(dp_shard=world, ep=ep), seed)
            what = f"lora={lora} ep={ep} rank {rank}"
            run = DistributedRun(cfg, torch.device("cpu"))
            model = _build(cfg, run)
            ref = _build(cfg, LocalRun(cfg, torch.device("cpu")))  # world 1: the same path, unsharded
            state = gather_full_state(model, run.dims)
            if rank == 0:
                ref_state = ref.state_dict()
                assert state.keys() == ref_state.keys(), what
                for n, t in state.items():
                    assert t.dtype == ref_state[n].dtype and torch.equal(t, ref_state[n]), f"{what}: {n} differs"
            # one step of training on each rank's quarter of the batch vs the whole batch in one process
            out = ref(x, y, return_logits=False)
            (out.loss + out.aux_loss).backward()
            ref_loss, ref_grads = float(out.loss), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
            per = x.shape[0] // world
            out = model(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per], return_logits=False)
            (out.loss + out.aux_loss).backward()
            loss = out.loss.detach().clone()
            dist.all_reduce(loss)
            assert abs(float(loss) / world - ref_loss) < TOL, f"{what}: loss {float(loss) / world} vs {ref_loss}"
            grads, experts = full_grads(model, run.dims), expert_names(model)
            assert set(grads) == set(ref_grads), f"{what}: {sorted(set(grads) ^ set(ref_grads))[:4]}"
            El = spec.n_routed_experts // ep
            lo = run.dims.ep_rank * El
            for n, g in grads.items():
                r = ref_grads[n][lo:lo + El] if (n in experts and ep > 1) else ref_grads[n]
                assert r.abs().max() > 0 or not lora, f"{what}: {n} has a zero gradient; the test would be weak"
                err = (g - r).abs().max().item()
                assert err < TOL, f"{what}: grad {n} differs by {err:.2e}"


def test_sharded_build_equals_world1_and_trains_the_same(seed):
    spawn(_same_as_world1, 4, seed % 10_000)


class _Rows:
    def __init__(self, x, y):
        self.inputs, self.labels = x, y

    def __len__(self):
        return len(self.inputs)


def _eval_all_ranks(rank, world):
    from moeadapt.parallel import DistributedRun
    from moeadapt.train.local import LocalRun
    from moeadapt.train.trainer import evaluate

    spec = micro_spec()
    cfg = _cfg(spec, False, dict(dp_shard=world, ep=2), 5, micro_batch_size=2, eval_batches=3)
    x, y = batch(spec, 10, 16, seed=9)  # 5 batches: rank 0 takes 0, 2, 4; rank 1 takes 1, 3 and a blank
    y[3, 5:] = -100  # an uneven token count per batch: the mean is per token, not per batch
    ds = _Rows(x, y)
    run = DistributedRun(cfg, torch.device("cpu"))
    got = evaluate(_build(cfg, run), ds, cfg, torch.device("cpu"), run=run)
    ref = evaluate(_build(cfg, LocalRun(cfg, torch.device("cpu"))), ds, cfg, torch.device("cpu"), n_batches=5)
    assert abs(got - ref) < TOL, (got, ref)
    one = evaluate(_build(cfg, LocalRun(cfg, torch.device("cpu"))), ds, cfg, torch.device("cpu"), n_batches=3)
    assert abs(got - one) > 1e-4, "rank 0's batches alone give the same loss: the test would not see the sum"


def test_eval_loss_covers_every_ranks_batches():
    spawn(_eval_all_ranks, 2)


def test_fill_of_the_wrong_shape_fails_clearly():
    from moeadapt.train.local import LocalRun

    cfg = _cfg(micro_spec(), False, {}, 0)

    def bad(name, shape, slices):
        return torch.zeros(3)

    from moeadapt.train.build import build_meta, materialize_shards

    with pytest.raises(ValueError, match=r"fill gave embed.weight the shape \(3,\) for slices .* shard is \(264, 32\)"):
        materialize_shards(build_meta(cfg, torch.device("cpu")), cfg, LocalRun(cfg, torch.device("cpu")), fill=bad)


def _hwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


# What a rank may hold beyond its share of the training state: FSDP's unsharded working set (two blocks
# gathered + one block of unsharded gradients before the reduce-scatter), activations of a tiny batch and
# the allocator's slack. Stated, not fitted: 3 unsharded blocks + 64 MiB.
def _budget(model_bytes: dict, block_bytes: int, world: int) -> float:
    return (model_bytes["weights"] + model_bytes["grads"] + model_bytes["optimizer"]) / world * 1.3 \
        + 3 * block_bytes + 64 * 2**20


def _mem_spec(**kw):
    """~69M parameters (277 MB fp32), almost all in 11 layers of 64 routed experts: little compute per token."""
    return micro_spec(**{**dict(n_layers=12, hidden_size=64, n_routed_experts=64, moe_intermediate_size=256,
                                latent_dim=128), **kw})


def _memory(rank, world, lora, ep, out_dir):
    import json

    from moeadapt.parallel import DistributedRun
    from moeadapt.parallel.shards import shard_bytes

    torch.set_num_threads(1)

    def train(spec):
        cfg = _cfg(spec, lora, dict(dp_shard=world, ep=ep), 7)
        x, y = batch(spec, 2 * world, 16, seed=1)
        model = _build(cfg, DistributedRun(cfg, torch.device("cpu")))
        built = _hwm()
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        for _ in range(2):
            out = model(x[rank * 2:rank * 2 + 2], y[rank * 2:rank * 2 + 2], return_logits=False)
            (out.loss + out.aux_loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model, opt, built

    train(_mem_spec(n_routed_experts=4, moe_intermediate_size=16))  # the same code on a tiny model: lazy
    base = _hwm()  # imports and allocator pools are in the baseline, not in the growth
    model, opt, built = train(_mem_spec())
    grown, built = _hwm() - base, built - base
    mine = shard_bytes(model)
    held = sum(v.to_local().numel() * v.element_size() if hasattr(v, "to_local") else v.numel() * v.element_size()
               for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
    (out_dir / f"rank{rank}.json").write_text(json.dumps({"grown": grown, "built": built, "bytes": mine,
                                                          "adam": held}))


@pytest.mark.parametrize("lora,ep", [(False, 1), (True, 2)])
def test_no_rank_holds_more_than_its_share(tmp_path, monkeypatch, lora, ep):
    import json

    from moeadapt.config import LoRASpec
    from moeadapt.models.model import build_model
    from moeadapt.plan.memory import Plan, state_bytes

    world = 4
    # glibc returns freed blocks of >= 64 KiB at once (no dynamic mmap threshold), so VmHWM follows live memory
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    spawn(_memory, world, lora, ep, tmp_path)
    spec = _mem_spec()

    lspec = LoRASpec(rank=4, alpha=8.0) if lora else None
    full = state_bytes(spec, Plan(1, 1, 1, 1, 1, "none", 1, 16), lspec, base_bytes=4)  # one process, whole model
    m = build_model(spec, "meta")
    block = max(sum(p.numel() for p in b.parameters()) for b in m.layers) * 4 // ep
    budget = _budget(full, block, world)
    if lora:  # the training state is the frozen base: a rank holding the whole model would break the budget
        assert full["weights"] > budget, "the model is too small for this test to tell sharded from whole"
    for r in range(world):
        rec = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert rec["grown"] <= budget, (f"rank {r} grew {rec['grown'] / 2**20:.0f} MiB ({rec['built'] / 2**20:.0f} "
                                        f"MiB once built), allowed {budget / 2**20:.0f} MiB (whole model "
                                        f"{full['weights'] / 2**20:.0f} MiB)")
        # AdamW allocates state only for parameters that got a gradient (here all but a few thousand elements)
        assert 0.999 * rec["bytes"]["optimizer"] <= rec["adam"] <= rec["bytes"]["optimizer"], (rec["adam"], rec["bytes"])
        plan = state_bytes(spec, Plan(world, 1, world, 1, ep, "none", 1, 16), lspec, base_bytes=4)
        if r == 0:  # the planner counts the rank holding the most
            for k in ("weights", "grads", "optimizer"):
                assert rec["bytes"][k] == plan[k], (k, rec["bytes"][k], plan[k])
