"""Helpers for tests/dist: spawn N gloo ranks on CPU, build the micro model, compare with one process."""

from __future__ import annotations

import copy
import os
import socket
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, fn, args) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    from moeadapt.parallel import init_distributed
    from moeadapt.parallel.mesh import shutdown_distributed

    init_distributed("cpu", timeout_s=float(os.environ.get("MOEADAPT_TEST_TIMEOUT", "120")))
    try:
        fn(rank, world, *args)
    finally:
        shutdown_distributed(barrier=False)  # a rank that raised must not wait for the others


def spawn(fn, world: int, *args) -> None:
    """Run fn(rank, world, *args) in `world` fresh processes (an exception in any rank fails the test)."""
    for p in (str(ROOT), str(Path(__file__).parent)):
        if p not in sys.path:
            sys.path.insert(0, p)
    mp.spawn(_entry, args=(world, free_port(), fn, args), nprocs=world, join=True)


def micro_spec(**kw):
    """tests/conftest.py's micro model (loaded by path: several conftest modules share that name)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("_moeadapt_tests_conftest", ROOT / "tests" / "conftest.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.micro_spec(**kw)


def build(spec, lora: bool, seed: int = 0):
    """The micro model in fp32 on CPU; with LoRA, B is made non-zero so that every adapter has a gradient."""
    from moeadapt.config import LoRASpec
    from moeadapt.lora import inject_lora, lora_modules
    from moeadapt.models.model import build_model, materialize

    model = materialize(build_model(spec, "meta"), "cpu", seed=seed)
    model.set_backend("reference")
    if lora:  # adapters draw A from the global RNG (the base init uses its own generator): same on every rank
        torch.manual_seed(seed + 2)
        inject_lora(model, LoRASpec(rank=4, alpha=8.0))
        g = torch.Generator().manual_seed(seed + 1)
        with torch.no_grad():
            for m in lora_modules(model).values():
                b = m.lora_B.weight if hasattr(m.lora_B, "weight") else m.lora_B
                b.copy_(torch.randn(b.shape, generator=g) * 0.05)
    return model


def batch(spec, rows: int, seq: int, seed: int = 123):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, spec.vocab_size, (rows, seq + 1), generator=g)
    return x[:, :-1].contiguous(), x[:, 1:].contiguous()


def skew_router(model, hot: tuple[int, ...] = (0, 1), bias: float = 10.0) -> None:
    """Send every token's choices to the experts in `hot` (with top-2 and hot = (0, 1): all rows go to the
    first EP rank, the others receive nothing)."""
    from moeadapt.models.router import Router

    for m in model.modules():
        if isinstance(m, Router):
            m.expert_bias[list(hot)] = bias


def expert_names(model) -> set[str]:
    from moeadapt.models.moe import GroupedExperts

    return {f"{mn}.{pn}" for mn, m in model.named_modules() if isinstance(m, GroupedExperts)
            for pn, _ in m.named_parameters()}


def full_grads(model, dims) -> dict[str, torch.Tensor]:
    """name -> full gradient of this rank's (expert-sliced) parameter."""
    from torch.distributed.tensor import DTensor

    out = {}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        g = p.grad
        out[n] = g.full_tensor() if isinstance(g, DTensor) else g
    return out


def reference(model, x, y, lora_path: str | None = None, **kw):
    """The single-process run on a copy; lora_path: every GroupedExperts' path there (e.g. "layers": each
    expert projection through grouped_lora on its own, a reference for lean_lora)."""
    ref = copy.deepcopy(model)
    if lora_path is not None:
        from moeadapt.models.moe import GroupedExperts

        for m in ref.modules():
            if isinstance(m, GroupedExperts):
                m.lora_path = lora_path
    out = ref(x, y, return_logits=False, **kw)
    (out.loss + out.aux_loss).backward()
    return ref, float(out.loss), {n: p.grad.clone() for n, p in ref.named_parameters() if p.grad is not None}


def check_against_reference(model, dims, out, world: int, ref_loss: float, ref_grads: dict, experts: set,
                            n_experts: int, what: str, tol: float) -> None:
    """This rank's loss (mean over ranks) and every gradient (gathered; experts sliced to this EP rank's) equal
    the single-process run's within `tol`. Collective."""
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    assert abs(float(loss) / world - ref_loss) < tol, f"{what}: loss {float(loss) / world} vs {ref_loss}"
    grads = full_grads(model, dims)
    assert set(grads) == set(ref_grads), f"{what}: grads for {sorted(set(grads) ^ set(ref_grads))[:4]}"
    ep = dims.spec.ep
    lo = dims.ep_rank * (n_experts // ep)
    for n, g in grads.items():
        r = ref_grads[n][lo:lo + n_experts // ep] if (n in experts and ep > 1) else ref_grads[n]
        err = (g - r).abs().max().item()
        assert err < tol, f"{what}: grad {n} differs by {err:.2e} (scale {r.abs().max().item():.2e})"
