"""Sharded loading of a big checkpoint: time to the first training step and peak host memory per rank.

Each rank builds the model on meta, applies LoRA and FSDP2 (+ EP) on meta, allocates only its shards
(`to_empty`), fills them from the checkpoint reading only its boxes (`moeadapt.parallel.sharded_io.load_sharded`),
then takes one LoRA training step. Per rank it reports: seconds from process start to the end of the load and
to the end of the first step, checkpoint bytes read, its shard bytes, the peak resident memory (VmHWM) after
the load and after the step, and the load's transient peak (VmHWM during the load above the resident set before
it, minus the shard bytes the load fills), against the largest single box it read.

CPU (gloo ranks spawned here, a random Hugging Face qwen3_moe checkpoint made first, bf16 on disk):
    python benchmarks/bench_load.py --make /tmp/ckpt --layers 8 --experts 32        # ~2.8 GB
    python benchmarks/bench_load.py --ckpt /tmp/ckpt --worlds 1 2 4
GPU (`small` preset, a random checkpoint in our format made on the machine; NCCL, one rank per GPU):
    python benchmarks/bench_load.py --gpu --make /tmp/small-ckpt                     # then:
    torchrun --nproc_per_node 1 benchmarks/bench_load.py --gpu --ckpt /tmp/small-ckpt
  (also reports peak GPU memory before the first step; the first step includes Triton compilation.)
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install


def _since_process_start() -> float:
    """Seconds since this process was started (Linux /proc), so 'time to first step' includes imports."""
    ticks = os.sysconf("SC_CLK_TCK")
    start = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
    return float(Path("/proc/uptime").read_text().split()[0]) - start


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := current VmRSS


# -- making a random checkpoint ------------------------------------------------------------------------------
def qwen3_config(layers: int, experts: int, hidden: int = 2048, moe_ffn: int = 768, vocab: int = 32000) -> dict:
    import transformers

    cfg = transformers.Qwen3MoeConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
        num_attention_heads=16, num_key_value_heads=4, head_dim=128, moe_intermediate_size=moe_ffn,
        num_experts=experts, num_experts_per_tok=4, max_position_embeddings=4096, tie_word_embeddings=False)
    d = cfg.to_dict()
    d["architectures"] = ["Qwen3MoeForCausalLM"]
    return d


def make_checkpoint(out: Path, cfg: dict, max_shard_bytes: int, dtype: torch.dtype = torch.bfloat16,
                    seed: int = 0) -> dict:
    """Random weights (std 0.02, norms 1) for every tensor the family's name map reads, written tensor by tensor
    in row blocks of <= 64 MB into safetensors shards: never more than one block in memory. The values are
    windows at random offsets into one 64 MB pool of normal samples (drawing fresh ones for GBs is slow)."""
    from moeadapt.io import atomic_dir, plan_shard_files, write_region, write_shard_headers, write_shard_index
    from moeadapt.onboard import build_rules, read_family

    fam = read_family(cfg)
    names: dict[str, tuple[int, ...]] = {}
    for r in build_rules(fam):
        if r.absent_ok:
            continue
        for s in r.sources:
            names.setdefault(s, tuple(r.shape[1:] if r.stacked else r.shape))
    meta = {n: (s, torch.float32 if n.endswith(("expert_bias", "e_score_correction_bias")) else dtype)
            for n, s in names.items()}
    files = plan_shard_files([(n, *meta[n]) for n in names], max_shard_bytes)
    g = torch.Generator().manual_seed(seed)
    pool = torch.randn(16 * 2**20, generator=g) * 0.02
    with atomic_dir(out) as tmp:
        where = write_shard_headers(tmp, files, meta)
        fds = {f: os.open(tmp / f, os.O_WRONLY) for f in files}
        for n, (shape, dt) in meta.items():
            f, start = where[n]
            row = max(1, int(torch.Size(shape[1:]).numel()) * 4)
            step = max(1, 64 * 2**20 // row)  # rows per block
            for a in range(0, shape[0], step):
                b = min(shape[0], a + step)
                if "norm" in n:
                    blk = torch.ones((b - a, *shape[1:]))
                elif "bias" in n:
                    blk = torch.zeros((b - a, *shape[1:]))
                else:
                    n_el = (b - a) * row // 4
                    o = int(torch.randint(0, pool.numel() - n_el + 1, (1,), generator=g))
                    blk = pool[o:o + n_el].view(b - a, *shape[1:])
                write_region(fds[f], start, shape, (a, *([0] * (len(shape) - 1))), blk.to(dt))
        for fd in fds.values():
            os.fsync(fd)
            os.close(fd)
        write_shard_index(tmp, files, meta)
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    total = sum(torch.Size(s).numel() * torch.empty((), dtype=dt).element_size() for s, dt in meta.values())
    return {"path": str(out), "bytes": total, "files": len(files), "tensors": len(meta)}


# -- one rank ------------------------------------------------------------------------------------------------
def run_rank(ckpt: Path, device: str, ep: int, seq: int, out_dir: Path | None) -> dict:
    import torch.distributed as dist

    from moeadapt.config import LoRASpec, ParallelSpec
    from moeadapt.lora import inject_lora, lora_modules
    from moeadapt.models.model import build_model
    from moeadapt.onboard.sources import open_source
    from moeadapt.parallel import build_parallel_dims, init_distributed, parallelize_model
    from moeadapt.parallel.sharded_io import load_sharded, local, model_regions

    dev = init_distributed(device)
    rank, world = dist.get_rank(), dist.get_world_size()
    src = open_source(ckpt)
    spec = src.fam.spec
    model = build_model(spec, "meta")
    inject_lora(model, LoRASpec(rank=8, alpha=16.0))
    dims = build_parallel_dims(ParallelSpec(dp_shard=world, ep=ep), spec, dev)
    parallelize_model(model, dims)
    model.to_empty(device=dev)
    with torch.no_grad():  # adapters are not in the checkpoint: A small random, B zero (the model is the base)
        for m in lora_modules(model).values():
            a = m.lora_A.weight if hasattr(m.lora_A, "weight") else m.lora_A
            b = m.lora_B.weight if hasattr(m.lora_B, "weight") else m.lora_B
            local(a).normal_(0, 0.01)
            local(b).zero_()
    regs = model_regions(model, dims)
    largest_box = max(torch.Size(r.shape).numel() * t.element_size() for t, r in regs.values())
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats(dev)
    dist.barrier()
    _reset_hwm()
    rss0, t0 = _status("VmRSS"), time.perf_counter()
    info = load_sharded(model, src, dims)
    load_s = time.perf_counter() - t0
    hwm_load = _status("VmHWM")
    t_loaded = _since_process_start()
    gpu_before = torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None
    model.set_backend("reference" if dev.type == "cpu" else "auto")
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(1 + rank)
    x = torch.randint(0, spec.vocab_size, (1, seq + 1), generator=g).to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
        out = model(x[:, :-1], x[:, 1:], return_logits=False)
    (out.loss + out.aux_loss).backward()
    opt.step()
    loss = out.loss.detach().float()
    dist.all_reduce(loss)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    rec = {"rank": rank, "world": world, "ep": ep, "load_s": load_s, "to_loaded_s": t_loaded,
           "to_first_step_s": _since_process_start(), "bytes_read": info["bytes_read"],
           "shard_bytes": info["local_bytes"], "largest_box": largest_box, "rss_before_load": rss0,
           "hwm_after_load": hwm_load, "load_transient": hwm_load - rss0 - info["local_bytes"],
           "hwm_after_step": _status("VmHWM"), "loss": float(loss) / world,
           "gpu_peak_before_step": gpu_before,
           "gpu_peak_after_step": torch.cuda.max_memory_allocated(dev) if dev.type == "cuda" else None}
    if out_dir is not None:
        (out_dir / f"rank{rank}.json").write_text(json.dumps(rec))
    dist.destroy_process_group()
    return rec


def _spawned(rank: int, world: int, port: int, ckpt: str, ep: int, seq: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    run_rank(Path(ckpt), "cpu", ep, seq, Path(out_dir))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _table(recs: list[dict]) -> str:
    mb = 2**20
    rows = ["| world | ep | rank | load s | launch -> loaded s | launch -> 1st step s | read MB | shard MB | "
            "largest box MB | load transient MB | VmHWM after load MB | VmHWM after step MB | GPU peak before step GiB |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in recs:
        gpu = f"{r['gpu_peak_before_step'] / 2**30:.2f}" if r.get("gpu_peak_before_step") is not None else "-"
        rows.append(f"| {r['world']} | {r['ep']} | {r['rank']} | {r['load_s']:.1f} | {r['to_loaded_s']:.1f} | "
                    f"{r['to_first_step_s']:.1f} | {r['bytes_read'] / mb:.0f} | {r['shard_bytes'] / mb:.0f} | "
                    f"{r['largest_box'] / mb:.1f} | {r['load_transient'] / mb:.0f} | {r['hwm_after_load'] / mb:.0f} | "
                    f"{r['hwm_after_step'] / mb:.0f} | {gpu} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--make", type=Path, help="write a random checkpoint here (then exit)")
    ap.add_argument("--ckpt", type=Path, help="checkpoint directory to load")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--max-shard-gb", type=float, default=1.0)
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--gpu", action="store_true", help="small preset on CUDA (launch with torchrun for N GPUs)")
    ap.add_argument("--json", type=Path, help="append the per-rank records to this JSONL file")
    args = ap.parse_args()
    if args.make:
        if args.gpu:
            from moeadapt.config.presets import get_preset

            cfg = {"moeadapt": get_preset("small").model_dump(mode="json")}
        else:
            cfg = qwen3_config(args.layers, args.experts)
        t0 = time.perf_counter()
        res = make_checkpoint(args.make, cfg, int(args.max_shard_gb * 1e9))
        print(json.dumps({**res, "seconds": time.perf_counter() - t0}))
        return
    if args.ckpt is None:
        ap.error("give --make DIR or --ckpt DIR")
    if args.gpu:
        if "RANK" not in os.environ:
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
                              MASTER_PORT=str(_free_port()))
        rec = run_rank(args.ckpt, "cuda", args.ep, args.seq, None)
        recs = [rec]
    else:
        import torch.multiprocessing as mp

        recs = []
        for world in args.worlds:
            with tempfile.TemporaryDirectory() as d:
                mp.spawn(_spawned, args=(world, _free_port(), str(args.ckpt), args.ep, args.seq, d), nprocs=world)
                recs += [json.loads((Path(d) / f"rank{r}.json").read_text()) for r in range(world)]
            print(_table([r for r in recs if r["world"] == world]), flush=True)
    if args.json:
        with open(args.json, "a") as f:
            for r in recs:
                f.write(json.dumps(r) + "\n")
    if recs[0]["rank"] == 0:
        print(_table(recs))


if __name__ == "__main__":
    main()
