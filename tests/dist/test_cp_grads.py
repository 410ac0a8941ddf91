"""Context parallelism in the one mesh (cp x dp_shard, with EP and FSDP2) on 2 and 4 gloo ranks: the loss
and every gradient equal the single-process run (fp32, 1e-5), at lengths that are not multiples of the KDA
chunk, full fine-tuning and LoRA, with and without activation checkpointing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _harness import check_against_reference, batch, build, expert_names, full_grads, micro_spec, reference, spawn

pytestmark = pytest.mark.dist

TOL = 1e-5


def _check_one(rank, world, par, lora, seq, rows=2):
    from moeadapt.config import ParallelSpec
    from moeadapt.parallel import build_parallel_dims, parallelize_model

    spec = micro_spec(index_loss_coef=0.01, index_topk=6, aux_loss_coef=0.01)
    pspec = ParallelSpec(**par)
    pspec.validate_seq_len(seq)
    model = build(spec, lora)
    x, y = batch(spec, rows, seq)
    y[:, 3:11] = -100  # unequal valid-token counts across the cp ranks (equal across rows, as dp needs)
    _, ref_loss, ref_grads = reference(model, x, y)

    dims = build_parallel_dims(pspec, spec, "cpu")
    experts = expert_names(model)
    parallelize_model(model, dims)
    per = rows // dims.dp_size
    rows_x, rows_y = (t[dims.dp_rank * per:(dims.dp_rank + 1) * per] for t in (x, y))
    layout = dims.cp_layout()
    out = model(layout.split(rows_x), layout.split(rows_y), return_logits=False)
    (out.loss + out.aux_loss).backward()
    what = f"{par} lora={lora} T={seq} rank {rank}"
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
