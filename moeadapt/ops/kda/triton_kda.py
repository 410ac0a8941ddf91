"""Triton kernels for chunked KDA (forward and backward) behind the custom ops `moeadapt::chunk_kda_fwd` / `_bwd`.

Owns the kernels, `chunk_kda_triton` and the torch.library registration (register_fake, register_autograd), so
selective activation checkpointing keeps the forward's outputs and torch.compile traces one op each way; in plain
eager mode the same functions run as an autograd.Function without the op's dispatch (`chunk_kda_fwd_fast`,
ops/custom.py); imports only torch/triton, ops/custom.py, ops/host.py and triton_l2norm.py. The math is the
chunk form of `reference.py` (chunk BT=64, sub-chunks BC=16). Per chunk, with G the
in-chunk cumulative gate, gam = G at the chunk's last row, q unscaled:
  Akk_ij = beta_i sum_c k_ic k_jc e^(G_ic-G_jc) (j<i),  Aqk_ij = sum_c q_ic k_jc e^(G_ic-G_jc) (j<=i)
  Ti = (I + Akk)^-1,  w = Ti (beta k e^G),  u = Ti (beta v)
  d = u - w S,  o = scale (q e^G S + Aqk d),  S <- e^gam S + (k e^(gam-G))^T d
Off-diagonal BCxBC blocks split e^(G_i-G_j) at a reference row r between i and j (both factors
<= 1) and use tensor-core dots on the six 16x16 block pairs of a chunk (`_fwd_intra`, `_bwd_intra`; Ti by blockwise
substitution). The diagonal blocks are inside the same kernels, by tensor-core dots split at the sub-chunk's middle
row where the gate's decay across the sub-chunk is at most KDALaunch.diag_spread (each factor then within
e^(+-diag_spread/2)), elementwise where it is larger (H200, benchmarks/bench_kda.py: the backward kernel with the
token-parallel diagonal kernel it replaced was 2.44 vs 1.48 ms). `_fwd_intra` also takes the in-chunk gate cumsum
itself; in the backward `_bwd_wy` stores it (float32) for `_bwd_intra`.

Kernels (forward in triton_fwd.py, backward in triton_bwd.py): `_fwd_intra` (per chunk: Akk, Aqk, Ti),
`_fwd_wu` (per chunk and K- or V-block: w, u, k e^(gam-G), q e^G; a separate kernel so that `_fwd_intra`
compiles without register spills for sm_90), `_fwd_h` (per sequence and V-block: the state recurrence, storing the state entering
each chunk and d), `_fwd_o` (per chunk: output); `_bwd_dh` (reverse recurrence: dS per chunk and dd),
`_bwd_dv` (dv, dAqk, dAkk), `_bwd_wy` (state and WY terms of dq, dk, dg), `_bwd_intra` (intra-chunk pair
terms, dg = reverse cumsum). The gate (A_log, dt_bias) is fused wherever g is read. The forward keeps the
per-chunk states h and d for the backward (recomputing them was slower). Launch parameters: `KDALaunch`
(the defaults, LAUNCH, are the ones measured); `python benchmarks/sm90_check.py kda` compiles every launch
for sm_90 without a GPU and prints registers / spills.
Sequences are always handled in varlen form (dense batches become B sequences of T).
"""

import dataclasses
import functools
import json

import torch
import triton
from torch import Tensor

from ..custom import eager_or_op, impl_or_op
from ..host import host_tensor
from .triton_bwd import _bwd_dh, _bwd_dv, _bwd_intra, _bwd_wy
from .triton_fwd import _fwd_h, _fwd_intra, _fwd_o, _fwd_wu
from .triton_l2norm import l2norm_qk

BT = 64
BC = 16


