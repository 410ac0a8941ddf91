"""Compile every Triton kernel an op launches for sm_90 (H200) on a machine without a GPU, and report
shared memory, registers and spills per launch: catches `OutOfResources` before a GPU run is spent on it.

    python benchmarks/sm90_check.py kda --dtype float32 --D 128          # one KDA fwd+bwd
    python benchmarks/sm90_check.py pytest tests/ops/test_dsa.py -k sparse   # every launch of those tests

How: a child process runs the op once under the interpreter (CPU) and records each `kernel[grid](...)`
launch (module, kernel, argument dtypes, constexprs, num_warps/num_stages); this process (not interpreted,
so the kernels are real JITFunctions) compiles each distinct launch ahead of time with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))`. ptxas ships with triton. Like the JIT, an
integer argument divisible by 16 and a tensor whose address is 16-byte aligned compile with tt.divisibility = 16
(vector widths, and whether a loop's loads can be pipelined, depend on it), so the recorded shapes matter.
"""

from __future__ import annotations

import argparse
import json  # noqa: E402
import os
import subprocess  # noqa: E402
import sys
from pathlib import Path

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

_DT = {
    torch.float32: "fp32",
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
    torch.int8: "i8",
    torch.uint8: "u8",
    torch.bool: "i1",
    torch.float64: "fp64",
}
LAUNCHES: dict = {}


def _sig(names, params, args, kwargs):
    """(signature, constexprs, the names that the JIT would specialise as divisible by 16)."""
    bound = dict(zip(names, args))
    bound.update({k: v for k, v in kwargs.items() if k in names})
    sig, const, div16 = {}, {}, []
    for i, n in enumerate(names):
        v = bound.get(n)
        if params[i]:
            sig[n] = "constexpr"
            const[n] = v
        elif isinstance(v, torch.Tensor):
            sig[n] = "*" + _DT[v.dtype]
            if v.data_ptr() % 16 == 0:
                div16.append(n)
        elif isinstance(v, bool):
            sig[n] = "i1"
        elif isinstance(v, int):
            sig[n] = "i32" if -(2**31) <= v < 2**31 else "i64"
            if v % 16 == 0:
                div16.append(n)
        elif isinstance(v, float):
            sig[n] = "fp32"
        elif v is None:
            sig[n] = "constexpr"
            const[n] = None
        else:
            raise TypeError(f"{n}: {type(v)}")
    return sig, const, div16


class _Recorder:
    def __init__(self, module, name, interp):
        import inspect

        self.module, self.name, self.interp = module, name, interp
        ps = inspect.signature(interp.fn).parameters.values()
        self.names = [p.name for p in ps]
        self.params = ["constexpr" in str(p.annotation) for p in ps]

    def __call__(self, *args, **kwargs):  # a @triton.jit helper called from inside a kernel
        return self.interp(*args, **kwargs)

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            opts = {k: kwargs[k] for k in ("num_warps", "num_stages") if k in kwargs}
            sig, const, div16 = _sig(self.names, self.params, args, kwargs)
            rec = dict(module=self.module, name=self.name, sig=sig, const=const, opts=opts, div16=div16)
            LAUNCHES.setdefault(json.dumps(rec, sort_keys=True), rec)
            return self.interp[grid](*args, **{k: v for k, v in kwargs.items()})

        return launch


def record(module_names=None):
    """Wrap every interpreted kernel held by a module of moeadapt.ops (kernels imported across modules too)."""
    import importlib
    import pkgutil

    import moeadapt.ops as ops

    if module_names is None:
        module_names = [m.name for m in pkgutil.walk_packages(ops.__path__, "moeadapt.ops.")]
    for mname in module_names:
        mod = importlib.import_module(mname)
        for attr, obj in list(vars(mod).items()):
            if type(obj).__name__ == "InterpretedFunction":
                setattr(mod, attr, _Recorder(mname, attr, obj))


SMEM_LIMIT = 232448  # bytes of shared memory one block may use on sm_90 (227 KiB)


