"""The memory / communication model and the plan search, including the hybrid-2.8t reproduction."""

import json

import pytest

from moeadapt.cli import main
from moeadapt.config import LoRASpec, get_preset
from moeadapt.plan import GiB, Plan, evaluate_plan, memory_breakdown, search


@pytest.fixture(scope="module")
def big():
    return get_preset("hybrid-2.8t")


# The stated plan: FSDP over all 128 GPUs (dp_shard 32 x cp 4), EP64, full recompute, seq 4096, micro-batch 1
# (59.9 GiB predicted; with cp 2 it is 63.6 GiB, also under 64).
STATED = Plan(gpus=128, dp_replicate=1, dp_shard=32, cp=4, ep=64, recompute="full", micro_batch=1, seq_len=4096)


def test_2p8t_lora_fsdp_ep64_fits_64GiB(big):
    lora = LoRASpec(rank=16)
    res = search(big, 128, "64GiB", lora, seq_lens=[4096])
    ep64 = [c for c in res.feasible if c.plan.ep == 64 and c.plan.dp_replicate == 1]
    assert ep64, "no FSDP + EP64 plan fits 64 GiB"
    c = evaluate_plan(big, STATED, lora, 64 * GiB)
    assert c.fits, c.why
    m = c.memory
    assert 2.7e12 < m["params_total"] < 2.9e12 and 15e9 < m["params_trainable"] < 30e9
    assert 40 * GiB < m["weights"] < 43 * GiB  # 2.82T bf16 / 128
    print(STATED.label(), {k: round(v / GiB, 2) for k, v in m.items() if isinstance(v, float)})


def test_2p8t_lora_fails_at_32GiB_because_of_the_weights(big):
    res = search(big, 128, "32GiB", LoRASpec(rank=16), seq_lens=[4096])
    assert not res.feasible
    smallest = res.rejected[0]
    assert smallest.memory["weights"] > 32 * GiB  # the bf16 base alone, sharded 128 ways, exceeds the budget
    assert "largest term weights" in smallest.why and "nothing fits" in res.notes[0]


def test_full_training_of_2p8t_needs_more_than_141GiB_on_128_gpus(big):
    assert not search(big, 128, "141GiB", None, seq_lens=[4096], micro_batches=[1]).feasible


def test_terms_move_the_right_way(big):
    lora = LoRASpec(rank=16)
    base = dict(gpus=128, dp_replicate=1, dp_shard=128, cp=1, ep=64, micro_batch=1, seq_len=4096)
    acts = {rc: memory_breakdown(big, Plan(recompute=rc, **base), lora)["activations"]
            for rc in ("none", "selective", "full")}
    assert acts["none"] > acts["selective"] > acts["full"]
    m1 = memory_breakdown(big, Plan(recompute="none", **base), lora)
    m2 = memory_breakdown(big, Plan(recompute="none", **{**base, "micro_batch": 2}), lora)
    assert m2["activations"] == pytest.approx(2 * m1["activations"])
    ep8 = memory_breakdown(big, Plan(recompute="full", **{**base, "ep": 8}), lora)
    assert ep8["fsdp_gather"] > m1["fsdp_gather"]  # fewer EP ranks -> bigger expert all-gathers
    full = memory_breakdown(big, Plan(recompute="full", **base), None)
    assert full["optimizer"] > 100 * m1["optimizer"]