@dataclasses.dataclass(frozen=True)
class KDALaunch:
    """Launch parameters of the KDA kernels (block sizes, warps, pipelining). Frozen: pass a changed copy
    (`dataclasses.replace(LAUNCH, ...)`) to chunk_kda(..., launch=) to try another one."""

    # the per-chunk intra kernels work on 16x16 blocks: few warps win. With the diagonal blocks inside _fwd_intra,
    # 1 warp (H200, bench_kda.py --launch, one run: fwd 5.49 vs 6.13 ms at 8,4096,32,128, 1.79 vs 1.95 at
    # 1,16384,16,128); the h / o / dh / dv / local / wu kernels at 4 warps instead of 8 (fwd+bwd 17.67 vs 18.66 ms
    # at 8,4096,32,128 with intra_warps 1, 5.09 vs 5.40 at 1,16384,16,128; each of them alone 1-2%)
    intra_BK: int = 16
    intra_warps: int = 1
    h_BV: int | str = "auto"  # V-block of the state recurrences ("auto": see _state_bv)
    h_warps: int = 4
    o_BV: int = 64
    o_warps: int = 4
    dh_warps: int = 4
    dv_warps: int = 4
    # _bwd_dv's V-block 32 (was 16) and _bwd_intra on 64-wide K-blocks with 4 warps (was 32 / 2; earlier, H200:
    # 32 / 2 beat 32 / 1, 16 / 2, 16 / 1) with _state_bv's rule: H100, bench_kda.py --launch, one run, fwd+bwd ms
    # against the former launch: 2.37 vs 2.57 at 2,4096,16,128 (the `small` step's layer), 5.09 vs 5.21 at
    # 1,16384,16,128, 17.62 vs 18.30 at 8,4096,32,128; with dv_BV 16 and the rest as now 2.37 / 5.17 / 17.73
    dv_BV: int = 32
    local_BK: int = 32
    local_BV: int = 64
    local_warps: int = 4
    local_BK2: int = 64
    intra2_warps: int = 4
    # the diagonal blocks of _fwd_intra / _bwd_intra take tensor-core dots where the gate's decay within the
    # sub-chunk is at most this (every channel of the K-block), elementwise otherwise (negative: always elementwise;
    # _bwd_intra 2.81 vs 1.57 ms)
    diag_spread: float = 64.0
    # tensor-core precision of the intra-chunk A / dA dots for bf16/fp16 inputs (fp32 inputs: ieee);
    # "tf32x3" is closer to fp32 but made _bwd_intra spill registers in an sm_90 compile (Triton 3.9)
    dot_prec: str = "tf32"
    # _fwd_h / _bwd_dh keep K=128 as two 64-row blocks (sm_90 compile, Triton 3.9: _fwd_h with 8 warps then
    # has no spill; _bwd_dh spills more split than whole; at 4 warps _fwd_h whole and split timed within 0.2%)
    h_split: bool = True
    dh_split: bool = False
    stages: int = 3  # software-pipelining depth of every kernel (Triton's sm_90 default is 3)
    fp32_stages: int = 1  # float32 tiles pipelined 3 deep overflow sm_90 shared memory at K = V = 128
    wu_warps: int = 4
    wu_BK: int = 64
    wu_BV: int = 64

    def __post_init__(self):
        # the canonical string the custom ops take (their arguments are tensors, scalars and strings); not a field
        object.__setattr__(self, "key", json.dumps(dataclasses.asdict(self)))


LAUNCH = KDALaunch()


def _prep_varlen(B, T, cu_seqlens, device):
    """cu (int32 [N+1]), chunk index pairs (int32 [NC,2]: sequence, chunk), chunk offsets (int32 [N+1]). Host
    boundaries (models/documents.py keeps them there) cost no device sync; device ones cost one read."""
    if cu_seqlens is None:
        return _prep_dense(B, T, str(device))
    return _prep_bounds(tuple(cu_seqlens.tolist()), str(device))


def _prep_dense(B, T, device):  # cached by _prep_bounds
    return _prep_bounds(tuple(i * T for i in range(B + 1)), device)


