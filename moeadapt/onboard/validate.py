"""Numerical validation of an onboarded checkpoint: the *given* weights in transformers and in moeadapt, compared.

Owns: building both models from the same checkpoint directory (all blocks, or the first N with embeddings, final
norm and head: the truncated transformers model is loaded from the same files), the random input (documents of
different lengths, each longer than the indexer's top-k where the family has an indexer), and the comparison of
every block's output and the logits in float32 (our ops on the reference backend). The first block whose output
differs by more than the tolerance is named. Must not write anything. transformers is an optional dependency:
only this module imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .families import Family, OnboardError, truncated

TOL = 1e-4  # max |logit difference| in float32; per block: max |Δh| / max(1, max |h|)


def _hf_config(path: Path, n_layers: int):
    import transformers

    try:
        cfg = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except (ValueError, KeyError) as e:
        raise OnboardError(f"transformers {transformers.__version__} cannot read {path}/config.json ({e}); "
                           "--validate needs a transformers version that implements this model_type") from None
    full = cfg.num_hidden_layers
    if n_layers < full:
        cfg.num_hidden_layers = n_layers
        for k, v in list(vars(cfg).items()):  # per-layer lists (layer_types, mlp_layer_types, ...)
            if isinstance(v, list) and len(v) == full and k not in ("architectures",):
                setattr(cfg, k, v[:n_layers])
    return cfg


def _hf_model(path: Path, fam: Family, n_layers: int) -> nn.Module:
    import transformers

    cfg = _hf_config(path, n_layers)
    cls = getattr(transformers, fam.hf_class or "", None) or transformers.AutoModelForCausalLM
    verbosity = transformers.logging.get_verbosity()
    transformers.logging.set_verbosity_error()  # the skipped layers >= N would each be reported as unexpected
    try:
        hf = cls.from_pretrained(str(path), config=cfg, dtype=torch.float32, attn_implementation="eager")
    finally:
        transformers.logging.set_verbosity(verbosity)
    return hf.float().eval()


def _blocks(model: nn.Module, n: int, exclude: tuple[str, ...] = ()) -> nn.ModuleList:
    """The decoder-layer list of a causal LM (the first ModuleList of length n named ...layers)."""
    for name, m in model.named_modules():
        if isinstance(m, nn.ModuleList) and name.endswith("layers") and len(m) == n and not name.startswith(exclude):
            return m
    raise OnboardError(f"no list of {n} decoder layers found in {type(model).__name__}")


@contextlib.contextmanager
def _record(blocks: nn.ModuleList, out: list[torch.Tensor]):
    def hook(_m, _args, output):
        out.append((output[0] if isinstance(output, tuple) else output).detach().float())

    handles = [b.register_forward_hook(hook) for b in blocks]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def default_seq_len(fam: Family) -> int:
    """Long enough that the indexer's top-k is smaller than the sequence (where the family has an indexer)."""
    s = fam.spec
    if "dsa" in s.resolved_layer_types() and not fam.dense_mla:
        return min(s.max_position_embeddings, s.index_topk + 24)
    return min(s.max_position_embeddings, 40)


def validate_checkpoint(path: str | Path, fam: Family, layers: int | None = None, seq_len: int | None = None,
                        seed: int = 0, tol: float = TOL,
                        tamper: Callable[[nn.Module], None] | None = None) -> dict:
    """Run transformers and moeadapt on the checkpoint's weights (the first `layers` blocks, default all) over
    three random documents of different lengths (the longest `seq_len` tokens) and compare every block's
    output and the logits. `tamper(our_model)` runs after loading (tests break our side on purpose).
    Returns a dict: passed, max_abs_diff (logits), per_layer [(max |Δh|, max |h|)], first_bad_layer, ..."""
    from ..models.model import build_model, materialize
    from .loader import StreamingLoader, checkpoint_index, load_into_model
    from .names import build_rules

    try:
        import transformers
    except ImportError as e:
        raise ImportError("--validate needs transformers (pip install 'moeadapt[dev]')") from e
    path = Path(path)
    if fam.model_type == "moeadapt":
        return {"family": "moeadapt", "passed": True, "max_abs_diff": None,
                "note": "moeadapt's own format: no transformers implementation to compare with"}
    n = layers or fam.spec.n_layers
    part = truncated(fam, n)
    T = seq_len or default_seq_len(part)
    has_indexer = "dsa" in part.spec.resolved_layer_types() and not part.dense_mla
    if has_indexer and T <= part.spec.index_topk:
        raise OnboardError(f"--seq-len {T} does not exceed index_topk={part.spec.index_topk}: the indexer would "
                           f"select every key; give --seq-len > {part.spec.index_topk}")
    if T > part.spec.max_position_embeddings:
        raise OnboardError(f"--seq-len {T} exceeds max_position_embeddings={part.spec.max_position_embeddings}")
    hf = _hf_model(path, part, n)
    ours = materialize(build_model(part.spec, "meta"), "cpu", dtype=torch.float32)
    load_into_model(ours, StreamingLoader(path, part, build_rules(part, checkpoint_index(path)), dtype=torch.float32))
    ours.set_backend("reference")
    ours.eval()
    if tamper is not None:
        tamper(ours)
    g = torch.Generator().manual_seed(seed)
    lengths = sorted({T, max(2, 2 * T // 3 - 1), max(2, T // 3 + 1)}, reverse=True)
    per_layer = [[0.0, 0.0] for _ in range(n)]  # max |Δh|, max |h_ref| over the documents
    logit_diff, logit_max = 0.0, 0.0
    hf_blocks, our_blocks = _blocks(hf, n), _blocks(ours, n)
    for L in lengths:
        ids = torch.randint(0, part.spec.vocab_size, (1, L), generator=g)
        h_ref: list[torch.Tensor] = []
        h_got: list[torch.Tensor] = []
        with torch.no_grad(), _record(hf_blocks, h_ref), _record(our_blocks, h_got):
            ref = hf(input_ids=ids, use_cache=False).logits.float()
            got = ours(ids).logits.float()
        for i, (a, b) in enumerate(zip(h_ref, h_got)):
            per_layer[i][0] = max(per_layer[i][0], (a - b).abs().max().item())
            per_layer[i][1] = max(per_layer[i][1], a.abs().max().item())
        logit_diff = max(logit_diff, (ref - got).abs().max().item())
        logit_max = max(logit_max, ref.abs().max().item())
    bad = [i for i, (d, m) in enumerate(per_layer) if not d / max(1.0, m) <= tol]  # NaN counts as bad
    passed = not bad and logit_diff <= tol
    first = bad[0] if bad else None
    where = (f"layer {first} ({part.spec.resolved_layer_types()[first]}) is the first to diverge: max |Δh| = "
             f"{per_layer[first][0]:.3g} (max |h| = {per_layer[first][1]:.3g})" if first is not None else
             ("the blocks agree; the final norm or lm_head diverges" if not passed else ""))
    return {"family": fam.model_type, "reference": f"transformers {transformers.__version__} {type(hf).__name__}",
            "layers": n, "of_layers": fam.spec.n_layers, "lengths": lengths, "seed": seed,
            "max_abs_diff": logit_diff, "max_abs_logit": logit_max, "tolerance": tol, "passed": bool(passed),
            "per_layer": [tuple(x) for x in per_layer], "first_bad_layer": first, "where": where}
