"""The step's forwards and backwards captured once as a CUDA graph and replayed (`train.cuda_graph`: auto, the
default, captures where `resolve_cuda_graph` finds nothing against it; true requires it; false never).

Issuing a step costs the host about as much as the GPU takes to run it (~5,000 kernel launches and autograd's
bookkeeping for the `small` preset), so the host bounds the step. A replay issues the same kernels in one call.
A replay repeats the captured step exactly, so it needs: one process (no FSDP hooks, no expert-parallel retry),
the same shapes every step (every batch is micro_batch_size x seq_len), and no per-batch values on the host
(packed documents' boundaries, images). The forward and backward already make no host sync
(tests/gpu/test_no_sync_gpu.py), which capture requires.

The first WARMUP steps run eagerly (kernels compile and autotune). The next one is captured: with every gradient
None, the captured backward allocates the gradients in the graph's memory pool and each replay writes them
afresh; the trainer drops them after the optimizer step (zero_grad(set_to_none=True)), so they are handed back
to the parameters after every replay. The step's inputs are copied into the captured input buffers; its loss,
finiteness, auxiliary losses and MoE counts are the captured outputs, valid until the next replay (the trainer
reads them, on the device, before that). What the captured kernels read from outside the graph's pool must stay
where it is: the weights (updated in place), the router biases, the ops' cached index tensors (one entry per
batch shape: only packed documents, refused here, would make enough to evict one).

A capture that fails (an op that reads a value on the host, or one that cannot be captured) stops the run under
`auto` as under `true`, with the op's error and the fix: it does not go on eagerly, because on torch 2.11 a failed
capture leaves the process's CUDA random-number state unusable (the next random op raises "Offset increment outside
graph capture") and keeps the half-made graph's memory pool (benchmarks/RESULTS.md, the end-to-end section's
tried list).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ..ops.host import to_device
from .errors import TrainingError

WARMUP = 2  # eager steps before the capture: Triton autotuning and torch.compile must not run inside it


def check_graphable(cfg, run) -> str | None:
    """Why `train.cuda_graph` cannot be used with this run (None: it can)."""
    if run.world > 1:
        return "it replays one process's step: run without torchrun (FSDP and expert parallelism hook the step)"
    if run.device.type != "cuda":
        return f"it needs a CUDA device (train.device resolves to {run.device.type})"
    if cfg.data.pack_documents:
        return ("packed documents put each batch's boundaries on the host, which a replay cannot change: set "
                "data.pack_documents: false")
    if cfg.model.vision is not None:
        return "images change shape from batch to batch: train vision-language models without it"
    if cfg.parallel.offload_activations:
        return ("offloaded activations wait in host buffers made during the step, which a replay cannot keep: "
                "set parallel.offload_activations: false")
    if cfg.model.capacity_factor is not None:
        return ("an expert capacity (model.capacity_factor) makes each step's routed row count a value the host "
                "reads: set model.capacity_factor: null (dropless)")
    if cfg.parallel.activation_checkpointing != "none" and cfg.lora is not None and cfg.lora.dropout > 0:
        return ("the recompute replays LoRA's dropout masks from the CUDA RNG state, which cannot be read while a "
                "step is captured: set lora.dropout: 0 or parallel.activation_checkpointing: none")
    return None


def resolve_cuda_graph(cfg, run) -> tuple[bool, str | None]:
    """(capture the step?, why not): train.cuda_graph true must be servable (TrainingError naming the reason
    and the fix); auto captures what check_graphable allows except the reference kernels (some of their ops read
    values on the host, which a capture cannot; activation recompute, full or selective, captures:
    tests/gpu/test_cuda_graph_gpu.py replays it); false never."""
    mode = cfg.train.cuda_graph
    if mode is False:
        return False, "train.cuda_graph: false"
    why = check_graphable(cfg, run)
    if mode is True:
        if why:
            raise TrainingError(f"train.cuda_graph: {why}")
        return True, None
    if why is None and cfg.train.kernel_backend == "reference":
        why = "train.kernel_backend is 'reference'"
    return why is None, why


class StepGraph:
    """`fwd_bwd(batches)` -> (stats, finite), eagerly for the first WARMUP calls, then captured and replayed."""

    def __init__(self, params: list[torch.nn.Parameter], fwd_bwd: Callable, device: torch.device):
        self.params, self.fwd_bwd, self.device = params, fwd_bwd, device
        self.calls = 0
        self.graph: torch.cuda.CUDAGraph | None = None
        self.inputs: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.grads: list[torch.Tensor | None] = []
        self.out = None

    def __call__(self, batches: list[tuple]):
        self.calls += 1
        if any(v is not None for _, _, extra in batches for v in extra.values()):
            raise TrainingError("train.cuda_graph: a batch carries position_ids or images, which a replay cannot "
                               "change; set train.cuda_graph: false")
        if self.calls <= WARMUP:
            return self.fwd_bwd(batches)
        if self.graph is None:
            self._capture(batches)
        else:
            for (sx, sy), (x, y, _) in zip(self.inputs, batches):
                sx.copy_(to_device(x, self.device))
                sy.copy_(to_device(y, self.device))
        self.graph.replay()
        for p, g in zip(self.params, self.grads):
            p.grad = g
        st, finite = self.out
        return type(st)(loss=st.loss, grad_norm=st.grad_norm, tokens=st.tokens, aux=dict(st.aux),
                        counts=dict(st.counts), drops=dict(st.drops)), finite

    def release(self) -> None:
        """Drop the captured graph and everything in its memory pool (the trainer has dropped the gradients after
        the last optimizer step), and hand the pool's memory back to the device; the caller runs eagerly after."""
        self.graph, self.grads, self.inputs, self.out = None, [], [], None
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()

    def _capture(self, batches: list[tuple]) -> None:
        if any(p.grad is not None for p in self.params):
            raise TrainingError("train.cuda_graph: gradients are held before the capture; the trainer drops them "
                               "after every optimizer step")
        self.inputs = [(to_device(x, self.device).clone(), to_device(y, self.device).clone()) for x, y, _ in batches]
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the eager steps' cached blocks: the graph's pool cannot reuse them
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, capture_error_mode="thread_local"):
                self.out = self.fwd_bwd([(sx, sy, {}) for sx, sy in self.inputs])
        except Exception as e:
            # an op that cannot be captured invalidates the capture, and ending it then raises again: the first
            # error is the one that names the op
            first = e.__context__ if isinstance(e.__context__, Exception) else e
            line = (str(first).strip().splitlines() or [""])[0]
            raise TrainingError(f"train.cuda_graph: capturing the step failed ({type(first).__name__}: {line}); "
                                "set train.cuda_graph: false to run the steps eagerly") from e
        self.grads = [p.grad for p in self.params]
        self.graph = graph
