"""Plan search: every (ep, dp_shard, cp, recompute, micro-batch) that the GPU count allows, memory-checked and
ranked by estimated throughput (tokens / s / GPU); the report says why rejected plans do not fit.

Owns: enumeration and ranking. The degrees obey ParallelSpec.validate_for (ep divides the expert count and
dp_shard * cp); dp_replicate takes the GPUs dp_shard * cp leaves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..config import LoRASpec, ModelSpec, ParallelSpec
from ..ui import make_console
from .comm import DEFAULT_HW, Hardware, comm_and_time
from .memory import GiB, Plan, memory_breakdown


def parse_mem(s: str | float | int) -> float:
    """'141GiB' / '80GB' / '64g' / bytes -> bytes."""
    if isinstance(s, (int, float)):
        return float(s)
    t = s.strip().lower().replace(" ", "")
    for suf, mul in (("gib", GiB), ("gb", 1e9), ("g", GiB), ("tib", 1024 * GiB), ("mib", 1024**2)):
        if t.endswith(suf):
            return float(t[: -len(suf)]) * mul
    return float(t)


@dataclass
class Candidate:
    plan: Plan
    memory: dict
    comm: dict
    fits: bool
    why: str = ""

    def row(self) -> dict:
        return {"plan": self.plan.label(), **self.plan.__dict__, "fits": self.fits, "why": self.why,
                "mem_GiB": self.memory["total"] / GiB, "peak_phase": self.memory.get("peak_phase"),
                "tokens_per_s_per_gpu": self.comm["tokens_per_s_per_gpu"],
                "step_s": self.comm["step_s"], "a2a_GB_per_step": self.comm["a2a_bytes"] / 1e9,
                "fsdp_GB_per_step": (self.comm["fsdp_allgather_bytes"] + self.comm["fsdp_reduce_scatter_bytes"]) / 1e9,
                "breakdown_GiB": {k: v / GiB for k, v in self.memory.items()
                                  if k not in ("params_total", "params_trainable", "tokens_per_gpu", "peak_phase")}}


@dataclass
class SearchResult:
    feasible: list[Candidate]
    rejected: list[Candidate]
    gpu_mem: float
    notes: list[str] = field(default_factory=list)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _why(mem: dict, cap: float) -> str:
    big = max((k for k in mem if k not in ("total", "params_total", "params_trainable", "tokens_per_gpu", "peak_phase")),
              key=lambda k: mem[k])
    return (f"needs {mem['total'] / GiB:.1f} GiB > {cap / GiB:.1f} GiB; largest term {big} "
            f"{mem[big] / GiB:.1f} GiB")


def evaluate_plan(spec: ModelSpec, plan: Plan, lora: LoRASpec | None, gpu_mem: float,
                  hw: Hardware = DEFAULT_HW) -> Candidate:
    mem = memory_breakdown(spec, plan, lora)
    comm = comm_and_time(spec, plan, lora, hw)
    fits = mem["total"] <= gpu_mem
    return Candidate(plan, mem, comm, fits, "" if fits else _why(mem, gpu_mem))


def check_cp(gpus: int, cps: tuple[int, ...], seq_lens: list[int] | None) -> None:
    """Requested cp degrees must multiply out with the GPU count and cut each sequence into 2*cp pieces."""
    for cp in cps:
        if cp < 1 or gpus % cp:
            ok = ", ".join(str(d) for d in _divisors(gpus))
            raise ValueError(f"cp={cp} does not divide --gpus {gpus}: dp_replicate x dp_shard x cp must multiply "
                             f"out to the GPU count; choose cp in {{{ok}}}")
        for seq in seq_lens or ():
            ParallelSpec(cp=cp).validate_seq_len(seq)


def search(spec: ModelSpec, gpus: int, gpu_mem: float | str, lora: LoRASpec | None = None,
           seq_lens: list[int] | None = None, micro_batches: list[int] | None = None,
           recomputes: tuple[str, ...] = ("none", "selective", "full"), cps: tuple[int, ...] = (1, 2, 4, 8),
           hw: Hardware = DEFAULT_HW) -> SearchResult:
    cap = parse_mem(gpu_mem)
    seq_lens = seq_lens or [2048, 4096]
    micro_batches = micro_batches or [1, 2, 4, 8]
    E = spec.n_routed_experts
    feasible, rejected = [], []
    # one GPU, full fine-tuning: the trainer's default keeps the weights split (train.weight_dtype auto ->
    # fp32_split: bf16 parameters, bf16 gradients, int16 low halves in the optimizer's state, no copies)
    weights = Plan.state_dtypes("fp32_split", "fp32") if gpus == 1 and lora is None else {}
    for cp in cps:
        if gpus % cp:
            continue
        for dp_shard in _divisors(gpus // cp):
            shard = dp_shard * cp
            eps = [e for e in _divisors(E) if shard % e == 0] if E else [1]
            for ep in eps:
                ps = ParallelSpec(dp_replicate=gpus // shard, dp_shard=dp_shard, cp=cp, ep=ep)
                ps.validate_for(spec, gpus)
                for seq in seq_lens:
                    if (cp > 1 and seq % (2 * cp)) or seq > spec.max_position_embeddings:  # 2*cp pieces
                        continue
                    for rc in recomputes:
                        for mb in micro_batches:
                            c = evaluate_plan(spec, Plan(gpus, gpus // shard, dp_shard, cp, ep, rc, mb, seq,
                                                         **weights), lora, cap, hw)
                            (feasible if c.fits else rejected).append(c)
    feasible.sort(key=lambda c: -c.comm["tokens_per_s_per_gpu"])
    rejected.sort(key=lambda c: c.memory["total"])
    res = SearchResult(feasible, rejected, cap)
    if not feasible and rejected:
        best = rejected[0]
        res.notes.append(f"nothing fits in {cap / GiB:.1f} GiB; the smallest plan ({best.plan.label()}) {best.why}")
    return res


def print_result(res: SearchResult, spec: ModelSpec, top: int = 5, console=None) -> None:
    from rich.table import Table

    console = console or make_console()
    t = Table(title=f"{spec.name}: top plans fitting {res.gpu_mem / GiB:.0f} GiB per GPU "
                    f"({len(res.feasible)} fit, {len(res.rejected)} do not)")
    for c in ("#", "plan", "GiB/GPU", "tok/s/GPU", "step s", "a2a GB/step", "FSDP GB/step"):
        t.add_column(c, justify="right" if c != "plan" else "left")
    for i, c in enumerate(res.feasible[:top]):
        r = c.row()
        t.add_row(str(i + 1), r["plan"], f"{r['mem_GiB']:.1f}", f"{r['tokens_per_s_per_gpu']:.0f}",
                  f"{r['step_s']:.2f}", f"{r['a2a_GB_per_step']:.1f}", f"{r['fsdp_GB_per_step']:.1f}")
    console.print(t)
    best = res.feasible[0] if res.feasible else (res.rejected[0] if res.rejected else None)
    if best is not None:
        b = Table(title=f"per-GPU memory of {'the best plan' if best.fits else 'the smallest plan (does not fit)'}: "
                        f"{best.plan.label()} (peak: {best.memory.get('peak_phase')})")
        b.add_column("term")
        b.add_column("GiB", justify="right")
        for k, v in best.row()["breakdown_GiB"].items():
            b.add_row(k, f"{v:.2f}")
        console.print(b)
        console.print(f"params total {best.memory['params_total'] / 1e9:,.1f}B, trainable "
                      f"{best.memory['params_trainable'] / 1e9:,.2f}B; EP all-to-all "
                      f"{best.comm['a2a_bytes_per_layer'] / 1e6:,.1f} MB per MoE layer per micro-batch per rank "
                      f"({best.comm['a2a_bytes_per_rank_pair_layer'] / 1e6:,.2f} MB per rank pair)")
    for n in res.notes:
        console.print(f"[red]{n}[/]")
