"""GPU: full fine-tuning with bf16 weight copies (train/copies.py, parallel/optim.CopyAdamW) trains as autocast's
casts with torch's fused AdamW do. The tiny model, the trainer's steps from the same weights on the same batches,
eager and replayed (train.cuda_graph): the first step's loss and gradient norm are the same computation (equal
to rounding: the DSA backward adds with atomics), and the weights' updates over the steps agree as a whole. LoRA
with the adapters' bf16 copies trains bit for bit as with their per-use casts."""

import copy
import os

import pytest
import torch

from tests.conftest import ListBatches, trainer_loop

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0"),
]

ROWS, SEQ, STEPS, LR = 2, 256, 5, 1e-4


def _steps(lp, steps: int, graphed: bool) -> list:
    """Run `steps` training steps of the loop (captured into a CUDA graph when `graphed`) and the last one's
    settle; the per-step stats, each step taken (none skipped)."""
    from moeadapt.train import trainer

    if graphed:
        trainer.use_cuda_graph(lp)
    stats = []
    for step in range(steps):
        lp.step = step
        stats.append(trainer.train_step(lp))
    stats.append(trainer.settle(lp))
    stats = [s for s in stats if s is not None]
    assert [s.step for s in stats] == list(range(steps)) and all(s.skipped is None for s in stats)
    return stats


def _tiny_full(seed):
    """The tiny model on the GPU and STEPS batches of ROWS x SEQ tokens for it."""
    from moeadapt.config import get_preset
    from moeadapt.models.model import build_model, materialize

    spec = get_preset("tiny")
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(3, spec.vocab_size, (ROWS, SEQ + 1), generator=g) for _ in range(STEPS)]
    base = materialize(build_model(spec, "meta"), "cuda", seed=seed % 1000)
    base.set_backend("auto")
    return spec, base, data


def _full_loop(spec, base, data, seed, **train):
    """The trainer's full fine-tuning loop on the GPU (tests/conftest.py `trainer_loop`)."""
    from moeadapt.config import RunConfig

    cfg = RunConfig.model_validate({"model": spec.model_dump(), "train": {
        "seed": seed % 1000, "device": "cuda", "micro_batch_size": ROWS, "seq_len": SEQ, "steps": STEPS,
        "log_every": 2, "lr": LR, "warmup_steps": 0, "weight_dtype": "fp32", **train}})  # fp32: the copies path
    return trainer_loop(cfg, base, data)


def test_copies_train_as_autocasts_casts(seed):
    from moeadapt.parallel.optim import CopyAdamW

    spec, base, data = _tiny_full(seed)
    runs = []
    for copies_on, graphed in ((False, False), (True, False), (True, True)):
        lp, params, copies = _full_loop(spec, base, data, seed, weight_copies=copies_on)
        assert isinstance(lp.opt, CopyAdamW) == copies_on and (copies is not None) == copies_on
        start = [p.detach().clone() for p in params]
        stats = _steps(lp, STEPS, graphed)
        if copies_on:
            for w, c in zip(copies.weights, copies.copies):  # the optimizer wrote each copy from its new weight
                assert torch.equal(c, w.detach().to(torch.bfloat16))
        runs.append((stats, torch.cat([(p.detach() - s).flatten() for p, s in zip(params, start)])))
    (s_ref, d_ref), *others = runs
    assert d_ref.norm() > 0
    for stats, d in others:
        assert abs(stats[0].loss - s_ref[0].loss) < 1e-4 * abs(s_ref[0].loss), (stats[0].loss, s_ref[0].loss)
        assert abs(stats[0].grad_norm - s_ref[0].grad_norm) < 1e-2 * s_ref[0].grad_norm
        for a, b in zip(stats, s_ref):
            assert abs(a.loss - b.loss) < 1e-3 * abs(b.loss), (a.step, a.loss, b.loss)
        rel = float((d - d_ref).norm() / d_ref.norm())
        assert rel < 0.25, f"the weights' updates differ by {rel:.3f} (relative)"


