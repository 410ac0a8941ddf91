"""Expert parallelism: place E/ep whole experts on each EP rank and move token rows to them.

Owns: `shard_experts` (slices every `[E, ...]` expert tensor, base weights and grouped LoRA adapters alike,
to this rank's experts) and `EPDispatcher`, the drop-in for `LatentMoE.dispatcher`:

  permute locally by global expert (rows come out grouped by destination rank, since rank r owns experts
  [r*E/ep, (r+1)*E/ep)) -> all_to_all counts [ep, E/ep] -> all_to_all latent-width rows -> regroup the
  received rows (src, expert) -> (expert, src) -> grouped GEMM -> reverse regroup -> all_to_all back ->
  unpermute with the gate weights.

Each all-to-all's backward is the reverse all-to-all with the same (swapped) split sizes.
Expert weight gradients are scaled by 1/ep in autograd (see parallelize.py "Gradient scale").
Overlap: the local tokens are cut into `chunks`; chunk i+1's dispatch all-to-all is in flight while chunk
i's experts compute, and chunk i's combine all-to-all is in flight while chunk i+1 computes. The backward
mirrors it: every chunk's output-gradient all-to-all starts as soon as the gradients exist (chunk i's
arrives while chunk i+1's experts run backward), and each chunk's input-gradient all-to-all starts when
its rows' gradient exists and is waited for after every chunk's experts (chunk i's travels while chunk
i-1's experts run backward). `_Exchange` and the autograd Functions below start and wait.
All chunks' counts travel in one small all-to-all: one host sync per layer (EPDispatcher says why).
Must not touch routing (router.py) or parameters beyond slicing them.

Shape suffixes: T tokens, K choices, L latent width, N rows sent, M rows received, E experts, R EP ranks.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from ..models.moe import GroupedExperts, LatentMoE
from ..ops.moe import offsets_from_counts, permute, unpermute


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


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


def _regroup_index(counts_RE: torch.Tensor, M: int) -> torch.Tensor:
    """Rows arrive ordered (src rank, expert); return the index that orders them (expert, src rank).
    On the counts' device, no host sync: M (= counts_RE.sum(), known on the host) sizes the output."""
    R, E = counts_RE.shape
    flat = counts_RE.flatten()
    starts_RE = (torch.cumsum(flat, 0) - flat).view(R, E)
    lens_ER, starts_ER = counts_RE.t().flatten(), starts_RE.t().flatten()
    seg_begin = torch.cumsum(lens_ER, 0) - lens_ER  # where each (e, r) segment begins in the output
    shift = torch.repeat_interleave(starts_ER - seg_begin, lens_ER, output_size=M)
    return torch.arange(M, device=counts_RE.device) + shift


