"""The whole model with every op on its Triton kernel (interpreted on CPU) against the reference backend."""

import pytest
import torch

from moeadapt.models.model import build_model, materialize
from tests.conftest import micro_spec

triton = pytest.importorskip("triton")


def test_model_triton_backend_matches_reference(seed):
    # two layers run every op kind once: layer 0 is KDA + the dense MLP, layer 1 DSA + routed experts (the
    # micro model's default four layers repeat the KDA layer, doubling the interpreted time for no new op)
    spec = micro_spec(n_layers=2, dsa_every=2, kda_head_dim=16, qk_nope_head_dim=16, v_head_dim=16, kv_lora_rank=16,
                      qk_rope_head_dim=8, index_head_dim=16, index_loss_coef=0.1, aux_loss_coef=0.01)
    assert spec.resolved_layer_types() == ["kda", "dsa"] and spec.first_k_dense == 1
    device = "cuda" if torch.cuda.is_available() else "cpu"
    m = materialize(build_model(spec, "meta"), device, seed=seed)
    x = torch.randint(0, 256, (1, 40), device=device)
    y = torch.randint(0, 256, (1, 40), device=device)
    res = {}
    for backend in ("reference", "triton"):
        m.set_backend(backend)
        m.zero_grad(set_to_none=True)
        out = m(x, y)
        (out.loss + out.aux_loss).backward()
        res[backend] = (out.loss.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None})
    torch.testing.assert_close(res["triton"][0], res["reference"][0], rtol=1e-4, atol=1e-4)
    assert res["triton"][1].keys() == res["reference"][1].keys()
    for n, g in res["reference"][1].items():
        rel = float((res["triton"][1][n] - g).norm() / (g.norm() + 1e-12))
        assert rel < 1e-3, (n, rel)