@functools.lru_cache(maxsize=64)
def _prep_bounds(bounds: tuple, device: str):
    """The varlen index tensors of one set of boundaries, sent to the device without a sync; cached, so the
    layers of one forward (which share their documents) build them once."""
    lens = [bounds[i + 1] - bounds[i] for i in range(len(bounds) - 1)]
    nchunks = [-(-n // BT) for n in lens]
    pairs = [(i, j) for i, nc in enumerate(nchunks) for j in range(nc)]
    offs = [0]
    for nc in nchunks:
        offs.append(offs[-1] + nc)
    cu = host_tensor(list(bounds), device, torch.int32)
    cidx = host_tensor(pairs if pairs else [(0, 0)], device, torch.int32).reshape(-1, 2)
    coff = host_tensor(offs, device, torch.int32)
    return cu, cidx, coff, len(pairs)


def _check_head_dims(K, V) -> None:
    if K not in (16, 32, 64, 128) or V not in (16, 32, 64, 128):
        raise ValueError(f"backend='triton' supports head dims K, V in (16, 32, 64, 128), got K={K}, V={V}.")


@functools.lru_cache(maxsize=64)
def _cfg(K, V, dtype, HV, launch: str) -> dict:
    """The kernels' launch parameters for these head dims, dtype and KDALaunch key (cached: built once per
    combination, not per layer call; read-only)."""
    _check_head_dims(K, V)
    c = dataclasses.asdict(_launch_of(launch))
    for key in ("o_BV", "local_BV", "dv_BV", "wu_BV"):
        c[key] = min(c[key], V)
    for key in ("local_BK", "intra_BK", "wu_BK", "local_BK2"):
        c[key] = min(c[key], K)
    c["KH"] = K // 2 if c["h_split"] and K > 64 else K
    c["KHB"] = K // 2 if c["dh_split"] and K > 64 else K
    c["BV"] = c["local_BV"]
    c["PREC"] = "ieee" if dtype == torch.float32 else "tf32"
    c["DPREC"] = "ieee" if dtype == torch.float32 else c["dot_prec"]
    # float32 tiles pipelined 3 deep overflow sm_90 shared memory (_bwd_dh needs 278528 B > 232448 at K=V=128)
    c["stages"] = c["fp32_stages"] if dtype == torch.float32 else c["stages"]
    return c


@functools.lru_cache(maxsize=32)
def _launch_of(key: str) -> KDALaunch:
    """The KDALaunch a canonical string (KDALaunch.key) names; parsed once per distinct string."""
    return KDALaunch(**json.loads(key))


def _gate_params(A_log, dt_bias, beta, HV, K):
    """(USE_GATE, A_log in fp32, dt_bias flat in fp32); without the gate both are beta (an unread pointer)."""
    if A_log is None:
        return False, beta, beta
    b32 = dt_bias.float().reshape(-1).contiguous() if dt_bias is not None else torch.zeros(HV * K, device=beta.device)
    return True, A_log.float().contiguous(), b32


def _empty(like: torch.Tensor) -> torch.Tensor:
    """The stand-in for an absent tensor output (a custom op returns tensors): shape [0], float32."""
    return torch.empty(0, device=like.device, dtype=torch.float32)


def _chunk_kda_fwd_impl(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, scale: float, h0: Tensor | None,
    output_final_state: bool, cu_seqlens: Tensor | None, A_log: Tensor | None, dt_bias: Tensor | None, launch: str,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor,
           Tensor]:
    """Chunked KDA forward. q, k [B,T,H,K], v [B,T,HV,V], g [B,T,HV,K], beta [B,T,HV] (contiguous), h0 float32
    [N,HV,K,V] or None, cu_seqlens [N+1] or None, A_log [HV] / dt_bias (fused gate) or None, launch: a
    KDALaunch.key. Returns (o [B,T,HV,V], ht float32 [N,HV,K,V] (shape [0] unless output_final_state), then what
    chunk_kda_bwd reads: Aqk, Ti [B*T,HV,64] fp32, w, u, kd, qg [B*T,HV,K|V], gl fp32 [NC,HV,K], h [NC,HV,K,V],
    vn [B*T,HV,V], cu int32 [N+1], cidx int32 [max(NC,1),2], coff int32 [N+1]) with NC the number of 64-token
    chunks."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    dev = q.device
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    gate, A32, b32 = _gate_params(A_log, dt_bias, beta, HV, K)
    cu, cidx, coff, NC = _prep_varlen(B, T, cu_seqlens, dev)
    N = cu.numel() - 1
    cfg = _cfg(K, V, q.dtype, HV, launch)
    Tt = B * T
    Aqk = torch.empty(Tt, HV, BT, device=dev, dtype=torch.float32)
    Ti = torch.empty_like(Aqk)
    w, kd, qg = (torch.empty(Tt, HV, K, device=dev, dtype=q.dtype) for _ in range(3))
    u = torch.empty(Tt, HV, V, device=dev, dtype=q.dtype)
    gl = torch.empty(NC, HV, K, device=dev, dtype=torch.float32)
    _fwd_intra[(NC, HV)](
        q, k, g, beta, Aqk, Ti, cu, cidx, A32, b32,
        H=H, HV=HV, K=K, BT=BT, BC=BC, BK=cfg["intra_BK"], PREC=cfg["PREC"], DPREC=cfg["DPREC"], USE_GATE=gate,
        DIAG_SPREAD=cfg["diag_spread"], num_stages=cfg["stages"], num_warps=cfg["intra_warps"],
    )
    _fwd_wu[(NC, HV, K // cfg["wu_BK"] + triton.cdiv(V, cfg["wu_BV"]))](
        g, q, k, v, beta, Ti, w, u, kd, qg, gl, cu, cidx, A32, b32,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=cfg["wu_BK"], BV=cfg["wu_BV"], PREC=cfg["PREC"], USE_GATE=gate,
        num_stages=cfg["stages"], num_warps=cfg["wu_warps"],
    )
    h, vn, ht = _run_fwd_h(kd, w, u, gl, h0, cu, coff, NC, N, HV, K, V, cfg, output_final_state)
    o = torch.empty(B, T, HV, V, device=dev, dtype=v.dtype)
    _fwd_o[(triton.cdiv(V, cfg["o_BV"]), NC, HV)](
        qg, h, vn, Aqk, o, cu, cidx, scale,
        H=H, HV=HV, K=K, V=V, BT=BT, BV=cfg["o_BV"], PREC=cfg["PREC"], num_stages=cfg["stages"],
        num_warps=cfg["o_warps"],
    )
    # the index tensors are _prep_bounds' cached ones (shared by the layers of a forward): an op's outputs are
    # its own
    cu, cidx, coff = cu.clone(), cidx.clone(), coff.clone()
    return o, (ht if ht is not None else _empty(q)), Aqk, Ti, w, u, kd, qg, gl, h, vn, cu, cidx, coff


chunk_kda_fwd = torch.library.custom_op("moeadapt::chunk_kda_fwd", mutates_args=())(_chunk_kda_fwd_impl)


@chunk_kda_fwd.register_fake
def _(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, A_log, dt_bias, launch):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    _check_head_dims(K, V)
    Tt = B * T
    if cu_seqlens is None:
        N, NC = B, B * ((T + BT - 1) // BT)
    else:  # the chunk count depends on cu_seqlens' values
        N, NC = cu_seqlens.shape[0] - 1, torch.library.get_ctx().new_dynamic_size()
    f32, dt = torch.float32, q.dtype
    new = functools.partial(torch.empty, device=q.device)
    ht = new(N, HV, K, V, dtype=f32) if output_final_state else new(0, dtype=f32)
    return (new(B, T, HV, V, dtype=v.dtype), ht, new(Tt, HV, BT, dtype=f32), new(Tt, HV, BT, dtype=f32),
            new(Tt, HV, K, dtype=dt), new(Tt, HV, V, dtype=dt), new(Tt, HV, K, dtype=dt), new(Tt, HV, K, dtype=dt),
            new(NC, HV, K, dtype=f32), new(NC, HV, K, V, dtype=dt), new(Tt, HV, V, dtype=dt),
            new(N + 1, dtype=torch.int32), new(torch.sym_max(NC, 1), 2, dtype=torch.int32),
            new(N + 1, dtype=torch.int32))


def _chunk_kda_bwd_impl(
    q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, Aqk: Tensor, Ti: Tensor, w: Tensor, u: Tensor,
    kd: Tensor, qg: Tensor, gl: Tensor, h: Tensor, vn: Tensor, cu: Tensor, cidx: Tensor, coff: Tensor,
    h0: Tensor | None, A_log: Tensor | None, dt_bias: Tensor | None, do: Tensor, dht: Tensor | None, scale: float,
    launch: str, gate_grads: bool = True,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """Gradients of chunk_kda_fwd for the cotangents do [B,T,HV,V] and dht [N,HV,K,V] (None: zero), from its
    inputs and saved outputs: (dq, dk, dv, dg, dbeta in their inputs' dtypes, dh0 float32 [N,HV,K,V],
    dA_log [HV], ddt_bias like dt_bias); dh0 / dA_log / ddt_bias are shape [0] where h0 / A_log / dt_bias
    is None, and where `gate_grads` is False (a frozen gate: LoRA). dg is stored in g's dtype by the kernel
    that finishes it, which also sums it over each chunk's tokens in float32 for ddt_bias."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    NC, N = gl.shape[0], cu.numel() - 1
    dev = q.device
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    gate, A32, b32 = _gate_params(A_log, dt_bias, beta, HV, K)
    cfg = _cfg(K, V, q.dtype, HV, launch)
    Tt = B * T
    # cotangents may arrive expanded (stride 0, from `.sum()`) or strided: the kernels index them densely
    do = do.contiguous()
    dht = None if dht is None else dht.contiguous()
    dh = torch.empty_like(h)
    dd = torch.empty(Tt, HV, V, device=dev, dtype=torch.float32)
    dh0 = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32) if h0 is not None else None
    BVh = _state_bv(cfg, N * HV, V, dev)
    _bwd_dh[(triton.cdiv(V, BVh), N * HV)](
        qg, kd, w, gl, Aqk, do, dh, dd, dht if dht is not None else dd, dh0 if dh0 is not None else dd,
        cu, coff, scale, H=H, HV=HV, K=K, V=V, KH=cfg["KHB"], BT=BT, BV=BVh, PREC=cfg["PREC"],
        HAS_DHT=dht is not None, STORE_DH0=dh0 is not None, num_stages=cfg["stages"], num_warps=cfg["dh_warps"],
    )
    # dq / dk: _bwd_wy's partials, finished in place by _bwd_intra, in q's / k's dtype (where HV > H, float32:
    # the value heads' gradients are summed after); dg's partial stays float32 (its in-chunk reverse cumsum)
    dq = torch.empty(Tt, HV, K, device=dev, dtype=q.dtype if HV == H else torch.float32)
    dk = torch.empty(Tt, HV, K, device=dev, dtype=k.dtype if HV == H else torch.float32)
    dg = torch.empty(Tt, HV, K, device=dev, dtype=torch.float32)
    Gc = torch.empty(Tt, HV, K, device=dev, dtype=torch.float32)
    dv = torch.empty(Tt, HV, V, device=dev, dtype=v.dtype)  # stored once, by _bwd_dv: in v's dtype there
    dRu = torch.empty(Tt, HV, V, device=dev, dtype=q.dtype)
    dAqk = torch.empty(Tt, HV, BT, device=dev, dtype=torch.float32)
    dAkk = torch.empty_like(dAqk)
    BK, BK2 = cfg["local_BK"], cfg["local_BK2"]
    db0 = torch.empty(Tt, HV, device=dev, dtype=torch.float32)
    db1 = torch.empty(K // BK, Tt, HV, device=dev, dtype=torch.float32)
    db2 = torch.empty(K // BK2, Tt, HV, device=dev, dtype=torch.float32)
    _bwd_dv[(NC, HV)](
        v, beta, Ti, vn, dd, do, dv, dRu, db0, dAqk, dAkk, cu, cidx, scale,
        HV=HV, V=V, BT=BT, BV=cfg["dv_BV"], PREC=cfg["PREC"], num_stages=cfg["stages"], num_warps=cfg["dv_warps"],
    )
    _bwd_wy[(NC, HV, K // BK)](
        q, k, g, beta, h, dh, vn, dRu, do, dq, dk, dg, db1, Gc, cu, cidx, scale, Tt, A32, b32,
        H=H, HV=HV, K=K, V=V, BT=BT, BK=BK, BV=cfg["local_BV"], PREC=cfg["PREC"], USE_GATE=gate,
        num_stages=cfg["stages"], num_warps=cfg["local_warps"],
    )
    dA = torch.empty(K // BK2, Tt, HV, device=dev, dtype=torch.float32) if gate else db2
    gate_grads = gate and gate_grads
    dg_out = torch.empty(Tt, HV, K, device=dev, dtype=g.dtype)
    # d dt_bias: each chunk's sum of dg over its tokens, from the kernel's float32 values
    ddt_part = torch.empty(NC, HV, K, device=dev, dtype=torch.float32) if gate_grads and dt_bias is not None else None
    _bwd_intra[(NC, HV, K // BK2)](
        q, k, g, Gc, beta, dAqk, dAkk, dq, dk, dg, db2, cu, cidx, Tt, A32, b32, dA, dg_out,
        ddt_part if ddt_part is not None else dg,
        H=H, HV=HV, K=K, BT=BT, BC=BC, BK=BK2, DPREC=cfg["DPREC"],
        USE_GATE=gate, num_stages=cfg["stages"], num_warps=cfg["intra2_warps"],
        DIAG_SPREAD=cfg["diag_spread"], DDT=ddt_part is not None,
    )
    del Gc
    dA_log = dA.sum((0, 1)).to(A_log.dtype) if gate_grads else _empty(q)
    ddt = ddt_part.sum(0).reshape(dt_bias.shape).to(dt_bias.dtype) if ddt_part is not None else _empty(q)
    dg = dg_out
    dbeta = db0 + db1.sum(0) + db2.sum(0)
    if HV != H:
        dq = dq.view(Tt, H, HV // H, K).sum(2)
        dk = dk.view(Tt, H, HV // H, K).sum(2)
    return (dq.view(B, T, H, K).to(q.dtype), dk.view(B, T, H, K).to(k.dtype), dv.view(B, T, HV, V),
            dg.view(B, T, HV, K).to(g.dtype), dbeta.view(B, T, HV).to(beta.dtype),
            dh0 if dh0 is not None else _empty(q), dA_log, ddt)


chunk_kda_bwd = torch.library.custom_op("moeadapt::chunk_kda_bwd", mutates_args=())(_chunk_kda_bwd_impl)
chunk_kda_bwd_fast = impl_or_op(chunk_kda_bwd, _chunk_kda_bwd_impl)  # the implementation itself in eager


@chunk_kda_bwd.register_fake
def _(q, k, v, g, beta, Aqk, Ti, w, u, kd, qg, gl, h, vn, cu, cidx, coff, h0, A_log, dt_bias, do, dht, scale,
      launch, gate_grads=True):
    def like(x):
        return torch.empty(x.shape, device=x.device, dtype=x.dtype) if x is not None else _empty(q)

    gates = (like(A_log), like(dt_bias)) if gate_grads else (_empty(q), _empty(q))
    return like(q), like(k), like(v), like(g), like(beta), like(h0), *gates


def _kda_setup_context(ctx, inputs, output) -> None:
    q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, A_log, dt_bias, launch = inputs
    ctx.save_for_backward(q, k, v, g, beta, h0, A_log, dt_bias, *output[2:])
    ctx.scale, ctx.launch, ctx.o_meta = scale, launch, (output[0].shape, output[0].dtype)
    ctx.mark_non_differentiable(*output[2:])
    ctx.set_materialize_grads(False)  # no zero cotangents for the saved tensors (or an unused o / final state)


def _kda_backward(ctx, do, dht, *_):
    q, k, v, g, beta, h0, A_log, dt_bias, *saved = ctx.saved_tensors
    if do is None:  # only the final state was used
        shape, dtype = ctx.o_meta
        do = torch.zeros(shape, device=q.device, dtype=dtype)
    if dht is not None and dht.numel() == 0:  # the shape-[0] stand-in of an absent final state
        dht = None
    # the gate's own parameters (A_log, dt_bias: inputs 9 and 10) frozen, as under LoRA: their token sums are not
    # taken, and dg is stored straight in g's dtype
    gate_grads = ctx.needs_input_grad[9] or ctx.needs_input_grad[10]
    dq, dk, dv, dg, dbeta, dh0, dA_log, ddt = chunk_kda_bwd_fast(
        q, k, v, g, beta, *saved, h0, A_log, dt_bias, do, dht, ctx.scale, ctx.launch, gate_grads)
    return (dq, dk, dv, dg, dbeta, None, dh0 if h0 is not None else None, None, None,
            dA_log if A_log is not None and gate_grads else None, ddt if dt_bias is not None and gate_grads else None,
            None)


chunk_kda_fwd.register_autograd(_kda_backward, setup_context=_kda_setup_context)
# what chunk_kda_triton calls: the op where traced, in eager an autograd.Function of the same functions (custom.py)
chunk_kda_fwd_fast = eager_or_op(chunk_kda_fwd, _chunk_kda_fwd_impl, _kda_setup_context, _kda_backward)


def _state_bv(cfg, NH, V, device):
    """V-block of the state recurrences (one program per sequence, head and V-block, looping over chunks):
    cfg["h_BV"], or with "auto" 16 when 32-wide blocks would fill at most half the SMs, else 32 (narrower blocks
    re-read w / kd / qg once more per block). H100, bench_kda.py --sweep, fwd+bwd: at 2,4096,16,128 (the `small`
    step: 128 programs of 32 on 132 SMs) 32 takes 2.43 ms against 16's 2.54; at 1,16384,16,128 (64 programs of
    32) 16 wins (KDALaunch's comment)."""
    bv = cfg["h_BV"]
    if bv == "auto":
        sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 132
        bv = 16 if 2 * NH * triton.cdiv(V, 32) <= sms else 32
    return min(bv, V)


def _run_fwd_h(kd, w, u, gl, h0, cu, coff, NC, N, HV, K, V, cfg, output_final_state):
    dev = kd.device
    BV = _state_bv(cfg, N * HV, V, dev)
    h = torch.empty(NC, HV, K, V, device=dev, dtype=kd.dtype)
    vn = torch.empty(u.shape, device=dev, dtype=u.dtype)
    ht = torch.empty(N, HV, K, V, device=dev, dtype=torch.float32) if output_final_state else None
    _fwd_h[(triton.cdiv(V, BV), N * HV)](
        kd, w, u, gl, h, vn, h0 if h0 is not None else vn, ht if ht is not None else vn, cu, coff,
        HV=HV, K=K, V=V, KH=cfg["KH"], BT=BT, BV=BV, PREC=cfg["PREC"],
        HAS_H0=h0 is not None, STORE_HT=output_final_state, num_stages=cfg["stages"], num_warps=cfg["h_warps"],
    )
    return h, vn, ht


def chunk_kda_triton(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    *, use_qk_l2norm=False, A_log=None, dt_bias=None, beta_is_logits=False, launch: KDALaunch = LAUNCH,
):
    """Triton KDA; same contract as `moeadapt.ops.kda.chunk_kda`. The gate (A_log, dt_bias) is fused
    into the kernels; the L2 norm of q/k runs as one Triton pass before them (triton_l2norm.py), the sigmoid of
    beta in PyTorch."""
    if not isinstance(launch, KDALaunch):
        raise TypeError(f"launch must be a KDALaunch (dataclasses.replace(LAUNCH, ...)), got {type(launch).__name__}")
    K = q.shape[-1]
    scale = K**-0.5 if scale is None else scale
    if use_qk_l2norm:
        q, k = l2norm_qk(q, k)
    if beta_is_logits:
        beta = torch.sigmoid(beta.float()).to(beta.dtype)
    h0 = None if initial_state is None else initial_state.float().contiguous()  # kernels index it densely
    # contiguous here, not only inside the op: the op's autograd then saves the tensors the kernels read
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    o, ht, *_ = chunk_kda_fwd_fast(q, k, v, g, beta, float(scale), h0, bool(output_final_state), cu_seqlens, A_log,
                                   dt_bias if A_log is not None else None, launch.key)
    return o, (ht if output_final_state else None)
