"""Tile sweep for the fold_io passes of the fused grouped LoRA (issue 5), on one GPU:

    python benchmarks/tune_fold.py [--E 64 --K 8] [--out best.json]

Times, at the bench_moe shapes (T = 16384 tokens, latent L = 1024, expert ffn F = 1024, r = 16, bf16, uniform
routing), each candidate tile of the three fold passes (`fused_lora.fold_in` in gather and SwiGLU modes,
`fused_lora.fold_swiglu_bwd`), checks each candidate's output against the first tile's, and prints the bytes
each pass must move with the effective bandwidth. Writes the fastest tiles as JSON (`bench_moe.py --fold-tiles`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("TRITON_INTERPRET", "0")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import triton.testing  # noqa: E402

from moeadapt.ops.moe import fused_lora, offsets_from_counts  # noqa: E402


def gemm_widths(a, bench, dev, dt):
    """torch._grouped_mm at the fused path's layouts with the K (forward, [x | s·x·A]·[W | Bᵀ]ᵀ) or N
    (backward dx, dy·[W | Bᵀ]) dimension widened from 1024 by the rank columns: which padding costs least."""
    N = a.T * a.K
    counts = torch.full((a.E,), N // a.E, dtype=torch.int64)
    offs = torch.cumsum(counts, 0).to(torch.int32).to(dev)
    for O, name in ((2 * a.F, "gate/up"), (a.L, "down")):
        I = a.L if O == 2 * a.F else a.F
        for J in (I, I + 16, I + 32, I + 64, I + 128):
            x = torch.randn(N, J, device=dev, dtype=dt)
            w = torch.randn(a.E, O, J, device=dev, dtype=dt) * 0.02
            dy = torch.randn(N, O, device=dev, dtype=dt)
            f = bench(lambda x=x, w=w: torch._grouped_mm(x, w.transpose(1, 2), offs=offs), warmup=5, rep=50)
            b = bench(lambda dy=dy, w=w: torch._grouped_mm(dy, w, offs=offs), warmup=5, rep=50)
            fl = 2 * N * J * O
            print(f"gemm {name} width {J}: fwd {f:.3f} ms ({fl / f / 1e9:.0f} TF/s), bwd dx {b:.3f} ms "
                  f"({fl / b / 1e9:.0f} TF/s)", flush=True)
            if J > I:  # the base GEMM on the [W | Bᵀ] buffer's view (row stride J), as fused_lora's split dx runs it
                wv, xv = w[:, :, :I], x[:, :I].contiguous()
                f = bench(lambda xv=xv, wv=wv: torch._grouped_mm(xv, wv.transpose(1, 2), offs=offs), warmup=5, rep=50)
                b = bench(lambda dy=dy, wv=wv: torch._grouped_mm(dy, wv, offs=offs), warmup=5, rep=50)
                fl = 2 * N * I * O
                print(f"gemm {name} width {I} as a view of width {J}: fwd {f:.3f} ms ({fl / f / 1e9:.0f} TF/s), "
                      f"bwd dx {b:.3f} ms ({fl / b / 1e9:.0f} TF/s)", flush=True)
                del wv, xv
            del x, w, dy


IN_TILES = [(64, 128, 4, 3), (64, 128, 8, 3), (32, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3),
            (32, 256, 4, 2), (64, 256, 8, 2), (16, 256, 4, 3), (128, 128, 8, 2)]
BWD_TILES = [(64, 128, 4, 2), (64, 128, 8, 2), (32, 128, 4, 2), (64, 64, 4, 2), (32, 64, 4, 2),
             (128, 64, 8, 2), (16, 256, 4, 2), (32, 256, 8, 2), (128, 128, 8, 2)]

# round 2 (after session 3's call 3: best in_swiglu (64, 64, 4, 3) 0.333 ms, swiglu_bwd (16, 256, 4, 2) 0.456 ms)
IN_TILES2 = [(64, 64, 4, 3), (64, 32, 4, 3), (32, 64, 4, 3), (64, 64, 4, 4), (128, 32, 8, 3), (64, 64, 4, 2),
             (32, 32, 4, 3), (128, 64, 4, 3)]
BWD_TILES2 = [(16, 256, 4, 2), (16, 128, 4, 2), (16, 256, 8, 2), (16, 512, 8, 2), (16, 64, 2, 2), (32, 64, 2, 2),
              (16, 128, 2, 2), (16, 512, 4, 2), (32, 32, 4, 2)]

# session 3 call 6 (H200, E = 64): swiglu_in best (64, 32, 4, 3) 0.394 ms; swiglu_bwd best (16, 128, 2, 2) 0.876 ms
# (with B loaded twice; now once and transposed in registers), (16, 256, 4, 2) 20.9 ms (pathological)
LEAN_IN = [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2)]
# call 7 (B loaded once): swiglu_bwd best (32, 64, 2, 2) 0.602 ms, (64, 64/128, 4, 2) 0.630, (16, 128, 2, 2) 0.968.
# 5th entry: SPLIT, the column slices run as separate programs (dh as partial sums)
LEAN_BWD = [(32, 64, 2, 2, 1), (32, 64, 2, 2, 4), (32, 128, 4, 2, 8), (64, 128, 4, 2, 8), (16, 128, 2, 2, 8),
            (64, 64, 4, 2, 16), (32, 64, 2, 2, 16), (128, 128, 8, 2, 8)]


def lean(a, bench, dev, dt, N, offsets, gu, A_d):
    """Tile sweep of lean_lora's SwiGLU passes (one LoRA on the packed gate/up: shared h)."""
    from moeadapt.ops.moe import lean_lora

    F, R, B = a.F, a.R, 2
    h = torch.randn(N, R, device=dev, dtype=dt) * 0.1
    B_gu = torch.randn(a.E, R, 2 * F, device=dev, dtype=dt) * 0.03
    acat = torch.empty(N, F + R, device=dev, dtype=dt)
    da = torch.randn(N, F, device=dev, dtype=dt)
    gd = torch.randn(N, R, device=dev, dtype=dt)
    dgu = torch.empty_like(gu)
    dh = torch.empty(N, R, device=dev, dtype=dt)
    runs = {
        "swiglu_in": (lambda: lean_lora.swiglu_lora_in(gu[:, :F], gu[:, F:], h, h, B_gu[:, :, :F], B_gu[:, :, F:],
                                                       A_d, offsets, 2.0, acat[:, :F], acat[:, F:]),
                      acat, B * N * (2 * F + F + R), "BK", LEAN_IN),
        "swiglu_bwd": (lambda: lean_lora.swiglu_lora_bwd(da, gd, A_d, 2.0, gu[:, :F], gu[:, F:], h, h,
                                                         B_gu[:, :, :F], B_gu[:, :, F:], offsets, dgu[:, :F],
                                                         dgu[:, F:], dh),
                       dgu, B * N * (F + 2 * F + 2 * F), "BN", LEAN_BWD),
    }
    best = {}
    for name, (fn, out, nbytes, wide, tiles) in runs.items():
        res, ref = [], None
        for t in tiles:
            lean_lora.LEAN_TILES[name] = {"BM": t[0], wide: t[1], "num_warps": t[2], "num_stages": t[3]}
            if len(t) > 4:
                lean_lora.LEAN_TILES[name]["SPLIT"] = t[4]
            try:
                fn()
                got = out.float().clone()
                ref = got if ref is None else ref
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                ms = bench(fn, warmup=5, rep=50)
            except Exception as e:  # noqa: BLE001  (report the tile that fails, go on)
                print(f"lean {name} {t}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            res.append((ms, dict(lean_lora.LEAN_TILES[name])))
            print(f"lean {name} {t}: {ms:.3f} ms, {nbytes / ms / 1e6:.0f} GB/s, rel err vs first {err:.1e}", flush=True)
        ms, cfg = min(res, key=lambda r: r[0])
        lean_lora.LEAN_TILES[name] = best[name] = cfg
        print(f"best lean {name}: {ms:.3f} ms {cfg}", flush=True)
    print(json.dumps(best))
    return best


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--E", type=int, default=64)
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--T", type=int, default=16384)
    ap.add_argument("--L", type=int, default=1024)
    ap.add_argument("--F", type=int, default=1024)
    ap.add_argument("--R", type=int, default=16)
    ap.add_argument("--out", default=None)
    ap.add_argument("--gemm", action="store_true", help="only time grouped GEMMs at widths 1024 + {0,16,32,64,128}")
    ap.add_argument("--lean", action="store_true", help="the lean_lora SwiGLU passes instead of the fold passes")
    ap.add_argument("--round2", action="store_true", help="the second tile list (around call 3's best)")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run under TRITON_INTERPRET=1 (use small --T/--L/--F)")
    a = ap.parse_args()
    dev, dt = a.device, torch.bfloat16 if a.device == "cuda" else torch.float32
    torch.manual_seed(0)
    if a.device == "cpu":  # dry run: no Triton driver for do_bench
        import time

        def bench(fn, warmup=0, rep=0):
            t = time.perf_counter()
            fn()
            return 1e3 * (time.perf_counter() - t)
    else:
        bench = triton.testing.do_bench
    if a.gemm:
        gemm_widths(a, bench, dev, dt)
        return
    N = a.T * a.K
    counts = torch.full((a.E,), N // a.E, dtype=torch.int64)
    counts[: N - int(counts.sum())] += 1
    offsets = offsets_from_counts(counts).to(dev)
    row_index = torch.randperm(N, device=dev).to(torch.int32)
    z = torch.randn(a.T, a.L, device=dev, dtype=dt)
    A_in = torch.randn(a.E, a.L, a.R, device=dev, dtype=dt) * 0.03
    A_dn = torch.randn(a.E, a.F, a.R, device=dev, dtype=dt) * 0.03
    gu = torch.randn(N, 2 * a.F, device=dev, dtype=dt)
    gate, up = gu[:, : a.F], gu[:, a.F:]
    RP = fused_lora.padded_rank(a.R)
    xcat = torch.empty(N, a.L + RP, device=dev, dtype=dt)
    hcat = torch.empty(N, a.F + RP, device=dev, dtype=dt)
    base = torch.randn(N, a.F + RP, device=dev, dtype=dt)
    g = base[:, a.F:a.F + a.R]
    dgu = torch.empty_like(gu)
    B = 2  # bytes per element
    if a.lean:
        best = lean(a, bench, dev, dt, N, offsets, gu, A_dn)
        if a.out:
            with open(a.out + ".tmp", "w") as f:
                json.dump({f"lean_{k}": v for k, v in best.items()}, f)
            os.replace(a.out + ".tmp", a.out)
        return
    passes = {
        "in_gather": (lambda: fused_lora.fold_in(z, A_in, offsets, 2.0, xcat, row_index_N=row_index, K=a.K),
                      xcat, B * N * (a.L + a.L + RP)),
        "in_swiglu": (lambda: fused_lora.fold_in(gate, A_dn, offsets, 2.0, hcat, up_NI=up),
                      hcat, B * N * (2 * a.F + a.F + RP)),
        "swiglu_bwd": (lambda: fused_lora.fold_swiglu_bwd(base[:, : a.F], g, A_dn, offsets, 2.0, gate, up,
                                                          dgu[:, : a.F], dgu[:, a.F:]),
                       dgu, B * N * ((a.F + a.R) + 2 * a.F + 2 * a.F)),
    }
    ref_copy = bench(lambda: xcat.copy_(torch.empty_like(xcat)), warmup=5, rep=50)
    print(f"# E={a.E} K={a.K} N={N}: torch copy of xcat ({2 * xcat.numel() * B / 1e9:.2f} GB moved) "
          f"{ref_copy:.3f} ms = {2 * xcat.numel() * B / ref_copy / 1e6:.0f} GB/s", flush=True)
    best = {}
    for name, (fn, out, nbytes) in passes.items():
        if a.round2:
            tiles = BWD_TILES2 if name == "swiglu_bwd" else (IN_TILES if name == "in_gather" else IN_TILES2)
        else:
            tiles = BWD_TILES if name == "swiglu_bwd" else IN_TILES
        ref = None
        res = []
        for t in tiles:
            cfg = (dict(BM=t[0], BN=t[1]) if name == "swiglu_bwd" else dict(BM=t[0], BK=t[1]))
            cfg.update(num_warps=t[2], num_stages=t[3])
            fused_lora.FOLD_TILES[name] = cfg
            try:
                fn()
                if dev == "cuda":
                    torch.cuda.synchronize()
                got = out.float().clone()
                if ref is None:
                    ref = got
                err = ((got - ref).abs().max() / ref.abs().max()).item()
                ms = bench(fn, warmup=5, rep=50)
            except Exception as e:  # noqa: BLE001  (a tile that does not compile or launch: report, go on)
                print(f"{name} {cfg}: failed {type(e).__name__}: {str(e)[:120]}", flush=True)
                continue
            res.append((ms, cfg))
            print(f"{name} {cfg}: {ms:.3f} ms, {nbytes / ms / 1e6:.0f} GB/s, rel err vs first {err:.1e}", flush=True)
        ms, cfg = min(res, key=lambda r: r[0])
        best[name] = cfg
        fused_lora.FOLD_TILES[name] = cfg
        print(f"best {name}: {ms:.3f} ms {cfg} (first tile {res[0][0]:.3f} ms)", flush=True)
    print(json.dumps(best))
    if a.out:
        tmp = a.out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(best, f)
        os.replace(tmp, a.out)


if __name__ == "__main__":
    main()
