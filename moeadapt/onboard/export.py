"""Write a model onboarded from a Hugging Face checkpoint back in that checkpoint's own format.

Owns the reverse of the name map (names.py): every tensor of our state dict goes back to its checkpoint name(s)
(stacked experts split per expert, RoPE row permutations undone, the checkpoint's shape and dtype restored), the
checkpoint's other tensors (multi-token-prediction layers, rotary tables) are copied through unchanged, and
config.json (plus tokenizer / generation files) is copied, so `transformers.AutoModelForCausalLM.from_pretrained`
loads the result. FP8 checkpoints come back dequantised in bf16 (quantization_config dropped). The tensors go
through `write_safetensors`, the one place that decides the file layout (a single file for now).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from ..io import atomic_dir, save_tensors
from .families import OnboardError
from .loader import checkpoint_index
from .names import build_rules

_COPIED = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
           "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja")


def _source_meta(src: Path, index: dict[str, str]) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    meta = {}
    for shard in sorted(set(index.values())):
        with safe_open(str(src / shard), "pt") as f:
            for k in f.keys():
                sl = f.get_slice(k)
                meta[k] = (tuple(sl.get_shape()), getattr(torch, {"F32": "float32", "F16": "float16", "BF16":
                                                                  "bfloat16", "F8_E4M3": "float8_e4m3fn",
                                                                  "I64": "int64", "I32": "int32", "F64": "float64",
                                                                  "BOOL": "bool"}[sl.get_dtype()]))
    return meta


def hf_tensors(model: torch.nn.Module, src: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) for every tensor of the checkpoint at `src`, our model's values where we hold
    them (in the checkpoint's shape and dtype; FP8 weights as bf16), the checkpoint's own for the rest."""
    from . import read_family_dir

    src = Path(src)
    fam = read_family_dir(src, allow_unmapped=True)
    if fam.model_type == "moeadapt":
        raise OnboardError(f"{src} is in moeadapt's own format; --format hf needs a Hugging Face base checkpoint")
    index = checkpoint_index(src)
    meta = _source_meta(src, index)
    state = model.state_dict()
    written: set[str] = set()
    parts: dict[str, list[torch.Tensor | None]] = {}  # fused checkpoint tensors being assembled from our parts
    for r in build_rules(fam, index):
        if r.ours not in state or (r.absent_ok and not any(s in index for s in r.sources)):
            continue
        if r.ours == "lm_head.weight" and fam.spec.tie_word_embeddings:
            continue  # the checkpoint holds the embedding once
        t = state[r.ours].detach()
        if r.part is not None:  # e.g. gate and up in experts.gate_up_proj: yield once both are there
            d, i, n = r.part
            name = r.sources[0]
            got = parts.setdefault(name, [None] * n)
            got[i] = t.float()
            if all(x is not None for x in got):
                written.add(name)
                yield name, torch.cat(got, dim=d).to(meta[name][1]).contiguous()  # type: ignore[arg-type]
            continue
        parts = [t[e] for e in range(t.shape[0])] if r.stacked else [t]
        for name, part in zip(r.sources, parts):
            shape, dtype = meta[name]
            out_dtype = torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype
            written.add(name)
            yield name, r.from_ours(part.float(), shape).to(out_dtype).contiguous()
    for name in index:  # MTP layers, rotary tables, ...: unchanged (FP8 scales dropped with the FP8 weights)
        if name in written or name.endswith("weight_scale_inv"):
            continue
        with safe_open(str(src / index[name]), "pt") as f:
            yield name, f.get_tensor(name)


def write_safetensors(tensors: Iterator[tuple[str, torch.Tensor]], out: Path) -> None:
    """The checkpoint's tensors as out/model.safetensors (one file: the layout decision lives here alone)."""
    save_tensors(dict(tensors), out / "model.safetensors", metadata={"format": "pt"})


def save_hf_dir(model: torch.nn.Module, src: str | Path, out: str | Path) -> Path:
    """Write `model` (onboarded from the Hugging Face checkpoint `src`, adapters merged) as a checkpoint of the
    same family: the checkpoint's names, shapes, dtypes and config.json. Written atomically."""
    src = Path(src)
    with atomic_dir(out) as tmp:
        write_safetensors(hf_tensors(model, src), tmp)
        cfg = json.loads((src / "config.json").read_text())
        if cfg.pop("quantization_config", None) is not None:
            cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"  # FP8 weights were written dequantised
        (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
        for f in _COPIED:
            if (src / f).is_file():
                shutil.copy(src / f, tmp / f)
    return Path(out)
