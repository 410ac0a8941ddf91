"""LoRA step of the `small` preset with a Kimi-VL-sized vision tower (~400M parameters: width 1152, 27 blocks,
16 heads, MLP 4304, patch 14) on image + text rows, against the text-only step at the same number of language-model
tokens: tokens/s, images/s and peak memory, printed as a markdown table and written as JSON.

Each row: `--images` pictures of `--image-size`^2 pixels (resized to multiples of 28: 1024 -> 1008, i.e.
72 x 72 patches -> 1296 image tokens each) plus `--text-tokens` text tokens. The text-only step runs rows of the
same total length (image tokens replaced by text), so the difference is what the vision path costs. LoRA defaults
(tower and projector frozen, adapters on the LM) unless --vision-lora / --projector full. bf16 autocast with the
frozen base in bf16 (the trainer's GPU setup); the ViT's attention is PyTorch's flash varlen kernel.

    python benchmarks/bench_vision.py --out vision.json [--images 4] [--image-size 1024] [--micro-batch 1]
    python benchmarks/bench_vision.py --smoke      # CPU: the same code path on tiny-vl with 56 x 56 images
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without install
from moeadapt.config import LoRASpec, VisionSpec  # noqa: E402
from moeadapt.config.presets import get_preset  # noqa: E402
from moeadapt.data.multimodal import resize_for_budget  # noqa: E402
from moeadapt.lora import cast_frozen_, inject_lora  # noqa: E402
from moeadapt.models.model import build_model, materialize  # noqa: E402
from moeadapt.models.stats import count_parameters  # noqa: E402
from moeadapt.models.vision import ImageBatch  # noqa: E402

KIMI_VL_TOWER = dict(patch_size=14, hidden_size=1152, n_layers=27, n_heads=16, intermediate_size=4304,
                     image_token_id=32000)


def _rows(spec, args, device, with_images: bool, g):
    vs = spec.vision
    H, W = resize_for_budget(args.image_size, args.image_size, 28, 28 * 28, args.image_size ** 2)
    gh, gw = H // 14, W // 14
    n_img_tok = gh * gw // 4
    T = args.text_tokens + args.images * n_img_tok
    x = torch.randint(0, min(32000, vs.image_token_id), (args.micro_batch, T + 1), device=device, generator=g)
    images = None
    if with_images:
        for r in range(args.micro_batch):
            for i in range(args.images):
                s = 8 + i * (n_img_tok + 8)
                x[r, s:s + n_img_tok] = vs.image_token_id
        n = args.micro_batch * args.images
        px = torch.randn(n * gh * gw, 3 * 14 * 14, device=device, generator=g)
        images = ImageBatch(px, torch.tensor([[gh, gw]] * n))
    return x[:, :-1].contiguous(), x[:, 1:].contiguous(), images, T, n_img_tok


def bench(args, with_images: bool, model, spec, device) -> dict:
    g = torch.Generator(device=device).manual_seed(0)
    x, y, images, T, n_img_tok = _rows(spec, args, device, with_images, g)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    times = []
    for i in range(args.warmup + args.steps):
        sync()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext():
            out = model(x, y, return_logits=False, images=images)
            loss = out.loss + out.aux_loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    dt = sorted(times)[len(times) // 2]
    toks = args.micro_batch * T
    return {"kind": "image+text" if with_images else "text-only", "seq_len": T,
            "image_tokens_per_row": args.images * n_img_tok if with_images else 0,
            "patches_per_row": args.images * n_img_tok * 4 if with_images else 0,
            "step_ms": dt * 1e3, "lm_tokens_per_s": toks / dt,
            "images_per_s": args.micro_batch * args.images / dt if with_images else 0.0,
            "peak_mem_gib": torch.cuda.max_memory_allocated(device) / 2**30 if cuda else float("nan"),
            "loss": float(out.loss.detach())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--image-size", type=int, default=1024)
    ap.add_argument("--text-tokens", type=int, default=512)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--vision-lora", action="store_true", help="LoRA on the tower's linears as well")
    ap.add_argument("--projector", default="frozen", choices=["frozen", "lora", "full"])
    ap.add_argument("--out", default=None)
    ap.add_argument("--smoke", action="store_true", help="CPU check of this script on tiny-vl (numbers meaningless)")
    args = ap.parse_args()
    if args.smoke:
        args.images, args.image_size, args.text_tokens, args.steps, args.warmup = 2, 56, 16, 1, 0
        device, spec = torch.device("cpu"), get_preset("tiny-vl")
    elif not torch.cuda.is_available():
        sys.exit("bench_vision needs a CUDA GPU (or --smoke on CPU)")
    else:
        device = torch.device("cuda")
        spec = get_preset("small", vision=VisionSpec(**KIMI_VL_TOWER), max_position_embeddings=65536)
    model = materialize(build_model(spec, "meta"), device, seed=0)
    lora = LoRASpec(rank=16, alpha=32, vision_tower="lora" if args.vision_lora else "frozen", projector=args.projector)
    inject_lora(model, lora)
    if device.type == "cuda":
        cast_frozen_(model, torch.bfloat16)
    model.set_backend("auto")
    c = count_parameters(model, spec)["by_component"]
    tower = c.get("vision_tower", 0)
    print(f"small + vision tower: tower {tower / 1e6:.1f}M, projector {c.get('vision_projector', 0) / 1e6:.1f}M "
          f"parameters; LoRA {lora.vision_tower=} {lora.projector=}", flush=True)
    rows = [bench(args, False, model, spec, device), bench(args, True, model, spec, device)]
    print("\n| step | LM tokens/row | image tokens/row | ms/step | LM tokens/s | images/s | peak GiB |\n"
          "|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['kind']} | {r['seq_len']} | {r['image_tokens_per_row']} | {r['step_ms']:.1f} | "
              f"{r['lm_tokens_per_s']:,.0f} | {r['images_per_s']:.1f} | {r['peak_mem_gib']:.2f} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "tower_params": tower, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
