"""parallel/expert.py's fixed-capacity exchange on 2 gloo ranks: no host read of a device value inside the
dispatcher's forward, outputs and gradients equal a float64 reference over every rank's tokens (dropped
choices included), an exceeded capacity is recorded, grown by `check_capacity` and exact on the re-run, and
the trainer re-runs an overflowing step so that its gradients equal the single-process run's (with
activation-checkpoint recompute), and skips a step only when no rank's batch has a target token."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import batch, expert_names, full_grads, micro_spec, spawn

pytestmark = pytest.mark.dist

E, L, K, T = 4, 8, 2, 12
TOL = 1e-5
_SYNCS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


class _NoSync:
    """Tensor methods that read a device value on the host raise inside this block."""

    def __enter__(self):
        self.saved = {n: getattr(torch.Tensor, n) for n in _SYNCS}

        def raiser(name):
            def f(self, *a, **kw):
                raise AssertionError(f"host sync: Tensor.{name} called inside the EP dispatcher forward")
            return f

        for n in _SYNCS:
            setattr(torch.Tensor, n, raiser(n))

    def __exit__(self, *exc):
        for n, f in self.saved.items():
            setattr(torch.Tensor, n, f)


class _Experts(torch.nn.Module):
    """Stand-in for GroupedExperts with no host sync: row of expert e scaled by w[e]; rows past offsets[-1]
    get 0. `sync=True` reads offsets[-1] on the host (what the no-sync check must catch)."""

    def __init__(self, w, sync=False):
        super().__init__()
        self.w, self.sync = torch.nn.Parameter(w.clone()), sync

    def forward(self, x, offsets):
        if self.sync:
            int(offsets[-1])
        rows = torch.arange(x.shape[0], device=x.device)
        e = torch.searchsorted(offsets.long(), rows, right=True)  # len(offsets): past the last expert
        return x * torch.cat([self.w, self.w.new_zeros(1, self.w.shape[1])])[e]


def _inputs(seed, rank, skew=False):
    g = torch.Generator().manual_seed(seed + rank)
    z = torch.randn(T, L, generator=g, dtype=torch.float64)
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices
    if skew:  # every choice to experts 0 and 1: all rows go to rank 0
        ids = torch.tensor([0, 1]).expand(T, K).clone()
    ids[torch.rand(T, K, generator=g) < 0.15] = -1  # dropped by a capacity-limited router
    w = torch.rand(T, K, generator=g, dtype=torch.float64)
    gy = torch.randn(T, L, generator=g, dtype=torch.float64)
    return z, ids, w, gy


def _reference(seed, rank, world, W, skew):
    """float64: this rank's y and dz, and dW over every rank's tokens (the all-to-all sums them)."""
    dW = torch.zeros_like(W)
    for r in range(world):
        z, ids, w, gy = _inputs(seed, r, skew)
        keep = (ids >= 0).to(z.dtype)
        Wk = W[ids.clamp(min=0)]  # [T, K, L]
        if r == rank:
            y = (w[..., None] * keep[..., None] * Wk * z[:, None]).sum(1)
            dz = (w[..., None] * keep[..., None] * Wk * gy[:, None]).sum(1)
        dW.index_add_(0, ids.clamp(min=0).flatten(), (w * keep).flatten()[:, None] * (z * gy).repeat_interleave(K, 0))
    return y, dz, dW


def _run(disp, experts, seed, rank, skew, no_sync=True):
    z, ids, w, gy = _inputs(seed, rank, skew)
    z.requires_grad_()
    experts.w.grad = None
    with _NoSync() if no_sync else torch.enable_grad():
        y = disp(experts, z, ids, w, E, backend="reference")
    y.backward(gy)
    return y.detach(), z.grad


def _dispatcher(rank, world, seed):
    from moeadapt.parallel.expert import EPDispatcher, check_capacity

    group = dist.new_group(list(range(world)))
    W = torch.randn(E, L, generator=torch.Generator().manual_seed(seed + 99), dtype=torch.float64)
    El = E // world
    lo = rank * El
    for chunks in (1, 2):
        for skew in (False, True):
            timing: dict = {}
            disp, experts = EPDispatcher(group, chunks, timing=timing), _Experts(W[lo:lo + El])
            y, dz = _run(disp, experts, seed, rank, skew)
            y_ref, dz_ref, dW_ref = _reference(seed, rank, world, W, skew)
            what = f"chunks={chunks} skew={skew} rank {rank}"
            assert torch.allclose(y, y_ref, atol=1e-12), f"{what}: output"
            assert torch.allclose(dz, dz_ref, atol=1e-12), f"{what}: input gradient"
            # expert weight gradients carry 1/ep (FSDP averages over the other world/ep ranks)
            assert torch.allclose(experts.w.grad, dW_ref[lo:lo + El] / world, atol=1e-12), f"{what}: dW"
            assert timing["syncs"] == 0 and "bwd_wait_s" in timing, timing
            assert check_capacity(_Model(disp)) is None, f"{what}: the default capacity overflowed"

    # a forced tiny capacity: rows are lost, recorded, the capacity grows (the same on both ranks), exact again
    disp, experts = EPDispatcher(group, 2), _Experts(W[lo:lo + El])
    disp.cap = 2
    y, _ = _run(disp, experts, seed, rank, True)
    y_ref, dz_ref, dW_ref = _reference(seed, rank, world, W, True)
    assert (y - y_ref).abs().max() > 1e-3, "a capacity of 2 rows lost nothing: the test would be weak"
    notice = check_capacity(_Model(disp))
    assert notice is not None and "cap 2 ->" in notice, notice
    caps = [None] * world
    dist.all_gather_object(caps, disp.cap)
    assert caps[0] == caps[1] and disp.cap % 64 == 0 and disp.cap > 2, caps
    y, dz = _run(disp, experts, seed, rank, True)
    assert torch.allclose(y, y_ref, atol=1e-12) and torch.allclose(dz, dz_ref, atol=1e-12), "after growing"
    assert torch.allclose(experts.w.grad, dW_ref[lo:lo + El] / world, atol=1e-12), "dW after growing"
    assert check_capacity(_Model(disp)) is None

    # the no-sync check catches a host read (an expert that reads its offsets on the host)
    try:
        _run(EPDispatcher(group, 1), _Experts(W[lo:lo + El], sync=True), seed, rank, False)
    except AssertionError as e:
        assert "host sync" in str(e), e
    else:
        raise AssertionError("a host read inside the dispatcher's forward went unnoticed")


class _Model(torch.nn.Module):
    """A holder of one dispatcher, as a MoE layer holds its own (what check_capacity looks for)."""

    def __init__(self, disp):
        super().__init__()
        self.dispatcher = disp


def test_dispatcher_exact_without_host_sync_and_grows_capacity(seed):
    spawn(_dispatcher, 2, seed % 10_000)


def _trainer(rank, world, seed):
    from moeadapt.config import RunConfig
    from moeadapt.models.init import init_fill
    from moeadapt.parallel import DistributedRun
    from moeadapt.parallel.expert import ep_dispatchers, reset_capacity
    from moeadapt.train import trainer
    from moeadapt.train.build import build_meta, materialize_shards
    from moeadapt.train.local import LocalRun
    from moeadapt.train.metrics import NullLogger

    spec = micro_spec()
    rows, seq = 4, 16
    cfg = RunConfig.model_validate({
        "model": spec.model_dump(),
        "train": {"seed": seed, "device": "cpu", "kernel_backend": "reference", "micro_batch_size": rows // world,
                  "seq_len": seq, "grad_clip": None},
        "parallel": dict(dp_shard=world, ep=2, a2a_chunks=2, activation_checkpointing="full")})
    x, y = batch(spec, rows, seq, seed=seed)

    def build(run):
        model = build_meta(cfg, run.device)
        return materialize_shards(model, cfg, run, fill=init_fill(model, seed))

    ref = build(LocalRun(cfg, torch.device("cpu")))
    out = ref(x, y, return_logits=False)
    (out.loss + out.aux_loss).backward()
    ref_loss, ref_grads = float(out.loss), {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}

    run = DistributedRun(cfg, torch.device("cpu"))
    model = build(run)
    per = rows // world
    xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    experts, El = expert_names(model), spec.n_routed_experts // 2
    lo = run.dims.ep_rank * El

    def max_err(grads, rel=False):
        errs = []
        for n, g in grads.items():
            r = ref_grads[n][lo:lo + El] if n in experts else ref_grads[n]
            errs.append((g - r).abs().max().item() / (r.abs().max().item() + 1e-30 if rel else 1.0))
        return max(errs)

    # the planner sizes the exchange buffers with the runtime's capacity (plan/memory.py `ep_capacity`)
    from moeadapt.plan.memory import Plan, ep_capacity

    plan = Plan(gpus=2, dp_replicate=1, dp_shard=2, cp=1, ep=2, recompute="full", micro_batch=per, seq_len=seq,
                a2a_chunks=2, ep_capacity_factor=cfg.parallel.ep_capacity_factor)
    assert {d.cap for d in ep_dispatchers(model)} == {ep_capacity(spec, plan)}, "planner and runtime capacities"

    def tiny():
        for d in ep_dispatchers(model):
            d.cap = 4

    # without the re-run, 4 rows per rank pair lose choices: the gradients are wrong (the test is not vacuous)
    tiny()
    out = model(xs, ys, return_logits=False)
    (out.loss + out.aux_loss).backward()
    assert max_err(full_grads(model, run.dims), rel=True) > 0.05, "a capacity of 4 rows lost nothing: the test is weak"
    model.zero_grad(set_to_none=True)
    reset_capacity(model)
    tiny()

    masked = {}  # rank -> True: that rank's labels are all -100 (no target token)

    class _Batches:
        def next(self):
            return xs, (torch.full_like(ys, -100) if masked.get(rank) else ys), {}

    params = [p for p in model.parameters() if p.requires_grad]
    seen = {}

    class _Capture(torch.optim.SGD):
        def step(self, closure=None):  # the gradients the optimizer applies
            seen.update(full_grads(model, run.dims))
            return super().step(closure)

    opt = _Capture(params, lr=0.0)
    said = []
    lp = trainer.Loop(cfg, run, model, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                      _Batches(), NullLogger(), None, 1.0, True)
    lp.say = said.append
    st = trainer.train_step(lp)
    assert st.skipped is None, st.skipped
    assert len(said) == 1 and "overflowed" in said[0] and "re-running" in said[0], said
    assert all(d.cap > 4 for d in ep_dispatchers(model))
    assert abs(st.loss - ref_loss) < TOL, f"rank {rank}: loss {st.loss} vs {ref_loss}"
    assert set(seen) == set(ref_grads)
    err = max_err(seen)
    assert err < TOL, f"rank {rank}: a gradient differs from the single-process run by {err:.2e}"

    # the step's one read sums the target tokens over ranks: one rank without targets still steps, every rank
    # without targets skips (and the optimizer never runs)
    masked[1] = True
    seen.clear()
    assert trainer.train_step(lp).skipped is None and seen, f"rank {rank}: a step with rank 0's targets was skipped"
    masked[0] = True
    seen.clear()
    st = trainer.train_step(lp)
    assert st.skipped == "no_targets" and not seen, f"rank {rank}: a step without any target: {st.skipped}"


def test_trainer_reruns_an_overflowing_step_exactly(seed):
    spawn(_trainer, 2, seed % 10_000)


def test_capacity_rows_rule():
    from moeadapt.parallel.expert import capacity_rows

    # 4096 tokens, top-8, ep 8, 2 chunks: 2048 * 8 / 8 = 2048 balanced rows per pair, x 1.5 = 3072 (a multiple of 64)
    assert capacity_rows(4096, 8, 8, 2, 1.5) == 3072
    assert capacity_rows(1000, 6, 4, 3, 1.3) == 704  # ceil(1000/3) = 334 tokens: 334 * 6 / 4 * 1.3 = 651.3 -> 704
    assert capacity_rows(12, 2, 2, 2, 1.5) == 12  # never more than a chunk's choices (6 * 2): no routing exceeds it
    with pytest.raises(ValueError, match="parallel.ep_capacity_factor=0 must be > 0"):
        capacity_rows(12, 2, 2, 1, 0)
