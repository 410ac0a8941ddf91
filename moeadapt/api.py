"""Python entry points, one per CLI command (`moeadapt <command>` calls exactly these)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml

from .config import RunConfig, build_run_config, load_run_config
from .config.load import ConfigError
from .data.dataset import PackedDataset, check_targets, pack, read_jsonl
from .data.tokenizer import get_tokenizer
from .io import save_model_dir
from .lora import export_peft, inject_lora, load_peft, merge_lora
from .models.model import HybridMoEModel, build_model, materialize
from .models.stats import count_parameters
from .onboard import model_spec_from_dir, resolve_model
from .ui import make_console

ASSETS = Path(__file__).parent / "assets"
DEMO_BASE = ASSETS / "tiny-base"


def _cfg(config: str | Path | dict | RunConfig, overrides: dict[str, Any] | None = None) -> RunConfig:
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, dict):
        return build_run_config(config, from_dir=model_spec_from_dir)
    return load_run_config(config, overrides, from_dir=model_spec_from_dir)


def _check_launch(cfg: RunConfig) -> None:
    """Degrees that need several processes are refused in a single-process run instead of being ignored."""
    import os

    p = cfg.parallel
    if "WORLD_SIZE" not in os.environ and (p.world_size > 1 or p.ep > 1):
        raise ConfigError(f"parallel: dp_replicate={p.dp_replicate} dp_shard={p.dp_shard} ep={p.ep} cp={p.cp} need "
                          f"{p.world_size} processes; launch with `torchrun --nproc_per_node {p.world_size} -m "
                          "moeadapt train ...`, or set them to 1 for a single-process run")


def _save_resolved(cfg: RunConfig) -> None:
    out = Path(cfg.train.output_dir)
    for parent in (out, *out.parents):
        if parent.exists() and not parent.is_dir():
            raise ConfigError(f"train.output_dir {out}: {parent} is a file, not a directory; choose another "
                              "output_dir")
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def train(config, overrides: dict[str, Any] | None = None, quiet: bool = False):
    """Full training (or LoRA when the config has a `lora:` section). Returns a TrainResult."""
    from .train.trainer import train as _train

    cfg = _cfg(config, overrides)
    _check_launch(cfg)
    from .train.checkpoint import step_dirs

    have = step_dirs(Path(cfg.train.output_dir) / "checkpoints")
    if have and not cfg.train.resume:
        raise ConfigError(f"train.output_dir {cfg.train.output_dir} already holds checkpoints (newest {have[0].name}); "
                          "set train.resume=true to continue that run, or choose a new output_dir (a fresh start "
                          "there would overwrite them)")
    if cfg.train.init_from:
        from .onboard.sources import is_dcp_dir

        if not Path(cfg.train.init_from).is_dir():
            raise ConfigError(f"train.init_from {cfg.train.init_from} is not a directory; give a model directory "
                              "(config.json + model.safetensors), e.g. RUN/model")
        try:
            if not is_dcp_dir(cfg.train.init_from):  # a DCP checkpoint's names and shapes are checked when read
                model_spec_from_dir(cfg.train.init_from)
        except ConfigError as e:
            raise ConfigError(f"train.init_from: {e}") from None
    _save_resolved(cfg)
    return _train(cfg, quiet=quiet)


def finetune(config, overrides: dict[str, Any] | None = None, quiet: bool = False):
    """Training with LoRA on (a `lora:` section with defaults is added when the config has none)."""
    cfg = _cfg(config, overrides)
    if cfg.lora is None:
        from .config import LoRASpec

        cfg = cfg.model_copy(update={"lora": LoRASpec()})
    return train(cfg, quiet=quiet)


def dry_run(config, overrides: dict[str, Any] | None = None, world: int | None = None,
            ranks: list[int] | None = None, lora: bool = False, device: str = "cuda", quiet: bool = False) -> dict:
    """The run's real build -> LoRA -> parallelize path on the meta device for simulated ranks (a fake process
    group): per-rank parameter / gradient / optimizer bytes beside the planner's. See train/dryrun.py."""
    from .train.dryrun import dry_run as _dry_run

    cfg = _cfg(config, overrides)
    if lora and cfg.lora is None:
        from .config import LoRASpec

        cfg = cfg.model_copy(update={"lora": LoRASpec()})
    if world is not None and world != cfg.parallel.world_size and cfg.parallel.world_size == 1:
        cfg = cfg.model_copy(update={"parallel": cfg.parallel.model_copy(update={"dp_shard": world})})
    return _dry_run(cfg, world, ranks=ranks, device=device, quiet=quiet)


