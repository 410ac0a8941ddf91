"""EP dispatcher, forward + backward, on gloo ranks (CPU): how long the host is blocked on all-to-alls per
step at a2a_chunks 1 vs 2, and the step time against expert compute alone.

    python benchmarks/bench_ep_backward.py                       # this checkout, 2 ranks
    python benchmarks/bench_ep_backward.py --repo /path/to/other  # the same on another checkout (before / after)

Per step (median over --steps after --warmup): `step` = dispatch -> experts -> combine forward + backward;
`compute` = the same experts forward + backward on as many rows with no all-to-all; `blocked` = host time
spent waiting on the dispatcher's collectives (counts exchange, forward and backward all-to-alls), summed
from the profiler's `_c10d_functional::wait_tensor` events (functional collectives and their autograd
backward) and `ep_wait` ranges (this checkout's `_Exchange.wait`, wrapped here): the same measure for any
checkout. `host_syncs_per_step`: host reads of device values inside the dispatcher, as it counts them (1 per
layer in the variable-size exchange, 0 in the fixed-capacity one); `sync_ms`: that sync (counts all-to-all +
the copy of the split sizes, older checkouts); `counts_ms`: the fixed-size counts all-to-all (the host waits
for it on gloo; on NCCL it is stream-ordered). Spawns its own ranks (no torchrun).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from pathlib import Path


def _rank(rank: int, world: int, port: int, args) -> None:
    sys.path.insert(0, str(Path(args.repo).resolve()))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world))
    import torch
    import torch.distributed as dist

    from moeadapt.models.moe import GroupedExperts
    from moeadapt.ops.moe import offsets_from_counts
    from moeadapt.parallel.expert import EPDispatcher

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    E, L, F, K, T = args.experts, args.latent, args.ffn, args.topk, args.tokens
    El = E // world
    torch.manual_seed(0)
    experts = GroupedExperts(El, L, F)
    for lin in (experts.w1, experts.w2, experts.w3):
        torch.nn.init.normal_(lin.weight, std=0.02)
    g = torch.Generator().manual_seed(rank)
    z = torch.randn(T, L, generator=g).requires_grad_()
    ids = torch.rand(T, E, generator=g).topk(K, dim=-1).indices  # uniform routing
    w = torch.rand(T, K, generator=g)
    rows = torch.randn(T * K, L, generator=g).requires_grad_()
    offs = offsets_from_counts(torch.full((El,), T * K // El, dtype=torch.int64))
    group = dist.new_group(list(range(world)))

    from moeadapt.parallel import expert as ep_mod

    if hasattr(ep_mod, "_Exchange"):  # this checkout's waits are Work.wait calls: make them profiler ranges
        wait = ep_mod._Exchange.wait

        def ranged(self, key):
            with torch.profiler.record_function("ep_wait"):
                return wait(self, key)

        ep_mod._Exchange.wait = ranged

    def timed(fn) -> tuple[float, float]:
        ts, bs = [], []
        for it in range(args.warmup + args.steps):
            dist.barrier(group)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                t0 = time.perf_counter()
                fn()
                t = time.perf_counter() - t0
            if it >= args.warmup:
                ts.append(t)
                bs.append(sum(e.cpu_time_total for e in prof.key_averages()
                              if e.key in ("_c10d_functional::wait_tensor", "ep_wait")) * 1e-6)
        return sorted(ts)[len(ts) // 2], sorted(bs)[len(bs) // 2]

    n_steps = args.warmup + args.steps
    compute, _ = timed(lambda: experts(rows, offs).sum().backward())
    out = []
    for c in (1, args.chunks):
        timing: dict = {}
        disp = EPDispatcher(group, c, timing=timing)
        step, blocked = timed(lambda d=disp: d(experts, z, ids, w, E, backend="reference").sum().backward())
        syncs = timing.get("syncs", 0)  # recorded by the dispatcher (checkouts that count them)
        out.append({"chunks": c, "step_ms": round(1e3 * step, 1), "compute_ms": round(1e3 * compute, 1),
                    "blocked_ms": round(1e3 * blocked, 1), "rank": rank, "host_syncs_per_step": syncs / n_steps,
                    "sync_ms": round(1e3 * timing["sync_s"] / syncs, 2) if syncs and "sync_s" in timing else None,
                    "counts_ms": round(1e3 * timing["counts_s"] / n_steps, 2) if "counts_s" in timing else None})
    if rank == 0:
        print(json.dumps({"repo": str(Path(args.repo).resolve()), "world": world, "T": T, "K": K, "E": E, "L": L,
                          "F": F}))
    for r in out:
        print(json.dumps(r), flush=True)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repo", default=str(Path(__file__).resolve().parents[1]), help="checkout whose moeadapt runs")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--chunks", type=int, default=2)
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--latent", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    args = p.parse_args()
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_rank, args=(args.world, port, args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
