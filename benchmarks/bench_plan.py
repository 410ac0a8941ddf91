"""The planner against measurements, two modes.

Accuracy on one GPU (the default): predicted vs measured peak memory of training steps of the `small` preset.
    python benchmarks/bench_plan.py [--preset small] [--json out.json] [--lora-only]
For each (seq_len, micro_batch, recompute, lora) setting it builds a fresh model (fp32 master weights, BF16
autocast, Triton kernels; LoRA: frozen BF16 base + fp32 adapters, as the trainer does), runs two AdamW steps and
reads `torch.cuda.max_memory_allocated` over the second (the optimizer state exists by then), and prints it next
to `moeadapt.plan.accuracy.predict_step` (single GPU: no FSDP / EP buffers, no allocator reserve). The step runs
as the trainer's does: autocast around the forward only, `return_logits=False`. Target: |error| <= 10%. Each
setting runs in a child process so one OOM does not end the sweep.

Live storages on CPU (`live`): which storages are live at the peak of a CPU training step (and at the end of
forward), by creating op, shape and module / op scope, next to the planner's per-layer prediction.
    python benchmarks/bench_plan.py live tiny|micro|gqa SEQ MB none|selective|full LORA_RANK [-v]
        [--kernel[=lean|fused|triton|torch]] [-f PREFIX]
Runs the step twice: the first finds the peak, the second snapshots the live set when it is reached. -v lists
the peak's tensors per module; -f PREFIX lists the end-of-forward tensors of modules starting with PREFIX.
--kernel: the GPU op path on CPU (TRITON_INTERPRET=1 is set; measure_step backend="kernel"), optionally forcing
the grouped LoRA backend; the prediction then uses the planner's kernel path in fp32.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
LIVE = sys.argv[1:2] == ["live"]
if LIVE:
    del sys.argv[1]
KERNEL = next((a for a in sys.argv if a.startswith("--kernel")), None) if LIVE else None
if KERNEL:  # before any Triton kernel is defined (triton.jit reads TRITON_INTERPRET then)
    os.environ["TRITON_INTERPRET"] = "1"
    sys.argv.remove(KERNEL)
KW = dict(backend="kernel", expert_lora=KERNEL.partition("=")[2] or None) if KERNEL else {}
import torch  # noqa: E402

from moeadapt.config import LoRASpec, get_preset  # noqa: E402
from moeadapt.plan import accuracy as A  # noqa: E402
from moeadapt.plan.accuracy import predict_step  # noqa: E402

SETTINGS = [  # seq_len, micro_batch, recompute, lora rank (0 = full training)
    (2048, 1, "none", 0),
    (4096, 1, "selective", 0),
    (4096, 2, "full", 0),
    (4096, 1, "none", 16),
    (2048, 4, "selective", 16),
    (8192, 1, "full", 16),
]


def one(preset: str, seq: int, mb: int, rc: str, rank: int, device: str = "cuda") -> dict:
    import torch

    from moeadapt.config import LoRASpec, get_preset
    from moeadapt.plan.accuracy import measure_step, predict_step

    spec = get_preset(preset)
    lora = LoRASpec(rank=rank) if rank else None
    pred = predict_step(spec, seq, mb, rc, lora, device=device)
    try:
        meas = measure_step(spec, seq, mb, rc, lora, device=device)["peak"]
    except torch.OutOfMemoryError:
        meas = float("nan")
    return {"seq_len": seq, "micro_batch": mb, "recompute": rc, "lora_rank": rank, "measured_GiB": meas / 2**30,
            "predicted_GiB": pred["total"] / 2**30, "error_pct": 100 * (pred["total"] / meas - 1),
            "predicted_peak_phase": pred["peak_phase"],
            "predicted_terms_GiB": {k: v / 2**30 for k, v in pred.items()
                                    if k not in ("total", "params_total", "params_trainable", "tokens_per_gpu", "peak_phase")}}


def accuracy_main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="small")
    ap.add_argument("--json", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script (use --preset tiny)")
    ap.add_argument("--scale", type=int, default=1, help="divide sequence lengths by this (dry runs)")
    ap.add_argument("--one", nargs=4, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lora-only", action="store_true", help="only the LoRA settings (the rows still owed a GPU check)")
    a = ap.parse_args()
    if a.one:
        seq, mb, rc, rank = a.one
        print(json.dumps(one(a.preset, int(seq), int(mb), rc, int(rank), a.device)))
        return
    import torch

    name = torch.cuda.get_device_name() if a.device == "cuda" else "cpu"
    print(f"torch {torch.__version__}, {name}, preset {a.preset}")
    print(f"{'seq':>6} {'mb':>3} {'recompute':>10} {'lora':>5} {'measured GiB':>13} {'predicted GiB':>14} {'error':>8}")
    rows = []
    for seq, mb, rc, rank in SETTINGS:
        if a.lora_only and not rank:
            continue
        seq //= a.scale
        p = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--device", a.device, "--one", str(seq),
                            str(mb), rc, str(rank)], capture_output=True, text=True)
        if p.returncode != 0:
            print(f"{seq:>6} {mb:>3} {rc:>10} {rank:>5}  failed: {p.stderr.strip().splitlines()[-1:]}")
            continue
        r = json.loads(p.stdout.strip().splitlines()[-1])
        rows.append(r)
        print(f"{seq:>6} {mb:>3} {rc:>10} {rank:>5} {r['measured_GiB']:>13.2f} {r['predicted_GiB']:>14.2f} "
              f"{r['error_pct']:>+7.1f}%")
    errs = [abs(r["error_pct"]) for r in rows if r["error_pct"] == r["error_pct"]]
    if errs:
        print(f"max |error| {max(errs):.1f}% (target 10%)")
    if a.json:
        Path(a.json).write_text(json.dumps(rows, indent=2))


# ---------------------------------------------------------------- live storages (mode `live`)
STACK = ["-"]


class Tagged(A.LiveBytes):
    def __init__(self, target=None, held=None):
        super().__init__(held)
        self.tags = {}
        self.target = target
        self.snap = None
        self.fwd = None

    def _on_new(self, func, t, key, n):
        self.tags[key] = (n, STACK[-1], str(func).replace("aten.", ""), tuple(t.shape), torch.is_grad_enabled())
        if self.target is not None and self.snap is None and self.live == self.target:
            self.snap = {k: self.tags[k] for k in self._seen}
            self.snap_op = (str(func), STACK[-1], tuple(t.shape))


def _scope(mod, name):
    fn = getattr(mod, name)

    def w(*a, **k):
        STACK.append(STACK[-1] + "/" + name)
        try:
            return fn(*a, **k)
        finally:
            STACK.pop()

    setattr(mod, name, w)


def _install_scopes() -> None:
    """Tag every storage with the op function of ours it was created under (the live mode only)."""
    import moeadapt.lora.layers as _L
    import moeadapt.models.dsa_attn as _D
    import moeadapt.models.kda_attn as _K
    import moeadapt.models.moe as _M

    for n in ("chunk_kda",):
        _scope(_K, n)
    for n in ("sparse_attention", "indexer_kl_loss", "lightning_indexer", "apply_rope"):
        _scope(_D, n)
    for n in ("permute", "unpermute", "grouped_mm"):
        _scope(_M, n)
    _scope(_L, "grouped_lora")


def run(spec, seq, mb, rc, rank, targets=None):
    lora = (LoRASpec(rank=rank, targets=targets) if targets else LoRASpec(rank=rank)) if rank else None
    orig = A.LiveBytes
    # hook module stack

    def pre(m, a):
        STACK.append(m._tag)

    def post(m, a, o):
        STACK.pop()
        if m._tag == "root" and holder and holder[-1].fwd is None:
            t = holder[-1]
            t.fwd = {k: t.tags[k] for k in t._seen}

    import moeadapt.models.model as MM

    res = {}
    for _pass in (0, 1):  # the second pass stops at the first pass's peak

        def mk():
            return Tagged(res.get("peak_live"))

        A.LiveBytes = mk
        torch.manual_seed(0)
        # patch materialize to add hooks
        real_mat = MM.materialize

        def mat(*a, **k):
            m = real_mat(*a, **k)  # noqa: B023 (bound in this pass)
            for name, mod in m.named_modules():
                parts = name.split(".")
                mod._tag = ".".join(parts[:4]) if name else "root"
                mod.register_forward_pre_hook(pre)
                mod.register_forward_hook(post)
            return m

        MM.materialize = mat
        holder = []

        def mk2(held=None):
            t = Tagged(res.get("peak_live"), held)
            holder.append(t)  # noqa: B023 (bound in this pass)
            return t

        A.LiveBytes = mk2
        r = A.measure_step(spec, seq, mb, rc, lora, **KW)
        MM.materialize = real_mat
        t = holder[-1]
        res["peak_live"] = t.peak
        res["meas"] = r["peak"]
    A.LiveBytes = orig
    pred = predict_step(spec, seq, mb, rc, lora, **KW)
    print(
        f"== {spec.name} seq={seq} mb={mb} {rc} lora={rank}: measured {res['meas'] / 1e6:.3f} MB predicted {pred['total'] / 1e6:.3f} MB err {100 * (pred['total'] / res['meas'] - 1):+.1f}%"
    )
    print(
        "  phase",
        pred["peak_phase"],
        " pred terms:",
        {
            k: round(v / 1e6, 3)
            for k, v in pred.items()
            if k not in ("params_total", "params_trainable", "tokens_per_gpu", "peak_phase")
        },
    )
    from moeadapt.plan.memory import layer_activation_bytes, param_counts

    pc = param_counts(spec, lora)
    la = pc.lora_targets if lora else (frozenset(),) * spec.n_layers
    fl = collections.Counter()
    for n, mod, _op, _shape, _ge in t.fwd.values():
        fl[".".join(mod.split(".")[:2]) if mod.startswith("layers") else mod] += n
    print("  end-of-forward kept by layer (measured / predicted MB):")
    for i in range(spec.n_layers):
        p = layer_activation_bytes(
            spec,
            i,
            seq * mb,
            seq,
            rc if rc != "full" else "none",
            4,
            "kernel" if KERNEL else "reference",
            lora is None,
            la[i],
            pc.lora_rank,
            KW.get("expert_lora"),
        )
        print(
            f"    layers.{i} {spec.resolved_layer_types()[i]} {fl[f'layers.{i}'] / 1e6:.3f} / {p / 1e6:.3f}"
        )
    print("    others", {k: round(v / 1e6, 3) for k, v in fl.items() if not k.startswith("layers")})
    if "-f" in sys.argv:
        by = collections.Counter()
        for n, mod, op, shape, _ge in t.fwd.values():
            if mod.startswith(sys.argv[-1]):
                by[(mod, op, shape)] += n
        for k, v in by.most_common():
            print("      ", round(v / 1e3, 1), "kB", *k)
    snap = t.snap
    by_mod = collections.Counter()
    by_op = collections.defaultdict(collections.Counter)
    for n, mod, op, shape, ge in snap.values():
        by_mod[mod] += n
        by_op[mod][(op, shape, "fwd" if ge else "bwd")] += n
    print(
        f"  live-at-peak (excluding params/opt state) {sum(by_mod.values()) / 1e6:.3f} MB, reached by",
        t.snap_op,
    )
    print(
        f"    created under grad mode (forward / recompute) {sum(v[0] for v in snap.values() if v[4]) / 1e6:.3f} MB,"
        f" in backward {sum(v[0] for v in snap.values() if not v[4]) / 1e6:.3f} MB"
    )
    for mod, n in sorted(by_mod.items()):
        print(f"  {mod:40s} {n / 1e6:8.3f}")
        if "-v" in sys.argv:
            for (op, shape, ph), b in by_op[mod].most_common():
                print(f"       {b / 1e3:9.1f} kB  {ph} {op} {shape}")


def live_main() -> None:
    _install_scopes()
    name, seq, mb, rc, rank = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
    targets = None
    if name == "gqa":  # the test's gqa model and its LoRA targets (q/k/v/o + experts)
        sys.path.insert(0, "tests/plan")
        from test_accuracy import GQA as spec
        from test_accuracy import GQA_LORA as targets  # noqa: F811
    elif name == "micro":
        sys.path.insert(0, "tests/plan")
        from test_accuracy import SPEC as spec
    else:
        spec = get_preset(name)
    run(spec, seq, mb, rc, rank, targets)

if __name__ == "__main__":
    live_main() if LIVE else accuracy_main()
