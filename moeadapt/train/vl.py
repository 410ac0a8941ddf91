"""Evaluation of a vision-language model on a multimodal dataset: loss and answer accuracy.

Answer accuracy: a row counts as correct when the model's argmax matches every target token of the assistant's
answers (end-of-turn token included), which is exactly when greedy decoding would reproduce the answer given the
prompt. Reported overall and per `meta.question` when the records carry one (builtin:shapes does).
Must not change the model or the data.
"""

from __future__ import annotations

import contextlib

import torch


@torch.no_grad()
def evaluate_vl(model, ds, batch_size: int, device: torch.device, n_batches: int | None = None,
                autocast=contextlib.nullcontext) -> dict:
    """-> {"loss": mean over target tokens, "accuracy": share of rows answered exactly, "rows": n,
    "by_question": {kind: accuracy}}."""
    was_training = model.training
    model.eval()
    n = len(ds) if n_batches is None else min(len(ds), n_batches * batch_size)
    tot, cnt, right = 0.0, 0, torch.zeros(n, dtype=torch.bool)
    for i in range(0, n, batch_size):
        idx = torch.arange(i, min(i + batch_size, n))
        x, y, images = ds.rows(idx)
        x, y = x.to(device), y.to(device)
        with autocast():
            out = model(x, y, images=images.to(device) if images is not None else None)
        k = int((y != -100).sum())
        if k:
            tot += float(out.loss) * k
            cnt += k
        ok = (out.logits.argmax(-1) == y) | (y == -100)
        right[idx] = ok.all(-1).cpu()
    if was_training:
        model.train()
    res = {"loss": tot / max(cnt, 1), "accuracy": float(right.float().mean()) if n else 0.0, "rows": n}
    kinds = [ds.meta[i].get("question") if i < len(ds.meta) else None for i in range(n)]
    if any(kinds):
        res["by_question"] = {q: float(right[[i for i, k in enumerate(kinds) if k == q]].float().mean())
                              for q in sorted({k for k in kinds if k})}
    return res
