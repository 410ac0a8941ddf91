"""Benchmark DSA on one GPU: lightning indexer (LI), sparse attention forward (SFA) and
backward (SFAG), the whole layer fwd+bwd; ours (Triton) vs the PyTorch composition a
user would write vs dense causal SDPA.

    python benchmarks/bench_dsa.py --out results.json [--T 8192 32768 131072] [--H 64 128] [--no-baselines]
    python benchmarks/bench_dsa.py --check --T 32768 --H 64 128   # SFA / SFAG launch variants, one table
    python benchmarks/bench_dsa.py --check --fwd-only --T 32768 --H 64 128   # SFA only: Triton vs Gluon
    python benchmarks/bench_dsa.py --sweep [fwd bwd li]   # time candidate launch configs at T = 16384, H = 128
    python benchmarks/bench_dsa.py --forms --T 4096 8192 --H 16 32 --batch 2   # MLA attention: absorbed vs MHA form
    python benchmarks/bench_dsa.py --plot-forms A.json B.json --out forms.png   # --forms rows of several runs, plotted

Every variant is passed to the op as an argument (fwd_cfg / bwd_cfg / gluon of triton_sparse_attn, cfg of
the indexer); nothing here changes the op's defaults.

MQA/MLA form: B = 1, HK = 1, D = 576 (512 latent + 64 rope), DV = 512 (v = kv[..., :512]),
topk = 2048, indexer HI = 64, DI = 128, bf16. Imports only torch/triton and moeadapt.ops.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from moeadapt.ops.dsa import gluon_sparse_attn as gws
from moeadapt.ops.dsa import triton_indexer as ti
from moeadapt.ops.dsa import triton_sparse_attn as tsa
from moeadapt.ops.dsa.flex_attn import FLEX_CONFIG
from moeadapt.ops.dsa.triton_indexer import lightning_indexer_triton

PEAK_TFLOPS = 790.0  # H200 bf16 dense, measured ceiling used in this repo
D, DV, TOPK, HI, DI = 576, 512, 2048, 64, 128


def timeit(fn, reps=3, warmup=1):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b))
    return min(ts)


def timed_peak(fn, reps=1, warmup=1):
    """(best ms, peak GiB allocated above what was live before the call)."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    ms = timeit(fn, reps=reps, warmup=warmup)
    return ms, (torch.cuda.max_memory_allocated() - base) / 2**30


def pairs(T, topk):
    n = min(T, topk)
    return n * (n + 1) // 2 + (T - n) * topk


# ------------------------------------------------------------ (b) PyTorch composition
def li_torch(q_idx, k_idx, w_idx, topk, block=512):
    T = q_idx.shape[1]
    out = torch.full((T, topk), -1, dtype=torch.int32, device=q_idx.device)
    pos = torch.arange(T, device=q_idx.device)
    for t0 in range(0, T, block):
        t1 = min(T, t0 + block)
        s = torch.einsum("qhd,sd->qhs", q_idx[0, t0:t1], k_idx[0, :t1]).relu()
        s = (s * w_idx[0, t0:t1, :, None]).sum(1).float()
        s = s.masked_fill(pos[None, :t1] > pos[t0:t1, None], float("-inf"))
        k = min(topk, t1)
        v, i = s.topk(k, dim=-1)
        out[t0:t1, :k] = torch.where(v > float("-inf"), i, -1).int()
    return out[None]


def sfa_torch(q, kv, indices, scale):
    idx = indices[0].long()
    valid = idx >= 0
    kvg = kv[0, idx.clamp(min=0), 0]  # [T, K, D]
    s = torch.einsum("thd,tkd->thk", q[0], kvg) * scale
    s = s.masked_fill(~valid[:, None], float("-inf"))
    p = s.float().softmax(-1).to(q.dtype)
    return torch.einsum("thk,tkd->thd", p, kvg[..., :DV])[None]


def sdpa_dense(q, kv, scale):
    H = q.shape[2]
    qh = q.transpose(1, 2)
    kh = kv.transpose(1, 2).expand(-1, H, -1, -1)
    return F.scaled_dot_product_attention(qh, kh, kh[..., :DV], is_causal=True, scale=scale)


# ------------------------------------------------------------ runs
def try_run(name, fn, log):
    try:
        return fn()
    except torch.OutOfMemoryError:
        log(f"  {name}: OOM")
    except Exception as e:  # noqa: BLE001  (record, keep benchmarking)
        log(f"  {name}: {type(e).__name__}: {str(e)[:200]}")
    finally:
        torch.cuda.empty_cache()
    return None


# Sweep at T = 16384, H = 128, random causal indices (half the slots -1), H200, Triton 3.6, TFLOP/s over every
# slot: fwd (BLOCK_H, BLOCK_K, warps, stages) (64,64,8,2) 313, (64,64,8,3) 270, (64,128,8,1) 221, (64,32,8,2)
# 210, (32,32,8,2) mma.sync 94; LI (BLOCK_S, BLOCK_R, progs/SM, warps) (128,1024,4,4) 200, (64,1024,4,4) 163,
# (128,2048,2,8) 155, (64,64,4,4) 69.
FWD_CANDIDATES = [
    dict(BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=2),
    dict(BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=3),
    dict(BLOCK_H=64, BLOCK_K=128, num_warps=8, num_stages=1),
    dict(tsa.FWD_CONFIG),  # + SKIP, REVERSE, DENSE (the default)
]
LI_CANDIDATES = [
    dict(ti.LI_CONFIG),
    dict(ti.LI_CONFIG_FEW_HEADS),
    dict(BLOCK_Q=1, BLOCK_S=64, BLOCK_R=1024, progs_per_sm=4, num_warps=4),
    dict(BLOCK_Q=8, BLOCK_S=64, BLOCK_R=1024, progs_per_sm=2, num_warps=4, PREDICT=True, CAP=16384),
    dict(BLOCK_Q=2, BLOCK_S=64, BLOCK_R=1024, progs_per_sm=4, num_warps=4, PREDICT=True, CAP=16384),
    dict(BLOCK_S=128, BLOCK_R=2048, progs_per_sm=2, num_warps=8),
]
BWD_CANDIDATES = [dict(tsa.BWD_CONFIG)]  # more P/dS launch shapes: --check


