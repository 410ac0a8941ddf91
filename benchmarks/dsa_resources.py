"""Compile the DSA attention kernels for sm_90 on any machine (no GPU needed) and print
each configuration's registers, spill stack and shared memory, as ptxas/cuobjdump report them.

    TRITON_INTERPRET=0 PYTHONPATH=. python benchmarks/dsa_resources.py [name ...]   (gluon_fwd, gluon_bwd_p1 too)

Shapes of issue #4 (bf16, D = 576 = 512 + 64, DV = 512, v = kv[..., :512], topk = 2048);
integer arguments get Triton's divisible-by-16 specialisation as they do at T = 32768.
Uses Triton's compiler directly (ASTSource / GPUTarget), so the numbers are those of the
Triton installed here, not necessarily of the GPU machine's. Shared memory above 232448 B
(227 KiB) cannot launch on an H100/H200; STACK > 0 means spills to local memory.
"""

from __future__ import annotations

import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from moeadapt.ops.dsa import triton_sparse_attn as tsa  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from sm90_check import res_usage  # noqa: E402

BF = "*bf16"
MLA = dict(D1=512, D2=64, BLOCK_DV=512, V_FROM_K=True, IEEE=False, I64=False)
WALK = dict(SKIP=True, REVERSE=True, TOPK_P2=2048)
KERNELS = {
    "fwd": (tsa._sfa_fwd_kernel, dict(Q=BF, K=BF, V=BF, IDX="*i32", O=BF, LSE="*fp32")),
    "bwd": (tsa._sfa_bwd_kernel, dict(Q=BF, K=BF, V=BF, IDX="*i32", O=BF, DO=BF, LSE="*fp32", DQ=BF,
                                      DK="*fp32", DV_="*fp32")),
    "pds": (tsa._sfa_bwd_pds_kernel, dict(Q=BF, K=BF, V=BF, IDX="*i32", O=BF, DO=BF, LSE="*fp32", P_=BF, DS_=BF)),
    "apply": (tsa._sfa_bwd_from_pds_kernel, dict(Q=BF, K=BF, IDX="*i32", DO=BF, P_=BF, DS_=BF, DQ=BF,
                                                 DK="*fp32", DV_="*fp32")),
}
NO_DIV = ("NHB", "NC", "ROW0", "NROWS")  # runtime ints that are not multiples of 16 (or not specialised)
CONFIGS = {  # name -> (kernel, constexprs + num_warps / num_stages)
    "fwd_old": ("fwd", dict(MLA, BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=2)),
    "fwd_skip_rev": ("fwd", dict(MLA, **WALK, BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=2)),
    "fwd_dense": ("fwd", dict(MLA, **WALK, DENSE=True, BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=2)),  # default
    "bwd_old_fused": ("bwd", dict(MLA, BLOCK_H=64, BLOCK_K=16, num_warps=8, num_stages=2, DKV_T=True,
                                  DO_DQ=True, DO_DKV=True, STORE_ONLY=False)),
    "bwd_split_dq": ("bwd", dict(MLA, **WALK, BLOCK_H=64, BLOCK_K=32, num_warps=8, num_stages=2, DKV_T=True,
                                 DO_DQ=True, DO_DKV=False, STORE_ONLY=False)),
    "bwd_split_dkv": ("bwd", dict(MLA, **WALK, IDX_AHEAD=True, BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=1,
                                  DKV_T=True, DO_DQ=False, DO_DKV=True, STORE_ONLY=False)),
    "pds_w4": ("pds", dict(MLA, **WALK, IDX_AHEAD=False, BLOCK_H=64, BLOCK_K=32, num_warps=4, num_stages=2)),
    "pds_w8": ("pds", dict(MLA, **WALK, IDX_AHEAD=False, BLOCK_H=64, BLOCK_K=32, num_warps=8, num_stages=2)),
    "pds_k16": ("pds", dict(MLA, **WALK, IDX_AHEAD=False, BLOCK_H=64, BLOCK_K=16, num_warps=4, num_stages=4)),
    "apply_h128": ("apply", dict(V_FROM_K=True, IEEE=False, I64=False, **WALK, IDX_AHEAD=False, BLOCK_C=128,
                                 BLOCK_H=128, BLOCK_K=64, num_warps=8, num_stages=3)),
    "pds_w4_ahead": ("pds", dict(MLA, **WALK, IDX_AHEAD=True, BLOCK_H=64, BLOCK_K=32, num_warps=4, num_stages=2)),
    "apply_h128_ahead": ("apply", dict(V_FROM_K=True, IEEE=False, I64=False, **WALK, IDX_AHEAD=True, BLOCK_C=128,
                                       BLOCK_H=128, BLOCK_K=64, num_warps=8, num_stages=3)),
    "apply_h128_w4": ("apply", dict(V_FROM_K=True, IEEE=False, I64=False, **WALK, IDX_AHEAD=False, BLOCK_C=128,
                                    BLOCK_H=128, BLOCK_K=64, num_warps=4, num_stages=3)),  # default since session 6
    "apply_h64_c64_w4": ("apply", dict(V_FROM_K=True, IEEE=False, I64=False, **WALK, IDX_AHEAD=False, BLOCK_C=64,
                                       BLOCK_H=64, BLOCK_K=64, num_warps=4, num_stages=3)),  # default at HQ = 64
    "apply_h64": ("apply", dict(V_FROM_K=True, IEEE=False, I64=False, **WALK, IDX_AHEAD=False, BLOCK_C=128,
                                BLOCK_H=64, BLOCK_K=64, num_warps=8, num_stages=3)),
}


def resources(kernel: str, opts: dict) -> str:
    fn, ptrs = KERNELS[kernel]
    opts = dict(opts)
    nw, ns = opts.pop("num_warps"), opts.pop("num_stages")
    const = dict(opts)
    for n, p in zip(fn.arg_names, fn.params):
        if p.is_constexpr and n not in const:
            const[n] = p.default
    sig = {n: "constexpr" if n in const else ptrs.get(n, "fp32" if n in ("qk_scale", "scale") else "i32")
           for n in fn.arg_names}
    attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in fn.arg_names
             if (n in ptrs or sig[n] == "i32") and n not in NO_DIV}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in const.items()},
                    attrs=attrs)
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": nw, "num_stages": ns})
    return res_usage(k)


GLUON = ("gluon_fwd", "gluon_bwd_p1")  # the warp-specialised kernels of gluon_sparse_attn.py (4 warps + 2 workers)


def gluon_resources(name: str) -> str:
    from moeadapt.ops.dsa import gluon_sparse_attn as gws

    return res_usage(gws.compile_sm90(name.removeprefix("gluon_")))


def main():
    names = sys.argv[1:] or list(CONFIGS) + list(GLUON)
    print(f"triton {triton.__version__}, target sm_90")
    for n in names:
        try:
            if n in GLUON:  # REG is the launch bound (384 threads); setmaxnreg gives the consumers 232
                print(f"{n:20s} {gluon_resources(n)}", flush=True)
                continue
            kernel, opts = CONFIGS[n]
            print(f"{n:20s} {resources(kernel, opts)}", flush=True)
        except Exception as e:  # noqa: BLE001  (report and go on)
            print(f"{n:20s} failed: {type(e).__name__}: {str(e)[:200]}", flush=True)


if __name__ == "__main__":
    main()
