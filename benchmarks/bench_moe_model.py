"""The model's own LatentMoE layer (moeadapt.models.moe, as `train` builds it), frozen bf16 base with and without
grouped LoRA r = 16 on the experts' w1 / w3 / w2, forward + backward, at bench_moe.py's shapes (T = 16384,
hidden 4096, latent 1024, expert ffn 1024, no shared expert, dropless, the router's own routing of random input).

bench_moe.py times a packed re-implementation of the layer ([E, 2F, L] gate/up); this times the module users
train, whose w1 and w3 are separate (two gate/up GEMMs, their SwiGLU through ops/moe swiglu_pair). Overhead =
median LoRA ms / median frozen ms - 1 over interleaved rounds (do_bench means, L2 flushed).

    python benchmarks/bench_moe_model.py [--cases 64x8,256x16,896x16] [--rounds 5] [--out model.jsonl]
        [--bubbles]          host enqueue time vs wall time vs summed kernel time of one step (is it host-bound?)
        [--host-profile]     where the host time goes (Triton launches, cProfile of forward and Python backwards)
        [--router-matmul M]  the router's logit GEMM (ModelSpec.router_matmul: bf16x2, tf32, fp32, bf16)
        [--no-buffer B ...]  also time the LoRA layer without its [W | Bᵀ] buffers (released as parallelize_model
                             does before FSDP2 shards the experts), once per expert LoRA backend B (auto, torch,
                             triton), interleaved with the others: the FSDP2 paths at one GPU's cost
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from moeadapt.config import LoRASpec, get_preset  # noqa: E402
from moeadapt.lora import cast_frozen_, inject_lora  # noqa: E402
from moeadapt.models.moe import LatentMoE  # noqa: E402

EXPERT_TARGETS = ["experts.w1", "experts.w3", "experts.w2"]
DEV = "cuda"


def _wall(fn, warmup=0, rep=0):
    import time

    t = time.perf_counter()
    fn()
    return 1e3 * (time.perf_counter() - t)


def build(E, K, D, L, F, lora, seed=0, lora_backend="auto", router_matmul=None, release=False):
    update = dict(hidden_size=D, latent_dim=L, moe_intermediate_size=F, n_routed_experts=E, n_experts_per_tok=K,
                  n_shared_experts=0, capacity_factor=None)
    if router_matmul is not None:  # else ModelSpec's default
        update["router_matmul"] = router_matmul
    spec = get_preset("small").model_copy(update=update)
    torch.manual_seed(seed)
    m = LatentMoE(spec).to(DEV, torch.float32)
    with torch.no_grad():
        for n, p in m.named_parameters():
            p.normal_(0.0, p.shape[-1] ** -0.5 if p.dim() > 1 else 0.0)
            if p.dim() == 1:
                p.fill_(1.0 if "norm" in n else 0.0)
    for p in m.parameters():
        p.requires_grad_(False)
    if lora:
        inject_lora(m, LoRASpec(rank=16, targets=EXPERT_TARGETS))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.01)
        for w in (m.experts.w1, m.experts.w3, m.experts.w2):
            w.backend = lora_backend  # "fused": lean_lora.py at any rows per expert (where "auto" picks Triton)
    cast_frozen_(m, torch.bfloat16)
    if release:  # no [W | Bᵀ] or gate/up buffers, as under FSDP2 (parallel/parallelize.py)
        m.experts.release_cat()
        for w in (m.experts.w1, m.experts.w3, m.experts.w2):
            w.release_cat()
    return m


def _lora_path(step) -> str:
    """Which expert path one LoRA step takes: lean_lora.py (with the experts' gate/up buffer: one dx GEMM for
    gate/up) or grouped_lora's auto choice."""
    from moeadapt.ops.moe import lean_lora

    fn, calls = lean_lora.lean_lora_experts, []

    def counted(*args, **kw):
        calls.append(kw.get("wk_gu") is not None)
        return fn(*args, **kw)
    lean_lora.lean_lora_experts = counted
    try:
        step()
    finally:
        lean_lora.lean_lora_experts = fn
    if not calls:
        return "grouped_lora auto"
    return "lean + gate/up buffer" if all(calls) else "lean"


