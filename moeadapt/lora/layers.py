"""LoRA layers: dense (`LoRALinear`) and grouped by expert (`GroupedLoRALinear`).

Both keep the base weight under its original name (`weight`), so base checkpoints load unchanged, and
add `lora_A` / `lora_B`. Dense: PEFT layout, lora_A.weight [r, in], lora_B.weight [out, r].
Grouped: lora_A [E, in, r], lora_B [E, r, out], computed by `moeadapt.ops.moe.grouped_lora` next to the
grouped GEMM; the per-expert delta-W is never formed in the forward.
B starts at zero, so an injected model computes exactly what the base did.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..models.moe import GroupedLinear
from ..ops.moe import grouped_lora


class LoRALinear(nn.Linear):
    def __init__(self, base: nn.Linear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        dev = base.weight.device
        self.lora_A = nn.Linear(self.in_features, rank, bias=False, device=dev, dtype=torch.float32)
        self.lora_B = nn.Linear(rank, self.out_features, bias=False, device=dev, dtype=torch.float32)
        self.rank, self.scaling = rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora()

    def reset_lora(self) -> None:
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight, self.bias)
        xa = self.dropout(x).to(self.lora_A.weight.dtype)
        return y + (self.lora_B(self.lora_A(xa)) * self.scaling).to(y.dtype)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, lora_rank={self.rank}, scaling={self.scaling:g}"


class GroupedLoRALinear(GroupedLinear):
    def __init__(self, base: GroupedLinear, rank: int, alpha: float, dropout: float = 0.0):
        nn.Module.__init__(self)
        self.n_experts, self.in_features, self.out_features = base.n_experts, base.in_features, base.out_features
        self.weight = base.weight
        self.backend = base.backend
        E, dev = self.n_experts, base.weight.device
        self.lora_A = nn.Parameter(torch.empty(E, self.in_features, rank, device=dev, dtype=torch.float32))
        self.lora_B = nn.Parameter(torch.zeros(E, rank, self.out_features, device=dev, dtype=torch.float32))
        self.rank, self.scaling = rank, alpha / rank
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.reset_lora()

    def reset_lora(self) -> None:
        bound = 1.0 / math.sqrt(self.in_features)
        nn.init.uniform_(self.lora_A, -bound, bound)
        nn.init.zeros_(self.lora_B)

    def forward(self, x_NI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        w_EIO = self.weight.transpose(1, 2).to(x_NI.dtype)
        A, B = self.lora_A.to(x_NI.dtype), self.lora_B.to(x_NI.dtype)
        if isinstance(self.dropout, nn.Identity):  # fused base + adapter path
            return grouped_lora(x_NI, A, B, offsets_E, self.scaling, w_EIO=w_EIO, backend=self.backend)
        base = super().forward(x_NI, offsets_E)
        return base + grouped_lora(self.dropout(x_NI), A, B, offsets_E, self.scaling, backend=self.backend)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """[E, out, in], the layout of `weight` (formed only for merging)."""
        return torch.einsum("eir,ero->eoi", self.lora_A, self.lora_B) * self.scaling

    def extra_repr(self) -> str:
        return f"experts={self.n_experts}, {self.in_features}, {self.out_features}, lora_rank={self.rank}"
