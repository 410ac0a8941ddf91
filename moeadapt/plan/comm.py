"""Communication and time model of one step: FSDP all-gather / reduce-scatter bytes, EP all-to-all bytes,
and a step-time estimate from stated bandwidths.

Stated hardware (H200 SXM nodes of 8 GPUs; override with `Hardware(...)`):
  * NVLink 4 inside a node: 450 GB/s per GPU per direction, of which collectives reach ~360 GB/s (80%);
  * InfiniBand NDR between nodes: one 400 Gb/s NIC per GPU = 50 GB/s, ~40 GB/s achieved (80%);
  * a collective whose group spans nodes runs at the inter-node rate (ring / all-to-all bottleneck);
    an all-to-all over ep ranks sends (ep - 8) / ep of its bytes over IB when ep > 8;
  * bf16 dense peak 989 TFLOP/s per GPU at 40% MFU, for the weights' GEMMs (6 N a token, 4 N under LoRA, + 2 N
    under full recompute) and attention's own products (`models.stats.attention_flops_per_token`: DSA in the form its
    kernels take at that length, the indexer's scores once, the delta rule's products), one rate for all:
    measured, the indexer runs at ~90 TFLOP/s at 131k tokens (benchmarks/RESULTS.md), so long-context steps
    take longer than this predicts;
  * FSDP collectives overlap with compute (prefetch): only the part beyond 85% of compute is exposed;
    the EP all-to-all sits on the critical path between router and experts: exposed in full. It moves the
    runtime's fixed [ep, cap, L] buffers (parallel/expert.py: padding included, the same bytes for every
    rank pair whatever the routing), so the routing straggler factor (max/mean rank load, 1.3 by default;
    see `moeadapt simulate-routing`) slows the expert compute, not the all-to-all;
  * context parallelism: DSA layers all-gather the kv latent + RoPE part and the index keys (and reduce-scatter
    their gradient), GQA layers their k/v, KDA layers all-gather each piece's fp32 (final state, transition)
    [H, K, V + K] (backward: [H, K, V]), 2 pieces per rank, 15 us latency per collective; exposed in full.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..config import LoRASpec, ModelSpec
from ..models.stats import attention_flops_per_token
from .memory import Plan, dsa_mha_form, ep_rows_per_token, param_counts


@dataclass(frozen=True)
class Hardware:
    gpus_per_node: int = 8
    nvlink_GBps: float = 360.0
    ib_GBps: float = 40.0
    peak_tflops: float = 989.0
    mfu: float = 0.40
    fsdp_overlap: float = 0.85


DEFAULT_HW = Hardware()


def _bw(group: int, hw: Hardware) -> float:
    return hw.nvlink_GBps if group <= hw.gpus_per_node else hw.ib_GBps


def comm_and_time(spec: ModelSpec, plan: Plan, lora: LoRASpec | None, hw: Hardware = DEFAULT_HW,
                  act_bytes: int = 2, straggler: float = 1.3, grad_accum: int = 1) -> dict:
    pc = param_counts(spec, lora)
    n, ep = plan.shard, plan.ep
    m = max(1, n // ep)  # dp_shard_in_ep
    t = plan.micro_batch * plan.seq_len // plan.cp
    passes = 3 if plan.recompute == "full" else 2  # forward, (recomputed forward), backward all-gathers
    dense = pc.root + sum(pc.block_dense) + sum(pc.lora_dense)
    experts_local = (sum(pc.block_experts) + sum(pc.lora_experts)) / ep
    ag = passes * 2 * (dense * (n - 1) / n + experts_local * (m - 1) / m) if n > 1 else 0.0  # bf16 received
    trainable_dense = sum(pc.lora_dense) if lora else dense
    trainable_exp = sum(pc.lora_experts) / ep if lora else experts_local
    rs = 4 * (trainable_dense * (n - 1) / n + trainable_exp * (m - 1) / m) if n > 1 else 0.0  # fp32 grads
    if plan.dp_replicate > 1:  # HSDP: all-reduce of the sharded grads across replicas
        rs += 2 * 4 * (trainable_dense + trainable_exp) / n * (plan.dp_replicate - 1) / plan.dp_replicate
    n_moe = sum(spec.is_moe_layer(i) for i in range(spec.n_layers))
    L = spec.latent_dim or spec.hidden_size
    a2a_passes = 6 if plan.recompute == "full" else 4  # dispatch + combine, forward (+ recompute) + backward
    rows = ep_rows_per_token(spec, plan) or 0.0  # every chunk's ep * cap rows per local token, padding included
    a2a_layer = t * rows * L * act_bytes * (ep - 1) / ep if ep > 1 else 0.0
    a2a = a2a_passes * n_moe * a2a_layer
    # context parallelism: DSA gathers the kv latent + index keys of the whole sequence, GQA its k/v (ring);
    # KDA all-gathers (S_loc, M) of the 2 pieces per rank (ops/kda/cp.py): small, latency-bound
    cp_bytes, cp_lat = 0.0, 0.0
    if plan.cp > 1:
        s_all = plan.micro_batch * plan.seq_len * (plan.cp - 1) / plan.cp
        for kind in spec.resolved_layer_types():
            if kind == "dsa":
                cp_bytes += passes * s_all * (spec.kv_lora_rank + spec.qk_rope_head_dim + spec.index_head_dim) * act_bytes
            elif kind == "gqa":
                cp_bytes += passes * s_all * 2 * spec.gqa_n_kv_heads * spec.gqa_head_dim * act_bytes
            else:
                K = spec.kda_head_dim
                state = 2 * plan.micro_batch * spec.kda_n_heads * K * 4 * (plan.cp - 1)  # 2 pieces per rank
                cp_bytes += (passes - 1) * state * 2 * K + state * K  # forward(s): [K, V + K]; backward: [K, V]
                cp_lat += passes * 15e-6
    # time per micro-batch
    act = pc.total - sum(pc.block_experts) + sum(pc.block_experts) * spec.n_experts_per_tok / max(1, spec.n_routed_experts)
    flops_per_tok = (4 if lora else 6) * act + (2 if plan.recompute == "full" else 0) * act
    # attention's own products (models/stats.py): DSA in the form its kernels take at this length, every kind
    # forward, backward (2x) and again under full recompute, the indexer once (a recompute keeps its top-k)
    form = "mha_dense" if dsa_mha_form(spec, plan.seq_len, plan.cp, plan.recompute == "selective") else "absorbed"
    attn_flops = attention_flops_per_token(spec, plan.seq_len, dsa_form=form, passes=passes + 1)
    compute_s = t * (flops_per_tok + attn_flops) / (hw.peak_tflops * 1e12 * hw.mfu) * straggler ** 0.5
    fsdp_s = ag / (_bw(n, hw) * 1e9) + rs / (_bw(n, hw) * 1e9) / grad_accum
    if ep > hw.gpus_per_node:
        ib_frac = (ep - hw.gpus_per_node) / ep
        a2a_s = a2a * (ib_frac / (hw.ib_GBps * 1e9) + (1 - ib_frac) / (hw.nvlink_GBps * 1e9))
    else:
        a2a_s = a2a / (hw.nvlink_GBps * 1e9)
    cp_s = cp_bytes / (_bw(plan.cp, hw) * 1e9) + cp_lat
    exposed_fsdp = max(0.0, fsdp_s - hw.fsdp_overlap * compute_s)
    step_s = compute_s + exposed_fsdp + a2a_s + cp_s
    return {"fsdp_allgather_bytes": ag, "fsdp_reduce_scatter_bytes": rs, "a2a_bytes": a2a, "cp_bytes": cp_bytes,
            "cp_s": cp_s,
            "a2a_bytes_per_layer": a2a_layer, "a2a_bytes_per_rank_pair_layer": a2a_layer / max(1, ep - 1),
            "compute_s": compute_s, "fsdp_s": fsdp_s, "a2a_s": a2a_s, "step_s": step_s,
            "tokens_per_s_per_gpu": t / step_s}
