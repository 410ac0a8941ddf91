"""The contract the overlapped optimizer step (train/overlap.py) rests on, on CPU: the model's forward reads each
parameter only after `stage_hook` was called with that parameter's stage (`forward_stages`), so an update of
stage s that the forward waits for at hook s is complete before any of its weights is read. Checked by poisoning
every weight with NaN and restoring each stage's inside its hook: the loss must equal the clean forward's. The
GPU test (tests/gpu/test_overlap_gpu.py) checks the captured update's values."""

import pytest
import torch

from moeadapt.config import RunConfig, get_preset
from moeadapt.models.model import build_model, forward_stages, materialize


def _model(seed, **kw):
    spec = get_preset("tiny", **kw)
    model = materialize(build_model(spec, "meta"), "cpu", seed=seed % 1000, dtype=torch.float64)
    model.set_backend("reference")
    return spec, model


def _poisoned_loss(model, x, y, stages):
    """The loss of a forward whose weights are NaN until the hook of the stage `stages` puts them in."""
    keep = {p: p.detach().clone() for st in stages for p in st}
    calls = []

    def hook(s):
        calls.append(s)
        with torch.no_grad():
            for p in stages[s]:
                p.copy_(keep[p])

    with torch.no_grad():
        for p in keep:
            p.fill_(float("nan"))
    model.stage_hook = hook
    try:
        loss = model(x, y, return_logits=False).loss
    finally:
        model.stage_hook = None
        with torch.no_grad():
            for p, v in keep.items():
                p.copy_(v)
    return loss, calls


@pytest.mark.parametrize("kw", [{}, {"tie_word_embeddings": True}, {"hc_mult": 2}], ids=["plain", "tied", "hc"])
def test_every_weight_is_read_after_its_stage_hook(seed, kw):
    spec, model = _model(seed, **kw)
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(3, spec.vocab_size, (2, 24), generator=g)
    y = torch.randint(3, spec.vocab_size, (2, 24), generator=g)
    stages = forward_stages(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert len(stages) == spec.n_layers + 2
    assert sorted(id(p) for st in stages for p in st) == sorted(names)  # each parameter once
    clean = model(x, y, return_logits=False).loss
    loss, calls = _poisoned_loss(model, x, y, stages)
    assert calls == list(range(spec.n_layers + 2))
    assert torch.isfinite(loss) and torch.equal(loss, clean), (float(loss), float(clean))

    # the check fails where a weight's stage comes after its first read: layer 0's first weight put into the head's
    moved = [list(st) for st in stages]
    p = moved[1].pop(0)
    moved[-1].append(p)
    late, _ = _poisoned_loss(model, x, y, moved)
    assert not torch.isfinite(late), f"{names[id(p)]} read before its stage went unnoticed"


def test_overlap_is_taken_where_it_applies():
    from moeadapt.parallel.optim import CopyAdamW
    from moeadapt.train.local import LocalRun
    from moeadapt.train.overlap import why_not

    spec, model = _model(0)
    params = [p for p in model.parameters()]
    copy_opt = CopyAdamW(params, {})
    plain_opt = torch.optim.AdamW(params)

    def cfg(**train):
        return RunConfig.model_validate({"model": spec.model_dump(), "train": train})

    on = cfg(cuda_graph=True)
    assert why_not(on, LocalRun(on, torch.device("cpu")), copy_opt, model) is None
    off = cfg(cuda_graph=True, overlap_optimizer=False)
    assert "overlap_optimizer is off" in why_not(off, LocalRun(off, torch.device("cpu")), copy_opt, model)
    assert "CopyAdamW" in why_not(on, LocalRun(on, torch.device("cpu")), plain_opt, model)
    assert "no forward stages" in why_not(on, LocalRun(on, torch.device("cpu")), copy_opt, torch.nn.Linear(2, 2))
