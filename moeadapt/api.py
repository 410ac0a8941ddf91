"""Python entry points, one per CLI command (`moeadapt <command>` calls exactly these)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import yaml

from .config import RunConfig, build_run_config, load_run_config, resolve_model
from .config.load import ConfigError
from .data.dataset import PackedDataset, pack, read_jsonl
from .data.tokenizer import get_tokenizer
from .io import save_model_dir
from .lora import export_peft, inject_lora, load_peft, merge_lora
from .models.model import HybridMoEModel, build_model, materialize
from .models.stats import count_parameters
from .ui import make_console

ASSETS = Path(__file__).parent / "assets"
DEMO_BASE = ASSETS / "tiny-base"


def _cfg(config: str | Path | dict | RunConfig, overrides: dict[str, Any] | None = None) -> RunConfig:
    if isinstance(config, RunConfig):
        return config
    if isinstance(config, dict):
        return build_run_config(config)
    return load_run_config(config, overrides)


def _save_resolved(cfg: RunConfig) -> None:
    out = Path(cfg.train.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def train(config, overrides: dict[str, Any] | None = None, quiet: bool = False):
    """Full training (or LoRA when the config has a `lora:` section). Returns a TrainResult."""
    from .train.trainer import train as _train

    cfg = _cfg(config, overrides)
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
    m.eval()
    return m


def evaluate(model: str | Path, data: str, adapter: str | Path | None = None, seq_len: int = 256,
             batch_size: int = 8, max_batches: int = 16, tokenizer: str = "auto") -> dict:
    from .config import TrainSpec
    from .train.trainer import evaluate as _eval

    m = load_model_dir(model, adapter)
    tok = get_tokenizer(tokenizer, model)
    ds = PackedDataset(*pack(read_jsonl(data), tok, seq_len))
    cfg = RunConfig(model=m.spec, train=TrainSpec(micro_batch_size=batch_size, seq_len=seq_len, eval_batches=max_batches))
    loss = _eval(m, ds, cfg, torch.device("cpu"))
    return {"loss": loss, "perplexity": float(torch.tensor(loss).exp()), "rows": min(len(ds), max_batches * batch_size)}


@torch.no_grad()
def _decode(m: HybridMoEModel, tok, prompt: str, max_new_tokens: int, temperature: float, chat: bool,
            g: torch.Generator) -> str:
    ids = ([tok.role_id("user")] + tok.encode(prompt) + [tok.end_id, tok.role_id("assistant")]) if chat \
        else tok.encode(prompt)
    out: list[int] = []
    stop = {tok.eos_id, tok.end_id} if chat else {tok.eos_id}
    for _ in range(max_new_tokens):
        x = torch.tensor([ids + out][-m.spec.max_position_embeddings:])
        logits = m(x).logits[0, -1].float()
        if temperature <= 0:
            nxt = int(logits.argmax())
        else:
            nxt = int(torch.multinomial((logits / temperature).softmax(-1), 1, generator=g))
        if nxt in stop:
            break
        out.append(nxt)
    return tok.decode(out)


def generate(model: str | Path, prompt: str, adapter: str | Path | None = None, max_new_tokens: int = 64,
             temperature: float = 0.0, chat: bool = False, seed: int = 0, tokenizer: str = "auto") -> str:
    """Greedy (temperature 0) or sampled decoding. Recomputes the prefix each token (no cache): for small models."""
    m = load_model_dir(model, adapter)
    tok = get_tokenizer(tokenizer, model)
    return _decode(m, tok, prompt, max_new_tokens, temperature, chat, torch.Generator().manual_seed(seed))


def export_adapter(run_dir: str | Path, out: str | Path) -> Path:
    """Write the PEFT adapter of a LoRA run's latest checkpoint (or its final adapter) to `out`."""
    from .io import load_tensors
    from .train.checkpoint import latest_checkpoint

    run_dir = Path(run_dir)
    cfg_file = run_dir / "config.yaml"
    if not cfg_file.is_file():
        raise ConfigError(f"{run_dir} is not a run directory (no config.yaml)")
    cfg = build_run_config(yaml.safe_load(cfg_file.read_text()), str(cfg_file))
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


def merge_adapter(model: str | Path, adapter: str | Path, out: str | Path) -> Path:
    """Fold a PEFT adapter into the base weights and write a plain model directory."""
    m = load_model_dir(model, adapter)
    merge_lora(m)
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
            allow_unmapped: bool = False, quiet: bool = False) -> dict:
    """Map a checkpoint directory (HF families or ours) onto our model: spec, tensor-name check, op mapping;
    optionally validate logits against transformers and write a run YAML. See moeadapt/onboard/."""
    from . import onboard as ob

    res = ob.onboard(path, validate=validate, allow_unmapped=allow_unmapped)
    if write_config:
        res["config_written"] = ob.write_run_config(res["fam"], path, write_config)
    if not quiet:
        ob.report(res)
    v = res.get("validation")
    if v is not None and not v["passed"]:
        raise ValueError(f"validation failed: max |logit diff| {v['max_abs_diff']} > tolerance {v.get('tolerance')}")
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
