import pytest

from moeadapt import api


@pytest.mark.parametrize("name, lo, hi", [
    ("hybrid-2.8t", 2.7e12, 2.9e12),
    ("small", 1e9, 3e9),
    ("kimi-linear-48b-a3b", 45e9, 52e9),
    ("deepseek-v3.2", 660e9, 700e9),
])
def test_preset_parameter_counts_on_meta(name, lo, hi):
    c = api.info(name)
    assert lo <= c["total"] <= hi, c["total"]
    assert c["active_per_token"] < c["total"]
    assert sum(c["by_component"].values()) == c["total"]


def test_hybrid_2_8t_shape():
    c = api.info("hybrid-2.8t")
    assert (c["experts"], c["experts_per_token"], c["shared_experts"]) == (896, 16, 1)
    assert c["kda_layers"] == 3 * c["dsa_layers"]
    assert c["index_topk"] == 2048 and c["context"] >= 1_000_000 and c["latent_dim"]
    # active = total - routed experts not chosen: (1 - 16/896) of the routed parameters are inactive
    routed = c["by_component"]["moe.routed_experts"]
    assert abs(c["total"] - c["active_per_token"] - routed * (1 - 16 / 896)) < 1e6
