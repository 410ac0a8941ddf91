"""train/dryrun.py: the real build -> LoRA -> parallelize path on meta for simulated ranks (fake process
group) gives per-rank bytes equal to the planner's, covers the whole model across ranks, and runs the
128-rank hybrid-2.8t plans in under a minute of CPU."""

import time

import pytest
import yaml

from moeadapt import api
from moeadapt.config import build_run_config
from moeadapt.plan.memory import Plan, memory_breakdown, param_counts
from moeadapt.train.dryrun import dry_run
from tests.conftest import micro_spec


@pytest.mark.parametrize("lora", [False, True])
def test_ranks_cover_the_model_and_match_the_planner(lora):
    spec = micro_spec(n_routed_experts=8)
    cfg = build_run_config({"model": spec.model_dump(), "lora": {"rank": 4} if lora else None,
                            "parallel": {"dp_shard": 8, "ep": 4}})
    res = dry_run(cfg, 8, ranks=list(range(8)), quiet=True)
    pc = param_counts(spec, cfg.lora)
    base = 2 if lora else 4  # the target is a GPU run: frozen base in bf16
    trainable = pc.lora if lora else pc.total
    assert sum(r["weights"] for r in res["ranks"]) == (pc.total * base + (trainable * 4 if lora else 0))
    assert sum(r["grads"] for r in res["ranks"]) == trainable * 4
    assert sum(r["optimizer"] for r in res["ranks"]) == trainable * 8
    assert res["runtime_over_planner"] == {"weights": 1.0, "grads": 1.0, "optimizer": 1.0}
    assert max(r["weights"] for r in res["ranks"]) == res["ranks"][0]["weights"]  # rank 0 holds the most


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_moments_halve_the_optimizer_bytes(world):
    """train.moment_dtype bf16: the ranks hold 4 bytes of AdamW state a trainable parameter in all, as the planner
    says for rank 0 (one process, and FSDP2's shards, where CopyAdamW steps the local shards)."""
    spec = micro_spec(n_routed_experts=8)
    cfg = build_run_config({"model": spec.model_dump(), "train": {"moment_dtype": "bf16", "weight_dtype": "fp32"},
                            "parallel": {"dp_shard": world}})
    res = dry_run(cfg, world, ranks=list(range(world)), quiet=True)
    assert sum(r["optimizer"] for r in res["ranks"]) == param_counts(spec, None).total * 4
    assert res["runtime_over_planner"]["optimizer"] == 1.0


@pytest.mark.slow
@pytest.mark.parametrize("ep", [64, 128])
def test_hybrid_2p8t_lora_128_ranks_agrees_with_plan(ep):
    cfg = build_run_config({"model": "hybrid-2.8t", "lora": {"rank": 16},
                            "train": {"seq_len": 4096, "micro_batch_size": 1},
                            "parallel": {"dp_shard": 128, "ep": ep, "activation_checkpointing": "full"}})
    t0 = time.process_time()
    res = dry_run(cfg, 128, quiet=True)
    cpu_s = time.process_time() - t0
    plan = Plan(128, 1, 128, 1, ep, "full", 1, 4096)
    mb = memory_breakdown(cfg.model, plan, cfg.lora)  # what `moeadapt plan` prints for this plan
    r0 = res["ranks"][0]
    for k in ("weights", "optimizer"):
        assert abs(r0[k] / mb[k] - 1) < 0.02, (k, r0[k], mb[k])
    assert abs(r0["grads"] / res["planner_rank0"]["grads"] - 1) < 0.02
    assert 40 * 2**30 < r0["weights"] < 43 * 2**30  # 2.82T bf16 / 128 (+ fp32 adapters)
    assert r0["largest_tensor"] < 2**30 and r0["init_block"] <= 64 * 2**20
    assert cpu_s < 60, f"dry run took {cpu_s:.0f} s of CPU"


