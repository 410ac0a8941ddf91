"""Context parallelism in the one mesh (cp x dp_shard, with EP and FSDP2) on 2 and 4 gloo ranks: the loss
and every gradient equal the single-process run (fp32, 1e-5), at lengths that are not multiples of the KDA
chunk, full fine-tuning and LoRA, with and without activation checkpointing, and packed documents that cross
the cp piece boundaries (position_ids split with the sequence)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import check_against_reference, batch, build, expert_names, full_grads, micro_spec, reference, spawn
from test_cp_model import packed_positions

pytestmark = pytest.mark.dist

TOL = 1e-5


def _check_one(rank, world, par, lora, seq, rows=2, packed=False):
    from moeadapt.config import ParallelSpec
    from moeadapt.parallel import build_parallel_dims, parallelize_model

    spec = micro_spec(index_loss_coef=0.01, index_topk=6, aux_loss_coef=0.01)
    pspec = ParallelSpec(**par)
    pspec.validate_seq_len(seq)
    model = build(spec, lora)
    x, y = batch(spec, rows, seq)
    y[:, 3:11] = -100  # unequal valid-token counts across the cp ranks (equal across rows, as dp needs)
    dims = build_parallel_dims(pspec, spec, "cpu")
    layout = dims.cp_layout()
    pos = packed_positions(rows, seq, layout.n_pieces, seq) if packed else None
    _, ref_loss, ref_grads = reference(model, x, y, position_ids=pos)

    experts = expert_names(model)
    parallelize_model(model, dims)
    per = rows // dims.dp_size
    rows_x, rows_y = (t[dims.dp_rank * per:(dims.dp_rank + 1) * per] for t in (x, y))
    kw = {"position_ids": layout.split(pos[dims.dp_rank * per:(dims.dp_rank + 1) * per])} if packed else {}
    out = model(layout.split(rows_x), layout.split(rows_y), return_logits=False, **kw)
    (out.loss + out.aux_loss).backward()
    what = f"{par} lora={lora} T={seq} packed={packed} rank {rank}"
    check_against_reference(model, dims, out, world, ref_loss, ref_grads, experts, spec.n_routed_experts, what, TOL)


def _cases(rank, world, cases):
    for c in cases:
        _check_one(rank, world, *c)


def test_cp2():
    spawn(_cases, 2, [(dict(cp=2), False, 52),
                      (dict(cp=2, activation_checkpointing="full"), True, 68)])


def test_cp4_and_cp2_ep2():
    spawn(_cases, 4, [(dict(cp=4), True, 72),
                      (dict(dp_shard=2, cp=2, ep=2, activation_checkpointing="full"), False, 76, 4)])


def test_cp2_ep2_packed_documents():
    """cp = 2 x ep = 2 on 2 ranks (FSDP2, experts split), documents crossing the pieces: full fine-tuning with
    full recompute, LoRA with selective checkpointing."""
    spawn(_cases, 2, [(dict(cp=2, ep=2, activation_checkpointing="full"), False, 60, 2, True),
                      (dict(cp=2, ep=2, activation_checkpointing="selective"), True, 52, 2, True)])


@pytest.mark.slow
def test_cp2_ep2_dp2_packed_documents_four_ranks():
    spawn(_cases, 4, [(dict(dp_shard=2, cp=2, ep=2), True, 76, 4, True)])
