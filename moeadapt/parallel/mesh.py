"""Process-group start-up and the device meshes every other part of parallel/ works on (DESIGN.md §4).

Owns: `init_distributed` (backend by device: gloo on CPU, NCCL on GPU; a finite process-group timeout so
a dead rank ends the job with an error instead of a hang), `shutdown_distributed` (leaving the group so that
the process exits cleanly) and `ParallelDims`, which derives every mesh dimension from a `ParallelSpec` and
validates it in one place.

Rank layout (row-major, last dim fastest):
  dense mesh   ("dp_replicate", "dp_shard", "cp")        non-expert parameters (FSDP / HSDP)
  expert mesh  ("dp_replicate", "dp_shard_in_ep", "ep")  experts: E/ep per EP rank, FSDP over dp_shard_in_ep
Both hold the same ranks, and ep * dp_shard_in_ep = dp_shard * cp, so an EP group is `ep` consecutive ranks
(one NVLink island on a node when ep <= GPUs per node) and the groups are orthogonal.
Must not touch the model; parallelize.py applies the meshes to one.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from ..config import ModelSpec, ParallelSpec
from ..ops.cp_comm import CPLayout

DEFAULT_TIMEOUT_S = 600


def init_distributed(device: torch.device | str | None = None, timeout_s: float | None = None) -> torch.device:
    """Join the process group that torchrun describes (RANK / WORLD_SIZE / MASTER_ADDR in the environment).

    Returns this rank's device. A collective that waits longer than `timeout_s` (env MOEADAPT_DIST_TIMEOUT,
    default 600 s) raises on the surviving ranks, so a crashed rank ends the job instead of hanging it."""
    if device is None or str(device) == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        t = timeout_s if timeout_s is not None else float(os.environ.get("MOEADAPT_DIST_TIMEOUT", DEFAULT_TIMEOUT_S))
        kw = dict(backend="nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=t),
                  device_id=device if device.type == "cuda" else None)
        store = _store_for_this_attempt(timedelta(seconds=t))
        if store is not None:
            kw.update(store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
        dist.init_process_group(**kw)
    return device


def shutdown_distributed(barrier: bool = True) -> None:
    """Leave the process group so that the process can exit cleanly.

    Gloo's worker threads drop a finished collective's tensors on their own thread, and dropping a tensor
    that has a Python object needs the GIL. DTensor's caches keep the device meshes, and with them the
    groups and their threads, alive until the interpreter shuts down; a worker still waiting for the GIL
    then is killed inside that destructor and the process aborts ("terminate called without an active
    exception", SIGABRT) after a run that succeeded. The pause below hands the GIL to such a worker while
    the interpreter is alive (it needs microseconds; 20 ms is several switch intervals)."""
    if not dist.is_initialized():
        return
    if barrier:
        dist.barrier()
    dist.destroy_process_group()
    time.sleep(0.02)


def _store_for_this_attempt(timeout: timedelta) -> dist.Store | None:
    """Under `torchrun --max-restarts`, the agent's TCPStore outlives a failed round: without a per-attempt
    prefix, a restarted rank can read a dead rank's address and fail (`Gloo connectFullMesh ... refused`)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "TORCHELASTIC_RESTART_COUNT" not in os.environ:
        return None
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
                          is_master=False, timeout=timeout)
    return dist.PrefixStore(f"moeadapt/attempt_{os.environ['TORCHELASTIC_RESTART_COUNT']}", store)


