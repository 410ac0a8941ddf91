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
    if getattr(cfg, "text_config", None) is not None:  # a multimodal checkpoint: its text model is what we compare
        cfg = cfg.text_config
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


TIE = 1e-5  # indexer scores this close to the k-th (relative to max(1, |k-th|)) are ties


class _IndexerTies:
    """Aligns transformers' indexer selections with ours where they differ only in how ties are broken.

    The lightning indexer's ReLU makes equal scores common with few heads (a key scores exactly 0 for a query when
    every head's ReLU is 0); torch.topk breaks such ties arbitrarily, ours by the lower position. Our model runs
    first and records, per DSA layer, its scores and selection. When transformers' selection for a query holds
    only causal keys scoring within TIE of our k-th score (an equally correct top-k), ours replaces it, so the
    rest of the forward compares like with like; a selection holding any clearly lower-scored key is left alone
    and shows as a divergence at that layer."""

    def __init__(self, ours: nn.Module, hf: nn.Module, n: int):
        self.ours = {i: b.attn for i, b in enumerate(_blocks(ours, n))
                     if b.attn_type == "dsa" and b.attn.index_from is None}  # layers with an indexer of their own
        self.hf = {}
        for name, m in hf.named_modules():
            parts = name.split(".")
            if type(m).__name__.endswith("Indexer") and "layers" in parts:
                self.hf[int(parts[parts.index("layers") + 1])] = m
        self.scores: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.aligned = self.rows = 0

    @contextlib.contextmanager
    def active(self):
        handles = [a.register_forward_pre_hook(self._ours_hook(i), with_kwargs=True) for i, a in self.ours.items()
                   if i in self.hf]
        handles += [m.register_forward_hook(self._hf_hook(i)) for i, m in self.hf.items() if i in self.ours]
        try:
            yield
        finally:
            for h in handles:
                h.remove()

    def _ours_hook(self, i: int):
        from ..ops.dsa.reference import indexer_scores_reference, lightning_indexer_reference

        def hook(attn, args, kwargs):
            x = args[0]
            q_idx, k_idx, w_idx = attn.indexer(x, attn._queries(x)[1], kwargs["cos"], kwargs["sin"])
            sc = indexer_scores_reference(q_idx, k_idx, w_idx)[0]  # [T, T]
            T = sc.shape[0]
            sc = sc.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            self.scores[i] = sc, lightning_indexer_reference(q_idx, k_idx, w_idx, attn.spec.index_topk)[0]
        return hook

    def _hf_hook(self, i: int):
        def hook(_m, _args, out):
            if i not in self.scores or out.shape[0] != 1:
                return None
            sc, mine = self.scores.pop(i)
            T, K = sc.shape[0], out.shape[-1]
            theirs = out[0].long()
            pos = torch.arange(T)[:, None]
            full = pos[:, 0] + 1 <= K  # every causal key fits: any selection holding them all is the same
            kth = sc.topk(K, dim=-1).values[:, -1:]
            picked = sc.gather(1, theirs)
            ok = ((picked >= kth - TIE * kth.abs().clamp(min=1)) & (theirs <= pos)).all(1) & ~full
            mine = mine[:, :K].long()
            same = (mine.sort(1).values == theirs.sort(1).values).all(1)
            swap = ok & ~same
            self.rows += int((~full).sum())
            if not swap.any():
                return None
            self.aligned += int(swap.sum())
            return torch.where(swap[:, None], mine, theirs).to(out.dtype).unsqueeze(0)
        return hook


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
    ties = _IndexerTies(ours, hf, n) if has_indexer else None
    for L in lengths:
        ids = torch.randint(0, part.spec.vocab_size, (1, L), generator=g)
        h_ref: list[torch.Tensor] = []
        h_got: list[torch.Tensor] = []
        with torch.no_grad(), _record(hf_blocks, h_ref), _record(our_blocks, h_got), \
                (ties.active() if ties else contextlib.nullcontext()):
            got = ours(ids).logits.float()  # first: it records the indexer scores the tie check reads
            ref = hf(input_ids=ids, use_cache=False).logits.float()
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
            "per_layer": [tuple(x) for x in per_layer], "first_bad_layer": first, "where": where,
            "tie_aligned": (ties.aligned, ties.rows) if ties else None}
