"""`moeadapt <command>`: thin argument parsing over moeadapt.api (every command is callable from Python).

User errors (bad config, missing file, corrupt checkpoint) print one message and exit 2; no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys

from rich.table import Table

from .ui import make_console

console = make_console()


def _kv(items: list[str]) -> dict:
    """--set train.lr=1e-3 style overrides (values parsed as YAML)."""
    from .config.load import parse_overrides

    return parse_overrides(items)


def _bounded(kind, lo, strict: bool = False):
    """An argparse type: `kind` with value >= lo (> lo when strict), with the bound in the message."""
    def conv(text: str):
        try:
            v = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {'an integer' if kind is int else 'a number'}, "
                                             f"got {text!r}") from None
        if (v <= lo) if strict else (v < lo):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {lo}, got {text}")
        if v != v or v in (float("inf"), float("-inf")):
            raise argparse.ArgumentTypeError(f"must be finite, got {text}")
        return v
    return conv


POS_INT = _bounded(int, 1)
NONNEG_FLOAT = _bounded(float, 0.0)


def _nonempty(text: str) -> str:
    if not text:
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def _print_info(c: dict) -> None:
    t = Table(title=f"{c['name']}: {c['layers']} layers ({c['kda_layers']} KDA + {c['dsa_layers']} gated DSA), "
                    f"{c['moe_layers']} MoE layers, {c['experts']} experts (top-{c['experts_per_token']}, "
                    f"{c['shared_experts']} shared), latent {c['latent_dim']}, context {c['context']:,}")
    t.add_column("component")
    t.add_column("parameters", justify="right")
    t.add_column("share", justify="right")
    for k, v in c["by_component"].items():
        t.add_row(k, f"{v:,}", f"{100 * v / c['total']:.2f}%")
    t.add_row("[bold]total", f"[bold]{c['total']:,}", f"{c['total'] / 1e9:,.2f}B")
    t.add_row("[bold]active per token", f"[bold]{c['active_per_token']:,}", f"{c['active_per_token'] / 1e9:,.2f}B")
    console.print(t)


def _add_plan_parsers(sub) -> None:
    s = sub.add_parser("plan", help="search EP / FSDP / CP / recompute / micro-batch plans that fit the GPUs")
    s.add_argument("--model", required=True, help="a preset name or a model directory")
    s.add_argument("--gpus", type=POS_INT, required=True)
    s.add_argument("--gpu-mem", default="141GiB", help="usable memory per GPU, e.g. 141GiB, 80GB")
    s.add_argument("--lora", action="store_true", help="LoRA fine-tune (frozen base) instead of full training")
    s.add_argument("--lora-rank", type=POS_INT, default=16)
    s.add_argument("--seq-len", type=POS_INT, default=None, help="fix the sequence length (default: search 2048 and 4096)")
    s.add_argument("--micro-batch", type=POS_INT, default=None, help="fix the micro-batch (default: search)")
    s.add_argument("--top", type=POS_INT, default=5)
    s.add_argument("--cp", default=None, help="context-parallel degrees to search, e.g. 1,2,4,8 (default: "
                   "those of 1,2,4,8 that divide --gpus and --seq-len)")
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("simulate-routing", help="per-rank token loads and all-to-all volume under EP")
    s.add_argument("--experts", type=POS_INT, default=896)
    s.add_argument("--top-k", type=POS_INT, default=16)
    s.add_argument("--ep", type=POS_INT, default=64)
    s.add_argument("--tokens", type=POS_INT, default=65536, help="tokens per step (all ranks)")
    s.add_argument("--dist", default="zipf:1.0", help="uniform | zipf:S | a metrics.jsonl path (per-expert counts)")
    s.add_argument("--layer", type=int, default=None, help="MoE layer to take from a metrics.jsonl")
    s.add_argument("--latent", type=POS_INT, default=3584, help="values per token-choice on the wire")
    s.add_argument("--bytes-per-value", type=POS_INT, default=2)
    s.add_argument("--png", default=None, help="write a plot here")
    s.add_argument("--json", action="store_true")
    s.add_argument("--seed", type=int, default=0)


def _run_plan_command(args) -> None:
    from . import api

    if args.cmd == "plan":
        try:  # None: the planner searches the cp degrees that divide --gpus and --seq-len
            cps = tuple(int(c) for c in args.cp.split(",")) if args.cp else None
        except ValueError:
            raise ValueError(f"--cp {args.cp!r}: give comma-separated integers such as 1,2,4") from None
        if cps is not None and any(c < 1 for c in cps):
            raise ValueError(f"--cp {args.cp!r}: every degree must be >= 1")
        api.plan(args.model, args.gpus, args.gpu_mem, lora=args.lora, lora_rank=args.lora_rank, seq_len=args.seq_len,
                 micro_batch=args.micro_batch, top=args.top, as_json=args.json,
                 cps=cps)
    else:
        if args.top_k > args.experts:
            raise ValueError(f"--top-k {args.top_k} exceeds --experts {args.experts}; each token picks distinct experts")
        if args.experts % args.ep:
            raise ValueError(f"--ep {args.ep} does not divide --experts {args.experts}; choose a divisor")
        api.simulate_routing(args.experts, args.top_k, args.ep, args.tokens, args.dist, layer=args.layer,
                             latent=args.latent, bytes_per_value=args.bytes_per_value, png=args.png,
                             as_json=args.json, seed=args.seed)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="moeadapt", description="Train and fine-tune hybrid KDA/DSA MoE models.")
    sub = p.add_subparsers(dest="cmd", required=True)
    for name, hlp in (("train", "train from a YAML config"), ("finetune", "train with LoRA on")):
        s = sub.add_parser(name, help=hlp)
        s.add_argument("config")
        s.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE", help="override config fields")
        s.add_argument("--dry-run", action="store_true", help="build and parallelize on the meta device for "
                       "simulated ranks and print each rank's bytes (no data, no GPU, nothing allocated)")
        s.add_argument("--world", type=int, default=None, help="simulated ranks for --dry-run (default: the plan's)")
        s.add_argument("--ranks", default=None, help="which simulated ranks to build, e.g. 0,127 (default 0: it "
                       "holds the most)")
    s = sub.add_parser("eval", help="evaluate a model (+ adapter) on a JSONL dataset (image + text records for a "
                       "vision-language model: also answer accuracy)")
    s.add_argument("--model", required=True)
    s.add_argument("--adapter")
    s.add_argument("--data", required=True)
    s.add_argument("--seq-len", type=_bounded(int, 2), default=256)
    s.add_argument("--batches", type=POS_INT, default=16)
    s = sub.add_parser("generate", help="generate text from a model (+ adapter)")
    s.add_argument("--model", required=True)
    s.add_argument("--adapter")
    s.add_argument("--prompt", required=True, type=_nonempty)
    s.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn")
    s.add_argument("--max-new-tokens", type=POS_INT, default=64)
    s.add_argument("--temperature", type=NONNEG_FLOAT, default=0.0, help="0 = greedy")
    s.add_argument("--image", action="append", default=[], metavar="FILE",
                   help="a picture for a vision-language model (repeat for several; implies --chat)")
    s = sub.add_parser("export-adapter", help="write a LoRA run's adapter as a PEFT directory")
    s.add_argument("run_dir")
    s.add_argument("--out", required=True)
    s = sub.add_parser("merge-adapter", help="fold an adapter into the base weights")
    s.add_argument("--model", required=True)
    s.add_argument("--adapter", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--format", choices=("moeadapt", "hf"), default="moeadapt", help="hf: the base Hugging Face "
                   "checkpoint's own names, config and safetensors (loadable by transformers)")
    s.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file written")
    s = sub.add_parser("info", help="parameter counts of a preset or model directory (meta device)")
    s.add_argument("--model", required=True)
    s.add_argument("--json", action="store_true")
    s = sub.add_parser("demo", help="the built-in default job (LoRA fine-tune of the tiny model)")
    s.add_argument("--output-dir", default="runs/demo")
    s.add_argument("--rebuild-base", action="store_true", help="pre-train the tiny base again first")
    s = sub.add_parser("onboard", help="map a Hugging Face (or moeadapt) checkpoint directory onto our model")
    s.add_argument("path")
    s.add_argument("--validate", action="store_true", help="run the checkpoint's weights in transformers and in "
                   "moeadapt on the same random documents; compare every layer and the logits (FAIL above 1e-4)")
    s.add_argument("--layers", type=int, default=None, help="validate only the first N blocks (+ embeddings, head)")
    s.add_argument("--seq-len", type=int, default=None, help="longest validation document (default: index_topk + 24 "
                   "with an indexer, else 40)")
    s.add_argument("--seed", type=int, default=0, help="seed of the validation input")
    s.add_argument("--tolerance", type=float, default=None, help="max |logit diff| relative to max(1, max |logit|) "
                   "(default 1e-4; per layer relative to max(1, max |h|)). fp32 rounding grows with depth: deep checkpoints may need --layers")
    s.add_argument("--write-config", metavar="OUT.yaml", help="write a run config for the mapped model")
    s.add_argument("--allow-unmapped", action="store_true", help="map what can be mapped; list the rest as notes")
    _add_plan_parsers(sub)
    args = p.parse_args(argv)

    from . import api

    try:
        if args.cmd in ("train", "finetune") and args.dry_run:
            ranks = [int(r) for r in args.ranks.split(",")] if args.ranks else None
            api.dry_run(args.config, _kv(args.set), world=args.world, ranks=ranks, lora=args.cmd == "finetune")
        elif args.cmd == "train":
            api.train(args.config, _kv(args.set))
        elif args.cmd == "finetune":
            api.finetune(args.config, _kv(args.set))
        elif args.cmd == "eval":
            r = api.evaluate(args.model, args.data, args.adapter, seq_len=args.seq_len, max_batches=args.batches)
            acc = f"  answer accuracy {r['accuracy']:.3f}" if "accuracy" in r else ""
            by = "".join(f"  {k} {v:.3f}" for k, v in r.get("by_question", {}).items())
            console.print(f"loss {r['loss']:.4f}  perplexity {r['perplexity']:.3f}{acc}{by}  ({r['rows']} rows)")
        elif args.cmd == "generate":
            print(api.generate(args.model, args.prompt, args.adapter, args.max_new_tokens, args.temperature, args.chat,
                               images=args.image or None))
        elif args.cmd == "export-adapter":
            console.print(f"adapter written to {api.export_adapter(args.run_dir, args.out)}")
        elif args.cmd == "merge-adapter":
            out = api.merge_adapter(args.model, args.adapter, args.out, args.format, args.max_shard_gb)
            console.print(f"merged model written to {out}")
        elif args.cmd == "info":
            c = api.info(args.model)
            print(json.dumps(c, indent=2)) if args.json else _print_info(c)
        elif args.cmd == "demo":
            api.demo(args.output_dir, args.rebuild_base)
        elif args.cmd == "onboard":
            r = api.onboard(args.path, args.validate, args.write_config, args.allow_unmapped, layers=args.layers,
                            seq_len=args.seq_len, seed=args.seed, tolerance=args.tolerance)
            if r.get("config_written"):
                console.print(f"run config written to {r['config_written']}")
        elif args.cmd in ("plan", "simulate-routing"):
            _run_plan_command(args)
    except KeyboardInterrupt as e:
        print(str(e) or "interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - user errors become one line; anything else is re-raised
        msg = user_error(e)
        if msg is None:
            raise
        print(f"error: {msg}", file=sys.stderr)
        return 2
    return 0


def user_error(e: BaseException) -> str | None:
    """The one-line message for an error the user can act on; None for a bug (shown as a traceback)."""
    import errno
    import os

    from pydantic import ValidationError

    rank = f"rank {os.environ['RANK']}: " if "WORLD_SIZE" in os.environ and os.environ.get("WORLD_SIZE") != "1" else ""
    if isinstance(e, ValidationError):
        from .config.load import format_validation_error

        return rank + format_validation_error(e, e.title).replace("\n", "; ")
    if isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT):
        return (f"{rank}disk full while writing {e.filename or 'a file'}; free space (or point train.output_dir at "
                "another disk) and run again" + (f" - {e.moeadapt_hint}" if getattr(e, "moeadapt_hint", None) else ""))
    if isinstance(e, (IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)):
        return f"{rank}{e.strerror}: {e.filename}" + (f" ({e.moeadapt_hint})" if getattr(e, "moeadapt_hint", None) else "")
    if isinstance(e, (ValueError, FileNotFoundError, ImportError)):
        return f"{rank}{e}"
    if isinstance(e, RuntimeError) and type(e).__name__ == "TrainingError":
        return f"{rank}{e}"
    try:
        from torch.distributed import DistError
    except ImportError:  # pragma: no cover
        DistError = ()
    if rank and isinstance(e, (DistError, RuntimeError)) and any(
            w in str(e) for w in ("Connection", "connection", "closed", "NCCL", "Gloo", "gloo", "timed out", "Timeout")):
        first = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return (f"{rank}lost contact with another rank ({first}); a rank died or hung - torchrun's summary below "
                "names it; resume with train.resume=true")
    return None


if __name__ == "__main__":
    sys.exit(main())
