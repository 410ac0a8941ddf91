"""Benchmark KDA: our Triton variants vs fla.ops.kda.chunk_kda (fla-core) vs our PyTorch reference.

Usage (GPU): python3 -u benchmarks/bench_kda.py [--shapes 1,16384,16,128 ...] [--ours token,tf32x3]
             [--fla-shapes N] [--time-limit S] [--profile] [--no-ref] [--sweep]

Our variants are launch parameters passed to the op (`chunk_kda(..., launch=triton_kda.KDALaunch)`): token =
the defaults (triton_kda.LAUNCH), tf32x3 = the intra-chunk dots in tf32x3. --sweep times launch knobs on the
first shape and reports the fastest (the defaults change only by an edit of triton_kda.py).
Order, so that a time limit cuts the least important numbers: (1) ours, every variant and shape, timed;
(2) numerics at small shapes vs the float64 reference (ours, and fla with --ref-fla; dense bf16, and
varlen + in-kernel gate + beta logits + grouped value heads); (3) fla per shape (first --fla-shapes shapes): numerics vs each
of ours, then timed (its first call per head count autotunes for a long time); (4) the PyTorch reference
timed on the first shape. Stops starting new fla / reference work once --time-limit seconds have passed,
and prints the summary table after every fla shape and at the end.

For each (B,T,H,D): bf16 q/k/v (q, k L2-normalised), fp32 gates g = -exp(A_log) softplus(x + dt_bias)
with Kimi-style A_log ~ log U(1,16), dt ~ U(1e-3, 0.1); beta = sigmoid(randn). Times the median of
triton.testing.do_bench for forward (no grad) and forward+backward (of o and the final state).

FLOP count (matmul work of the chunk algorithm, chunk C=64, per token and head):
fwd = 2*(2CK [Akk,Aqk] + CK [w] + CV [u] + 2KV [d = u - wS, S update] + KV [qS] + CV [Aqk d])
    = 6CK + 4CV + 6KV;  fwd+bwd counted as 3x fwd (the usual 1:2 convention).
Imports nothing from moeadapt beyond moeadapt.ops.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moeadapt.ops.kda import (
    chunk_kda,  # noqa: E402
    triton_kda,  # noqa: E402
)

SHAPES = [(1, 16384, 16, 128), (1, 65536, 16, 128), (8, 4096, 32, 128), (2, 8192, 64, 128)]
FLA_REF_MS = {(1, 16384, 16, 128): 5.8, (1, 65536, 16, 128): 22.6, (8, 4096, 32, 128): 19.8, (2, 8192, 64, 128): 20.0}
VARIANTS = {
    "token": {},
    "tf32x3": dict(dot_prec="tf32x3"),
}
T_START = time.time()
DEV = "cuda"
DRY = False  # --dry-run: tiny CPU run (TRITON_INTERPRET=1) that only exercises this script's code paths
LOWP = torch.bfloat16  # input dtype of q, k, v, beta (float32 in --dry-run: the CPU interpreter has no bf16)


def make(B, T, H, D, seed=0):
    torch.manual_seed(seed)
    dev = DEV
    q = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(LOWP)
    k = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(LOWP)
    v = torch.randn(B, T, H, D, device=dev).to(LOWP)
    A_log = torch.log(torch.empty(H, device=dev).uniform_(1, 16))
    dt_bias = torch.log(torch.expm1(torch.empty(H, D, device=dev).uniform_(1e-3, 0.1)))
    g = -A_log.exp()[:, None] * F.softplus(torch.randn(B, T, H, D, device=dev) * 0.5 + dt_bias)
    beta = torch.sigmoid(torch.randn(B, T, H, device=dev)).to(LOWP)
    h0 = torch.randn(B, H, D, D, device=dev) * 0.1
    return q, k, v, g, beta, h0


def flops_fwd(B, T, H, D, C=64):
    return B * T * H * (6 * C * D + 4 * C * D + 6 * D * D)


def set_backend(backend, launch=None):
    """(backend, launch keywords of chunk_kda): 'triton:<variant>' is backend 'triton' with that variant's launch
    parameters (VARIANTS, over triton_kda.LAUNCH); `launch` (a KDALaunch) overrides."""
    if backend.startswith("triton:"):
        launch = launch or dataclasses.replace(triton_kda.LAUNCH, **VARIANTS[backend.split(":")[1]])
        backend = "triton"
    return backend, ({"launch": launch} if launch is not None else {})


def runner(backend, args, need_grad, launch=None):
    backend, lk = set_backend(backend, launch)
    q, k, v, g, beta, h0 = args
    xs = [x.detach().requires_grad_(need_grad) for x in (q, k, v, g, beta, h0)]
    do = torch.randn_like(v)

    def fwd():
        with torch.no_grad():
            return chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True, backend=backend, **lk)

    def fwdbwd():
        o, ht = chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True, backend=backend, **lk)
        torch.autograd.backward([o, ht], [do, torch.ones_like(ht)])
        for x in xs:
            x.grad = None

    return fwd, fwdbwd, xs, do


def outputs_and_grads(backend, args, cu_seqlens=None, double=False, seed=123, **kw):
    """o, final state and the gradients of every input (q, k, v, g, beta, h0, then any tensor in kw) for
    fixed float32 cotangents (seeded), so that backends and dtypes see the same cotangents."""
    backend, lk = set_backend(backend)
    names = [n for n in kw if torch.is_tensor(kw[n])]
    xs = [x.detach().clone().requires_grad_() for x in list(args) + [kw[n] for n in names]]
    if double:
        xs = [x.detach().double().requires_grad_() for x in xs]
    extra = dict(zip(names, xs[6:]))
    o, ht = chunk_kda(*xs[:5], initial_state=xs[5], output_final_state=True, cu_seqlens=cu_seqlens,
                      backend=backend, **lk, **{n: v for n, v in kw.items() if not torch.is_tensor(v)}, **extra)
    gen = torch.Generator(device=o.device).manual_seed(seed)
    do = torch.randn(o.shape, device=o.device, generator=gen).to(o.dtype)
    dht = torch.randn(ht.shape, device=o.device, generator=gen).to(ht.dtype)
    torch.autograd.backward([o, ht], [do, dht])
    return [o, ht] + [x.grad for x in xs]


def rel_err(a, b):
    a, b = a.float(), b.float()
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


NAMES = ["o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0"]


def fmt_err(err):
    return " ".join(f"{n}={e:.1e}" for n, e in err.items()) + f"  max={max(err.values()):.1e}"


def check_vs_fla(args, shape, ours):
    """Max abs error / max |fla| of o, final state and every gradient, for each of our variants."""
    try:
        theirs = outputs_and_grads("fla", args)
    except Exception as e:  # report and keep going
        print(f"{shape} fla FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
        return {}
    worst = {}
    for b in ours:
        try:
            mine = outputs_and_grads(b, args)
        except Exception as e:
            print(f"{shape} {b}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
            continue
        err = {n: rel_err(x, y) for n, x, y in zip(NAMES, mine, theirs)}
        worst[b] = max(err.values())
        print(f"{shape} {b} vs fla: {fmt_err(err)}", flush=True)
        del mine
    del theirs
    return worst


def make_gated(B, T, H, HV, D, seed=1):
    """Varlen-style inputs with the gate in the kernel: raw g, A_log, dt_bias, beta logits, HV value heads."""
    torch.manual_seed(seed)
    dev = DEV
    q = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(LOWP)
    k = F.normalize(torch.randn(B, T, H, D, device=dev), dim=-1).to(LOWP)
    v = torch.randn(B, T, HV, D, device=dev).to(LOWP)
    g = (torch.randn(B, T, HV, D, device=dev) * 0.5).float()
    beta = torch.randn(B, T, HV, device=dev).to(LOWP)
    A_log = torch.log(torch.empty(HV, device=dev).uniform_(1, 16))
    dt_bias = torch.log(torch.expm1(torch.empty(HV * D, device=dev).uniform_(1e-3, 0.1)))
    return q, k, v, g, beta, A_log, dt_bias


def check_vs_reference(ours, have_fla, dense, gated):
    """Numerics vs the float64 PyTorch reference at small shapes (max abs err / max |ref|): a dense
    bf16 batch like the timed ones, and a varlen batch with the gate in the kernel, beta logits and
    HV = 2H value heads."""
    cases = [(f"dense {','.join(map(str, dense))}", make(*dense, seed=3), None, {})]
    B, T, H, HV, D = gated
    q, k, v, g, beta, A_log, dt_bias = make_gated(B, T, H, HV, D)
    cuts = [0, T // 3, T // 3 + 64, T // 3 + 100, T]
    cu = torch.tensor(cuts, device=DEV, dtype=torch.int32)
    h0 = torch.randn(len(cuts) - 1, HV, D, D, device=DEV) * 0.1
    cases.append((f"varlen+gate+logits {B},{T},{H},{HV},{D}", (q, k, v, g, beta, h0), cu,
                  dict(A_log=A_log, dt_bias=dt_bias, beta_is_logits=True)))
    for label, args, cu, kw in cases:
        ref = outputs_and_grads("reference", args, cu_seqlens=cu, double=True, **kw)
        names = NAMES + [n for n in kw if torch.is_tensor(kw[n])]
        for b in ours + (["fla"] if have_fla else []):
            try:
                got = outputs_and_grads(b, args, cu_seqlens=None if cu is None else (cu.long() if b == "fla" else cu),
                                        **kw)
            except Exception as e:
                print(f"[{label}] {b}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            err = {n: rel_err(x, y) for n, x, y in zip(names, got, ref)}
            print(f"[{label}] {b} vs float64 reference: {fmt_err(err)}", flush=True)
        del ref


def bench(fn, fast=True):
    if DRY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    if fast:
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")
    fn()  # slow path (our PyTorch reference): one warm-up call, median of 3 timed calls
    ts = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) * 1e3)
    return sorted(ts)[1]


def peak_mem(fn):
    if DRY:
        return 0.0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def kernel_times(fn, label):
    """Per-kernel CUDA time of one call (torch.profiler), to say where the time goes."""
    if DRY:
        return
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0:
            rows.append((t / 1e3, e.key[:60], e.count))
    rows.sort(reverse=True)
    print(f"  [{label}] kernels (ms, calls):", "; ".join(f"{n} {t:.3f} x{c}" for t, n, c in rows[:10]))


def sweep(shape):
    """Try launch variants on one shape and report the fastest fwd+bwd (passed as launch=, nothing is changed)."""
    args = make(*shape)
    variants = [  # launch knobs around the defaults
        {},
        dict(intra_warps=2),
        dict(intra_warps=4),
        dict(intra_BK=32),
        dict(intra2_warps=1),
        dict(intra2_warps=4),
        dict(local_BK2=16),
        dict(local_BK2=16, intra2_warps=1),
        dict(diag_spread=32.0),
        dict(local_warps=8),
        dict(dh_warps=8, dv_warps=8),
        dict(local_BK=64),
        dict(h_BV=16),
        dict(h_BV=32),
        dict(h_split=False),
        dict(h_warps=8),
        dict(dh_split=True),
        dict(dv_BV=32),
        dict(wu_BK=32, wu_BV=32),
        dict(wu_warps=8),
        dict(o_warps=8),
        dict(o_BV=32),
        dict(stages=2),
        dict(stages=4),
        dict(local_BK2=64),
        dict(local_BK2=64, intra2_warps=4),
        dict(local_BK=64, local_warps=8),
        dict(local_BK=16),
        dict(local_BV=32),
        dict(local_BV=128),
        dict(dv_BV=64),
        dict(dh_warps=2),
        dict(h_warps=2),
        dict(intra_BK=64),
        dict(wu_BK=128, wu_warps=8),
        dict(o_BV=128, o_warps=8),
    ]
    best = (float("inf"), {})
    for var in variants:
        try:
            fwd, fwdbwd, _, _ = runner("triton", args, True, dataclasses.replace(triton_kda.LAUNCH, **var))
            tf = bench(fwd)
            tb = bench(fwdbwd)
        except Exception as e:  # a variant that fails to compile must not stop the run
            print(f"  sweep {var}: FAILED {type(e).__name__}: {str(e)[:200]}")
            continue
        print(f"  [{elapsed():.0f} s] sweep {var}: fwd {tf:.3f} ms  fwd+bwd {tb:.3f} ms", flush=True)
        if tb < best[0]:
            best = (tb, var)
    print(f"  sweep best: {best[1]} over the defaults {triton_kda.LAUNCH}")


def elapsed():
    return time.time() - T_START


def print_table(shapes, ours, res):
    print(f"\n[{elapsed():.0f} s] | B,T,H,D | ours | fwd ms | f+b ms | fla fwd | fla f+b | ours/fla f+b | "
          "max err vs fla | TFLOP/s f+b | peak GiB ours/fla |", flush=True)
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for shape in shapes:
        r = res[shape]
        f = r.get("fla")
        for b in ours:
            t = r.get(b)
            if not t:
                continue
            fl = 3 * flops_fwd(*shape)
            e = r.get("err", {}).get(b)
            print(f"| {','.join(map(str, shape))} | {b} | {t[0]:.2f} | {t[1]:.2f} | "
                  f"{f[0] if f else float('nan'):.2f} | {f[1] if f else float('nan'):.2f} | "
                  f"{t[1] / f[1] if f else t[1] / FLA_REF_MS.get(shape, float('nan')):.2f}{'' if f else ' (brief)'} | "
                  f"{'n/a' if e is None else f'{e:.1e}'} | {fl / t[1] / 1e9:.0f} | "
                  f"{t[2]:.2f}/{f[2] if f else float('nan'):.2f} |", flush=True)
        if r.get("reference"):
            c = r["reference"]
            print(f"| {','.join(map(str, shape))} | reference | {c[0]:.1f} | {c[1]:.1f} | | | | | | {c[2]:.2f} |")


def time_backend(backend, shape, args, profile):
    fwd, fwdbwd, _, _ = runner(backend, args, True)
    fast = backend != "reference"
    t = (bench(fwd, fast), bench(fwdbwd, fast), peak_mem(fwdbwd))
    fl = flops_fwd(*shape)
    print(f"[{elapsed():.0f} s] {shape} {backend}: fwd {t[0]:.2f} ms, fwd+bwd {t[1]:.2f} ms "
          f"({fl / t[0] / 1e9:.0f} / {3 * fl / t[1] / 1e9:.0f} TFLOP/s), peak fwd+bwd {t[2]:.2f} GiB", flush=True)
    if profile:
        try:
            kernel_times(fwdbwd, f"{backend} fwd+bwd {shape}")
        except Exception as e:
            print(f"  profile failed: {type(e).__name__}: {str(e)[:200]}")
    return t


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", nargs="*", default=None, help="B,T,H,D ...")
    p.add_argument("--ours", default="token", help=f"comma list of {list(VARIANTS)}")
    p.add_argument("--no-ref", action="store_true", help="skip the float64 reference checks and reference timing")
    p.add_argument("--no-fla", action="store_true")
    p.add_argument("--ref-fla", action="store_true",
                   help="also check fla vs the float64 reference (its autotune runs again for those head counts)")
    p.add_argument("--fla-shapes", type=int, default=99, help="run fla on the first N shapes only")
    p.add_argument("--time-limit", type=float, default=240.0, help="start no fla/reference work after this many s")
    p.add_argument("--sweep", action="store_true", help="try launch variants on the first shape first")
    p.add_argument("--launch", nargs="*", default=[], metavar="NAME=JSON",
                   help='more variants of ours, e.g. w1=\'{"intra_warps": 1}\' (KDALaunch fields), timed on every shape')
    p.add_argument("--profile", action="store_true", help="per-kernel times on the first shape")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, TRITON_INTERPRET=1: test this script")
    a = p.parse_args()
    global DEV, DRY, LOWP
    if a.dry_run:
        DEV, DRY, LOWP = "cpu", True, torch.float32
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    names = a.ours.split(",")
    for item in a.launch:
        name, _, spec = item.partition("=")
        try:
            VARIANTS[name] = json.loads(spec)
        except json.JSONDecodeError as e:
            p.error(f"--launch {item!r}: expected NAME=JSON of KDALaunch fields ({e})")
        names.append(name)
    ours = [f"triton:{v}" for v in names]
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}  {DEV if DRY else torch.cuda.get_device_name()}  "
          f"torch {torch.__version__}  triton {triton.__version__}", flush=True)
    have_fla = False
    if not a.no_fla:
        try:
            import fla  # noqa: F401

            have_fla = True
            print(f"# fla {getattr(fla, '__version__', '?')}")
        except ImportError as e:
            print(f"# fla not importable: {e}")
    if a.sweep:
        sweep(shapes[0])
    ref_small = ((1, 200, 2, 32), (1, 300, 1, 2, 32)) if DRY else ((2, 1024, 4, 128), (1, 3000, 2, 4, 128))
    res = {shape: {} for shape in shapes}
    for shape in shapes:  # (1) ours
        args = make(*shape)
        for b in ours:
            try:
                res[shape][b] = time_backend(b, shape, args, a.profile and shape == shapes[0])
            except Exception as e:  # out of memory, or a variant that fails: report and go on
                print(f"{shape} {b}: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        del args
        if not DRY:
            torch.cuda.empty_cache()
    if not a.no_ref:  # (2) numerics vs float64
        try:
            check_vs_reference(ours, have_fla and a.ref_fla, *ref_small)
        except Exception as e:
            print(f"reference check FAILED: {type(e).__name__}: {str(e)[:300]}", flush=True)
    for shape in shapes[: a.fla_shapes] if have_fla else []:  # (3) fla
        if elapsed() > a.time_limit:
            print(f"[{elapsed():.0f} s] time limit: fla skipped from {shape} on", flush=True)
            break
        args = make(*shape)
        res[shape]["err"] = check_vs_fla(args, shape, ours)
        try:
            res[shape]["fla"] = time_backend("fla", shape, args, a.profile and shape == shapes[0])
        except Exception as e:
            print(f"{shape} fla: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
        del args
        if not DRY:
            torch.cuda.empty_cache()
        print_table(shapes, ours, res)
    if not a.no_ref and elapsed() < a.time_limit:  # (4) our PyTorch reference, first shape
        try:
            res[shapes[0]]["reference"] = time_backend("reference", shapes[0], make(*shapes[0]), False)
        except Exception as e:
            print(f"{shapes[0]} reference: FAILED {type(e).__name__}: {str(e)[:300]}", flush=True)
    print_table(shapes, ours, res)


if __name__ == "__main__":
    main()
