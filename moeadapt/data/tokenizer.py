"""Tokenizers: a built-in byte-level tokenizer (no files needed) and HF `tokenizers` when a model directory
ships tokenizer.json.

Byte tokenizer: ids 0-255 are bytes; then <bos>, <eos>, <pad>, and the chat markers <|user|>,
<|assistant|>, <|system|>, <|end|>, and the image placeholder <|image|> (263; one per image token of a
vision-language model, see data/multimodal.py). Vocabulary 264 (the `tiny` preset's vocab_size).
"""

from __future__ import annotations

from pathlib import Path

SPECIALS = ["<bos>", "<eos>", "<pad>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>", "<|image|>"]


class ByteTokenizer:
    vocab_size = 256 + len(SPECIALS)

    def __init__(self):
        self.special = {s: 256 + i for i, s in enumerate(SPECIALS)}
        self.bos_id, self.eos_id, self.pad_id = self.special["<bos>"], self.special["<eos>"], self.special["<pad>"]

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        inv = {v: k for k, v in self.special.items()}
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
            else:
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(inv.get(i, ""))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def role_id(self, role: str) -> int:
        key = f"<|{role}|>"
        if key not in self.special:
            raise ValueError(f"unknown chat role {role!r}; use 'system', 'user' or 'assistant'")
        return self.special[key]

    @property
    def end_id(self) -> int:
        return self.special["<|end|>"]

    @property
    def image_id(self) -> int:
        return self.special["<|image|>"]


class HFTokenizer:
    """Wraps `tokenizers.Tokenizer` from a tokenizer.json (optional dependency)."""

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer
        except ImportError as e:
            raise ImportError("this model ships tokenizer.json; install the `tokenizers` package to use it") from e
        p = Path(path)
        f = p / "tokenizer.json" if p.is_dir() else p
        if not f.is_file():
            raise FileNotFoundError(f"tokenizer {f} does not exist; set data.tokenizer to 'byte', 'auto' or a path "
                                    "holding tokenizer.json")
        try:
            self.tok = Tokenizer.from_file(str(f))
        except Exception as e:  # noqa: BLE001 - the tokenizers library raises plain Exception
            raise ValueError(f"{f} is not a readable tokenizer.json ({' '.join(str(e).split())[:200]})") from None
        self.vocab_size = self.tok.get_vocab_size()
        vocab = self.tok.get_vocab()

        def find(*names):
            return next((vocab[n] for n in names if n in vocab), None)

        self.bos_id = find("<bos>", "<s>", "<|begin_of_text|>", "<｜begin▁of▁sentence｜>")
        self.eos_id = find("<eos>", "</s>", "<|end_of_text|>", "<|endoftext|>", "<｜end▁of▁sentence｜>")
        self.pad_id = find("<pad>", "<|pad|>") or self.eos_id
        self._roles = {r: find(f"<|{r}|>", f"<|im_start|>{r}") for r in ("user", "assistant", "system")}
        self._end = find("<|end|>", "<|im_end|>")

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids)

    def role_id(self, role: str) -> int:
        rid = self._roles.get(role)
        if rid is None:
            raise ValueError(f"tokenizer.json has no token for chat role {role!r}")
        return rid

    @property
    def end_id(self) -> int:
        if self._end is None:
            raise ValueError("tokenizer.json has no end-of-turn token (<|end|> or <|im_end|>)")
        return self._end


def get_tokenizer(name: str = "byte", model_dir: str | Path | None = None):
    """'auto' takes the model directory's tokenizer.json when it has one, else the byte tokenizer."""
    if name == "auto":
        if model_dir is not None and (Path(model_dir) / "tokenizer.json").is_file():
            return HFTokenizer(model_dir)
        return ByteTokenizer()
    if name == "byte":
        return ByteTokenizer()
    return HFTokenizer(name)
