"""Predicted vs measured peak memory of one training step, on any device.

Measurement on CPU (torch has no CPU allocator statistics): a TorchDispatchMode that sees every tensor an op
creates and keeps a running sum of *live storage bytes* (each storage counted once when it first appears,
uncounted when Python's weakref finalizer reports it freed); the peak of that sum plus the bytes already live
when the step starts (parameters) is the CPU analogue of `torch.cuda.max_memory_allocated` (no allocator
rounding or fragmentation, which the model's `reserve` term covers on GPU). On CUDA the same function reads
`torch.cuda.max_memory_allocated` instead.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..config import LoRASpec, ModelSpec
from .memory import Plan, memory_breakdown


class LiveBytes(TorchDispatchMode):
    """Running and peak bytes of storages created under the mode (each storage once)."""

    def __init__(self, held: set[int] | None = None):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: set[int] = set()
        # storages already live before the mode (parameters, optimizer state): a view of one (w.t(), a
        # transposed expert weight saved for backward) is not new memory and must not be counted again
        self._held = set(held or ())

    def _free(self, key: int, n: int) -> None:
        self._seen.discard(key)
        self.live -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                st = t.untyped_storage()
                key, n = st.data_ptr(), st.nbytes()
                if n == 0 or key in self._seen or key in self._held:
                    continue
                self._seen.add(key)
                self.live += n
                self.peak = max(self.peak, self.live)
                weakref.finalize(st, self._free, key, n)
                self._on_new(func, t, key, n)
        return out

    def _on_new(self, func, t: torch.Tensor, key: int, n: int) -> None:
        """Called for each newly counted storage (a hook for tools that tag what is live)."""


def measure_step(spec: ModelSpec, seq_len: int, micro_batch: int, recompute: str, lora: LoRASpec | None,
                 device: str = "cpu", seed: int = 0, backend: str | None = None, expert_lora: str | None = None) -> dict:
    """One forward + backward + AdamW step of a fresh model; returns measured peak bytes and the split.

    backend: None = "reference" on CPU, "auto" on CUDA; "kernel" on CPU runs the GPU's op choice in fp32 under
    TRITON_INTERPRET=1 (`set_kernel_backends`: Triton KDA / DSA / permute, torch._grouped_mm experts, the
    grouped LoRA backend CUDA's "auto" would take, or `expert_lora`) so the planner's kernel path can be
    checked on CPU."""
    from ..lora import cast_frozen_, inject_lora
    from ..models.model import build_model, materialize
    from ..parallel.activation import apply_activation_checkpointing

    torch.manual_seed(seed)
    dtype = torch.float32
    model = materialize(build_model(spec, "meta"), device, seed=seed, dtype=dtype)
    model.set_backend("reference" if device == "cpu" else "auto")
    if lora is not None:
        inject_lora(model, lora)
        if device == "cuda":
            cast_frozen_(model, torch.bfloat16)
    if backend == "kernel" and device == "cpu":
        set_kernel_backends(model, micro_batch * seq_len, expert_lora)
    if recompute != "none":
        apply_activation_checkpointing(model, recompute)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, foreach=False)
    ids = torch.randint(0, spec.vocab_size, (micro_batch, seq_len), device=device)
    labels = torch.randint(0, spec.vocab_size, (micro_batch, seq_len), device=device)
    base = sum(t.untyped_storage().nbytes() for t in {id(x): x for x in [*model.parameters(), *model.buffers()]}.values())
    if device == "cuda":  # autocast around the forward only, as the trainer does (its cast cache ends there)
        _step(model, opt, ids, labels, autocast=True)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _step(model, opt, ids, labels, autocast=True)
        torch.cuda.synchronize()
        return {"peak": torch.cuda.max_memory_allocated(), "params": base}
    _step(model, opt, ids, labels)  # the first step creates the optimizer state; measure the second
    held = base + sum(s.untyped_storage().nbytes() for st in opt.state.values() for s in st.values()
                      if isinstance(s, torch.Tensor))
    held_ptrs = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    held_ptrs |= {s.untyped_storage().data_ptr() for st in opt.state.values() for s in st.values()
                  if isinstance(s, torch.Tensor)}
    mode = LiveBytes(held_ptrs)
    with mode:
        _step(model, opt, ids, labels)
    return {"peak": mode.peak + held, "params": base}


def set_kernel_backends(model, tokens: int, expert_lora: str | None = None) -> None:
    """The op choice CUDA's "auto" makes, forced on a CPU model (Triton ops need TRITON_INTERPRET=1): Triton
    attention kernels and MoE permute / combine, torch._grouped_mm for plain expert GEMMs, and for grouped LoRA
    layers `expert_lora` or what ops/moe `expert_lora_path` picks for tokens x top-k / E rows per expert.
    expert_lora "lean" runs the layers "fused" with lean_lora where it applies; "fused" the fused GEMM (with
    its folded input passes) and never lean (the planner's `expert_lora` means the same)."""
    from ..lora.layers import GroupedLoRALinear
    from ..models.moe import GroupedExperts, GroupedLinear
    from ..ops.moe import expert_lora_path

    model.set_backend("triton")
    spec = model.spec
    rows = tokens * spec.n_experts_per_tok / max(spec.n_routed_experts, 1)
    for m in model.modules():
        if isinstance(m, GroupedExperts):
            m.lora_path = "fold" if expert_lora == "fused" else "auto"
        if isinstance(m, GroupedLoRALinear):
            forced = {"lean": "fused"}.get(expert_lora, expert_lora)
            m.backend = forced or expert_lora_path(rows, cuda=True, fused_buffer=m.cat_weight(m.weight.dtype) is not None)
        elif isinstance(m, GroupedLinear):
            m.backend = "torch"


def _step(model, opt, ids, labels, autocast: bool = False) -> None:
    import contextlib

    opt.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16) if autocast else contextlib.nullcontext():
        out = model(ids, labels=labels, return_logits=False)  # as the trainer calls it
    (out.loss + out.aux_loss).backward()
    opt.step()


def predict_step(spec: ModelSpec, seq_len: int, micro_batch: int, recompute: str, lora: LoRASpec | None,
                 device: str = "cpu", backend: str | None = None, expert_lora: str | None = None) -> dict:
    """The planner's prediction for the same single-device step (no FSDP, no EP, no reserve). device="cuda"
    needs no GPU (bf16 autocast, kernel path); device="cpu" with backend="kernel" predicts measure_step's CPU
    emulation of the kernel path (fp32)."""
    cpu = device == "cpu"
    plan = Plan(1, 1, 1, 1, 1, recompute, micro_batch, seq_len)
    backend = backend or ("reference" if cpu else "kernel")
    return memory_breakdown(spec, plan, lora, act_bytes=4 if cpu else 2, backend=backend,
                            reserve_frac=0.0, context_bytes=0.0, base_bytes=4 if cpu else 2, expert_lora=expert_lora)
