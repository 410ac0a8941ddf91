"""Expert parallelism: place E/ep whole experts on each EP rank and move token rows to them.

Owns: `shard_experts` (slices every `[E, ...]` expert tensor, base weights and grouped LoRA adapters alike,
to this rank's experts), `EPDispatcher`, the drop-in for `LatentMoE.dispatcher`, the capacity rule
(`capacity_rows`, shared with plan/memory.py) and `check_capacity`, the trainer's once-per-step overflow check.

Fixed-capacity, dropless exchange with no host sync (the host never reads a count):
  per chunk, lay this rank's token choices out in a send buffer [R, cap, L] (the rows for rank r, ordered by
  r's local expert, at slots r*cap + j, zeros after them), built on the device from the ids -> all_to_all
  the counts [R, C, E/ep] of every chunk (one fixed-size exchange) -> all_to_all the [R, cap, L] rows (fixed
  size) -> regroup the received rows (src, expert) -> (expert, src) with the padding rows after every real row
  -> grouped GEMM with device offsets (rows past offsets[-1] are no expert's: their outputs are zeroed here)
  -> reverse regroup -> all_to_all back -> weighted sum of each token's K rows.
`cap` rows per (source, destination, chunk) is a host integer every rank of the group agrees on: from
`capacity_factor` x the balanced share (T_c * K / R, rounded up to 64, never above T_c * K, which no routing
can exceed). A pair with more rows than `cap` keeps its first `cap` (the rest contribute nothing) and the
dispatcher records, on the device, the largest pair count it saw (`peak`, a running max). `check_capacity`
reads every layer's peak once (all-reduced max over the world), grows `cap` where it was exceeded and tells
the caller to re-run the step: results are always those of the dropless exchange.

Each all-to-all's backward is the same fixed-size all-to-all in reverse. Expert weight gradients are scaled
by 1/ep in autograd (see parallelize.py "Gradient scale").
Overlap: the local tokens are cut into `chunks`; chunk i+1's dispatch all-to-all is in flight while chunk
i's experts compute, and chunk i's combine all-to-all is in flight while chunk i+1 computes. The backward
mirrors it: every chunk's output-gradient all-to-all starts as soon as the gradients exist (chunk i's
arrives while chunk i+1's experts run backward), and each chunk's input-gradient all-to-all starts when
its rows' gradient exists and is waited for after every chunk's experts (chunk i's travels while chunk
i-1's experts run backward). `_Exchange` and the autograd Functions below start and wait.
Must not touch routing (router.py) or parameters beyond slicing them.

Shape suffixes: T tokens, K choices, L latent width, N = T*K choices, S = R*cap slots of a chunk's buffer,
E experts (El = E/ep local ones), R EP ranks, C chunks.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from ..models.moe import GroupedExperts, LatentMoE

CAP_ALIGN = 64  # capacities are multiples of this many rows (or T_c * K, the most a pair can carry)
CAP_GROWTH = 1.25  # an exceeded capacity grows to round_up(peak * CAP_GROWTH, CAP_ALIGN)


@torch.no_grad()
def _slice0(p: nn.Parameter, lo: int, hi: int) -> nn.Parameter:
    return nn.Parameter(p.data[lo:hi].clone(), requires_grad=p.requires_grad)


def shard_experts(model: nn.Module, ep: int, ep_rank: int) -> list[GroupedExperts]:
    """Keep only experts [ep_rank*E/ep, (ep_rank+1)*E/ep) of every MoE layer (weights and LoRA adapters).
    Returns the sliced GroupedExperts modules. Call before fully_shard and before building the optimizer;
    on a meta-built model it allocates nothing (the scale-true build: parallel/shards.py)."""
    out = []
    for m in model.modules():
        if not isinstance(m, LatentMoE):
            continue
        E = m.spec.n_routed_experts
        if E % ep:
            raise ValueError(f"ep={ep} does not divide n_routed_experts={E}")
        n_local = E // ep
        lo, hi = ep_rank * n_local, (ep_rank + 1) * n_local
        for lin in (m.experts.w1, m.experts.w2, m.experts.w3):
            if lin.weight.shape[0] != E:
                raise ValueError(f"experts already sharded: weight has {lin.weight.shape[0]} experts, expected {E}")
            for name in ("weight", "lora_A", "lora_B"):
                p = getattr(lin, name, None)
                if isinstance(p, nn.Parameter):
                    setattr(lin, name, _slice0(p, lo, hi))
            lin.n_experts = n_local
            lin.expert_range = (lo, E)  # first global expert held here, and E (parallel.shards reads it)
        out.append(m.experts)
    return out


def _round_up(n: float, to: int = CAP_ALIGN) -> int:
    return int(math.ceil(n / to)) * to


def capacity_rows(tokens: int, top_k: int, ep: int, chunks: int, factor: float) -> int:
    """Rows per (source rank, destination rank, chunk) of the exchange for `tokens` local tokens: `factor` x
    the balanced share T_c * K / ep (T_c: the largest chunk's tokens), rounded up to 64 and capped at T_c * K
    (every choice of the chunk to one rank: a capacity no routing exceeds)."""
    if not factor > 0:
        raise ValueError(f"parallel.ep_capacity_factor={factor} must be > 0 (e.g. 1.5: room for 1.5x the balanced "
                         "share of rows per rank pair)")
    C = max(1, min(chunks, tokens))
    most = -(-tokens // C) * top_k  # the largest chunk's choices
    return max(1, min(most, _round_up(factor * most / ep)))


def _send_layout(ids_TK: torch.Tensor, n_experts: int, R: int, cap: int):
    """Where each token choice goes in the [R*cap] send slots, on the device (no host read).

    Returns src_S (the flat choice index t*K+k feeding each slot, -1 for padding), slot_N (the slot of each
    choice; S = R*cap for a dropped choice (-1 id) or one past its pair's capacity), counts_RE (the true rows
    per destination rank and local expert) and the largest count of any destination (the pair's need)."""
    El, S = n_experts // R, R * cap
    ids_N = ids_TK.reshape(-1).long()
    N = ids_N.shape[0]
    key_N = torch.where(ids_N < 0, n_experts, ids_N)  # dropped choices sort after every expert
    order_N = torch.argsort(key_N, stable=True)  # expert-major, stable in t*K+k (permute's order)
    counts = torch.zeros(n_experts + 1, dtype=torch.int64, device=ids_N.device)
    counts.scatter_add_(0, key_N, torch.ones_like(key_N))
    counts_RE = counts[:n_experts].view(R, El)
    n_R = counts_RE.sum(1)
    start_R = torch.cumsum(n_R, 0) - n_R  # where each destination's rows begin in the sorted order
    r_N = key_N[order_N] // El  # destination of each sorted choice (R: dropped)
    j_N = torch.arange(N, device=ids_N.device) - start_R[r_N.clamp(max=R - 1)]
    keep_N = (r_N < R) & (j_N < cap)
    slot_sorted = torch.where(keep_N, r_N * cap + j_N, S)
    slot_N = torch.empty_like(slot_sorted).scatter_(0, order_N, slot_sorted)
    src_S = torch.full((S + 1,), -1, dtype=torch.int64, device=ids_N.device).scatter_(0, slot_sorted, order_N)
    return src_S[:S], slot_N, counts_RE, n_R.max()


def _regroup(recv_RE: torch.Tensor, cap: int):
    """Received slot (src r, j) -> its row in the experts' input: expert-major, then source rank, then j;
    every padding slot after every real row. On the device. Returns pos_S (a permutation of [0, R*cap)),
    the experts' END offsets (int32, [El]) and the number of real rows. recv_RE holds the true counts:
    rows past `cap` never arrived (an overflowing step, re-run by the trainer), so they are clamped away."""
    R, El = recv_RE.shape
    end_RE = torch.cumsum(recv_RE, 1).clamp(max=cap)
    cnt_RE = torch.diff(end_RE, dim=1, prepend=end_RE.new_zeros(R, 1))
    start_RE = end_RE - cnt_RE
    tot_R = end_RE[:, -1]
    j_RS = torch.arange(cap, device=recv_RE.device).expand(R, cap)
    e_RS = torch.searchsorted(end_RE.contiguous(), j_RS.contiguous(), right=True)  # El: a padding slot
    seg_ER = cnt_RE.t().reshape(-1)
    begin_RE = (torch.cumsum(seg_ER, 0) - seg_ER).view(El, R).t()  # where segment (e, r) starts in the output
    n_real = cnt_RE.sum()
    pad_R = cap - tot_R
    pad_begin_R = n_real + torch.cumsum(pad_R, 0) - pad_R
    e_c = e_RS.clamp(max=El - 1)
    pos_RS = torch.where(e_RS < El, begin_RE.gather(1, e_c) + j_RS - start_RE.gather(1, e_c),
                         pad_begin_R[:, None] + j_RS - tot_R[:, None])
    offsets_E = torch.cumsum(cnt_RE.sum(0), 0, dtype=torch.int32)
    return pos_RS.reshape(-1), offsets_E, n_real


def _inverse(pos_S: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(pos_S).scatter_(0, pos_S, torch.arange(pos_S.shape[0], device=pos_S.device))


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


class _Exchange:
    """One chunk's fixed-size all-to-all pair (dispatch and combine), forward and backward: every buffer is
    [R*cap, L], cap rows to and from each rank, so no split sizes exist. Each all-to-all is started by one
    autograd node and waited for by a later one, so it runs while other work (the next chunk's experts,
    in forward and in backward) proceeds. Gloo and NCCL both run an async collective on their own stream /
    thread; on NCCL `wait` only orders the current stream (the host does not block)."""

    def __init__(self, group: dist.ProcessGroup, timing: dict | None):
        self.group, self.timing = group, timing
        self.works: dict[str, tuple[dist.Work, torch.Tensor]] = {}

    def start(self, key: str, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        out = torch.empty_like(x)
        work = dist.all_to_all_single(out, x, group=self.group, async_op=True)
        self.works[key] = (work, out)
        return out

    def wait(self, key: str) -> torch.Tensor:
        work, out = self.works.pop(key)
        t0 = time.perf_counter()
        work.wait()
        if self.timing is not None:
            k = "wait_s" if key.startswith("fwd") else "bwd_wait_s"
            self.timing[k] = self.timing.get(k, 0.0) + time.perf_counter() - t0
        return out


class _Dispatch(torch.autograd.Function):
    """Forward: start sending this chunk's rows to their experts' ranks (the caller waits: `ex.wait`).
    Backward: hand on the rows' gradients, whose all-to-all `_SendBack` started; `_AwaitGrad` waits for it."""

    @staticmethod
    def forward(ctx, x_SL: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        ctx.ex = ex
        return ex.start("fwd_dispatch", x_SL)

    @staticmethod
    def backward(ctx, g_SL: torch.Tensor):
        return ctx.ex.works["bwd_dispatch"][1], None


class _SendBack(torch.autograd.Function):
    """Identity on the received rows, applied when chunk i computes; backward starts the all-to-all that
    returns the rows' gradients at once, so it is in flight while chunk i-1's experts run backward.
    (Autograd runs nodes newest first: `_Dispatch` of chunk i was made before chunk i-1 computed, so its own
    backward would come only after chunk i-1's.)"""

    @staticmethod
    def forward(ctx, x_SL: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        ctx.ex = ex
        return x_SL.view_as(x_SL)

    @staticmethod
    def backward(ctx, g_SL: torch.Tensor):
        ctx.ex.start("bwd_dispatch", g_SL)
        return g_SL, None


class _AwaitGrad(torch.autograd.Function):
    """Identity; backward waits for the dispatch gradient that `_Dispatch.backward` started."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        ctx.ex = ex
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return ctx.ex.wait("bwd_dispatch"), None


class _Combine(torch.autograd.Function):
    """Forward: start sending this chunk's expert outputs back to the tokens' ranks (`_Combined` waits).
    Backward: wait for the output gradient's all-to-all, which `_Combined.backward` started for every chunk
    at once, so chunk i's arrives while chunk i+1's experts run backward."""

    @staticmethod
    def forward(ctx, y_SL: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        ctx.ex = ex
        return ex.start("fwd_combine", y_SL)

    @staticmethod
    def backward(ctx, g_SL: torch.Tensor):
        return ctx.ex.wait("bwd_combine"), None


class _Combined(torch.autograd.Function):
    """Forward: wait for every chunk's combine (identity on the received rows). Backward: start every chunk's
    output-gradient all-to-all, in the order the chunks' backward will need them (the last chunk first)."""

    @staticmethod
    def forward(ctx, exs: list[_Exchange], *ys: torch.Tensor):
        ctx.exs = exs
        for ex in exs:
            ex.wait("fwd_combine")
        return tuple(y.view_as(y) for y in ys)

    @staticmethod
    def backward(ctx, *gs: torch.Tensor):
        for ex, g in reversed(list(zip(ctx.exs, gs))):  # (autograd gives zeros for an unused output, never None)
            ex.start("bwd_combine", g)
        return (None, *gs)


class EPDispatcher:
    """All-to-all dispatch/combine over one EP process group; same call contract as LocalDispatcher.

    No host sync: the counts travel in one fixed-size all-to-all and stay on the device; the rows travel in
    fixed-size [R, cap, L] buffers per chunk (module docstring). `timing["syncs"]` counts host reads of
    device values inside the dispatcher: 0. The host integer `cap` is set at the first call from
    `capacity_factor` and that call's T (or from `tokens`, the trainer's tokens per forward, so that every
    rank agrees even when one rank's batch is short), and changed only by `check_capacity`; every rank of
    the group must hold the same `cap` (all_to_all with equal splits). `peak` (device, int64) is the running
    max of rows sent to one rank by one chunk, read and reset by `check_capacity`. An activation-checkpoint
    recompute sees the same counts: it neither changes `cap` nor `peak`. Dropped choices (id -1, a
    capacity-limited router) take no slot, so one path serves dropless and capacity routers alike."""

    def __init__(self, group: dist.ProcessGroup, chunks: int = 1, timing: dict | None = None,
                 capacity_factor: float = 1.5, tokens: int | None = None, top_k: int | None = None):
        if not capacity_factor > 0:
            raise ValueError(f"parallel.ep_capacity_factor={capacity_factor} must be > 0 (e.g. 1.5: room for "
                             "1.5x the balanced share of rows per rank pair)")
        self.group, self.chunks = group, max(1, chunks)
        self.ep = dist.get_world_size(group)
        self.capacity_factor = capacity_factor
        self.cap: int | None = None
        if tokens is not None and top_k is not None:
            self.cap = capacity_rows(tokens, top_k, self.ep, self.chunks, capacity_factor)
        self.peak: torch.Tensor | None = None
        # when a dict: accumulates seconds the host blocks on the forward all-to-alls (wait_s), the backward
        # ones (bwd_wait_s) and the counts exchange (counts_s), expert compute (compute_s), and `syncs`, the
        # host reads of device values (none)
        self.timing = timing

    def __call__(self, experts: GroupedExperts, z_TL: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
                 n_experts: int, backend: str = "auto") -> torch.Tensor:
        R = self.ep
        if n_experts % R:
            raise ValueError(f"ep={R} does not divide n_routed_experts={n_experts}")
        El = n_experts // R
        T, K = ids_TK.shape
        if self.cap is None:
            self.cap = capacity_rows(T, K, R, self.chunks, self.capacity_factor)
        cap = self.cap
        S = R * cap
        C = max(1, min(self.chunks, T))
        bounds = [T * i // C for i in range(C + 1)]
        lays = [_send_layout(ids_TK[a:b], n_experts, R, cap) for a, b in zip(bounds, bounds[1:])]
        need = torch.stack([p for *_, p in lays]).max()
        if self.peak is None or self.peak.device != need.device:
            self.peak = torch.zeros((), dtype=torch.int64, device=need.device)
        # the same op whether or not peak existed: a selective-checkpoint recompute replays the forward's ops
        self.peak = torch.maximum(self.peak, need)
        # one fixed-size counts exchange for every chunk: to rank r goes [C, El]
        send_RCE = torch.stack([c for _, _, c, _ in lays], 1)
        t0 = time.perf_counter()
        recv_RCE = funcol.wait_tensor(funcol.all_to_all_single(send_RCE.flatten().contiguous(), None, None,
                                                               self.group)).view(R, C, El)
        if self.timing is not None:
            self.timing["counts_s"] = self.timing.get("counts_s", 0.0) + time.perf_counter() - t0
            self.timing["syncs"] = self.timing.get("syncs", 0)
        exs = [_Exchange(self.group, self.timing) for _ in range(C)]
        sends = []
        for (src_S, *_), a in zip(lays, bounds):
            x_SL = z_TL.index_select(0, a + src_S.clamp(min=0) // K)
            sends.append(torch.where((src_S >= 0)[:, None], x_SL, 0))
        # placed before any chunk starts: in backward autograd reaches these last, after every chunk's experts
        xs = [_AwaitGrad.apply(x_SL, ex) for x_SL, ex in zip(sends, exs)]
        inflight = _Dispatch.apply(xs[0], exs[0])
        outs = []
        for i in range(C):
            x_SL = inflight
            if i + 1 < C:
                inflight = _Dispatch.apply(xs[i + 1], exs[i + 1])  # chunk i+1's dispatch overlaps chunk i's experts
            pos_S, offsets_E, n_real = _regroup(recv_RCE[:, i], cap)
            exs[i].wait("fwd_dispatch")
            x_SL = _SendBack.apply(x_SL, exs[i])
            t1 = time.perf_counter()
            # expert weight grads sum the tokens of all ep ranks while FSDP averages over world/ep ranks only:
            # scale dW by 1/ep (gradient into the experts' output), and give dx its factor ep back
            x_in = _ScaleGrad.apply(x_SL.index_select(0, _inverse(pos_S)), float(R))
            y_SL = experts(x_in, offsets_E)
            # rows past offsets[-1] belong to no expert (a kernel may leave them unwritten): zeros travel back
            real_S = torch.arange(S, device=y_SL.device) < n_real
            y_SL = _ScaleGrad.apply(torch.where(real_S[:, None], y_SL, 0), 1.0 / R)
            y_SL = y_SL.index_select(0, pos_S)  # back to the received slots' order
            if self.timing is not None:
                self.timing["compute_s"] = self.timing.get("compute_s", 0.0) + (time.perf_counter() - t1)
            outs.append(_Combine.apply(y_SL, exs[i]))  # combine overlaps the next chunk
        outs = _Combined.apply(exs, *outs)
        ys = [_combine_choices(y_SL, slot_N, w_TK[a:b], S)
              for y_SL, (_, slot_N, _, _), a, b in zip(outs, lays, bounds, bounds[1:])]
        return ys[0] if C == 1 else torch.cat(ys)


def _combine_choices(y_SL: torch.Tensor, slot_N: torch.Tensor, w_TK: torch.Tensor, S: int) -> torch.Tensor:
    """y_TL[t] = sum_k w[t, k] * y[slot of (t, k)], accumulated in at least fp32; a choice without a slot
    (dropped, or past its pair's capacity) adds nothing."""
    T, K = w_TK.shape
    acc = torch.promote_types(y_SL.dtype, torch.float32)
    y_TKL = y_SL.index_select(0, slot_N.clamp(max=S - 1)).view(T, K, -1)
    w_TK = torch.where((slot_N < S).view(T, K), w_TK, 0).to(acc)
    return (y_TKL.to(acc) * w_TK[..., None]).sum(1).to(y_SL.dtype)


def ep_dispatchers(model: nn.Module) -> list[EPDispatcher]:
    """Every EP dispatcher of the model's MoE layers, in module order (the same on every rank)."""
    return [m.dispatcher for m in model.modules() if isinstance(getattr(m, "dispatcher", None), EPDispatcher)]


def reset_capacity(model: nn.Module) -> None:
    """Forget the recorded peaks (a discarded step's); local, no collective."""
    for d in ep_dispatchers(model):
        d.peak = None


def check_capacity(model: nn.Module) -> str | None:
    """Once per optimizer step (or evaluation), on every rank: the largest pair count of each EP layer since
    the last check, max over all ranks (one all-reduce of [layers] and one host read). Where it exceeded the
    layer's `cap`, cap grows to round_up(peak * 1.25, 64) (it never shrinks) and a one-line notice is
    returned: the caller must discard the work and re-run it. None when nothing overflowed. Collective over
    the default group (every rank takes the same decision); the peaks are reset."""
    ds = ep_dispatchers(model)
    if not ds:
        return None
    dev = next((d.peak.device for d in ds if d.peak is not None), None)
    if dev is None:
        dev = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    peaks = torch.stack([d.peak if d.peak is not None else torch.zeros((), dtype=torch.int64, device=dev)
                         for d in ds])
    dist.all_reduce(peaks, op=dist.ReduceOp.MAX)
    grown = []
    for i, (d, p) in enumerate(zip(ds, peaks.tolist())):
        d.peak = None
        if d.cap is not None and p > d.cap:
            new = max(d.cap, _round_up(p * CAP_GROWTH))
            grown.append(f"EP layer {i}: {p} rows > cap {d.cap} -> {new}")
            d.cap = new
    if not grown:
        return None
    return ("expert-parallel exchange overflowed (" + "; ".join(grown) + "); re-running the step with the larger "
            "capacity (raise parallel.ep_capacity_factor to start higher)")
