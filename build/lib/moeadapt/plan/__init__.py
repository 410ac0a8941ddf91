"""Planning (DESIGN.md §7): per-GPU memory and communication model, plan search, routing simulator.

memory.py  what each rank holds at the step's peak, term by term (weights, grads, optimizer, FSDP buffers,
           activations per layer type and recompute mode, loss / recompute transient, all-to-all buffers, reserve)
comm.py    FSDP and EP bytes per step and a step-time estimate from stated bandwidths
search.py  enumerate ep / dp_shard / cp / recompute / micro-batch, keep what fits, rank by tokens/s/GPU
routing.py per-rank loads and all-to-all volume for uniform, Zipf or measured routing
accuracy.py predicted vs measured peak memory (CPU: live-storage accounting; CUDA: max_memory_allocated)
"""

from .comm import Hardware, comm_and_time
from .memory import GiB, Plan, memory_breakdown, param_counts
from .search import Candidate, SearchResult, evaluate_plan, parse_mem, print_result, search

__all__ = ["Candidate", "GiB", "Hardware", "Plan", "SearchResult", "comm_and_time", "evaluate_plan",
           "memory_breakdown", "param_counts", "parse_mem", "print_result", "search"]