def load_model_dir(model: str | Path, adapter: str | Path | None = None, device: str = "cpu") -> HybridMoEModel:
    """A moeadapt model directory (config.json + model.safetensors), optionally with a PEFT adapter."""
    from .train.build import load_model

    spec = resolve_model(str(model))
    m = materialize(build_model(spec, "meta"), device)
    if Path(str(model)).is_dir():
        load_model(model, m)
    if adapter is not None:
        load_peft(m, adapter)
    if not Path(str(model)).is_dir():  # a preset: the weights are random
        import sys

        print(f"warning: {model!r} is a preset with random weights (not a trained model): its output is noise; give "
              "a model directory written by `moeadapt train` (RUN/model) for real results", file=sys.stderr)
    m.eval()
    return m


def evaluate(model: str | Path, data: str, adapter: str | Path | None = None, seq_len: int = 256,
             batch_size: int = 8, max_batches: int = 16, tokenizer: str = "auto") -> dict:
    from .config import TrainSpec
    from .train.trainer import evaluate as _eval

    for name, v, lo in (("seq_len", seq_len, 2), ("batch_size", batch_size, 1), ("max_batches", max_batches, 1)):
        if not isinstance(v, int) or v < lo:
            raise ValueError(f"{name}={v!r} must be an integer >= {lo}")
    m = load_model_dir(model, adapter)
    tok = get_tokenizer(tokenizer, model)
    if m.spec.vision is not None:  # image + text records: loss and answer accuracy (train/vl.py)
        from .config import DataSpec
        from .data.multimodal import build_mm_dataset
        from .train.vl import evaluate_vl

        ds = build_mm_dataset(data, tok, m.spec.vision, seq_len, DataSpec(train=data))
        r = evaluate_vl(m, ds, batch_size, torch.device("cpu"), max_batches)
        return {"loss": r["loss"], "perplexity": float(torch.tensor(r["loss"]).exp()), "rows": r["rows"],
                "accuracy": r["accuracy"], **({"by_question": r["by_question"]} if "by_question" in r else {})}
    ds = PackedDataset(*pack(read_jsonl(data), tok, seq_len))
    check_targets(ds, str(data))
    cfg = RunConfig(model=m.spec, train=TrainSpec(micro_batch_size=batch_size, seq_len=seq_len, eval_batches=max_batches))
    loss = _eval(m, ds, cfg, torch.device("cpu"))
    return {"loss": loss, "perplexity": float(torch.tensor(loss).exp()), "rows": min(len(ds), max_batches * batch_size)}