def res_usage(compiled) -> str:
    """Registers and spill stack per thread of a compiled kernel (cuobjdump, shipped with Triton), and its
    shared memory: 'REG:n STACK:n shared n B'. STACK > 0 means register spills to local memory."""
    import tempfile

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cubin")
        Path(path).write_bytes(compiled.asm["cubin"])
        out = subprocess.run([tool, "--dump-resource-usage", path], capture_output=True, text=True).stdout
    usage = " ".join(w for line in out.splitlines() if "REG:" in line for w in line.split()
                     if w.startswith(("REG:", "STACK:")))
    smem = compiled.metadata.shared
    return f"{usage} shared {smem} B{'  OVER 227 KB' if smem > SMEM_LIMIT else ''}"


def _pipelined(compiled) -> str:
    """'  async copies n' where the TTGIR has loads software-pipelined into shared memory (cp.async), else ''."""
    n = compiled.asm["ttgir"].count("async_copy_global_to_local")
    return f"  async copies {n}" if n else ""


def compile_all(recs, cap=90):
    import importlib

    target = GPUTarget("cuda", cap, 32)
    bad = 0
    for r in sorted(recs, key=lambda r: r["name"]):
        name, o = r["name"], r["opts"]
        jit = getattr(importlib.import_module(r["module"]), name)
        assert isinstance(jit, JITFunction), f"{name} is not a JITFunction (TRITON_INTERPRET set?)"
        const = {(jit.arg_names.index(k),): v for k, v in r["const"].items()}
        attrs = {(jit.arg_names.index(n),): [["tt.divisibility", 16]] for n in r.get("div16", [])}
        src = ASTSource(fn=jit, signature=r["sig"], constexprs=const, attrs=attrs)
        try:
            k = triton.compile(src, target=target, options=dict(o))
            print(f"{name:24s} {str(o):40s} {res_usage(k)}{_pipelined(k)}")
            bad += k.metadata.shared > SMEM_LIMIT
        except Exception as e:  # noqa: BLE001
            bad += 1
            print(f"{name:24s} {str(o):40s} FAILED {type(e).__name__}: {str(e)[:300]}")
    return bad


def run_kda(a):
    from moeadapt.ops.kda import chunk_kda

    record()
    dt = getattr(torch, a.dtype)
    torch.manual_seed(0)
    B, T, H, D = 1, a.T, a.H, a.D
    q = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1).to(dt).requires_grad_()
    k = torch.nn.functional.normalize(torch.randn(B, T, H, D), dim=-1).to(dt).requires_grad_()
    v = torch.randn(B, T, H, D).to(dt).requires_grad_()
    g = (-torch.rand(B, T, H, D)).requires_grad_()
    beta = torch.rand(B, T, H).to(dt).requires_grad_()
    h0 = torch.zeros(B, H, D, D).requires_grad_()
    o, ht = chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True, backend="triton")
    (o.float().sum() + ht.sum()).backward()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("op", choices=["kda", "pytest"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--T", type=int, default=128)
    p.add_argument("--H", type=int, default=2)
    p.add_argument("--D", type=int, default=128)
    a, rest = p.parse_known_args()
    a.pytest_args = rest  # op=pytest: everything else goes to pytest
    if rest and a.op != "pytest":
        p.error(f"unrecognised arguments: {rest}")
    if os.environ.get("_SM90_RECORD"):
        if a.op == "pytest":
            import pytest

            record()
            pytest.main(["-q", "-x", "-p", "no:cacheprovider", *a.pytest_args])
        else:
            run_kda(a)
        Path(os.environ["_SM90_RECORD"]).write_text(json.dumps(list(LAUNCHES.values())))
        return
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "launches.json"
        env = dict(os.environ, TRITON_INTERPRET="1", _SM90_RECORD=str(out))
        if "SM90_CHILD_PYTHONPATH" in os.environ:  # e.g. record under the venv's Triton, compile under the GPU's
            env["PYTHONPATH"] = os.environ["SM90_CHILD_PYTHONPATH"]
        subprocess.run([sys.executable, __file__, *sys.argv[1:]], env=env, check=True)
        recs = json.loads(out.read_text())
    bad = compile_all(recs)
    print(f"{len(recs)} launches, {bad} over the limit or failed")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
