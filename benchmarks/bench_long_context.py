"""Long-context training on one GPU and the context-parallel exchange's local cost, printed as markdown tables.

1. `small` preset, LoRA (rank 16, frozen bf16 base), full recompute (optionally with the block inputs offloaded
   to host memory, parallel.offload_activations), micro-batch 1: tokens/s and peak memory at each sequence
   length from 16k doubling up to --max-len; a length that runs out of memory ends the sweep (recorded as OOM).
2. At cp = 1 (one GPU, no communication: the local work the multi-GPU run adds), per layer, forward + backward:
   KDA  chunk_kda_cp (local (state, transition) pass + fold + rerun from the folded state) against chunk_kda,
        and the fold alone;
   DSA  dsa_attention_cp (key-side gather + indexer over the gathered keys + sparse attention) against the
        single-rank indexer + sparse attention, and the gather alone.

Run (one H200, a few minutes):
    python benchmarks/bench_long_context.py                              # 16k -> 512k, both parts
    python benchmarks/bench_long_context.py --offload --max-len 1048576  # block inputs in host memory
    python benchmarks/bench_long_context.py --part exchange --T 32768 131072
Quick check of the script on CPU: python benchmarks/bench_long_context.py --device cpu --preset tiny
    --lengths 256 512 --T 256 --steps 1 --warmup 0
"""

from __future__ import annotations

import argparse
import contextlib
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
from moeadapt.config import LoRASpec, ParallelSpec  # noqa: E402
from moeadapt.config.presets import get_preset  # noqa: E402
from moeadapt.lora import cast_frozen_, inject_lora  # noqa: E402
from moeadapt.models.model import build_model, materialize  # noqa: E402
from moeadapt.ops.cp_comm import CPLayout  # noqa: E402


