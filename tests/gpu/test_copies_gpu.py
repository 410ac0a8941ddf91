"""GPU: full fine-tuning with bf16 weight copies (train/copies.py, parallel/optim.CopyAdamW) trains as autocast's
casts with torch's fused AdamW do. The tiny model, the trainer's steps from the same weights on the same batches,
eager and replayed (train.cuda_graph): the first step's loss and gradient norm are the same computation (equal
to rounding: the DSA backward adds with atomics), and the weights' updates over the steps agree as a whole."""

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

ROWS, SEQ, STEPS, LR = 2, 256, 5, 1e-4


def test_copies_train_as_autocasts_casts(seed):
    from moeadapt.config import RunConfig, get_preset
    from moeadapt.models.model import build_model, materialize
    from moeadapt.parallel.optim import CopyAdamW
    from moeadapt.train import trainer
    from moeadapt.train.local import LocalRun
    from moeadapt.train.metrics import NullLogger

    spec = get_preset("tiny")
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(3, spec.vocab_size, (ROWS, SEQ + 1), generator=g) for _ in range(STEPS)]

    base = materialize(build_model(spec, "meta"), "cuda", seed=seed % 1000)
    base.set_backend("auto")
    runs = []
    for copies_on, graphed in ((False, False), (True, False), (True, True)):
        cfg = RunConfig.model_validate({"model": spec.model_dump(), "train": {
            "seed": seed % 1000, "device": "cuda", "micro_batch_size": ROWS, "seq_len": SEQ, "steps": STEPS,
            "log_every": 2, "lr": LR, "warmup_steps": 0, "weight_copies": copies_on}})
        m = copy.deepcopy(base).train()
        params = [p for p in m.parameters() if p.requires_grad]
        run = LocalRun(cfg, torch.device("cuda"))
        opt, copies = trainer.make_optimizer(cfg, run, m, params)
        assert isinstance(opt, CopyAdamW) == copies_on and (copies is not None) == copies_on
        lp = trainer.Loop(cfg, run, m, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
                          ListBatches(data), NullLogger(), None, 1.0, True, copies=copies)
        if graphed:
            trainer.use_cuda_graph(lp)
        start = [p.detach().clone() for p in params]
        stats = []
        for step in range(STEPS):
            lp.step = step
            stats.append(trainer.train_step(lp))
        stats.append(trainer.settle(lp))
        stats = [s for s in stats if s is not None]
        assert [s.step for s in stats] == list(range(STEPS)) and all(s.skipped is None for s in stats)
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