def li_default(hi):
    """The indexer's default launch config at `hi` indexer heads (what `lightning_indexer_triton` picks)."""
    return ti.LI_CONFIG_FEW_HEADS if hi <= ti.FEW_HEADS else ti.LI_CONFIG


def li_shapes(log, Ts, HIs, B=1):
    """The indexer's launch variants (LI_CANDIDATES, the default for the head count first) at each T and
    indexer head count: ms, TFLOP/s and the fraction of entries equal to the default's selection."""
    rows = []
    for T in Ts:
        for hi in HIs:
            default = li_default(hi)
            cands = [dict(default)] + [c for c in LI_CANDIDATES if c != default]
            g = torch.Generator(device="cuda").manual_seed(0)
            q_idx = torch.randn(B, T, hi, DI, device="cuda", dtype=torch.bfloat16, generator=g)
            k_idx = torch.randn(B, T, DI, device="cuda", dtype=torch.bfloat16, generator=g)
            w_idx = torch.randn(B, T, hi, device="cuda", dtype=torch.bfloat16, generator=g)
            fl = B * 2 * hi * DI * T * (T + 1) / 2
            ref = None
            for n, cfg in enumerate(cands):
                def run(cfg=cfg, xs=(q_idx, k_idx, w_idx)):
                    return ti.lightning_indexer_triton(*xs, TOPK, cfg=cfg)
                ms = try_run(f"li {cfg}", lambda run=run, reps=2 if T > 65536 else 3 if T > 8192 else 20: timeit(run, reps=reps), log)
                if ms is None:
                    continue
                got = run()
                ref = got if ref is None else ref
                same = (got == ref).float().mean().item()  # bf16 scores: ties may order differently
                row = dict(T=T, B=B, HI=hi, cfg=cfg, ms=ms, tflops=fl / ms / 1e9, same_as_first=same)
                log(f"  LI T={T} HI={hi} #{n} {cfg}: {ms:.2f} ms {row['tflops']:.0f} TFLOP/s, "
                    f"same entries as #0 {same:.5f}")
                rows.append(row)
    return rows


