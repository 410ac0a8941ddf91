"""bf16 compute copies of the fp32 trained matmul weights for a one-process bf16 step: full fine-tuning's weights
and LoRA's adapters.

Under bf16 autocast every fp32 weight is cast to bf16 at its use in the forward and its bf16 gradient is cast
back to fp32 in the backward: 12 bytes moved per parameter per step, with no arithmetic (full fine-tuning of
`small`: ~17 ms of a ~250 ms step on one H100 / H200), and the fp32 gradients take 4 bytes per parameter. LoRA
trains fp32 adapters on a frozen bf16 base and casts them the same way: few bytes, but some 600 small cast and
copy kernels a step of `small`. `WeightCopies` keeps one bf16 copy of each trainable matmul weight instead (the
weights of nn.Linear and GroupedLinear modules, LoRALinear's lora_A / lora_B among them, and the grouped
experts' adapters, GroupedLoRALinear's lora_A / lora_B; not a weight two modules share, such as a tied
embedding), which the optimizer (`parallel.optim.CopyAdamW`) writes in the same pass that updates the weight.
The forward borrows them (`lent`): inside it each copied weight reads as its copy, through one autograd node
whose backward hands the bf16 gradients to the fp32 weights as they are (`Parameter.grad_dtype` None: no cast,
half the bytes).

The grouped experts' adapters are lent to their module (`GroupedLoRALinear.lent`) instead of taking the
parameters' place: the lean experts path (ops/moe/lean_lora.py) computes with the copies (all but the gate/up A:
GroupedExperts.forward_lean) but writes the adapters' gradients in fp32 from its K-grouped kernels (fp32
accumulation over the rows), which it must hand to the fp32 adapters themselves (through a bf16 tensor autograd
would round them to bf16). grad_dtype None keeps every gradient in the dtype its path makes it: bf16 through a
copy, fp32 from lean.

The step computes the same values as with autocast's casts: the copy is the round-to-nearest bf16 of the
weight, which is what autocast's cast (or the LoRA layers' own `.to(bf16)`) makes, the GEMMs are the same bf16
GEMMs, and the gradient the optimizer reads is the same tensor autograd would have cast up exactly (or, from
lean, the same fp32 one). Gradients that add up over several forwards would add in bf16, so `plan_copies`
takes this path only where the step has one forward. One difference in rounding: full fine-tuning's experts read
w1's and w3's copies as one [E, 2F, I] buffer (`gate_up_pairs`), so the input's gradient from gate and up is one
GEMM accumulating both in fp32, where two bf16 GEMM outputs were added.

`train.weight_dtype: bf16` or `fp32_split` (full fine-tuning) is the other way to a bf16 step: `store_bf16` keeps
the weights themselves in bf16 (no fp32 weight, no copy; CopyAdamW stores them stochastically rounded, or with
fp32_split keeps the 16 bits each drops in its state, so that the weights are fp32 ones exactly), and the experts'
w1 / w3 become the halves of one buffer in place of their copies'.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch import nn

from ..lora.layers import GroupedLoRALinear
from ..models.moe import GroupedExperts, GroupedLinear


def why_not(cfg, run, device: torch.device, model: nn.Module | None = None) -> str | None:
    """Why this run does not take bf16 weight copies (None: it does); with `model`, also whether CopyAdamW can
    step its trainable tensors (each contiguous, in its own 64-byte-aligned storage)."""
    t = cfg.train
    if not t.weight_copies:
        return "train.weight_copies is off"
    if run.world > 1:
        return "under torchrun FSDP2's mixed precision makes the bf16 compute copies"
    if device.type != "cuda" or t.dtype == "fp32":
        return "the step runs without bf16 autocast (CPU or train.dtype fp32)"
    if t.grad_accum_steps > 1:
        return "gradients of several micro-batches would add up in bf16 (train.grad_accum_steps > 1)"
    if cfg.parallel.activation_checkpointing != "none":
        return "recompute re-runs blocks after the forward has given the weights back"
    if not hasattr(nn.Parameter(torch.zeros(1)), "grad_dtype"):
        return f"torch {torch.__version__} has no Parameter.grad_dtype"
    if model is not None:
        for n, p in model.named_parameters():
            if p.requires_grad and (not p.is_contiguous() or p.data_ptr() % 64):
                return f"{n} is not contiguous in its own aligned storage, which the multi-tensor AdamW needs"
    return None


def copy_targets(model: nn.Module) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """(module, name, weight) of every trainable fp32 weight an nn.Linear or GroupedLinear multiplies by (a LoRA
    run: LoRALinear's lora_A / lora_B, which are nn.Linear, and GroupedLoRALinear's lora_A / lora_B), each used
    by that module only."""
    uses = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
    out = []
    for mod in model.modules():
        if not isinstance(mod, nn.Linear | GroupedLinear):
            continue
        for name in ("lora_A", "lora_B") if isinstance(mod, GroupedLoRALinear) else ("weight",):
            w = mod._parameters.get(name)
            if (w is not None and w.requires_grad and w.dtype == torch.float32 and w.is_contiguous()
                    and uses[id(w)] == 1):
                out.append((mod, name, w))
    return out


class _Lend(torch.autograd.Function):
    """Forward: the copies (as new tensors, so autograd can route their gradients). Backward: each copy's
    gradient is its weight's, unchanged."""

    @staticmethod
    def forward(ctx, copies, *weights):
        ctx.set_materialize_grads(False)
        return tuple(c.view_as(c) for c in copies)

    @staticmethod
    def backward(ctx, *grads):
        return (None, *grads)