@pytest.mark.slow
def test_hybrid_2p8t_one_million_tokens_example_agrees_with_plan():
    """examples/hybrid_2p8t_lora_1m.yaml (dp_shard 2 x cp 64, ep 32, 1,048,576 tokens): the dry run's rank-0 bytes
    equal the planner's memory breakdown of that plan within 2%."""
    from pathlib import Path

    from moeadapt.config import load_run_config

    cfg = load_run_config(Path(__file__).resolve().parents[2] / "examples" / "hybrid_2p8t_lora_1m.yaml")
    res = dry_run(cfg, 128, quiet=True)
    mb = memory_breakdown(cfg.model, Plan(128, 1, 2, 64, 32, "full", 1, 1_048_576), cfg.lora)
    r0 = res["ranks"][0]
    for k in ("weights", "optimizer"):
        assert abs(r0[k] / mb[k] - 1) < 0.02, (k, r0[k], mb[k])
    assert all(abs(v - 1) < 0.02 for v in res["runtime_over_planner"].values()), res["runtime_over_planner"]


def test_dry_run_rejects_a_world_that_is_not_the_plan(tmp_path):
    cfg = build_run_config({"model": micro_spec().model_dump(), "parallel": {"dp_shard": 4, "ep": 2}})
    with pytest.raises(ValueError, match=r"--world 8 but the config's parallel section gives .* = 4"):
        dry_run(cfg, 8, quiet=True)
    cfg = build_run_config({"model": micro_spec().model_dump()})
    bad = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"dp_shard": 6, "ep": 3})})
    with pytest.raises(ValueError, match="ep=3 does not divide n_routed_experts=4"):
        dry_run(bad, 6, quiet=True)
    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"model": micro_spec().model_dump()}))
    with pytest.raises(ValueError, match="ep=3 does not divide n_routed_experts=4"):  # the same through the API
        api.dry_run(str(f), {"parallel.dp_shard": 6, "parallel.ep": 3}, quiet=True)


def test_cli_dry_run_prints_each_rank(capsys, tmp_path):
    from moeadapt.cli import main

    f = tmp_path / "run.yaml"
    f.write_text(yaml.safe_dump({"model": micro_spec().model_dump(), "lora": {"rank": 4}}))
    assert main(["finetune", str(f), "--dry-run", "--world", "4", "--ranks", "0,3"]) == 0
    out = capsys.readouterr().out
    assert "dry run: micro LoRA, 4 ranks, FSDP4 EP1" in out and "runtime / planner (rank 0): weights 1.0000" in out


@pytest.mark.parametrize("weights, state", [("bf16", 8), ("fp32_split", 10)])
def test_bf16_weights_halve_the_weight_and_gradient_bytes(weights, state):
    """train.weight_dtype bf16 / fp32_split (one process): the rank holds 2 bytes of weight and 2 of gradient a
    trainable parameter, and 8 of AdamW state (10 with fp32_split's int16 low halves), but for the routers'
    weights (kept fp32: 4 + 4 + 8), as the planner says; under torchrun (world 2) the dry run refuses it as the
    trainer does."""
    spec = micro_spec(n_routed_experts=8)
    cfg = build_run_config({"model": spec.model_dump(), "train": {"weight_dtype": weights}})
    res = dry_run(cfg, 1, quiet=True)
    pc = param_counts(spec, None)
    n = pc.total
    nr = sum(rows * row for rows, row, _, _, whole in pc.tensors if whole)  # the routers' weights
    assert 0 < nr == spec.n_routed_experts * spec.hidden_size * sum(map(spec.is_moe_layer, range(spec.n_layers)))
    r0 = res["ranks"][0]
    assert r0["weights"] == 2 * n + 2 * nr and r0["grads"] == 2 * n + 2 * nr
    assert r0["optimizer"] == state * n - (state - 8) * nr
    assert res["runtime_over_planner"] == {"weights": 1.0, "grads": 1.0, "optimizer": 1.0}
    two = build_run_config({"model": spec.model_dump(), "train": {"weight_dtype": weights},
                            "parallel": {"dp_shard": 2}})
    with pytest.raises(ValueError, match=f"weight_dtype: {weights} runs in one process"):
        dry_run(two, 2, quiet=True)
