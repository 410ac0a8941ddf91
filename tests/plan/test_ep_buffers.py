"""plan/memory.py's EP terms follow the runtime's fixed-capacity exchange: the all-to-all buffers are
4 x chunks x ep x cap rows of latent width, and the experts' saved tensors count the padded rows."""

from __future__ import annotations

from moeadapt.config import get_preset
from moeadapt.plan.comm import comm_and_time
from moeadapt.plan.memory import Plan, ep_capacity, ep_rows_per_token, memory_breakdown


def test_a2a_buffers_are_the_padded_exchange():
    spec = get_preset("tiny")
    base = dict(gpus=4, dp_replicate=1, dp_shard=4, cp=1, ep=2, recompute="none", micro_batch=2, seq_len=256)
    plan = Plan(**base, a2a_chunks=2)
    t, K, L = 512, spec.n_experts_per_tok, spec.latent_dim or spec.hidden_size
    cap = ep_capacity(spec, plan)
    # the runtime's rule: 1.5 x the balanced share of a chunk (256 tokens x K / ep), rounded up to 64
    assert cap == min(256 * K, -(-int(1.5 * 256 * K / 2) // 64) * 64)
    m = memory_breakdown(spec, plan, None)
    assert m["a2a_buffers"] == 4 * 2 * 2 * cap * L * 2
    assert ep_rows_per_token(spec, plan) == 2 * 2 * cap / t
    assert ep_rows_per_token(spec, Plan(**{**base, "ep": 1, "dp_shard": 4})) is None
    # a larger capacity factor: bigger buffers, more saved expert rows, more bytes on the wire
    big = Plan(**base, a2a_chunks=2, ep_capacity_factor=3.0)
    mb = memory_breakdown(spec, big, None)
    assert mb["a2a_buffers"] > m["a2a_buffers"] and mb["activations"] > m["activations"]
    assert comm_and_time(spec, big, None)["a2a_bytes"] > comm_and_time(spec, plan, None)["a2a_bytes"]
