"""Routing simulator: per-rank token loads and all-to-all volume under expert parallelism.

Owns: sampling token -> expert choices from a distribution (uniform, Zipf(s), or measured per-expert counts from
a run's metrics.jsonl), placing experts on EP ranks (contiguous blocks, as parallel/ does, or "spread": hot experts
dealt round-robin over ranks by load), applying capacity factors with a drop policy, and reporting per-rank
loads (mean, p99, max/mean = the straggler factor: the slowest rank sets the step time), the all-to-all
bytes per rank pair, and the token drop rate. Plots to PNG (written atomically). No torch.distributed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np


def expert_probs(dist: str, n_experts: int, layer: int | None = None, seed: int = 0) -> np.ndarray:
    """'uniform' | 'zipf:S' | path to a metrics.jsonl (per-expert `counts` of a MoE layer, summed over steps).
    Zipf ranks are shuffled over expert ids (hot experts are not all adjacent)."""
    if dist == "uniform":
        return np.full(n_experts, 1.0 / n_experts)
    if dist.startswith("zipf"):
        try:
            s = float(dist.split(":", 1)[1]) if ":" in dist else 1.0
        except ValueError:
            raise ValueError(f"--dist {dist!r}: the Zipf exponent must be a number, e.g. zipf:1.0") from None
        if not (s >= 0 and np.isfinite(s)):
            raise ValueError(f"--dist {dist!r}: the Zipf exponent must be >= 0 and finite, e.g. zipf:1.0")
        p = 1.0 / np.arange(1, n_experts + 1) ** s
        np.random.default_rng(seed).shuffle(p)
        return p / p.sum()
    path = Path(dist)
    if not path.is_file():
        raise ValueError(f"--dist {dist!r} is neither 'uniform', 'zipf:S' nor a metrics.jsonl file")
    total = None
    lines = path.read_text(errors="replace").split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):  # a torn last line (the run was cut off mid-write)
                break
            raise ValueError(f"{path}:{i}: not a JSON record; give a metrics.jsonl written by `moeadapt train`") from None
        if not isinstance(rec, dict):
            continue
        for m in rec.get("moe", []) or []:
            if "counts" in m and (layer is None or m["layer"] == layer):
                c = np.asarray(m["counts"], dtype=np.float64)
                total = c if total is None else total + c
    if total is None:
        raise ValueError(f"{path} has no per-expert `counts` in its moe records; the trainer logs them for runs "
                         "with at most 1024 experts (rerun, or use uniform / zipf:S)")
    if len(total) != n_experts:
        raise ValueError(f"{path} logs {len(total)} experts but --experts={n_experts}; pass --experts {len(total)}")
    return total / total.sum()


def placement(probs: np.ndarray, ep: int, mode: str = "contiguous") -> np.ndarray:
    """rank of each expert: contiguous blocks of E/ep, or 'spread' (experts sorted by load dealt in a
    snake order so every rank gets an equal share of hot and cold experts)."""
    E = len(probs)
    if E % ep:
        raise ValueError(f"ep={ep} does not divide the expert count {E}")
    if mode == "contiguous":
        return np.arange(E) // (E // ep)
    order = np.argsort(-probs)
    rank = np.empty(E, dtype=np.int64)
    for i, e in enumerate(order):
        r, lap = i % ep, i // ep
        rank[e] = r if lap % 2 == 0 else ep - 1 - r
    return rank


def sample_choices(probs: np.ndarray, tokens: int, top_k: int, seed: int = 0) -> np.ndarray:
    """[tokens, top_k] distinct experts per token, drawn by Gumbel-top-k from probs (what a router with these
    marginal preferences picks)."""
    rng = np.random.default_rng(seed)
    g = -np.log(-np.log(rng.random((tokens, len(probs)))))
    return np.argpartition(-(np.log(probs + 1e-30) + g), top_k - 1, axis=1)[:, :top_k]


def simulate(n_experts: int, top_k: int, ep: int, tokens: int, dist: str = "uniform", layer: int | None = None,
             latent: int = 3584, bytes_per_value: int = 2, capacity_factor: float | None = None,
             drop_policy: str = "probs", placement_mode: str = "contiguous", seed: int = 0,
             probs: np.ndarray | None = None) -> dict:
    """One step of routing `tokens` tokens (spread evenly over the ep source ranks)."""
    p = expert_probs(dist, n_experts, layer, seed) if probs is None else probs
    choices = sample_choices(p, tokens, top_k, seed)  # [T, K]
    counts = np.bincount(choices.ravel(), minlength=n_experts).astype(np.int64)
    dropped = 0
    kept_mask = np.ones_like(choices, dtype=bool)
    if capacity_factor is not None:
        cap = max(1, math.ceil(capacity_factor * tokens * top_k / n_experts))
        # priority within an expert: "probs" keeps the highest gate (here: random order of preference,
        # the sampled Gumbel rank stands in for the score), "position" keeps the earliest tokens
        rng = np.random.default_rng(seed + 1)
        flat = choices.ravel()
        pri = np.repeat(np.arange(tokens), top_k) if drop_policy == "position" else rng.random(flat.size)
        order = np.lexsort((pri, flat))
        sorted_e = flat[order]
        starts = np.searchsorted(sorted_e, np.arange(n_experts))
        rank_in = np.arange(flat.size) - starts[sorted_e]
        keep = np.empty(flat.size, dtype=bool)
        keep[order] = rank_in < cap
        kept_mask = keep.reshape(choices.shape)
        dropped = int((~keep).sum())
        counts = np.bincount(flat[keep], minlength=n_experts)
    rank_of = placement(p, ep, placement_mode)
    loads = np.bincount(rank_of, weights=counts, minlength=ep)  # token-choices each rank computes
    src = np.arange(tokens) * ep // tokens  # source rank of each token
    dst = rank_of[choices]
    pair = np.zeros((ep, ep))
    np.add.at(pair, (np.repeat(src, top_k)[kept_mask.ravel()], dst.ravel()[kept_mask.ravel()]), 1)
    pair_bytes = pair * latent * bytes_per_value
    off = pair_bytes[~np.eye(ep, dtype=bool)]
    mean = loads.mean()
    return {
        "experts": n_experts, "top_k": top_k, "ep": ep, "tokens": tokens, "dist": dist,
        "capacity_factor": capacity_factor, "drop_policy": drop_policy if capacity_factor else None,
        "placement": placement_mode,
        "rank_load_mean": float(mean), "rank_load_p99": float(np.quantile(loads, 0.99)),
        "rank_load_max": float(loads.max()), "straggler_factor": float(loads.max() / mean),
        "expert_load_max_over_mean": float(counts.max() / counts.mean()),
        "drop_rate": dropped / (tokens * top_k),
        "a2a_bytes_per_pair_mean": float(off.mean()), "a2a_bytes_per_pair_max": float(off.max()),
        "a2a_bytes_per_rank_max": float((pair_bytes.sum(0) - np.diag(pair_bytes)).max()),
        "rank_loads": loads.tolist(),
    }


def sweep(n_experts: int, top_k: int, ep: int, tokens: int, dist: str, layer: int | None = None,
          latent: int = 3584, bytes_per_value: int = 2, seed: int = 0) -> list[dict]:
    """Dropless vs capacity factors (1.0, 1.25, 1.5 with probs / position dropping) x contiguous vs spread."""
    p = expert_probs(dist, n_experts, layer, seed)
    out = []
    for pl in ("contiguous", "spread"):
        for cf, pol in ((None, "probs"), (1.0, "probs"), (1.25, "probs"), (1.5, "probs"), (1.25, "position")):
            out.append(simulate(n_experts, top_k, ep, tokens, dist, layer, latent, bytes_per_value, cf, pol, pl,
                                seed, probs=p))
    return out


def plot(results: list[dict], path: str | Path) -> Path:
    """Per-rank loads (dropless, contiguous vs spread) and straggler factor / drop rate per setting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4))
    for r in results:
        if r["capacity_factor"] is None:
            a.plot(r["rank_loads"], label=f"{r['placement']} (max/mean {r['straggler_factor']:.2f})")
    a.set_xlabel("EP rank")
    a.set_ylabel("token-choices per step")
    a.set_title(f"{results[0]['dist']}: E={results[0]['experts']} top-{results[0]['top_k']} EP{results[0]['ep']}")
    a.legend()
    labels = [f"{r['placement'][:6]} cf={r['capacity_factor'] or '-'}{'/' + r['drop_policy'][:3] if r['drop_policy'] else ''}"
              for r in results]
    x = np.arange(len(results))
    b.bar(x - 0.2, [r["straggler_factor"] for r in results], 0.4, label="straggler (max/mean)")
    b.bar(x + 0.2, [1 + 10 * r["drop_rate"] for r in results], 0.4, label="1 + 10 x drop rate")
    b.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
    b.axhline(1.0, color="k", lw=0.5)
    b.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=120)
    plt.close(fig)
    tmp.replace(path)
    return path
