"""The model under context parallelism (models/ wiring, no FSDP): every rank runs its pieces of each sequence;
the loss and every gradient (averaged over ranks) equal the single-process run (fp32, 1e-5). Packed batches:
documents that start exactly at a piece boundary, that cross one, and one-token documents, split with the
sequence (position_ids; the single-process packed run equals each document alone: tests/models/test_documents)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _harness import batch, build, micro_spec, reference, spawn

pytestmark = pytest.mark.dist

TOL = 1e-5


def packed_positions(rows: int, seq: int, n_pieces: int, seed: int) -> torch.Tensor:
    """position_ids [rows, seq]: row 0 has a document starting at the first piece boundary and one crossing
    the next (from 3 tokens before it); every row a one-token document and random others."""
    g = torch.Generator().manual_seed(seed)
    piece = seq // n_pieces
    pos = torch.empty(rows, seq, dtype=torch.long)
    for b in range(rows):
        starts = {0, int(torch.randint(1, seq, (1,), generator=g)), int(torch.randint(1, seq, (1,), generator=g))}
        one = int(torch.randint(1, seq - 1, (1,), generator=g))
        starts |= {one, one + 1}
        if b == 0:
            starts |= {piece, 2 * piece - 3}
        cut = sorted(starts) + [seq]
        for s, e in zip(cut, cut[1:]):
            pos[b, s:e] = torch.arange(e - s)
    return pos


def _check(rank, world, seq, balanced, lora, checkpointing, packed=False):
    from moeadapt.models.model import set_context_parallel
    from moeadapt.models.router import Router
    from moeadapt.ops.cp_comm import CPLayout
    from moeadapt.parallel.activation import apply_activation_checkpointing

    spec = micro_spec(index_loss_coef=0.01, index_topk=6, aux_loss_coef=0.01, seq_aux_loss_coef=0.01,
                      z_loss_coef=0.001)
    model = build(spec, lora)
    x, y = batch(spec, 2, seq)
    y[0, 5:9] = -100  # unequal valid-token counts across ranks: the loss must weight by tokens
    layout = CPLayout(dist.group.WORLD, rank, world, balanced)
    pos = packed_positions(2, seq, layout.n_pieces, seq) if packed else None
    _, ref_loss, ref_grads = reference(model, x, y, position_ids=pos)
    what = f"cp={world} T={seq} balanced={balanced} lora={lora} ac={checkpointing} packed={packed}"

    cp_model = copy.deepcopy(model)
    set_context_parallel(cp_model, layout)
    for m in cp_model.modules():
        if isinstance(m, Router):
            m.global_counts_reduce = dist.all_reduce
    if checkpointing:  # True: full recompute, or the mode
        apply_activation_checkpointing(cp_model, "full" if checkpointing is True else checkpointing)
    out = cp_model(layout.split(x), layout.split(y), return_logits=False,
                   position_ids=layout.split(pos) if packed else None)
    (out.loss + out.aux_loss).backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    assert abs(float(loss) / world - ref_loss) < TOL, f"{what}: loss {float(loss) / world} vs {ref_loss}"
    grads = {n: p.grad for n, p in cp_model.named_parameters() if p.grad is not None}
    assert set(grads) == set(ref_grads), f"{what}: grads for {sorted(set(grads) ^ set(ref_grads))[:4]}"
    for n, g in grads.items():
        g = g.clone()
        dist.all_reduce(g)
        err = (g / world - ref_grads[n]).abs().max().item()
        assert err < TOL, f"{what}: grad {n} differs by {err:.2e} (scale {ref_grads[n].abs().max().item():.2e})"


def _cases(rank, world, cases):
    for c in cases:
        _check(rank, world, *c)


def test_model_cp_two_ranks():
    spawn(_cases, 2, [(52, True, False, False), (70, False, True, True)])


@pytest.mark.slow  # the 4-rank model proof in CI is test_cp_grads.py::test_cp4_and_cp2_ep2
def test_model_cp_four_ranks():
    spawn(_cases, 4, [(56, True, True, False)])


def test_model_cp_packed_documents_two_ranks():
    """Full fine-tuning and LoRA, a balanced and a contiguous layout, without activation checkpointing, with full
    recompute and with selective checkpointing (the recompute reruns the cp collectives)."""
    spawn(_cases, 2, [(52, True, False, False, True), (60, False, True, True, True),
                      (52, True, True, "selective", True)])


@pytest.mark.slow
def test_model_cp_packed_documents_four_ranks():
    spawn(_cases, 4, [(72, True, True, False, True), (72, True, False, True, True)])