class WeightCopies:
    """The bf16 copies of `targets`' weights (`copy_targets`), made from the weights here and by `refresh`.
    pairs (`gate_up_pairs`): (w1, w3) weights whose copies are the two row halves of one [E, 2F, I] buffer, so
    that the experts run gate and up as one GEMM each way (ops/moe/gate_up.py); CopyAdamW writes the halves."""

    def __init__(self, targets: list[tuple[nn.Module, str, nn.Parameter]], pairs=()):
        self.slots = [(m, n) for m, n, _ in targets]
        self.weights = [w for _, _, w in targets]
        halves = {}
        for w1, w3 in pairs:
            E, F, I = w1.shape
            buf = torch.empty(E, 2 * F, I, dtype=torch.bfloat16, device=w1.device)
            halves[w1], halves[w3] = buf[:, :F], buf[:, F:]
        self.copies = [halves[w] if w in halves else torch.empty_like(w, dtype=torch.bfloat16)
                       for w in self.weights]
        for w in self.weights:
            w.grad_dtype = None  # kept as it comes: bf16 through the copy, fp32 from lean (module docstring)
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        """Copies made afresh from the weights (after the weights were loaded or changed outside the optimizer)."""
        for c, w in zip(self.copies, self.weights):
            c.copy_(w)

    def by_weight(self) -> dict[nn.Parameter, torch.Tensor]:
        return dict(zip(self.weights, self.copies))

    @contextlib.contextmanager
    def lent(self):
        """Inside: every copied weight reads as its bf16 copy, whose gradient goes to the weight; the grouped
        experts' adapters stay in place and their copies are lent to their module (module docstring)."""
        views = _Lend.apply(self.copies, *self.weights)
        for (m, n), v in zip(self.slots, views):
            if isinstance(m, GroupedLoRALinear):
                m.lent[n] = v
            else:
                m._parameters[n] = v
        try:
            yield
        finally:
            for (m, n), w in zip(self.slots, self.weights):
                if isinstance(m, GroupedLoRALinear):
                    m.lent.pop(n, None)
                else:
                    m._parameters[n] = w


def _halves_in_blocks(w1: torch.Tensor) -> bool:
    """Each expert's [F, I] of w1 is a whole number of the optimizer kernel's blocks, so that CopyAdamW can update
    (or write the copy of) each half of a gate/up buffer in place (TensorTable's row_blocks)."""
    from ..ops.optim.triton_adamw import BLOCK

    return w1[0].numel() % BLOCK == 0


def gate_up_pairs(model: nn.Module, targets) -> list[tuple[nn.Parameter, nn.Parameter]]:
    """(w1, w3) weights of the grouped experts whose copies can share one [E, 2F, I] buffer: both copied, of one
    shape, each expert's [F, I] a whole number of the optimizer kernel's blocks (it writes each half in place)."""
    copied = {id(w) for _, _, w in targets}
    out = []
    for m in model.modules():
        if isinstance(m, GroupedExperts) and m.limit is None and not hasattr(m.w1, "lora_A"):
            w1, w3 = m.w1.weight, m.w3.weight
            if id(w1) in copied and id(w3) in copied and w1.shape == w3.shape and _halves_in_blocks(w1):
                out.append((w1, w3))
    return out


def why_not_bf16(cfg, run, device: torch.device) -> str | None:
    """Why this run cannot keep its trained weights as bf16 parameters (`train.weight_dtype: bf16` or
    `fp32_split`), as the message that names the fix; None where it can (or does not ask: fp32, or auto, which
    `resolve_weight_dtype` settles)."""
    t = cfg.train
    if t.weight_dtype in ("fp32", "auto"):
        return None
    return _bf16_params_refusal(cfg, run, device, t.weight_dtype)


