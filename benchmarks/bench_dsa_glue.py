"""Benchmark the DSA layer's elementwise glue (models/dsa_attn.py: mha_inputs, gate_heads, rope_first) at the `small`
preset's shapes, four ways: eager torch ops, torch.compile with dynamic shapes (GLUE_IMPL = "compile": what the model
runs), torch.compile with static shapes, and the Triton ops of ops/dsa/triton_glue.py (GLUE_IMPL = "triton").

Usage (GPU): python3 benchmarks/bench_dsa_glue.py [--quick] [--H 16 32 64] [--B 2] [--T 4096] [--no-graph] [--sweep]
             [--out R.json]

Pieces, bf16 (B, T, H from the options; nope 128, rope 64, value 128, kv latent 512, indexer 16 heads x 128):
  mha_inputs        q [B, T, H, 192], kvb [B, T, H, 256], k_pe a [B, T, 64] slice of the kv projection [B, T, 576]
  gate_heads        o [B, T, H, 128] as FlexAttention returns it (its output follows q_full's [B, T, H, D] layout,
                    so o is contiguous), gate logits [B, T, H]
  gate_heads o^T    o a transposed view of a contiguous [B, H, T, 128] (not with --quick)
  rope_first q_idx  [B, T, 16, 128], RoPE on the first 64 channels
  rope_first k_idx  [B, T, 128] (not with --quick)
cos / sin fp32 [T, 32]. Passes: "fwd" (the forward with gradients enabled, as in training) and "fwd+bwd" (the forward
and torch.autograd.grad of every bf16 input for fixed random cotangents).
Timing: each variant captured CALLS times in one CUDA graph (the training step runs as a CUDA graph: no host time),
the median of REPS replays per call; --no-graph: triton.testing.do_bench (median; host time shows where it exceeds
the GPU's). GB/s: the fewest bytes the pass must move (each input read once, each output written once, cos / sin
included) over the time. err: max |x - x64| / max |x64| over the outputs and gradients, against the torch function
run in float64 on the same inputs, computed before any timing; above TOL (a bf16 rounding or two is ~4e-3) the row is
flagged MISMATCH and the run exits 1. The check is each variant's first call (the compiled ones compile there, the
Triton kernels JIT), so the timed calls reuse what it built.
--sweep: the Triton ops again at other launches (SWEEP_ROWS, SWEEP_GATE; a winner becomes the constant beside the
kernels). --dry-run: CPU under TRITON_INTERPRET=1 at tiny shapes, eager and Triton only, checks only (a check of
this script itself).
Expect: eager far behind (many kernels), compile dynamic ~0.3-1.5 TB/s (the profile's numbers), the Triton ops near
the copy bandwidth (~2.5-3 TB/s on an H100) where they are memory bound as intended.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import types
from collections.abc import Callable
from dataclasses import dataclass, field

if "--dry-run" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"

import torch
import triton

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moeadapt.io import atomic_write_text  # noqa: E402
from moeadapt.models.common import rope_cos_sin  # noqa: E402
from moeadapt.models.dsa_attn import gate_heads, mha_inputs, rope_first  # noqa: E402
from moeadapt.ops.dsa import triton_glue as tg  # noqa: E402

NOPE, ROPE, VD, KVL, HI, DI = 128, 64, 128, 512, 16, 128
# a variant further than this from the float64 reference is flagged (bf16: one or two roundings, ~4e-3 of the largest
# value; under the interpreter of --dry-run the kernels' casts to bf16 truncate, which doubles theirs)
TOL = 1.5e-2
CALLS, REPS = 10, 5
# --sweep: the Triton ops' launch constants (ops/dsa/triton_glue.py) timed besides the defaults: (ROWS, NUM_WARPS)
# of the mha_inputs / rope_first kernels, (GATE_BLOCK_T, GATE_NUM_WARPS) of the gate kernels
SWEEP_ROWS = ((16, 4), (32, 4), (64, 4), (32, 8), (64, 8), (128, 8))
SWEEP_GATE = ((16, 4), (32, 4), (64, 4), (64, 8), (128, 8))


@dataclass
class Piece:
    name: str
    ref: Callable  # the torch function (models/dsa_attn.py)
    op: Callable  # its Triton op (same arguments)
    leaves: list  # bf16 inputs that get gradients
    others: tuple  # the other arguments
    bytes: dict = field(default_factory=dict)  # pass -> the fewest bytes it moves


def _nbytes(*ts) -> int:
    """Bytes of the tensors' elements (a strided view counts its own elements only)."""
    return sum(t.numel() * t.element_size() for t in ts)


