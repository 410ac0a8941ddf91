"""Small-batch merging: M micro-batches in one forward (experts batched) == gradient accumulation over them."""

import torch

from moeadapt.models.model import build_model, materialize
from tests.conftest import micro_spec


def test_merged_forward_equals_gradient_accumulation(seed):
    # dropless routing; the global-batch aux loss is left out: merging makes its f_e span all M micro-batches
    spec = micro_spec(seq_aux_loss_coef=0.01, z_loss_coef=1e-3, index_loss_coef=0.1)
    m = materialize(build_model(spec, "meta"), "cpu", seed=seed, dtype=torch.float64)
    M, bs, T = 3, 2, 24
    x = torch.randint(0, 256, (M * bs, T))
    y = torch.randint(0, 256, (M * bs, T))
    y[0, :5] = -100  # unequal label counts per micro-batch: the loss is a mean of means
    m.zero_grad()
    for i in range(M):
        out = m(x[i * bs:(i + 1) * bs], y[i * bs:(i + 1) * bs])
        ((out.loss + out.aux_loss) / M).backward()
    ref = {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}
    m.zero_grad()
    out = m(x, y, micro_batches=M)
    (out.loss + out.aux_loss).backward()
    assert ref.keys() == {n for n, p in m.named_parameters() if p.grad is not None}
    for n, g in ref.items():
        torch.testing.assert_close(m.get_parameter(n).grad, g, rtol=1e-7, atol=1e-9, msg=n)
    # the experts saw all M micro-batches at once
    assert all(int(s["counts"].sum()) == M * bs * T * spec.n_experts_per_tok for s in out.moe)
