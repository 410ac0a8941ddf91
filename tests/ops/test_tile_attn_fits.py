"""ops/dsa/triton_tile_attn.py's launches fit an sm_90 card's shared memory (227 KiB on the H100 and the H200).

Compiled ahead of time for sm_90 (Triton's own ptxas, no GPU needed), with the divisibility a real launch
specialises on (16-aligned pointers and strides): that is what decides how many buffers the software pipeliner
keeps, so an unspecialised compile under-counts. A launch that does not fit fails at its first call on the GPU
(triton.runtime.errors.OutOfResources), which is what this checks ahead of time.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

SM90_SHARED = 232448  # bytes a block may use on sm_90
FLOATS = {"qk_scale", "sm_scale"}
INDEX = {"NUM", "IDX", "FNUM", "FIDX"}
TENSORS = {"Q", "K", "V", "O", "DO", "DQ", "DK", "DV_"}  # in the inputs' dtype
LOOSE = {"NQB", "NKB"}  # block counts: no divisibility assumed


def _shared(kernel, constexprs: dict, dtype: str, warps: int, stages: int) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig, attrs = {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in constexprs:
            sig[name] = "constexpr"
            continue
        if name in FLOATS:
            sig[name] = "fp32"
            continue
        if name == "SEL":
            sig[name] = "*u8"
        elif name in INDEX:
            sig[name] = "*i32"
        elif name in ("LSE", "DELTA"):
            sig[name] = "*fp32"
        elif name in TENSORS:
            sig[name] = "*" + dtype
        else:
            sig[name] = "i32"
        if name not in LOOSE:
            attrs[(i,)] = [["tt.divisibility", 16]]
    src = ASTSource(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    out = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    return out.metadata.shared


def _cases(tta, launch: dict, ieee: bool):
    dims = dict(H=16, D=192, D1=128, D2=64, DV=128, LB=tta.LIST_BLOCK, FULL=True, IEEE=ieee)
    yield "fwd", tta._tile_attn_fwd, {**dims, "BN": launch["FWD_BN"]}, launch["FWD_WARPS"], launch["FWD_STAGES"]
    yield "dq", tta._tile_attn_dq, {**dims, "BN": launch["DQ_BN"]}, launch["DQ_WARPS"], launch["DQ_STAGES"]
    yield ("dkv", tta._tile_attn_dkv, {**dims, "BN": launch["DKV_BN"], "BM": launch["DKV_BM"]}, launch["DKV_WARPS"],
           launch["DKV_STAGES"])


TOO_BIG = {"DQ_BN": 128}  # dq on 128-key steps: 256 KiB (the check must be able to fail)


def _needs(dtype: str) -> dict:
    """Shared memory per kernel at the launch the wrapper takes for dtype ("too_big": bf16 with TOO_BIG over the
    default); run in a process of its own without TRITON_INTERPRET (under the interpreter the kernels are not
    compilable objects)."""
    from moeadapt.ops.dsa import triton_tile_attn as tta

    over = {"fp32": tta.FP32_LAUNCH, "too_big": TOO_BIG}.get(dtype, {})
    launch = {**tta.TILE_LAUNCH, **over}
    dtype = "bf16" if dtype == "too_big" else dtype
    return {name: _shared(kernel, consts, dtype, warps, stages)
            for name, kernel, consts, warps, stages in _cases(tta, launch, dtype == "fp32")}


def _run(dtype: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, __file__, dtype], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dtype", ["bf16", "fp32", "too_big"])
def test_tile_attention_launches_fit_sm90_shared_memory(dtype):
    """Each kernel at MLA's head dims (192 / 128, 16 heads) with the launch the wrapper takes for that dtype
    (TILE_LAUNCH; FP32_LAUNCH over it for fp32) needs at most SM90_SHARED bytes; TOO_BIG is seen to need more.
    The first launch, which failed on an H100 (dq's key blocks unrolled into sub-steps inside a 2-stage pipelined
    loop), needed 256 KiB."""
    pytest.importorskip("triton")
    needs = _run(dtype)
    if dtype == "too_big":
        assert needs["dq"] > SM90_SHARED, needs
        return
    for name, need in needs.items():
        assert 0 < need <= SM90_SHARED, f"{name}: {need} bytes of shared memory, over {SM90_SHARED}"


if __name__ == "__main__":
    print(json.dumps(_needs(sys.argv[1])))