def _forward(m, h):
    with torch.autocast(DEV, dtype=torch.bfloat16):
        return m(h)[0]


def _backward(m, h, out, g_out):
    """Back-propagate the fixed output gradient, then drop the gradients (the next step starts clean)."""
    out.backward(g_out)
    h.grad = None
    for p in m.parameters():
        p.grad = None


def step_fn(m, h, g_out):
    """One forward + backward of the layer with a fixed output gradient (no loss computation in the timing)."""
    def step():
        _backward(m, h, _forward(m, h), g_out)
    return step


def bubbles(step, n=10) -> dict:
    """Is the step bound by the host? host_ms: time to enqueue one step (no sync) after an idle GPU; wall_ms:
    the same step to completion; kernel_ms: the GPU kernels' own time summed over one step (torch.profiler,
    3 steps). wall - kernel is the time the GPU sat idle inside a step (launch gaps, syncs)."""
    import time

    host, wall = [], []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        host.append(1e3 * (time.perf_counter() - t))
        torch.cuda.synchronize()
        wall.append(1e3 * (time.perf_counter() - t))
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    dev = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]  # kernels, memcpy/set
    kern = sum(ev.time_range.elapsed_us() for ev in dev)
    launches = len(dev) / 3
    return dict(host_ms=round(statistics.median(host), 3), wall_ms=round(statistics.median(wall), 3),
                kernel_ms=round(kern / 3e3, 3), kernels=round(launches))


def _stats_table(pr, n, top) -> str:
    """cProfile rows as microseconds per step: own time, cumulative time, calls per step."""
    import pstats

    st = pstats.Stats(pr).stats
    rows = sorted(st.items(), key=lambda kv: -kv[1][2])[:top]
    out = [f"{'own us':>9} {'cum us':>9} {'calls':>7}  function"]
    for (file, line, fn), (_, nc, tt, ct, _) in rows:
        where = f"{os.path.basename(file)}:{line}({fn})" if file != "~" else fn
        out.append(f"{1e6 * tt / n:9.1f} {1e6 * ct / n:9.1f} {nc / n:7.1f}  {where}")
    return "\n".join(out)


