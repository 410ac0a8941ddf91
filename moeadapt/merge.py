"""Fold a LoRA adapter into a checkpoint, streaming: no process ever holds the model, only one block of rows.

Owns: `merge_adapter_streaming(model_dir, adapter_dir, out)`. The base checkpoint (a Hugging Face directory of
an onboarded family, or ours) is read box by box (`StreamingLoader.read_slice`), each block of rows gets its
adapter delta (`scaling * B[rows] @ A`, per expert for grouped adapters) and is written straight into sharded
safetensors (`moeadapt.io.write_sharded_dir`): in our format, or under the checkpoint's own names with
`layout="hf"` (the checkpoint's tensors our model does not hold, e.g. a vision tower, copied through unchanged).
Under torch.distributed every rank merges a share of the tensors (balanced by bytes) into the same files; alone,
one process does all of them. The adapter itself (small) is loaded whole by `load_peft`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .io import DEFAULT_MAX_SHARD_BYTES, ST_DTYPES, write_sharded_dir
from .lora import inject_lora, load_peft, lora_modules
from .lora.layers import LoRALinear
from .lora.peft import read_adapter_config
from .models.model import build_model
from .onboard.loader import HFLayout
from .onboard.sources import SafetensorsSource

BLOCK_BYTES = 64 * 2**20
_FROM_ST = {v: k for k, v in ST_DTYPES.items()}


class _Box:
    """What `HFLayout.pieces` needs of a region: where the box starts."""

    def __init__(self, offset: tuple[int, ...]):
        self.offset = offset


def _adapters(spec, adapter_dir: Path) -> dict[str, nn.Module]:
    """The adapter's modules on a meta-built model, their LoRA tensors real (CPU) and loaded."""
    model = build_model(spec, "meta")
    inject_lora(model, read_adapter_config(adapter_dir)[0])
    for m in lora_modules(model).values():
        if isinstance(m, LoRALinear):
            m.lora_A.to_empty(device="cpu")
            m.lora_B.to_empty(device="cpu")
        else:
            m.lora_A = nn.Parameter(torch.empty(m.lora_A.shape), requires_grad=False)
            m.lora_B = nn.Parameter(torch.empty(m.lora_B.shape), requires_grad=False)
    load_peft(model, adapter_dir)
    return lora_modules(model)


