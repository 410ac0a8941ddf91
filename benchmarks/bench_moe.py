"""Benchmark of a LatentMoE-like layer (fwd+bwd) built from moeadapt.ops.moe, against baselines.

Layer: router (fp32 scores, selection-only bias that imposes the routing distribution, top-k,
normalised sigmoid weights) → fc1 latent projection D→L → permute → grouped SwiGLU experts
(fused gate/up [E, 2F, L], down [E, L, F]) with optional grouped LoRA r=16 → unpermute → fc2 L→D.

Variants (all bf16, fwd+bwd):
  ours-<mm>        our permute/unpermute (Triton) + grouped_mm with backend <mm> (triton | torch)
  titan-0.3        torchtitan 0.3.0's local path re-implemented (argsort dispatch, three
                   torch._grouped_mm per expert MLP, fp32 score multiply + deterministic scatter_add)
  loop             per-expert Python loop (argsort dispatch, one matmul per expert and projection)
  gemm-floor       torch._grouped_mm alone on pre-permuted inputs (gate/up and down GEMMs, fwd+bwd)
  lora-<be>        frozen base + grouped LoRA r=16 on gate/up and down: lora-triton (the Triton grouped LoRA
                   kernel), lora-torch (three torch._grouped_mm), lora-fused (LoRA folded into the base
                   torch._grouped_mm through a persistent [W | Bᵀ] buffer, fused_lora.py, dx="cat"),
                   lora-fused-fold (+ folded input passes: no permuted copy z, the gate/up LoRA-in pass
                   gathers token rows itself; no SwiGLU output, the down LoRA-in pass forms it; SwiGLU
                   backward fused into the down dx epilogue), lora-lean (lean_lora.py: gate/up GEMM at
                   native width, the rank terms in the gather / SwiGLU passes); "-split": dx="split"
  frozen           the same layer with a frozen base and no LoRA (dx only), the LoRA baseline
Every variant permutes with num_routed = T*K (dropless routing), so none of them syncs with the host.
Scopes: "layer" (everything above) and "experts" (permute → experts → unpermute on a fixed latent).

Run: python3 benchmarks/bench_moe.py [--quick] [--out results.jsonl]
LoRA overhead only (frozen vs every LoRA variant, 3 cases, uniform, ~2-3 min on an H200):
     python3 benchmarks/bench_moe.py --lora-only
Imports only torch, triton and moeadapt.ops.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from moeadapt.ops.moe import (  # noqa: E402
    fused_lora,
    grouped_lora,
    grouped_mm,
    lean_lora,
    offsets_from_counts,
    permutation,
    permute,
    swiglu,
    unpermute,
)

# lora variant -> (path, the fused backward's dx mode): the arguments experts_ours passes to the ops
LORA_VARIANTS = {
    "lora-triton": ("triton", "cat"),
    "lora-torch": ("torch", "cat"),
    "lora-fused": ("fused", "cat"),
    "lora-fused-split": ("fused", "split"),
    "lora-fused-fold": ("fold", "cat"),
    "lora-fused-fold-split": ("fold", "split"),
    "lora-lean": ("lean", "cat"),
    "lora-lean-split": ("lean", "split"),
}

DEV = "cuda"
BF16 = torch.bfloat16


def make_params(E, D, L, Fh, R, seed=0):
    g = torch.Generator(device=DEV).manual_seed(seed)

    def p(*shape, scale):
        return (torch.randn(*shape, device=DEV, generator=g) * scale).to(BF16)

    return {
        "router_DE": p(D, E, scale=D**-0.5),
        "fc1_DL": p(D, L, scale=D**-0.5),
        "fc2_LD": p(L, D, scale=L**-0.5),
        "w_gu_EOI": p(E, 2 * Fh, L, scale=L**-0.5),  # stored [E, out, in] like the model
        "w_d_EOI": p(E, L, Fh, scale=Fh**-0.5),
        "A_gu": p(E, L, R, scale=L**-0.5),
        "B_gu": p(E, R, 2 * Fh, scale=0.01),
        "A_d": p(E, Fh, R, scale=Fh**-0.5),
        "B_d": p(E, R, L, scale=0.01),
    }


def routing_bias(T, E, zipf_s, seed=1):
    """Selection-only bias: log p_e + Gumbel noise, so top-k samples experts ~ p without replacement."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    ranks = torch.arange(1, E + 1, device=DEV, dtype=torch.float32)
    logp = -zipf_s * ranks.log() if zipf_s else torch.zeros(E, device=DEV)
    u = torch.rand(T, E, device=DEV, generator=g).clamp_(1e-9, 1 - 1e-9)
    return (logp - torch.log(-torch.log(u))) * 100.0  # dominates the router logits


