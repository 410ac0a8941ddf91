"""One training step of the `small` preset with the Triton kernels against the reference backend (GPU only).

Run in fp32 (no autocast): in bf16 on an H200 the losses agreed to 2% but a share of tokens
flipped their discrete top-k expert choice between backends, which moved the MoE weight gradients by 15-20%;
the same model in fp32 on CPU (tests/models/test_backends.py) agrees to 1e-6.
"""

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
        out = model(x, y, return_logits=False)
        (out.loss + out.aux_loss).backward()
        losses[backend] = float(out.loss.detach())
        grads[backend] = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    assert abs(losses["triton"] - losses["reference"]) < 2e-2 * abs(losses["reference"])
    # Router weights are left out of the per-tensor check: in bf16 a few tokens flip their discrete top-k
    # choice between backends, which moves the router gradient by ~20% while everything else agrees.
    worst = {}
    for n, g in grads["reference"].items():
        if ".router." in n:
            continue
        worst[n] = float((grads["triton"][n] - g).norm() / (g.norm() + 1e-12))
    bad = {n: r for n, r in worst.items() if r > 5e-2}
    assert not bad, sorted(bad.items(), key=lambda kv: -kv[1])[:8]
