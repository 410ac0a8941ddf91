import json

import pytest
import torch

from moeadapt.data.dataset import PackedDataset, Sampler, encode_record, pack, read_jsonl
from moeadapt.data.tokenizer import ByteTokenizer


def test_chat_loss_only_on_assistant():
    tok = ByteTokenizer()
    rec = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    ids, mask = encode_record(rec, tok)
    assert tok.decode(ids) == "<|user|>hi<|end|><|assistant|>yo<|end|><eos>"
    learned = tok.decode([i for i, m in zip(ids, mask) if m])
    assert learned == "yo<|end|>"


def test_pack_shift_and_mask():
    tok = ByteTokenizer()
    recs = [{"text": "abcdefgh"}, {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}]
    x, y = pack(recs, tok, seq_len=4)
    flat_x, flat_y = x.flatten(), y.flatten()
    ids = [ord(c) for c in "abcdefgh"] + [tok.eos_id]
    assert flat_x[:8].tolist() == ids[:8]
    assert flat_y[:8].tolist() == ids[1:9]
    # the user turn is never a target
    assert (flat_y == ord("q")).sum() == 0


def test_bad_jsonl_is_named(tmp_path):
    p = tmp_path / "d.jsonl"
    p.write_text('{"text": "ok"}\n{broken\n')
    with pytest.raises(ValueError, match=r"d.jsonl:2: not valid JSON"):
        read_jsonl(str(p))
    p.write_text(json.dumps({"foo": 1}) + "\n")
    with pytest.raises(ValueError, match="needs a 'text' string or a 'messages' list"):
        read_jsonl(str(p))
    with pytest.raises(FileNotFoundError, match="no built-in dataset"):
        read_jsonl("builtin:nope")


def test_sampler_resume_is_exact():
    ds = PackedDataset(torch.arange(40).view(10, 4), torch.arange(40).view(10, 4))
    a = Sampler(ds, 3, seed=7)
    seq = [a.next()[0][:, 0].tolist() for _ in range(5)]
    b = Sampler(ds, 3, seed=7)
    for _ in range(2):
        b.next()
    c = Sampler(ds, 3, seed=7)
    c.load_state(b.state())
    assert [c.next()[0][:, 0].tolist() for _ in range(3)] == seq[2:]


def test_builtin_data_is_reproducible(tmp_path):
    from moeadapt.data.dataset import BUILTIN_DIR
    from moeadapt.data.synth import generate

    generate(tmp_path)
    for name in ("tinystories.jsonl", "recall_qa.jsonl"):
        assert (tmp_path / name).read_bytes() == (BUILTIN_DIR / name).read_bytes()


def _stream_positions(recs, tok, seq_len):
    """The expected position_ids and document-end flags, walking the joined token stream one token at a time."""
    start, end = [], []
    for r in recs:
        n = len(encode_record(r, tok)[0])
        start += [True] + [False] * (n - 1)
        end += [False] * (n - 1) + [True]
    rows = (len(start) - 1) // seq_len
    pos, c = [], 0
    for i in range(rows * seq_len):
        c = 0 if i % seq_len == 0 or start[i] else c + 1
        pos.append(c)
    return [pos[i * seq_len:(i + 1) * seq_len] for i in range(rows)], end[:rows * seq_len]


def test_pack_documents_gives_positions_per_document(seed):
    import random

    from moeadapt.data.dataset import pack_documents

    rng, tok = random.Random(seed), ByteTokenizer()
    recs = [{"text": "x" * rng.randint(0, 12)} if rng.random() < 0.7 else
            {"messages": [{"role": "user", "content": "q" * rng.randint(1, 5)},
                          {"role": "assistant", "content": "a" * rng.randint(1, 5)}]} for _ in range(30)]
    seq_len = rng.randint(5, 17)
    x, y, pos = pack_documents(recs, tok, seq_len)
    x0, y0 = pack(recs, tok, seq_len)
    want_pos, ends = _stream_positions(recs, tok, seq_len)
    assert torch.equal(x, x0) and pos.tolist() == want_pos
    # labels: pack's, and -100 at every document's last token (its target is the next document's first)
    ends_t = torch.tensor(ends).view(x.shape)
    assert bool((y[ends_t] == -100).all()) and torch.equal(y[~ends_t], y0[~ends_t])
    assert int(ends_t.sum()) > 3 and bool((y0[ends_t] != -100).any())  # the text documents' ends did take loss
    assert pack_documents(recs, tok, seq_len, boundaries=False)[2] is None


def test_take_rows_equals_indexing_for_index_tensors_and_slices(seed):
    """The sampler's row gather (index_select for index tensors) gives the rows advanced indexing gives."""
    from moeadapt.data.dataset import PackedDataset, take_rows

    rows, seq = int(torch.randint(3, 20, ())), int(torch.randint(1, 50, ()))
    t = torch.randint(0, 1000, (rows, seq))
    idx = torch.randperm(rows)[: int(torch.randint(1, rows + 1, ()))]
    assert torch.equal(take_rows(t, idx), t[idx])
    assert torch.equal(take_rows(t, slice(1, rows)), t[1:rows])
    x, y, extra = PackedDataset(t, t + 1).batch(idx)
    assert torch.equal(x, t[idx]) and torch.equal(y, t[idx] + 1) and extra == {}