def _init(device: str) -> torch.device:
    if "RANK" not in os.environ:  # plain `python`: a world of one
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    from moeadapt.parallel import init_distributed

    return init_distributed(device)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _median_s(fn, device: torch.device, iters: int, warmup: int) -> float:
    ts = []
    for i in range(warmup + iters):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        if i >= warmup:
            ts.append(time.perf_counter() - t0)
    return sorted(ts)[len(ts) // 2]


def _one_length(T: int, spec, dims, args, device: torch.device) -> dict:
    """One training configuration at sequence length T: median step time and peak memory (or OOM)."""
    from moeadapt.parallel import parallelize_model

    amp = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    row = {"part": "length", "preset": spec.name, "seq_len": T, "offload": args.offload, "lora_rank": 16}
    try:
        model = materialize(build_model(spec, "meta"), device, seed=0)
        inject_lora(model, LoRASpec(rank=16))
        if device.type == "cuda":
            cast_frozen_(model, torch.bfloat16)
        model.set_backend("auto")
        parallelize_model(model, dims)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=1e-4)
        g = torch.Generator(device=device).manual_seed(0)
        x = torch.randint(0, spec.vocab_size, (1, T + 1), device=device, generator=g)
        inp, lab = x[:, :-1].contiguous(), x[:, 1:].contiguous()

        def step():
            with amp:
                out = model(inp, lab, return_logits=False)
            (out.loss + out.aux_loss).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        dt = _median_s(step, device, args.steps, args.warmup)
        row.update(step_s=dt, tokens_per_s=T / dt)
        if device.type == "cuda":
            row["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        if args.profile:  # one more step under the profiler: CUDA time by kernel family (profile_step.py's)
            sys.path.insert(0, str(Path(__file__).resolve().parent))
            from profile_step import _triton_families, profile_one

            prof = profile_one(step, device, _triton_families())
            keep = ("families_ms", "total_ms", "top_kernels_ms", "top_ops_ms", "host_ms")
            row["profile"] = {k: prof[k] for k in keep}
    except torch.OutOfMemoryError:
        row["oom"] = True
    return row


def bench_lengths(args, device: torch.device) -> list[dict]:
    from moeadapt.parallel import build_parallel_dims

    spec = get_preset(args.preset, max_position_embeddings=max(args.lengths))
    pspec = ParallelSpec(activation_checkpointing="full", offload_activations=args.offload)
    dims = build_parallel_dims(pspec, spec, device)
    rows = []
    for T in args.lengths:
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        row = _one_length(T, spec, dims, args, device)
        print(json.dumps(row), flush=True)
        rows.append(row)
        if row.get("oom"):
            break
    print(f"\n{spec.name} preset, LoRA r16 (frozen bf16 base), full recompute"
          f"{' + block inputs offloaded to host' if args.offload else ''}, micro-batch 1, one GPU, "
          f"median of {args.steps} steps\n")
    print("| seq len | tokens/s | peak memory (GiB) | step (s) |")
    print("|---:|---:|---:|---:|")
    for r in rows:
        if r.get("oom"):
            print(f"| {r['seq_len']:,} | OOM | | |")
        else:
            print(f"| {r['seq_len']:,} | {r['tokens_per_s']:,.0f} | {r.get('peak_mem_gib', float('nan')):.1f} | "
                  f"{r['step_s']:.2f} |")
    return rows


def _fwd_bwd(fn, inputs):
    def run():
        out = fn()
        torch.autograd.grad(out.float().sum(), inputs)
    return run


def _exchange_one(T: int, spec, args, device: torch.device) -> dict:
    """Per-layer forward + backward times at cp = 1 for sequence length T (see the module docstring)."""
    from moeadapt.ops.dsa import lightning_indexer, sparse_attention
    from moeadapt.ops.dsa.cp import dsa_attention_cp, gather_sequence
    from moeadapt.ops.kda import chunk_kda
    from moeadapt.ops.kda.cp import _FoldStates, chunk_kda_cp

    dt = torch.bfloat16 if device.type == "cuda" else torch.float32
    layout = CPLayout(None, 0, 1)  # cp = 1, causally balanced: 2 pieces, the fold runs, nothing is sent
    H, K = spec.kda_n_heads, spec.kda_head_dim
    kvl, r, HQ, HI, DI = spec.kv_lora_rank, spec.qk_rope_head_dim, spec.n_heads, spec.index_n_heads, spec.index_head_dim
    topk = spec.index_topk
    g = torch.Generator(device=device).manual_seed(0)

    def rnd(*s, dtype=dt):
        return torch.randn(*s, device=device, generator=g, dtype=dtype).requires_grad_(True)

    def timed(fn, inputs):
        return _median_s(_fwd_bwd(fn, inputs), device, args.steps, args.warmup)

    q, k, v, gr = rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K), rnd(1, T, H, K)
    beta = rnd(1, T, H, dtype=torch.float32)
    opts = dict(use_qk_l2norm=True, A_log=torch.zeros(H, device=device), dt_bias=torch.zeros(H * K, device=device),
                beta_is_logits=True)
    kin = [q, k, v, gr, beta]
    S, M = rnd(2, 1, H, K, K, dtype=torch.float32), rnd(2, 1, H, K, K, dtype=torch.float32)
    qf, kv = rnd(1, T, HQ, kvl + r), rnd(1, T, 1, kvl + r)
    q_idx, k_idx, w_idx = rnd(1, T, HI, DI), rnd(1, T, DI), rnd(1, T, HI)
    keys = rnd(1, T, kvl + r + DI)

    def dsa_single():
        with torch.no_grad():
            idx = lightning_indexer(q_idx, k_idx, w_idx, topk)
        return sparse_attention(qf, kv, kv[..., :kvl], idx)

    return {"part": "exchange", "T": T, "device": device.type,
            "kda_s": timed(lambda: chunk_kda(q, k, v, gr, beta, **opts)[0], kin),
            "kda_cp_s": timed(lambda: chunk_kda_cp(q, k, v, gr, beta, layout, **opts), kin),
            "kda_fold_s": timed(lambda: _FoldStates.apply(S, M, layout, (True, False)), [S, M]),
            "dsa_s": timed(dsa_single, [qf, kv]),
            "dsa_cp_s": timed(lambda: dsa_attention_cp(qf, kv, q_idx, k_idx, w_idx, topk, layout, kvl)[0], [qf, kv]),
            "dsa_gather_s": timed(lambda: gather_sequence(keys, layout), [keys])}


