"""JSONL datasets, packing and a resumable sampler.

Records are `{"text": "..."}` (loss on every token) or `{"messages": [{"role", "content"}, ...]}`
(loss only on assistant turns). Documents are tokenised, joined with <eos> and packed into rows of
seq_len + 1 tokens; row i gives input = row[:-1], labels = row[1:] with -100 where no loss is taken.
`builtin:NAME` reads `moeadapt/data/builtin/NAME.jsonl`, which ships with the package.
`pack_documents` (data.pack_documents: true) packs the same rows and also gives each token's position inside
its document (position_ids, 0 at a document start and at every row start): the model then keeps the documents
of a row apart (models/documents.py), and the last token of a document takes no loss (its target, the next
document's first token, is not visible to it).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

BUILTIN_DIR = Path(__file__).parent / "builtin"


def resolve_path(path: str) -> Path:
    if path.startswith("builtin:"):
        p = BUILTIN_DIR / f"{path.removeprefix('builtin:')}.jsonl"
        if not p.is_file():
            names = sorted(q.stem for q in BUILTIN_DIR.glob("*.jsonl"))
            raise FileNotFoundError(f"no built-in dataset {path!r}; available: {['builtin:' + n for n in names]}")
        return p
    p = Path(path)
    if p.is_dir():
        raise ValueError(f"data path {p} is a directory; give a .jsonl file (one JSON record per line)")
    if not p.is_file():
        raise FileNotFoundError(f"data file {p} does not exist")
    return p


def _check_record(rec, where: str) -> None:
    """The record's shape, with the place and the fix (a wrong type would fail deep in the tokenizer)."""
    if not isinstance(rec, dict) or not ("text" in rec or "messages" in rec):
        raise ValueError(f"{where}: each record needs a 'text' string or a 'messages' list")
    if "text" in rec and not isinstance(rec["text"], str):
        raise ValueError(f"{where}: 'text' is a {type(rec['text']).__name__}, not a string; quote it")
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: 'messages' must be a non-empty list of {{\"role\", \"content\"}} objects, "
                             f"got {type(msgs).__name__}")
        for j, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: messages[{j}] needs a string 'role' and a string 'content', got {m!r:.80}")
            if m["role"] not in ("system", "user", "assistant"):
                raise ValueError(f"{where}: messages[{j}] has role {m['role']!r}; use 'system', 'user' or 'assistant'")


def iter_jsonl(p: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of every non-empty line of a JSONL file; one error naming file:line for a
    line that is not UTF-8 or not valid JSON (the caller checks what the value must be)."""
    with p.open("rb") as f:
        for i, raw in enumerate(f, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{p}:{i}: not UTF-8 text (byte {raw[e.start]:#04x} at column {e.start + 1}); "
                                 "convert the file to UTF-8") from None
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{i}: not valid JSON ({e.msg}); each line must be one JSON object") from None
            yield i, rec


def read_jsonl(path: str) -> list[dict]:
    p = resolve_path(path)
    out = []
    for i, rec in iter_jsonl(p):
        _check_record(rec, f"{p}:{i}")
        out.append(rec)
    if not out:
        raise ValueError(f"{p} holds no records")
    return out


def check_targets(ds: PackedDataset, source: str) -> None:
    """A dataset with no token to predict would train and evaluate at loss 0: refuse it, naming the source."""
    if not bool((ds.labels != -100).any()):
        raise ValueError(f"{source} has no target tokens (chat records without an assistant turn, or all loss "
                         "masked); add assistant messages, or use text records / data.format: text")


def encode_record(rec: dict, tok, fmt: str = "auto") -> tuple[list[int], list[bool]]:
    """Token ids and a per-token loss flag (True = predict this token)."""
    kind = fmt if fmt != "auto" else ("chat" if "messages" in rec else "text")
    if kind == "text":
        if "text" not in rec:
            raise ValueError("data.format is 'text' but a record has no 'text' field")
        ids = tok.encode(rec["text"]) + [tok.eos_id]
        return ids, [True] * len(ids)
    if "messages" not in rec:
        raise ValueError("data.format is 'chat' but a record has no 'messages' field")
    ids, mask = [], []
    for m in rec["messages"]:
        body = tok.encode(m["content"]) + [tok.end_id]
        ids += [tok.role_id(m["role"])] + body
        learn = m["role"] == "assistant"
        mask += [False] + [learn] * len(body)
    ids.append(tok.eos_id)
    mask.append(False)
    return ids, mask


def pack(records: list[dict], tok, seq_len: int, fmt: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """-> inputs [N, seq_len], labels [N, seq_len] (int64; labels -100 where no loss)."""
    return pack_documents(records, tok, seq_len, fmt, boundaries=False)[:2]


def _encode_all(records: list[dict], tok, fmt: str) -> tuple[list[int], list[bool], list[int]]:
    """Every record's tokens and loss flags joined, and where each document starts."""
    ids, mask, starts = [], [], []
    for rec in records:
        i, m = encode_record(rec, tok, fmt)
        starts.append(len(ids))
        ids += i
        mask += m
    return ids, mask, starts


def pack_documents(records: list[dict], tok, seq_len: int, fmt: str = "auto", boundaries: bool = True
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """-> inputs, labels, position_ids [N, seq_len] (int64). position_ids: each token's position inside its
    document, restarting at 0 at every document start and at every row start (the part of a document that
    runs into the next row is a document of that row); labels: -100 where no loss, and at each document's
    last token (its target starts the next document). boundaries=False: `pack`'s rows, position_ids None."""
    ids, mask, starts = _encode_all(records, tok, fmt)
    n = (len(ids) - 1) // seq_len
    if n < 1:
        raise ValueError(f"the data holds {len(ids)} tokens, fewer than one row of seq_len={seq_len}; "
                         "add data or lower train.seq_len")
    ids_t = torch.tensor(ids[: n * seq_len + 1], dtype=torch.long)
    mask_t = torch.tensor(mask[: n * seq_len + 1], dtype=torch.bool)
    inputs = ids_t[:-1].view(n, seq_len)
    labels = ids_t[1:].clone()
    labels[~mask_t[1:]] = -100
    if not boundaries:
        return inputs, labels.view(n, seq_len), None
    first = torch.zeros(n * seq_len + 1, dtype=torch.bool)
    first[[s for s in starts if s <= n * seq_len]] = True
    labels[first[1:]] = -100  # the token before a document start
    first = first[:-1].view(n, seq_len)
    first[:, 0] = True
    t = torch.arange(seq_len).expand(n, seq_len)
    last_start = torch.where(first, t, 0).cummax(1).values  # the start of each token's document in its row
    return inputs, labels.view(n, seq_len), t - last_start


@dataclass
class PackedDataset:
    inputs: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor | None = None  # packed documents (pack_documents), else one document per row

    def batch(self, idx) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Rows `idx` (a tensor of indices or a slice): inputs, labels and the model's other inputs."""
        extra = {} if self.position_ids is None else {"position_ids": take_rows(self.position_ids, idx)}
        return take_rows(self.inputs, idx), take_rows(self.labels, idx), extra

    def __len__(self) -> int:
        return self.inputs.shape[0]


def take_rows(t: torch.Tensor, idx) -> torch.Tensor:
    """t's rows `idx` (an index tensor or a slice). An index tensor goes through index_select: advanced indexing
    (`t[idx]`, aten::index) of a few rows of a host tensor took 5-16 ms of host time per call in the trainer's
    step (its parallel CPU kernel; index_select takes a few µs), once per step for the inputs and once for the
    labels."""
    return t.index_select(0, idx) if isinstance(idx, torch.Tensor) else t[idx]


class Sampler:
    """Deterministic shuffled batches over epochs; `state()` / `load_state()` resume exactly."""

    def __init__(self, ds: PackedDataset, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        if len(ds) < batch_size * world:
            raise ValueError(f"the dataset packs into {len(ds)} rows, fewer than micro_batch_size x ranks = "
                             f"{batch_size * world}; lower train.micro_batch_size or train.seq_len")
        self.ds, self.bs, self.seed, self.rank, self.world = ds, batch_size, seed, rank, world
        self.epoch, self.pos = 0, 0
        self._perm = self._make_perm()

    def _make_perm(self) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1000003 + self.epoch)
        return torch.randperm(len(self.ds), generator=g)

    def next_indices(self) -> torch.Tensor:
        """This rank's rows of the next global batch (a new epoch's permutation when the data runs out)."""
        step = self.bs * self.world
        if self.pos + step > len(self.ds):
            self.epoch, self.pos = self.epoch + 1, 0
            self._perm = self._make_perm()
        idx = self._perm[self.pos + self.rank * self.bs: self.pos + (self.rank + 1) * self.bs]
        self.pos += step
        return idx

    def next(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """inputs, labels [B, T] and the model's other inputs ({"position_ids": ...} for packed documents)."""
        return self.ds.batch(self.next_indices())

    def state(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos, "seed": self.seed}

    def load_state(self, s: dict) -> None:
        self.epoch, self.pos = int(s["epoch"]), int(s["pos"])
        self._perm = self._make_perm()


def build_datasets(data_spec, tok, seq_len: int, seed: int) -> tuple[PackedDataset, PackedDataset]:
    """Train and eval sets; without `data.eval`, the last `eval_fraction` of records are held out."""
    recs = read_jsonl(data_spec.train)
    if data_spec.eval:
        ev = read_jsonl(data_spec.eval)
    else:
        n_ev = max(1, int(len(recs) * data_spec.eval_fraction))
        if n_ev >= len(recs):
            raise ValueError(f"{data_spec.train} has too few records ({len(recs)}) to hold out an eval split; "
                             "set data.eval")
        recs, ev = recs[:-n_ev], recs[-n_ev:]
    docs = data_spec.pack_documents
    train_ds = PackedDataset(*pack_documents(recs, tok, seq_len, data_spec.format, boundaries=docs))
    eval_ds = PackedDataset(*pack_documents(ev, tok, seq_len, data_spec.format, boundaries=docs))
    check_targets(train_ds, data_spec.train)
    check_targets(eval_ds, data_spec.eval or f"the held-out end of {data_spec.train}")
    return train_ds, eval_ds
