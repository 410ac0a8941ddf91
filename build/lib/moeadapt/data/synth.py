"""The built-in data, generated procedurally (no downloads), so the demo is reproducible end to end.

- `tinystories`: short simple stories (plain text) - what the tiny base model is pre-trained on.
- `recall_qa`: chat records: a few facts, then a question about one of them; the assistant answers with
  the fact. The base model never sees the chat markers or this task, so a LoRA fine-tune on it is a
  clean test that fine-tuning works (eval loss on held-out records before vs after).
Regenerate with `python -m moeadapt.data.synth`; the files are byte-identical for the same seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ["Lily", "Tom", "Mia", "Ben", "Sara", "Max", "Anna", "Leo", "Zoe", "Sam", "Nora", "Finn", "Ella", "Jack",
         "Ruby", "Omar", "Ivy", "Noah", "Maya", "Eli"]
ANIMALS = ["cat", "dog", "bird", "fox", "frog", "duck", "bunny", "bear", "mouse", "fish"]
COLORS = ["red", "blue", "green", "yellow", "pink", "purple", "orange", "white", "black", "brown"]
THINGS = ["ball", "kite", "hat", "box", "book", "cup", "car", "boat", "drum", "sock"]
PLACES = ["park", "garden", "forest", "beach", "kitchen", "school", "farm", "river", "hill", "shop"]
FEELINGS = ["happy", "sad", "sleepy", "hungry", "brave", "scared", "excited", "tired", "proud", "calm"]
VERBS = ["played", "ran", "walked", "jumped", "sang", "danced", "read", "slept", "laughed", "looked"]


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def _story(r: random.Random) -> str:
    n1, n2 = r.sample(NAMES, 2)
    a, c, t, p, f = r.choice(ANIMALS), r.choice(COLORS), r.choice(THINGS), r.choice(PLACES), r.choice(FEELINGS)
    v = r.choice(VERBS)
    he = r.choice(["He", "She"])
    parts = [
        f"Once upon a time, there was {_a(r.choice(FEELINGS))} {a} named {n1}.",
        f"{n1} had {_a(c)} {t}.",
        f"One day, {n1} went to the {p} with {n2}.",
        f"They {v} all day and felt {f}.",
        r.choice([f"{he} liked the {c} {t} very much.", f"{n2} wanted to play with the {t} too.",
                  f"The sun was warm and the sky was {r.choice(['blue', 'clear', 'bright'])}."]),
        r.choice([f"At the end of the day, {n1} and {n2} went home.", f"{n1} said, \"I love the {p}!\"",
                  f"Then they {r.choice(VERBS)} again, and everyone was {r.choice(FEELINGS)}."]),
    ]
    k = r.randint(4, len(parts))
    return " ".join(parts[:k])


def _qa(r: random.Random) -> dict:
    names = r.sample(NAMES, 3)
    facts = [(n, r.choice(COLORS), r.choice(THINGS), r.choice(PLACES)) for n in names]
    ctx = " ".join(f"{n} has {_a(c)} {t} at the {p}." for n, c, t, p in facts)
    n, c, t, p = r.choice(facts)
    kind = r.randrange(3)
    if kind == 0:
        q, a = f"What does {n} have?", f"{n} has {_a(c)} {t}."
    elif kind == 1:
        q, a = f"Where is the {t} of {n}?", f"It is at the {p}."
    else:
        q, a = f"What color is the {t} of {n}?", f"It is {c}."
    return {"messages": [{"role": "user", "content": f"{ctx} {q}"}, {"role": "assistant", "content": a}]}


def generate(out_dir: Path | None = None, seed: int = 1234, n_stories: int = 12000, n_qa: int = 3000) -> None:
    out_dir = Path(out_dir or Path(__file__).parent / "builtin")
    out_dir.mkdir(parents=True, exist_ok=True)
    r = random.Random(seed)
    with (out_dir / "tinystories.jsonl").open("w") as f:
        for _ in range(n_stories):
            f.write(json.dumps({"text": _story(r)}) + "\n")
    r = random.Random(seed + 1)
    with (out_dir / "recall_qa.jsonl").open("w") as f:
        for _ in range(n_qa):
            f.write(json.dumps(_qa(r)) + "\n")


if __name__ == "__main__":
    generate()
    print("wrote", Path(__file__).parent / "builtin")
