"""One training step of the `small` preset with the Triton kernels against the reference backend (GPU only)."""

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_small_preset_step_triton_matches_reference():
    from moeadapt.config import get_preset
    from moeadapt.models.model import build_model, materialize

    spec = get_preset("small", n_layers=4, index_topk=256)
    torch.manual_seed(0)
    model = materialize(build_model(spec, "meta"), "cuda", seed=0)
    x = torch.randint(0, spec.vocab_size, (1, 1024), device="cuda")
    y = torch.randint(0, spec.vocab_size, (1, 1024), device="cuda")
    losses, grads = {}, {}
    for backend in ("reference", "triton"):
        model.set_backend(backend)
        model.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(x, y, return_logits=False)
        (out.loss + out.aux_loss).backward()
        losses[backend] = float(out.loss)
        grads[backend] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert abs(losses["triton"] - losses["reference"]) < 2e-2 * abs(losses["reference"])
    for n, g in grads["reference"].items():
        gt = grads["triton"][n]
        rel = (gt - g).norm() / (g.norm() + 1e-12)
        assert rel < 5e-2, (n, float(rel))