def _delta(m: nn.Module, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of the module's delta-W (experts [a, b) for a grouped adapter), float32."""
    if isinstance(m, LoRALinear):
        return (m.lora_B.weight[a:b].float() @ m.lora_A.weight.float()) * m.scaling
    return torch.einsum("eir,ero->eoi", m.lora_A[a:b].float(), m.lora_B[a:b].float()) * m.scaling


def _share(sizes: list[int], world: int) -> list[int]:
    """Tensor index -> rank, greedy by bytes (largest first onto the least loaded rank)."""
    load, owner = [0] * world, [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        r = min(range(world), key=load.__getitem__)
        owner[i], load[r] = r, load[r] + sizes[i]
    return owner


def _passthrough(loader) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The checkpoint tensors the name map skips (a vision tower, multi-token-prediction layers, rotary tables) ->
    (shape, dtype): the hf layout writes them through unchanged, so the merged directory is the whole checkpoint.
    The FP8 scales of weights we dequantise are left out with their quantization_config."""
    from safetensors import safe_open

    consumed = {s for r in loader.rules for s in r.sources}
    names = [n for n in loader.ignored
             if not (n.endswith("_scale_inv") and n[:-len("_scale_inv")] in consumed)]
    out = {}
    for shard in sorted({loader.index[n] for n in names}):
        with safe_open(str(loader.path / shard), "pt") as f:
            for n in names:
                if loader.index[n] == shard:
                    sl = f.get_slice(n)
                    out[n] = (tuple(sl.get_shape()), _FROM_ST[sl.get_dtype()])
    return out


@torch.no_grad()
def merge_adapter_streaming(model_dir: str | Path, adapter_dir: str | Path, out: str | Path, layout: str = "ours",
                            dtype: torch.dtype | None = None,
                            max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES) -> Path:
    """Write base + adapter merged to `out` (sharded safetensors + config.json). `layout`: "ours" (a moeadapt
    model directory) or "hf" (the base checkpoint's names, shapes, row order and config; FP8 bases come out in
    bf16 without their quantization_config). `dtype`: of the floating tensors (default: the base's, bf16 for
    FP8). Collective under torch.distributed."""
    import torch.distributed as dist

    src = SafetensorsSource(model_dir)
    loader = src.loader
    loader.check()
    if layout not in ("ours", "hf"):
        raise ValueError(f"layout={layout!r}; use 'ours' (a moeadapt model directory) or 'hf' (the checkpoint's names)")
    if layout == "hf" and src.fam.model_type == "moeadapt":
        layout = "ours"
    spec = src.fam.spec
    mods = _adapters(spec, Path(adapter_dir))
    rules = [r for r in loader.rules if not (layout == "hf" and r.absent_ok)]
    lay = HFLayout(loader.rules, loader.src_shapes) if layout == "hf" else None

    def out_dtype(r) -> torch.dtype:
        if r.ours.endswith("expert_bias"):
            return torch.float32
        if dtype is not None:
            return dtype
        st = next((loader.src_dtypes[s] for s in r.sources if s in loader.src_dtypes), "F32")
        return torch.bfloat16 if st.startswith("F8") else _FROM_ST.get(st, torch.float32)

    tensors, seen, claims = [], set(), []  # claims[i]: the outputs rule i writes (tied weights: the first rule)
    for r in rules:
        dests = lay.dests(r.ours, r.shape) if lay else [(r.ours, r.shape)]
        # a tied weight is written once (by its first rule); the parts of a fused tensor each write theirs
        claims.append({dn for dn, _ in dests if dn not in seen or r.part is not None})
        for dn, dshape in dests:
            if dn not in seen:
                seen.add(dn)
                tensors.append((dn, tuple(dshape), out_dtype(r)))
    passthrough = _passthrough(loader) if layout == "hf" else {}
    tensors += [(n, shape, dt) for n, (shape, dt) in passthrough.items()]
    sizes = [int(torch.Size(r.shape).numel()) for r in rules]
    dist_on = dist.is_available() and dist.is_initialized()
    rank, world = (dist.get_rank(), dist.get_world_size()) if dist_on else (0, 1)
    owner = _share(sizes, world)

    def write(emit) -> None:
        if rank == world - 1:  # the checkpoint's tensors our model does not hold, copied unchanged
            from safetensors import safe_open

            for n in passthrough:
                with safe_open(str(Path(model_dir) / loader.index[n]), "pt") as f:
                    t = f.get_tensor(n)
                emit(n, (0,) * t.dim(), t)
        for i, r in enumerate(rules):
            if owner[i] != rank or not claims[i]:
                continue
            mod = mods.get(r.ours.rsplit(".", 1)[0]) if r.ours.endswith(".weight") else None
            row = max(1, int(torch.Size(r.shape[1:]).numel()) * 4)
            step = max(1, BLOCK_BYTES // row)
            for a in range(0, r.shape[0], step):
                b = min(r.shape[0], a + step)
                sl = (slice(a, b), *(slice(0, d) for d in r.shape[1:]))
                box = loader.read_slice(r.ours, sl)
                if box is None:  # absent by design, "keep": our init is not defined outside a model
                    raise ValueError(f"{r.ours} is not in {model_dir} and has no stated init; cannot merge")
                box = box.float()
                if mod is not None:
                    box += _delta(mod, a, b)
                offset = (a, *([0] * (len(r.shape) - 1)))
                pieces = lay.pieces(r.ours, _Box(offset), box) if lay else [(r.ours, offset, box)]
                for dn, off, piece in pieces:
                    if dn in claims[i]:
                        emit(dn, off, piece)
        loader.close()

    if layout == "hf":
        config = json.loads((Path(model_dir) / "config.json").read_text())
        if any(s.startswith("F8") for s in loader.src_dtypes.values()):
            config.pop("quantization_config", None)
    else:
        config = {"moeadapt": spec.model_dump(mode="json")}
    return write_sharded_dir(out, tensors, config, write, max_shard_bytes)