def _pieces(B: int, T: int, H: int, dev: str, quick: bool) -> list[Piece]:
    g = torch.Generator(device="cpu").manual_seed(B * 1_000_003 + T * 31 + H)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dev, torch.bfloat16)

    cos, sin = (t.to(dev) for t in rope_cos_sin(torch.arange(T), ROPE, 10000.0))
    tables = _nbytes(cos, sin)
    q, kvb, k_pe = rnd(B, T, H, NOPE + ROPE), rnd(B, T, H, NOPE + VD), rnd(B, T, KVL + ROPE)[..., KVL:]
    out_mha = 2 * _nbytes(q) + _nbytes(kvb[..., NOPE:])  # q_full, k_full, v
    mha = Piece("mha_inputs", mha_inputs, tg.mha_inputs_triton, [q, kvb, k_pe], (cos, sin, NOPE, True))
    mha.bytes["fwd"] = _nbytes(q, kvb, k_pe) + tables + out_mha
    mha.bytes["bwd"] = out_mha + tables + _nbytes(q, kvb, k_pe)  # read the outputs' gradients, write the inputs'
    out = [mha]
    o_layouts = [("gate_heads", rnd(B, T, H, VD))]
    if not quick:
        o_layouts.append(("gate_heads o^T", rnd(B, H, T, VD).transpose(1, 2)))
    for name, o in o_layouts:
        gl = rnd(B, T, H)
        p = Piece(name, gate_heads, tg.gate_heads_triton, [o, gl], ())
        p.bytes["fwd"] = 2 * _nbytes(o) + _nbytes(gl)
        p.bytes["bwd"] = 3 * _nbytes(o) + 2 * _nbytes(gl)  # read dy, o, gl; write d_o, d_gl
        out.append(p)
    xs = [("rope_first q_idx", rnd(B, T, HI, DI))]
    if not quick:
        xs.append(("rope_first k_idx", rnd(B, T, DI)))
    for name, x in xs:
        p = Piece(name, rope_first, tg.rope_first_triton, [x], (cos, sin, ROPE))
        p.bytes["fwd"] = p.bytes["bwd"] = 2 * _nbytes(x) + tables
        out.append(p)
    for p in out:
        p.leaves = [t.detach().requires_grad_() for t in p.leaves]
        p.bytes["fwd+bwd"] = p.bytes["fwd"] + p.bytes.pop("bwd")
    return out


def _fresh(fn: Callable) -> Callable:
    """A copy of fn with its own code object: Dynamo keeps its compiled graphs on the code object, so each
    torch.compile variant of a copy compiles and caches apart from the others (and from the model's)."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _variants(p: Piece, compile_: bool) -> list[tuple[str, Callable]]:
    out = [("eager", p.ref)]
    if compile_:
        out += [("compile dynamic", torch.compile(_fresh(p.ref), dynamic=True)),
                ("compile static", torch.compile(_fresh(p.ref), dynamic=False))]
    return out + [("triton", p.op)]


def _as_tuple(y) -> tuple:
    return y if isinstance(y, tuple) else (y,)


def _cotangents(p: Piece) -> list[torch.Tensor]:
    """Fixed random bf16 cotangents of the piece's outputs (shapes from one eager forward)."""
    g = torch.Generator(device="cpu").manual_seed(7)
    with torch.no_grad():
        outs = _as_tuple(p.ref(*p.leaves, *p.others))
    return [torch.randn(o.shape, generator=g).to(o.device, o.dtype) for o in outs]


def _calls(fn: Callable, p: Piece, dys: list[torch.Tensor]) -> dict[str, Callable]:
    def fwd():
        return fn(*p.leaves, *p.others)

    def fwd_bwd():
        return torch.autograd.grad(_as_tuple(fwd()), p.leaves, dys)

    return {"fwd": fwd, "fwd+bwd": fwd_bwd}


def _check(fn: Callable, p: Piece, dys, want) -> float:
    """max |x - x64| / max |x64| over fn's outputs and the leaves' gradients (want: the float64 ones)."""
    outs = _as_tuple(fn(*p.leaves, *p.others))
    got = list(outs) + list(torch.autograd.grad(outs, p.leaves, dys))
    err = 0.0
    for a, b in zip(got, want):
        assert a.shape == b.shape, (p.name, a.shape, b.shape)
        err = max(err, float((a.detach().double() - b).abs().max() / b.abs().max().clamp(min=1e-30)))
    return err


def _want(p: Piece, dys) -> list[torch.Tensor]:
    leaves = [t.detach().double().requires_grad_() for t in p.leaves]
    others = [t.double() if isinstance(t, torch.Tensor) else t for t in p.others]
    outs = _as_tuple(p.ref(*leaves, *others))
    return [t.detach() for t in outs] + list(torch.autograd.grad(outs, leaves, [d.double() for d in dys]))


