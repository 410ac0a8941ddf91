"""The optimizer's kernels: AdamW and the gradient norm over a list of tensors in one launch each.

Math: `reference.py`. Kernels: `triton_adamw.py` (fp32 weights, fp32 or bf16 moments, gradients in any float
dtype, an optional bf16 copy of each updated weight). Used by `parallel.optim.CopyAdamW`.
"""

from .reference import adamw_reference, grad_norm_reference, moment_bits, stochastic_round_bf16
from .triton_adamw import TensorBlocks, TensorTable, adamw_, grad_sq_sum

__all__ = ["adamw_reference", "grad_norm_reference", "moment_bits", "stochastic_round_bf16", "TensorBlocks", "adamw_",
           "grad_sq_sum", "TensorTable"]