class _Exchange:
    """One chunk's all-to-all pair (dispatch and combine), forward and backward: the split sizes (host ints,
    from the one counts exchange of the layer) and the in-flight works. Each all-to-all is started by one
    autograd node and waited for by a later one, so it runs while other work (the next chunk's experts,
    in forward and in backward) proceeds. Gloo and NCCL both run an async collective on their own stream /
    thread; on NCCL `wait` only orders the current stream (the host does not block)."""

    def __init__(self, group: dist.ProcessGroup, send: list[int], recv: list[int], timing: dict | None):
        self.group, self.send, self.recv, self.timing = group, send, recv, timing
        self.works: dict[str, tuple[dist.Work, torch.Tensor]] = {}

    def start(self, key: str, x: torch.Tensor, out_rows: int, out_splits: list[int], in_splits: list[int]):
        x = x.contiguous()
        out = x.new_empty((out_rows, *x.shape[1:]))
        work = dist.all_to_all_single(out, x, out_splits, in_splits, group=self.group, async_op=True)
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
    def forward(ctx, x_NL: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        ctx.ex = ex
        return ex.start("fwd_dispatch", x_NL, sum(ex.recv), ex.recv, ex.send)

    @staticmethod
    def backward(ctx, g_ML: torch.Tensor):
        return ctx.ex.works["bwd_dispatch"][1], None


class _SendBack(torch.autograd.Function):
    """Identity on the received rows, applied when chunk i computes; backward starts the all-to-all that
    returns the rows' gradients at once, so it is in flight while chunk i-1's experts run backward.
    (Autograd runs nodes newest first: `_Dispatch` of chunk i was made before chunk i-1 computed, so its own
    backward would come only after chunk i-1's.)"""

    @staticmethod
    def forward(ctx, x_ML: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        ctx.ex = ex
        return x_ML.view_as(x_ML)

    @staticmethod
    def backward(ctx, g_ML: torch.Tensor):
        ex = ctx.ex
        ex.start("bwd_dispatch", g_ML, sum(ex.send), ex.send, ex.recv)
        return g_ML, None


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
    def forward(ctx, y_ML: torch.Tensor, ex: _Exchange) -> torch.Tensor:
        ctx.ex = ex
        return ex.start("fwd_combine", y_ML, sum(ex.send), ex.send, ex.recv)

    @staticmethod
    def backward(ctx, g_NL: torch.Tensor):
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
            ex.start("bwd_combine", g, sum(ex.recv), ex.recv, ex.send)
        return (None, *gs)


class EPDispatcher:
    """All-to-all dispatch/combine over one EP process group; same call contract as LocalDispatcher.

    Host syncs: one per layer (forward), the copy of the layer's token counts [R, C, E/ep] (sent and received)
    to the host. It cannot move earlier (layer l's counts follow from layer l-1's output) nor go away while
    the exchange has variable sizes: all_to_all_single takes its split sizes as host integers and the host
    allocates the received rows. A fixed-capacity exchange (padding / drops) or device-initiated all-to-all
    would remove it. Backward reuses the forward's sizes (no sync); an activation-checkpoint recompute repeats
    the forward's one. permute takes N = T*K from a dropless router (no sync of its own)."""

    def __init__(self, group: dist.ProcessGroup, chunks: int = 1, timing: dict | None = None, dropless: bool = False):
        self.group, self.chunks, self.dropless = group, max(1, chunks), dropless
        self.ep = dist.get_world_size(group)
        # when a dict: accumulates seconds the host blocks on the forward all-to-alls (wait_s), the backward
        # ones (bwd_wait_s) and the counts sync (sync_s, with its count `syncs`), and expert compute (compute_s)
        self.timing = timing

    def __call__(self, experts: GroupedExperts, z_TL: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
                 n_experts: int, backend: str = "auto") -> torch.Tensor:
        R = self.ep
        if n_experts % R:
            raise ValueError(f"ep={R} does not divide n_routed_experts={n_experts}")
        El = n_experts // R
        T, K = ids_TK.shape
        C = max(1, min(self.chunks, T))
        bounds = [T * i // C for i in range(C + 1)]
        perm = [permute(z_TL[a:b], ids_TK[a:b], n_experts, backend=backend,
                        num_routed=(b - a) * K if self.dropless else None) for a, b in zip(bounds, bounds[1:])]
        # one counts exchange for every chunk: to rank r goes [C, El]; then the layer's one host sync
        send_RCE = torch.stack([c.view(R, El) for _, _, c in perm], 1).to(torch.int64)
        t0 = time.perf_counter()
        recv_RCE = funcol.wait_tensor(funcol.all_to_all_single(send_RCE.flatten().contiguous(), None, None,
                                                               self.group)).view(R, C, El)
        sizes = torch.stack([send_RCE.sum(2), recv_RCE.sum(2)]).cpu()  # [2, R, C]
        if self.timing is not None:
            self.timing["sync_s"] = self.timing.get("sync_s", 0.0) + time.perf_counter() - t0
            self.timing["syncs"] = self.timing.get("syncs", 0) + 1
        exs = [_Exchange(self.group, sizes[0, :, i].tolist(), sizes[1, :, i].tolist(), self.timing) for i in range(C)]
        # placed before any chunk starts: in backward autograd reaches these last, after every chunk's experts
        xs = [_AwaitGrad.apply(x_NL, ex) for (x_NL, _, _), ex in zip(perm, exs)]
        inflight = _Dispatch.apply(xs[0], exs[0])
        outs = []
        for i in range(C):
            x_ML = inflight
            if i + 1 < C:
                inflight = _Dispatch.apply(xs[i + 1], exs[i + 1])  # chunk i+1's dispatch overlaps chunk i's experts
            counts_RE = recv_RCE[:, i]
            idx_M = _regroup_index(counts_RE, sum(exs[i].recv))
            exs[i].wait("fwd_dispatch")
            x_ML = _SendBack.apply(x_ML, exs[i])
            t1 = time.perf_counter()
            # expert weight grads sum the tokens of all ep ranks while FSDP averages over world/ep ranks only:
            # scale dW by 1/ep (gradient into the experts' output), and give dx its factor ep back
            x_in = _ScaleGrad.apply(x_ML.index_select(0, idx_M), float(R))
            y_ML = experts(x_in, offsets_from_counts(counts_RE.sum(0)))
            y_ML = _ScaleGrad.apply(y_ML, 1.0 / R)
            y_ML = y_ML.index_select(0, torch.argsort(idx_M))  # back to (src rank, expert) order
            if self.timing is not None:
                self.timing["compute_s"] = self.timing.get("compute_s", 0.0) + (time.perf_counter() - t1)
            outs.append(_Combine.apply(y_ML, exs[i]))  # combine overlaps the next chunk
        outs = _Combined.apply(exs, *outs)
        ys = [unpermute(y, ri, w_TK[a:b], b - a, backend=backend)
              for y, (_, ri, _), a, b in zip(outs, perm, bounds, bounds[1:])]
        return ys[0] if C == 1 else torch.cat(ys)
