"""Packed documents: which tokens of a batch row belong together, and the varlen KDA run the layers share.

A packed row holds several documents back to back. `position_ids` [B, T] give each token's position inside its
document: 0 at a document's first token, +1 per token after it (the form of transformers' packed batches and of
`data.dataset.pack_documents`; every row starts a document). `Documents.from_position_ids` turns them, once per
forward, into what the layers need:
  * RoPE positions: the ids themselves (they restart at every document start);
  * the short causal convs' reach: a token sees only its min(position, kernel - 1) predecessors;
  * cu_seqlens for the varlen KDA / DSA ops, on the host (no device sync to read them): per row over the whole
    sequence (under context parallelism, the global boundaries that ops/kda/cp.py and ops/dsa/cp.py take), and
    over the flattened batch (one process: B rows run as one packed row of B * T tokens);
  * document ids per token (GQA's block-diagonal causal mask).
Under context parallelism each rank holds its pieces of position_ids (split like input_ids, `layout.split`); the
rows' global ids are gathered once over the cp group. Owns no parameters; knows nothing about meshes.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from ..ops.dsa.cp import gather_sequence
from ..ops.host import to_device
from ..ops.kda import chunk_kda
from ..ops.kda.cp import chunk_kda_cp


@dataclass(frozen=True)
class Documents:
    position_ids: torch.Tensor  # [B, T_local] int64: each local token's position inside its document
    doc_ids: torch.Tensor  # [B, T_local] int64: the index of each local token's document in its row
    cu_rows: tuple[torch.Tensor, ...]  # per row, [N_b + 1] int64 boundaries over the row's whole sequence (host)
    seq_len: int  # T of the whole sequence (T_local x cp)

    @classmethod
    def from_position_ids(cls, position_ids: torch.Tensor, seq_len: int, layout=None,
                          device: torch.device | str | None = None) -> Documents:
        """position_ids: this rank's [B, T_local] (the whole rows without context parallelism), on the host or on
        the device; layout: the model's ops.cp_comm.CPLayout or None; device: where the layers run (default:
        position_ids'). One clear error when they do not describe packed documents.
        Host syncs: none when position_ids come on the host without context parallelism (the trainer passes
        them so); one device read otherwise (the ids, gathered over the cp group). The boundaries stay on the
        host (the ops read them there for free, ops/host.py); position and document ids go to the device
        without a wait."""
        if position_ids.dim() != 2 or position_ids.dtype.is_floating_point or position_ids.dtype == torch.bool:
            raise ValueError(f"position_ids must be an integer tensor [B, T] like input_ids, got "
                             f"{position_ids.dtype} {list(position_ids.shape)}")
        device = position_ids.device if device is None else torch.device(device)
        pos = position_ids.long()
        if layout is not None and layout.size > 1:
            with torch.no_grad():
                whole = gather_sequence(to_device(pos, device), layout).cpu()
        else:
            whole = pos.cpu()
        bad = torch.zeros_like(whole, dtype=torch.bool)
        bad[:, 0] = whole[:, 0] != 0
        bad[:, 1:] = (whole[:, 1:] != 0) & (whole[:, 1:] != whole[:, :-1] + 1)
        if bool(bad.any()):
            b, t = (int(i) for i in bad.nonzero()[0])
            was = f"{int(whole[b, t - 1])} -> {int(whole[b, t])}" if t else f"{int(whole[b, 0])}"
            raise ValueError(f"position_ids row {b} token {t}: {was}; packed documents' position_ids count 0, 1, "
                             "2, ... from each document's first token, and every row starts at 0 (as "
                             "data.pack_documents gives them)")
        starts = whole == 0
        doc_ids = starts.long().cumsum(1) - 1
        if layout is not None and layout.size > 1:
            doc_ids = layout.split(doc_ids)
        end = torch.tensor([whole.shape[1]])
        cu_rows = tuple(torch.cat([s.nonzero()[:, 0], end]) for s in starts)
        return cls(to_device(pos, device), to_device(doc_ids, device), cu_rows, seq_len)

    @cached_property
    def flat_cu_seqlens(self) -> torch.Tensor:
        """Boundaries [N + 1] (host) of every document of the batch with the rows laid end to end (B * T
        tokens); computed once per forward, read by every layer."""
        T = self.seq_len
        return torch.cat([cu[:-1] + b * T for b, cu in enumerate(self.cu_rows)]
                         + [self.cu_rows[0].new_tensor([len(self.cu_rows) * T])])

    def chunk(self, n: int) -> list[Documents]:
        """The documents of n equal groups of rows (micro-batches stacked along B)."""
        B = self.position_ids.shape[0]
        k = B // n
        return [Documents(self.position_ids[i * k:(i + 1) * k], self.doc_ids[i * k:(i + 1) * k],
                          self.cu_rows[i * k:(i + 1) * k], self.seq_len) for i in range(n)]


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [1, B * T, ...]: the rows as one packed row (the varlen ops' layout)."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def run_kda(q, k, v, g, beta, docs: Documents | None, layout=None, **opts) -> torch.Tensor:
    """o [B, T, HV, V] of `chunk_kda` (or `chunk_kda_cp` under `layout`), every document from a zero state.
    With packed documents, one process runs the batch as one varlen row; under context parallelism each row
    runs with its global boundaries (the state exchange stops at a document start)."""
    if docs is None:
        return chunk_kda_cp(q, k, v, g, beta, layout, **opts) if layout is not None else chunk_kda(
            q, k, v, g, beta, **opts)[0]
    if layout is None:
        o, _ = chunk_kda(*(flat_rows(t) for t in (q, k, v, g, beta)), cu_seqlens=docs.flat_cu_seqlens, **opts)
        return o.view(v.shape)
    return torch.cat([chunk_kda_cp(q[b:b + 1], k[b:b + 1], v[b:b + 1], g[b:b + 1], beta[b:b + 1], layout,
                                   cu_seqlens=cu, **opts) for b, cu in enumerate(docs.cu_rows)])
