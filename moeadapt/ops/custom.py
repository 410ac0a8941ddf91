"""The eager fast path of our Triton custom ops: `traced`, `eager_or_op` (forward ops) and `impl_or_op` (backward ops).

The Triton kernels are torch.library custom ops (register_fake, register_autograd) so that torch.compile traces one
op each way and selective activation checkpointing (whose caching TorchDispatchMode keeps an op's outputs) sees one
op. In plain eager mode that costs the host: a custom op call, forward + backward, takes 170-270 µs more than a
torch.autograd.Function running the same implementation (the dispatcher and schema handling, the generated autograd
node redispatching below autograd, the backward going through a second custom op). A training step makes ~100-150
such calls: 20-35 ms of host time per step, on steps that are host-bound. (With stub implementations of
chunk_kda_fwd / _bwd's schemas on a CPU host, forward + backward: 247 µs through the ops, 129 µs here.)

So the ops' callers call what `eager_or_op` builds: when nothing traces or records the call (`traced` is False), a
plain autograd.Function around the op's own implementation, with the op's own setup_context and backward; otherwise
the custom op itself, exactly as registered (a dispatch mode sees dispatcher ops only: under SAC's mode the
Function's Triton launches would be invisible, so recomputed, and a fake tensor cannot run them). The backward
functions call their backward op through `impl_or_op` (the raw implementation in eager). The custom ops stay fully
registered: opcheck, torch.compile, SAC, fake tensors and dispatch modes see them as before.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable

import torch

_PLAIN = (torch.Tensor, torch.nn.Parameter)


def traced(*args) -> bool:
    """True where a call must go through the custom op: under torch.compile / export (compiled autograd included),
    under any TorchDispatchMode (SAC's caching and recompute modes, FakeTensorMode, make_fx, FlopCounterMode,
    DebugMode), inside a torch.func transform (grad, vmap, functionalize), or when a tensor argument is a subclass
    (FakeTensor, DTensor, FunctionalTensor), a torch.func wrapper (C++ wrappers look like plain tensors; a dead
    one outlives its transform) or on the meta device. Non-tensor arguments are ignored."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0
            or torch._C._functorch.peek_interpreter_stack() is not None):
        return True
    for a in args:
        if isinstance(a, torch.Tensor) and (type(a) not in _PLAIN or a.is_meta
                                            or torch._C._functorch.is_functorch_wrapped_tensor(a)):
            return True
    return False


def eager_or_op(op: torch.library.CustomOpDef, impl: Callable, setup_context: Callable, backward: Callable) -> Callable:
    """The callable a forward op's callers use, taking the op's arguments positionally and all of them
    (the op's setup_context unpacks every input): `op` where `traced`; else an autograd.Function running `impl`
    (the function the op was made from) with the op's `setup_context` and `backward` (those given to
    register_autograd), or `impl` alone where no gradient is asked for (as the op's autograd does: no
    setup_context then). The Function is the callable's `.Function`; its grad_fn is `<Function name>Backward`."""
    name = impl.__name__.strip("_").removesuffix("_impl")
    arity = len(inspect.signature(impl).parameters)
    fn = type(f"Eager_{name}", (torch.autograd.Function,), {
        "forward": staticmethod(impl),  # new style: no ctx in forward, setup_context saves what backward reads
        "setup_context": staticmethod(setup_context),
        "backward": staticmethod(backward),
    })
    # Function.apply's Python layer binds the arguments to forward's signature (inspect.signature, every call) and
    # handles torch.func transforms; with every argument given positionally and transforms sent to the op (traced),
    # what is left is the C++ apply under it, which runs forward, then setup_context: ~70 µs less host time a call
    # than Function.apply (measured on CPU with a 12-argument forward)
    apply = super(torch.autograd.Function, fn).apply

    @functools.wraps(impl)
    def call(*args):
        if len(args) != arity:
            raise TypeError(f"{name} takes its {arity} arguments positionally, got {len(args)}")
        if traced(*args):
            return op(*args)
        if torch.is_grad_enabled() and torch._C._any_requires_grad(*args):
            return apply(*args)
        return impl(*args)  # nothing to record (the Function would still run setup_context)

    call.Function = fn
    return call


def impl_or_op(op: torch.library.CustomOpDef, impl: Callable) -> Callable:
    """The callable a backward function uses for its backward op (which has no autograd of its own): `op` where
    `traced`, else `impl` directly."""

    @functools.wraps(impl)
    def call(*args):
        return op(*args) if traced(*args) else impl(*args)

    return call
