"""The training loop: one file a reader can follow from data to optimizer step.

train(cfg) builds the model (meta, then materialised), loads `init_from`, injects LoRA when
cfg.lora is set, evaluates before, trains (AdamW, warmup + cosine, grad clipping, grad accumulation,
bf16 autocast on GPU with fp32 trainable params, fp32 on CPU), evaluates after, and writes the results:
`model/` (full training) or `adapter/` (PEFT, LoRA runs), `metrics.jsonl`, `report.png`, `summary.json`.
A NaN/Inf loss skips the step with a warning; `max_bad_steps` in a row stop the run with a clear error.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from ..config import RunConfig
from ..data.dataset import Sampler, build_datasets
from ..data.tokenizer import get_tokenizer
from ..io import atomic_write_text, load_state_into, load_tensors, save_model_dir
from ..lora import cast_frozen_, export_peft, inject_lora
from ..models.model import HybridMoEModel, build_model, materialize
from ..models.router import update_expert_bias
from ..models.stats import count_parameters
from ..ui import make_console
from .checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from .metrics import MetricsLogger, load_quantiles, plot_report

console = make_console()


class TrainingError(RuntimeError):
    """A run cannot continue; the message says why and what to change."""


@dataclass
class TrainResult:
    output_dir: Path
    eval_before: float
    eval_after: float
    final_loss: float
    tokens_per_s: float
    steps: int


def pick_device(name: str) -> torch.device:
    if name == "cuda" and not torch.cuda.is_available():
        raise TrainingError("train.device is 'cuda' but no GPU is visible; use device: auto or cpu")
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def load_model(model_dir: str | Path, model: HybridMoEModel) -> None:
    """Weights from a moeadapt model directory, or (streamed and name-mapped) from a Hugging Face one."""
    p = Path(model_dir)
    cfg_file = p / "config.json"
    if cfg_file.is_file() and "moeadapt" not in json.loads(cfg_file.read_text()):
        from ..onboard import load_weights

        load_weights(p, model)
        return
    f = p / "model.safetensors"
    if not f.is_file():
        raise FileNotFoundError(f"{p} holds no model.safetensors; give a directory written by `moeadapt train`")
    state = load_tensors(f)
    load_state_into(model, {k: v.to(model.embed.weight.dtype) if v.is_floating_point() and "expert_bias" not in k
                            else v for k, v in state.items()}, str(f))


def prepare_model(cfg: RunConfig, device: torch.device) -> HybridMoEModel:
    model = build_model(cfg.model, "meta")
    materialize(model, device, seed=cfg.train.seed)
    if cfg.train.init_from:
        load_model(cfg.train.init_from, model)
    if cfg.lora is not None:
        inject_lora(model, cfg.lora)
        if device.type == "cuda":  # frozen BF16 backbone, fp32 adapters
            cast_frozen_(model, torch.bfloat16)
    model.set_backend(cfg.train.kernel_backend)
    return model


def _autocast(device: torch.device, dtype: str):
    if device.type == "cuda" and dtype in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
def evaluate(model, ds, cfg: RunConfig, device, n_batches: int | None = None, dr=None) -> float:
    model.eval()
    bs = cfg.train.micro_batch_size
    n = min(len(ds), (n_batches or cfg.train.eval_batches) * bs)
    tot, cnt = 0.0, 0
    for i in range(0, n, bs):
        x, y = ds.inputs[i:i + bs].to(device), ds.labels[i:i + bs].to(device)
        with _autocast(device, cfg.train.dtype):
            out = model(dr.local_part(x) if dr else x, dr.local_part(y) if dr else y, return_logits=False)
        k = int((y != -100).sum())
        if k:  # under cp each rank's loss is its share x cp: the mean over ranks is the rows' loss
            tot += (dr.mean(float(out.loss)) if dr and dr.cp_layout else float(out.loss)) * k
            cnt += k
    model.train()
    return tot / max(cnt, 1)


def lr_lambda(cfg: RunConfig):
    t = cfg.train

    def f(step: int) -> float:
        if step < t.warmup_steps:
            return (step + 1) / max(1, t.warmup_steps)
        prog = (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)
        return t.min_lr_ratio + (1 - t.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, prog)))

    return f


def flops_per_token(model, cfg: RunConfig) -> float:
    counts = count_parameters(model, cfg.model)
    trainable_frac = 1.0 if cfg.lora is None else 2 / 3  # LoRA skips the weight-gradient GEMMs of the base
    return 6 * trainable_frac * (counts["active_per_token"] - counts["by_component"].get("embeddings", 0))


def peak_flops(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return 790e12 if ("H200" in name or "H100" in name) else None  # measured bf16 dense on H200


def train(cfg: RunConfig, quiet: bool = False) -> TrainResult:
    t = cfg.train
    device = pick_device(t.device)
    dr = None  # under torchrun (even 1 process): FSDP2 + EP + DCP via moeadapt.parallel (docs/parallel.md)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from ..parallel import DistributedRun

        dr = DistributedRun(cfg, device)
        device, quiet = dr.device, quiet or not dr.is_main
    world = dr.world if dr else 1
    torch.manual_seed(t.seed)
    out_dir = Path(t.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = get_tokenizer(cfg.data.tokenizer, t.init_from)
    if tok.vocab_size > cfg.model.vocab_size:
        raise TrainingError(f"tokenizer has {tok.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}; "
                            "raise vocab_size or use a matching tokenizer")
    train_ds, eval_ds = build_datasets(cfg.data, tok, t.seq_len, t.seed)
    model = prepare_model(cfg, device)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fpt, n_total = flops_per_token(model, cfg), count_parameters(model, cfg.model)["total"]
    if dr:
        dr.parallelize(model)  # shards parameters: count them (above) before
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    sampler = Sampler(train_ds, t.micro_batch_size, t.seed, rank=dr.data_rank if dr else 0,
                      world=dr.data_world if dr else 1)
    ckpt_root = out_dir / "checkpoints"
    start = 0
    if t.resume:
        last = latest_checkpoint(ckpt_root)
        if last is None:
            console.print(f"[yellow]resume: no checkpoint under {ckpt_root}; starting from step 0")
        else:
            start, sstate = dr.load(last, model, opt, sched) if dr else load_checkpoint(last, model, opt, sched)
            sampler.load_state(sstate)
            console.print(f"resumed from {last} at step {start}")
    if dr and not dr.is_main:
        from ..parallel.run import NullLogger

        logger = NullLogger()
    else:
        logger = MetricsLogger(out_dir, t.tensorboard)
    logger.truncate_after(start)  # a resumed run continues the log from its checkpoint step
    if start:
        logger.log({"kind": "resume", "step": start})
    peak = peak_flops(device)
    if not quiet:
        console.print(f"[bold]{cfg.model.name}[/]: {n_total / 1e6:.2f}M params, "
                      f"{n_train / 1e6:.3f}M trainable ({'LoRA' if cfg.lora else 'full'}), device {device}, "
                      f"{len(train_ds)} train rows x {t.seq_len} tokens")
    eval_before = evaluate(model, eval_ds, cfg, device, dr=dr)
    logger.log({"kind": "eval", "step": start, "eval_loss": eval_before})
    if not quiet:
        console.print(f"eval loss before: {eval_before:.4f}")

    bad, last_loss, tokens_done, t_start = 0, float("nan"), 0, time.perf_counter()
    step_counts: dict[int, torch.Tensor] = {}
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console, disable=quiet)
    model.train()
    with progress:
        task = progress.add_task("train", total=t.steps, completed=start, info="")
        t_log = time.perf_counter()
        tok_log = 0
        for step in range(start, t.steps):
            loss_sum, aux_sum, finite, drops = 0.0, {}, True, {}
            step_counts.clear()
            # merge_microbatches: one forward over all micro-batches (experts batched), else one per micro-batch
            per_fwd = t.grad_accum_steps if t.merge_microbatches else 1
            n_fwd = t.grad_accum_steps // per_fwd
            for _ in range(n_fwd):
                xs, ys = zip(*(sampler.next() for _ in range(per_fwd)))
                x, y = torch.cat(xs).to(device), torch.cat(ys).to(device)
                if dr:
                    x, y = dr.local_part(x), dr.local_part(y)
                with _autocast(device, t.dtype):
                    out = model(x, y, return_logits=False, micro_batches=per_fwd)
                    loss = out.loss + out.aux_loss
                if not (dr.all_finite(loss) if dr else torch.isfinite(loss)):  # ranks must agree to skip
                    finite = False
                    break
                (loss / n_fwd).backward()
                loss_sum += float(out.loss.detach()) / n_fwd
                for k, v in out.aux.items():
                    aux_sum[k] = aux_sum.get(k, 0.0) + v / n_fwd
                for m in out.moe:
                    # stays on the device: read back only on log steps (no per-layer sync in the hot loop)
                    step_counts[m["layer"]] = step_counts.get(m["layer"], 0) + m["counts"].float()
                    drops[m["layer"]] = drops.get(m["layer"], 0.0) + m["drop_rate"] / n_fwd
                tokens_done += x.numel() * world
                tok_log += x.numel() * world
            if not finite:
                bad += 1
                opt.zero_grad(set_to_none=True)
                console.print(f"[yellow]step {step}: loss is NaN/Inf - step skipped ({bad}/{t.max_bad_steps} in a row)")
                if bad >= t.max_bad_steps:
                    raise TrainingError(f"{bad} NaN/Inf losses in a row at step {step}; lower train.lr, enable "
                                        "grad_clip, or check the data and init_from checkpoint")
                continue
            bad = 0
            if dr:  # global norm over dense and expert meshes; loss averaged over ranks for the log
                gnorm, loss_sum = dr.clip(params, t.grad_clip), dr.mean(loss_sum)
            else:
                gnorm = torch.nn.utils.clip_grad_norm_(params, t.grad_clip if t.grad_clip else float("inf"))
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            update_expert_bias(model, counts_reduce=dr.counts_reduce if dr else None)
            last_loss = loss_sum
            progress.update(task, advance=1, info=f"loss {loss_sum:.3f}")
            if (step + 1) % t.log_every == 0 or step == t.steps - 1 or step == start:
                dt = time.perf_counter() - t_log
                tps = tok_log / max(dt, 1e-9)
                rec = {"kind": "train", "step": step + 1, "loss": loss_sum, "lr": sched.get_last_lr()[0],
                       "grad_norm": float(gnorm), "tokens_per_s": tps, **{f"aux/{k}": v for k, v in aux_sum.items()}}
                if peak:
                    rec["mfu"] = tps * fpt / peak / world  # tps counts every rank; MFU is per GPU
                if device.type == "cuda":
                    rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
                rec["moe"] = [{"layer": layer, **load_quantiles(c), "drop_rate": float(drops[layer]),
                               # raw per-expert counts for `moeadapt simulate-routing` (small models only)
                               **({"counts": [int(x) for x in c.tolist()]} if c.numel() <= 1024 else {})}
                              for layer, c in sorted(step_counts.items())]
                logger.log(rec)
                t_log, tok_log = time.perf_counter(), 0
                if not quiet:
                    q = " ".join(f"L{m['layer']}(p50 {m['p50']:.2f} p90 {m['p90']:.2f} p99 {m['p99']:.2f} "
                                 f"max {m['max']:.2f})" for m in rec["moe"])
                    progress.console.print(f"step {step + 1:5d} loss {loss_sum:.4f} lr {rec['lr']:.2e} "
                                           f"gnorm {float(gnorm):.2f} tok/s {tps:,.0f}  load/mean {q}")
            if t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps:
                ev = evaluate(model, eval_ds, cfg, device, dr=dr)
                logger.log({"kind": "eval", "step": step + 1, "eval_loss": ev})
            if t.save_every and (step + 1) % t.save_every == 0:
                (dr.save if dr else save_checkpoint)(ckpt_root, step + 1, model, opt, sched, sampler.state())
    elapsed = time.perf_counter() - t_start
    eval_after = evaluate(model, eval_ds, cfg, device, dr=dr)
    logger.log({"kind": "eval", "step": t.steps, "eval_loss": eval_after})
    logger.close()
    tps = tokens_done / max(elapsed, 1e-9)
    plain = dr.unsharded_copy(model) if dr else model  # (None on ranks other than 0: they write nothing)
    if plain is not None:
        if cfg.lora is not None:
            from ..onboard import peft_maps  # checkpoint names / row order for a Hugging Face init_from

            export_peft(plain, cfg.lora, out_dir / "adapter", base_model=t.init_from or cfg.model.name,
                        **peft_maps(t.init_from))
        else:
            save_model_dir(plain, cfg.model.model_dump(), out_dir / "model")
        plot_report(logger.path, out_dir / "report.png", title=f"{cfg.model.name} - {'LoRA' if cfg.lora else 'full'}")
        summary = {"eval_loss_before": eval_before, "eval_loss_after": eval_after, "final_train_loss": last_loss,
                   "tokens_per_s": tps, "steps": t.steps, "elapsed_s": elapsed, "trainable_params": n_train}
        atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2))
    if dr:
        dr.finish()
    if not quiet:
        console.print(f"eval loss before {eval_before:.4f} -> after {eval_after:.4f}; {tps:,.0f} tokens/s; "
                      f"results in {out_dir}/")
    return TrainResult(out_dir, eval_before, eval_after, last_loss, tps, t.steps)