def bench_exchange(args, device: torch.device) -> list[dict]:
    spec = get_preset(args.preset)
    rows = []
    for T in args.T:
        rows.append(_exchange_one(T, spec, args, device))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\nper layer at cp = 1 ({spec.name} shapes: KDA {spec.kda_n_heads} x {spec.kda_head_dim}, DSA "
          f"{spec.n_heads} heads, kv {spec.kv_lora_rank}+{spec.qk_rope_head_dim}, index {spec.index_n_heads} x "
          f"{spec.index_head_dim}, top-{spec.index_topk}), forward + backward, median of {args.steps}\n")
    print("| T | KDA (ms) | KDA cp path (ms) | fold alone (ms) | DSA (ms) | DSA cp path (ms) | key gather alone (ms) |")
    print("|---:|---:|---:|---:|---:|---:|---:|")
    for x in rows:
        print(f"| {x['T']:,} | {1e3 * x['kda_s']:.2f} | {1e3 * x['kda_cp_s']:.2f} | {1e3 * x['kda_fold_s']:.3f} | "
              f"{1e3 * x['dsa_s']:.2f} | {1e3 * x['dsa_cp_s']:.2f} | {1e3 * x['dsa_gather_s']:.3f} |")
    return rows


def plot_profiles(files: list[str], labels: list[str], path: str) -> None:
    """Stacked CUDA time by kernel family of the profiled rows (--profile) of each --out file, one bar per file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    profs = []
    for f in files:
        rows = [json.loads(line) for line in open(f) if line.strip()]
        profs.append(next(r for r in rows if "profile" in r))
    fams = sorted({k for r in profs for k in r["profile"]["families_ms"]},
                  key=lambda k: -max(r["profile"]["families_ms"].get(k, 0) for r in profs))
    fig, ax = plt.subplots(figsize=(8.5, 4.5))
    bottom = [0.0] * len(profs)
    for fam in fams[:8] + ["the rest"]:
        ms = [(r["profile"]["families_ms"].get(fam, 0) if fam != "the rest" else
               sum(v for k, v in r["profile"]["families_ms"].items() if k not in fams[:8])) / 1e3 for r in profs]
        ax.bar(labels, ms, bottom=bottom, label=fam)
        bottom = [b + m for b, m in zip(bottom, ms)]
    for i, r in enumerate(profs):
        ax.text(i, bottom[i], f"{r['step_s']:.2f} s/step\n{r['tokens_per_s']:,.0f} tok/s", ha="center", va="bottom")
    ax.set_ylabel("CUDA time per step (s)")
    ax.set_ylim(0, max(bottom) * 1.2)
    ax.set_title(f"{profs[0]['preset']} + LoRA r16, {profs[0]['seq_len']:,} tokens, full recompute, one GPU")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="auto")
    p.add_argument("--preset", default="small")
    p.add_argument("--part", default="all", choices=("all", "lengths", "exchange"))
    p.add_argument("--lengths", type=int, nargs="+", default=None, help="sequence lengths (default 16k doubling)")
    p.add_argument("--max-len", type=int, default=524288)
    p.add_argument("--offload", action="store_true", help="parallel.offload_activations (block inputs on host)")
    p.add_argument("--T", type=int, nargs="+", default=[32768], help="sequence lengths of the exchange part")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--out", default=None, help="append JSON rows here")
    p.add_argument("--profile", action="store_true", help="profile one more step per length: CUDA time by kernel "
                   "family and the top kernels, in the row")
    p.add_argument("--plot", default=None, help="with --plot-from: write the plot of their profiled rows here, exit")
    p.add_argument("--plot-from", nargs="+", default=None, help="--out files of --profile runs, one bar each")
    p.add_argument("--labels", nargs="+", default=None, help="bar labels for --plot-from")
    args = p.parse_args()
    if args.plot:
        plot_profiles(args.plot_from, args.labels or args.plot_from, args.plot)
        return
    if args.lengths is None:
        args.lengths = [16384 << i for i in range(8) if 16384 << i <= args.max_len]
    device = _init(args.device)
    rows = []
    if args.part in ("all", "lengths"):
        rows += bench_lengths(args, device)
    if args.part in ("all", "exchange"):
        rows += bench_exchange(args, device)
    if args.out:
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps(r) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
