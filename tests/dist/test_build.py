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


def _same_as_world1(rank, world, seed, cases):
    from moeadapt.parallel import DistributedRun, gather_full_state
    from moeadapt.train.local import LocalRun

    spec = micro_spec()
    x, y = batch(spec, 8, 16, seed=seed)
    for lora, ep in cases:
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
    spawn(_same_as_world1, 4, seed % 10_000, [(False, 1), (False, 2), (True, 1), (True, 2)])


def _eval_all_ranks(rank, world):
    from moeadapt.data.dataset import PackedDataset
    from moeadapt.parallel import DistributedRun
    from moeadapt.train.local import LocalRun
    from moeadapt.train.trainer import evaluate

    spec = micro_spec()
    cfg = _cfg(spec, False, dict(dp_shard=world, ep=2), 5, micro_batch_size=2, eval_batches=3)
    x, y = batch(spec, 10, 16, seed=9)  # 5 batches: rank 0 takes 0, 2, 4; rank 1 takes 1, 3 and a blank
    y[3, 5:] = -100  # an uneven token count per batch: the mean is per token, not per batch
    ds = PackedDataset(x, y)
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


def _status(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {key} in /proc/self/status")


def _reset_peak() -> int:
    """Reset VmHWM to the current VmRSS (Linux clear_refs 5) and return that: the baseline of a measurement."""
    import gc

    gc.collect()
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status("VmRSS:")


# What a rank may hold beyond its share of the training state, stated (not fitted): FSDP's unsharded working
# set, i.e. two blocks gathered (the current one and the prefetched next, a block's experts being its E/ep
# local experts) + one block of unsharded gradients before the reduce-scatter (full fine-tuning only), and
# 24 MiB for the activations of a 2 x 16 batch and the allocator's slack.
FIXED_SLACK = 24 * 2**20


def _budget(state: dict, block_bytes: int, world: int, lora: bool) -> float:
    share = (state["weights"] + state["grads"] + state["optimizer"]) / world
    return share * 1.3 + (2 if lora else 3) * block_bytes + FIXED_SLACK


def _mem_spec(big: bool):
    """Almost all parameters in the routed experts (little compute per token). big: 74M parameters (283 MiB
    fp32) in 24 layers of 32 experts (a block is 1/24 of the model); small: 2.6M (10 MiB) in 4 layers."""
    if big:
        return micro_spec(n_layers=24, hidden_size=64, n_routed_experts=32, moe_intermediate_size=256,
                          latent_dim=128)
    return micro_spec(n_layers=4, hidden_size=64, n_routed_experts=16, moe_intermediate_size=256, latent_dim=64)


MEM_CASES = [(False, 1), (False, 2), (True, 1), (True, 2)]  # (lora, ep)
# the small model in CI: full fine-tuning at ep 2 and LoRA at ep 1 (each value of each axis once; all four cases
# are built sharded and trained against one process in CI by test_sharded_build_equals_world1_and_trains_the_same);
# the big model runs all four before a release
MEM_CASES_CI = [(False, 2), (True, 1)]


def _dump_grads(model, path) -> None:
    """Each local gradient as raw fp32 bytes (numpy tofile: no copy, nothing allocated) + where it lies in the
    global tensor, for the comparison with the single-process run."""
    import json

    from moeadapt.parallel.shards import global_layout, named_tensors

    index, off = [], 0
    with open(path, "wb") as f:
        for name, t, owner in named_tensors(model):
            if not isinstance(t, torch.nn.Parameter) or t.grad is None:
                continue
            g = t.grad.to_local() if hasattr(t.grad, "to_local") else t.grad
            _, slices = global_layout(t, owner)
            g.detach().contiguous().numpy().tofile(f)
            index.append({"name": name, "offset": off, "shape": list(g.shape),
                          "slices": [[s.start, s.stop] for s in slices]})
            off += g.numel() * g.element_size()
    path.with_suffix(".json").write_text(json.dumps(index))


def _memory(rank, world, big, out_dir, cases):
    import gc
    import json

    from moeadapt.parallel import DistributedRun
    from moeadapt.parallel.shards import shard_bytes

    torch.set_num_threads(1)
    runs = {}  # one set of meshes (process groups) per ep degree

    def train(spec, lora, ep, dump=None):
        # the config's tokens per forward are the batch's: they size the EP exchange (parallel/expert.py)
        cfg = _cfg(spec, lora, dict(dp_shard=world, ep=ep), 7, seq_len=16, micro_batch_size=2)
        x, y = batch(spec, 2 * world, 16, seed=1)
        run = runs.setdefault(ep, DistributedRun(cfg, torch.device("cpu")))
        model = _build(cfg, run)
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        losses = []
        for step in range(2):
            out = model(x[rank * 2:rank * 2 + 2], y[rank * 2:rank * 2 + 2], return_logits=False)
            (out.loss + out.aux_loss).backward()
            loss = out.loss.detach().clone()
            dist.all_reduce(loss)
            losses.append(float(loss) / world)
            if step == 0 and dump is not None:
                _dump_grads(model, dump)
            opt.step()
            opt.zero_grad(set_to_none=True)
        return model, opt, losses

    for ep in sorted({ep for _, ep in cases}):  # the same code on a tiny model first: lazy imports, pools, groups
        train(micro_spec(n_layers=3), True, ep)
    for lora, ep in cases:
        gc.collect()
        base = _reset_peak()
        model, opt, losses = train(_mem_spec(big), lora, ep, dump=out_dir / f"grads_{lora}_{ep}_rank{rank}.bin")
        grown = _status("VmHWM:") - base
        mine = shard_bytes(model)
        held = sum(v.to_local().numel() * v.element_size() if hasattr(v, "to_local") else v.numel() * v.element_size()
                   for st in opt.state.values() for v in st.values() if torch.is_tensor(v) and v.dim() > 0)
        (out_dir / f"mem_{lora}_{ep}_rank{rank}.json").write_text(json.dumps(
            {"grown": grown, "bytes": mine, "adam": held, "losses": losses}))
        del model, opt


def _reference(spec, lora: bool, world: int):
    """The single process on the whole batch: (losses of two AdamW steps, gradients of the first)."""
    from moeadapt.train.local import LocalRun

    cfg = _cfg(spec, lora, dict(dp_shard=world, ep=1), 7)
    x, y = batch(spec, 2 * world, 16, seed=1)
    model = _build(cfg, LocalRun(cfg, torch.device("cpu")))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    losses, grads = [], {}
    for step in range(2):
        out = model(x, y, return_logits=False)
        (out.loss + out.aux_loss).backward()
        losses.append(float(out.loss.detach()))
        if step == 0:
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads


def _check_memory(tmp_path, big: bool, cases) -> None:
    import json

    import numpy as np

    from moeadapt.config import LoRASpec
    from moeadapt.models.model import build_model
    from moeadapt.plan.memory import Plan, state_bytes

    world, spec = 4, _mem_spec(big)
    m = build_model(spec, "meta")
    for lora, ep in cases:
        what = f"lora={lora} ep={ep}"
        lspec = LoRASpec(rank=4, alpha=8.0) if lora else None
        full = state_bytes(spec, Plan(1, 1, 1, 1, 1, "none", 1, 16), lspec, base_bytes=4)  # one process
        block = max(sum(p.numel() for p in b.parameters()) for b in m.layers) * 4 // ep  # experts dominate
        budget = _budget(full, block, world, lora)
        whole = full["weights"] + full["grads"] + full["optimizer"]
        if big:  # a rank holding the whole training state would break the budget by far
            assert whole >= 2 * budget, f"{what}: the model is too small for the test to tell sharded from whole"
        ref_losses, ref_grads = _reference(spec, lora, world)
        seen = set()
        for r in range(world):
            rec = json.loads((tmp_path / f"mem_{lora}_{ep}_rank{r}.json").read_text())
            assert rec["grown"] <= budget, (f"{what}: rank {r} grew {rec['grown'] / 2**20:.0f} MiB, allowed "
                                            f"{budget / 2**20:.0f} MiB (whole training state {whole / 2**20:.0f} MiB)")
            # AdamW allocates state only for parameters that got a gradient (here all but a few thousand elements)
            assert 0.999 * rec["bytes"]["optimizer"] <= rec["adam"] <= rec["bytes"]["optimizer"], (what, rec)
            plan = state_bytes(spec, Plan(world, 1, world, 1, ep, "none", 1, 16), lspec, base_bytes=4)
            if r == 0:  # the planner counts the rank holding the most
                for k in ("weights", "grads", "optimizer"):
                    assert rec["bytes"][k] == plan[k], (what, k, rec["bytes"][k], plan[k])
            for got, want in zip(rec["losses"], ref_losses):
                assert abs(got - want) < TOL, f"{what}: losses {rec['losses']} vs one process {ref_losses}"
            raw = np.fromfile(tmp_path / f"grads_{lora}_{ep}_rank{r}.bin", dtype=np.float32)
            for e in json.loads((tmp_path / f"grads_{lora}_{ep}_rank{r}.json").read_text()):
                n = e["name"]
                g = torch.from_numpy(raw[e["offset"] // 4:e["offset"] // 4 + int(np.prod(e["shape"]))]).view(e["shape"])
                want = ref_grads[n][tuple(slice(a, b) for a, b in e["slices"])]
                # relative to the whole tensor's largest entry (never looser than TOL absolute below 1): the big
                # model (24 layers, not 4; the gradient reaches layer 0 through all of them in fp32) has its LoRA
                # o_proj B gradient 1.4e-5 of its largest entry off (the same on every run), so it gets 5e-5. A
                # sharding bug (a lost or doubled shard) moves a gradient by O(1) of its size.
                bound = (5e-5 if big else TOL) * max(1.0, ref_grads[n].abs().max().item())
                err = (g - want).abs().max().item() if g.numel() else 0.0
                assert err < bound, f"{what}: rank {r}'s gradient of {n} differs by {err:.2e} (bound {bound:.2e})"
                seen.add(n)
        assert seen == set(ref_grads), f"{what}: no rank had a gradient for {sorted(set(ref_grads) - seen)[:4]}"


def _run_memory(tmp_path, monkeypatch, big: bool, cases) -> None:
    # glibc returns freed blocks of >= 64 KiB at once (no dynamic mmap threshold), so VmHWM follows live memory
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    spawn(_memory, 4, big, tmp_path, cases)
    _check_memory(tmp_path, big, cases)


def test_no_rank_holds_more_than_its_share(tmp_path, monkeypatch):
    """4 ranks, full fine-tuning at ep 2 and LoRA at ep 1, on a small model: each rank's peak host memory growth
    stays within its share x 1.3 + FSDP's working set + 24 MiB, its state bytes are the planner's, and losses
    and gradients equal the single-process run (fp32, 1e-5)."""
    _run_memory(tmp_path, monkeypatch, False, MEM_CASES_CI)


@pytest.mark.slow
def test_no_rank_holds_more_than_its_share_big_model(tmp_path, monkeypatch):
    """The same on a model whose whole training state is over twice what any rank may hold, for full fine-tuning
    and LoRA each at ep 1 and 2."""
    _run_memory(tmp_path, monkeypatch, True, MEM_CASES)
