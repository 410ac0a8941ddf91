"""The planner under context parallelism: activations / cp, the gathered key-side and state buffers, the
exchange volume, the 1M-token 2.8T plan, and one clear error for a cp that does not fit."""

from __future__ import annotations

import pytest

from moeadapt.cli import main
from moeadapt.config import LoRASpec
from moeadapt.config.presets import get_preset
from moeadapt.plan.comm import comm_and_time
from moeadapt.plan.memory import GiB, Plan, memory_breakdown


@pytest.fixture(scope="module")
def big():
    return get_preset("hybrid-2.8t")


def test_cp_divides_activations_and_adds_its_buffers(big):
    lora = LoRASpec(rank=16)
    base = dict(gpus=128, dp_replicate=1, ep=64, recompute="full", micro_batch=1, seq_len=262144)
    m1 = memory_breakdown(big, Plan(dp_shard=128, cp=1, **base), lora)
    m4 = memory_breakdown(big, Plan(dp_shard=32, cp=4, **base), lora)
    assert m1["cp_buffers"] == 0 and m4["cp_buffers"] > 0
    # cp = 1 also keeps the top-k selections for the recompute (cp > 1 selects inside the cp path, keeping none)
    from moeadapt.plan.memory import kept_selections

    sel = kept_selections(big, Plan(dp_shard=128, cp=1, **base), 262144)
    assert sel == 16 * 262144 * 2048 * 4  # 16 DSA layers with an indexer, int32
    assert m4["activations"] == pytest.approx((m1["activations"] - sel) / 4)
    assert m4["tokens_per_gpu"] == 262144 // 4
    # the gathered key side of the whole sequence (kv latent 512 + rope 64 + index key 128, bf16) + fp32 grad
    assert m4["cp_buffers"] >= 262144 * (512 + 64 + 128) * (2 + 4)
    c1 = comm_and_time(big, Plan(dp_shard=128, cp=1, **base), lora)
    c4 = comm_and_time(big, Plan(dp_shard=32, cp=4, **base), lora)
    assert c1["cp_bytes"] == 0 and c4["cp_bytes"] > 0 and c4["cp_s"] > 0


def test_2p8t_lora_at_1m_tokens_fits_141GB_on_128_gpus():
    from moeadapt import api

    out = api.plan("hybrid-2.8t", 128, "141GB", lora=True, seq_len=1048576, micro_batch=1, top=3, quiet=True,
                   cps=(16, 32, 64))
    assert out["n_feasible"], out["smallest_rejected"][:1]
    best = out["feasible"][0]
    assert best["cp"] * best["dp_shard"] * best["dp_replicate"] == 128 and best["cp"] > 1
    assert best["mem_GiB"] < 141e9 / GiB and best["breakdown_GiB"]["cp_buffers"] > 0
    assert api.plan("hybrid-2.8t", 64, "141GB", lora=True, seq_len=1048576, micro_batch=1, quiet=True,
                    cps=(16, 32, 64))["n_feasible"] == 0


def test_cp_errors_name_the_numbers(capsys):
    from moeadapt import api

    with pytest.raises(ValueError, match=r"cp=3 does not divide --gpus 8.*choose cp in \{1, 2, 4, 8\}"):
        api.plan("small", 8, "80GiB", cps=(1, 3), quiet=True)
    with pytest.raises(ValueError, match=r"seq_len=1000 does not split over cp=8 into 16 equal pieces.*992 or 1008"):
        api.plan("small", 8, "80GiB", seq_len=1000, cps=(8,), quiet=True)
    assert main(["plan", "--model", "small", "--gpus", "8", "--seq-len", "1000", "--cp", "8"]) != 0
    err = capsys.readouterr()
    assert "does not split over cp=8" in err.out + err.err and "Traceback" not in err.out + err.err


def test_offload_leaves_no_block_input_on_the_gpu():
    small = get_preset("small", max_position_embeddings=262144)
    base = dict(gpus=1, dp_replicate=1, dp_shard=1, cp=1, ep=1, recompute="full", micro_batch=1, seq_len=262144)
    on, off = (memory_breakdown(small, Plan(offload=o, **base), LoRASpec(rank=16)) for o in (True, False))
    from moeadapt.plan.memory import kept_selections

    sel = kept_selections(small, Plan(**base), 262144)  # the top-k selections stay on the GPU: 4 DSA layers
    assert sel == 4 * 262144 * 2048 * 4
    assert off["activations"] >= 262144 * small.hidden_size * 2 * small.n_layers + sel and on["activations"] == sel
    assert on["total"] < off["total"] and "+offload" in Plan(offload=True, **base).label()



def test_the_time_model_counts_the_indexer_once_and_the_rest_of_attention_per_pass():
    """The step-time model's attention (models.stats.attention_flops), on hardware of 1 TFLOP/s at 100%: at 131k
    tokens, sharing three of `small`'s four indexers (index_shared_layers) takes exactly their scores' FLOPs (and
    their weights' 6 N) off the compute time; a full recompute runs attention's forward again but not the indexer
    (its top-k is kept), so with or without them it adds the same but for those weights' forward."""
    from moeadapt.models.stats import attention_flops
    from moeadapt.plan.comm import Hardware
    from moeadapt.plan.memory import param_counts

    T = 131072
    own, shared = get_preset("small"), get_preset("small", index_shared_layers=[7, 11, 15])

    def flops_per_token(spec, recompute):
        plan = Plan(gpus=1, dp_replicate=1, dp_shard=1, cp=1, ep=1, recompute=recompute, micro_batch=1, seq_len=T)
        return comm_and_time(spec, plan, None, hw=Hardware(peak_tflops=1.0, mfu=1.0), straggler=1.0)["compute_s"] \
            * 1e12 / T

    indexer = attention_flops(own, T)["indexer"]
    weights = param_counts(own, None).total - param_counts(shared, None).total  # the shared layers' indexer weights
    assert flops_per_token(own, "none") - flops_per_token(shared, "none") == pytest.approx(indexer * 3 / 4 + 6 * weights)
    recompute = [flops_per_token(spec, "full") - flops_per_token(spec, "none") for spec in (own, shared)]
    assert recompute[0] - recompute[1] == pytest.approx(2 * weights)  # the weights' forward again, no indexer
    assert indexer > 0.1 * flops_per_token(own, "none")  # at 131k the indexer is a large share of the step