def sweep(log, ops, T=16384, H=128):
    """Time the candidate launch configs once and report the fastest of each op (the defaults stay as they are:
    a winner goes into the op's constants by an edit, with its measurement)."""
    torch.manual_seed(0)
    q = torch.randn(1, T, H, D, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(1, T, 1, D, device="cuda", dtype=torch.bfloat16)
    idx = torch.sort(torch.randint(0, T, (1, T, TOPK), device="cuda"), -1).values.int()
    idx = torch.where(idx <= torch.arange(T, device="cuda")[None, :, None], idx, -1)
    scale = D**-0.5
    fl = 2 * T * TOPK * H * (D + DV)
    best = {}
    for n, cfg in enumerate(FWD_CANDIDATES if "fwd" in ops else []):
        ms = try_run(f"fwd {cfg}", lambda cfg=cfg: timeit(lambda: tsa.sfa_forward(q, kv, kv[..., :DV], idx, scale, cfg)), log)
        if ms is not None:
            log(f"  sweep SFA fwd #{n} {cfg}: {ms:.2f} ms {fl / ms / 1e9:.0f} TFLOP/s (random idx, half masked)")
            if "fwd" not in best or ms < best["fwd"][0]:
                best["fwd"] = (ms, cfg)
    o, lse = tsa.sfa_forward(q, kv, kv[..., :DV], idx, scale, best.get("fwd", (0, tsa.FWD_CONFIG))[1])
    do = torch.randn_like(o)
    flb = 2 * T * TOPK * H * (3 * D + 2 * DV)
    ref = None
    for n, cfg in enumerate(BWD_CANDIDATES if "bwd" in ops else []):
        def run(cfg=cfg):
            return tsa.sfa_backward(q, kv, kv[..., :DV], idx, o, lse, do, scale, cfg)
        ms = try_run(f"bwd #{n}", lambda: timeit(run, reps=2), log)
        if ms is not None:
            dq, dk, _ = run()
            ref = ref or (dq.float(), dk.float())
            err = max((dq.float() - ref[0]).abs().max().item(), (dk.float() - ref[1]).abs().max().item())
            log(f"  sweep SFAG #{n}: {ms:.2f} ms {flb / ms / 1e9:.0f} TFLOP/s, max diff vs #0-ok {err:.3g}")
            if "bwd" not in best or ms < best["bwd"][0]:
                best["bwd"] = (ms, cfg)
    for row in li_shapes(log, [T], [HI]) if "li" in ops else []:
        if "li" not in best or row["ms"] < best["li"][0]:
            best["li"] = (row["ms"], row["cfg"])
    log(f"fastest: {({k: v[1] for k, v in best.items()})}; defaults fwd {tsa.FWD_CONFIG} bwd {tsa.BWD_CONFIG} "
        f"li {li_default(HI)}")
    return {k: v[1] for k, v in best.items()}


# ------------------------------------------------------------ --check: launch variants in one process
# forward: name -> Triton config ("full_walk" is the error reference: every key block, masked)
CHECK_FWD = {
    "full_walk": {**tsa.FWD_CONFIG, "SKIP": False, "REVERSE": False, "DENSE": False},
    "skip_rev": {**tsa.FWD_CONFIG, "DENSE": False},
}
CHECK_FWD_MORE = {  # --fwd-only: the default walk and the launch shapes that lost (16 warps; BLOCK_K 32, 3 stages)
    "dense": dict(tsa.FWD_CONFIG),
    "w16": {**tsa.FWD_CONFIG, "DENSE": False, "num_warps": 16},
    "w16_k32s3": {**tsa.FWD_CONFIG, "DENSE": False, "num_warps": 16, "BLOCK_K": 32, "num_stages": 3},
    # the dense-tile forward (one KV head, <= 32 query heads, dense selections; MIN_DENSITY 0 so that it also
    # runs where its default would not) and its launch shapes: 3 stages, 32-key tiles, 4 warps
    **{f"tiles{n}": {**tsa.DENSE_FWD_CONFIG, "MIN_DENSITY": 0.0, **o} for n, o in (
        ("", {}), ("_s3", {"num_stages": 3}), ("_s1", {"num_stages": 1}), ("_k32", {"BLOCK_KEYS": 32}),
        ("_k32s3", {"BLOCK_KEYS": 32, "num_stages": 3}), ("_w4", {"num_warps": 4}))},
}
GLUON_FWD = "gluon_ws"  # the warp-specialised Gluon forward (MLA shape, sm_90), the default where it applies
_APPLY = tsa.BWD_CONFIG["APPLY_CFG"]
# backward: name -> (P/dS config, Gluon pass 1); the first is the error reference
_DENSE = tsa.DENSE_PDS_CONFIG
CHECK_BWD = {
    # the slot pass 2 (one fp32 dk row per selected pair; the default where the dense one does not apply)
    "slot": ({**tsa.BWD_CONFIG, "DENSE": None}, True),
    "pds": (dict(tsa.BWD_CONFIG), True),  # the default (dense pass 2 where it applies)
    # dense pass 2 launch shapes: with no memory cap ("any"), query blocks of 4 / 16, segments of 8 / 64 query blocks, dk chunks of 64 /
    # 256 channels (8 warps), dq chunks of 64 channels on 4 warps, 2 stages
    **{f"dense_{n}": ({**tsa.BWD_CONFIG, "DENSE": {**_DENSE, **o}}, True) for n, o in (
        ("any", {"BYTES": 2**40, "MAX_HEADS": 1024}), ("q4", {"BLOCK_Q": 4}), ("q16", {"BLOCK_Q": 16, "DQ_CFG": {**_DENSE["DQ_CFG"], "BLOCK_C": 64}}),
        ("seg8", {"SEG": 8}), ("seg64", {"SEG": 64}),
        ("dk64", {"DK_CFG": {**_DENSE["DK_CFG"], "BLOCK_C": 64}}),
        ("dk256", {"DK_CFG": {**_DENSE["DK_CFG"], "BLOCK_C": 256, "num_warps": 8}}),
        ("dq64", {"DQ_CFG": {**_DENSE["DQ_CFG"], "BLOCK_C": 64, "num_warps": 4}}),
        ("st2", {"DK_CFG": {**_DENSE["DK_CFG"], "num_stages": 2}, "DQ_CFG": {**_DENSE["DQ_CFG"], "num_stages": 2}}),
    )},
    # pass 1 on dense tiles (no zeroing): (query, head) columns x keys a program, warps, stages
    **{f"dense_p1t_{m}x{k}w{w}s{st}": ({**tsa.BWD_CONFIG, "DENSE": {**_DENSE, "P1_TILES": {
        "BLOCK_M": m, "BLOCK_KEYS": k, "num_warps": w, "num_stages": st}}}, True)
       for m, k, w, st in ((64, 32, 4, 2), (64, 32, 8, 2), (64, 64, 8, 1), (32, 64, 4, 2), (128, 32, 8, 1))},
    "pds_triton_p1": (dict(tsa.BWD_CONFIG), False),  # pass 1 by the Triton kernel
    # pass 1 at head blocks of 16 / 32 with 32-key blocks (the default takes 64 there)
    "pds_p1k32": ({**tsa.BWD_CONFIG, "PDS_CFG": {**tsa.BWD_CONFIG["PDS_CFG"], "BLOCK_K_H32": 32}}, True),
    # 128-channel chunks at every head block (the default takes 64 at 64-head blocks); 64 at every one
    "pds_c128": ({**tsa.BWD_CONFIG, "APPLY_CFG": {**_APPLY, "BLOCK_C_H64": 128}}, True),
    "pds_c64": ({**tsa.BWD_CONFIG, "APPLY_CFG": {**_APPLY, "BLOCK_C": 64}}, True),
    # pass-2 launch shapes around the default (4 warps, 3 stages, 128-head blocks)
    **{f"p2_{n}": ({**tsa.BWD_CONFIG, "APPLY_CFG": {**_APPLY, **o}}, True) for n, o in (
        ("w8", {"num_warps": 8}), ("s2", {"num_stages": 2}), ("s4", {"num_stages": 4}), ("h64", {"BLOCK_H": 64}))},
    # pass 2 row-major (every channel chunk of a row together) / channel-major (every row of a chunk together;
    # what "auto" picks when it moves fewer DRAM bytes: tsa._channel_major), and channel-major with 32-channel chunks
    "p2_rows": ({**tsa.BWD_CONFIG, "APPLY_CFG": {**_APPLY, "CHANNEL_MAJOR": False}}, True),
    "p2_chan": ({**tsa.BWD_CONFIG, "APPLY_CFG": {**_APPLY, "CHANNEL_MAJOR": True}}, True),
    "p2_chan_c32": ({**tsa.BWD_CONFIG, "APPLY_CFG": {**_APPLY, "CHANNEL_MAJOR": True, "BLOCK_C": 32,
                                                     "BLOCK_C_H64": 32}}, True),
    # 178 KB / 131 KB of shared memory (the defaults need 217 KB / 197 KB under Triton 3.9)
    "pds_k16": ({**tsa.BWD_CONFIG, "PDS_CFG": {**tsa.BWD_CONFIG["PDS_CFG"], "BLOCK_K": 16, "num_stages": 4},
                 "APPLY_CFG": {**_APPLY, "BLOCK_H": 64, "num_warps": 8}}, False),
}


def check(log, T=32768, Hs=(128, 64), reps=3, dev="cuda", fwd_only=False, bwd_names=None, batch=1):
    """SFA and SFAG launch variants at batch x T (LI indices) in one process, each checked against the first
    one's output; prints a table and the fastest of each."""
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    fwd_cfgs = {**CHECK_FWD, **(CHECK_FWD_MORE if fwd_only else {}), GLUON_FWD: None}
    bwd_cfgs = {} if fwd_only else {n: c for n, c in CHECK_BWD.items() if not bwd_names or n in bwd_names}
    torch.manual_seed(0)
    q_idx = torch.randn(batch, T, HI, DI, device=dev, dtype=dt)
    k_idx = torch.randn(batch, T, DI, device=dev, dtype=dt)
    w_idx = torch.randn(batch, T, HI, device=dev, dtype=dt) * (HI**-0.5 * DI**-0.5)
    idx = lightning_indexer_triton(q_idx, k_idx, w_idx, TOPK)
    del q_idx, k_idx, w_idx
    scale = D**-0.5
    np_ = batch * pairs(T, TOPK)
    out = {"T": T, "batch": batch, "rows": []}

    def rel(a, b):  # max |a - b| / max |b|, a few rows at a time (float copies of [T, 128, 512] need 32 GiB)
        diff = max((x.float() - y.float()).abs().max().item() for x, y in zip(a.split(4096, 1), b.split(4096, 1)))
        return diff / max(y.float().abs().max().item() for y in b.split(4096, 1))

    def cell(x):
        if x is None or x[0] is None:
            return "–"
        return f"{x[0]:.1f} ({x[1]:.0f})" if x[1] else f"{x[0]:.1f}"

    def one(H):  # per head count; its tensors are freed on return
        torch.manual_seed(1)
        q = torch.randn(batch, T, H, D, device=dev, dtype=dt)
        kv = torch.randn(batch, T, 1, D, device=dev, dtype=dt)
        v = kv[..., :DV]
        fl_f, fl_b = 2 * np_ * H * (D + DV), 2 * np_ * H * (3 * D + 2 * DV)
        row = {"H": H}
        o_ref, lse_ref = tsa.sfa_forward(q, kv, v, idx, scale, CHECK_FWD["full_walk"])
        for name, cfg in fwd_cfgs.items():
            if cfg is None and not gws.supported(q, kv, v, idx):  # the Gluon forward needs 64-head multiples
                continue

            def f(cfg=cfg):
                if cfg is None:
                    return gws.sfa_forward_ws(q, kv, idx, scale)
                return tsa.sfa_forward(q, kv, v, idx, scale, cfg)
            ms = try_run(f"fwd {name}", lambda f=f: timeit(f, reps=reps), log)
            if ms is None:
                continue
            o, lse = f()
            err = max(rel(o, o_ref), (lse - lse_ref).abs().max().item())
            row[f"fwd_{name}"] = (ms, fl_f / ms / 1e9, err)
            log(f"  T={T} H={H} SFA {name}: {ms:.2f} ms {fl_f / ms / 1e9:.0f} TF/s err {err:.2g}")
            del o, lse
        do = torch.randn_like(o_ref)

        def b(cg):
            return tsa.sfa_backward(q, kv, v, idx, o_ref, lse_ref, do, scale, cg[0], cg[1])
        dq_ref = dk_ref = None
        for name, cg in bwd_cfgs.items():
            ms = try_run(f"bwd {name}", lambda cg=cg: timeit(lambda: b(cg), reps=reps), log)
            if ms is None:
                continue
            dq, dk, _ = b(cg)
            if dq_ref is None:
                dq_ref, dk_ref = dq, dk  # the first is the reference
            err = max(rel(dq, dq_ref), rel(dk, dk_ref))
            row[f"bwd_{name}"] = (ms, fl_b / ms / 1e9, err)
            log(f"  T={T} H={H} SFAG {name}: {ms:.2f} ms {fl_b / ms / 1e9:.0f} TF/s, rel err vs first {err:.2g}")
            if tsa._fallen_back:  # a pass did not fit in shared memory: this row timed the fallback
                log(f"    ({name} ran the shared-memory fallback: {tsa._fallen_back})")
                row[f"bwd_{name}"] += ("fallback",)
                tsa._fallen_back.clear()
            del dq, dk
        return row

    for H in Hs:
        out["rows"].append(one(H))
        torch.cuda.empty_cache()

    fw, bw = list(fwd_cfgs), list(bwd_cfgs)
    cols = [f"SFA {n} ms (TF/s)" for n in fw] + [f"SFAG {n} ms (TF/s)" for n in bw]
    log("| T | HQ | " + " | ".join(cols) + " |")
    log("|" + "---|" * (2 + len(cols)))
    for r in out["rows"]:
        log(f"| {T} | {r['H']} | " + " | ".join([cell(r.get(f"fwd_{n}")) for n in fw]
                                               + [cell(r.get(f"bwd_{n}")) for n in bw]) + " |")
    for r in out["rows"]:
        for kind, names, cfgs in (("fwd", fw, fwd_cfgs), ("bwd", bw, bwd_cfgs)):
            ok = [(r[f"{kind}_{n}"][0], n) for n in names if f"{kind}_{n}" in r and r[f"{kind}_{n}"][2] < 2e-2]
            if ok:
                ms, n = min(ok)
                log(f"H={r['H']}: fastest {kind} {n} ({ms:.1f} ms) = {cfgs[n]}")
    return out


def bench_shape(T, H, log, run_torch=True, run_sdpa=True):
    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16
    r = {"T": T, "H": H}
    q_idx = torch.randn(1, T, HI, DI, device=dev, dtype=dt)
    k_idx = torch.randn(1, T, DI, device=dev, dtype=dt)
    w_idx = torch.randn(1, T, HI, device=dev, dtype=dt) * (HI**-0.5 * DI**-0.5)
    q = torch.randn(1, T, H, D, device=dev, dtype=dt, requires_grad=True)
    kv = torch.randn(1, T, 1, D, device=dev, dtype=dt, requires_grad=True)
    scale = D**-0.5
    np_ = pairs(T, TOPK)
    fl_li = 2 * HI * DI * T * (T + 1) / 2
    fl_f = 2 * np_ * H * (D + DV)
    fl_b = 2 * np_ * H * (3 * D + 2 * DV)
    reps, wu = (3, 1) if T <= 32768 else (1, 0)  # big T: kernels already compiled at smaller T

    li = lambda: lightning_indexer_triton(q_idx, k_idx, w_idx, TOPK)  # noqa: E731
    r["li_ms"] = timeit(li, reps=reps, warmup=wu)
    r["li_tflops"] = fl_li / r["li_ms"] / 1e9
    idx = li()
    fwd = lambda: tsa.sfa_forward(q.detach(), kv.detach(), kv.detach()[..., :DV], idx, scale)  # noqa: E731
    r["sfa_ms"] = timeit(fwd, reps=reps, warmup=wu)
    r["sfa_tflops"] = fl_f / r["sfa_ms"] / 1e9
    st = dict(zip(("o", "lse"), fwd()))
    do = torch.randn_like(st["o"])
    bwd = lambda: tsa.sfa_backward(q.detach(), kv.detach(), kv.detach()[..., :DV], idx, st["o"], st["lse"], do, scale)  # noqa: E731
    r["sfag_ms"] = timeit(bwd, reps=reps, warmup=wu)
    r["sfag_tflops"] = fl_b / r["sfag_ms"] / 1e9
    st.clear()  # keep the big-T layer run inside memory

    def layer():
        ix = lightning_indexer_triton(q_idx, k_idx, w_idx, TOPK)
        out = tsa.sparse_attention_triton(q, kv, kv[..., :DV], ix, scale)
        out.backward(do)

    r["layer_ms"], r["layer_gib"] = timed_peak(layer, reps=reps, warmup=wu)
    r["layer_tflops"] = (fl_li + fl_f + fl_b) / r["layer_ms"] / 1e9
    log(f"T={T} H={H} ours: LI {r['li_ms']:.1f} ms ({r['li_tflops']:.0f} TF/s), SFA {r['sfa_ms']:.1f} ms "
        f"({r['sfa_tflops']:.0f}), SFAG {r['sfag_ms']:.1f} ms ({r['sfag_tflops']:.0f}), layer {r['layer_ms']:.1f} ms "
        f"({r['layer_tflops']:.0f}), peak {r['layer_gib']:.1f} GiB")
    q.grad = kv.grad = None

    if run_torch:
        r["li_torch_ms"] = try_run("li_torch", lambda: timeit(lambda: li_torch(q_idx, k_idx, w_idx, TOPK), reps=1), log)
        ref_idx = li_torch(q_idx, k_idx, w_idx, TOPK) if r["li_torch_ms"] else None
        if ref_idx is not None:  # selection agreement (ties/rounding may differ slightly)
            a = torch.sort(torch.where(idx[0] < 0, T, idx[0]).long(), -1).values
            b = torch.sort(torch.where(ref_idx[0] < 0, T, ref_idx[0]).long(), -1).values
            r["li_agree"] = (a == b).float().mean().item()

        def layer_torch():
            ix = li_torch(q_idx, k_idx, w_idx, TOPK)
            sfa_torch(q, kv, ix, scale).backward(do)

        r["sfa_torch_ms"] = try_run("sfa_torch fwd", lambda: timeit(lambda: sfa_torch(q.detach(), kv.detach(), idx, scale), reps=1), log)
        lt = try_run("layer_torch", lambda: timed_peak(layer_torch), log)
        r["layer_torch_ms"], r["layer_torch_gib"] = lt or (None, None)
        if lt:
            o_t = sfa_torch(q.detach(), kv.detach(), idx, scale)
            o_f = tsa.sfa_forward(q.detach(), kv.detach(), kv.detach()[..., :DV], idx, scale)[0]
            r["sfa_maxerr_vs_torch"] = (o_t.float() - o_f.float()).abs().max().item()
            del o_t, o_f
        q.grad = kv.grad = None
        log(f"  torch: LI {r.get('li_torch_ms')} SFA {r.get('sfa_torch_ms')} layer {r.get('layer_torch_ms')} "
            f"agree {r.get('li_agree')} err {r.get('sfa_maxerr_vs_torch')}")
    if T == 8192 and H == 128:  # indexer KL loss (fwd+bwd), Triton vs reference
        from moeadapt.ops.dsa import indexer_kl_loss

        xs = [x.detach().requires_grad_() for x in (q_idx, k_idx, w_idx)]
        for be in ("triton", "reference"):
            def kl(be=be):
                indexer_kl_loss(q.detach(), kv.detach(), idx, *xs, scale=scale, backend=be).backward()

            res = try_run(f"kl {be}", lambda kl=kl: timed_peak(kl), log)
            r[f"kl_{be}_ms"], r[f"kl_{be}_gib"] = res or (None, None)
        log(f"  KL loss fwd+bwd: triton {r.get('kl_triton_ms')} ms ({r.get('kl_triton_gib')} GiB), "
            f"reference {r.get('kl_reference_ms')} ms ({r.get('kl_reference_gib')} GiB)")
    if run_sdpa:
        def dense():
            sdpa_dense(q, kv, scale).backward(do.transpose(1, 2))

        sd = try_run("sdpa", lambda: timed_peak(dense, warmup=int(T < 32768)), log)
        r["sdpa_layer_ms"], r["sdpa_layer_gib"] = sd or (None, None)
        q.grad = kv.grad = None
        log(f"  sdpa fwd+bwd {r.get('sdpa_layer_ms')}")
    return r



# ------------------------------------------------------------ --forms: MLA attention, absorbed vs MHA form
MLA_NOPE, MLA_ROPE, MLA_KVL, MLA_VD = 128, 64, 512, 128
FLEX_BWD = dict(FLEX_CONFIG["KERNEL_OPTIONS"] or {})  # the default backward launch, kept by the forward variants


def _bwd(m1, n1, warps, stages):
    """A backward launch: dk/dv on m1 queries x n1 keys, dq on n1 queries x m1 keys."""
    return {"KERNEL_OPTIONS": {"BLOCK_M1": m1, "BLOCK_N1": n1, "BLOCK_M2": n1, "BLOCK_N2": m1,
                               "bwd_num_warps": warps, "bwd_num_stages": stages}}


# FlexAttention settings timed beside the default (ops/dsa/flex_attn.py FLEX_CONFIG): backward launches (the
# fastest is the default now), a forward launch, PRESCALE_QK, no full-block lists. Max-autotune (AUTOTUNE) is
# left out: it costs ~70 s of compiling and found 3.70 ms against the default's 2.30 (RESULTS.md)
FLEX_VARIANTS = {
    "heuristic": {"KERNEL_OPTIONS": None},  # inductor's launch for head dim 192: 64 x 64 tiles, 4 warps, 2 stages
    "bwd64x64w8s2": _bwd(64, 64, 8, 2), "bwd32x64w4s2": _bwd(32, 64, 4, 2), "bwd32x128w8s2": _bwd(32, 128, 8, 2),
    "bwd64x128w4s2": _bwd(64, 128, 4, 2), "bwd64x128w8s1": _bwd(64, 128, 8, 1), "bwd64x128w8s3": _bwd(64, 128, 8, 3),
    "bwd128x128w8s1": _bwd(128, 128, 8, 1), "bwd64x128w16s2": _bwd(64, 128, 16, 2),
    "fwd128x64w8s2": {"KERNEL_OPTIONS": {**FLEX_BWD, "BLOCK_M": 128, "BLOCK_N": 64, "fwd_num_warps": 8,
                                         "fwd_num_stages": 2}},
    "prescale": {"KERNEL_OPTIONS": {**FLEX_BWD, "PRESCALE_QK": True}},
    "nofull": {"FULL_BLOCKS": False},
}


# Launches of ops/dsa/triton_tile_attn.py (the same tiles without FlexAttention) timed beside its TILE_LAUNCH:
# overrides of it
TILE_VARIANTS = {  # (4-warp launches spill at these head dims when compiled for sm_90: left out)
    "fwd_bn128": {"FWD_BN": 128}, "fwd_s2": {"FWD_STAGES": 2}, "dq_bn32": {"DQ_BN": 32}, "dq_s3": {"DQ_STAGES": 3},
    "dkv_bn64": {"DKV_BN": 64}, "dkv_bm32": {"DKV_BM": 32},
    "stages1": {"FWD_STAGES": 1, "DQ_STAGES": 1, "DKV_STAGES": 1}, "stages3": {"FWD_STAGES": 3, "DQ_STAGES": 3,
                                                                              "DKV_STAGES": 3},
}


def forms(log, Ts, Hs, batch, reps=5, variants=True, tile_variants=True):
    """MLA attention fwd + bwd in its two forms (models/dsa_attn.py) from the same q_nope, q_pe, kv latent, k_pe
    and wkv_b, at DeepSeek's dims (nope 128, rope 64, kv_lora_rank 512, v_head_dim 128), LI selections of top-2048:
    absorbed (W_uk into q, MQA sparse attention on the latent, W_uv after) vs MHA (per-head k, v = kv latent x
    wkv_b; FlexAttention's dense tiles, ops/dsa/flex_attn.py). Checks the MHA form's o and gradients against the
    absorbed form's and prints ms and the ratio."""
    rows = []
    for T in Ts:
        torch.manual_seed(0)
        q_idx = torch.randn(batch, T, HI, DI, device="cuda", dtype=torch.bfloat16)
        k_idx = torch.randn(batch, T, DI, device="cuda", dtype=torch.bfloat16)
        w_idx = torch.randn(batch, T, HI, device="cuda", dtype=torch.bfloat16) * (HI**-0.5 * DI**-0.5)
        idx = lightning_indexer_triton(q_idx, k_idx, w_idx, TOPK)
        del q_idx, k_idx, w_idx
        for H in Hs:
            rows.append(_forms_row(idx, T, H, batch, reps, log, variants, tile_variants))
            torch.cuda.empty_cache()
    return rows


def _forms_row(idx, T, H, batch, reps, log, variants=True, tile_variants=True):
    """One (T, H) row of `forms`; its tensors are freed on return."""
    from moeadapt.ops.dsa import flex_attn as fa
    from moeadapt.ops.dsa import sparse_attention

    dev, dt = "cuda", torch.bfloat16
    NOPE, R, KVL, VD = MLA_NOPE, MLA_ROPE, MLA_KVL, MLA_VD
    scale = (NOPE + R) ** -0.5
    q_nope = torch.randn(batch, T, H, NOPE, device=dev, dtype=dt, requires_grad=True)
    q_pe = torch.randn(batch, T, H, R, device=dev, dtype=dt, requires_grad=True)
    kv_lat = torch.randn(batch, T, KVL, device=dev, dtype=dt, requires_grad=True)
    k_pe = torch.randn(batch, T, R, device=dev, dtype=dt, requires_grad=True)
    w = (torch.randn(H, NOPE + VD, KVL, device=dev, dtype=dt) * KVL**-0.5).requires_grad_()
    do = torch.randn(batch, T, H, VD, device=dev, dtype=dt)
    leaves = (q_nope, q_pe, kv_lat, k_pe, w)

    def absorbed():
        q = torch.cat([torch.einsum("bthn,hnc->bthc", q_nope, w[:, :NOPE]), q_pe], -1)
        kv = torch.cat([kv_lat, k_pe], -1).unsqueeze(2)
        o_lat = sparse_attention(q, kv, kv[..., :KVL], idx, scale=scale)
        return torch.einsum("bthc,hvc->bthv", o_lat, w[:, NOPE:])

    def mha(cfg=None):
        kvb = torch.einsum("btc,hnc->bthn", kv_lat, w)
        k = torch.cat([kvb[..., :NOPE], k_pe.unsqueeze(2).expand(batch, T, H, R)], -1)
        q = torch.cat([q_nope, q_pe], -1)
        if cfg is None:
            return sparse_attention(q, k, kvb[..., NOPE:], idx, scale=scale)
        return fa.sparse_attention_flex(q, k, kvb[..., NOPE:], idx, scale, cfg)

    def fb(f):
        def run():
            for x in leaves:
                x.grad = None
            o = f()
            o.backward(do)
            return o
        return run

    probe = torch.empty(batch, T, H, 1, device=dev)
    row = {"T": T, "H": H, "batch": batch, "mha_dense_tiles": fa.dense_tiles_apply(probe, probe, idx)}
    got = {}
    for name, f in [("absorbed", absorbed), ("mha", mha)]:
        o = fb(f)()
        got[name] = [o.float()] + [x.grad.float() for x in leaves]
        row[f"{name}_fwd_ms"] = timeit(f, reps=reps)
        row[f"{name}_fwdbwd_ms"] = timeit(fb(f), reps=reps)
    row["rel_err"] = max((a - b).abs().max().item() / b.abs().max().item()
                         for a, b in zip(got["mha"], got["absorbed"]))
    row["mask_ms"] = timeit(lambda: fa.selection_block_mask(idx, T, T), reps=reps)
    row["ratio"] = row["absorbed_fwdbwd_ms"] / row["mha_fwdbwd_ms"]
    log(f"forms T={T} H={H} B={batch}: absorbed fwd {row['absorbed_fwd_ms']:.2f} fwd+bwd "
        f"{row['absorbed_fwdbwd_ms']:.2f} ms | MHA fwd {row['mha_fwd_ms']:.2f} fwd+bwd {row['mha_fwdbwd_ms']:.2f} ms "
        f"(block mask {row['mask_ms']:.2f}) | absorbed / MHA {row['ratio']:.2f}x | rel err {row['rel_err']:.2g}")
    # FlexAttention's kernels alone (the block mask built once, outside the timing), default vs each variant,
    # each checked against the default's output and gradients
    with torch.no_grad():
        kvb = torch.einsum("btc,hnc->bthn", kv_lat, w)
        k0 = torch.cat([kvb[..., :NOPE], k_pe.unsqueeze(2).expand(batch, T, H, R)], -1).contiguous()
        q0 = torch.cat([q_nope, q_pe], -1).contiguous()
        v0 = kvb[..., NOPE:].contiguous()
    qkv = [x.detach().requires_grad_() for x in (q0, k0, v0)]
    bm = fa.selection_block_mask(idx, T, T)

    def flex_fb(cfg, mask):
        def run():
            for x in qkv:
                x.grad = None
            fa.flex_on_mask(*qkv, mask, scale, cfg).backward(do)
        return run

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)  # one graph a variant

    where = f"forms T={T} H={H} B={batch}"

    def timed(label, fwd_fn, fb, ref):
        """{fwd_ms, fwdbwd_ms, bwd_ms, grad_err} of one kernel setting (its dq, dk, dv against ref, None: itself),
        or None where it does not launch (shared memory, registers: reported, not fatal)."""
        try:
            fb()
            grads = [x.grad.float() for x in qkv]
            err = max((a - b).abs().max().item() / b.abs().max().item() for a, b in zip(grads, ref or grads))
            fwd, tot = timeit(fwd_fn, reps=reps), timeit(fb, reps=reps)
        except Exception as e:
            log(f"{where}: {label} failed: {type(e).__name__}: {str(e)[:160]}")
            return None
        log(f"{where}: {label}: fwd {fwd:.2f} bwd {tot - fwd:.2f} fwd+bwd {tot:.2f} ms (grads vs flex default "
            f"{err:.2g})")
        return {"fwd_ms": fwd, "fwdbwd_ms": tot, "bwd_ms": tot - fwd, "grad_err": err}

    ref = None
    for name, c in [("default", {})] + (list(FLEX_VARIANTS.items()) if variants else []):
        cfg = {**fa.FLEX_CONFIG, **c}
        mask = fa.selection_block_mask(idx, T, T, cfg["FULL_BLOCKS"]) if "FULL_BLOCKS" in c else bm
        res = timed(f"flex {name}", lambda m=mask, cf=cfg: fa.flex_on_mask(*qkv, m, scale, cf), flex_fb(cfg, mask),
                    ref)
        if res is not None:
            row[f"flex_{name}"] = res
            ref = ref or [x.grad.float() for x in qkv]
    # the same tiles by triton_tile_attn.py (no head-dim padding), its launch and the variants
    from moeadapt.ops.dsa import triton_tile_attn as tta

    tiles = fa.selection_tiles(idx, T, T)
    flex_ms = row.get("flex_default")
    for name, c in [("default", {})] + (list(TILE_VARIANTS.items()) if tile_variants else []):
        launch = {**tta.TILE_LAUNCH, **c}

        def tiles_fb(launch=launch):
            for x in qkv:
                x.grad = None
            tta.tile_attention(*qkv, tiles, scale, launch).backward(do)

        res = timed(f"tiles {name}", lambda lc=launch: tta.tile_attention(*qkv, tiles, scale, lc), tiles_fb, ref)
        if res is not None:
            row[f"tiles_{name}"] = res
            if flex_ms:
                log(f"{where}: tiles {name}: flex default / this: fwd {flex_ms['fwd_ms'] / res['fwd_ms']:.2f}x bwd "
                    f"{flex_ms['bwd_ms'] / res['bwd_ms']:.2f}x fwd+bwd {flex_ms['fwdbwd_ms'] / res['fwdbwd_ms']:.2f}x")
    return row


