"""Image + text samples: JSONL in the HF chat / ms-swift / LLaMA-Factory convention, Pillow decoding, resizing
to a pixel budget, placeholder expansion, assistant-only loss, batches of rows with their packed images.

Records (one JSON object per line; image paths relative to the JSONL file's directory, or absolute):
  {"messages": [{"role": "user", "content": [{"type": "image", "image": "a.png"}, {"type": "text", "text": "..."}]},
                {"role": "assistant", "content": "..."}]}
  {"messages": [{"role": "user", "content": "<image>What is it?"}, ...], "images": ["a.png"]}   (swift / LLaMA-Factory)
Every image becomes (H / patch / 2) * (W / patch / 2) placeholder tokens (`vision.image_token_id`) after it is
resized, aspect kept, to H x W multiples of patch_size * merge_size within [min_pixels, max_pixels]. Loss is
taken on assistant text only. One record = one row of seq_len tokens (right-padded, padding has no loss); image
tokens are never split across rows. Each image is fully decoded once when the dataset is built, so a missing,
unreadable or truncated file stops the run there with one error naming the JSONL line and the file (or, with
`data.skip_bad_images`, drops the record and counts it); batches decode again when they are drawn.
Owns: no model code. The packed patch order is models/vision's `patchify`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..config import DataSpec, VisionSpec
from ..models.vision import ImageBatch, patchify
from .dataset import take_rows

IMAGE_MARK = "<image>"


class ImageError(ValueError):
    """An image of a record cannot be used; the message names the JSONL line and the file."""


def resize_for_budget(h: int, w: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """(H, W): multiples of `factor`, aspect ratio kept as far as rounding allows, min_pixels <= H*W <= max_pixels.
    Where both cannot hold (a budget narrower than one rounding step), max_pixels wins; a side never goes below
    one tile of `factor` pixels."""
    if min(h, w) < 1:
        raise ValueError(f"image of {h} x {w} pixels is empty")
    if max(h, w) / min(h, w) > 50:
        raise ValueError(f"image of {h} x {w} pixels has an aspect ratio above 50; crop it")
    H, W = max(factor, round(h / factor) * factor), max(factor, round(w / factor) * factor)
    if H * W > max_pixels:
        s = math.sqrt(h * w / max_pixels)
        H, W = max(factor, math.floor(h / s / factor) * factor), max(factor, math.floor(w / s / factor) * factor)
    elif H * W < min_pixels:
        s = math.sqrt(min_pixels / (h * w))
        H, W = math.ceil(h * s / factor) * factor, math.ceil(w * s / factor) * factor
    return H, W


def load_image(path: Path):
    """Decode fully (a truncated file fails here, not mid-epoch) and convert to RGB. Raises OSError / ValueError."""
    from PIL import Image

    with Image.open(path) as im:
        im.load()
        return im.convert("RGB")


def image_to_patches(img, vspec: VisionSpec, min_pixels: int, max_pixels: int) -> tuple[torch.Tensor, tuple[int, int]]:
    """A PIL image -> (patches [N, 3 * p * p] in the packed order, (grid rows, grid cols) in patches)."""
    from PIL import Image

    p, f = vspec.patch_size, vspec.patch_size * vspec.merge_size
    H, W = resize_for_budget(img.height, img.width, f, min_pixels, max_pixels)
    if (img.width, img.height) != (W, H):
        img = img.resize((W, H), Image.Resampling.BICUBIC)
    x = torch.frombuffer(bytearray(img.tobytes()), dtype=torch.uint8).view(H, W, 3).permute(2, 0, 1).float() / 255
    mean, std = torch.tensor(vspec.image_mean).view(3, 1, 1), torch.tensor(vspec.image_std).view(3, 1, 1)
    return patchify((x - mean) / std, p, vspec.merge_size), (H // p, W // p)


def _parts(rec: dict, where: str) -> list[tuple[str, list[tuple[str, str]]]]:
    """-> [(role, [("text", s) | ("image", path), ...]), ...] from either record convention."""
    msgs = rec.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise ValueError(f"{where}: a multimodal record needs a non-empty 'messages' list")
    pool = list(rec.get("images") or [])
    out = []
    for m in msgs:
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ValueError(f"{where}: each message needs 'role' and 'content'")
        c, parts = m["content"], []
        if isinstance(c, str):
            for i, piece in enumerate(c.split(IMAGE_MARK)):
                if i:
                    if not pool:
                        raise ValueError(f"{where}: more {IMAGE_MARK} markers than entries in 'images'")
                    parts.append(("image", str(pool.pop(0))))
                if piece:
                    parts.append(("text", piece))
        elif isinstance(c, list):
            for part in c:
                kind = part.get("type") if isinstance(part, dict) else None
                if kind == "text":
                    parts.append(("text", str(part.get("text", ""))))
                elif kind == "image":
                    src = part.get("image") or part.get("path")
                    if not isinstance(src, str):
                        raise ValueError(f"{where}: an image part needs an 'image' path string")
                    parts.append(("image", src))
                else:
                    raise ValueError(f"{where}: content part {part!r} is not {{'type': 'text'|'image', ...}}")
        else:
            raise ValueError(f"{where}: 'content' must be a string or a list of parts")
        out.append((m["role"], parts))
    if pool:
        raise ValueError(f"{where}: 'images' lists {len(pool)} more image(s) than the {IMAGE_MARK} markers use")
    return out


def _image_path(src: str, base: Path, where: str) -> Path:
    if "://" in src:
        raise ImageError(f"{where}: image {src!r} is a URL; download it and give a local path")
    p = Path(src)
    return p if p.is_absolute() else base / p


def _check_image(path: Path, where: str) -> tuple[int, int]:
    """Decode the whole file once; -> (height, width)."""
    if not path.is_file():
        raise ImageError(f"{where}: image file {path} does not exist")
    try:
        im = load_image(path)
        return im.height, im.width
    except Exception as e:  # PIL raises UnidentifiedImageError, OSError ("truncated"), SyntaxError, ...
        raise ImageError(f"{where}: image file {path} cannot be decoded ({type(e).__name__}: {e}); "
                         "replace or remove it, or set data.skip_bad_images: true") from None


@dataclass
class Sample:
    ids: list[int]
    mask: list[bool]  # True = predict this token
    images: list[Path]
    where: str


def encode_mm_record(rec: dict, tok, vspec: VisionSpec, base: Path, where: str, min_pixels: int,
                     max_pixels: int) -> Sample:
    """Token ids with one placeholder per image token, the loss mask (assistant text + its end token), image
    paths in order. Every image is decoded here (size -> number of tokens)."""
    ids, mask, paths = [], [], []
    f = vspec.patch_size * vspec.merge_size
    for role, parts in _parts(rec, where):
        learn = role == "assistant"
        ids.append(tok.role_id(role))
        mask.append(False)
        for kind, val in parts:
            if kind == "text":
                t = tok.encode(val)
                ids += t
                mask += [learn] * len(t)
            else:
                path = _image_path(val, base, where)
                H, W = resize_for_budget(*_check_image(path, where), f, min_pixels, max_pixels)
                n = (H // f) * (W // f)
                ids += [vspec.image_token_id] * n
                mask += [False] * n
                paths.append(path)
        ids.append(tok.end_id)
        mask.append(learn)
    ids.append(tok.eos_id)
    mask.append(False)
    return Sample(ids, mask, paths, where)


@dataclass
class MultimodalDataset:
    """Rows inputs / labels [N, seq_len] (like PackedDataset) plus each row's images (decoded on demand)."""

    inputs: torch.Tensor
    labels: torch.Tensor
    images: list[list[Path]]
    vspec: VisionSpec
    min_pixels: int
    max_pixels: int
    skipped: list[str] = field(default_factory=list)  # "file:line: reason" of records dropped (skip_bad_images)
    meta: list[dict] = field(default_factory=list)  # each row's record["meta"] ({} if none), e.g. the question type

    def __len__(self) -> int:
        return self.inputs.shape[0]

    def image_batch(self, rows) -> ImageBatch | None:
        pix, grids = [], []
        for r in (rows.tolist() if torch.is_tensor(rows) else list(rows)):
            for path in self.images[r]:
                px, g = image_to_patches(load_image(path), self.vspec, self.min_pixels, self.max_pixels)
                pix.append(px)
                grids.append(g)
        if not pix:
            return None
        return ImageBatch(torch.cat(pix), torch.tensor(grids, dtype=torch.long))

    def rows(self, idx) -> tuple[torch.Tensor, torch.Tensor, ImageBatch | None]:
        return take_rows(self.inputs, idx), take_rows(self.labels, idx), self.image_batch(idx)


