"""Metrics: expert-load quantiles, JSONL / TensorBoard logging, and the PNG run report.

Expert load is reported per MoE layer as multiples of the mean tokens-per-expert: p50, p90, p99, max, min,
plus the share of experts that got no token and the token drop rate. The tail (p99, max) is what decides
the step time under expert parallelism, so it is first-class here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch


def load_quantiles(counts_E: torch.Tensor) -> dict[str, float]:
    c = counts_E.double().cpu()
    mean = c.mean().item()
    if mean <= 0:
        return {"p50": 0.0, "p90": 0.0, "p99": 0.0, "max": 0.0, "min": 0.0, "zero_frac": 1.0}
    r = c / mean
    q = torch.quantile(r, torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64))
    return {"p50": q[0].item(), "p90": q[1].item(), "p99": q[2].item(), "max": r.max().item(),
            "min": r.min().item(), "zero_frac": (c == 0).double().mean().item()}


class MetricsLogger:
    def __init__(self, out_dir: str | Path, tensorboard: bool = False):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.out_dir / "metrics.jsonl"
        _drop_torn_tail(self.path)
        self.tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise ImportError("train.tensorboard is on but the `tensorboard` package is missing; "
                                  "pip install tensorboard or set tensorboard: false") from e
            self.tb = SummaryWriter(str(self.out_dir / "tb"))

    def truncate_after(self, step: int) -> None:
        """Drop records past `step` (all of them for a fresh run), atomically."""
        if not self.path.exists():
            return
        keep = [r for r in read_metrics(self.path) if step > 0 and r.get("step", 0) <= step]
        tmp = self.path.with_name(".metrics.jsonl.tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in keep))
        tmp.replace(self.path)

    def log(self, rec: dict) -> None:
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
            f.flush()
        if self.tb is not None:
            step = rec.get("step", 0)
            for k, v in _flatten(rec).items():
                if isinstance(v, (int, float)) and k != "step" and math.isfinite(v):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()


class NullLogger:
    """The logger of ranks other than 0: only rank 0 writes metrics.jsonl."""

    path = None

    def log(self, rec: dict) -> None:
        pass

    def truncate_after(self, step: int) -> None:
        pass

    def close(self) -> None:
        pass


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "/"))
        elif isinstance(v, list) and v and isinstance(v[0], dict):
            for i, x in enumerate(v):
                out.update(_flatten(x, f"{key}/{x.get('layer', i)}/"))
        else:
            out[key] = v
    return out


def _drop_torn_tail(path: Path) -> None:
    """A record cut short (disk full, kill -9 mid-write) has no final newline: cut it off before appending."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    data = path.read_bytes()
    if data.endswith(b"\n"):
        return
    with path.open("r+b") as f:
        f.truncate(data.rfind(b"\n") + 1)


def read_metrics(path: str | Path) -> list[dict]:
    """The records of a metrics.jsonl; a torn last line (a write cut short) is left out, any other bad line
    is an error naming the file and line."""
    path = Path(path)
    text = path.read_bytes().decode("utf-8", errors="replace")
    lines = text.split("\n")
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError as e:
            if i == len(lines):  # no newline after it: the last write was cut short
                break
            raise ValueError(f"{path}:{i}: not a JSON record ({e.msg}); the file is damaged - remove that line "
                             "or start a new output_dir") from None
    return out


def plot_report(metrics_path: str | Path, out_png: str | Path, title: str = "") -> Path:
    """Loss curve (train + eval) and expert-load quantiles over steps, plus a layer x step max/mean heat map."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    recs = read_metrics(metrics_path)
    train = [r for r in recs if r.get("kind") == "train"]
    evals = [r for r in recs if r.get("kind") == "eval"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.6))
    ax = axes[0]
    if train:
        ax.plot([r["step"] for r in train], [r["loss"] for r in train], label="train loss")
    if evals:
        ax.plot([r["step"] for r in evals], [r["eval_loss"] for r in evals], "o--", label="eval loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy")
    ax.set_title("loss")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[1]
    moe_steps = [r for r in train if r.get("moe")]
    layers = sorted({m["layer"] for r in moe_steps for m in r["moe"]})
    steps = [r["step"] for r in moe_steps]
    for q, style in (("p50", ":"), ("p90", "-."), ("p99", "--"), ("max", "-")):
        for j, layer in enumerate(layers):
            ys = [next(m[q] for m in r["moe"] if m["layer"] == layer) for r in moe_steps]
            ax.plot(steps, ys, style, color=f"C{j}", label=f"L{layer} {q}" if q in ("max", "p99") else None)
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("tokens per expert / mean")
    ax.set_title("expert load quantiles (p50 : p90 -. p99 -- max -)")
    if layers:
        ax.legend(fontsize=7, ncol=2)
    ax.grid(alpha=0.3)

    ax = axes[2]
    if moe_steps and layers:
        grid = [[next(m["max"] for m in r["moe"] if m["layer"] == layer) for r in moe_steps] for layer in layers]
        # each column a logged step, centred on it (half a logging interval either side; one step: +-0.5)
        half = (steps[-1] - steps[0]) / (2 * (len(steps) - 1)) if len(steps) > 1 else 0.5
        im = ax.imshow(grid, aspect="auto", origin="lower", cmap="magma",
                       extent=(steps[0] - half, steps[-1] + half, -0.5, len(layers) - 0.5))
        ax.set_yticks(range(len(layers)), [f"L{layer}" for layer in layers])
        fig.colorbar(im, ax=ax, label="max / mean")
    ax.set_xlabel("step")
    ax.set_title("max/mean expert load, layer x step")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_png = Path(out_png)
    tmp = out_png.with_name(f".{out_png.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out_png)
    return out_png
