"""GPU: the training step never makes the host wait for the device, not per layer, per copy or per step.

`torch.cuda.set_sync_debug_mode("error")` raises on every operation that makes the host wait for the device
(a device read, a blocking copy, nonzero, ...). The tiny model (KDA, gated DSA, LatentMoE) runs its forward and
backward with packed documents under it, then whole trainer steps with the fused AdamW, which apply or skip each
step on the device and read the previous step's verdict from pinned memory once that step's event has passed
(`trainer.settle`). The same forward with the documents' ids on the device must raise (the check can fail), and
so must a step with an optimizer that cannot skip on the device (it reads the verdict before stepping)."""

import os

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="run with TRITON_INTERPRET=0"),
]

ROWS, SEQ = 2, 256


def _batch(spec, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, spec.vocab_size, (ROWS, SEQ + 1), generator=g)
    pos = torch.zeros(ROWS, SEQ, dtype=torch.long)
    for r in range(ROWS):  # three documents per row, cut at random places
        cuts = sorted(torch.randperm(SEQ - 2, generator=g)[:2].add(1).tolist())
        for a, b in zip([0, *cuts], [*cuts, SEQ]):
            pos[r, a:b] = torch.arange(b - a)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous(), pos


def _model(seed):
    from moeadapt.config import get_preset
    from moeadapt.models.model import build_model, materialize

    spec = get_preset("tiny")
    model = materialize(build_model(spec, "meta"), "cuda", seed=seed % 1000)
    model.set_backend("auto")
    return spec, model.train()


class _SameBatch:
    """The trainer's sampler giving the same packed batch every step."""

    def __init__(self, batch):
        self.batch = batch

    def next(self):
        x, y, pos = self.batch
        return x, y, {"position_ids": pos}


class _NoSync:
    def __enter__(self):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode(0)
        return False


def _fwd_bwd(model, x, y, pos):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = model(x, y, return_logits=False, position_ids=pos)
    (out.loss + out.aux_loss).backward()
    return out


def test_forward_backward_with_packed_documents_never_waits(seed):
    spec, model = _model(seed)
    x, y, pos = _batch(spec, seed)
    xd, yd = x.cuda(), y.cuda()
    _fwd_bwd(model, xd, yd, pos)  # compiles and autotunes (those wait)
    model.zero_grad(set_to_none=True)
    with _NoSync():
        _fwd_bwd(model, xd, yd, pos)
    with pytest.raises(RuntimeError, match="synchroniz"), _NoSync():
        _fwd_bwd(model, xd, yd, pos.cuda())  # boundaries read from the device: the check can fail


def test_trainer_steps_never_wait(seed):
    from moeadapt.config import RunConfig
    from moeadapt.train import trainer
    from moeadapt.train.local import LocalRun
    from moeadapt.train.metrics import NullLogger

    spec, model = _model(seed)
    cfg = RunConfig.model_validate({"model": spec.model_dump(), "train": {
        "seed": seed % 1000, "device": "cuda", "micro_batch_size": ROWS, "seq_len": SEQ, "grad_accum_steps": 2,
        "steps": 10, "log_every": 1}})  # every step logged: its host copies run under the check too
    batch = _batch(spec, seed)

    run = LocalRun(cfg, torch.device("cuda"))
    reads = []
    read = trainer._read

    def counted(*a):
        reads.append(1)
        return read(*a)

    trainer._read = counted
    try:
        params = [p for p in model.parameters() if p.requires_grad]

        def loop(opt):
            return trainer.Loop(cfg, run, model, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                                _SameBatch(batch), NullLogger(), None, 1.0, True)

        lp = loop(torch.optim.AdamW(params, lr=1e-4, fused=True))
        assert trainer.train_step(lp) is None  # warm-up: compiles, autotunes, makes the optimizer state
        lp.step = 1
        st = trainer.train_step(lp)
        assert st is not None and st.step == 0 and st.skipped is None, st
        reads.clear()
        with _NoSync():
            lp.step = 2
            st = trainer.train_step(lp)
        assert st.step == 1 and st.skipped is None and reads == [1]
        assert trainer.settle(lp).skipped is None

        lp = loop(torch.optim.AdamW(params, lr=1e-4, foreach=True))  # reads its verdict before stepping
        trainer.train_step(lp)
        with pytest.raises(RuntimeError, match="synchroniz"), _NoSync():
            trainer.train_step(lp)
    finally:
        trainer._read = read


@pytest.mark.parametrize("weights", ["fp32", "fp32_split"])
def test_trainer_steps_with_weight_copies_never_wait(seed, weights):
    """Full fine-tuning with bf16 weight copies (train/copies.py) or split weights (train.weight_dtype
    fp32_split, the default where it runs): CopyAdamW's tables, gradient norm and update make no host sync
    either, once its block maps exist (the first step)."""
    from moeadapt.config import RunConfig
    from moeadapt.parallel.optim import CopyAdamW
    from moeadapt.train import trainer
    from moeadapt.train.local import LocalRun
    from moeadapt.train.metrics import NullLogger

    spec, model = _model(seed)
    cfg = RunConfig.model_validate({"model": spec.model_dump(), "train": {
        "seed": seed % 1000, "device": "cuda", "micro_batch_size": ROWS, "seq_len": SEQ, "steps": 10,
        "log_every": 1, "weight_dtype": weights}})
    batch = _batch(spec, seed)

    run = LocalRun(cfg, torch.device("cuda"))
    params = [p for p in model.parameters() if p.requires_grad]
    opt, copies = trainer.make_optimizer(cfg, run, model, params)
    assert isinstance(opt, CopyAdamW) and (copies is not None) == (weights == "fp32")
    lp = trainer.Loop(cfg, run, model, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                      _SameBatch(batch), NullLogger(), None, 1.0, True, copies=copies)
    for step in range(2):  # compiles, autotunes, makes the optimizer state and its block maps
        lp.step = step
        trainer.train_step(lp)
    with _NoSync():
        lp.step = 2
        st = trainer.train_step(lp)
    assert st.step == 1 and st.skipped is None
    assert trainer.settle(lp).skipped is None