@pytest.mark.parametrize("seq", [1024, 128])  # 512 routed rows per expert: the lean experts path; 64: Triton's
def test_lora_copies_train_as_the_casts(seed, seq):
    """LoRA (fp32 adapters on the frozen bf16 base) with the adapters' bf16 copies computes what the per-use casts
    compute, bit for bit: the same losses step by step and the same adapters after the steps, eager and replayed
    (train.cuda_graph). Both sides step with CopyAdamW and no clip (without copies: fp32 gradients, nothing to
    write), so the optimizer's arithmetic is the same, and the tiny model's layers are all KDA (DSA's backward adds
    with atomics, which no two runs repeat bit for bit). The gradients the optimizer reads: bf16, except the
    experts' adapters on the lean path (fp32 from its K-grouped kernels, which a bf16 gradient would round). A run
    whose optimizer does not write the copies (a stale copy) departs from the casts' losses."""
    from moeadapt.config import LoRASpec, RunConfig, get_preset
    from moeadapt.lora import cast_frozen_, inject_lora
    from moeadapt.models.model import build_model, materialize
    from moeadapt.parallel.optim import CopyAdamW
    from moeadapt.train import trainer
    from moeadapt.train.local import LocalRun
    from moeadapt.train.metrics import NullLogger

    steps = 4  # two eager, then the capture and a replay under train.cuda_graph
    spec = get_preset("tiny", layer_types=["kda"] * 4)
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(3, spec.vocab_size, (ROWS, seq + 1), generator=g) for _ in range(steps)]
    base = materialize(build_model(spec, "meta"), "cuda", seed=seed % 1000)
    inject_lora(base, LoRASpec(rank=8))
    cast_frozen_(base, torch.bfloat16)
    base.set_backend("auto")
    with torch.no_grad():
        for n, p in base.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.02)  # every adapter's gradient nonzero from the first step

    def train(copies_on, graphed=False, stale=False):
        cfg = RunConfig.model_validate({"model": spec.model_dump(), "lora": {"rank": 8}, "train": {
            "seed": seed % 1000, "device": "cuda", "micro_batch_size": ROWS, "seq_len": seq, "steps": steps,
            "log_every": 2, "lr": 1e-3, "warmup_steps": 0, "grad_clip": None, "weight_copies": copies_on}})
        m = copy.deepcopy(base).train()
        params = [p for p in m.parameters() if p.requires_grad]
        run = LocalRun(cfg, torch.device("cuda"))
        opt, copies = trainer.make_optimizer(cfg, run, m, params)
        assert isinstance(opt, CopyAdamW) == copies_on and (copies is not None) == copies_on
        writes = copies.by_weight() if copies and not stale else None
        opt = CopyAdamW(params, writes, lr=cfg.train.lr, betas=cfg.train.betas, weight_decay=cfg.train.weight_decay)
        lp = trainer.Loop(cfg, run, m, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                          ListBatches(data), NullLogger(), None, 1.0, True, copies=copies)
        stats = _steps(lp, steps, graphed)
        if copies and not stale:
            for w, c in zip(copies.weights, copies.copies):  # the optimizer wrote each copy from its new weight
                assert torch.equal(c, w.detach().to(torch.bfloat16))
        if copies and not graphed and not stale:  # one more forward + backward: the gradients' dtypes
            trainer._forward_backward(lp, [(data[0][:, :-1], data[0][:, 1:], {})], 1)
            lean = seq == 1024
            for n, p in m.named_parameters():
                if p.requires_grad:
                    want = torch.float32 if lean and ".experts." in n else torch.bfloat16
                    assert p.grad.dtype == want, (n, p.grad.dtype)
            opt.zero_grad(set_to_none=True)
        return [float(s.loss) for s in stats], [float(s.grad_norm) for s in stats], params

    losses, norms, adapters = train(False)
    for graphed in (False, True):
        got, got_norms, got_adapters = train(True, graphed)
        assert got == losses, (graphed, got, losses)
        for a, b in zip(got_adapters, adapters):
            assert torch.equal(a, b)
        # the norm sums bf16 and fp32 gradients in separate launches: the same values, summed in another order
        assert got_norms == pytest.approx(norms, rel=1e-5)
    stale, _, _ = train(True, stale=True)
    assert stale[0] == losses[0] and stale[1:] != losses[1:]


@pytest.mark.parametrize("graphed", [False, True])
@pytest.mark.parametrize("kept", ["bf16", "fp32_split", "auto"])
def test_bf16_weights_train_as_fp32_weights(seed, graphed, kept):
    """train.weight_dtype bf16 (copies.store_bf16, CopyAdamW's stochastically rounded bf16 weights), fp32_split
    (the same bf16 parameters with their int16 low halves in the optimizer's state) and auto (the default, which
    is fp32_split here) on the tiny model against fp32 weights with their bf16 copies, from the same weights on
    the same batches: the weights stay bf16 (the experts' w1 / w3 one buffer's halves where they pair), the first
    loss is the same to the residual stream's bf16 rounding, every loss stays within 2%, and the weights' updates
    agree as a whole (lr 1e-3: each update several bf16 steps of the weights); split weights keep int16 low
    halves that are not all zero."""
    from moeadapt.models.moe import GroupedExperts
    from moeadapt.models.router import Router

    spec, base, data = _tiny_full(seed)
    runs = []
    for weights in ("fp32", kept):
        lp, params, copies = _full_loop(spec, base, data, seed, weight_dtype=weights, lr=1e-3)
        m = lp.model
        assert (copies is None) == (weights != "fp32")
        start = [p.detach().float().clone() for p in params]
        stats = _steps(lp, STEPS, graphed and weights != "fp32")
        if weights != "fp32":
            routers = {id(r.weight) for r in m.modules() if isinstance(r, Router)}  # kept fp32 (store_bf16)
            assert routers and all((p.dtype == torch.float32) == (id(p) in routers) for p in params)
            if weights != "bf16":
                assert lp.opt.split_weights
                lows = [lp.opt.state[p]["weight_lo"] for p in params if id(p) not in routers]
                assert all(t.dtype == torch.int16 for t in lows) and any(bool(t.any()) for t in lows)
            for e in (mod for mod in m.modules() if isinstance(mod, GroupedExperts)):
                assert (e._gu_pair is not None) == (e.w1.weight[0].numel() % 4096 == 0)
                if e._gu_pair is not None:
                    assert e.w1.weight.data_ptr() == e._gu_pair.data_ptr()
        runs.append((stats, torch.cat([(p.detach().float() - s).flatten() for p, s in zip(params, start)])))
    (s_ref, d_ref), (stats, d) = runs
    assert abs(stats[0].loss - s_ref[0].loss) < 1e-2 * abs(s_ref[0].loss), (stats[0].loss, s_ref[0].loss)
    for a, b in zip(stats, s_ref):
        assert abs(a.loss - b.loss) < 2e-2 * abs(b.loss), (a.step, a.loss, b.loss)
    rel = float((d - d_ref).norm() / d_ref.norm())
    assert rel < 0.5, f"the weights' updates differ by {rel:.3f} (relative)"
