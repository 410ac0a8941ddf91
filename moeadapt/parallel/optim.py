"""The trainer's optimizer: torch's AdamW, with its update run on the parameters' local shards.

Owns: `ShardedAdamW`, `CopyAdamW` (bf16 gradients and weight copies in one process, fp32 or bf16 moments) and
`build_optimizer` (the trainer's AdamW from `cfg.train`: fused on CUDA).
Under FSDP2 every trainable parameter, its gradient and its two AdamW states are DTensors. The update is elementwise,
so it is the same computation on each rank's shard; dispatching it through DTensor costs the host the sharding
propagation of every argument of the one fused kernel (~26 ms per step for the `small` LoRA model's 210 adapters
under FSDP2 world 1, on an H200 host, against ~6 ms for the whole step of the same optimizer on plain tensors).
`ShardedAdamW` hands torch's AdamW kernels the local tensors instead (they share storage with the DTensors), so
the parameters and states are updated in place and stay DTensors: DCP's optimizer state dict is unchanged.
Plain tensors (one process) pass through as they are.
"""

from __future__ import annotations

import itertools

import torch

from .sharded_io import local


class ShardedAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (same arguments, same state, same update) that steps on the local shards of DTensor
    parameters. It extends AdamW's `_init_group`, where AdamW gathers the tensors its kernels update."""

    def _init_group(self, group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
        has_complex = super()._init_group(group, params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
                                          state_steps)
        for ts in (params_with_grad, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps):
            ts[:] = [local(t) for t in ts]
        return has_complex


def build_optimizer(params: list[torch.nn.Parameter], train, device: torch.device,
                    copies: dict | None = None) -> torch.optim.Optimizer:
    """The trainer's AdamW over `params` from a TrainSpec (lr, betas, weight decay), fused on every device: one
    kernel over all parameters per step (vs foreach's several passes), and it takes the trainer's skip flag on
    the device (`found_inf`), so a step is applied or skipped without the host waiting for its verdict.
    copies (weight -> its bf16 compute copy, train/copies.py): a `CopyAdamW`, which writes them. bf16 moments
    (train.moment_dtype) and bf16 weights (train.weight_dtype; train/copies.py `why_not_bf16` says where they
    run) are CopyAdamW's alone (on a GPU; under FSDP2 it steps the local shards)."""
    bf16_moments = getattr(train, "moment_dtype", "fp32") == "bf16"
    if bf16_moments and device.type != "cuda":
        raise ValueError("train.moment_dtype: bf16 runs in a Triton GPU kernel (CopyAdamW); this run is on the CPU. "
                         "Set train.moment_dtype: fp32")
    weights = getattr(train, "weight_dtype", "fp32")
    if copies or bf16_moments or weights != "fp32":
        return CopyAdamW(params, copies, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay,
                         moment_dtype=torch.bfloat16 if bf16_moments else torch.float32, seed=train.seed,
                         split_weights=weights == "fp32_split")
    return ShardedAdamW(params, lr=train.lr, betas=train.betas, weight_decay=train.weight_decay, fused=True)


class CopyAdamW(torch.optim.Optimizer):
    """AdamW for fp32 parameters on a GPU whose gradients may be bf16 (`Parameter.grad_dtype`), which also writes
    each copied weight's bf16 compute copy (train/copies.py) from the updated weight, in the same pass (whatever
    the gradient's dtype: the lean experts path returns fp32 gradients for copied adapters). bf16 parameters
    (train.weight_dtype bf16: no fp32 weight, no copy) are updated in fp32 and stored stochastically rounded
    (ops/optim/reference.py); a parameter may be a block of rows of a bigger tensor (the experts' w1 / w3 in
    one gate/up buffer, train/copies.py `store_bf16`). With split_weights (train.weight_dtype fp32_split) a bf16
    parameter is instead the high half of an fp32 weight whose low 16 bits are its state `weight_lo` (int16:
    `seed_low_halves` gives those of the fp32 weights a run starts from; zero otherwise, the weight starting as
    its bf16 value), and the update is the fp32 one exactly.

    The update and the state dict are torch.optim.AdamW's (per parameter `step`, `exp_avg`, `exp_avg_sq`;
    a checkpoint of either loads into the other). One Triton launch per group of parameters that share a gradient
    dtype and have a copy or not (ops/optim). Like torch's fused AdamW it takes `found_inf` (a device flag: the step
    changes nothing, step counts included) and `grad_scale` (every gradient divided by it: the clip), set as
    attributes for one step; `grad_norm` gives the gradients' norm (one rank's) summed in fp32, in one launch per
    gradient dtype (torch's foreach norm of bf16 gradients returns bf16).

    Under FSDP2 (DTensor parameters, gradients and states) it steps each rank's local shards, as ShardedAdamW
    does, and the states stay DTensors (DCP's optimizer state dict is unchanged).

    moment_dtype torch.bfloat16 keeps `exp_avg` / `exp_avg_sq` in bf16, stored stochastically rounded
    (ops/optim/reference.py; random bits from `seed`, the step count and each element's place): 8 bytes a
    parameter less state and traffic. A state dict of either moment dtype loads into the other (and into torch's
    AdamW, which casts moments to the weights' dtype)."""

    def __init__(self, params, copies: dict | None = None, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 0.0, moment_dtype: torch.dtype = torch.float32, seed: int = 0,
                 split_weights: bool = False):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        if moment_dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"CopyAdamW keeps its moments in torch.float32 or torch.bfloat16, not {moment_dtype}")
        self.moment_dtype, self.seed, self.split_weights = moment_dtype, seed, split_weights
        # each rank's shards draw their own rounding bits (their elements are indexed from 0 on every rank)
        self._rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        self.copies = dict(copies or {})
        self._blocks: dict[tuple, object] = {}  # ops/optim TensorBlocks per list of sizes
        self._tabs: dict[tuple, tuple] = {}  # (addresses, ops/optim TensorTable) per (group, part, role)

    def _parts(self) -> list[tuple[int, dict, tuple, list]]:
        """(group index, group, (weight dtype, grad dtype, copied), parameters with a gradient) for each kernel
        launch."""
        from ..ops.optim.triton_adamw import ALIGN

        out = []
        for gi, group in enumerate(self.param_groups):
            parts: dict[tuple, list] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                if local(p.grad).data_ptr() % (ALIGN * p.grad.element_size()):
                    # autograd may keep a gradient that is a row block of a bigger one (shared_input.py's dA of
                    # several adapters, one GEMM) off the 16-element boundary the kernels' vector loads need
                    p.grad = p.grad.clone()
                parts.setdefault((p.dtype, p.grad.dtype, p in self.copies), []).append(p)
            out += [(gi, group, key, ps) for key, ps in parts.items()]
        return out

    def _table(self, key: tuple, tensors: list[torch.Tensor], row_blocks: bool = False):
        """The tensors' TensorTable (their local shards under FSDP2), made again only when one of them has moved
        (eager gradients, a load)."""
        from ..ops.optim.triton_adamw import TensorTable

        tensors = [local(t) for t in tensors]
        ptrs = tuple(t.data_ptr() for t in tensors)
        hit = self._tabs.get(key)
        if hit is None or hit[0] != ptrs:
            hit = self._tabs[key] = (ptrs, TensorTable(tensors, tensors[0].device, row_blocks))
        return hit[1]

    def _block_map(self, ps: list[torch.Tensor]):
        from ..ops.optim.triton_adamw import TensorBlocks

        key = tuple(local(p).numel() for p in ps)
        if key not in self._blocks:
            self._blocks[key] = TensorBlocks(list(key), ps[0].device)
        return self._blocks[key]

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """sqrt(sum of every gradient's squares), a float32 device scalar (0 with no gradient): this rank's
        shards only (under FSDP2 the trainer takes the global norm from `parallel.clip_grad_norm_`)."""
        from ..ops.optim.triton_adamw import grad_sq_sum

        total = None
        for gi, _, key, ps in self._parts():
            grads = [p.grad for p in ps]
            s = grad_sq_sum(self._table((gi, *key, "g"), grads), self._block_map(ps))
            total = s if total is None else total + s
        if total is None:
            return torch.zeros((), device=self.param_groups[0]["params"][0].device)
        return total.sqrt()

    @torch.no_grad()
    def step(self, closure=None):
        from ..ops.optim.triton_adamw import adamw_

        if closure is not None:
            raise ValueError("CopyAdamW.step takes no closure")
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        for launch, (gi, group, key, ps) in enumerate(self._parts()):
            for p in ps:
                st = self.state[p]
                if "step" not in st:  # (a split weight's seeded `weight_lo` may be there already)
                    st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
                    for k in ("exp_avg", "exp_avg_sq"):
                        st[k] = torch.zeros_like(p, dtype=self.moment_dtype, memory_format=torch.contiguous_format)
                elif (st["step"].device != p.device or st["step"].dtype != torch.float32
                      or st["exp_avg"].dtype != self.moment_dtype):
                    # state set from outside load_state_dict (the DCP resume writes it in place)
                    _own_state(p, st, self.moment_dtype)
                if self._split(p) and "weight_lo" not in st:  # (a state from a run without the remainder)
                    st["weight_lo"] = torch.zeros_like(p, dtype=torch.int16, memory_format=torch.contiguous_format)
            steps = [self.state[p]["step"] for p in ps]
            torch._foreach_add_(steps, 1.0)
            if found_inf is not None:  # a skipped step does not count (torch's fused AdamW does the same)
                torch._foreach_sub_(steps, [found_inf] * len(steps))
            tabs = {"p": self._table((gi, *key, "p"), ps, row_blocks=True),
                    "g": self._table((gi, *key, "g"), [p.grad for p in ps]),
                    "m": self._table((gi, *key, "m"), [self.state[p]["exp_avg"] for p in ps]),
                    "v": self._table((gi, *key, "v"), [self.state[p]["exp_avg_sq"] for p in ps]),
                    "step": self._table((gi, *key, "step"), steps)}
            if key[2]:  # copied
                tabs["c"] = self._table((gi, *key, "c"), [self.copies[p] for p in ps], row_blocks=True)
            if self._split(ps[0]):
                tabs["lo"] = self._table((gi, *key, "lo"), [self.state[p]["weight_lo"] for p in ps])
            adamw_(tabs, self._block_map(ps), lr=group["lr"], betas=group["betas"], eps=group["eps"],
                   weight_decay=group["weight_decay"], grad_scale=grad_scale, found_inf=found_inf,
                   seed=self.seed + 7919 * launch + 104729 * self._rank)

    def seed_low_halves(self, lows: dict) -> None:
        """Give split weights their fp32 low halves before the first step (`weight_lo`, int16 like the parameter:
        train/copies.py `store_bf16(model, lows)` makes them from the fp32 weights it splits), where the state has
        none yet; without them a split weight starts as its bf16 value."""
        for p, lo in lows.items():
            if not self._split(p) or lo.dtype != torch.int16 or lo.shape != p.shape:
                raise ValueError(f"a low half of shape {tuple(lo.shape)} / {lo.dtype} for a {p.dtype} parameter of "
                                 f"shape {tuple(p.shape)}: expected int16 halves of split (bf16) weights")
            st = self.state[p]
            if "weight_lo" not in st:  # taken as it is where it already lies on p's device, contiguous
                st["weight_lo"] = lo.to(device=p.device, memory_format=torch.contiguous_format)

    @torch.no_grad()
    def full_weight(self, p: torch.Tensor) -> torch.Tensor:
        """p's fp32 weight: a split weight joined with its state's `weight_lo` (a new fp32 tensor), any other
        tensor as it is."""
        from ..ops.optim import join_fp32

        lo = self.state.get(p, {}).get("weight_lo") if self._split(p) else None
        return p if lo is None else join_fp32(p.detach(), lo).view(p.shape)

    def _split(self, p: torch.Tensor) -> bool:
        """p is the bf16 high half of a split fp32 weight (its low half in the state's `weight_lo`)."""
        return self.split_weights and p.dtype == torch.bfloat16

    def load_state_dict(self, state_dict):
        """torch's load for the parameter groups and step counts; the moments and a split weight's `weight_lo`
        are kept as they were saved (torch's load would cast them to the parameter's dtype: fp32 moments of a
        bf16 weight rounded to bf16, weight_lo's integers turned into bf16 values), then every state tensor as the
        kernel reads it (`_own_state`: its own aligned storage, the moments in this run's `moment_dtype`, the
        step count a float32 scalar on its parameter's device). A run without split weights drops `weight_lo`
        (train/checkpoint.py joins it into the fp32 weights first: a split run resumed as fp32)."""
        ids = itertools.chain.from_iterable(g["params"] for g in state_dict["param_groups"])
        params = itertools.chain.from_iterable(g["params"] for g in self.param_groups)
        by_id = dict(zip(ids, params))
        kept, rest = {}, {}
        for i, st in state_dict["state"].items():
            rest[i] = {k: v for k, v in st.items() if k not in _KEPT}
            for k in _KEPT:
                if k not in st:
                    continue
                t = st[k]
                p = by_id.get(i)
                if not torch.is_tensor(t) or p is None or t.shape != p.shape or (
                        k == "weight_lo" and t.dtype != torch.int16):
                    want = "an int16 tensor" if k == "weight_lo" else "a tensor"
                    raise ValueError(f"optimizer state {i}.{k} is not {want} of its parameter's shape; the state is "
                                     "corrupt or from another config")
                if k != "weight_lo" or self._split(p):
                    kept.setdefault(p, {})[k] = t
        super().load_state_dict({**state_dict, "state": rest})
        for p, st in kept.items():
            self.state[p].update(st)
        for p, st in self.state.items():
            _own_state(p, st, self.moment_dtype)


_KEPT = ("exp_avg", "exp_avg_sq", "weight_lo")  # state tensors CopyAdamW.load_state_dict keeps in their own dtype


def _own_state(p: torch.Tensor, st: dict, moment_dtype: torch.dtype) -> None:
    """A CopyAdamW state as its kernel reads it: the step count a float32 scalar on p's device, the moments in
    `moment_dtype` on p's device in their own (aligned, contiguous) storage (fp32 moments loaded into bf16 ones
    round to nearest); a split weight's `weight_lo` on p's device in its own storage."""
    if "weight_lo" in st:
        st["weight_lo"] = st["weight_lo"].to(device=p.device).clone(memory_format=torch.contiguous_format)
    if "step" in st:
        st["step"] = torch.as_tensor(st["step"], dtype=torch.float32).to(p.device).reshape(()).clone()
    for k in ("exp_avg", "exp_avg_sq"):
        if k in st:
            st[k] = st[k].to(device=p.device, dtype=moment_dtype).clone(memory_format=torch.contiguous_format)
