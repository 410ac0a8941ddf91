"""`builtin:shapes`: a procedurally generated image question-answering task (the vision-language demo's data).

Each 56 x 56 picture (4 image tokens for a patch-14 tower) holds 1-3 shapes of one kind (circle, square, triangle) and one colour (red, green, blue,
yellow) on a white background. Questions: colour, shape, count, and, for a single shape, left or right. The
answer is one word, so the chance level of a model that ignores the image is 1/4, 1/3, 1/3 and 1/2 per question
type (`meta.questions` lists each turn's). A record holds TURNS turns, each asking about its own picture. Generated deterministically (fixed seeds) on first use into
$MOEADAPT_CACHE/shapes-v5 (default ~/.cache/moeadapt) as PNG files plus `train.jsonl` / `eval.jsonl` in the
usual chat-with-images format, so the normal JSONL path reads them.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import tempfile
from pathlib import Path

COLOURS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220), "yellow": (235, 200, 20)}
KINDS = ("circle", "square", "triangle")
QUESTIONS = {  # short: on a CPU, every prompt byte is a token the tiny model pays for
    "colour": "Colour?",
    "shape": "Shape?",
    "count": "How many?",
    "position": "Left or right?",
}
CHANCE = {"colour": 1 / 4, "shape": 1 / 3, "count": 1 / 3, "position": 1 / 2}
SIZE, CELL = 56, 28  # a 2 x 2 grid of cells (one image token each for a patch-14 tower), one shape at most per cell
TURNS = 8  # question-answer turns per record, each about its own picture (more supervision per row)
SPLITS = {"train": (400, 1), "eval": (30, 2)}  # records, seed
VERSION = "shapes-v5"


def _draw(d, kind: str, cx: int, cy: int, r: int, rgb) -> None:
    box = [cx - r, cy - r, cx + r, cy + r]
    if kind == "circle":
        d.ellipse(box, fill=rgb)
    elif kind == "square":
        d.rectangle(box, fill=rgb)
    else:
        d.polygon([(cx, cy - r), (cx - r, cy + r), (cx + r, cy + r)], fill=rgb)


def make_sample(rng: random.Random):
    """-> (PIL image, question kind, question, answer)."""
    from PIL import Image, ImageDraw

    q = rng.choice(list(QUESTIONS))
    n = 1 if q == "position" else rng.randint(1, 3)
    colour, kind = rng.choice(list(COLOURS)), rng.choice(KINDS)
    cells = [(c, r) for r in range(2) for c in range(2)]
    if q == "position":
        side = rng.choice(("left", "right"))
        cells = [(0 if side == "left" else 1, rng.randrange(2))]
    else:
        cells = rng.sample(cells, n)
    img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    d = ImageDraw.Draw(img)
    for c, r in cells:
        rad = rng.randint(8, 11)
        cx = c * CELL + CELL // 2 + rng.randint(-2, 2)
        cy = r * CELL + CELL // 2 + rng.randint(-2, 2)
        _draw(d, kind, cx, cy, rad, COLOURS[colour])
    answer = {"colour": colour, "shape": kind, "count": str(n),
              "position": "left" if cells[0][0] == 0 else "right"}[q]
    return img, q, QUESTIONS[q], answer


def write_split(root: Path, split: str, n: int, seed: int, turns: int = TURNS) -> None:
    """n records of `turns` user/assistant turns; each user turn asks about a new picture."""
    rng = random.Random(seed)
    (root / split).mkdir(parents=True, exist_ok=True)
    with (root / f"{split}.jsonl").open("w") as f:
        for i in range(n):
            msgs, kinds = [], []
            for j in range(turns):
                img, q, text, ans = make_sample(rng)
                rel = f"{split}/{i:05d}_{j}.png"
                img.save(root / rel)
                # question first, picture last: its tokens sit right before the answer (read sooner by a tiny model)
                msgs += [{"role": "user", "content": [{"type": "text", "text": text}, {"type": "image", "image": rel}]},
                         {"role": "assistant", "content": ans}]
                kinds.append(q)
            f.write(json.dumps({"messages": msgs, "meta": {"questions": kinds}}) + "\n")


def cache_root() -> Path:
    return Path(os.environ.get("MOEADAPT_CACHE", Path.home() / ".cache" / "moeadapt")) / VERSION


def ensure_shapes() -> Path:
    """Generate the task once; concurrent callers (several ranks) race safely: the first rename wins."""
    final = cache_root()
    if (final / "eval.jsonl").is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{VERSION}.tmp-", dir=final.parent))
    try:
        for split, (n, seed) in SPLITS.items():
            write_split(tmp, split, n, seed)
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def builtin_shapes(name: str) -> Path:
    """`builtin:shapes` (train split) or `builtin:shapes-eval` -> the JSONL file."""
    split = {"builtin:shapes": "train", "builtin:shapes-eval": "eval"}.get(name)
    if split is None:
        raise FileNotFoundError(f"no built-in image dataset {name!r}; available: builtin:shapes, builtin:shapes-eval")
    return ensure_shapes() / f"{split}.jsonl"
