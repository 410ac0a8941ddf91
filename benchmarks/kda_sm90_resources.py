"""Compile the KDA Triton kernels for sm_90 without a GPU and print registers / spills per kernel.

Usage: python3 benchmarks/kda_sm90_resources.py [--diag dot|chunk|token] [--dtype bf16|fp32]
Uses the ptxas / cuobjdump that ship with Triton (triton/backends/nvidia/bin). Shapes: K=V=128 (H, HV are runtime arguments),
launch parameters from triton_kda.CONFIG. Imports nothing from moeadapt beyond moeadapt.ops.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from moeadapt.ops.kda import triton_bwd, triton_fwd, triton_kda  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_check import res_usage  # noqa: E402

GATE = [False]  # --gate: kernels with the fused gate (A_log, dt_bias)
STAGES = [3]  # set from triton_kda's launch config in main(); KDA_STAGES overrides


def compile_one(fn, types, consts, num_warps):
    sig = {n: types.get(n, "constexpr") for n in fn.arg_names}
    src = ASTSource(fn, sig, constexprs=consts)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": int(os.environ.get("KDA_STAGES", STAGES[0]))})
    return res_usage(k)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--diag", default=None)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--set", nargs="*", default=[], help="CONFIG overrides key=value (ints/floats parsed)")
    p.add_argument("--only", default=None, help="fwd, bwd or all (default: the intra kernels)")
    p.add_argument("--gate", action="store_true", help="compile the fused-gate (A_log, dt_bias) versions")
    a = p.parse_args()
    for kv in a.set:
        key, val = kv.split("=")
        try:
            val = int(val)
        except ValueError:
            try:
                val = float(val)
            except ValueError:
                pass
        triton_kda.CONFIG[key] = val
    if a.diag:
        triton_kda.CONFIG["diag"] = a.diag
    dt = a.dtype
    c = triton_kda._cfg(128, 128, torch.bfloat16 if dt == "bf16" else torch.float32, 16)
    c["h_BV"] = 32 if c["h_BV"] == "auto" else c["h_BV"]
    K = V = 128
    in_k = c["diag"] != "token"
    STAGES[0] = c["stages"]
    GATE[0] = a.gate
    P = lambda *names, t: {n: t for n in names}  # noqa: E731
    f32, i32 = "*fp32", "*i32"
    fwd_types = {**P("q", "k", "v", "beta", "w", "u", "kd", "qg", t=f"*{dt}"), **P("g", "Aqk", "Ti", "gl", "A_log",
                 "dt_bias", t=f32), **P("cu", "cidx", t=i32), "dmax": "fp32", "H": "i32", "HV": "i32"}
    fwd_c = dict(K=K, V=V, BT=64, BC=16, BK=c["intra_BK"], BV=c["BV"], PREC=c["PREC"], DPREC=c["DPREC"],
                 DIAG_IN_KERNEL=in_k, USE_GATE=GATE[0], FUSE_WU=c["fuse_wu"])
    if a.only != "bwd":
        print("_fwd_intra", compile_one(triton_fwd._fwd_intra, fwd_types, fwd_c, c["intra_warps"]))
        fb_c = {n: fwd_c[n] for n in ("K", "BT", "BC", "BK", "USE_GATE")}
        print("_fwd_diag_chunk", compile_one(triton_fwd._fwd_diag_chunk, fwd_types, fb_c, c["intra_warps"]))
        if not c["fuse_wu"]:
            wu_c = {n: fwd_c[n] for n in ("K", "V", "BT", "PREC", "USE_GATE")}
            wu_c.update(BK=c["wu_BK"], BV=c["wu_BV"])
            print("_fwd_wu", compile_one(triton_fwd._fwd_wu, fwd_types, wu_c, c["wu_warps"]))
    bwd_types = {**P("q", "k", "beta", t=f"*{dt}"), **P("g", "dAqk", "dAkk", "dq", "dk", "dg", "db", "A_log", "dt_bias",
                 "dA", t=f32), **P("cu", "cidx", t=i32), "T_total": "i32", "dmax": "fp32", "H": "i32", "HV": "i32"}
    bwd_c = dict(K=K, BT=64, BC=16, BK=c["local_BK2"], PREC=c["PREC"], DPREC=c["DPREC"],
                 DIAG_IN_KERNEL=in_k, USE_GATE=GATE[0])
    if a.only != "fwd":
        print("_bwd_intra", compile_one(triton_bwd._bwd_intra, bwd_types, bwd_c, c["intra2_warps"]))
        fb_c = {n: bwd_c[n] for n in ("K", "BT", "BC", "BK", "USE_GATE")}
        print("_bwd_diag_chunk", compile_one(triton_bwd._bwd_diag_chunk, bwd_types, fb_c, c["intra2_warps"]))

    if a.only == "all":  # the state / output / WY kernels too
        lo = {"q", "k", "v", "beta", "w", "u", "kd", "qg", "h", "vn", "dh", "dRu", "do", "o"}
        scal = {"scale": "fp32", "T_total": "i32", "dmax": "fp32", "H": "i32", "HV": "i32"}
        com = dict(K=K, V=V, KH=c["KH"], BT=64, PREC=c["PREC"])
        jobs = [
            (triton_fwd._fwd_h, dict(BV=c["h_BV"], HAS_H0=True, STORE_HT=True), c["h_warps"]),
            (triton_fwd._fwd_o, dict(BV=c["o_BV"]), c["o_warps"]),
            (triton_bwd._bwd_dh, dict(BV=c["h_BV"], HAS_DHT=True, STORE_DH0=True, KH=c["KHB"]), c["dh_warps"]),
            (triton_bwd._bwd_dv, dict(BV=c["dv_BV"]), c["dv_warps"]),
            (triton_bwd._bwd_wy, dict(BK=c["local_BK"], BV=c["local_BV"], USE_GATE=GATE[0]), c["local_warps"]),
        ]
        for fn, extra, nw in jobs:
            cons = {n: v for n, v in {**com, **extra}.items() if n in fn.arg_names}
            types = {n: scal.get(n, f"*{dt}" if n in lo else ("*i32" if n in ("cu", "cidx", "coff") else "*fp32"))
                     for n in fn.arg_names if n not in cons}
            print(fn.__name__, compile_one(fn, types, cons, nw))


if __name__ == "__main__":
    main()
