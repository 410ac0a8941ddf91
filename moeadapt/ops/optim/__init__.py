"""The optimizer's kernels: AdamW and the gradient norm over a list of tensors in one launch each.

Math: `reference.py`. Kernels: `triton_adamw.py` (fp32, bf16 or split fp32 weights, fp32 or bf16 moments,
gradients in any float dtype, an optional bf16 copy of each updated fp32 weight). Used by `parallel.optim.CopyAdamW`.
"""

from .reference import (
                        adamw_reference,
                        grad_norm_reference,
                        join_fp32,
                        moment_bits,
                        split_fp32,
                        stochastic_round_bf16,
                        weight_bits,
)
from .triton_adamw import TensorBlocks, TensorTable, adamw_, grad_sq_sum

__all__ = ["adamw_reference", "grad_norm_reference", "join_fp32", "moment_bits", "split_fp32",
           "stochastic_round_bf16", "weight_bits", "TensorBlocks", "adamw_", "grad_sq_sum", "TensorTable"]
