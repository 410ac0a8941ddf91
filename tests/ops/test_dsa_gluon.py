"""The Gluon SFA kernels (forward, backward pass 1) on a machine without a GPU: they compile for sm_90 with the
installed Triton (the interpreter cannot run Gluon; values are checked by tests/gpu/test_dsa_gpu.py on the H200),
fit in an H200's shared memory, and the dispatch only picks them where they apply."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

gluon = pytest.importorskip("triton.experimental.gluon")
ROOT = Path(__file__).resolve().parents[2]


_COMPILE = r"""
import json
from moeadapt.ops.dsa import gluon_sparse_attn as gws
res = {}
for name in ("fwd", "bwd_p1"):
    k = gws.compile_sm90(name)
    ptx = k.asm["ptx"]
    res[name] = dict(shared=k.metadata.shared, wgmma=ptx.count("wgmma.mma_async"), setmaxnreg="setmaxnreg" in ptx,
                     cp_async_arrive="cp.async.mbarrier.arrive" in ptx)
print(json.dumps(res))
"""


def test_gluon_kernels_compile_for_sm90():
    # a child process: tests/conftest.py turns the interpreter on for this one, and Gluon does not run under it
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", _COMPILE], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for name, lo in (("fwd", 200_000), ("bwd_p1", 200_000)):  # Q (+ dO) and two K buffers; H100/H200 limit
        assert lo < r[name]["shared"] <= 232_448, (name, r[name])
        assert r[name]["setmaxnreg"] and r[name]["cp_async_arrive"], (name, r[name])
    assert r["fwd"]["wgmma"] >= 2 * (36 + 8)  # each consumer: S = Q K^T (36 k-steps of 16) and P V (2 x 4)
    assert r["bwd_p1"]["wgmma"] >= 2 * (36 + 32)  # each consumer: S = Q K^T and dP = dO V^T


def test_gluon_forward_dispatch_on_cpu():
    from moeadapt.ops.dsa import gluon_sparse_attn as gws
    from moeadapt.ops.dsa import triton_sparse_attn as tsa

    q = torch.zeros(1, 4, 64, 576, dtype=torch.bfloat16)
    kv = torch.zeros(1, 4, 1, 576, dtype=torch.bfloat16)
    idx = torch.zeros(1, 4, 8, dtype=torch.int32)
    assert not gws.supported(q, kv, kv[..., :512], idx)  # not CUDA
    assert tsa._gluon_module(q, kv, kv[..., :512], idx) is None
    assert tsa._gluon_module(q, kv, kv[..., :512], idx, gluon=False) is None
