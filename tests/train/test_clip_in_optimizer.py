"""The gradient clip handed to the fused AdamW as its grad_scale (`trainer.clip_divisor`) updates the parameters
as clipping the gradients in place first does: clipped steps and unclipped ones, fp32 on CPU."""

from __future__ import annotations

import torch

from moeadapt.train.trainer import clip_divisor


def test_clip_divisor_in_fused_adamw_matches_clipping_first(seed):
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (3,), (4, 2, 3)]
    init = [torch.randn(s, generator=g) for s in shapes]
    pa = [torch.nn.Parameter(t.clone()) for t in init]
    pb = [torch.nn.Parameter(t.clone()) for t in init]
    oa = torch.optim.AdamW(pa, lr=1e-2, weight_decay=0.1, fused=True)
    ob = torch.optim.AdamW(pb, lr=1e-2, weight_decay=0.1, fused=True)
    max_norm, clipped = 1.0, []
    for scale in (30.0, 0.01, 5.0, 0.05):  # gradient norms far above and below the clip
        grads = [torch.randn(s, generator=g) * scale for s in shapes]
        for p, q, gr in zip(pa, pb, grads):
            p.grad, q.grad = gr.clone(), gr.clone()
        norm_a = torch.nn.utils.clip_grad_norm_(pa, max_norm)
        oa.step()
        norm_b = torch.nn.utils.get_total_norm([q.grad for q in pb], 2.0, foreach=True)
        ob.grad_scale = clip_divisor(norm_b, max_norm)
        ob.step()
        del ob.grad_scale
        torch.testing.assert_close(norm_b, norm_a)
        clipped.append(float(norm_a) > max_norm)
        for p, q in zip(pa, pb):
            torch.testing.assert_close(q, p, rtol=1e-6, atol=1e-7)
    assert clipped == [True, False, True, False]
    assert clip_divisor(torch.tensor(3.0), None) is None
    # a divisor that forgot the clamp at 1 would scale the small gradients up: not the same update
    small = torch.tensor(0.5)
    assert float(clip_divisor(small, max_norm)) == 1.0
