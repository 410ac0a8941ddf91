"""Evaluation of a vision-language model on a multimodal dataset: loss and answer accuracy.

Answer accuracy: an answer (one assistant turn: a run of consecutive target tokens, its end-of-turn token
included) counts as correct when the model's argmax matches every one of its tokens, which is exactly when greedy
decoding would reproduce it given the conversation so far. Reported over all answers, and per question type when
records carry `meta.questions` (one per assistant turn) or `meta.question` (builtin:shapes does).
Must not change the model or the data.
"""

from __future__ import annotations

import contextlib

import torch


def _answers(y_T: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of consecutive target positions (labels != -100)."""
    on = (y_T != -100).tolist()
    out, start = [], None
    for t, v in enumerate(on + [False]):
        if v and start is None:
            start = t
        elif not v and start is not None:
            out.append((start, t))
            start = None
    return out


@torch.no_grad()
def evaluate_vl(model, ds, batch_size: int, device: torch.device, n_batches: int | None = None,
                autocast=contextlib.nullcontext) -> dict:
    """-> {"loss": mean over target tokens, "accuracy": share of answers reproduced exactly, "rows": n,
    "answers": count, "by_question": {kind: accuracy}}."""
    was_training = model.training
    model.eval()
    n = len(ds) if n_batches is None else min(len(ds), n_batches * batch_size)
    tot, cnt, right, kinds = 0.0, 0, [], []
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
        ok = (out.logits.argmax(-1) == y).cpu()
        for r, row in enumerate(idx.tolist()):
            spans = _answers(y[r].cpu())
            meta = ds.meta[row] if row < len(ds.meta) else {}
            qs = meta.get("questions") or ([meta["question"]] if "question" in meta else [])
            for j, (a, b) in enumerate(spans):
                right.append(bool(ok[r, a:b].all()))
                kinds.append(qs[j] if j < len(qs) else None)
    if was_training:
        model.train()
    acc = torch.tensor(right, dtype=torch.float64)
    res = {"loss": tot / max(cnt, 1), "accuracy": float(acc.mean()) if right else 0.0, "rows": n, "answers": len(right)}
    if any(kinds):
        res["by_question"] = {q: float(acc[[i for i, k in enumerate(kinds) if k == q]].mean())
                              for q in sorted({k for k in kinds if k})}
    return res
