"""Degree validation (no processes): every mismatch is one sentence naming the numbers."""

from __future__ import annotations

import pytest
from _harness import micro_spec

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("par, world, words", [
    (dict(dp_shard=4, ep=3), 4, ["ep=3", "n_routed_experts=4"]),
    (dict(dp_shard=2, ep=4), 2, ["ep=4", "dp_shard*cp=2"]),
    (dict(dp_shard=4, ep=2), 2, ["world size 2", "= 4"]),
    (dict(dp_shard=1, cp=2), 4, ["world size 4", "= 1*1*2"]),
    (dict(dp_shard=2, cp=2, ep=3), 4, ["ep=3", "n_routed_experts=4"]),
])
def test_check_spec_names_the_numbers(par, world, words):
    from moeadapt.config import ParallelSpec
    from moeadapt.parallel import check_spec

    with pytest.raises(ValueError) as e:
        check_spec(ParallelSpec.model_construct(**{**ParallelSpec().model_dump(), **par}), micro_spec(), world)
    for w in words:
        assert w in str(e.value), str(e.value)


def test_ep_without_moe_layers_is_rejected():
    from moeadapt.config import ParallelSpec
    from moeadapt.parallel import check_spec

    with pytest.raises(ValueError, match="no MoE layer"):
        check_spec(ParallelSpec(dp_shard=2, ep=2), micro_spec(first_k_dense=4), 2)


def test_cp_seq_len_must_split_into_pieces():
    from moeadapt.config import ParallelSpec

    ParallelSpec(cp=4).validate_seq_len(8 * 37)  # pieces need not be whole KDA chunks
    with pytest.raises(ValueError, match=r"seq_len=100 does not split over cp=4 into 8 equal pieces.*"
                                         r"multiple of 8, e.g. 96 or 104"):
        ParallelSpec(cp=4).validate_seq_len(100)
