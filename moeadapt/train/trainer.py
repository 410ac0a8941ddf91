"""The training loop: one file a reader can follow from data to optimizer step.

`train(cfg)` sets a run up (model built on meta and materialised, `init_from` loaded, LoRA injected when
cfg.lora is set, parallelized, AdamW + warmup/cosine, resume), evaluates, calls `fit`, evaluates again and
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
from ..io import atomic_write_text, load_state_into, load_tensors, save_model_dir
from ..lora import cast_frozen_, export_peft, inject_lora
from ..models.model import HybridMoEModel, build_model, materialize
from ..models.router import update_expert_bias
from ..models.stats import count_parameters
from ..ui import make_console
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
    tokens_per_s: float  # wall clock over the whole loop (first steps' kernel compiles and evals included)
    steps: int
    tokens_per_s_steady: float | None = None  # train steps only, after the first STEADY_SKIP (the speed)


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
def evaluate(model, ds, cfg: RunConfig, device, n_batches: int | None = None) -> float:
    model.eval()
    bs = cfg.train.micro_batch_size
    n = min(len(ds), (n_batches or cfg.train.eval_batches) * bs)
    tot, cnt = 0.0, 0
    for i in range(0, n, bs):
        x, y = ds.inputs[i:i + bs].to(device), ds.labels[i:i + bs].to(device)
        with _autocast(device, cfg.train.dtype):
            out = model(x, y, return_logits=False)
        k = int((y != -100).sum())
        if k:
            tot += float(out.loss) * k
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
        st.tokens += x.numel() * run.world
    st.grad_norm = run.clip(lp.params, t.grad_clip)  # global norm over every rank's shards
    st.loss = run.mean(st.loss)
    lp.opt.step()
    lp.sched.step()
    lp.opt.zero_grad(set_to_none=True)
    update_expert_bias(model, counts_reduce=run.counts_reduce)
    return st


# Steps left out of the steady-state speed: the first ones compile and autotune kernels (Triton, torch.compile).
STEADY_SKIP = 2


@dataclass
class Speed:
    """Train-step time and tokens after the first STEADY_SKIP steps, evals and checkpoint writes left out."""

    seconds: float = 0.0
    tokens: int = 0
    steps: int = 0

    @property
    def tokens_per_s(self) -> float | None:
        return self.tokens / self.seconds if self.steps and self.seconds > 0 else None


def fit(lp: Loop, start: int) -> tuple[float, float, Speed]:
    """Train from step `start` to cfg.train.steps (logging, periodic eval and checkpoints).
    Returns (last train loss, elapsed seconds, steady-state speed)."""
    t = lp.cfg.train
    ckpt_root = Path(t.output_dir) / "checkpoints"
    bad, last_loss, t0 = 0, float("nan"), time.perf_counter()
    t_log, tok_log = t0, 0
    speed, t_step = Speed(), t0
    cuda = lp.run.device.type == "cuda"
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
            do_eval = bool(t.eval_every and (step + 1) % t.eval_every == 0 and step + 1 < t.steps)
            do_save = bool(t.save_every and (step + 1) % t.save_every == 0)
            if step - start >= STEADY_SKIP:
                if cuda and (do_eval or do_save):  # the step's queued GPU work belongs to the step
                    torch.cuda.synchronize(lp.run.device)
                speed.seconds += time.perf_counter() - t_step
                speed.tokens += st.tokens
                speed.steps += 1
            progress.update(task, advance=1, info=f"loss {st.loss:.3f}")
            if (step + 1) % t.log_every == 0 or step == t.steps - 1 or step == start:
                _log_train(lp, step + 1, st, tok_log / max(time.perf_counter() - t_log, 1e-9), progress)
                t_log, tok_log = time.perf_counter(), 0
            if do_eval:
                lp.logger.log({"kind": "eval", "step": step + 1,
                               "eval_loss": evaluate(lp.model, lp.eval_ds, lp.cfg, lp.run.device)})
            if do_save:
                lp.run.save(ckpt_root, step + 1, lp.model, lp.opt, lp.sched, lp.sampler.state())
            t_step = time.perf_counter()  # evals and checkpoint writes stay out of the next step's time
    return last_loss, time.perf_counter() - t0, speed


def _log_train(lp: Loop, step: int, st: StepStats, tps: float, progress: Progress) -> None:
    device, peak = lp.run.device, peak_flops(lp.run.device)
    rec = {"kind": "train", "step": step, "loss": st.loss, "lr": lp.sched.get_last_lr()[0],
           "grad_norm": float(st.grad_norm), "tokens_per_s": tps, **{f"aux/{k}": v for k, v in st.aux.items()}}
    if peak:
        rec["mfu"] = tps * lp.flops_per_token / peak / lp.run.world  # tps counts every rank; MFU is per GPU
    if device.type == "cuda":
        rec["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
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
    model = prepare_model(cfg, run.device)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fpt, n_total = flops_per_token(model, cfg), count_parameters(model, cfg.model)["total"]
    run.parallelize(model)  # shards parameters: count them (above) before
    params = [p for p in model.parameters() if p.requires_grad]
    # fused=True on CUDA: one kernel over all parameters per step (vs foreach's several passes)
    opt = torch.optim.AdamW(params, lr=t.lr, betas=t.betas, weight_decay=t.weight_decay,
                            fused=run.device.type == "cuda")
    lp = Loop(cfg, run, model, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg)),
              Sampler(train_ds, t.micro_batch_size, t.seed, rank=run.rank, world=run.world),
              MetricsLogger(out_dir, t.tensorboard) if run.is_main else NullLogger(), eval_ds, fpt, quiet)
    start = _resume(lp)
    lp.logger.truncate_after(start)  # a resumed run continues the log from its checkpoint step
    if start:
        lp.logger.log({"kind": "resume", "step": start})
    if not quiet:
        console.print(f"[bold]{cfg.model.name}[/]: {n_total / 1e6:.2f}M params, "
                      f"{n_train / 1e6:.3f}M trainable ({'LoRA' if cfg.lora else 'full'}), device {run.device}, "
                      f"{len(train_ds)} train rows x {t.seq_len} tokens")
    eval_before = evaluate(model, eval_ds, cfg, run.device)
    lp.logger.log({"kind": "eval", "step": start, "eval_loss": eval_before})
    if not quiet:
        console.print(f"eval loss before: {eval_before:.4f}")

    last_loss, elapsed, speed = fit(lp, start)

    eval_after = evaluate(model, eval_ds, cfg, run.device)
    lp.logger.log({"kind": "eval", "step": t.steps, "eval_loss": eval_after})
    lp.logger.close()
    tps = lp.tokens_done / max(elapsed, 1e-9)
    _export(lp, out_dir)
    if run.is_main:
        plot_report(lp.logger.path, out_dir / "report.png", title=f"{cfg.model.name} - {'LoRA' if cfg.lora else 'full'}")
        summary = {"eval_loss_before": eval_before, "eval_loss_after": eval_after, "final_train_loss": last_loss,
                   # wall clock over the loop (first steps' compiles and periodic evals included)
                   "tokens_per_s": tps,
                   # the training speed: train steps only, after the first STEADY_SKIP (None if too few steps)
                   "tokens_per_s_steady": speed.tokens_per_s, "steady_steps": speed.steps,
                   "steps": t.steps, "elapsed_s": elapsed, "trainable_params": n_train}
        atomic_write_text(out_dir / "summary.json", json.dumps(summary, indent=2))
    run.finish()
    if not quiet:
        steady = (f"{speed.tokens_per_s:,.0f} tokens/s steady state (train steps after the first {STEADY_SKIP}), "
                  if speed.tokens_per_s else "")
        console.print(f"eval loss before {eval_before:.4f} -> after {eval_after:.4f}; {steady}{tps:,.0f} tokens/s "
                      f"wall clock (compiles and evals included); results in {out_dir}/")
    return TrainResult(out_dir, eval_before, eval_after, last_loss, tps, t.steps, speed.tokens_per_s)
