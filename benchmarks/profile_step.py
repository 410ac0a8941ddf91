"""One training step of a preset (default `small`, seq 4096 x micro-batch 2, bf16 autocast, single process, no
activation checkpointing), profiled: tokens/s, MFU, peak memory and CUDA time grouped by kernel family, for the
step-level levers switched on one after another in the SAME process (so every ratio comes from one run).

Levers (cumulative, in this order; `--variants` picks a subset by name):
  baseline      the pre-lever step: torch conv1d + transposes for the KDA short convs, logits + F.cross_entropy
                in fp32, RMSNorm keeping the residual stream's fp32 (each projection casts it again), foreach AdamW
  +conv         ops.kda.causal_conv_silu: the three short convs + SiLU in Triton (one pass forward, two backward), no transposes
  +loss         ops.loss.linear_cross_entropy (chunked): no [tokens x vocab] fp32 logits
  +norm_cast    RMSNorm emits the autocast dtype: one cast per norm instead of one per consuming GEMM
  +fused_adamw  torch.optim.AdamW(fused=True)
  +compile_norm RMSNorm (and the KDA output gate, and the residual add before the FFN norm, folded into it)
                through torch.compile, the model's default
  +compile_static  the same compiled with static shapes (one graph per shape) instead of dynamic ones
Full fine-tuning (fp32 master weights) runs every variant; LoRA r = 16 (frozen bf16 base, the trainer's layout)
runs baseline and the final variant. Kernel families: our Triton kernels by the ops/ folder that defines them
(KDA, DSA, MoE, conv), the rest by name (GEMM, elementwise+copy, norm+reduce, optimizer, index/sort, compiled).

MFU = 6 * (active params per token - embeddings) * tokens/s / 790e12 (the H200 bf16 rate measured here; LoRA:
2/3 of that, as the trainer counts); "+attn" adds the attention score FLOPs (DSA QK and PV over the selected keys
in latent MQA form, the indexer's causal scores forward only, KDA's chunked state and intra-chunk products).

Run (one GPU, ~3 minutes):  python benchmarks/profile_step.py --out /tmp/prof
CPU smoke run:              python benchmarks/profile_step.py --preset tiny --seq-len 64 --steps 1 --warmup 1
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from moeadapt.config import LoRASpec  # noqa: E402
from moeadapt.config.presets import get_preset  # noqa: E402
from moeadapt.lora import cast_frozen_, inject_lora  # noqa: E402
from moeadapt.models.common import CausalConv1d, RMSNorm  # noqa: E402
from moeadapt.models.model import build_model, materialize  # noqa: E402
from moeadapt.models.router import update_expert_bias  # noqa: E402
from moeadapt.models.stats import attention_flops_per_token, count_parameters  # noqa: E402

PEAK = 790e12
_BASE = dict(conv="reference", loss="reference", norm_cast=False, fused_adamw=False, compile_norm=False,
             compile_static=False)
_STEPS = [("+conv", dict(conv="auto")), ("+loss", dict(loss="auto")), ("+norm_cast", dict(norm_cast=True)),
          ("+fused_adamw", dict(fused_adamw=True)), ("+compile_norm", dict(compile_norm=True)),
          ("+compile_static", dict(compile_static=True))]


def variants() -> dict[str, dict]:
    out, cur = {"baseline": dict(_BASE)}, dict(_BASE)
    for name, change in _STEPS:
        cur = {**cur, **change}
        out[name] = dict(cur)
    return out


# ------------------------------------------------------------------ kernel families
def _triton_families() -> dict[str, str]:
    """Kernel function name -> family, for every Triton / Gluon kernel our ops define."""
    import importlib
    import pkgutil

    import moeadapt.ops as ops

    fam: dict[str, str] = {}
    for info in pkgutil.walk_packages(ops.__path__, "moeadapt.ops."):
        try:
            mod = importlib.import_module(info.name)
        except Exception:  # a backend whose import needs a missing extra: its kernels stay unnamed
            continue
        folder = info.name.split(".")[2]
        label = {"kda": "KDA", "dsa": "DSA", "moe": "MoE", "loss": "loss", "optim": "optimizer"}.get(folder, folder)
        if info.name.endswith("triton_conv"):
            label = "conv"
        for name, obj in vars(mod).items():
            if "JIT" in type(obj).__name__ or hasattr(obj, "fn") and callable(getattr(obj, "run", None)):
                fam.setdefault(name, label)
    return fam


_PATTERNS = [("compiled", r"^triton_(poi|per|red|tem)_"), ("GEMM", r"gemm|cutlass|xmma|nvjet|wgmma|cublas|splitk"),
             ("conv", r"conv|depthwise"), ("optimizer", r"adam|multi_tensor|foreach|fused_adam"),
             ("norm+reduce", r"norm|reduce|rsqrt"),
             ("index/sort", r"index|sort|scatter|gather|radix|topk|cumsum|scan|nonzero|unique|embedding|histc|bucket"),
             ("elementwise+copy", r"elementwise|copy|cat|fill|vectorized|unrolled|memcpy|memset|where|clamp")]


def family(name: str, triton_fam: dict[str, str]) -> str:
    base = name.split("(")[0].strip()
    if base in triton_fam:
        return triton_fam[base]
    low = name.lower()
    for fam, pat in _PATTERNS:
        if re.search(pat, low):
            return fam
    return "other"


# GPU-side ranges the profiler draws for CPU-side annotations (Optimizer.step#AdamW.step, ProfilerStep#N, FSDP2's
# FSDP::pre_forward (layers.i) ..., inductor's "## Call CompiledFxGraph <hash> ##" around a compiled graph's
# kernels in an eager step): not kernels, and they overlap the kernels they enclose ('#' alone is no sign:
# demangled lambdas carry it)
_ANNOTATION = re.compile(r"^(ProfilerStep|Optimizer\.|FSDP::|## Call CompiledFxGraph)")


def profile_one(fn, device: torch.device, triton_fam: dict[str, str]) -> dict:
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts, record_shapes=device.type == "cuda") as prof:
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    want = torch.autograd.DeviceType.CUDA if device.type == "cuda" else torch.autograd.DeviceType.CPU
    fams: dict[str, float] = {}
    kernels: dict[str, float] = {}
    counted: dict[str, list] = {}  # kernel name (160 characters) -> [launches, ms]
    avgs = prof.key_averages()  # one aggregation of the events, read three ways below
    for e in avgs:
        if e.device_type != want or (device.type == "cuda" and _ANNOTATION.search(e.key)):
            continue
        us = (getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
              if device.type == "cuda" else e.self_cpu_time_total)
        if not us:
            continue
        f = family(e.key, triton_fam)
        fams[f] = fams.get(f, 0.0) + us / 1e3
        kernels[e.key[:90]] = kernels.get(e.key[:90], 0.0) + us / 1e3
        row = counted.setdefault(e.key[:160], [0, 0.0])
        row[0] += e.count
        row[1] += us / 1e3
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:40]
    ops = []  # the aten ops whose kernels take the time, with their input shapes (CUDA only)
    if device.type == "cuda":
        for e in prof.key_averages(group_by_input_shape=True):
            us = getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)
            if e.device_type == torch.autograd.DeviceType.CPU and us and e.key.startswith("aten::"):
                ops.append((e.key, str(e.input_shapes)[:80], e.count, us / 1e3))
        ops = sorted(ops, key=lambda r: -r[3])[:120]
    # the host side: where the step's CPU time goes (a step whose host time exceeds its CUDA time is launch-bound;
    # a blocking read such as aten::_local_scalar_dense shows here as the host waiting for the device)
    host = [(e.key, e.count, e.self_cpu_time_total / 1e3) for e in avgs
            if e.device_type == torch.autograd.DeviceType.CPU and e.self_cpu_time_total]
    host = sorted(host, key=lambda r: -r[2])
    # FSDP2's annotated phases (unshard / copy-in / reduce-scatter ...): host time including the ops inside
    fsdp = sorted(((e.key, e.count, e.cpu_time_total / 1e3) for e in avgs
                   if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith("FSDP")),
                  key=lambda r: -r[2])
    return {"fsdp_host_ms": fsdp[:25], "families_ms": dict(sorted(fams.items(), key=lambda kv: -kv[1])),
            "total_ms": sum(fams.values()), "top_kernels_ms": top, "top_ops_ms": ops,
            "kernels": sorted(([k, n, ms] for k, (n, ms) in counted.items()), key=lambda r: -r[2])[:200],
            "host_ms": sum(r[2] for r in host), "top_host_ms": host[:25]}


# ------------------------------------------------------------------ switching the levers
_compile_static = False


def configure(model, v: dict) -> None:
    global _compile_static
    if v["compile_static"] != _compile_static:  # benchmark-only: swap the model's compiled norm function
        import moeadapt.models.common as common

        torch._dynamo.reset()
        for fn in (common.rms_norm, common.add_rms_norm):
            common._COMPILED[fn] = torch.compile(fn, dynamic=not v["compile_static"])
        _compile_static = v["compile_static"]
    model.set_backend("auto")
    model.backend = v["loss"]
    for m in model.modules():
        if isinstance(m, CausalConv1d):
            m.backend = v["conv"]
        if isinstance(m, RMSNorm):
            m.autocast_output = v["norm_cast"]
            m.compiled = v["compile_norm"]


def make_opt(params, v: dict, device):
    kw = dict(lr=1e-5, betas=(0.9, 0.95), weight_decay=0.1)
    if v["fused_adamw"] and device.type == "cuda":
        return torch.optim.AdamW(params, fused=True, **kw)
    return torch.optim.AdamW(params, foreach=True, **kw)


def train_step(model, opt, params, inp, lab, amp) -> torch.Tensor:
    with amp():
        out = model(inp, lab, return_logits=False)
    (out.loss + out.aux_loss).backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    update_expert_bias(model)
    return out.loss.detach()


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_mode(mode: str, names: list[str], args, spec, device, triton_fam) -> list[dict]:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    model = materialize(build_model(spec, "meta"), device, seed=0)
    if mode == "lora":
        inject_lora(model, LoRASpec(rank=16))
        if device.type == "cuda":
            cast_frozen_(model, torch.bfloat16)
    counts = count_parameters(model, spec)
    fpt = 6 * (counts["active_per_token"] - counts["by_component"].get("embeddings", 0))
    fpt_basis = fpt * (2 / 3 if mode == "lora" else 1.0)
    afpt = attention_flops_per_token(spec, args.seq_len)  # MFU "+attn": attention's own FLOPs too
    params = [p for p in model.parameters() if p.requires_grad]
    g = torch.Generator(device=device).manual_seed(1)
    x = torch.randint(0, spec.vocab_size, (args.micro_batch, args.seq_len + 1), device=device, generator=g)
    inp, lab = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    amp = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda"
           else contextlib.nullcontext)
    all_v = variants()
    rows = []
    for i, name in enumerate(names):
        v = all_v[name]
        configure(model, v)
        opt = make_opt(params, v, device)
        t_first = time.perf_counter()
        for _ in range(args.warmup + (1 if i == 0 else 0)):
            train_step(model, opt, params, inp, lab, amp)
        _sync(device)
        warm_s = time.perf_counter() - t_first
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times, loss = [], float("nan")
        for _ in range(args.steps):
            _sync(device)
            t0 = time.perf_counter()
            lt = train_step(model, opt, params, inp, lab, amp)
            _sync(device)
            times.append(time.perf_counter() - t0)
            loss = float(lt)
        dt = sorted(times)[len(times) // 2]
        tok = args.micro_batch * args.seq_len
        row = {"mode": mode, "variant": name, "step_s": dt, "step_min_s": min(times), "step_max_s": max(times),
               "tokens_per_s": tok / dt, "mfu": tok / dt * fpt_basis / PEAK,
               "mfu_attn": tok / dt * (fpt_basis + afpt) / PEAK,
               "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else float("nan"),
               "loss": loss, "warmup_s": warm_s}
        if name in args.profile.split(","):
            prof = profile_one(lambda m=model, o=opt, ps=params: train_step(m, o, ps, inp, lab, amp), device, triton_fam)
            row["profile"] = prof
            row["gpu_busy_frac"] = prof["total_ms"] / 1e3 / dt
        print(json.dumps({k: v for k, v in row.items() if k != "profile"}), flush=True)
        rows.append(row)
        del opt
    configure(model, all_v["baseline"])
    del model, params
    return rows


def check_ops(device) -> list[dict]:
    """The new ops at the small preset's shapes against their references (fp32 on upcast inputs) on this device,
    and each one's fwd+bwd time next to the code it replaces."""
    from moeadapt.ops.kda.short_conv import causal_conv_silu, causal_conv_silu_reference
    from moeadapt.ops.loss import linear_cross_entropy

    def rel(a, b):
        return float((a.float() - b.float()).norm() / b.float().norm())

    def timed(fn, n=10):
        fn()
        _sync(device)
        ts = []
        for _ in range(n):
            _sync(device)
            t0 = time.perf_counter()
            fn()
            _sync(device)
            ts.append(time.perf_counter() - t0)
        return sorted(ts)[n // 2] * 1e3

    out = []
    B, T, C = 2, 4096, 2048
    x = torch.randn(B, T, C, device=device).bfloat16().requires_grad_()
    w = (torch.randn(C, 1, 4, device=device) * 0.5).requires_grad_()
    dy = torch.randn(B, T, C, device=device).bfloat16()
    y = causal_conv_silu(x, w, backend="triton")
    y.backward(dy)
    gx, gw = x.grad.clone(), w.grad.clone()
    xr, wr = x.detach().float().requires_grad_(), w.detach().clone().requires_grad_()
    yr = causal_conv_silu_reference(xr, wr)
    yr.backward(dy.float())
    row = {"op": "causal_conv_silu [2,4096,2048] bf16", "rel_y": rel(y, yr), "rel_dx": rel(gx, xr.grad),
           "rel_dw": rel(gw, wr.grad), "nan": bool(torch.isnan(y).any() or torch.isnan(gx).any())}

    def run(fn):
        def f():
            x.grad = None
            w.grad = None
            fn(x, w).backward(dy)
        return f

    with torch.autocast("cuda", dtype=torch.bfloat16):
        row["ms_triton_fwd_bwd"] = timed(run(lambda a, b: causal_conv_silu(a, b, backend="triton")))
        row["ms_reference_fwd_bwd"] = timed(run(causal_conv_silu_reference))
    out.append(row)

    N, D, V = 8192, 2048, 32768
    h = (torch.randn(N, D, device=device) * 0.5).requires_grad_()
    W = (torch.randn(V, D, device=device) * 0.02).requires_grad_()
    lab = torch.randint(0, V, (N,), device=device)
    lab[::7] = -100
    valid = (lab != -100).float()
    wt = valid / valid.sum()
    res = {}
    for be in ("chunked", "reference"):
        h.grad, W.grad = None, None
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = linear_cross_entropy(h, W, lab, wt, backend=be)
        loss.backward()
        res[be] = (float(loss), h.grad.clone(), W.grad.clone(),
                   (torch.cuda.max_memory_allocated(device) - base) / 2**30)

    def ce_step(be):
        def f():
            h.grad, W.grad = None, None
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = linear_cross_entropy(h, W, lab, wt, backend=be)
            loss.backward()
        return f

    out.append({"op": "linear_cross_entropy [8192,2048]x[32768,2048] bf16",
                "rel_loss": abs(res["chunked"][0] - res["reference"][0]) / abs(res["reference"][0]),
                "rel_dh": rel(res["chunked"][1], res["reference"][1]),
                "rel_dW": rel(res["chunked"][2], res["reference"][2]),
                "extra_peak_gib_chunked": res["chunked"][3], "extra_peak_gib_reference": res["reference"][3],
                "ms_chunked_fwd_bwd": timed(ce_step("chunked")), "ms_reference_fwd_bwd": timed(ce_step("reference"))})
    for r in out:
        print(json.dumps(r), flush=True)
    return out


def check_model(spec, device, args, names: list[str]) -> list[dict]:
    """Loss and gradients of one forward/backward, baseline (twice: the run-to-run floor of the atomics in
    the kernels) vs each variant in `names`, on the same weights and batch. Also the three parameters whose
    gradients moved most."""
    model = materialize(build_model(spec, "meta"), device, seed=0)
    g = torch.Generator(device=device).manual_seed(2)
    x = torch.randint(0, spec.vocab_size, (args.micro_batch, args.seq_len + 1), device=device, generator=g)
    amp = ((lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if device.type == "cuda"
           else contextlib.nullcontext)

    def grads(name):
        configure(model, variants()[name])
        model.zero_grad(set_to_none=True)
        with amp():
            out = model(x[:, :-1], x[:, 1:], return_logits=False)
        out.loss.backward()
        return float(out.loss), {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}

    ref_loss, ref = grads("baseline")
    ref_flat = torch.cat([t.flatten() for t in ref.values()])
    rows = []
    for name in ["baseline", "baseline, embeddings x (1 + 2^-9 noise)"] + list(names):
        if name.startswith("baseline,"):  # a bf16-rounding-sized change of the input: routing's sensitivity
            saved = model.embed.weight.detach().clone()
            with torch.no_grad():
                model.embed.weight.mul_(1 + 2.0 ** -9 * torch.randn_like(saved))
            loss, gr = grads("baseline")
            with torch.no_grad():
                model.embed.weight.copy_(saved)
        else:
            loss, gr = grads(name)
        flat = torch.cat([gr[n].flatten() for n in ref])
        per = sorted(((float((gr[n] - ref[n]).norm() / ref[n].norm().clamp(min=1e-30)), n) for n in ref),
                     reverse=True)[:3]
        keep = [n for n in ref if "router" not in n]
        no_router = float(torch.cat([(gr[n] - ref[n]).flatten() for n in keep]).norm()
                          / torch.cat([ref[n].flatten() for n in keep]).norm())
        rows.append({"check": f"one fwd/bwd, baseline vs {name}", "loss_baseline": ref_loss, "loss": loss,
                     "rel_grad": float((flat - ref_flat).norm() / ref_flat.norm()), "rel_grad_no_router": no_router,
                     "worst_params": [(n, round(r, 4)) for r, n in per]})
        print(json.dumps(rows[-1]), flush=True)
    configure(model, variants()["baseline"])
    return rows


def _table(rows: list[dict]) -> str:
    lines = ["| mode | variant | tokens/s | vs baseline | MFU 6N | MFU +attn | peak GiB | step ms (min-max) |",
             "|---|---|---:|---:|---:|---:|---:|---|"]
    base = {}
    for r in rows:
        base.setdefault(r["mode"], r["tokens_per_s"])
        lines.append(f"| {r['mode']} | {r['variant']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s'] / base[r['mode']]:.2f}x | {100 * r['mfu']:.1f}% | "
                     f"{100 * r['mfu_attn']:.1f}% | {r['peak_gib']:.1f} | {1e3 * r['step_s']:.1f} "
                     f"({1e3 * r['step_min_s']:.1f}-{1e3 * r['step_max_s']:.1f}) |")
    return "\n".join(lines)


def _family_table(rows: list[dict]) -> str:
    profs = [(f"{r['mode']} {r['variant']}", r["profile"]) for r in rows if "profile" in r]
    if not profs:
        return ""
    fams = sorted({f for _, p in profs for f in p["families_ms"]},
                  key=lambda f: -max(p["families_ms"].get(f, 0) for _, p in profs))
    lines = ["| family (ms CUDA) | " + " | ".join(n for n, _ in profs) + " |",
             "|---|" + "---:|" * len(profs)]
    for f in fams:
        lines.append(f"| {f} | " + " | ".join(f"{p['families_ms'].get(f, 0):.1f}" for _, p in profs) + " |")
    lines.append("| **total** | " + " | ".join(f"{p['total_ms']:.1f}" for _, p in profs) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--variants", default="baseline,+conv,+loss,+norm_cast,+fused_adamw,+compile_norm,+compile_static")
    p.add_argument("--lora-variants", default="baseline,+compile_norm")
    p.add_argument("--profile", default="baseline,+compile_norm", help="variants to profile (one extra step each)")
    p.add_argument("--skip-checks", action="store_true")
    p.add_argument("--out", default=None, help="write profile_step.json here (a directory)")
    args = p.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = get_preset(args.preset, **({"n_layers": args.layers} if args.layers else {}))
    triton_fam = _triton_families()
    print(f"{spec.name}: seq {args.seq_len} x mb {args.micro_batch}, device {device}"
          f" {torch.cuda.get_device_name(device) if device.type == 'cuda' else ''}, torch {torch.__version__}",
          flush=True)
    result: dict = {"args": vars(args)}
    if not args.skip_checks and device.type == "cuda":
        result["ops"] = check_ops(device)
        result["model_check"] = check_model(spec, device, args, [n for n in args.variants.split(",")[1:]
                                                                 if n != "+compile_static"])
    rows = run_mode("full", args.variants.split(","), args, spec, device, triton_fam)
    if args.lora_variants:
        rows += run_mode("lora", args.lora_variants.split(","), args, spec, device, triton_fam)
    result["rows"] = rows
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "profile_step.json").write_text(json.dumps(result, indent=1))
    for r in rows:
        if "profile" in r:
            print(f"\ntop kernels, {r['mode']} {r['variant']}:")
            for k, ms in r["profile"]["top_kernels_ms"]:
                print(f"  {ms:8.2f} ms  [{family(k, triton_fam)}] {k}")
    print("\n" + _table(rows) + "\n\n" + _family_table(rows))


if __name__ == "__main__":
    main()
