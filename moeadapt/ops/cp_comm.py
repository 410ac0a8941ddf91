"""Context-parallel layout and the differentiable collectives the CP operators share (ops/kda/cp.py, ops/dsa/cp.py).

Owns `CPLayout` (which parts of one sequence each rank of a cp group holds) and two autograd collectives:
`gather_pieces` (all-gather forward, reduce-scatter of the gradient backward) and `predecessor_tails` (each
piece receives the last n tokens of the piece before it, for short causal convolutions; gradients flow back).
Knows nothing about models or meshes: a caller (parallel/) builds the layout from its process group.

Layout: the sequence of T tokens is cut into `n_pieces` equal pieces of T / n_pieces tokens. Contiguous
(`balanced=False`): rank r holds piece r. Causally balanced (`balanced=True`, the default): rank r holds
pieces r and 2 * size - 1 - r (one from the head, one from the tail), so every rank has the same amount of
causal attention work. A rank's local tensor is its pieces concatenated along time in ascending piece order.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class CPLayout:
    """One cp group and how a sequence is split over it. `group=None` with size 1 is the single-rank case."""

    group: dist.ProcessGroup | None
    rank: int
    size: int
    balanced: bool = True

    def __post_init__(self) -> None:
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise ValueError(f"cp rank {self.rank} is not in a cp group of size {self.size}")

    @property
    def n_pieces(self) -> int:
        return 2 * self.size if self.balanced else self.size

    def pieces(self, rank: int | None = None) -> tuple[int, ...]:
        """Global piece indices held by `rank` (default: this rank), ascending = local order."""
        r = self.rank if rank is None else rank
        return (r, 2 * self.size - 1 - r) if self.balanced else (r,)

    @property
    def pieces_per_rank(self) -> int:
        return 2 if self.balanced else 1

    def check_length(self, T_global: int, chunk: int = 1) -> int:
        """Piece length for a global length T_global; one clear error if it does not split into whole chunks."""
        unit = self.n_pieces * chunk
        if T_global % unit:
            lo, hi = T_global // unit * unit, -(-T_global // unit) * unit
            raise ValueError(f"sequence length {T_global} does not split over cp={self.size} into "
                             f"{self.n_pieces} pieces of whole {chunk}-token chunks; use a length that is a "
                             f"multiple of {unit} (e.g. {lo or unit} or {hi}) or another cp")
        return T_global // self.n_pieces

    def local_positions(self, T_global: int, device=None) -> torch.Tensor:
        """Global positions [T_local] of this rank's tokens in local order (for RoPE and for splitting inputs)."""
        Tp = self.check_length(T_global)
        return torch.cat([torch.arange(p * Tp, (p + 1) * Tp, device=device) for p in self.pieces()])

    def split(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's part of a global tensor along `dim` (time)."""
        return x.index_select(dim, self.local_positions(x.shape[dim], x.device))

    def piece_order(self) -> list[tuple[int, int]]:
        """(rank, local slot) holding each global piece, indexed by piece."""
        where = {p: (r, j) for r in range(self.size) for j, p in enumerate(self.pieces(r))}
        return [where[p] for p in range(self.n_pieces)]


def _all_gather(x: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    """[size, *x.shape], rank-major."""
    if layout.size == 1:
        return x.unsqueeze(0)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(layout.size)]
    dist.all_gather(parts, x, group=layout.group)
    return torch.stack(parts)


def _reduce_scatter(x_R: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    """Sum over ranks of x_R [size, ...], this rank's row. Gloo has no reduce-scatter: all-reduce and slice."""
    if layout.size == 1:
        return x_R[0]
    x_R = x_R.contiguous()
    if dist.get_backend(layout.group) == "nccl":
        out = torch.empty_like(x_R[0])
        dist.reduce_scatter_tensor(out, x_R, group=layout.group)
        return out
    dist.all_reduce(x_R, group=layout.group)
    return x_R[layout.rank].clone()


class _GatherPieces(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_J, layout: CPLayout):
        ctx.layout = layout
        g_RJ = _all_gather(x_J, layout)
        order = layout.piece_order()
        return torch.stack([g_RJ[r, j] for r, j in order])

    @staticmethod
    def backward(ctx, d_P):
        layout = ctx.layout
        d_RJ = d_P.new_zeros(layout.size, layout.pieces_per_rank, *d_P.shape[1:])
        for p, (r, j) in enumerate(layout.piece_order()):
            d_RJ[r, j] = d_P[p]
        return _reduce_scatter(d_RJ, layout), None


def gather_pieces(x_J: torch.Tensor, layout: CPLayout) -> torch.Tensor:
    """x_J [pieces_per_rank, ...] (this rank's pieces) -> [n_pieces, ...] in global piece order, differentiable:
    the gradient of every gathered piece is summed over ranks and returned to the rank that holds it."""
    return _GatherPieces.apply(x_J, layout)


def predecessor_tails(x_BTC: torch.Tensor, n: int, layout: CPLayout) -> torch.Tensor:
    """For each local piece, the last `n` time steps of the piece before it in the sequence (zeros for piece 0).

    x_BTC: this rank's [B, T_local, C]; returns [pieces_per_rank, B, n, C]. Differentiable (the gradient of a
    tail goes back to the rank holding that piece)."""
    J = layout.pieces_per_rank
    B, T, C = x_BTC.shape
    Tp = T // J
    if n > Tp:
        raise ValueError(f"a cp piece of {Tp} tokens is shorter than the {n} tokens a causal conv needs from "
                         f"its predecessor; use a longer sequence or a smaller cp")
    tails_J = x_BTC.view(B, J, Tp, C)[:, :, Tp - n:].transpose(0, 1)
    all_P = gather_pieces(tails_J, layout)
    prev_P = torch.cat([torch.zeros_like(all_P[:1]), all_P[:-1]])
    return prev_P[list(layout.pieces())]
