"""Routing simulator: loads, straggler factor, capacity / drop policies, placement, metrics input, plot."""

import json

import numpy as np
import pytest

from moeadapt.cli import main
from moeadapt.plan.routing import expert_probs, placement, simulate, sweep


def test_uniform_is_balanced_and_bytes_add_up():
    r = simulate(64, 4, 8, 8192, "uniform", latent=128, bytes_per_value=2)
    assert r["straggler_factor"] < 1.1 and r["drop_rate"] == 0
    # every token-choice leaving its rank crosses one pair: total ~ T*K*(ep-1)/ep values
    total = r["a2a_bytes_per_pair_mean"] * 8 * 7
    assert total == pytest.approx(8192 * 4 * 7 / 8 * 128 * 2, rel=0.05)


def test_zipf_skew_capacity_and_spread_placement():
    rows = {(r["placement"], r["capacity_factor"], r["drop_policy"]): r
            for r in sweep(256, 8, 16, 16384, "zipf:0.6", latent=64)}
    dropless = rows[("contiguous", None, None)]
    assert dropless["straggler_factor"] > 1.1
    capped = rows[("contiguous", 1.0, "probs")]
    assert capped["drop_rate"] > 0 and capped["straggler_factor"] < dropless["straggler_factor"]
    assert rows[("spread", None, None)]["straggler_factor"] < dropless["straggler_factor"]
    assert rows[("contiguous", 1.5, "probs")]["drop_rate"] < capped["drop_rate"]


def test_placement_spread_is_a_permutation():
    p = expert_probs("zipf:1.0", 64)
    r = placement(p, 8, "spread")
    assert sorted(np.bincount(r)) == [8] * 8


def test_counts_from_metrics_jsonl_and_png(tmp_path, capsys):
    f = tmp_path / "metrics.jsonl"
    counts = [50, 10, 10, 10, 5, 5, 5, 5]
    f.write_text("\n".join(json.dumps({"step": s, "moe": [{"layer": 1, "counts": counts, "max": 4.0}]})
                           for s in range(3)))
    assert expert_probs(str(f), 8)[0] == pytest.approx(0.5)
    png = tmp_path / "r.png"
    assert main(["simulate-routing", "--experts", "8", "--top-k", "2", "--ep", "4", "--tokens", "2048", "--dist",
                 str(f), "--latent", "32", "--png", str(png), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert png.is_file() and png.stat().st_size > 1000 and len(rows) == 10
    with pytest.raises(ValueError, match="logs 8 experts"):
        expert_probs(str(f), 16)