def _bf16_params_refusal(cfg, run, device: torch.device, weights: str) -> str | None:
    t = cfg.train
    what, fix = f"train.weight_dtype: {weights}", "; set train.weight_dtype: fp32"
    if cfg.lora is not None:
        return f"{what} is for full fine-tuning (a LoRA run's adapters are few and stay fp32)" + fix
    if run.world > 1:
        return (f"{what} runs in one process; under torchrun FSDP2 shards fp32 weights and makes their bf16 "
                "compute copies" + fix)
    if device.type != "cuda" or t.dtype == "fp32":
        return (f"{what} needs a GPU and bf16 autocast (its update is a Triton GPU kernel); this run is on the CPU "
                "or has train.dtype fp32" + fix)
    if t.grad_accum_steps > 1 and not t.merge_microbatches:
        return (f"{what} would add the gradients of several micro-batches (train.grad_accum_steps > 1) in bf16; "
                "set train.merge_microbatches: true (one forward) or train.weight_dtype: fp32")
    return None


def resolve_weight_dtype(cfg, run, device: torch.device):
    """cfg with a concrete train.weight_dtype: `auto` (the default) is fp32_split where the run can keep its
    trained weights as bf16 parameters (full fine-tuning in one process on a GPU with bf16 autocast, one forward
    a step) and has train.weight_copies on, else fp32 (with its bf16 copies where `why_not` allows them). Both are
    fp32 weights: fp32_split keeps the bf16 half the matmuls read as the parameter itself (no copy, its residual
    stream in bf16 as under FSDP2's mixed precision) and the other half in the optimizer's state. Returns cfg
    itself when there is nothing to settle, else a copy."""
    t = cfg.train
    if t.weight_dtype != "auto":
        return cfg
    ok = t.weight_copies and _bf16_params_refusal(cfg, run, device, "fp32_split") is None
    return cfg.model_copy(update={"train": t.model_copy(update={"weight_dtype": "fp32_split" if ok else "fp32"})})


@torch.no_grad()
def store_bf16(model: nn.Module, lows: dict | None = None) -> int:
    """Full fine-tuning with `train.weight_dtype: bf16` / `fp32_split`: every trainable parameter cast to bf16
    in place (the Parameter objects kept, so optimizer, checkpoints and names are unchanged), and each grouped
    experts' w1 / w3 laid out as the two row halves of one gate/up buffer (`GroupedExperts.pair_weights`: one
    GEMM each way) where each expert's [F, L] is a whole number of the optimizer kernel's blocks (it updates the
    halves in place). No bf16 copy remains; CopyAdamW updates the bf16 weights in fp32 and stores them
    stochastically rounded, or with fp32_split keeps the 16 bits each drops (its state's `weight_lo`;
    ops/optim/reference.py). With `lows` (a dict; fp32_split) each fp32 weight is split exactly instead
    (`split_fp32`: the parameter its bf16 half) and its int16 low half put in `lows[parameter]`, for
    `CopyAdamW.seed_low_halves`: the run then starts from the fp32 weights themselves. The residual stream then
    runs in bf16 (the embedding's dtype), as in a LoRA run. The MoE routers' weights stay fp32 (updated as
    plain fp32 weights, as DeepSeek-V3 keeps its gating): their logits are fp32 (`router_matmul` bf16x2 reads 16 of
    the weight's mantissa bits) and pick the experts, and they are a few thousandths of the parameters. Returns the
    number of paired experts."""
    from ..models.router import router_weight_ids
    from ..ops.optim import split_fp32

    keep = router_weight_ids(model)
    for p in model.parameters():
        if p.requires_grad and p.is_floating_point() and p.dtype != torch.bfloat16 and id(p) not in keep:
            if lows is not None and p.dtype == torch.float32 and p.device.type != "meta":
                p.data, lows[p] = split_fp32(p.data)
            else:
                p.data = p.data.to(torch.bfloat16)
    return sum(bool(m.pair_weights()) for m in model.modules()
               if isinstance(m, GroupedExperts) and m.w1.weight.requires_grad and m.w3.weight.requires_grad
               and _halves_in_blocks(m.w1.weight))


def plan_copies(model: nn.Module, cfg, run, device: torch.device) -> WeightCopies | None:
    """The run's WeightCopies, or None where it does not take them (`why_not`)."""
    if why_not(cfg, run, device, model) is not None:
        return None
    targets = copy_targets(model)
    return WeightCopies(targets, gate_up_pairs(model, targets)) if targets else None