def is_launched_distributed() -> bool:
    """True under torchrun (even with one process): the trainer then takes the DCP / FSDP path."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


@dataclass
class ParallelDims:
    spec: ParallelSpec
    world_size: int
    device: torch.device
    mesh: DeviceMesh  # ("dp_replicate", "dp_shard", "cp")
    expert_mesh: DeviceMesh  # ("dp_replicate", "dp_shard_in_ep", "ep")

    @property
    def ep(self) -> int:
        return self.spec.ep

    @property
    def dp_shard_in_ep(self) -> int:
        return self.spec.dp_shard * self.spec.cp // self.spec.ep

    @property
    def rank(self) -> int:
        return dist.get_rank()

    @property
    def ep_group(self) -> dist.ProcessGroup:
        return self.expert_mesh["ep"].get_group()

    @property
    def ep_rank(self) -> int:
        return self.expert_mesh["ep"].get_local_rank()

    @property
    def cp(self) -> int:
        return self.spec.cp

    @property
    def dp_rank(self) -> int:
        """Which batch rows this rank reads: the cp ranks of a group read the same rows (and split them in
        time), so the data-parallel index is the rank's (dp_replicate, dp_shard) coordinate."""
        return dist.get_rank() // self.spec.cp

    @property
    def dp_size(self) -> int:
        return self.spec.dp_replicate * self.spec.dp_shard

    def cp_layout(self) -> CPLayout | None:
        """The causally balanced split of each sequence over this rank's cp group (None when cp = 1)."""
        if self.spec.cp == 1:
            return None
        m = self.mesh["cp"]
        return CPLayout(m.get_group(), m.get_local_rank(), self.spec.cp, balanced=True)

    def dense_fsdp_mesh(self) -> DeviceMesh:
        """FSDP mesh of the non-expert parameters: sharded over dp_shard x cp (one flattened dim), HSDP
        (replicate, shard) when dp_replicate > 1."""
        if self.spec.cp > 1:
            if "_dp_shard_cp" not in self.__dict__:  # flatten once; later calls reuse the same groups
                self.__dict__["_dp_shard_cp"] = self.mesh["dp_shard", "cp"]._flatten("dp_shard_cp")
            shard = "dp_shard_cp"
        else:
            shard = "dp_shard"
        return self.mesh["dp_replicate", shard] if self.spec.dp_replicate > 1 else self.mesh[shard]

    def expert_fsdp_mesh(self) -> DeviceMesh:
        """FSDP mesh of the experts, orthogonal to EP."""
        em = self.expert_mesh
        return em["dp_replicate", "dp_shard_in_ep"] if self.spec.dp_replicate > 1 else em["dp_shard_in_ep"]


def check_spec(spec: ParallelSpec, model: ModelSpec, world_size: int) -> None:
    """Every degree check in one place (schema checks + what this implementation supports)."""
    spec.validate_for(model, world_size)
    if spec.cp > 1 and "gqa" in model.resolved_layer_types():
        raise ValueError(f"cp={spec.cp}: context parallelism covers KDA and DSA layers, and this model has GQA "
                         f"layers; set parallel.cp: 1 (use dp_shard={spec.dp_shard * spec.cp} instead)")
    if spec.ep > 1 and model.first_k_dense >= model.n_layers:
        raise ValueError(f"ep={spec.ep} but the model has no MoE layer (first_k_dense={model.first_k_dense} "
                         f">= n_layers={model.n_layers}); set ep: 1")


def build_parallel_dims(spec: ParallelSpec, model: ModelSpec, device: torch.device | str = "cpu") -> ParallelDims:
    """Both meshes over all ranks of the default process group (which must be initialised)."""
    if not dist.is_initialized():
        raise RuntimeError("torch.distributed is not initialised; call moeadapt.parallel.init_distributed() "
                           "first (or launch with torchrun)")
    world = dist.get_world_size()
    check_spec(spec, model, world)
    device = torch.device(device)
    ranks = torch.arange(world)
    dev_type = device.type
    mesh = DeviceMesh(dev_type, ranks.view(spec.dp_replicate, spec.dp_shard, spec.cp),
                      mesh_dim_names=("dp_replicate", "dp_shard", "cp"))
    shard_in_ep = spec.dp_shard * spec.cp // spec.ep
    expert_mesh = DeviceMesh(dev_type, ranks.view(spec.dp_replicate, shard_in_ep, spec.ep),
                             mesh_dim_names=("dp_replicate", "dp_shard_in_ep", "ep"))
    return ParallelDims(spec, world, device, mesh, expert_mesh)
