"""FSDP2 + EP on 2 gloo ranks with a vision-language model: loss and every gradient (vision tower, projector,
language model, experts) on a batch of image + text rows equal the single-process run (fp32)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _harness import expert_names, full_grads, micro_spec, spawn

pytestmark = pytest.mark.dist

TOL = 1e-5
VISION = dict(patch_size=14, hidden_size=16, n_layers=2, n_heads=2, intermediate_size=32)
# per row: image sizes (pixels); every row has 5 target tokens, so the mean of the two ranks' means is the
# single-process mean over all target tokens
ROWS = [[(56, 56)], [(56, 112)], [(56, 56), (56, 56)], [(112, 56)]]


def _batch(seq=24, seed=7):
    from moeadapt.models.vision import ImageBatch, patchify

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (len(ROWS), seq), generator=g)
    labels = torch.full_like(ids, -100)
    pix, grids, per_row = [], [], []
    for r, sizes in enumerate(ROWS):
        pos = 1
        for h, w in sizes:
            n = (h // 28) * (w // 28)
            ids[r, pos:pos + n] = 263
            pos += n + 1
            img = torch.randn(3, h, w, generator=g)
            pix.append(patchify(img, 14))
            grids.append((h // 14, w // 14))
        labels[r, seq - 6:seq - 1] = torch.randint(0, 256, (5,), generator=g)
        per_row.append(len(sizes))
    return ids, labels, ImageBatch(torch.cat(pix), torch.tensor(grids)), per_row


def _rows(images, per_row, lo, hi):
    from moeadapt.models.vision import ImageBatch

    first, last = sum(per_row[:lo]), sum(per_row[:hi])
    patches = (images.grid_hw[:, 0] * images.grid_hw[:, 1]).tolist()
    a, b = sum(patches[:first]), sum(patches[:last])
    return ImageBatch(images.pixel_values[a:b], images.grid_hw[first:last])


def _check(rank, world, lora):
    from moeadapt.config import LoRASpec, ParallelSpec
    from moeadapt.lora import inject_lora, lora_modules
    from moeadapt.models.model import build_model, materialize
    from moeadapt.parallel import build_parallel_dims, parallelize_model

    spec = micro_spec(vision=VISION)
    model = materialize(build_model(spec, "meta"), "cpu", seed=0)
    model.set_backend("reference")
    if lora:
        inject_lora(model, LoRASpec(rank=4, alpha=8.0, vision_tower="lora", projector="full"))
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for m in lora_modules(model).values():
                b = m.lora_B.weight if hasattr(m.lora_B, "weight") else m.lora_B
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    x, y, images, per_row = _batch()
    ref = copy.deepcopy(model)
    out = ref(x, y, return_logits=False, images=images)
    (out.loss + out.aux_loss).backward()
    ref_loss = float(out.loss)
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}
    assert any(n.startswith("vision.tower.") for n in ref_grads), "the tower must get gradients in this test"

    pspec = ParallelSpec(dp_shard=2, ep=2)
    dims = build_parallel_dims(pspec, spec, "cpu")
    experts = expert_names(model)
    parallelize_model(model, dims)
    per = len(ROWS) // world
    lo, hi = rank * per, (rank + 1) * per
    out = model(x[lo:hi], y[lo:hi], return_logits=False, images=_rows(images, per_row, lo, hi))
    (out.loss + out.aux_loss).backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    assert abs(float(loss) / world - ref_loss) < TOL, f"rank {rank}: loss {float(loss) / world} vs {ref_loss}"
    grads = full_grads(model, dims)
    assert set(grads) == set(ref_grads), sorted(set(grads) ^ set(ref_grads))[:4]
    El = spec.n_routed_experts // pspec.ep
    off = dims.ep_rank * El
    for n, gr in grads.items():
        r = ref_grads[n][off:off + El] if n in experts else ref_grads[n]
        err = (gr - r).abs().max().item()
        assert err < TOL, f"lora={lora} rank {rank}: grad {n} differs by {err:.2e} (scale {r.abs().max().item():.2e})"


def _world2(rank, world):
    _check(rank, world, lora=False)
    _check(rank, world, lora=True)


def test_vision_language_grads_match_single_process_ep2():
    spawn(_world2, 2)
