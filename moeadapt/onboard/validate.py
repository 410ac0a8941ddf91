"""Numerical validation of an onboarded checkpoint: the *given* weights in transformers and in moeadapt, compared.

Owns: building both models from the same checkpoint directory (all blocks, or the first N with embeddings, final
norm and head: the truncated transformers model is loaded from the same files), the random input (documents of
different lengths, each longer than the indexer's top-k where the family has an indexer), and the comparison of
every block's output and the logits in float32 (our ops on the reference backend). The first block whose output
differs by more than the tolerance is named. A vision-language family (a `vision` spec) runs on image + text
documents: random images of different sizes, laid out as the family's transformers processor writes them
(`_VISION_INPUTS`), their placeholder tokens in the text; the tower's parts (embedding, each block, final norm,
merger + projector) are compared as well and the first diverging part is named. The text model reads
transformers' image tokens in the compared run (`_feed_tokens`: float32 rounding of two towers, amplified by the
text blocks, would otherwise blur the text comparison); our end-to-end logits on the first document are reported
beside, not gated.
Must not write anything.
transformers is an optional dependency: only this module imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from .families import Family, OnboardError, truncated

TOL = 1e-4  # max |logit difference| in float32; per block: max |Δh| / max(1, max |h|)


def _hf_config(path: Path, n_layers: int, hf_class: str | None = None):
    import transformers

    try:
        cfg = transformers.AutoConfig.from_pretrained(str(path), trust_remote_code=False)
    except (ValueError, KeyError) as e:
        raise OnboardError(f"transformers {transformers.__version__} cannot read {path}/config.json ({e}); "
                           "--validate needs a transformers version that implements this model_type") from None
    text = getattr(cfg, "text_config", None) or cfg  # a multimodal config: the text model's own
    if (hf_class or "").endswith("ForCausalLM"):  # the text model alone is what we compare (Qwen3.5-MoE)
        cfg = text
    full = text.num_hidden_layers
    if n_layers < full:
        text.num_hidden_layers = n_layers
        for k, v in list(vars(text).items()):  # per-layer lists (layer_types, mlp_layer_types, ...)
            if isinstance(v, list) and len(v) == full and k not in ("architectures",):
                setattr(text, k, v[:n_layers])
    return cfg


def _hf_model(path: Path, fam: Family, n_layers: int) -> nn.Module:
    import transformers

    cfg = _hf_config(path, n_layers, fam.hf_class)
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
    and shows as a divergence at that layer. A KPool indexer (spec.index_kpool) is aligned the same way on its
    block scores: transformers' selected tokens are read back as blocks (the query's own incomplete block aside)."""

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
        kp = {i for i, a in self.ours.items() if a.kpool}
        handles = [a.register_forward_pre_hook((self._ours_kpool_hook if i in kp else self._ours_hook)(i),
                                               with_kwargs=True) for i, a in self.ours.items() if i in self.hf]
        handles += [m.register_forward_hook((self._hf_kpool_hook if i in kp else self._hf_hook)(i))
                    for i, m in self.hf.items() if i in self.ours]
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


    def _ours_kpool_hook(self, i: int):
        from ..ops.dsa import kpool_indexer
        from ..ops.dsa.reference import indexer_scores_reference, kpool_keys_reference

        def hook(attn, args, kwargs):
            x = args[0]
            q_idx, k_idx, w_idx = attn.indexer(x, attn._queries(x)[1], kwargs["cos"], kwargs["sin"])
            gate = attn.kpool_gate(x)
            sc = indexer_scores_reference(q_idx, kpool_keys_reference(k_idx, gate, attn.kpool_ape), w_idx)[0]
            P, T = attn.kpool, sc.shape[0]
            vis = torch.arange(sc.shape[1])[None] < ((torch.arange(T) + 1) // P)[:, None]
            mine = kpool_indexer(q_idx, k_idx, w_idx, gate, attn.kpool_ape, attn.spec.index_topk,
                                 attn.spec.index_kpool_select_tail)[0]
            self.scores[i] = sc.masked_fill(~vis, float("-inf")), mine, P, attn.spec.index_topk // P
        return hook

    def _hf_kpool_hook(self, i: int):
        def hook(_m, _args, out):
            if i not in self.scores or out.shape[0] != 1:
                return None
            sc, mine, P, kp = self.scores.pop(i)
            T, n = sc.shape
            theirs = out[0].long()
            swap = torch.zeros(T, dtype=torch.bool)
            for t in range(T):
                n_vis = (t + 1) // P
                k = min(kp, n_vis)
                if n_vis <= kp:  # every complete block fits: nothing to choose
                    continue
                self.rows += 1
                tok = theirs[t][(theirs[t] >= 0) & (theirs[t] < n_vis * P)]
                blocks = torch.unique(tok // P)
                ours = torch.unique(mine[t][(mine[t] >= 0) & (mine[t] < n_vis * P)].long() // P)
                kth = sc[t].topk(k).values[-1]
                swap[t] = (len(blocks) == k and not torch.equal(blocks, ours)
                           and bool((sc[t, blocks] >= kth - TIE * kth.abs().clamp(min=1)).all()))
            if not swap.any():
                return None
            self.aligned += int(swap.sum())
            return torch.where(swap[:, None], mine.long(), theirs).to(out.dtype).unsqueeze(0)
        return hook


def _kimi_k25_images(images: list[torch.Tensor], v) -> dict:
    """Kimi_K25ImageProcessor's output for images [C, H, W] already resized and normalised: pixel_values
    [N, C, p, p] (each image's patches in raster order, images one after another), image_grid_thw [I, 3]."""
    patch = v.patch_size
    px, grid = [], []
    for im in images:
        C, H, W = im.shape
        gh, gw = H // patch, W // patch
        px.append(im.reshape(C, gh, patch, gw, patch).permute(1, 3, 0, 2, 4).reshape(gh * gw, C, patch, patch))
        grid.append([1, gh, gw])
    return {"pixel_values": torch.cat(px), "image_grid_thw": torch.tensor(grid, dtype=torch.long)}


def _kimi_k25_parts(hf: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(part, transformers module, what its output holds) of the Kimi K2.5 vision side, in forward order."""
    vt, proj = hf.model.vision_tower, hf.model.mm_projector
    return ([("patch embedding + position table", vt.patch_embed, "patches")]
            + [(f"block {i}", b, "patches") for i, b in enumerate(vt.layers)]
            + [("final norm", vt.final_layernorm, "patches"), ("merger + projector", proj, "tokens")])


def _glm5_next_images(images: list[torch.Tensor], v) -> dict:
    """Glm5NextImageProcessor's output for images [C, H, W] already resized and normalised: pixel_values
    [N, C * T * p * p] (each image's patches in merge-block order, as ours, every patch repeated over the T
    frames of the Conv3d kernel after its channel), image_grid_thw [I, 3] (t = 1 for an image)."""
    from ..models.vision import patchify
    from .glm5_vision import glm5_next_pixel_values

    px = torch.cat([glm5_next_pixel_values(patchify(im, v.patch_size, v.merge_size), v) for im in images])
    grid = [[1, im.shape[1] // v.patch_size, im.shape[2] // v.patch_size] for im in images]
    return {"pixel_values": px, "image_grid_thw": torch.tensor(grid, dtype=torch.long)}


def _glm5_next_parts(hf: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(part, transformers module, what its output holds) of the GLM-5.3-Flash vision side, in forward order."""
    v = hf.model.visual
    return ([("patch embedding", v.patch_embed, "packed")]
            + [(f"block {i}", b, "packed") for i, b in enumerate(v.blocks)]
            + [("final norm", v.post_layernorm, "packed"), ("projector", v.merger, "tokens")])


# model_type -> (the processor's image inputs, the vision parts compared, ModuleList prefixes that are not the
# text model's decoder layers, the text tokens around each image's placeholders: config attribute names).
# A part holds "patches" (in raster order: permuted to ours before the comparison), "packed" (patches already in
# our merge-block order) or "tokens" (merged, projected image tokens).
_VISION_INPUTS = {
    "kimi_k25": (_kimi_k25_images, _kimi_k25_parts, ("model.vision_tower",),
                 ("vision_start_token_id", "vision_end_token_id")),
    "glm5_next": (_glm5_next_images, _glm5_next_parts, ("model.visual",),
                  ("image_start_token_id", "image_end_token_id")),
}


def _our_parts(ours: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Our vision modules in the order of `_kimi_k25_parts` (module, record its input instead of its output)."""
    v = ours.vision
    return ([(v.tower.blocks[0], True)] + [(b, False) for b in v.tower.blocks] + [(v.tower, False),
                                                                                  (v.projector, False)])


def _image_doc(spec, hf_cfg, L: int, n_images: int, g: torch.Generator, model_type: str):
    """A document of about L text tokens and `n_images` random images of different sizes, each image's
    placeholders (between the family's start / end tokens) at a random place: (input_ids [1, T], transformers'
    image kwargs, our ImageBatch)."""
    from ..models.vision import ImageBatch, patchify

    v = spec.vision
    make, _, _, around = _VISION_INPUTS[model_type]
    sides = [2, 4, 6]
    grids: list[tuple[int, int]] = []
    while len(grids) < n_images:
        gh, gw = (sides[int(i)] for i in torch.randint(0, 3, (2,), generator=g))
        if (gh, gw) not in grids:
            grids.append((gh, gw))
    images = [torch.randn(v.in_channels, gh * v.patch_size, gw * v.patch_size, generator=g) for gh, gw in grids]
    marks = [t for t in (getattr(hf_cfg, a, None) for a in around) if t is not None and t < spec.vocab_size]
    # no random text token may be a placeholder or open a video span (GLM tells images from video by the span)
    special = {v.image_token_id, *marks, *(getattr(hf_cfg, a, None) for a in (
        "video_token_id", "video_start_token_id", "video_end_token_id", "vision_start_token_id",
        "vision_end_token_id", "image_start_token_id", "image_end_token_id"))}
    text = [t for t in torch.randint(0, spec.vocab_size, (4 * L,), generator=g).tolist() if t not in special]
    n_text = max(n_images + 2, L - sum(gh * gw // 4 + len(marks) for gh, gw in grids))
    cuts = sorted(torch.randperm(n_text - 1, generator=g)[:n_images].add(1).tolist())
    ids, prev = [], 0
    for (gh, gw), cut in zip(grids, cuts):
        ids += text[prev:cut] + marks[:1] + [v.image_token_id] * (gh * gw // 4) + marks[1:]
        prev = cut
    ids += text[prev:n_text]
    ours = ImageBatch(torch.cat([patchify(im, v.patch_size, v.merge_size) for im in images]),
                      torch.tensor(grids, dtype=torch.long))
    return torch.tensor([ids]), make(images, v), ours


def _raster_to_ours(grid_hw: torch.Tensor, merge: int) -> torch.Tensor:
    """Index into patches in raster order (image by image) that gives them in our packed order."""
    from ..models.vision import patch_positions

    out, off = [], 0
    for (h, w), pos in zip(grid_hw.tolist(), patch_positions(grid_hw, merge).split(
            (grid_hw[:, 0] * grid_hw[:, 1]).tolist())):
        out.append(off + pos[:, 0] * w + pos[:, 1])
        off += h * w
    return torch.cat(out)


@contextlib.contextmanager
def _feed_tokens(ours: nn.Module, tokens: torch.Tensor):
    """Our projector's output replaced by `tokens` (transformers' image tokens of the same images): the text
    model and the placement of the image tokens are then compared on the same input. Float32 rounding makes the
    two towers' tokens differ by ~1e-6 relative, which a text model's blocks amplify (GLM-5.3's KDA layers: up to
    ~1e-4 in the logits of tiny random checkpoints); the towers themselves are compared part by part."""
    def hook(_m, _args, out):
        if out.shape != tokens.shape:
            raise OnboardError(f"our projector gives {tuple(out.shape)} image tokens, transformers "
                               f"{tuple(tokens.shape)}: the merger / projector map is wrong")
        return tokens.to(out.dtype)

    h = ours.vision.projector.register_forward_hook(hook)
    try:
        yield
    finally:
        h.remove()


@contextlib.contextmanager
def _record_vision(hf: nn.Module, ours: nn.Module, model_type: str, got_hf: list, got_ours: list):
    def keep(dst):
        def hook(_m, args, output=None):
            t = args[0] if output is None else output
            dst.append((t[0] if isinstance(t, tuple) else t).detach().float())
        return hook

    handles = [m.register_forward_hook(keep(got_hf)) for _, m, _ in _VISION_INPUTS[model_type][1](hf)]
    handles += [m.register_forward_pre_hook(keep(got_ours)) if pre else m.register_forward_hook(keep(got_ours))
                for m, pre in _our_parts(ours)]
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
    vis = _VISION_INPUTS.get(fam.model_type) if part.spec.vision is not None else None
    if part.spec.vision is not None and vis is None:
        raise OnboardError(f"--validate has no image inputs for {fam.model_type}; add them to validate._VISION_INPUTS")
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
    logit_diff, logit_max, e2e_diff = 0.0, 0.0, 0.0
    hf_blocks, our_blocks = _blocks(hf, n, exclude=vis[2] if vis else ()), _blocks(ours, n)
    ties = _IndexerTies(ours, hf, n) if has_indexer else None
    parts = [[label, 0.0, 0.0] for label, _, _ in vis[1](hf)] if vis else []  # vision: max |Δ|, max |h_ref|
    for d, L in enumerate(lengths):
        h_ref: list[torch.Tensor] = []
        h_got: list[torch.Tensor] = []
        v_ref: list[torch.Tensor] = []
        v_got: list[torch.Tensor] = []
        if vis:  # two images of different sizes in the first and last document, one in the middle one
            ids, hf_images, images = _image_doc(part.spec, hf.config, L, 1 if d == 1 else 2, g, fam.model_type)
            with torch.no_grad():  # transformers' image tokens: our text model reads them too (see below)
                hf_tokens = torch.cat(hf.model.get_image_features(**hf_images).pooler_output).float()
            seen = contextlib.ExitStack()
            seen.enter_context(_record_vision(hf, ours, fam.model_type, v_ref, v_got))
            seen.enter_context(_feed_tokens(ours, hf_tokens))  # after the recorder: it records our own tokens
        else:
            ids, hf_images, images, seen = (torch.randint(0, part.spec.vocab_size, (1, L), generator=g), {}, None,
                                            contextlib.nullcontext())
        with torch.no_grad(), _record(hf_blocks, h_ref), _record(our_blocks, h_got), seen, \
                (ties.active() if ties else contextlib.nullcontext()):
            got = ours(ids, images=images).logits.float()  # first: it records the indexer scores the tie check reads
            ref = hf(input_ids=ids, use_cache=False, **hf_images).logits.float()
        if vis:
            perm = _raster_to_ours(images.grid_hw, part.spec.vision.merge_size)
            for (_, _, holds), part_row, a, b in zip(vis[1](hf), parts, v_ref, v_got, strict=True):
                a = a[perm] if holds == "patches" else a.reshape(b.shape)
                part_row[1] = max(part_row[1], (a - b).abs().max().item())
                part_row[2] = max(part_row[2], a.abs().max().item())
        for i, (a, b) in enumerate(zip(h_ref, h_got)):
            per_layer[i][0] = max(per_layer[i][0], (a - b).abs().max().item())
            per_layer[i][1] = max(per_layer[i][1], a.abs().max().item())
        logit_diff = max(logit_diff, (ref - got).abs().max().item())
        logit_max = max(logit_max, ref.abs().max().item())
        if vis and d == 0:  # our model end to end (the longest document, two images): its own image tokens
            with torch.no_grad():
                own = ours(ids, images=images).logits.float()
            e2e_diff = max(e2e_diff, (ref - own).abs().max().item())
    bad = [i for i, (d, m) in enumerate(per_layer) if not d / max(1.0, m) <= tol]  # NaN counts as bad
    bad_parts = [p for p in parts if not p[1] / max(1.0, p[2]) <= tol]
    # The logits are gated like the blocks, relative to max(1, max |logit|): float32 rounding grows through the
    # layers, so a correct model with logits of ~5 can differ by a little more than tol in absolute terms.
    logit_rel_diff = logit_diff / max(1.0, logit_max)
    passed = not bad and not bad_parts and logit_rel_diff <= tol  # NaN fails
    first = bad[0] if bad else None
    where = (f"layer {first} ({part.spec.resolved_layer_types()[first]}) is the first to diverge: max |Δh| = "
             f"{per_layer[first][0]:.3g} (max |h| = {per_layer[first][1]:.3g})" if first is not None else
             ("the blocks agree; the final norm or lm_head diverges" if not passed else ""))
    if bad_parts:  # the images go in before the first block: a vision part diverging explains what follows
        where = (f"the vision {bad_parts[0][0]} is the first part to diverge: max |Δh| = {bad_parts[0][1]:.3g} "
                 f"(max |h| = {bad_parts[0][2]:.3g})")
    return {"family": fam.model_type, "reference": f"transformers {transformers.__version__} {type(hf).__name__}",
            "layers": n, "of_layers": fam.spec.n_layers, "lengths": lengths, "seed": seed,
            "max_abs_diff": logit_diff, "max_abs_logit": logit_max,
            "logit_rel_diff": logit_rel_diff, "tolerance": tol, "passed": bool(passed),
            "per_layer": [tuple(x) for x in per_layer], "first_bad_layer": first, "where": where,
            "tie_aligned": (ties.aligned, ties.rows) if ties else None,
            "vision_parts": [tuple(p) for p in parts], "first_bad_part": bad_parts[0][0] if bad_parts else None,
            "max_abs_diff_end_to_end": e2e_diff if vis else None}