def _image_prompt(m: HybridMoEModel, images: list[str]):
    """Placeholder ids for each image (in order) and the packed ImageBatch."""
    from .config import DataSpec
    from .data.multimodal import _check_image, image_to_patches, load_image
    from .models.vision import ImageBatch

    vs, d = m.spec.vision, DataSpec()
    if vs is None:
        raise ValueError(f"model {m.spec.name!r} has no vision tower; --image needs a vision-language model")
    ids, pix, grids = [], [], []
    for f in images:
        _check_image(Path(f), "--image")
        px, (gh, gw) = image_to_patches(load_image(Path(f)), vs, d.min_pixels, d.max_pixels)
        ids += [vs.image_token_id] * (gh * gw // 4)
        pix.append(px)
        grids.append((gh, gw))
    return ids, ImageBatch(torch.cat(pix), torch.tensor(grids, dtype=torch.long))


@torch.no_grad()
def _decode(m: HybridMoEModel, tok, prompt: str, max_new_tokens: int, temperature: float, chat: bool,
            g: torch.Generator, images: list[str] | None = None) -> str:
    img_ids, batch = _image_prompt(m, images) if images else ([], None)
    chat = chat or bool(images)  # images go into a user turn
    ids = ([tok.role_id("user")] + img_ids + tok.encode(prompt) + [tok.end_id, tok.role_id("assistant")]) if chat \
        else tok.encode(prompt)
    out: list[int] = []
    stop = {tok.eos_id, tok.end_id} if chat else {tok.eos_id}
    for _ in range(max_new_tokens):
        x = torch.tensor([ids + out])
        if x.shape[1] > m.spec.max_position_embeddings:
            raise ValueError(f"prompt + output reach {x.shape[1]} tokens, over the model's "
                             f"max_position_embeddings={m.spec.max_position_embeddings}; lower --max-new-tokens")
        logits = m(x, images=batch).logits[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=g))
        if nxt in stop:
            break
        out.append(nxt)
    return tok.decode(out)


def generate(model: str | Path, prompt: str, adapter: str | Path | None = None, max_new_tokens: int = 64,
             temperature: float = 0.0, chat: bool = False, seed: int = 0, tokenizer: str = "auto",
             images: list[str] | None = None) -> str:
    """Greedy (temperature 0) or sampled decoding. Recomputes the prefix each token (no cache): for small models.
    `images`: picture files put before the prompt in the user turn (a vision-language model; implies chat)."""
    if not isinstance(prompt, str) or not prompt:
        raise ValueError("the prompt is empty; give some text to continue")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens!r} must be an integer >= 1")
    if not (temperature >= 0 and temperature != float("inf")):
        raise ValueError(f"temperature={temperature!r} must be >= 0 and finite (0 = greedy)")
    m = load_model_dir(model, adapter)
    tok = get_tokenizer(tokenizer, model)
    return _decode(m, tok, prompt, max_new_tokens, temperature, chat, torch.Generator().manual_seed(seed), images)


def export_adapter(run_dir: str | Path, out: str | Path) -> Path:
    """Write the PEFT adapter of a LoRA run's latest checkpoint (or its final adapter) to `out`."""
    from .io import load_tensors
    from .train.checkpoint import latest_checkpoint

    run_dir = Path(run_dir)
    _check_out_dir(out, "export-adapter --out")
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    from .config.load import safe_load_yaml

    cfg = build_run_config(safe_load_yaml(cfg_file.read_text(), str(cfg_file)), str(cfg_file),
                           from_dir=model_spec_from_dir)
    if cfg.lora is None:
        raise ConfigError(f"{run_dir} is a full-training run; it has no adapter to export")
    m = materialize(build_model(cfg.model, "meta"), "cpu")
    ck = latest_checkpoint(run_dir / "checkpoints")
    if ck is not None:
        inject_lora(m, cfg.lora)
        own = dict(m.named_parameters())
        with torch.no_grad():
            for k, v in load_tensors(ck / "model.safetensors").items():
                if k in own:
                    own[k].copy_(v)
    elif (run_dir / "adapter").is_dir():
        load_peft(m, run_dir / "adapter")
    else:
        raise FileNotFoundError(f"{run_dir} has neither checkpoints/ nor adapter/; the run saved nothing yet")
    from .onboard import peft_maps

    return export_peft(m, cfg.lora, out, base_model=cfg.train.init_from or cfg.model.name,
                       **peft_maps(cfg.train.init_from))


