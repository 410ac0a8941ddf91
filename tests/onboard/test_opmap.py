"""Operator mapping: backend per layer and every fallback with its reason."""

import transformers

from moeadapt.config import get_preset
from moeadapt.onboard import op_mapping, read_family
from moeadapt.onboard import opmap as opmap_mod


def test_cpu_falls_back_to_reference_with_reason():
    rows = op_mapping(get_preset("tiny"), device="cpu")
    assert [r["attn"] for r in rows] == ["kda", "kda", "kda", "dsa"]
    assert all(r["attn_backend"] == "reference" and "device is CPU" in r["fallback"] for r in rows)
    assert rows[0]["ffn_backend"] == "torch" and rows[1]["ffn_backend"] == "reference"  # dense, then MoE


def test_cuda_with_triton_maps_to_kernels(monkeypatch):
    monkeypatch.setattr(opmap_mod, "_triton_ok", lambda: (True, ""))
    rows = op_mapping(get_preset("tiny"))
    assert all(r["attn_backend"] == "triton" and not r["fallback"] for r in rows)
    ds = read_family(transformers.DeepseekV3Config().to_dict()).spec
    rows = op_mapping(ds)
    assert all("dense MLA" in r["fallback"] for r in rows)  # indexer-less MLA: the one remaining caveat
    assert rows[3]["ffn_backend"] == "triton" and rows[0]["ffn_backend"] == "torch"