def route(h_TD, P, bias_TE, K):
    scores_TE = (h_TD @ P["router_DE"]).float()
    ids_TK = (scores_TE.detach() + bias_TE).topk(K, dim=1).indices
    w_TK = torch.sigmoid(scores_TE.gather(1, ids_TK))
    return ids_TK, w_TK / w_TK.sum(-1, keepdim=True)


def swiglu_unfused(gu_NF2):
    g, u = gu_NF2.chunk(2, dim=-1)
    return F.silu(g) * u


# ---------------------------------------------------------------- expert blocks (z_TL → y_TL)
def experts_ours(z_TL, ids_TK, w_TK, P, E, mm_backend, lora=None, scaling=2.0, act=swiglu, cats=None, dx="cat"):
    """lora: None, a grouped_lora backend, "fold" (fused with folded input passes) or "lean"; cats: persistent
    [W | Bᵀ] buffers {"gu", "d"} for the fused paths (the base weight is their view); dx: their backward GEMM."""
    T = z_TL.shape[0]
    if lora == "lean":
        ri, counts = permutation(ids_TK, E, num_routed=ids_TK.numel())
        offs = offsets_from_counts(counts)
        Fh, cd = P["w_d_EOI"].shape[2], cats["d"]
        o = lean_lora.lean_lora_experts(z_TL, ri, ids_TK.shape[1], offs, P["w_gu_EOI"], P["A_gu"], P["B_gu"],
                                        scaling, cd[:, :, :Fh].transpose(1, 2), P["A_d"], P["B_d"], scaling,
                                        wcat_d=cd, dx=dx)
        return unpermute(o, ri, w_TK, T)
    if lora == "fold":  # folded input passes: no permuted copy, no SwiGLU pass
        ri, counts = permutation(ids_TK, E, num_routed=ids_TK.numel())
        offs = offsets_from_counts(counts)
        L, Fh = z_TL.shape[1], P["w_d_EOI"].shape[2]
        cgu, cd = cats["gu"], cats["d"]
        gu = fused_lora.grouped_lora_fused_gather(z_TL, ri, ids_TK.shape[1], P["A_gu"], P["B_gu"], offs, scaling,
                                                  w_EIO=cgu[:, :, :L].transpose(1, 2), w_cat=cgu, dx=dx)
        o = fused_lora.grouped_lora_fused_swiglu(gu, None, P["A_d"], P["B_d"], offs, scaling,
                                                 w_EIO=cd[:, :, :Fh].transpose(1, 2), w_cat=cd, dx=dx)
        return unpermute(o, ri, w_TK, T)
    xs, ri, counts = permute(z_TL, ids_TK, E, num_routed=ids_TK.numel())
    offs = offsets_from_counts(counts)
    wgu, wd = P["w_gu_EOI"].transpose(1, 2), P["w_d_EOI"].transpose(1, 2)
    if lora is None:
        a = act(grouped_mm(xs, wgu, offs, backend=mm_backend))
        o = grouped_mm(a, wd, offs, backend=mm_backend)
    elif lora == "fused":
        L, Fh = xs.shape[1], P["w_d_EOI"].shape[2]
        cgu, cd = cats["gu"], cats["d"]
        a = act(grouped_lora(xs, P["A_gu"], P["B_gu"], offs, scaling, w_EIO=cgu[:, :, :L].transpose(1, 2),
                             backend="fused", w_cat=cgu, dx=dx))
        o = grouped_lora(a, P["A_d"], P["B_d"], offs, scaling, w_EIO=cd[:, :, :Fh].transpose(1, 2),
                         backend="fused", w_cat=cd, dx=dx)
    else:
        a = act(grouped_lora(xs, P["A_gu"], P["B_gu"], offs, scaling, w_EIO=wgu, backend=lora))
        o = grouped_lora(a, P["A_d"], P["B_d"], offs, scaling, w_EIO=wd, backend=lora)
    return unpermute(o, ri, w_TK, T)