def _autograd_functions():
    """The torch.autograd.Function subclasses of moeadapt (their Python backward runs on autograd's thread)."""
    import importlib
    import inspect
    import pkgutil

    import moeadapt.models
    import moeadapt.ops

    found = []
    infos = [i for pkg in (moeadapt.ops, moeadapt.models) for i in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")]
    for info in infos:
        try:
            mod = importlib.import_module(info.name)
        except Exception:  # noqa: BLE001 - optional modules (e.g. ones needing a GPU-only package)
            continue
        for _, cls in inspect.getmembers(mod, inspect.isclass):
            if issubclass(cls, torch.autograd.Function) and cls.__module__ == mod.__name__ and "backward" in cls.__dict__:
                found.append(cls)
    return found


def host_profile(name, m, h, g_out, n=20, top=40):
    """Where the host time of a step goes: enqueue time of forward and backward apart (no sync inside), the
    host time of each Triton launch (JITFunction.run, any thread), cProfile tables of the forward and of the
    Python backwards (profiled on autograd's device thread from inside each backward), microseconds per step."""
    import collections
    import cProfile
    import time

    from triton.runtime.jit import JITFunction

    sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
    fwd_ms, bwd_ms = [], []
    launch = collections.defaultdict(lambda: [0, 0.0])
    per_fn = collections.defaultdict(float)
    run = JITFunction.run
    pr_f, pr_b = cProfile.Profile(), cProfile.Profile()

    def timed_run(self, *args, **kw):
        t = time.perf_counter()
        try:
            return run(self, *args, **kw)
        finally:
            rec = launch[self.fn.__name__]
            rec[0] += 1
            rec[1] += time.perf_counter() - t

    def wrap(cls, orig):
        def backward(ctx, *grads):
            t = time.perf_counter()
            pr_b.enable()
            try:
                return orig(ctx, *grads)
            finally:
                pr_b.disable()
                per_fn[cls.__name__] += time.perf_counter() - t
        return staticmethod(backward)

    patched = [(cls, cls.__dict__["backward"]) for cls in _autograd_functions()]
    JITFunction.run = timed_run
    for cls, orig in patched:
        cls.backward = wrap(cls, orig.__func__ if isinstance(orig, staticmethod) else orig)
    try:
        for _ in range(n):
            sync()
            t = time.perf_counter()
            pr_f.enable()
            out = _forward(m, h)
            pr_f.disable()
            t1 = time.perf_counter()
            _backward(m, h, out, g_out)  # clearing the gradients is part of the timed backward (microseconds)
            bwd_ms.append(1e3 * (time.perf_counter() - t1))
            fwd_ms.append(1e3 * (t1 - t))
    finally:
        JITFunction.run = run
        for cls, orig in patched:
            cls.backward = orig
    sync()
    print(f"# host {name}: forward enqueue {statistics.median(fwd_ms):.3f} ms, backward enqueue "
          f"{statistics.median(bwd_ms):.3f} ms (medians of {n}; cProfile on, so above a plain step)", flush=True)
    for k, (c, sec) in sorted(launch.items(), key=lambda kv: -kv[1][1]):
        print(f"#   triton launch {k}: {c / n:.1f} per step, {1e6 * sec / c:.1f} us each", flush=True)
    for k, sec in sorted(per_fn.items(), key=lambda kv: -kv[1]):
        print(f"#   python backward {k}: {1e6 * sec / n:.1f} us per step", flush=True)
    print(f"# host profile {name}, forward\n" + _stats_table(pr_f, n, top), flush=True)
    print(f"# host profile {name}, python backwards\n" + _stats_table(pr_b, n, top), flush=True)


def calibrate():
    """Host cost of one small torch op and of one Triton launch with few and with many arguments."""
    import time

    import triton.language as tl

    @triton.jit
    def _k4(x_ptr, n, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    @triton.jit
    def _k40(x_ptr, a1, a2, a3, a4, a5, a6, a7, a8, a9, a10, a11, a12, a13, a14, a15, a16, a17, a18, a19, a20,
             a21, a22, a23, a24, a25, a26, a27, a28, a29, a30, a31, a32, a33, a34, a35, n, BLOCK: tl.constexpr,
             C1: tl.constexpr, C2: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    x = torch.zeros(64, device=DEV)
    ys = [torch.zeros(64, device=DEV) for _ in range(8)]
    ints = list(range(3, 30))
    cases = {"torch add_": lambda: x.add_(1.0),
             "triton 2 args": lambda: _k4[(1,)](x, 64, BLOCK=64),
             "triton 36 args": lambda: _k40[(1,)](x, *ys, *ints, 64, BLOCK=64, C1=1, C2=2)}
    for k, f in cases.items():
        for _ in range(20):
            f()
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(500):
            f()
        el = time.perf_counter() - t
        torch.cuda.synchronize()
        print(f"# calibrate {k}: {1e6 * el / 500:.1f} us host per call", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="64x8,256x16,896x16")
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=None)
    ap.add_argument("--dims", default="4096,1024,1024", help="hidden, latent, expert ffn")
    ap.add_argument("--profile", action="store_true", help="print a torch.profiler table per variant and case")
    ap.add_argument("--bubbles", action="store_true", help="host enqueue time vs kernel time per step (bubbles())")
    ap.add_argument("--host-profile", action="store_true", help="cProfile of the steps (host_profile())")
    ap.add_argument("--router-matmul", default=None, help="ModelSpec.router_matmul: bf16x2, fp32, tf32 or bf16 "
                    "(default: the ModelSpec default)")
    ap.add_argument("--lora-backend", default="auto", help="the experts' grouped-LoRA backend (auto, fused, triton)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (small --T / --dims, wall-clock timing)")
    ap.add_argument("--no-buffer", nargs="*", default=[], metavar="BACKEND",
                    help="also time LoRA without the [W | Bᵀ] buffers (as under FSDP2), per expert LoRA backend")
    a = ap.parse_args()
    D, L, F = (int(v) for v in a.dims.split(","))
    global DEV
    DEV = a.device
    bench = triton.testing.do_bench if DEV == "cuda" else _wall
    rows = []
    head = dict(gpu=torch.cuda.get_device_name() if DEV == "cuda" else "cpu", torch=torch.__version__,
                triton=triton.__version__)
    print(json.dumps(head), flush=True)
    if a.host_profile and DEV == "cuda":
        calibrate()
    for case in a.cases.split(","):
        E, K = (int(v) for v in case.split("x"))
        h = torch.randn(1, a.T, D, device=DEV, dtype=torch.bfloat16, requires_grad=True)
        models = {"frozen": build(E, K, D, L, F, False, router_matmul=a.router_matmul),
                  "lora": build(E, K, D, L, F, True, lora_backend=a.lora_backend, router_matmul=a.router_matmul)}
        for be in a.no_buffer:
            models[f"lora_nobuf_{be}"] = build(E, K, D, L, F, True, lora_backend=be, router_matmul=a.router_matmul,
                                               release=True)
        g_out = torch.randn(1, a.T, D, device=DEV, dtype=torch.bfloat16) / (a.T * D) ** 0.5
        steps = {k: step_fn(m, h, g_out) for k, m in models.items()}
        for s in steps.values():  # compile, warm up
            s()
        path = {k: _lora_path(s) for k, s in steps.items() if k != "frozen"}
        if a.profile:  # where the model layer's time goes (GPU kernels and host-side syncs), one step each
            for k, s in steps.items():
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                        torch.profiler.ProfilerActivity.CUDA]) as prof:
                    s()
                    torch.cuda.synchronize()
                print(f"# profile {k} E={E} K={K} (by GPU time)\n" + prof.key_averages().table(
                    sort_by="cuda_time_total", row_limit=30, max_name_column_width=70), flush=True)
                print(f"# profile {k} E={E} K={K} (by host time)\n" + prof.key_averages().table(
                    sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=70), flush=True)
        if a.host_profile:
            for k, mod in models.items():
                host_profile(f"{k} E={E} K={K}", mod, h, g_out)
        bub = {k: bubbles(s) for k, s in steps.items()} if a.bubbles and DEV == "cuda" else None
        ms = {k: [] for k in steps}
        peak = {}
        for k, s in steps.items():
            if DEV == "cuda":
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
            s()
            peak[k] = (torch.cuda.max_memory_allocated() - base) / 2**30 if DEV == "cuda" else 0.0
        for _ in range(a.rounds):
            for k, s in steps.items():
                ms[k].append(bench(s, warmup=5, rep=50))
        med = {k: statistics.median(v) for k, v in ms.items()}
        row = dict(E=E, K=K, T=a.T, D=D, L=L, F=F, rows_per_expert=a.T * K / E, lora_path=path["lora"],
                   router_matmul=models["frozen"].spec.router_matmul,
                   frozen_ms=round(med["frozen"], 3), lora_ms=round(med["lora"], 3),
                   overhead_pct=round(100 * (med["lora"] / med["frozen"] - 1), 1),
                   frozen_rounds=[round(v, 3) for v in ms["frozen"]], lora_rounds=[round(v, 3) for v in ms["lora"]],
                   peak_gib={k: round(v, 2) for k, v in peak.items()})
        for k in models:
            if k.startswith("lora_nobuf_"):
                row[k] = dict(path=path[k], ms=round(med[k], 3),
                              overhead_pct=round(100 * (med[k] / med["frozen"] - 1), 1))
        if bub:
            row["bubbles"] = bub
        print(json.dumps(row), flush=True)
        rows.append(row)
        del models, steps, h
        if DEV == "cuda":
            torch.cuda.empty_cache()
    if a.out:
        with open(a.out + ".tmp", "w") as f:
            for r in [head] + rows:
                f.write(json.dumps(r) + "\n")
        os.replace(a.out + ".tmp", a.out)


if __name__ == "__main__":
    main()