def _check_out_dir(out: str | Path, what: str) -> None:
    """An output directory may replace an earlier one of ours, never a file or a directory of something else."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise ValueError(f"{what} {out} is an existing file; give a new directory path")
    if out.is_dir() and any(out.iterdir()) and not ((out / "config.json").is_file()
                                                     or (out / "adapter_config.json").is_file()):
        raise ValueError(f"{what} {out} is a non-empty directory that is not a model/adapter directory; give a new "
                         "path (it would be replaced)")


def merge_adapter(model: str | Path, adapter: str | Path, out: str | Path, format: str = "moeadapt",
                  max_shard_gb: float = 5.0) -> Path:
    """Fold a PEFT adapter into the base weights and write a model directory: moeadapt's own format, or with
    format="hf" the base Hugging Face checkpoint's own names, config and row order (transformers loads it).
    A model directory is merged streaming, block by block into sharded safetensors of <= max_shard_gb
    (moeadapt/merge.py: no process holds the model; under torchrun the ranks share the tensors); a preset
    (random weights) in memory."""
    if format not in ("moeadapt", "hf"):
        raise ConfigError(f"format={format!r}; choose 'moeadapt' or 'hf'")
    _check_out_dir(out, "merge-adapter --out")
    if Path(str(model)).is_dir():
        from .merge import merge_adapter_streaming

        return merge_adapter_streaming(model, adapter, out, layout="hf" if format == "hf" else "ours",
                                       max_shard_bytes=int(max_shard_gb * 1e9))
    if format == "hf":
        raise ConfigError(f"format='hf' needs a Hugging Face model directory; {model!r} is a preset")
    m = load_model_dir(model, adapter)
    merge_lora(m)
    if format == "hf":
        from .onboard.export import save_hf_dir

        return save_hf_dir(m, model, out)
    return save_model_dir(m, m.spec.model_dump(), out)


def info(model: str) -> dict:
    """Parameter counts (total, active per token, by component) of a preset or directory, built on meta."""
    spec = resolve_model(model)
    m = build_model(spec, "meta")
    c = count_parameters(m, spec)
    types = spec.resolved_layer_types()
    c.update({"name": spec.name, "layers": len(types), "kda_layers": types.count("kda"),
              "dsa_layers": types.count("dsa"), "moe_layers": sum(spec.is_moe_layer(i) for i in range(spec.n_layers)),
              "experts": spec.n_routed_experts, "experts_per_token": spec.n_experts_per_tok,
              "shared_experts": spec.n_shared_experts, "latent_dim": spec.latent_dim,
              "index_topk": spec.index_topk, "context": spec.max_position_embeddings})
    return c


def demo(output_dir: str | Path = "runs/demo", rebuild_base: bool = False, quiet: bool = False) -> dict:
    """The built-in default job: LoRA fine-tune of the shipped tiny base model on a task it never saw."""
    out = Path(output_dir)
    base = DEMO_BASE
    if rebuild_base or not (base / "model.safetensors").is_file():
        base = out / "tiny-base"
        print(f"pre-training the tiny base model first ({base}) ...")
        r = train(ASSETS / "tiny_pretrain.yaml", {"train.output_dir": str(out / "pretrain")}, quiet=quiet)
        base = r.output_dir / "model"
    res = finetune(ASSETS / "demo_finetune.yaml", {"train.init_from": str(base), "train.output_dir": str(out)},
                   quiet=quiet)
    summary = json.loads((out / "summary.json").read_text())
    return {"result": res, "summary": summary}


def onboard(path: str | Path, validate: bool = False, write_config: str | Path | None = None,
            allow_unmapped: bool = False, quiet: bool = False, layers: int | None = None,
            seq_len: int | None = None, seed: int = 0, tolerance: float | None = None) -> dict:
    """Map a checkpoint directory (HF families or ours) onto our model: spec, tensor-name check, op mapping;
    optionally validate the checkpoint's weights (the first `layers` blocks) against transformers and write a run
    YAML. See moeadapt/onboard/."""
    from . import onboard as ob

    res = ob.onboard(path, validate=validate, allow_unmapped=allow_unmapped, layers=layers, seq_len=seq_len,
                     seed=seed, tolerance=tolerance)
    if write_config:
        res["config_written"] = ob.write_run_config(res["fam"], path, write_config)
    if not quiet:
        ob.report(res)
    v = res.get("validation")
    if v is not None and not v["passed"]:
        raise ValueError(f"validation failed: max |logit diff| {v['max_abs_diff']:.3g} at max |logit| "
                         f"{v['max_abs_logit']:.3g} (tolerance {v['tolerance']:.0e} relative to max(1, max |logit|)); "
                         f"{v['where']}")
    return res


def plan(model: str, gpus: int, gpu_mem: str | float = "141GiB", lora: bool = False, lora_rank: int = 16,
         seq_len: int | None = None, micro_batch: int | None = None, top: int = 5, as_json: bool = False,
         quiet: bool = False, cps: tuple[int, ...] | None = None) -> dict:
    """Search parallel plans (EP / FSDP / CP / recompute / micro-batch) that fit `gpus` GPUs of `gpu_mem`,
    ranked by estimated tokens/s/GPU. See moeadapt/plan/. `cps`: context-parallel degrees to search (default
    every one of 1, 2, 4, 8 that divides `gpus`); a requested cp that does not divide the GPU count or cut
    `seq_len` into 2 * cp pieces is an error."""
    from .config import LoRASpec
    from .plan import print_result, search
    from .plan.search import check_cp

    if cps is None:
        cps = tuple(c for c in (1, 2, 4, 8) if gpus % c == 0 and (not seq_len or c == 1 or seq_len % (2 * c) == 0))
    else:
        check_cp(gpus, tuple(cps), [seq_len] if seq_len else None)
    spec = resolve_model(model)
    res = search(spec, gpus, gpu_mem, LoRASpec(rank=lora_rank) if lora else None,
                 seq_lens=[seq_len] if seq_len else None, micro_batches=[micro_batch] if micro_batch else None,
                 cps=tuple(cps))
    out = {"model": spec.name, "gpus": gpus, "gpu_mem_GiB": res.gpu_mem / 2**30, "lora_rank": lora_rank if lora else None,
           "feasible": [c.row() for c in res.feasible[:top]], "n_feasible": len(res.feasible),
           "smallest_rejected": [c.row() for c in res.rejected[:3]], "notes": res.notes}
    if not quiet:
        print(json.dumps(out, indent=2)) if as_json else print_result(res, spec, top)
    return out


def simulate_routing(experts: int = 896, top_k: int = 16, ep: int = 64, tokens: int = 65536, dist: str = "zipf:1.0",
                     layer: int | None = None, latent: int = 3584, bytes_per_value: int = 2, png: str | None = None,
                     as_json: bool = False, seed: int = 0, quiet: bool = False) -> list[dict]:
    """Per-rank loads, straggler factor and all-to-all bytes under EP, dropless vs capacity factors and
    contiguous vs spread expert placement. See moeadapt/plan/routing.py."""
    from rich.table import Table

    from .plan.routing import plot, sweep

    rows = sweep(experts, top_k, ep, tokens, dist, layer, latent, bytes_per_value, seed)
    if png:
        plot(rows, png)
    if not quiet:
        if as_json:
            print(json.dumps([{k: v for k, v in r.items() if k != "rank_loads"} for r in rows], indent=2))
        else:
            t = Table(title=f"routing {dist}: {experts} experts top-{top_k}, EP{ep}, {tokens:,} tokens/step, "
                            f"{latent} x {bytes_per_value} B per token-choice")
            for c in ("placement", "capacity", "drop", "rank mean", "rank p99", "max/mean", "drop rate",
                      "MB/pair mean", "MB/pair max"):
                t.add_column(c, justify="right")
            for r in rows:
                t.add_row(r["placement"], str(r["capacity_factor"] or "dropless"), r["drop_policy"] or "-",
                          f"{r['rank_load_mean']:.0f}", f"{r['rank_load_p99']:.0f}", f"{r['straggler_factor']:.3f}",
                          f"{r['drop_rate']:.4f}", f"{r['a2a_bytes_per_pair_mean'] / 1e6:.2f}",
                          f"{r['a2a_bytes_per_pair_max'] / 1e6:.2f}")
            make_console().print(t)
            if png:
                make_console().print(f"plot written to {png}")
    return rows
