"""Launch sweep of the lean grouped-LoRA passes (ops/moe/lean_lora.py) at one MoE layer of the `small` LoRA step.

Usage (GPU, from the repo root after `. benchmarks/gpu_env.sh`):
    python3 benchmarks/bench_lean_tiles.py [--quick] [--passes gather_in swiglu_in ...] [--out R.json]
CPU check of this script (TRITON_INTERPRET=1, a tiny shape, fp32, checks only):
    python benchmarks/bench_lean_tiles.py --dry-run

Shapes: one layer of `small` (presets.py) as profile_step.py trains it: T = seq 4096 x micro-batch 2 tokens, top-K of
E experts (N = T·K routed rows, uniform-ish routing: each token's K distinct experts from random scores, rows
sorted by `permutation` as the step does), latent width I = latent_dim, expert ffn F = moe_intermediate_size, LoRA
rank R on each of w1, w3, w2 (w1's and w3's A as one [E, I, 2R] operand, two B's: the model's forward_lean with
its gate/up buffer), bf16 activations, fp32 adapter gradients. The operands are laid out as _LeanCatFn lays them
(strided views of the gather's h, the gate/up GEMM's output, acat, the down GEMM's dx and dcat).

Passes (each called through its wrapper with an explicit launch: `tiles=` / `launch=`; the tables beside the
kernels are only read, as the defaults):
  gather_in   gather_lora_in:   x = z[row_index // K], h = s·x·A              (FOLD_TILES["in_gather"])
  swiglu_in   swiglu_lora_in:   a = silu(g + hg·B_g)·(u + hu·B_u), hd = s_d·a·A_d  (LEAN_TILES["swiglu_in"])
  swiglu_bwd  swiglu_lora_bwd:  dg, du, dh of the SwiGLU with both LoRA terms   (LEAN_TILES["swiglu_bwd"])
  wgrad_*     grouped_wgrad (kgmm's kernel) for the backward's dB_g (= dB_u's shape, two launches a layer),
              dA_d, dB_d and dA, at wgrad_launch(I, O) and variants of the wide side's block, BK, warps, stages.
The wrapper's default launch runs first (the reference); then the current launch passed explicitly (on the GPU it
must give the default's bits, and its time is a second sample of the current launch: the faster of the two is the
baseline), then the candidates. Every launch runs once into NaN-filled outputs and is checked element-wise against
the reference (|got - want| <= ATOL_FRAC·max|want| + RTOL·|want|: bf16 rounding flips pass, a skipped or wrong
tile does not); a difference prints MISMATCH and the script exits 1 at the end. Then it is timed
(triton.testing.do_bench, median, L2 flushed between calls). Per pass: a table sorted by time with µs, GB/s over
the pass's minimal bytes (each operand read once, each output written once), the ratio to the baseline and the
compiled kernel's registers / spilled bytes / shared KB; then the best launch per pass and what it would save per
step (launches per step = MoE layers x calls per layer), and the tile map's cost per BM (the row-tiled passes of
a layer share one map per distinct BM). A launch that fails to compile (out of resources) is listed, not fatal.
--time-limit S: no new launch starts after S seconds (the tables show what was measured). About 100 launches,
~1 s each (compile, check, time): ~2 minutes on an H100; --quick ~30.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moeadapt.config.presets import get_preset  # noqa: E402
from moeadapt.ops.moe import fused_lora, lean_lora, offsets_from_counts, permutation, triton_grouped_mm  # noqa: E402
from moeadapt.ops.moe.fused_lora import FOLD_TILES, padded_rank  # noqa: E402
from moeadapt.ops.moe.lean_lora import LEAN_TILES, gather_lora_in, swiglu_lora_bwd, swiglu_lora_in  # noqa: E402
from moeadapt.ops.moe.triton_grouped_mm import grouped_wgrad, wgrad_launch  # noqa: E402

# element-wise check of a variant against the current launch: 2^-6 relative (two bf16 roundings apart) plus an
# absolute floor of 1e-3 of the output's largest magnitude (fp32 summation-order noise near zero)
RTOL = 2.0**-6
ATOL_FRAC = 1e-3

# Candidate launches per pass (the current launch is always timed first, and not repeated if listed).
# gather_in / swiglu_in: (BM, BK, num_warps, num_stages); swiglu_bwd: (BM, BN, num_warps, num_stages, SPLIT);
# wgrad: (block of the wide side, BK, num_warps, num_stages), the rank side's block kept as wgrad_launch's.
# Pruned by hand around what a memory-bound pass with a thin (rank <= 32) dot wants: tiles of 1K-16K elements, enough
# warps to keep loads in flight, 2-4 stages. Compiled for sm_90 at the step's widths (triton 3.9, the JIT's
# argument specialization), the SwiGLU backward spills at 2 warps (the current launch: 255 registers, 64 B) and
# badly at BN >= 128 (0.5-6 KB), so its list leans to 4-8 warps and BN <= 64. QUICK[pass]: the first few of each.
GATHER_IN = [(64, 128, 4, 3), (64, 64, 4, 3), (64, 128, 8, 3), (64, 128, 4, 4), (64, 256, 8, 3), (64, 64, 2, 4),
             (32, 128, 4, 3), (32, 128, 2, 3), (32, 256, 4, 3), (32, 64, 2, 4),
             (128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (128, 128, 4, 2),
             (16, 128, 2, 3), (16, 256, 4, 3)]
SWIGLU_IN = [(64, 32, 4, 3), (64, 64, 4, 3), (128, 32, 8, 3), (32, 64, 4, 3), (64, 64, 8, 3), (64, 32, 4, 4),
             (64, 64, 4, 2), (64, 32, 2, 3), (64, 128, 4, 3), (32, 64, 2, 3), (32, 128, 4, 3), (32, 32, 2, 4),
             (128, 64, 8, 3), (128, 32, 4, 3), (128, 64, 8, 2), (16, 64, 2, 3), (16, 128, 4, 3)]
SWIGLU_BWD = [(32, 64, 2, 2, 1), (32, 64, 4, 2, 1), (64, 64, 4, 2, 1), (64, 64, 8, 2, 1), (32, 32, 2, 3, 1),
              (128, 64, 8, 2, 1), (32, 64, 4, 3, 1), (32, 64, 2, 3, 1), (32, 32, 2, 2, 1), (32, 32, 4, 2, 1),
              (16, 64, 2, 3, 1), (16, 64, 4, 2, 1), (16, 32, 2, 2, 1), (64, 64, 4, 3, 1), (64, 32, 4, 2, 1),
              (64, 32, 2, 3, 1), (64, 128, 8, 2, 1), (128, 32, 4, 2, 1), (128, 32, 8, 2, 1), (32, 128, 4, 2, 1),
              (32, 64, 4, 2, 2), (64, 64, 4, 2, 2), (64, 64, 8, 2, 3), (128, 64, 8, 2, 4)]
WGRAD = [(128, 64, 4, 3), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 4, 3), (128, 64, 4, 4), (64, 128, 4, 3),
         (64, 64, 2, 4), (128, 32, 4, 4), (256, 64, 8, 3), (256, 32, 8, 4), (32, 128, 4, 3)]
QUICK = {"gather_in": 5, "swiglu_in": 5, "swiglu_bwd": 6, "wgrad": 4}


def _fmt_bytes(n: float) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e6 else f"{n / 1e3:.1f} KB"


class Pass:
    """One timed pass: call(launch or None) runs it with that launch (None: the wrapper's default), `outputs`
    names the result views checked after each variant, `fill` the buffers NaN-filled before a check run."""

    def __init__(self, name: str, per_step: int, min_bytes: float, call: Callable, current: dict,
                 variants: list[dict], outputs: dict[str, torch.Tensor], fill: list[torch.Tensor], fmt: Callable,
                 kernel=None):
        self.name, self.per_step, self.min_bytes, self.call, self.kernel = name, per_step, min_bytes, call, kernel
        self.current, self.outputs, self.fill, self.fmt = current, outputs, fill, fmt
        # the current launch passed explicitly first: against the wrapper's default (the reference), it must agree
        # (bit for bit on the GPU, where the default is that launch; its time there is a second sample of it)
        self.variants = [current] + [v for v in variants if v != current]


def _shapes(a) -> dict:
    """The step's shapes from the preset (overridable), or the dry run's tiny ones."""
    if a.dry_run:
        return dict(T=40, K=3, E=6, I=48, F=40, R=4, layers=1)
    spec = get_preset(a.preset)
    return dict(T=a.T, K=spec.n_experts_per_tok, E=spec.n_routed_experts, I=spec.latent_dim or spec.hidden_size,
                F=spec.moe_intermediate_size, R=a.R, layers=spec.n_layers - spec.first_k_dense)


def build(sh: dict, dev: str, dt: torch.dtype, seed: int = 0) -> dict:
    """One layer's operands, laid out as _LeanCatFn lays them (see the module docstring). Every pass reads inputs
    of its own (random) and writes outputs no other pass reads, so a failed or wrong variant of one pass cannot
    change what the next pass checks or times."""
    T, K, E, I, F, R = (sh[k] for k in "TKEIFR")
    g = torch.Generator(device=dev).manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g, device=dev) * scale).to(dt)

    def empty(*shape):
        return torch.empty(*shape, device=dev, dtype=dt)

    scores = torch.rand(T, E, generator=torch.Generator().manual_seed(seed))
    ids_TK = scores.topk(K, dim=1).indices.to(dev)  # K distinct experts a token, uniform-ish loads
    row_index_N, counts_E = permutation(ids_TK, E, num_routed=T * K)
    offsets_E = offsets_from_counts(counts_E)
    N = row_index_N.shape[0]
    RW, RWd = padded_rank(2 * R), padded_rank(R)  # h [N, RW] holds [h_g | h_u]; hd [N, RWd]
    return dict(
        N=N, rows=int(offsets_E[-1]), row_index_N=row_index_N, offsets_E=offsets_E, s=2.0, s_d=2.0,
        z_TI=rnd(T, I), A_EIR=rnd(E, I, 2 * R, scale=I**-0.5),  # w1's and w3's A as one operand
        Bg=rnd(E, R, F, scale=R**-0.5), Bu=rnd(E, R, F, scale=R**-0.5), Ad=rnd(E, F, R, scale=F**-0.5),
        x_out=empty(N, I), h_out=empty(N, RW),  # the gather's outputs
        h_NW=rnd(N, RW, scale=2.0),  # the gather's h as the SwiGLU passes read it: hg = [:, :R], hu = [:, R:2R]
        gu=rnd(N, 2 * F),  # the gate/up GEMM's output: gate = [:, :F], up = [:, F:]
        acat=empty(N, F + RWd),  # swiglu_in's outputs [a | hd]: the down GEMM's input
        dxc=rnd(N, F + RWd, scale=0.1),  # dy·[W_d | B_dᵀ]: da = [:, :F], gd = [:, F:F + R]
        dcat=empty(N, 2 * F + RW),  # swiglu_bwd's outputs [d(gate) | d(up) | dh_g | dh_u]
        # the K-grouped GEMMs' inputs: x (the gather's), acat, dy, dcat as the backward holds them
        x_NI=rnd(N, I), acat_in=rnd(N, F + RWd), dy=rnd(N, I, scale=0.1), dcat_in=rnd(N, 2 * F + RW, scale=0.1))


def _lean_fmt(keys):
    short = dict(num_warps="w", num_stages="s", SPLIT="x")
    return lambda t: " ".join(f"{short.get(k, k)}{t[k]}" for k in keys)


def passes(sh: dict, o: dict, which: list[str], quick: bool) -> list[Pass]:
    T, K, E, I, F, R, L = (sh[k] for k in ("T", "K", "E", "I", "F", "R", "layers"))
    rows, offs, dt_size = o["rows"], o["offsets_E"], o["z_TI"].element_size()
    RW = o["h_NW"].shape[1]
    hg, hu = o["h_NW"][:, :R], o["h_NW"][:, R:2 * R]
    g_NF, u_NF = o["gu"][:, :F], o["gu"][:, F:]
    a_NF, hd_NW = o["acat"][:, :F], o["acat"][:, F:]
    da_NF, gd_NR = o["dxc"][:, :F], o["dxc"][:, F:F + R]
    dcat = o["dcat"]
    dg_NF, du_NF, dhg, dhu = dcat[:, :F], dcat[:, F:2 * F], dcat[:, 2 * F:2 * F + R], dcat[:, 2 * F + R:2 * F + 2 * R]
    out: list[Pass] = []

    def pick(grid, name):
        return grid[:QUICK[name]] if quick else grid

    if "gather_in" in which:
        keys = ("BM", "BK", "num_warps", "num_stages")
        out.append(Pass(
            "gather_in", L, (T * I + rows * I + rows * RW) * dt_size + rows * 8,
            lambda t: gather_lora_in(o["z_TI"], o["A_EIR"], offs, o["s"], o["row_index_N"], K, o["x_out"],
                                     o["h_out"], tiles=t),
            dict(FOLD_TILES["in_gather"]), [dict(zip(keys, v)) for v in pick(GATHER_IN, "gather_in")],
            {"x": o["x_out"][:rows], "h": o["h_out"][:rows]}, [o["x_out"], o["h_out"]], _lean_fmt(keys),
            fused_lora._lora_in_kernel))
    if "swiglu_in" in which:
        keys = ("BM", "BK", "num_warps", "num_stages")
        out.append(Pass(
            "swiglu_in", L, rows * (2 * F + 2 * R + F + hd_NW.shape[1]) * dt_size,
            lambda t: swiglu_lora_in(g_NF, u_NF, hg, hu, o["Bg"], o["Bu"], o["Ad"], offs, o["s_d"], a_NF,
                                     hd_NW, tiles=t),
            dict(LEAN_TILES["swiglu_in"]), [dict(zip(keys, v)) for v in pick(SWIGLU_IN, "swiglu_in")],
            {"a": a_NF[:rows], "hd": hd_NW[:rows]}, [o["acat"]], _lean_fmt(keys), lean_lora._swiglu_lora_in_kernel))
    if "swiglu_bwd" in which:
        keys = ("BM", "BN", "num_warps", "num_stages", "SPLIT")
        cur = dict(LEAN_TILES["swiglu_bwd"])
        cur.setdefault("SPLIT", 1)
        out.append(Pass(
            "swiglu_bwd", L, rows * (F + R + 2 * F + 2 * R + 2 * F + 2 * R) * dt_size,
            lambda t: swiglu_lora_bwd(da_NF, gd_NR, o["Ad"], o["s_d"], g_NF, u_NF, hg, hu, o["Bg"], o["Bu"],
                                      offs, dg_NF, du_NF, dhg, dhu, tiles=t),
            cur, [dict(zip(keys, v)) for v in pick(SWIGLU_BWD, "swiglu_bwd")],
            {"dg": dg_NF[:rows], "du": du_NF[:rows], "dh_g": dhg[:rows], "dh_u": dhu[:rows]}, [dcat], _lean_fmt(keys),
            lean_lora._swiglu_lora_bwd_kernel))
    # the backward's K-grouped GEMMs as _down_backward / _LeanCatFn.backward call kgmm (fp32 adapter gradients)
    ai, di = o["acat_in"], o["dcat_in"]
    wgrads = [("wgrad_dB_g", 2, hg.contiguous(), di[:, :F], 1.0),  # dB_u: the same shape, a second launch
              ("wgrad_dA_d", 1, ai[:, :F], gd_NR, o["s_d"]),
              ("wgrad_dB_d", 1, ai[:, F:F + R], o["dy"], 1.0),
              ("wgrad_dA", 1, o["x_NI"], di[:, 2 * F:2 * F + 2 * R], o["s"])]
    for name, calls, x, dy, alpha in wgrads:
        if name not in which and "wgrad" not in which:
            continue
        Iw, Ow = x.shape[1], dy.shape[1]
        dw = torch.empty(E, Iw, Ow, device=x.device, dtype=torch.float32)
        cur = wgrad_launch(Iw, Ow)
        wide_i = Iw >= Ow  # the block that varies: the wider side's; the rank side keeps wgrad_launch's
        var = []
        for W, BK, nw, ns in pick(WGRAD, "wgrad"):
            v = dict(cur, BK=BK, num_warps=nw, num_stages=ns)
            v["BI" if wide_i else "BO"] = W
            var.append(v)
        out.append(Pass(
            name, L * calls, rows * (Iw + Ow) * dt_size + E * Iw * Ow * 4,
            lambda t, x=x, dy=dy, dw=dw, alpha=alpha: grouped_wgrad(x, dy, offs, None, alpha=alpha, out_EIO=dw,
                                                                    launch=t),
            cur, var, {"dW": dw}, [dw], _lean_fmt(("BI", "BO", "BK", "num_warps", "num_stages")),
            triton_grouped_mm._grouped_wgrad_kernel))
    return out


def compare(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[bool, str]:
    """(every element of every output within tolerance, a note: per output its largest |diff| / tolerance and,
    where any, how many elements are out of it). NaN (an element a launch never wrote) is out of tolerance."""
    ok, notes = True, []
    for k, w in want.items():
        a, b = got[k].float(), w.float()
        tol = ATOL_FRAC * b.abs().max().clamp(min=1e-30) + RTOL * b.abs()
        r = (a - b).abs() / tol
        bad = int((~(r <= 1)).sum()) if r.numel() else 0
        worst = float(r.nan_to_num(nan=float("inf")).max()) if r.numel() else 0.0
        ok &= bad == 0
        notes.append(f"{k} {worst:.2f}" + (f" ({bad} bad)" if bad else ""))
    return ok, " ".join(notes)


def _compiled(kernel) -> dict:
    """The compiled variants of a JIT kernel by cache key (empty under the interpreter or where this Triton keeps
    them elsewhere): read before and after a variant's first call to find the one it compiled."""
    try:
        return dict(kernel.device_caches[torch.cuda.current_device()][0])
    except Exception:  # noqa: BLE001 (a diagnostic column: never fatal)
        return {}


def _resources(k) -> str:
    """'registers / spilled bytes / shared KB' of a compiled kernel (CompiledKernel after its first launch)."""
    try:
        return f"{k.n_regs}/{k.n_spills}/{k.metadata.shared // 1024}"
    except AttributeError:
        return "-"


def run_pass(p: Pass, dry: bool, deadline: float = float("inf")) -> tuple[list[dict], bool]:
    """Check and time the wrapper's default launch (the reference of the checks: rows[0]), then every variant of
    p. Returns (rows, all variants within tolerance)."""
    rows, ok_all, want = [], True, None
    default = "interpreter default" if dry else f"default ({p.fmt(p.current)})"
    for i, t in enumerate([None] + p.variants):
        name = default if t is None else p.fmt(t)
        if i and time.time() > deadline:
            rows.append(dict(launch=t, name=name, skipped="time limit"))
            continue
        for f in p.fill:  # an element the launch does not write stays NaN and fails the check
            f.fill_(float("nan"))
        before = _compiled(p.kernel) if p.kernel is not None and not dry else {}
        try:
            p.call(t)
        except Exception as e:  # noqa: BLE001 (an out-of-resources launch: reported, not fatal)
            if t is None:
                raise
            rows.append(dict(launch=t, name=name, failed=f"{type(e).__name__}: {str(e)[:120]}"))
            continue
        if t is None:
            want = {k: v.clone() for k, v in p.outputs.items()}
            ok, check = True, "reference"
        else:
            ok, check = compare(p.outputs, want)
            if i == 1 and not dry and not all(torch.equal(p.outputs[k], w) for k, w in want.items()):
                ok, check = False, f"{check}; not the default's bits"  # on the GPU the default is this launch
            ok_all &= ok
        row = dict(launch=t or p.current, name=name, ok=ok, check=check)
        if not dry:
            new_k = [k for key, k in _compiled(p.kernel).items() if key not in before] if p.kernel is not None else []
            # the explicit current launch compiles nothing new: the default's kernel
            row["res"] = _resources(new_k[0]) if len(new_k) == 1 else (rows[0].get("res", "-") if i == 1 else "-")
            row["us"] = triton.testing.do_bench(lambda t=t: p.call(t), warmup=10, rep=50, return_mode="median") * 1e3
        rows.append(row)
    return rows, ok_all


def report(p: Pass, rows: list[dict], dry: bool) -> dict:
    print(f"\n== {p.name}  (minimal traffic {_fmt_bytes(p.min_bytes)}, {p.per_step} launches a step; current "
          f"{p.fmt(p.current)})", flush=True)
    timed = [r for r in rows if "us" in r]
    # the current launch is timed twice (the default, then passed explicitly): its faster sample is the baseline, so
    # a gain smaller than the run-to-run noise is not claimed
    base = min(r["us"] for r in rows[:2] if "us" in r) if not dry else None
    if dry:
        for r in rows:
            print(f"  {r['name']:<32} {r.get('check') or r.get('failed') or r.get('skipped')}"
                  f"{'' if r.get('ok', True) else '  MISMATCH'}")
        return {}
    print(f"  {'launch':<32} {'us':>8} {'GB/s':>7} {'ratio':>6} {'reg/spill/KB':>13}  check (max |diff| / tol)")
    for r in sorted(timed, key=lambda r: r["us"]):
        cur = "  <- current" if r is rows[0] else ("  <- current, passed explicitly" if r is rows[1] else "")
        print(f"  {r['name']:<32} {r['us']:8.1f} {p.min_bytes / r['us'] / 1e3:7.0f} {r['us'] / base:6.3f} "
              f"{r.get('res', '-'):>13}  {r['check']}{'' if r['ok'] else '  MISMATCH'}{cur}")
    for r in rows:
        if "us" not in r:
            print(f"  {r['name']:<32} {r.get('failed') or r.get('skipped')}")
    best = min([r for r in timed if r["ok"]], key=lambda r: r["us"])
    if best is rows[1]:
        best = rows[0]
    save = (base - best["us"]) * p.per_step / 1e3 if best is not rows[0] else 0.0
    twice = " / ".join(f"{r['us']:.1f}" for r in rows[:2] if "us" in r)
    print(f"  best: {best['name']}  {best['us']:.1f} us vs {base:.1f} us ({best['us'] / base:.3f}x): "
          f"{save:.3f} ms a step over {p.per_step} launches (the current launch timed twice: {twice} us)")
    return dict(current=p.current, current_us=base, best=best["launch"], best_us=best["us"], per_step=p.per_step,
                min_bytes=p.min_bytes, step_saving_ms=save,
                rows=[{k: v for k, v in r.items()} for r in rows])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--T", type=int, default=8192, help="tokens a step (profile_step: seq 4096 x micro-batch 2)")
    p.add_argument("--R", type=int, default=16, help="LoRA rank of each expert projection (profile_step: 16)")
    p.add_argument("--passes", nargs="+", default=["gather_in", "swiglu_in", "swiglu_bwd", "wgrad"],
                   help="gather_in swiglu_in swiglu_bwd wgrad (all four) or wgrad_dB_g wgrad_dA_d wgrad_dB_d wgrad_dA")
    p.add_argument("--quick", action="store_true", help="the first few candidates of each pass")
    p.add_argument("--time-limit", type=float, default=170.0, help="start no new variant after this many seconds")
    p.add_argument("--out", help="write the results as JSON here")
    p.add_argument("--dry-run", action="store_true", help="CPU, TRITON_INTERPRET=1, tiny shape, fp32: checks only")
    a = p.parse_args()
    dev = "cpu" if a.dry_run else "cuda"
    if dev == "cuda" and not torch.cuda.is_available():
        sys.exit("no GPU: run with --dry-run")
    dt = torch.float32 if a.dry_run else torch.bfloat16  # the interpreter computes no bf16 dot correctly
    sh = _shapes(a)
    t0 = time.time()
    o = build(sh, dev, dt)
    ps = passes(sh, o, a.passes, a.quick)
    gpu = torch.cuda.get_device_name() if dev == "cuda" else "cpu (TRITON_INTERPRET=1)"
    print(f"{gpu}, triton {triton.__version__}, torch {torch.__version__}; T {sh['T']}, top-{sh['K']} of E {sh['E']} "
          f"(N {o['N']}, rows per expert {o['rows'] / sh['E']:.0f}), I {sh['I']}, F {sh['F']}, R {sh['R']}, "
          f"{sh['layers']} MoE layers; {sum(len(x.variants) for x in ps)} launches", flush=True)
    results, ok = {}, True
    for ps_i in ps:
        rows, good = run_pass(ps_i, a.dry_run, t0 + a.time_limit)
        ok &= good
        results[ps_i.name] = report(ps_i, rows, a.dry_run)
    if not a.dry_run:
        print("\nbest launch per pass (step saving = (current - best) x launches a step):")
        total = 0.0
        for name, r in results.items():
            total += r["step_saving_ms"]
            print(f"  {name:<12} {json.dumps(r['best'])}  {r['best_us']:.1f} us (current {r['current_us']:.1f}); "
                  f"{r['step_saving_ms']:.3f} ms a step")
        print(f"  total {total:.2f} ms a step (each pass alone, L2 flushed; the step's overlap not modelled)")
        # the row-tiled passes share a layer's tile map per BM (_cached_tile_map): a BM no other pass uses costs one
        # more map a layer
        bms = {k: sorted({r[k]["BM"] for r in results.values() if "BM" in r[k]}) for k in ("current", "best")}
        offs, N = o["offsets_E"], o["N"]
        map_us = {bm: triton.testing.do_bench(lambda bm=bm: triton_grouped_mm.tile_map(offs, N, bm),
                                              return_mode="median") * 1e3 for bm in set(bms["current"] + bms["best"])}
        print(f"  tile maps (one a layer per distinct BM): current BMs {bms['current']}, best BMs {bms['best']}; "
              + ", ".join(f"BM {bm}: {us:.1f} us" for bm, us in sorted(map_us.items())))
    print(f"\n{time.time() - t0:.0f} s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(dict(shape=sh, gpu=gpu, passes=results), f, indent=1, default=str)
    if not ok:
        sys.exit("MISMATCH: a launch's outputs differ from the current launch's (see the tables)")


if __name__ == "__main__":
    main()
