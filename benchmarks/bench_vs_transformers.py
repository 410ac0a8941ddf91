"""Our training step vs transformers + peft on the same kind of model, side by side: tokens/s, median step time
and peak memory of a LoRA r = 16 step and a full fine-tuning step, each run in its own subprocess (fresh CUDA
memory statistics, no allocator state shared between the two stacks), on the same random token batches.

Ours: the `small` preset through the code path `moeadapt train` / `moeadapt finetune` takes on one GPU
(train/build.py's build_meta -> materialize_shards, the trainer's AdamW(fused) + warmup/cosine schedule, its
Sampler over a PackedDataset of random tokens, and trainer.train_step: bf16 autocast, fp32 trainable
parameters, a bf16 frozen base under LoRA, grad clipping 1.0, the router-bias update; LoRA = the default
targets: KDA / DSA projections and the grouped expert adapters). One process per run, plain `python3` (the
trainer's LocalRun), as `moeadapt finetune` runs on one GPU.

The peer: transformers' `KimiLinearForCausalLM` (KDA through fla-core's chunk_kda when fla is importable,
transformers' own PyTorch fallback otherwise; the short convolutions through transformers' torch fallback
since the `causal_conv1d` package is not there; MLA full attention through SDPA; routed experts through
transformers' default `grouped_mm` experts), randomly initialised, as users train it: LoRA = bf16 weights +
`peft.get_peft_model(LoraConfig(r=16, lora_alpha=32, target_modules="all-linear",
target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]))` (adapters fp32, peft's default),
full fine-tuning = fp32 weights (what a Trainer with bf16=True on an fp32 model does); both under bf16 autocast,
torch AdamW (fused), gradient clipping 1.0, gradients on the trainable parameters only.

How the peer's config is matched to our ModelSpec (`peer_config`; printed at run time):
  * vocabulary, hidden size, layer count, and the layer pattern: our DSA layers (every 4th) are the peer's
    full-attention (MLA) layers, our KDA layers its KDA layers; first_k_dense dense FFN layers of the same width;
  * KDA: heads x head dim and the short-conv kernel; MLA: heads, q_lora_rank, kv_lora_rank, nope / rope / v
    head dims. The peer's MLA attends to every earlier token (no lightning indexer, no top-k selection, no
    head-wise output gate, no RoPE in transformers' Kimi MLA): at seq 4096 with our index_topk 2048 our DSA
    layers attend to at most half the keys and run the indexer on top;
  * MoE: experts, top-k, sigmoid routing with normalised top-k weights x routed_scaling_factor, the shared
    expert's width (n_shared_experts x moe_intermediate_size on the peer). Our LatentMoE runs the experts in
    latent_dim (1024 for `small`) behind a down / up projection; Kimi Linear has no latent, its experts see
    the hidden size. `--peer-experts full` (default: the issue's baseline) keeps the expert FFN width
    (768), so each peer expert holds hidden/latent = 2x our expert's parameters; `--peer-experts matched` sets
    the peer's expert width to 768 x latent/hidden = 384 so every expert (and the routed part of the active
    parameters) holds as many parameters as ours, the shared expert keeping 1536.
  Counts (`small`, counted on meta): ours 2.91B total / 0.93B active per token, LoRA 86.4M trainable; the peer
  `full` 5.10B / 1.14B, 107.6M trainable; `matched` 2.84B / 0.86B, 89.9M trainable (peft's all-linear also
  covers the shared expert, the dense FFN and the KDA gate projections, which our default targets leave out).
  Both models' counts are printed and saved with every run.

Run (one H200, ~5-8 minutes for everything; fla's autotune results come from .fla_cache, see benchmarks/README.md):
    . benchmarks/gpu_env.sh        # carry .whl holding the transformers, peft, fla-core and pydantic wheels
    python3 benchmarks/bench_vs_transformers.py --part all --cuda-graph --out $OUT/vs_hf
CPU smoke run (tiny dimensions on both sides, ~1.5 CPU-minutes for the four runs; the peer on transformers'
torch fallback, which it needs: fla's kernels are Triton-only; `--modes lora` halves it):
    python benchmarks/bench_vs_transformers.py --tiny
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from moeadapt.config import LoRASpec, ModelSpec, RunConfig  # noqa: E402
from moeadapt.config.presets import get_preset  # noqa: E402
from moeadapt.io import atomic_write_text  # noqa: E402

MODES = ("lora", "full")
TINY = dict(seq=64, mb=2, steps=2, warmup=1)
FULL = dict(seq=4096, mb=2, steps=10, warmup=3)  # warm-up 3: with --cuda-graph the capture is the third step
GRAPH_MODES = {"auto": "auto", "on": True, "off": False}  # --cuda-graph -> train.cuda_graph
LR = {"lora": 1e-3, "full": 1e-4}  # both stacks; AdamW betas (0.9, 0.95), no weight decay (TrainSpec's defaults)


# ------------------------------------------------------------------ the two models
def our_spec(args) -> ModelSpec:
    return get_preset("tiny" if args.tiny else args.preset)


def peer_config(spec: ModelSpec, experts: str = "full"):
    """The transformers KimiLinearConfig closest to `spec` (module docstring: how each dimension is matched)."""
    import transformers

    types = spec.resolved_layer_types()
    if set(types) - {"kda", "dsa"}:
        raise ValueError(f"{spec.name} has {sorted(set(types) - {'kda', 'dsa'})} layers; Kimi Linear has KDA and "
                         "MLA layers only: pick a KDA/DSA preset such as small")
    if spec.score_func != "sigmoid":
        raise ValueError(f"Kimi Linear routes with sigmoid scores; {spec.name} uses {spec.score_func}")
    hidden = spec.hidden_size
    width = spec.moe_intermediate_size
    if experts == "matched":  # as many parameters per expert as ours: width x hidden = ours x latent
        latent = spec.latent_dim or hidden
        if (width * latent) % hidden:
            raise ValueError(f"moe_intermediate_size {width} x latent_dim {latent} is not a multiple of hidden "
                             f"{hidden}; use --peer-experts full")
        width = width * latent // hidden
    shared = (spec.shared_intermediate_size or spec.moe_intermediate_size) * spec.n_shared_experts
    if shared % width:
        raise ValueError(f"the shared expert's width {shared} is not a multiple of the peer's expert width {width} "
                         "(Kimi Linear's shared expert is n_shared_experts x moe_intermediate_size); use "
                         "--peer-experts full")
    cfg = transformers.KimiLinearConfig(
        vocab_size=spec.vocab_size, hidden_size=hidden, num_hidden_layers=spec.n_layers,
        layer_types=["full_attention" if t == "dsa" else "linear_attention" for t in types],
        mlp_layer_types=["dense" if i < spec.first_k_dense else "sparse" for i in range(spec.n_layers)],
        intermediate_size=spec.intermediate_size, moe_intermediate_size=width,
        num_experts=spec.n_routed_experts, num_experts_per_tok=spec.n_experts_per_tok,
        num_shared_experts=shared // width, routed_scaling_factor=spec.routed_scaling_factor,
        norm_topk_prob=spec.norm_topk_prob,
        num_attention_heads=spec.n_heads, num_key_value_heads=spec.n_heads, q_lora_rank=spec.q_lora_rank,
        kv_lora_rank=spec.kv_lora_rank, qk_nope_head_dim=spec.qk_nope_head_dim,
        qk_rope_head_dim=spec.qk_rope_head_dim, v_head_dim=spec.v_head_dim,
        linear_num_heads=spec.kda_n_heads, linear_head_dim=spec.kda_head_dim,
        linear_conv_kernel_dim=spec.kda_conv_size, rms_norm_eps=spec.norm_eps,
        tie_word_embeddings=spec.tie_word_embeddings, model_max_length=spec.max_position_embeddings,
        initializer_range=spec.initializer_range, pad_token_id=None, bos_token_id=None, eos_token_id=None,
        use_cache=False)
    return cfg


def matching_lines(spec: ModelSpec, cfg) -> list[str]:
    types = spec.resolved_layer_types()
    return [
        f"layers {spec.n_layers}: ours {types.count('kda')} KDA + {types.count('dsa')} DSA at {[i for i, t in enumerate(types) if t == 'dsa']}"
        f" = peer's linear_attention / full_attention (MLA) layers; hidden {spec.hidden_size}, vocab {spec.vocab_size}",
        f"KDA {spec.kda_n_heads} heads x {spec.kda_head_dim} (conv {spec.kda_conv_size}) on both; MLA {spec.n_heads} heads, "
        f"q_lora {spec.q_lora_rank}, kv_lora {spec.kv_lora_rank}, nope/rope/v {spec.qk_nope_head_dim}/"
        f"{spec.qk_rope_head_dim}/{spec.v_head_dim} on both; ours adds the lightning indexer ({spec.index_n_heads} x "
        f"{spec.index_head_dim}, top-{spec.index_topk}) and the output gate, the peer attends densely",
        f"MoE: {spec.n_routed_experts} experts top-{spec.n_experts_per_tok}, sigmoid, scale {spec.routed_scaling_factor};"
        f" ours in latent {spec.latent_dim} x ffn {spec.moe_intermediate_size}, the peer at hidden {spec.hidden_size} x "
        f"ffn {cfg.moe_intermediate_size}; shared expert {cfg.moe_intermediate_size * cfg.num_shared_experts} on both; "
        f"first {spec.first_k_dense} layer(s) dense FFN {spec.intermediate_size}",
    ]


# ------------------------------------------------------------------ shared pieces of a child
def token_batches(vocab: int, rows: int, seq: int):
    """The same random rows for both stacks (fixed seed): a PackedDataset as the trainer reads one."""
    from moeadapt.data.dataset import PackedDataset

    g = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, vocab, (rows * seq + 1,), generator=g)
    return PackedDataset(ids[:-1].view(rows, seq).clone(), ids[1:].view(rows, seq).clone())


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed_steps(step, device: torch.device, warmup: int, steps: int) -> dict:
    """Warm-up steps (compiles, autotunes, optimizer states), then `steps` back to back as training runs them (a
    step may overlap the next one's host work): `step_s` is the median interval between the calls, the steady
    rate; `step_mean_s` the whole span / steps, from a device sync before the first to one after the last (it
    includes draining the last step's queued work). The peak memory covers every step after the model was
    built (optimizer states and activations included)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    losses = []
    for _ in range(warmup):
        losses.append(step())
    _sync(device)
    warm_s = time.perf_counter() - t0
    stats0 = torch.cuda.memory_stats(device) if device.type == "cuda" else {}
    marks = [time.perf_counter()]
    for _ in range(steps):
        losses.append(step())
        marks.append(time.perf_counter())
    _sync(device)
    total = time.perf_counter() - marks[0]
    # the first call after the warm-up's sync reads a step the device has finished, so its interval is the host's
    # issue time alone (~7 ms of a ~130 ms step): left out of the intervals, kept in the mean
    gaps = sorted(b - a for a, b in zip(marks[1:], marks[2:])) if steps > 1 else [total]
    cuda = device.type == "cuda"
    losses = [x for x in losses if x is not None]
    return {"step_s": gaps[len(gaps) // 2], "step_mean_s": total / steps, "step_min_s": gaps[0],
            "step_max_s": gaps[-1], "warmup_s": warm_s,
            "loss_first": losses[0], "loss_last": losses[-1],
            "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else None,  # None: not measured
            "reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30 if cuda else None,
            # the caching allocator over the timed steps: cudaMalloc / cudaFree calls and retries (a retry frees
            # cached blocks, which synchronises the device: a host stall)
            **({f"alloc_{k}": torch.cuda.memory_stats(device).get(k, 0) - stats0.get(k, 0)
                for k in ("num_device_alloc", "num_device_free", "num_alloc_retries")} if cuda else {})}


# ------------------------------------------------------------------ ours: the trainer's step
UNFUSE = ("projections", "add_norm", "gate_up")


def unfuse(model, what: set[str]) -> int:
    """Turn the named glue fusions off for an A/B run, by the fallback each has: a no-op forward hook on a member
    makes models/shared_input run that group's layers one by one ("projections": KDA / DSA / MoE / SwiGLU), one on
    a block's FFN norm makes RMSNorm.after_add add and normalise apart ("add_norm"); the experts of full
    fine-tuning run w1 and w3 as two GEMMs each way ("gate_up": no copy pair, ops/moe/gate_up.py). Returns the
    hooks or switches placed."""
    from moeadapt.models.model import Block
    from moeadapt.models.moe import GroupedExperts

    def noop(*_):
        return None

    n = 0
    for m in model.modules():
        if "projections" in what:
            group = getattr(m, "_x_projections", None)
            if group:  # one hooked member runs its whole group layer by layer
                group[0].register_forward_hook(noop)
                n += 1
        if "add_norm" in what and isinstance(m, Block):
            m.ffn_norm.register_forward_hook(noop)
            n += 1
        if "gate_up" in what and isinstance(m, GroupedExperts):
            m._gate_up_pair = lambda *_: None
            n += 1
    return n


def run_ours(args, mode: str) -> dict:
    from moeadapt.data.dataset import Sampler
    from moeadapt.models.model import build_model
    from moeadapt.models.stats import count_parameters
    from moeadapt.train import trainer
    from moeadapt.train.build import build_meta, materialize_shards
    from moeadapt.train.copies import resolve_weight_dtype
    from moeadapt.train.graph import resolve_cuda_graph
    from moeadapt.train.metrics import NullLogger
    from moeadapt.train.trainer import Loop, flops_per_token, lr_lambda, make_optimizer, start_run, train_step

    spec = our_spec(args)
    out_dir = tempfile.mkdtemp(prefix="bench_vs_hf_")
    cfg = RunConfig(model=spec, lora=LoRASpec(rank=args.rank, alpha=2.0 * args.rank) if mode == "lora" else None,
                    train=dict(steps=args.warmup + args.steps, seq_len=args.seq, micro_batch_size=args.mb,
                               lr=LR[mode], output_dir=out_dir, log_every=10**6,
                               weight_copies=args.weight_copies == "on", moment_dtype=args.moments,
                               weight_dtype=args.weights, cuda_graph=GRAPH_MODES[args.cuda_graph]),
                    parallel=dict(reshard_after_forward=args.reshard_after_forward == "on"))
    t0 = time.perf_counter()
    run = start_run(cfg)
    cfg = resolve_weight_dtype(cfg, run, run.device)  # as the trainer settles train.weight_dtype auto
    counts = count_parameters(build_model(spec, "meta"), spec)  # the base model, adapters left out
    model = build_meta(cfg, run.device)
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    fpt = flops_per_token(model, cfg)
    materialize_shards(model, cfg, run)
    off = {w for w in args.unfuse.split(",") if w}
    if off - set(UNFUSE):
        raise SystemExit(f"--unfuse {args.unfuse!r}: expected a comma list of {', '.join(UNFUSE)}")
    if off and not unfuse(model, off):
        raise SystemExit(f"--unfuse {args.unfuse!r}: this model has no such fusion")
    params = [p for p in model.parameters() if p.requires_grad]
    t = cfg.train  # the optimizer and schedule exactly as trainer.train builds them
    opt, copies = make_optimizer(cfg, run, model, params)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg))
    ds = token_batches(spec.vocab_size, args.mb * (args.warmup + args.steps), args.seq)
    sampler = Sampler(ds, args.mb, t.seed, rank=run.data_rank, world=run.data_world)
    lp = Loop(cfg, run, model, params, opt, sched, sampler, NullLogger(), None, fpt, True, copies=copies)
    graphed, _ = resolve_cuda_graph(cfg, run)  # as the trainer settles train.cuda_graph
    if graphed:
        trainer.use_cuda_graph(lp)
    if args.defer_verdict != "auto":  # the run's own choice otherwise (LocalRun / DistributedRun.defer_verdict)
        run.defer_verdict = args.defer_verdict == "on"
    model.train()
    build_s = time.perf_counter() - t0

    # the host's time per step: issuing the step's work, and waiting for the device at the step's one read (the
    # previous step's verdict, `trainer._read`). A wait near zero means the step is bound by the host.
    read, marks = trainer._read, {"wait": 0.0}

    def timed_read(*a):
        t = time.perf_counter()
        try:
            return read(*a)
        finally:
            marks["wait"] += time.perf_counter() - t

    trainer._read = timed_read

    def step() -> float | None:
        t, marks["wait"] = time.perf_counter(), 0.0
        st = train_step(lp)  # the previous step's verdict (None at first)
        marks.setdefault("issue_s", []).append(time.perf_counter() - t - marks["wait"])
        marks.setdefault("wait_s", []).append(marks["wait"])
        if st is not None and st.skipped:
            raise RuntimeError(f"our step {st.step + 1} was skipped ({st.skipped}); the timing would not be of "
                               "full steps")
        return None if st is None else st.loss

    res = timed_steps(step, run.device, args.warmup, args.steps)
    res["unfused"] = sorted(off)
    for k in ("issue", "wait"):  # medians over the timed steps
        v = sorted(marks[f"{k}_s"][args.warmup:])
        res[f"host_{k}_s"] = v[len(v) // 2]
    last = trainer.settle(lp)
    if last is not None and last.skipped:
        raise RuntimeError(f"our step {last.step + 1} was skipped ({last.skipped})")
    if args.profile:  # one more step under the profiler: CUDA time by kernel family (profile_step.py's grouping)
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from profile_step import _triton_families, profile_one

        res["profile"] = profile_one(step, run.device, _triton_families())
    # MFU per GPU as summary.json states it: 6 N (LoRA 4 N), then with attention's own FLOPs
    tps = args.mb * args.seq * run.world / res["step_s"]  # every rank's tokens/s
    res.update(flops_per_token=fpt, attention_flops_per_token=lp.attention_flops_per_token,
               mfu=trainer._mfu(lp, tps), mfu_with_attention=trainer._mfu(lp, tps, attention=True))
    run.finish()
    shutil.rmtree(out_dir, ignore_errors=True)  # nothing is saved there; train.output_dir must name a directory
    return {"side": "ours", "mode": mode, "model": f"moeadapt {spec.name}", "params_total": counts["total"],
            "params_active": counts["active_per_token"], "trainable": n_train, "build_s": build_s,
            "tokens_per_step": args.mb * args.seq * run.world, "world": run.world,
            "precision": (("bf16 frozen base + fp32 adapters" if mode == "lora" else
                           "bf16 weights (stochastically rounded)" if cfg.train.weight_dtype == "bf16" else
                           "fp32 weights split (bf16 + int16 halves)" if cfg.train.weight_dtype == "fp32_split" else
                           "fp32 master weights")
                          + ((", bf16 adapter copies (the lean experts' adapter gradients fp32)" if mode == "lora"
                              else ", bf16 weight copies and gradients") if copies is not None else "")
                          + (", bf16 AdamW moments" if cfg.train.moment_dtype == "bf16" else "")
                          + ", bf16 autocast" if run.device.type == "cuda" else "fp32 (CPU)"),
            "lora_targets": cfg.lora.targets if cfg.lora else None, "cuda_graph": graphed,
            "defer_verdict": run.defer_verdict, "warmup_steps": args.warmup, **res}


# ------------------------------------------------------------------ the peer: transformers + peft
def _resolved(fn) -> str:
    """The module of the implementation transformers picked for a kernel-or-fallback function (its wrapper keeps
    it in a closure cell named `implementation`)."""
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    impl = dict(zip(code.co_freevars, (c.cell_contents for c in cells))).get("implementation") if code else None
    return getattr(impl, "__module__", "?") if impl is not None else "?"


def peer_kernels(device: torch.device) -> dict:
    """Which KDA and short-conv code transformers runs; fla's Triton kernels cannot run on CPU."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mk

    out = {"kda": _resolved(mk.chunk_kimi_delta_attention), "short_conv": _resolved(mk.causal_conv1d_fn)}
    if out["kda"].startswith("fla"):
        import importlib.metadata as md

        if device.type != "cuda":
            raise SystemExit("fla is importable but there is no GPU: transformers would call fla's Triton KDA "
                             "kernels on CPU; run the peer on a GPU, or without fla on the path for its torch fallback")
        out["kda"] += f" (fla-core {md.version('fla-core')})"
    for k, v in out.items():
        if v.startswith("transformers."):
            out[k] = "transformers torch fallback"
    return out


def run_peer(args, mode: str) -> dict:
    import transformers

    from moeadapt.data.dataset import Sampler

    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config-built model: nothing to fetch
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    kernels = peer_kernels(device)
    spec = our_spec(args)
    cfg = peer_config(spec, args.peer_experts)
    cuda = device.type == "cuda"
    t0 = time.perf_counter()
    torch.manual_seed(0)
    dtype = torch.bfloat16 if cuda and mode == "lora" else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    total = sum(p.numel() for p in model.parameters())
    routed = sum(p.numel() for n, p in model.named_parameters() if ".mlp.experts." in n)
    E, K = cfg.num_experts, cfg.num_experts_per_tok
    active = total - (routed - routed * K // E)
    peft_version = None
    if mode == "lora":
        import peft

        peft_version = peft.__version__
        lcfg = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules="all-linear",
                               target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
        model = peft.get_peft_model(model, lcfg)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_train = sum(p.numel() for p in params)
    opt = torch.optim.AdamW(params, lr=LR[mode], betas=(0.9, 0.95), weight_decay=0.0, fused=cuda)
    sampler = Sampler(token_batches(spec.vocab_size, args.mb * (args.warmup + args.steps), args.seq), args.mb, 0)
    amp = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else contextlib.nullcontext
    build_s = time.perf_counter() - t0

    def step() -> float:
        x, _, _ = sampler.next()
        x = x.to(device)
        with amp():
            out = model(input_ids=x, labels=x, use_cache=False)  # transformers shifts the labels itself
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(out.loss.detach())

    res = timed_steps(step, device, args.warmup, args.steps)
    inner = model.get_base_model() if mode == "lora" else model
    return {"side": "peer", "mode": mode, "model": f"transformers {transformers.__version__} KimiLinearForCausalLM"
            + (f" + peft {peft_version}" if peft_version else ""), "params_total": total, "params_active": active,
            "trainable": n_train, "build_s": build_s, "tokens_per_step": args.mb * args.seq, "world": 1,
            "precision": (("bf16 base + fp32 adapters" if mode == "lora" else "fp32 weights") + ", bf16 autocast"
                          if cuda else "fp32 (CPU)"),
            **kernels, "attn_implementation": inner.config._attn_implementation,
            "experts_implementation": inner.config._experts_implementation,
            "peer_moe_intermediate_size": cfg.moe_intermediate_size, "peer_n_shared_experts": cfg.num_shared_experts,
            **res}


def child(args) -> None:
    side, mode = args.child.split(":")
    main_rank = int(os.environ.get("RANK", "0")) == 0
    try:
        row = (run_ours if side == "ours" else run_peer)(args, mode)
    except BaseException as e:  # the parent reports why (an OOM, a missing package) in its table
        if main_rank:
            atomic_write_text(args.result, json.dumps({"side": side, "mode": mode,
                                                       "error": " ".join(f"{type(e).__name__}: {e}".split())[:300]}))
        raise
    row["tokens_per_s"] = row["tokens_per_step"] / row["step_s"]
    row["device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    print(json.dumps(row), flush=True)
    if main_rank:
        atomic_write_text(args.result, json.dumps(row))


# ------------------------------------------------------------------ the parent: one subprocess per run
def _versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0], "torch": torch.__version__}
    for d in ("transformers", "peft", "fla-core", "triton"):
        try:
            out[d] = md.version(d)
        except md.PackageNotFoundError:
            out[d] = None
    return out  # no CUDA call here: the parent holds no context on the GPU the runs measure


def spawn(args, side: str, mode: str, deadline: float) -> dict:
    cap = int(min(args.child_timeout, deadline - time.monotonic()))
    if cap < 30:
        return {"side": side, "mode": mode, "error": f"not run: --budget {args.budget}s spent", "wall_s": 0.0}
    with tempfile.TemporaryDirectory() as tmp:
        res = Path(tmp) / "row.json"
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", f"{side}:{mode}", "--result", str(res),
               "--seq", str(args.seq), "--mb", str(args.mb), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--rank", str(args.rank), "--preset", args.preset, "--peer-experts", args.peer_experts]
        cmd += ["--tiny"] if args.tiny else []
        cmd += ["--profile"] if args.profile and side == "ours" else []
        cmd += ["--cuda-graph", args.cuda_graph] if side == "ours" else []
        cmd += ["--defer-verdict", args.defer_verdict] if side == "ours" else []
        cmd += ["--reshard-after-forward", args.reshard_after_forward] if side == "ours" else []
        cmd += ["--weight-copies", args.weight_copies] if side == "ours" else []
        cmd += ["--moments", args.moments] if side == "ours" else []
        cmd += ["--weights", args.weights] if side == "ours" and mode == "full" else []
        cmd += ["--unfuse", args.unfuse] if side == "ours" and args.unfuse else []
        print(f"\n== {side} {mode}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        try:  # the run's output goes straight to ours: what it printed survives a kill of this process
            rc = subprocess.run(cmd, timeout=cap).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.perf_counter() - t0
        row = json.loads(res.read_text()) if res.exists() else {}
        if rc == 0 and "error" not in row and row:
            return {**row, "wall_s": wall}
        why = f"timed out after {cap}s" if rc == "timeout" else row.get("error", f"exit status {rc}")
        return {"side": side, "mode": mode, "error": why, "wall_s": wall}


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _fmt(v, spec: str) -> str:
    return "–" if v is None else format(v, spec)


def table(rows: list[dict]) -> str:
    out = ["| mode | side | model | params total / active | trainable | tokens/s | ms/step median (min-max) | "
           "peak GiB | ours/peer tokens/s | ours/peer peak |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['mode']} | {r['side']} | failed: {r['error']} | | | | | | | |")
            continue
        peer = next((p for p in rows if p["side"] == "peer" and p["mode"] == r["mode"] and "error" not in p), None)
        ratio_t = ratio_m = "–"
        if r["side"] == "ours" and peer:
            ratio_t = f"**{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x**"
            if r["peak_gib"] is not None and peer["peak_gib"]:
                ratio_m = f"{r['peak_gib'] / peer['peak_gib']:.2f}x"
        out.append(f"| {r['mode']} | {r['side']} | {r['model']} | {_count(r['params_total'])} / "
                   f"{_count(r['params_active'])} | {_count(r['trainable'])} | {r['tokens_per_s']:,.0f} | "
                   f"{1e3 * r['step_s']:.1f} ({1e3 * r['step_min_s']:.1f}-{1e3 * r['step_max_s']:.1f}) | "
                   f"{_fmt(r['peak_gib'], '.1f')} | {ratio_t} | {ratio_m} |")
    return "\n".join(out)


def plot(rows: list[dict], path: Path, title: str) -> str:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed: no plot"
    ok = [r for r in rows if "error" not in r]
    modes = [m for m in MODES if any(r["mode"] == m for r in ok)]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for ax, key, label in ((axes[0], "tokens_per_s", "tokens/s"), (axes[1], "peak_gib", "peak memory (GiB)")):
        for j, (side, color) in enumerate((("ours", "C0"), ("peer", "C1"))):
            xs = [i + (j - 0.5) * 0.38 for i, m in enumerate(modes)]
            ys = [next((r[key] for r in ok if r["side"] == side and r["mode"] == m), None) or 0.0 for m in modes]
            bars = ax.bar(xs, ys, 0.38, color=color, label="moeadapt" if side == "ours" else "transformers + peft")
            ax.bar_label(bars, fmt="%.0f" if key == "tokens_per_s" else "%.1f", fontsize=8)
        ax.set_xticks(range(len(modes)), ["LoRA r=16" if m == "lora" else "full FT" for m in modes])
        ax.set_ylabel(label)
        ax.grid(axis="y", alpha=0.3)
    if not any(r["peak_gib"] for r in ok):
        axes[1].text(0.5, 0.5, "no CUDA: peak memory not measured", ha="center", transform=axes[1].transAxes)
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(f".{path.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
    return f"plot: {path}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--part", default="all", choices=["ours", "peer", "all"])
    p.add_argument("--modes", default="lora,full", help="comma list of lora | full")
    p.add_argument("--steps", type=int, default=None, help="timed steps (median); default 10, --tiny 2")
    p.add_argument("--warmup", type=int, default=None,
                   help="untimed steps first; default 3, --tiny 1 (at least 3 where the step is captured: the capture is untimed)")
    p.add_argument("--seq", type=int, default=None, help="tokens per row; default 4096, --tiny 64")
    p.add_argument("--mb", type=int, default=None, help="rows per step (micro-batch); default 2")
    p.add_argument("--rank", type=int, default=16, help="LoRA rank (alpha = 2 x rank on both sides)")
    p.add_argument("--preset", default="small", help="our model preset (a KDA/DSA one)")
    p.add_argument("--peer-experts", default="full", choices=["full", "matched"],
                   help="full: the peer's experts keep our FFN width at the hidden size (the issue's 5.0B "
                        "baseline); matched: width scaled by latent/hidden so each expert has our parameter count")
    p.add_argument("--tiny", action="store_true", help="tiny dimensions (the `tiny` preset, seq 64) for a CPU "
                   "smoke run of both sides")
    p.add_argument("--child-timeout", type=int, default=300, help="seconds one subprocess may run")
    p.add_argument("--budget", type=int, default=450, help="seconds for all subprocesses together: the last ones "
                   "get what is left (none under 30 s), so the table is printed within a device time cap")
    p.add_argument("--out", default=None, help="write bench_vs_transformers.json (+ .png) into this directory")
    p.add_argument("--profile", action="store_true", help="our side: profile one extra step and save its CUDA time "
                   "by kernel family in the row")
    p.add_argument("--cuda-graph", nargs="?", const="on", default="auto", choices=list(GRAPH_MODES), help="our "
                   "side: train.cuda_graph (the step's forwards and backwards captured once and replayed); auto, the "
                   "default: as the trainer settles it (captured in one process on a GPU); bare --cuda-graph: on; "
                   "off: eager steps")
    p.add_argument("--defer-verdict", default="auto", choices=["auto", "on", "off"], help="our side: read each "
                   "step's verdict one step late (on) or before its optimizer step (off); auto: as the trainer does")
    p.add_argument("--reshard-after-forward", default="on", choices=["on", "off"], help="our side under torchrun: "
                   "FSDP2 frees each block's gathered parameters after its forward (on, the default) or keeps them "
                   "for the backward (off: no second all-gather, one more unsharded copy of the model)")
    p.add_argument("--weight-copies", default="on", choices=["on", "off"], help="our side, full fine-tuning: "
                   "train.weight_copies (bf16 weight copies and bf16 gradients; off: autocast's casts)")
    p.add_argument("--moments", default="fp32", choices=["fp32", "bf16"], help="our side: train.moment_dtype "
                   "(AdamW's moments in bf16, stochastically rounded; on a GPU)")
    p.add_argument("--weights", default="auto", choices=["auto", "fp32", "bf16", "fp32_split"], help="our side, "
                   "full fine-tuning: train.weight_dtype (bf16: the trained weights in bf16, stochastically rounded; "
                   "fp32_split: fp32 weights as a bf16 half and an int16 half, one GPU; auto: the trainer's "
                   "default, fp32_split where it runs)")
    p.add_argument("--unfuse", default="", help="our side: comma list of glue fusions to turn off for an A/B run "
                   f"in one tree ({', '.join(UNFUSE)}; see `unfuse`)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    for k, v in (TINY if args.tiny else FULL).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    # the step that captures the graph is a warm-up step, never a timed one (both sides alike)
    if args.cuda_graph == "on" or (args.cuda_graph == "auto" and torch.cuda.is_available()):
        from moeadapt.train.graph import WARMUP as GRAPH_WARMUP

        args.warmup = max(args.warmup, GRAPH_WARMUP + 1)
    if args.child:
        return child(args)
    modes = [m for m in args.modes.split(",") if m]
    if set(modes) - set(MODES):
        p.error(f"--modes {args.modes}: choose from {', '.join(MODES)}")
    if min(args.rank, args.seq, args.mb, args.steps) < 1 or args.warmup < 0:
        p.error("--rank, --seq, --mb and --steps must be >= 1 and --warmup >= 0")
    spec = our_spec(args)
    cfg = peer_config(spec, args.peer_experts)
    versions = _versions()
    head = (f"{spec.name} vs transformers KimiLinearForCausalLM (peer experts: {args.peer_experts}); seq {args.seq} x "
            f"mb {args.mb}, {args.warmup} warm-up + {args.steps} timed steps (median); {versions}")
    print(head + "\nmatching:\n  " + "\n  ".join(matching_lines(spec, cfg)), flush=True)
    sides = ["ours", "peer"] if args.part == "all" else [args.part]
    out = Path(args.out) if args.out else None
    deadline, rows = time.monotonic() + args.budget, []
    for mode in modes:
        for side in sides:
            rows.append(spawn(args, side, mode, deadline))
            if out:  # after every run: what finished survives a kill of this process
                out.mkdir(parents=True, exist_ok=True)
                atomic_write_text(out / "bench_vs_transformers.json", json.dumps(
                    {"args": vars(args), "versions": versions, "matching": matching_lines(spec, cfg), "rows": rows},
                    indent=1))
    print("\n" + head + "\n")
    print(table(rows))
    for r in rows:
        if r["side"] == "peer" and "error" not in r:
            print(f"peer {r['mode']}: KDA {r['kda']}, short conv {r['short_conv']}, attention {r['attn_implementation']}, experts "
                  f"{r['experts_implementation']}, {r['precision']}; loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}")
        elif "error" not in r:
            print(f"ours {r['mode']}: {r['precision']}; loss {r['loss_first']:.3f} -> {r['loss_last']:.3f}")
    if out:
        where = next((r["device"] for r in rows if "device" in r), "?")
        print(plot(rows, out / "bench_vs_transformers.png",
                   f"{spec.name} (moeadapt) vs KimiLinearForCausalLM (transformers {versions['transformers']} + peft "
                   f"{versions['peft']}, experts {args.peer_experts}); seq {args.seq} x mb {args.mb}; {where}"))
    if any("error" in r for r in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
