"""End-to-end training throughput of the `small` preset under FSDP2 (+ EP), activation checkpointing none vs
selective (vs full): tokens/s, MFU and peak memory, printed as a markdown table.

MFU = 6 * (active params per token - embedding lookup) * tokens / time / 790e12 (H200 bf16 dense, measured),
the trainer's definition (attention score FLOPs not counted). Mixed precision: bf16 parameters / fp32
gradient reduction (FSDP2 MixedPrecisionPolicy), fp32 master weights and AdamW states.

Run (one GPU, ~2-3 minutes):
    python benchmarks/bench_train_small.py                      # or: torchrun --nproc_per_node 1 benchmarks/...
Expert parallelism on one multi-GPU host (each rank holds 64/ep experts, FSDP over the rest):
    torchrun --nproc_per_node 4 benchmarks/bench_train_small.py --ep 4 --a2a-chunks 2
All-to-all overlap breakdown of the EP dispatcher alone (works on CPU with gloo too):
    torchrun --nproc_per_node 2 benchmarks/bench_train_small.py --a2a-breakdown
Needs torch >= 2.6 (fully_shard), triton on GPU, and pydantic (moeadapt.config).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from moeadapt.config import ParallelSpec  # noqa: E402
from moeadapt.config.presets import get_preset  # noqa: E402
from moeadapt.models.model import build_model, materialize  # noqa: E402
from moeadapt.models.stats import count_parameters  # noqa: E402
from moeadapt.parallel import build_parallel_dims, clip_grad_norm_, init_distributed, parallelize_model  # noqa: E402

PEAK = 790e12


def _init(device: str) -> torch.device:
    if "RANK" not in os.environ:  # plain `python`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return init_distributed(device)


def _log(*a) -> None:
    if dist.get_rank() == 0:
        print(*a, flush=True)


def bench_train(args, device: torch.device) -> list[dict]:
    world = dist.get_world_size()
    over = {k: json.loads(v) for k, v in (o.split("=", 1) for o in args.override)}
    spec = get_preset(args.preset, **({"n_layers": args.layers} if args.layers else {}), **over)
    counts = count_parameters(build_model(spec, "meta"), spec)
    flops_per_token = 6 * (counts["active_per_token"] - counts["by_component"].get("embeddings", 0))
    base = ParallelSpec(dp_shard=world, ep=args.ep, a2a_chunks=args.a2a_chunks)
    dims = build_parallel_dims(base, spec, device)
    rows = []
    for ac, rm in [(ac, rm) for ac in args.ac.split(",") for rm in (args.router_matmul or "").split(",")]:
        gc.collect()
        torch.cuda.empty_cache() if device.type == "cuda" else None
        spec_rm = spec.model_copy(update={"router_matmul": rm}) if rm else spec
        model = materialize(build_model(spec_rm, "meta"), device, seed=0)  # fp32 master weights
        model.set_backend("auto")
        pdims = dataclasses.replace(dims, spec=base.model_copy(update={"activation_checkpointing": ac}))
        parallelize_model(model, pdims)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=device.type == "cuda")
        g = torch.Generator(device=device).manual_seed(1 + dist.get_rank())
        x = torch.randint(0, spec.vocab_size, (args.micro_batch, args.seq_len + 1), device=device, generator=g)
        inp, lab = x[:, :-1].contiguous(), x[:, 1:].contiguous()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, loss = [], float("nan")
        amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
        for step in range(args.warmup + args.steps):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            with amp:  # as the trainer does on GPU (FSDP already gathers bf16 parameters)
                out = model(inp, lab, return_logits=False)
            (out.loss + out.aux_loss).backward()
            clip_grad_norm_(params, 1.0, pdims)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if step >= args.warmup:
                times.append(time.perf_counter() - t0)
            loss = float(out.loss.detach())
        dt = sorted(times)[len(times) // 2]  # median step
        tok = args.micro_batch * args.seq_len * world
        peak_gib = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan")
        peak_t = torch.tensor([peak_gib], device=device)
        dist.all_reduce(peak_t, op=dist.ReduceOp.MAX)
        row = {"ac": ac, "router_matmul": spec_rm.router_matmul, "world": world, "ep": args.ep, "a2a_chunks": args.a2a_chunks, "seq_len": args.seq_len,
               "micro_batch": args.micro_batch, "layers": spec.n_layers, "step_s": dt, "tokens_per_s": tok / dt,
               "mfu": tok / dt * flops_per_token / PEAK / world, "peak_mem_gib": float(peak_t), "loss": loss}
        _log(json.dumps(row))
        rows.append(row)
        del model, opt, params, out
    _log(f"\n{args.preset} preset{' ' + ' '.join(args.override) if args.override else ''}: {counts['total'] / 1e9:.2f}B params, {counts['active_per_token'] / 1e9:.2f}B active; "
         f"FSDP world {world}, ep {args.ep}, seq {args.seq_len} x micro-batch {args.micro_batch} per rank, bf16 mixed "
         f"precision on GPU (fp32 on CPU), {args.steps} timed steps (median)\n")
    _log("| activation ckpt | router GEMM | tokens/s (all ranks) | MFU | peak memory (GiB, max rank) | step (s) |")
    _log("|---|---|---:|---:|---:|---:|")
    for r in rows:
        _log(f"| {r['ac']} | {r['router_matmul']} | {r['tokens_per_s']:,.0f} | {100 * r['mfu']:.1f}% | "
             f"{r['peak_mem_gib']:.1f} | {r['step_s']:.3f} |")
    return rows


def _timed(fn, device: torch.device, iters: int, warmup: int, group) -> float:
    """Median seconds of fn() over `iters` runs (all ranks start together)."""
    ts = []
    for it in range(warmup + iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if it >= warmup:
            ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def bench_a2a(args, device: torch.device) -> list[dict]:
    """EP dispatch -> experts -> combine alone, forward, a2a_chunks 1 vs N, against its two parts timed apart:
    communication only (identity experts) and expert compute only (the experts on as many rows, no
    all-to-all). Hidden = (comm + compute - chunked total) / comm."""
    from moeadapt.models.moe import GroupedExperts
    from moeadapt.ops.moe import offsets_from_counts
    from moeadapt.parallel.expert import EPDispatcher

    world = dist.get_world_size()
    E, L, F, K, T = args.experts, args.latent, args.ffn, min(8, args.experts), args.tokens
    El = E // world
    torch.manual_seed(0)
    with torch.device(device):
        experts = GroupedExperts(El, L, F)
    for lin in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(lin.weight, std=0.02)
        lin.backend = "auto"
    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    experts.to(dt)
    group = dist.new_group(list(range(world)))
    g = torch.Generator(device=device).manual_seed(dist.get_rank())
    z = torch.randn(T, L, device=device, dtype=dt, generator=g)
    ids = torch.rand(T, E, device=device, generator=g).topk(K, dim=-1).indices  # uniform routing
    w = torch.rand(T, K, device=device, generator=g)
    M = T * K  # rows a rank receives on average under uniform routing
    x_rows = torch.randn(M, L, device=device, dtype=dt, generator=g)
    offs = offsets_from_counts(torch.full((El,), M // El, device=device, dtype=torch.int64))

    def identity(x, offsets):
        return x

    res = {}
    with torch.no_grad():
        res["comm_only"] = _timed(lambda: EPDispatcher(group, 1)(identity, z, ids, w, E), device, args.steps,
                                  args.warmup, group)
        res["compute_only"] = _timed(lambda: experts(x_rows, offs), device, args.steps, args.warmup, group)
        waits = {}
        for c in sorted({1, args.a2a_chunks}):
            timing: dict = {}
            disp = EPDispatcher(group, c, timing=timing)
            res[f"chunks_{c}"] = _timed(lambda d=disp: d(experts, z, ids, w, E), device, args.steps, args.warmup,
                                        group)
            waits[c] = timing.get("wait_s", 0.0) / (args.steps + args.warmup)
    comm, comp = res["comm_only"], res["compute_only"]
    rows = []
    for c in sorted({1, args.a2a_chunks}):
        tot = res[f"chunks_{c}"]
        rows.append({"chunks": c, "fwd_s": tot, "comm_only_s": comm, "compute_only_s": comp, "host_wait_s": waits[c],
                     "hidden_frac": (comm + comp - tot) / comm if comm > 0 else float("nan"), "world": world,
                     "tokens": T, "E": E, "L": L, "F": F, "device": device.type})
        _log(json.dumps(rows[-1]))
    _log(f"\nEP dispatcher alone, forward: {world} ranks ({device.type}), {T} tokens/rank x top-{K}, E={E}, "
         f"latent {L}, ffn {F}; comm only = permute + both all-to-alls + unpermute with identity experts; "
         f"compute only = the local experts on {M} rows; hidden = (comm + compute - total) / comm (GPU);\n"
         f"host wait = time the host blocks on the forward all-to-alls (meaningful with gloo/CPU, ~0 with NCCL)\n")
    _log("| a2a_chunks | total (ms) | comm only (ms) | compute only (ms) | comm hidden | host wait (ms) |")
    _log("|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        _log(f"| {r['chunks']} | {1e3 * r['fwd_s']:.1f} | {1e3 * comm:.1f} | {1e3 * comp:.1f} | "
             f"{100 * r['hidden_frac']:.0f}% | {1e3 * r['host_wait_s']:.1f} |")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--ac", default="none,selective", help="comma list of none | selective | full")
    p.add_argument("--router-matmul", default=None, help="comma list of ModelSpec.router_matmul modes to compare "
                   "(default: the preset's)")
    p.add_argument("--preset", default="small", help="model preset (tiny: quick checks on CPU)")
    p.add_argument("--override", action="append", default=[], metavar="FIELD=JSON",
                   help="ModelSpec field override, e.g. n_routed_experts=256 (repeat for several)")
    p.add_argument("--ep", type=int, default=1)
    p.add_argument("--a2a-chunks", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the preset's 16 (quick checks)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--a2a-breakdown", action="store_true", help="time the EP dispatcher alone (chunks 1 vs N)")
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--latent", type=int, default=1024)
    p.add_argument("--ffn", type=int, default=768)
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--out", default=None, help="append JSON rows here")
    args = p.parse_args()
    device = _init(args.device)
    if args.a2a_breakdown:
        args.a2a_chunks = max(args.a2a_chunks, 4) if args.a2a_chunks == 1 else args.a2a_chunks
        rows = bench_a2a(args, device)
    else:
        rows = bench_train(args, device)
    if args.out and dist.get_rank() == 0:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
