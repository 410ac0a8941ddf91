"""The training loop: one file a reader can follow from data to optimizer step.

`train(cfg)` sets a run up (model built on meta with LoRA when cfg.lora is set, parallelized on meta, each
rank's shards allocated and filled from `init_from` or the seeded init: build.py; AdamW + warmup/cosine,
resume), evaluates, calls `fit`, evaluates again and
writes the results: `model/` (full training) or `adapter/` (PEFT, LoRA runs), `metrics.jsonl`,
`report.png`, `summary.json`. `fit` is the loop; `train_step` is one optimizer step (grad accumulation,
bf16 autocast on GPU with fp32 trainable params, fp32 on CPU, grad clipping, router-bias update).
A NaN/Inf loss skips the step with a warning; `max_bad_steps` in a row stop the run with a clear error.

Everything that differs between one process and torchrun goes through `run`: a `LocalRun` (local.py) or a
`parallel.DistributedRun`, which have the same methods; the loop has no branch on which one it is.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

from ..config import RunConfig
from ..data.dataset import Sampler, build_datasets
from ..data.tokenizer import get_tokenizer
from ..io import atomic_write_text, save_model_dir
from ..lora import export_peft
from ..models.model import HybridMoEModel
from ..models.router import update_expert_bias
from ..models.stats import count_parameters
from ..ui import make_console
from .build import build_meta, materialize_shards
from .checkpoint import latest_checkpoint
from .local import LocalRun
from .metrics import MetricsLogger, NullLogger, load_quantiles, plot_report

if TYPE_CHECKING:
    from ..parallel import DistributedRun

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


def _autocast(device: torch.device, dtype: str):
    if device.type == "cuda" and dtype in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


@torch.no_grad()
@torch.no_grad()
def evaluate(model, ds, cfg: RunConfig, device, n_batches: int | None = None, run=None) -> float:
    """Mean loss per target token over the first `n_batches` (default eval_batches) micro-batches of every
    rank: rank r takes batches r, r + world, ... and the sums are added over ranks. Every rank runs the same
    number of forwards (FSDP and EP forwards are collective): one past the end repeats batch 0 at weight 0."""
    # the cp ranks of a group read the same batch (each its pieces of it): batches go by data-parallel rank;
    # their losses are shares x cp and every cp rank counts the batch's tokens, so the summed ratio is exact
    world, rank = (run.data_world, run.data_rank) if run is not None else (1, 0)
    model.eval()
    bs = cfg.train.micro_batch_size
    nb = min(-(-len(ds) // bs), (n_batches or cfg.train.eval_batches) * world)
    tot, cnt = 0.0, 0
    for b in range(rank, -(-nb // world) * world, world):
        i = b * bs if b < nb else 0
        x, y = ds.inputs[i:i + bs].to(device), ds.labels[i:i + bs].to(device)
        k = int((y != -100).sum()) if b < nb else 0  # the whole rows' tokens (before the cp split)
        if run is not None:
            x, y = run.local_part(x), run.local_part(y)
        with _autocast(device, cfg.train.dtype):
            out = model(x, y, return_logits=False)
        if k:
            tot += float(out.loss) * k
            cnt += k
    if run is not None:
        tot, cnt = run.sum([tot, cnt])
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


def start_run(cfg: RunConfig) -> LocalRun | DistributedRun:
    """A DistributedRun under torchrun (even with one process: FSDP2 + EP + DCP, docs/parallel.md), else a
    LocalRun. Both have the same methods; the returned object's `device` is this rank's device."""
    device = pick_device(cfg.train.device)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        from ..parallel import DistributedRun

        return DistributedRun(cfg, device)
    return LocalRun(cfg, device)


@dataclass
class Loop:
    """What the loop works on; built once by `train`."""

    cfg: RunConfig
    run: LocalRun | DistributedRun
    model: HybridMoEModel
    params: list[torch.nn.Parameter]
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    sampler: Sampler
    logger: MetricsLogger | NullLogger
    eval_ds: object
    flops_per_token: float
    quiet: bool
    tokens_done: int = 0


@dataclass
class StepStats:
    loss: float
    grad_norm: torch.Tensor
    tokens: int
    aux: dict[str, float] = field(default_factory=dict)
    counts: dict[int, torch.Tensor] = field(default_factory=dict)  # per MoE layer, still on the device
    drops: dict[int, float] = field(default_factory=dict)


def train_step(lp: Loop) -> StepStats | None:
    """One optimizer step over grad_accum_steps micro-batches; None when the loss was NaN/Inf (skipped)."""
    t, run, model, device = lp.cfg.train, lp.run, lp.model, lp.run.device
    # merge_microbatches: one forward over all micro-batches (experts batched), else one per micro-batch
    per_fwd = t.grad_accum_steps if t.merge_microbatches else 1
    n_fwd = t.grad_accum_steps // per_fwd
    st = StepStats(loss=0.0, grad_norm=torch.zeros(()), tokens=0)
    for _ in range(n_fwd):
        xs, ys = zip(*(lp.sampler.next() for _ in range(per_fwd)))
        x, y = torch.cat(xs).to(device), torch.cat(ys).to(device)
        x, y = run.local_part(x), run.local_part(y)  # this rank's pieces of each sequence under cp
        with _autocast(device, t.dtype):
            out = model(x, y, return_logits=False, micro_batches=per_fwd)
            loss = out.loss + out.aux_loss
        if not run.all_finite(loss):  # every rank takes the same branch
            lp.opt.zero_grad(set_to_none=True)
            return None
        (loss / n_fwd).backward()
        st.loss += float(out.loss.detach()) / n_fwd
        for k, v in out.aux.items():
            st.aux[k] = st.aux.get(k, 0.0) + v / n_fwd
        for m in out.moe:  # counts stay on the device: read back only on log steps
            st.counts[m["layer"]] = st.counts.get(m["layer"], 0) + m["counts"].float()
            st.drops[m["layer"]] = st.drops.get(m["layer"], 0.0) + m["drop_rate"] / n_fwd
        st.tokens += x.numel()  # this rank's; summed over ranks when logged
    st.grad_norm = run.clip(lp.params, t.grad_clip)  # global norm over every rank's shards
    st.loss = run.mean(st.loss)
    lp.opt.step()
    lp.sched.step()
    lp.opt.zero_grad(set_to_none=True)
    update_expert_bias(model, counts_reduce=run.counts_reduce)
    return st


def fit(lp: Loop, start: int) -> tuple[float, float]:
    """Train from step `start` to cfg.train.steps (logging, periodic eval and checkpoints).
    Returns (last train loss, elapsed seconds)."""
    t = lp.cfg.train
    ckpt_root = Path(t.output_dir) / "checkpoints"
    bad, last_loss, t0 = 0, float("nan"), time.perf_counter()
    t_log, tok_log = t0, 0
    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console, disable=lp.quiet)
    lp.model.train()
    with progress:
        task = progress.add_task("train", total=t.steps, completed=start, info="")
        for step in range(start, t.steps):
            st = train_step(lp)
            if st is None:
                bad += 1
                console.print(f"[yellow]step {step}: loss is NaN/Inf - step skipped ({bad}/{t.max_bad_steps} in a row)")
                if bad >= t.max_bad_steps:
                    raise TrainingError(f"{bad} NaN/Inf losses in a row at step {step}; lower train.lr, enable "
                                        "grad_clip, or check the data and init_from checkpoint")
                continue
            bad, last_loss = 0, st.loss
            lp.tokens_done += st.tokens
            tok_log += st.tokens
            progress.update(task, advance=1, info=f"loss {st.loss:.3f}")
            if (step + 1) % t.log_every == 0 or step == t.steps - 1 or step == start:
                tok_all = lp.run.sum([tok_log])[0]  # the tokens every rank processed, counted
                _log_train(lp, step + 1, st, tok_all / max(time.perf_counter() - t_log, 1e-9), progress)
                t_log, tok_log = time.perf_counter(), 0
            if t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps:
                lp.logger.log({"kind": "eval", "step": step + 1,
                               "eval_loss": evaluate(lp.model, lp.eval_ds, lp.cfg, lp.run.device, run=lp.run)})
            if t.save_every and (step + 1) % t.save_every == 0:
                lp.run.save(ckpt_root, step + 1, lp.model, lp.opt, lp.sched, lp.sampler.state())
    return last_loss, time.perf_counter() - t0


def _log_train(lp: Loop, step: int, st: StepStats, tps: float, progress: Progress) -> None:
    device, peak = lp.run.device, peak_flops(lp.run.device)
    rec = {"kind": "train", "step": step, "loss": st.loss, "lr": lp.sched.get_last_lr()[0],
           "grad_norm": float(st.grad_norm), "tokens_per_s": tps, **{f"aux/{k}": v for k, v in st.aux.items()}}
    if peak:
        rec["mfu"] = tps * lp.flops_per_token / peak / lp.run.world  # tps counts every rank; MFU is per GPU
    if device.type == "cuda":
        rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    if lp.run.counts_reduce is not None and st.counts:  # every rank's tokens: the load of the whole step
        for layer in sorted(st.counts):
            lp.run.counts_reduce(st.counts[layer])
        drops = lp.run.sum([float(st.drops[k]) for k in sorted(st.drops)])
        st.drops = {k: v / lp.run.world for k, v in zip(sorted(st.drops), drops)}
    rec["moe"] = [{"layer": layer, **load_quantiles(c), "drop_rate": float(st.drops[layer]),
                   # raw per-expert counts for `moeadapt simulate-routing` (small models only)
                   **({"counts": [int(x) for x in c.tolist()]} if c.numel() <= 1024 else {})}
                  for layer, c in sorted(st.counts.items())]
    lp.logger.log(rec)
    if not lp.quiet:
        q = " ".join(f"L{m['layer']}(p50 {m['p50']:.2f} p90 {m['p90']:.2f} p99 {m['p99']:.2f} "
                     f"max {m['max']:.2f})" for m in rec["moe"])
        progress.console.print(f"step {step:5d} loss {st.loss:.4f} lr {rec['lr']:.2e} "
                               f"gnorm {float(st.grad_norm):.2f} tok/s {tps:,.0f}  load/mean {q}")


def _resume(lp: Loop) -> int:
    """The step to start from: the latest checkpoint's when cfg.train.resume and one exists, else 0."""
    root = Path(lp.cfg.train.output_dir) / "checkpoints"
    last = latest_checkpoint(root) if lp.cfg.train.resume else None
    if lp.cfg.train.resume and last is None:
        console.print(f"[yellow]resume: no checkpoint under {root}; starting from step 0")
    if last is None:
        return 0
    start, sampler_state = lp.run.load(last, lp.model, lp.opt, lp.sched)
    lp.sampler.load_state(sampler_state)
    console.print(f"resumed from {last} at step {start}")
    return start