def read_mm_jsonl(path: str) -> tuple[Path, list[tuple[int, dict]]]:
    """(the file, [(line number, record)]); `builtin:shapes...` is generated on first use (data/shapes.py)."""
    from .dataset import iter_jsonl, resolve_path

    if path.startswith("builtin:shapes"):
        from .shapes import builtin_shapes

        p = builtin_shapes(path)
    else:
        p = resolve_path(path)
    out = list(iter_jsonl(p))
    for i, rec in out:
        if not isinstance(rec, dict):
            raise ValueError(f"{p}:{i}: each line must be one JSON object")
    if not out:
        raise ValueError(f"{p} holds no records")
    return p, out


def build_mm_dataset(path: str, tok, vspec: VisionSpec, seq_len: int, data: DataSpec) -> MultimodalDataset:
    p, recs = read_mm_jsonl(path)
    rows, skipped, meta = [], [], []
    for line, rec in recs:
        where = f"{p}:{line}"
        try:
            s = encode_mm_record(rec, tok, vspec, p.parent, where, data.min_pixels, data.max_pixels)
        except ImageError as e:
            if not data.skip_bad_images:
                raise
            skipped.append(str(e))
            continue
        if len(s.ids) - 1 > seq_len:
            n_img = sum(1 for t in s.ids if t == vspec.image_token_id)
            raise ValueError(f"{where}: the record is {len(s.ids) - 1} tokens ({n_img} of them image tokens), more "
                             f"than train.seq_len={seq_len}; raise train.seq_len or lower data.max_pixels")
        rows.append(s)
        meta.append(rec.get("meta") if isinstance(rec.get("meta"), dict) else {})
    if not rows:
        raise ValueError(f"{p}: no usable records ({len(skipped)} skipped for bad images)")
    n = len(rows)
    inputs = torch.full((n, seq_len), tok.pad_id, dtype=torch.long)
    labels = torch.full((n, seq_len), -100, dtype=torch.long)
    for r, s in enumerate(rows):
        ids, m = torch.tensor(s.ids), torch.tensor(s.mask)
        L = len(s.ids) - 1
        inputs[r, :L] = ids[:-1]
        labels[r, :L] = torch.where(m[1:], ids[1:], torch.full_like(ids[1:], -100))
    return MultimodalDataset(inputs, labels, [s.images for s in rows], vspec, data.min_pixels, data.max_pixels,
                             skipped, meta)