def experts_titan(z_TL, ids_TK, w_TK, P, E):
    """torchtitan 0.3.0 LocalTokenDispatcher + GroupedExperts, re-implemented (same ops, same order)."""
    K = ids_TK.shape[1]
    order_N = torch.argsort(ids_TK.view(-1), stable=True)
    scores_N = w_TK.reshape(-1)[order_N]
    tok_N = order_N // K
    xs = z_TL[tok_N]
    counts = torch.histc(ids_TK.float(), bins=E, min=0, max=E)  # titan counts in the router
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    Fh = P["w_gu_EOI"].shape[1] // 2
    w1, w3 = P["w_gu_EOI"][:, :Fh], P["w_gu_EOI"][:, Fh:]  # separate w1 / w3 as titan stores them
    h = F.silu(torch._grouped_mm(xs, w1.transpose(-2, -1), offs=offs))
    h = h * torch._grouped_mm(xs, w3.transpose(-2, -1), offs=offs)
    o = torch._grouped_mm(h, P["w_d_EOI"].transpose(-2, -1), offs=offs)
    o = (o.float() * scores_N[:, None]).to(o.dtype)
    out = torch.zeros_like(z_TL)
    torch.use_deterministic_algorithms(True)
    try:
        out = out.scatter_add(0, tok_N[:, None].expand(-1, o.shape[1]), o)
    finally:
        torch.use_deterministic_algorithms(False)
    return out


def experts_loop(z_TL, ids_TK, w_TK, P, E):
    K = ids_TK.shape[1]
    order_N = torch.argsort(ids_TK.view(-1), stable=True)
    tok_N = order_N // K
    xs = z_TL[tok_N]
    counts = torch.bincount(ids_TK.view(-1), minlength=E).tolist()
    outs, s = [], 0
    for e, c in enumerate(counts):
        x_e = xs[s : s + c]
        outs.append(swiglu_unfused(x_e @ P["w_gu_EOI"][e].t()) @ P["w_d_EOI"][e].t())
        s += c
    o = torch.cat(outs) * w_TK.reshape(-1)[order_N][:, None].to(BF16)
    return torch.zeros_like(z_TL, dtype=torch.float32).index_add(0, tok_N, o.float()).to(BF16)


def layer(h_TD, P, bias_TE, E, K, experts):
    ids_TK, w_TK = route(h_TD, P, bias_TE, K)
    z_TL = h_TD @ P["fc1_DL"]
    return experts(z_TL, ids_TK, w_TK) @ P["fc2_LD"]