def plot_forms(rows: list[dict], path: str, title: str) -> None:
    """fwd + bwd ms of the two MLA forms against T, one colour per head count: absorbed (circles, solid), the MHA
    form (squares, dashed; where a row lacks it, its tile kernels alone, hollow), the form the layer takes now
    (`flex_attn.mha_form_pays` at DeepSeek's dims) filled. Written atomically."""
    import os
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moeadapt.ops.dsa import flex_attn as fa

    fig, ax = plt.subplots(figsize=(8.0, 4.8))
    for i, H in enumerate(sorted({r["H"] for r in rows})):
        c = f"C{i}"
        mine = sorted((r for r in rows if r["H"] == H and (r.get("mha_fwdbwd_ms") or r.get("tiles_default"))),
                      key=lambda r: r["T"])  # a row whose tiles did not launch has nothing to draw for the MHA form
        T = [r["T"] for r in mine]
        ab = [r["absorbed_fwdbwd_ms"] for r in mine]
        whole = [bool(r.get("mha_fwdbwd_ms")) for r in mine]  # the whole MHA form timed, else its tiles alone
        mha = [r["mha_fwdbwd_ms"] if w else r["tiles_default"]["fwdbwd_ms"] for r, w in zip(mine, whole)]
        ax.plot(T, ab, "-", color=c, label=f"{H} heads: absorbed")
        ax.plot(T, mha, "--", color=c, label=f"{H} heads: MHA form")
        for t, a, m, w in zip(T, ab, mha, whole):
            now = fa.mha_form_pays(t, TOPK, MLA_NOPE + MLA_ROPE, MLA_VD, MLA_KVL + MLA_ROPE, MLA_KVL, True, heads=H)
            ax.plot(t, a, "o", color=c, mfc="white" if now else c)
            ax.plot(t, m, "s", mec=c, mfc=(c if now else "white") if w else "none", alpha=1.0 if w else 0.6)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("T (tokens, top-2048 selections)")
    ax.set_ylabel("fwd + bwd ms, one layer")
    ax.set_title(title + "\nfilled: the form the layer takes now; hollow square: the MHA form's tiles alone", fontsize=9)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    out = Path(path)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    os.replace(tmp, out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, nargs="+", default=[8192, 32768, 131072])
    ap.add_argument("--H", type=int, nargs="+", default=[64, 128])
    ap.add_argument("--sweep", nargs="*", default=None, help="ops to sweep: fwd bwd li (none given: all)")
    ap.add_argument("--out", default="bench_dsa.json")
    ap.add_argument("--budget_s", type=float, default=400.0)
    ap.add_argument("--check", action="store_true",
                    help="SFA/SFAG launch variants at the first --T (default 32768), each --H; then exit")
    ap.add_argument("--bwd", nargs="+", default=None, help="--check: only these backward variants (CHECK_BWD names)")
    ap.add_argument("--fwd-only", action="store_true",
                    help="with --check: only SFA, with more forward launch shapes (CHECK_FWD_MORE)")
    ap.add_argument("--no-baselines", dest="baselines", action="store_false",
                    help="time only ours (the PyTorch composition and SDPA do not change between runs)")
    ap.add_argument("--li", action="store_true", help="the indexer's launch variants (LI_CANDIDATES) "
                    "at each --T and --hi; then exit")
    ap.add_argument("--hi", type=int, nargs="+", default=[HI], help="indexer heads for --li")
    ap.add_argument("--batch", type=int, default=1, help="batch size for --li, --check and --forms")
    ap.add_argument("--no-flex-variants", dest="flex_variants", action="store_false",
                    help="--forms: time FlexAttention's default launch only, not FLEX_VARIANTS")
    ap.add_argument("--no-tile-variants", dest="tile_variants", action="store_false",
                    help="--forms: time triton_tile_attn's TILE_LAUNCH only, not TILE_VARIANTS")
    ap.add_argument("--forms", action="store_true", help="MLA attention fwd + bwd, absorbed vs MHA form, at each "
                    "--T and --H; then exit")
    ap.add_argument("--plot-forms", nargs="+", default=None, metavar="JSON",
                    help="plot the --forms rows of these result files into --out (a .png); no GPU needed")
    ap.add_argument("--title", default="MLA attention, absorbed vs MHA form", help="--plot-forms: the title")
    a = ap.parse_args()
    if a.plot_forms:
        rows = [r for f in a.plot_forms for r in json.load(open(f)).get("forms", [])]
        if not rows:
            raise SystemExit(f"--plot-forms: no --forms rows in {' '.join(a.plot_forms)}")
        plot_forms(rows, a.out, a.title)
        print(f"wrote {a.out} ({len(rows)} rows)")
        return
    t_start = time.time()

    def log(msg):
        print(f"[{time.time() - t_start:6.1f}s] {msg}", flush=True)

    res = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    import triton

    res["triton"] = triton.__version__
    if a.check:
        log(f"{res['gpu']} torch {res['torch']} triton {res['triton']}")
        res["check"] = check(log, T=a.T[0] if a.T != [8192, 32768, 131072] else 32768, Hs=tuple(a.H[::-1]),
                             fwd_only=a.fwd_only, bwd_names=a.bwd, batch=a.batch)
    elif a.forms:
        res["forms"] = forms(log, a.T, a.H, a.batch, variants=a.flex_variants, tile_variants=a.tile_variants)
    elif a.li:
        res["li"] = li_shapes(log, a.T, a.hi, a.batch)
    if a.check or a.forms or a.li:  # one mode, then exit
        with open(a.out, "w") as f:
            json.dump(res, f, indent=1)
        log("done")
        return
    if a.sweep is not None:
        ops = set(a.sweep or ["fwd", "bwd", "li"])
        res["sweep"] = try_run("sweep", lambda: sweep(log, ops=ops), log)
    for T in a.T:
        for H in a.H:
            if time.time() - t_start > a.budget_s:
                log(f"budget reached, skipping T={T} H={H}")
                continue
            row = try_run(f"T={T} H={H}", lambda T=T, H=H: bench_shape(T, H, log, run_torch=a.baselines and T <= 32768,
                                                     run_sdpa=a.baselines and T <= 32768), log)
            if row:
                res["rows"].append(row)
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    log("done")


if __name__ == "__main__":
    main()
