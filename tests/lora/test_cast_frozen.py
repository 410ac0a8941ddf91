"""Casting the frozen backbone to bf16 must not leave a second copy of the grouped expert weights behind."""

import torch

from moeadapt.config import LoRASpec
from moeadapt.lora import GroupedLoRALinear, cast_frozen_, inject_lora
from moeadapt.models.model import build_model, materialize
from tests.conftest import micro_spec


def _storage_bytes(model):
    seen, total = set(), 0
    for m in model.modules():
        ts = list(m.parameters(recurse=False)) + list(m.buffers(recurse=False))
        if isinstance(m, GroupedLoRALinear) and m._wcat is not None:
            ts.append(m._wcat)
        for t in ts:
            st = t.untyped_storage()
            if st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
    return total


def test_cast_frozen_keeps_one_copy_and_the_fused_view():
    model = materialize(build_model(micro_spec(), "meta"), torch.device("cpu"), seed=0)
    inject_lora(model, LoRASpec(rank=4))
    grouped = [m for m in model.modules() if isinstance(m, GroupedLoRALinear)]
    assert grouped
    before = _storage_bytes(model)
    x = torch.randn(6, grouped[0].in_features)
    offs = torch.tensor([2] * (grouped[0].n_experts - 1) + [6], dtype=torch.int32).cumsum(0).clamp(max=6).int()
    ref = grouped[0](x.bfloat16().float(), offs)
    cast_frozen_(model, torch.bfloat16)
    for m in grouped:
        assert m.weight.dtype == torch.bfloat16
        assert m.cat_weight(torch.bfloat16) is not None  # still the fused buffer's view
        assert m.lora_A.dtype == torch.float32  # adapters untouched
    after = _storage_bytes(model)
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    # every frozen float32 byte went to bf16 (+ the small B columns of the buffers), nothing doubled
    assert after < before - 1.9 * frozen, (before, after, frozen)
    out = grouped[0](x.bfloat16(), offs)
    torch.testing.assert_close(out.float(), ref, atol=3e-2, rtol=3e-2)


def test_replacing_weight_data_releases_the_stale_buffer():
    model = materialize(build_model(micro_spec(), "meta"), torch.device("cpu"), seed=0)
    inject_lora(model, LoRASpec(rank=4))
    m = next(mm for mm in model.modules() if isinstance(mm, GroupedLoRALinear))
    m.weight.data = m.weight.data.to(torch.bfloat16)  # what the trainer used to do
    assert m._wcat is not None  # the old float32 buffer is still held ...
    assert m.cat_weight(torch.bfloat16) is None
    assert m._wcat is None  # ... until the next forward asks for it