# ---------------------------------------------------------------- timing
def bench(fn, rep_ms=150):
    """(ms per call, peak GiB above the memory held before the call); (nan, nan) and a log line on failure."""
    try:
        return _bench(fn, rep_ms)
    except Exception as exc:  # a baseline that cannot run at a shape must not stop the others
        print(f"# FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
        torch.cuda.synchronize()
        return float("nan"), float("nan")


def _bench(fn, rep_ms):
    torch.cuda.synchronize()
    fn()  # compile / autotune outside the measurement
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    ms = triton.testing.do_bench(fn, warmup=25, rep=rep_ms)
    return ms, peak


def run_case(E, K, zipf_s, T, D, L, Fh, R, loop, log, profile=False, lora_only=False, rounds=1, lora_select=None):
    P = make_params(E, D, L, Fh, R)
    # persistent [W | Bᵀ] buffers for the fused LoRA (a model keeps only these; the bench also keeps
    # the contiguous P["w_*"] so the other variants run on exactly the weights they always had)
    cats = {"gu": fused_lora.make_cat_buffer(P["w_gu_EOI"], R), "d": fused_lora.make_cat_buffer(P["w_d_EOI"], R)}
    bias_TE = routing_bias(T, E, zipf_s)
    h0 = torch.randn(T, D, device=DEV, dtype=BF16)
    dout = torch.randn(T, D, device=DEV, dtype=BF16)
    dz = torch.randn(T, L, device=DEV, dtype=BF16)
    N = T * K
    fl_fwd = 2 * N * (L * 2 * Fh + Fh * L)  # expert GEMMs, forward
    fl_dense = 2 * T * D * (E + 2 * L)  # router + fc1 + fc2, forward
    with torch.no_grad():
        ids_TK, w_TK = route(h0, P, bias_TE, K)
        counts = torch.bincount(ids_TK.view(-1), minlength=E)
        z0 = (h0 @ P["fc1_DL"]).detach()
    load = (counts.float() / counts.float().mean())
    info = dict(E=E, K=K, routing=f"zipf{zipf_s}" if zipf_s else "uniform", T=T, D=D, L=L, F=Fh,
                load_max=round(load.max().item(), 2), load_min=round(load.min().item(), 2))

    try:  # full-shape agreement of our path with the torchtitan-style path
        if lora_only:
            raise StopIteration
        with torch.no_grad():
            y_a = experts_ours(z0, ids_TK, w_TK, P, E, "triton").float()
            y_b = experts_titan(z0, ids_TK, w_TK, P, E).float()
        log(dict(info, check="ours-triton vs titan-0.3 (experts fwd)",
                 rel_err=float((y_a - y_b).norm() / y_b.norm())))
    except StopIteration:
        pass
    except Exception as exc:
        print(f"# check FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    try:  # the fused LoRA (unfolded, then folded) against the old torch LoRA at full shape (fwd)
        with torch.no_grad():
            y_t = experts_ours(z0, ids_TK, w_TK, P, E, "auto", lora="torch").float()
            for name in ("lora-fused", "lora-fused-fold"):
                y_f = experts_ours(z0, ids_TK, w_TK, P, E, "auto", lora=LORA_VARIANTS[name][0], cats=cats).float()
                log(dict(info, check=f"{name} vs lora-torch (experts fwd)",
                         rel_err=float((y_f - y_t).norm() / y_t.norm())))
            y_f = experts_ours(z0, ids_TK, w_TK, P, E, "auto", lora="lean", cats=cats).float()
            log(dict(info, check="lora-lean vs lora-torch (experts fwd)",
                     rel_err=float((y_f - y_t).norm() / y_t.norm())))
    except Exception as exc:
        print(f"# lora check FAILED: {type(exc).__name__}: {str(exc)[:300]}", flush=True)

    def train_params(frozen):
        for k, v in P.items():
            base = k in ("w_gu_EOI", "w_d_EOI", "router_DE", "fc1_DL", "fc2_LD")
            v.requires_grad_(not frozen if base else frozen)
            v.grad = None

    def layer_step(experts, frozen=False):
        def step():
            train_params(frozen)
            h = h0.detach().requires_grad_(True)
            layer(h, P, bias_TE, E, K, experts).backward(dout)
        return step

    def experts_step(experts, frozen=False):
        def step():
            train_params(frozen)
            z = z0.detach().requires_grad_(True)
            w = w_TK.detach().requires_grad_(True)
            experts(z, ids_TK, w).backward(dz)
        return step

    variants = {
        "ours-triton": lambda z, i, w: experts_ours(z, i, w, P, E, "triton"),
        "ours-torch": lambda z, i, w: experts_ours(z, i, w, P, E, "torch"),
        "ours-torch-unfused-swiglu": lambda z, i, w: experts_ours(z, i, w, P, E, "torch", act=swiglu_unfused),
        "titan-0.3": lambda z, i, w: experts_titan(z, i, w, P, E),
    }
    if loop:
        variants["loop"] = lambda z, i, w: experts_loop(z, i, w, P, E)
    if lora_only:
        variants = {}

    def lora_fn(name):
        path, dx = LORA_VARIANTS[name]
        return lambda z, i, w: experts_ours(z, i, w, P, E, "auto", lora=path, cats=cats, dx=dx)

    lora_variants = {"frozen": lambda z, i, w: experts_ours(z, i, w, P, E, "auto")}
    lora_variants.update({name: lora_fn(name) for name in LORA_VARIANTS})
    if profile:  # where the time goes, per kernel, for our full-training and LoRA steps
        picks = lora_select or ["lora-fused", "lora-fused-fold", "lora-lean"]  # --lora-variants when given
        for name, ex, frozen in ([("ours-torch", variants.get("ours-torch"), False),
                                  ("frozen", lora_variants["frozen"], True)]
                                 + [(n, lora_variants[n], True) for n in picks]):
            if ex is None:
                continue
            step = experts_step(ex, frozen)
            step()
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                step()
                torch.cuda.synchronize()
            print(f"# profile {name} E={E} K={K}\n" + prof.key_averages().table(
                sort_by="cuda_time_total", row_limit=24, max_name_column_width=60), flush=True)
    rows = []
    for scope, maker in (("experts", experts_step), ("layer", layer_step)):
        for name, ex in variants.items():
            if name == "loop" and scope == "layer":
                continue  # the loop's cost is all in the expert block; spare the device time
            ms, mem = bench(maker(ex), rep_ms=40 if name == "loop" else 100)
            fl = 3 * fl_fwd + (3 * fl_dense if scope == "layer" else 0)
            rows.append(dict(info, scope=scope, variant=name, ms=round(ms, 3),
                             tflops=round(fl / ms / 1e9, 1), peak_gib=round(mem, 2)))
            log(rows[-1])
        names = [n for n in lora_variants if lora_select is None or n in lora_select or n == "frozen"]
        samples = {n: [] for n in names}
        for _ in range(rounds):  # rounds interleave the variants; the median of each is reported
            for name in names:
                samples[name].append(bench(maker(lora_variants[name], frozen=True)))
        for name in names:
            ms_all = sorted(m for m, _ in samples[name])
            ms, mem = ms_all[len(ms_all) // 2], max(g for _, g in samples[name])
            fl = 2 * fl_fwd + (2 * fl_dense if scope == "layer" else 0)  # dx only for a frozen base
            rows.append(dict(info, scope=scope, variant=name, ms=round(ms, 3),
                             tflops=round(fl / ms / 1e9, 1), peak_gib=round(mem, 2),
                             **({"ms_rounds": [round(m, 3) for m in ms_all]} if rounds > 1 else {})))
            log(rows[-1])
    for scope in ("experts", "layer"):  # the target: LoRA adds at most 25% over the frozen layer
        base = next(r["ms"] for r in rows if r["scope"] == scope and r["variant"] == "frozen")
        over = {r["variant"]: round(100 * (r["ms"] / base - 1), 1) for r in rows
                if r["scope"] == scope and r["variant"] in LORA_VARIANTS}
        log(dict(summary="lora overhead % over frozen", E=E, K=K, routing=info["routing"], scope=scope,
                 frozen_ms=base, **over))
    if lora_only:
        P.clear()
        torch.cuda.empty_cache()
        return rows
    # pure-GEMM floor on pre-permuted inputs: gate/up and down grouped GEMMs, fwd + bwd (dx, dW)
    offs = offsets_from_counts(counts)
    xs = torch.randn(N, L, device=DEV, dtype=BF16)
    a = torch.randn(N, Fh, device=DEV, dtype=BF16)
    g1 = torch.randn(N, 2 * Fh, device=DEV, dtype=BF16)
    g2 = torch.randn(N, L, device=DEV, dtype=BF16)

    def floor():
        train_params(False)
        x1, x2 = xs.detach().requires_grad_(True), a.detach().requires_grad_(True)
        y1 = torch._grouped_mm(x1, P["w_gu_EOI"].transpose(1, 2), offs=offs)
        y2 = torch._grouped_mm(x2, P["w_d_EOI"].transpose(1, 2), offs=offs)
        torch.autograd.backward([y1, y2], [g1, g2])

    ms, mem = bench(floor)
    rows.append(dict(info, scope="experts", variant="gemm-floor", ms=round(ms, 3),
                     tflops=round(3 * fl_fwd / ms / 1e9, 1), peak_gib=round(mem, 2)))
    log(rows[-1])
    P.clear()
    torch.cuda.empty_cache()
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="small shapes, no loop baseline")
    ap.add_argument("--cases", default="64x8,256x16,896x16", help="EXK,... experts x top-k")
    ap.add_argument("--routings", default="0,1.2", help="Zipf exponents, 0 = uniform")
    ap.add_argument("--no-loop", action="store_true", help="skip the per-expert Python loop baseline")
    ap.add_argument("--profile", action="store_true", help="print a per-kernel profile of the first case")
    ap.add_argument("--lora-only", action="store_true",
                    help="frozen vs each LoRA variant only (uniform routing unless --routings says otherwise)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=1, help="time the LoRA variants this many times, interleaved; "
                    "report each one's median (the H200 here showed ±2-point and occasional 2x outliers)")
    ap.add_argument("--lora-variants", default=None, help="comma list of LoRA variants to time (frozen always)")
    ap.add_argument("--budget-s", type=float, default=1e9, help="start no new case after this many seconds")
    args = ap.parse_args()
    if args.lora_only and args.routings == ap.get_default("routings"):
        args.routings = "0"
    T, D, L, Fh, R = (2048, 1024, 256, 256, 16) if args.quick else (16384, 4096, 1024, 1024, 16)
    cases = [tuple(int(v) for v in c.split("x")) for c in args.cases.split(",")]
    f = open(args.out, "a") if args.out else None

    def log(row):
        print(json.dumps(row), flush=True)
        if f:
            f.write(json.dumps(row) + "\n")
            f.flush()

    log(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
             date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())))
    t_start = time.time()
    first = True
    for zipf_s in (float(z) for z in args.routings.split(",")):
        for E, K in cases:
            if time.time() - t_start > args.budget_s:
                print(f"# budget spent: skipped E={E} K={K} zipf={zipf_s}", flush=True)
                continue
            t0 = time.time()
            run_case(E, K, zipf_s, T, D, L, Fh, R, not (args.quick or args.no_loop or args.lora_only), log,
                     profile=args.profile and first, lora_only=args.lora_only, rounds=args.rounds,
                     lora_select=args.lora_variants.split(",") if args.lora_variants else None)
            first = False
            print(f"# case E={E} K={K} zipf={zipf_s} took {time.time() - t0:.1f}s", flush=True)


if __name__ == "__main__":
    main()