def _export(lp: Loop, out_dir: Path) -> None:
    """model/ or adapter/ from the trained weights (written by rank 0 only; collective under torchrun)."""
    cfg = lp.cfg
    plain = lp.run.unsharded_copy(lp.model)  # None on ranks other than 0
    if plain is None:
        return
    if cfg.lora is not None:
        from ..onboard import peft_maps  # checkpoint names / row order for a Hugging Face init_from

        export_peft(plain, cfg.lora, out_dir / "adapter", base_model=cfg.train.init_from or cfg.model.name,
                    **peft_maps(cfg.train.init_from))
    else:
        save_model_dir(plain, cfg.model.model_dump(), out_dir / "model")


def train(cfg: RunConfig, quiet: bool = False) -> TrainResult:
    t = cfg.train
    run = start_run(cfg)
    quiet = quiet or not run.is_main
    torch.manual_seed(t.seed)
    out_dir = Path(t.output_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tok = get_tokenizer(cfg.data.tokenizer, t.init_from)
    if tok.vocab_size > cfg.model.vocab_size:
        raise TrainingError(f"tokenizer has {tok.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}; "
                            "raise vocab_size or use a matching tokenizer")
    train_ds, eval_ds = build_datasets(cfg.data, tok, t.seq_len, t.seed)
    model = build_meta(cfg, run.device)  # counted on meta, before it is sharded
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fpt, n_total = flops_per_token(model, cfg), count_parameters(model, cfg.model)["total"]
    materialize_shards(model, cfg, run)  # parallelize on meta, then allocate and fill this rank's shards
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay)
    lp = Loop(cfg, run, model, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
              Sampler(train_ds, t.micro_batch_size, t.seed, rank=run.data_rank, world=run.data_world),
              MetricsLogger(out_dir, t.tensorboard) if run.is_main else NullLogger(), eval_ds, fpt, quiet)
    start = _resume(lp)
    lp.logger.truncate_after(start)  # a resumed run continues the log from its checkpoint step
    if start:
        lp.logger.log({"kind": "resume", "step": start})
    if not quiet:
        console.print(f"[bold]{cfg.model.name}[/]: {n_total / 1e6:.2f}M params, "
                      f"{n_train / 1e6:.3f}M trainable ({'LoRA' if cfg.lora else 'full'}), device {run.device}, "
                      f"{len(train_ds)} train rows x {t.seq_len} tokens")
    eval_before = evaluate(model, eval_ds, cfg, run.device, run=run)
    lp.logger.log({"kind": "eval", "step": start, "eval_loss": eval_before})
    if not quiet:
        console.print(f"eval loss before: {eval_before:.4f}")

    last_loss, elapsed = fit(lp, start)

    eval_after = evaluate(model, eval_ds, cfg, run.device, run=run)
    lp.logger.log({"kind": "eval", "step": t.steps, "eval_loss": eval_after})
    lp.logger.close()
    tps = run.sum([lp.tokens_done])[0] / max(elapsed, 1e-9)
    _export(lp, out_dir)
    if run.is_main:
        plot_report(lp.logger.path, out_dir / "report.png", title=f"{cfg.model.name} - {'LoRA' if cfg.lora else 'full'}")
        summary = {"eval_loss_before": eval_before, "eval_loss_after": eval_after, "final_train_loss": last_loss,
                   "tokens_per_s": tps, "steps": t.steps, "elapsed_s": elapsed, "trainable_params": n_train}
        atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2))
    run.finish()
    if not quiet:
        console.print(f"eval loss before {eval_before:.4f} -> after {eval_after:.4f}; {tps:,.0f} tokens/s; "
                      f"results in {out_dir}/")
    return TrainResult(out_dir, eval_before, eval_after, last_loss, tps, t.steps)