def _time_graph(fn: Callable) -> float:
    """ms per call: fn captured CALLS times in one CUDA graph (after two warm-up calls on the capture stream),
    the median of REPS replays."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    times = []
    for _ in range(REPS):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / CALLS)
    del graph
    return sorted(times)[len(times) // 2]


def _time(fn: Callable, graph: bool) -> tuple[float, str]:
    """(ms per call, how it was timed)."""
    if graph:
        try:
            return _time_graph(fn), "graph"
        except Exception as e:  # a variant that cannot be captured is timed eagerly, and says so
            print(f"    (CUDA graph capture failed: {type(e).__name__}: {str(e)[:120]}; timed with do_bench)")
            torch.cuda.synchronize()
    return triton.testing.do_bench(fn, warmup=10, rep=40, return_mode="median"), "do_bench"


def run_piece(p: Piece, H: int, dev: str, graph: bool) -> list[dict]:
    dys = _cotangents(p)
    want = _want(p, dys)
    rows = []
    for vname, fn in _variants(p, compile_=dev == "cuda"):
        t0 = time.time()
        err = _check(fn, p, dys, want)  # also the first call: compiles, JITs
        row = {"piece": p.name, "H": H, "variant": vname, "err": err, "first_call_s": time.time() - t0}
        if dev == "cuda":
            for pname, call in _calls(fn, p, dys).items():
                ms, how = _time(call, graph)
                row[pname] = {"us": ms * 1e3, "gbs": p.bytes[pname] / ms / 1e6, "timing": how}
        rows.append(row)
    del want
    return rows


def sweep_piece(p: Piece, H: int, graph: bool) -> list[dict]:
    """The Triton op of p at each launch of SWEEP_ROWS / SWEEP_GATE (set on the module, restored after): checked,
    then timed."""
    names = ("GATE_BLOCK_T", "GATE_NUM_WARPS") if p.name.startswith("gate") else ("ROWS", "NUM_WARPS")
    launches = SWEEP_GATE if p.name.startswith("gate") else SWEEP_ROWS
    saved = tuple(getattr(tg, n) for n in names)
    dys = _cotangents(p)
    want = _want(p, dys)
    rows = []
    try:
        for launch in launches:
            for n, v in zip(names, launch):
                setattr(tg, n, v)
            row = {"piece": p.name, "H": H, "variant": f"triton {launch[0]}/{launch[1]}w",
                   "err": _check(p.op, p, dys, want)}
            for pname, call in _calls(p.op, p, dys).items():
                ms, how = _time(call, graph)
                row[pname] = {"us": ms * 1e3, "gbs": p.bytes[pname] / ms / 1e6, "timing": how}
            rows.append(row)
    finally:
        for n, v in zip(names, saved):
            setattr(tg, n, v)
    return rows


def _print(rows: list[dict]) -> None:
    base = {(r["piece"], r["H"]): r for r in rows if r["variant"] == "compile dynamic"}
    print(f"{'piece':<17} {'H':>3} {'variant':<16} {'fwd us':>8} {'GB/s':>6} {'x dyn':>6} {'f+b us':>8} {'GB/s':>6} "
          f"{'x dyn':>6} {'max err':>8}")
    last = None
    for r in rows:
        if last is not None and (r["piece"], r["H"]) != last:
            print()
        last = (r["piece"], r["H"])
        cells = []
        for pname in ("fwd", "fwd+bwd"):
            v = r.get(pname)
            if v is None:
                cells.append(f"{'-':>8} {'-':>6} {'-':>6}")
                continue
            b = base.get(last, {}).get(pname)
            ratio = f"{b['us'] / v['us']:6.2f}" if b else f"{'-':>6}"
            cells.append(f"{v['us']:8.1f} {v['gbs']:6.0f} {ratio}")
        flag = "  MISMATCH" if r["err"] > TOL else ""
        print(f"{r['piece']:<17} {r['H']:>3} {r['variant']:<16} {cells[0]} {cells[1]} {r['err']:8.1e}{flag}",
              flush=True)
    print("x dyn: the compile-dynamic variant's time over this one's (> 1: faster than what the model runs now)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--B", type=int, default=2)
    p.add_argument("--T", type=int, default=4096)
    p.add_argument("--H", type=int, nargs="*", default=[16], help="attention head counts (the small preset: 16)")
    p.add_argument("--quick", action="store_true", help="the model's layouts only (no o^T, no k_idx)")
    p.add_argument("--no-graph", action="store_true", help="time with triton.testing.do_bench, not a CUDA graph")
    p.add_argument("--sweep", action="store_true", help="also time the Triton ops at the launches of SWEEP_*")
    p.add_argument("--out", default=None, help="write the rows as JSON here")
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    t_start = time.time()
    dev = "cpu" if args.dry_run or not torch.cuda.is_available() else "cuda"
    B, T, Hs = (1, 9, [3]) if args.dry_run else (args.B, args.T, args.H)
    if dev == "cuda":
        print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}; B {B}, T {T}, "
              f"{'CUDA graph' if not args.no_graph else 'do_bench'} timing")
    rows = []
    for H in Hs:
        for piece in _pieces(B, T, H, dev, args.quick):
            rows += run_piece(piece, H, dev, graph=not args.no_graph)
            if args.sweep and dev == "cuda":
                rows += sweep_piece(piece, H, graph=not args.no_graph)
            del piece
    _print(rows)
    first = sum(r.get("first_call_s", 0.0) for r in rows)
    print(f"total {time.time() - t_start:.1f} s (first calls, compiles and JIT included: {first:.1f} s)")
    if args.out:
        atomic_write_text(args.out, json.dumps(rows, indent=1))
    if any(r["err"] > TOL for r in rows):
        sys.exit("a variant's values do not match the float64 reference (MISMATCH above)")


if __name__ == "__main__":
    main()
