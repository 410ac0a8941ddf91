"""Expert parallelism: place E/ep whole experts on each EP rank and move token rows to them.

Owns: `shard_experts` (slices every `[E, ...]` expert tensor, base weights and grouped LoRA adapters alike,
to this rank's experts) and `EPDispatcher`, the drop-in for `LatentMoE.dispatcher`:

  permute locally by global expert (rows come out grouped by destination rank, since rank r owns experts
  [r*E/ep, (r+1)*E/ep)) -> all_to_all counts [ep, E/ep] -> all_to_all latent-width rows -> regroup the
  received rows (src, expert) -> (expert, src) -> grouped GEMM -> reverse regroup -> all_to_all back ->
  unpermute with the gate weights.

The all-to-alls are autograd-aware functional collectives; their backward is the reverse all-to-all.
Expert weight gradients are scaled by 1/ep in autograd (see parallelize.py "Gradient scale").
Overlap: the local tokens are cut into `chunks`; chunk i+1's dispatch all-to-all is in flight while chunk
i's experts compute, and chunk i's combine all-to-all is in flight while chunk i+1 computes (the waits are
lazy: `AsyncCollectiveTensor` blocks on first use). All chunks' counts travel in one small all-to-all.
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


def _wait(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor (still in the autograd graph) from a possibly in-flight collective's output: Triton
    kernels cannot take the AsyncCollectiveTensor wrapper."""
    return t.trigger_wait() if isinstance(t, funcol.AsyncCollectiveTensor) else t


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        return g * ctx.scale, None


def _regroup_index(counts_RE: torch.Tensor) -> torch.Tensor:
    """Rows arrive ordered (src rank, expert); return the index that orders them (expert, src rank)."""
    R, E = counts_RE.shape
    starts_RE = (torch.cumsum(counts_RE.flatten(), 0) - counts_RE.flatten()).view(R, E)
    lens_ER, starts_ER = counts_RE.t().flatten(), starts_RE.t().flatten()
    M = int(lens_ER.sum())
    seg_begin = torch.cumsum(lens_ER, 0) - lens_ER  # where each (e, r) segment begins in the output
    return torch.arange(M) + torch.repeat_interleave(starts_ER - seg_begin, lens_ER)


class EPDispatcher:
    """All-to-all dispatch/combine over one EP process group; same call contract as LocalDispatcher."""

    def __init__(self, group: dist.ProcessGroup, chunks: int = 1, timing: dict | None = None):
        self.group, self.chunks = group, max(1, chunks)
        self.ep = dist.get_world_size(group)
        self.timing = timing  # when a dict: accumulates seconds spent waiting on comm vs in expert compute

    def _a2a(self, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        return funcol.all_to_all_single_autograd(x, out_splits, in_splits, self.group)

    def __call__(self, experts: GroupedExperts, z_TL: torch.Tensor, ids_TK: torch.Tensor, w_TK: torch.Tensor,
                 n_experts: int, backend: str = "auto") -> torch.Tensor:
        R = self.ep
        if n_experts % R:
            raise ValueError(f"ep={R} does not divide n_routed_experts={n_experts}")
        El = n_experts // R
        T = z_TL.shape[0]
        C = max(1, min(self.chunks, T))
        bounds = [T * i // C for i in range(C + 1)]
        perm = [permute(z_TL[a:b], ids_TK[a:b], n_experts, backend=backend) for a, b in zip(bounds, bounds[1:])]
        # one counts exchange for every chunk: to rank r goes [C, El]
        send_RCE = torch.stack([c.view(R, El) for _, _, c in perm], 1).to(torch.int64)
        recv_RCE = funcol.all_to_all_single(send_RCE.flatten().contiguous(), None, None, self.group)
        recv_RCE = funcol.wait_tensor(recv_RCE).view(R, C, El).cpu()
        send_RCE = send_RCE.cpu()

        def start(i: int):
            in_splits = send_RCE[:, i].sum(1).tolist()
            out_splits = recv_RCE[:, i].sum(1).tolist()
            return self._a2a(perm[i][0], out_splits, in_splits), in_splits, out_splits

        outs = []
        inflight = start(0)
        for i in range(C):
            x_ML, in_splits, out_splits = inflight
            if i + 1 < C:
                inflight = start(i + 1)  # chunk i+1's dispatch overlaps chunk i's experts
            counts_RE = recv_RCE[:, i]
            idx_M = _regroup_index(counts_RE).to(z_TL.device)
            t0 = time.perf_counter()
            x_ML = _wait(x_ML)
            t1 = time.perf_counter()
            # expert weight grads sum the tokens of all ep ranks while FSDP averages over world/ep ranks only:
            # scale dW by 1/ep (gradient into the experts' output), and give dx its factor ep back
            x_in = _ScaleGrad.apply(x_ML.index_select(0, idx_M), float(R))
            y_ML = experts(x_in, offsets_from_counts(counts_RE.sum(0).to(z_TL.device)))
            y_ML = _ScaleGrad.apply(y_ML, 1.0 / R)
            y_ML = y_ML.index_select(0, torch.argsort(idx_M))  # back to (src rank, expert) order
            if self.timing is not None:
                t2 = time.perf_counter()
                self.timing["wait_s"] = self.timing.get("wait_s", 0.0) + (t1 - t0)
                self.timing["compute_s"] = self.timing.get("compute_s", 0.0) + (t2 - t1)
            outs.append(self._a2a(y_ML, in_splits, out_splits))  # combine overlaps the next chunk
        ys = [unpermute(_wait(y), ri, w_TK[a:b], b - a, backend=backend)
              for y, (_, ri, _), a, b in zip(outs, perm, bounds, bounds[1:])]
        return ys[0] if C == 1 else torch.cat(ys)