def build_mm_datasets(data: DataSpec, tok, vspec: VisionSpec, seq_len: int) -> tuple[MultimodalDataset, MultimodalDataset]:
    """Train and eval sets; without `data.eval`, the last `eval_fraction` of the records are held out."""
    full = build_mm_dataset(data.train, tok, vspec, seq_len, data)
    if data.eval:
        return full, build_mm_dataset(data.eval, tok, vspec, seq_len, data)
    n_ev = max(1, int(len(full) * data.eval_fraction))
    if n_ev >= len(full):
        raise ValueError(f"{data.train} has too few records ({len(full)}) to hold out an eval split; set data.eval")
    k = len(full) - n_ev

    def part(sl: slice) -> MultimodalDataset:
        return MultimodalDataset(full.inputs[sl], full.labels[sl], full.images[sl], vspec, full.min_pixels,
                                 full.max_pixels, full.skipped if sl.start is None else [], full.meta[sl])

    return part(slice(None, k)), part(slice(k, None))


class MultimodalSampler:
    """The text Sampler's order (deterministic shuffle per epoch, rank slices, resumable) over multimodal rows;
    `next()` -> (inputs [B, T], labels [B, T], {"images": ImageBatch | None}), the text Sampler's form."""

    def __init__(self, ds: MultimodalDataset, batch_size: int, seed: int, rank: int = 0, world: int = 1):
        from .dataset import Sampler

        self._order = Sampler(ds, batch_size, seed, rank, world)
        self.ds = ds

    def next(self) -> tuple[torch.Tensor, torch.Tensor, dict]:
        x, y, images = self.ds.rows(self._order.next_indices())
        return x, y, {"images": images}

    def state(self) -> dict:
        return self._order.state()

    def load_state(self, st: dict) -> None:
        self._order.load_state(st)
