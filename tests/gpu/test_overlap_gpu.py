"""GPU: the optimizer step applied inside the next replay, beside its forward (train/overlap.py).

Full fine-tuning of the tiny model (KDA, gated DSA, LatentMoE) with bf16 weight copies and train.cuda_graph: each
replayed step must apply exactly the AdamW step of the gradients before it (float64 reference, `ops/optim`), with
the clip and the lr schedule of that step and its bf16 copies rewritten; not the step of the gradients the same
replay writes. `settle` applies the last queued step, and the replay after it applies nothing twice. Over the
steps, training with and without the overlap agree (the DSA backward adds with atomics, so two runs agree to
rounding, not bit for bit)."""

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

ROWS, SEQ, STEPS, LR = 2, 256, 6, 1e-3


def _loop(seed, base, data, overlap: bool, clip: float | None):
    from moeadapt.config import RunConfig, get_preset
    from moeadapt.train import trainer
    from moeadapt.train.local import LocalRun
    from moeadapt.train.metrics import NullLogger

    spec = get_preset("tiny")
    cfg = RunConfig.model_validate({"model": spec.model_dump(), "train": {
        "seed": seed % 1000, "device": "cuda", "micro_batch_size": ROWS, "seq_len": SEQ, "steps": STEPS,
        "log_every": 2, "lr": LR, "warmup_steps": 0, "grad_clip": clip, "cuda_graph": True,
        "overlap_optimizer": overlap}})
    m = copy.deepcopy(base).train()
    params = [p for p in m.parameters() if p.requires_grad]
    run = LocalRun(cfg, torch.device("cuda"))
    opt, copies = trainer.make_optimizer(cfg, run, m, params)
    # an lr that changes every step: the captured update must read each step's own
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    lp = trainer.Loop(cfg, run, m, params, opt, sched, ListBatches(data), NullLogger(), None, 1.0, True,
                      copies=copies)
    trainer.use_cuda_graph(lp)
    return lp


def _snapshot(lp):
    """What the queued step will update: weight, gradient, moments and step count of each trained tensor."""
    out = {}
    for p in lp.params:
        if p.grad is None:
            continue
        st = lp.opt.state[p]
        out[p] = (p.detach().clone(), p.grad.clone(), st["exp_avg"].clone(), st["exp_avg_sq"].clone(),
                  float(st["step"]))
    return out


def _expected(lp, snap, lr, scale, grads=None):
    """Each tensor after one AdamW step from `snap` in float64 (`grads`: other gradients in place of the
    snapshot's)."""
    from moeadapt.ops.optim import adamw_reference

    g = lp.opt.param_groups[0]
    out = {}
    for p, (w, gr, m, v, n) in snap.items():
        gr = grads[p] if grads is not None else gr
        out[p] = adamw_reference(w.double(), gr.double(), m.double(), v.double(), int(n) + 1, lr, g["betas"],
                                 g["eps"], g["weight_decay"], scale)[0]
    return out


def _close(lp, want, lr) -> list[str]:
    """Tensors whose weight is not the expected one to fp32 rounding (a wrong step moves weights by ~lr)."""
    bad = []
    for p, w in want.items():
        err = float((p.detach().double() - w).abs().max())
        if err > 1e-3 * lr + 4e-7 * float(w.abs().max()):
            bad.append(f"{list(p.shape)}: {err:.3g}")
    return bad


@pytest.mark.parametrize("clip", [0.05, None], ids=["clipped", "no_clip"])
def test_each_replay_applies_the_previous_steps_adamw(seed, clip):
    from moeadapt.config import get_preset
    from moeadapt.models.model import build_model, materialize
    from moeadapt.train import trainer

    spec = get_preset("tiny")
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(3, spec.vocab_size, (ROWS, SEQ + 1), generator=g) for _ in range(STEPS + 1)]
    base = materialize(build_model(spec, "meta"), "cuda", seed=seed % 1000)
    base.set_backend("auto")
    lp = _loop(seed, base, data, True, clip)
    assert lp.update is not None
    checked = 0
    for step in range(STEPS):
        lp.step = step
        queued = lp.update.queued_lr
        if queued is not None:  # the step before this one waits for this replay
            snap = _snapshot(lp)
            lr, scale = queued[0], (float(lp.update.scale) if clip else None)
            skip = float(lp.update.skip)
        trainer.train_step(lp)
        if queued is None:
            continue
        assert lp.update.live and skip == 0.0
        if clip:
            assert scale > 1.0, "the clip must act for this test to check it"
        want = _expected(lp, snap, lr, scale)
        bad = _close(lp, want, lr)
        assert not bad, f"step {step}: the replay's update is not AdamW of the previous gradients: {bad[:5]}"
        # the check can fail: the step of the gradients this replay wrote is another one
        wrong = _expected(lp, snap, lr, scale, grads={p: p.grad for p in lp.params})
        assert _close(lp, wrong, lr), "the gradients of two steps gave the same update"
        for w, c in zip(lp.copies.weights, lp.copies.copies):
            assert torch.equal(c, w.detach().to(torch.bfloat16))
        checked += 1
    assert checked >= STEPS - 3 and lp.graph.calls == STEPS

    # settle applies the queued step now; the next replay applies nothing twice
    snap, lr = _snapshot(lp), lp.update.queued_lr[0]
    scale = float(lp.update.scale) if clip else None
    trainer.settle(lp)
    assert not _close(lp, _expected(lp, snap, lr, scale), lr) and lp.update.queued_lr is None
    after = [p.detach().clone() for p in lp.params]
    lp.step = STEPS
    trainer.train_step(lp)
    assert all(torch.equal(p, a) for p, a in zip(lp.params, after)), "the replay after settle changed the weights"
    assert lp.update.queued_lr is not None


def test_training_with_and_without_the_overlap_agrees(seed):
    from moeadapt.config import get_preset
    from moeadapt.models.model import build_model, materialize
    from moeadapt.train import trainer

    spec = get_preset("tiny")
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(3, spec.vocab_size, (ROWS, SEQ + 1), generator=g) for _ in range(STEPS)]
    base = materialize(build_model(spec, "meta"), "cuda", seed=seed % 1000)
    base.set_backend("auto")
    runs = []
    for overlap in (False, True):
        lp = _loop(seed, base, data, overlap, 1.0)
        assert (lp.update is not None) == overlap
        start = [p.detach().clone() for p in lp.params]
        stats = []
        for step in range(STEPS):
            lp.step = step
            stats.append(trainer.train_step(lp))
        stats.append(trainer.settle(lp))
        stats = [s for s in stats if s is not None]
        assert [s.step for s in stats] == list(range(STEPS)) and all(s.skipped is None for s in stats)
        runs.append((stats, torch.cat([(p.detach() - s).flatten() for p, s in zip(lp.params, start)])))
    (s_ref, d_ref), (s_ov, d_ov) = runs
    for a, b in zip(s_ov, s_ref):
        assert abs(a.loss - b.loss) < 1e-3 * abs(b.loss), (a.step, a.loss, b.loss)
    assert d_ref.norm() > 0
    rel = float((d_ov - d_ref).norm() / d_ref.norm())
    assert rel < 0.25, f"the weights' updates differ by {rel:.3f} (relative)"