def test_cli_plan_json(capsys):
    assert main(["plan", "--model", "small", "--gpus", "8", "--gpu-mem", "80GiB", "--lora", "--seq-len", "4096",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["feasible"] and out["feasible"][0]["fits"] and out["feasible"][0]["breakdown_GiB"]["weights"] > 0


def test_2p8t_lora_runnable_plan_without_cp():
    """The plan parallel/ can launch today (cp=1): FSDP over 128 ranks + EP64 fits 64 GiB at seq 2048, mb 1."""
    from moeadapt import api

    out = api.plan("hybrid-2.8t", 128, "64GiB", lora=True, seq_len=2048, micro_batch=1, top=50, quiet=True)
    names = [r["plan"] if "plan" in r else r["name"] for r in out["feasible"]]
    assert any("EP64" in n and "cp" not in n for n in names), names
    assert api.plan("hybrid-2.8t", 128, "32GiB", lora=True, seq_len=2048, micro_batch=1, quiet=True)["n_feasible"] == 0


def test_dsa_backward_workspace_in_the_planner(monkeypatch):
    """The P / dS buffer of the Triton sparse-attention backward: the dense pass 2's [B, Tk, T, HQ] x 2 at <= 32
    heads within 2 GiB, else one slot chunk; the planner adds it to each DSA layer's backward phase only."""
    from moeadapt.ops.dsa import triton_sparse_attn as tsa
    from moeadapt.plan import memory as mem

    assert tsa.backward_workspace_bytes(2, 4096, 4096, 16, 2048) == 2 * 2 * 4096 * 4096 * 16 * 2  # dense, 2 GiB
    assert tsa.backward_workspace_bytes(2, 4100, 4100, 16, 2048) == min(8200, 2**30 // (16 * 2048 * 4)) * 16 * 2048 * 4
    assert tsa.backward_workspace_bytes(2, 4096, 4096, 64, 2048) == 2**30  # 64 heads: the slot chunk (1 GiB)
    assert tsa.backward_workspace_bytes(1, 40, 40, 4, 24, 4) == 2 * 64 * 40 * 4 * 4  # keys padded to 64, queries to 8
    p1t = {**tsa.BWD_CONFIG, "DENSE": {**tsa.DENSE_PDS_CONFIG, "P1_TILES": {"BLOCK_M": 64}}}  # + the selection mask
    assert tsa.backward_workspace_bytes(2, 4096, 4096, 16, 2048, cfg=p1t) == 2 * 2 * 4096 * 4096 * 16 * 2 + 2 * 4096 * 4104
    from moeadapt.ops.dsa import flex_attn

    monkeypatch.setitem(flex_attn.FLEX_CONFIG, "MHA_FORM", False)  # the absorbed form (the MHA form has no P / dS)
    spec = get_preset("small")
    plan = Plan(gpus=1, dp_replicate=1, dp_shard=1, cp=1, ep=1, recompute="none", micro_batch=2, seq_len=4096)
    types = spec.resolved_layer_types()
    ws = mem._dsa_backward_workspace(spec, plan, 2, "kernel")
    assert [w > 0 for w in ws] == [k == "dsa" for k in types] and max(ws) == 2**31
    monkeypatch.setattr(tsa, "backward_workspace_bytes", lambda *a, **k: 10 * 2**40)
    huge = memory_breakdown(spec, plan, LoRASpec(rank=16))
    assert huge["peak_phase"].startswith("backward") and types[int(huge["peak_phase"].split()[1])] == "dsa"
    assert mem._dsa_backward_workspace(spec, plan, 2, "reference") == [0.0] * spec.n_layers


def test_dsa_mha_form_in_the_plan(monkeypatch):
    """Where the DSA layer takes the MHA form (FLEX_CONFIG["MHA_FORM"], cp = 1, no selective recompute) the planner
    drops the P / dS backward buffer and counts FlexAttention's saved set instead of the absorbed form's."""
    from moeadapt.ops.dsa import flex_attn as fa
    from moeadapt.plan import memory as mem

    spec = get_preset("small")
    dsa = spec.resolved_layer_types().index("dsa")

    def plan(recompute="none", cp=1, seq=4096):
        return Plan(gpus=cp, dp_replicate=1, dp_shard=1, cp=cp, ep=1, recompute=recompute, micro_batch=2, seq_len=seq)

    def layer(recompute="none", seq=4096):
        return mem.layer_activation_bytes(spec, dsa, 2 * seq, seq, recompute, 2)

    monkeypatch.setitem(fa.FLEX_CONFIG, "MHA_FORM", False)
    absorbed = (max(mem._dsa_backward_workspace(spec, plan(), 2, "kernel")), layer(), layer("selective"))
    monkeypatch.setitem(fa.FLEX_CONFIG, "MHA_FORM", True)
    assert max(mem._dsa_backward_workspace(spec, plan(), 2, "kernel")) == 0
    assert max(mem._dsa_backward_workspace(spec, plan("selective"), 2, "kernel")) == absorbed[0]
    assert max(mem._dsa_backward_workspace(spec, plan(cp=2), 2, "kernel")) > 0
    assert max(mem._dsa_backward_workspace(spec, plan(seq=65536), 2, "kernel")) > 0  # sparse: absorbed
    # per token: q, k [16 x 192], wkv_b's output [16 x 256] (bf16), lse (fp32), the selection mask (seq bytes)
    # against the absorbed form's q / q_full / o_lat chain
    mha = layer()
    assert mha != absorbed[1] and layer("selective") == absorbed[2]
    n, r, vd, H = spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.v_head_dim, spec.n_heads
    dsa_items = dict((name, b) for name, b, _ in mem._layer_acc(spec, dsa, 4096, "kernel", 2, True, frozenset(), 0,
                                                                 8192).items)
    assert dsa_items["q, k (flex inputs), wkv_b out (v)"] == (2 * H * (n + r) + H * (n + vd)) * 2
    assert dsa_items["selection mask"] == 4096 and "q_full (attention input)" not in dsa_items


def test_bf16_moments_halve_the_optimizer_term():
    """train.moment_dtype bf16 (Plan.moment_bytes = 2): AdamW's two moments take 4 bytes a trainable parameter,
    the other terms unchanged."""
    small = get_preset("small")
    base = dict(gpus=1, dp_replicate=1, dp_shard=1, cp=1, ep=1, recompute="none", micro_batch=2, seq_len=4096)
    fp32, bf16 = (memory_breakdown(small, Plan(**base, moment_bytes=b), None) for b in (4, 2))
    assert fp32["optimizer"] == pytest.approx(8 * fp32["params_trainable"], rel=1e-6)
    assert bf16["optimizer"] == pytest.approx(fp32["optimizer"] / 2, rel=1e-9)
    assert bf16["weights"] == fp32["weights"] and bf16["grads"] == fp32["grads"]


def test_bf16_weights_halve_weights_and_gradients_and_drop_the_copies():
    """train.weight_dtype bf16 (Plan.weight_bytes = 2, one GPU): weights and gradients 2 bytes a trainable
    parameter but the routers' weights (kept fp32), no bf16 compute copies, and the residual stream bf16 (the
    embedding's dtype), so the activations shrink too; the optimizer term unchanged."""
    from moeadapt.plan.memory import param_counts

    small = get_preset("small")
    base = dict(gpus=1, dp_replicate=1, dp_shard=1, cp=1, ep=1, recompute="none", micro_batch=2, seq_len=4096)
    fp32, bf16 = (memory_breakdown(small, Plan(**base, weight_bytes=b), None) for b in (4, 2))
    n = fp32["params_trainable"]
    nr = sum(rows * row for rows, row, _, _, whole in param_counts(small, None).tensors if whole)
    assert 0 < nr < n / 1000
    assert fp32["weights"] == pytest.approx(4 * n, rel=1e-6)
    assert bf16["weights"] == pytest.approx(2 * n + 2 * nr, rel=1e-6)
    assert bf16["grads"] == pytest.approx(fp32["grads"] / 2, rel=1e-9)
    assert bf16["optimizer"] == fp32["optimizer"]
    assert bf16["activations"] < fp32["activations"]
    assert bf16["total"] < fp32["total"] - 4 * n


def test_one_gpu_full_fine_tuning_plans_the_split_default():
    """The search plans one GPU's full fine-tuning as the trainer runs it by default (train.weight_dtype auto ->
    fp32_split: 2-byte weights and gradients, the 2-byte low halves in the optimizer term, no copies; the routers'
    weights whole in fp32); LoRA and several GPUs keep fp32 weights."""
    from moeadapt.plan.memory import param_counts

    small = get_preset("small")
    kw = dict(seq_lens=[4096], micro_batches=[2], recomputes=("none",), cps=(1,))
    one = search(small, 1, "141GiB", **kw)
    c = (one.feasible or one.rejected)[0]
    assert (c.plan.weight_bytes, c.plan.lo_bytes) == (2, 2)
    n = c.memory["params_trainable"]
    nr = sum(rows * row for rows, row, _, _, whole in param_counts(small, None).tensors if whole)  # routers: no low
    assert c.memory["optimizer"] == pytest.approx(10 * n - 2 * nr, rel=1e-6)  # half (kept fp32)
    two = search(small, 2, "141GiB", **kw)
    assert all((x.plan.weight_bytes, x.plan.lo_bytes) == (4, 0) for x in two.feasible + two.rejected)
    lora = search(small, 1, "141GiB", lora=LoRASpec(rank=16), **kw)
    assert all((x.plan.weight_bytes, x.plan.lo_bytes) == (4, 0) for x in lora.feasible + lora.rejected)
