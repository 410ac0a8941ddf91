"""The MHA form of MLA attention: FlexAttention's dense tiles of a selection (ops/dsa/flex_attn.py) against the
reference, and the DSA layer's two forms (absorbed MQA, per-head MHA) against each other."""

import shutil

import pytest
import torch

from moeadapt.ops.dsa import flex_attn as fa
from moeadapt.ops.dsa import lightning_indexer_reference, sparse_attention_reference


def _indices(B, T, topk, g, dt=torch.float64):
    """Lightning-indexer selections of random scores (every query selects min(topk, t + 1) causal keys)."""
    qi = torch.randn(B, T, 2, 16, generator=g, dtype=dt)
    ki = torch.randn(B, T, 16, generator=g, dtype=dt)
    wi = torch.randn(B, T, 2, generator=g, dtype=dt)
    return lightning_indexer_reference(qi, ki, wi, topk)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")  # eager on CPU, on purpose
def test_flex_dense_tiles_match_reference():
    """FlexAttention over the selection's block mask (full and partial blocks, a query that selects nothing) equals
    the reference on the selected keys alone; forward on CPU (FlexAttention has no CPU backward: the GPU suite
    checks gradients)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    B, T, H = 2, 512, int(torch.randint(1, 4, ()))
    D, DV = 16 * int(torch.randint(1, 5, ())), 8 * int(torch.randint(1, 5, ()))
    topk = int(torch.randint(260, 380, ()))  # query blocks 2 and 3 hold full blocks (every key of block 0)
    q, k = (torch.randn(B, T, H, D, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(B, T, H, DV, generator=g, dtype=torch.float64)
    idx = _indices(B, T, topk, g)
    idx[1, 77] = -1  # a query with no selected key gets 0
    scale = float(torch.rand((), generator=g)) * 0.3 + 0.05
    ref = sparse_attention_reference(q, k, v, idx, scale)
    bm = fa.selection_block_mask(idx, T, T, full_blocks=True)
    assert int(bm.full_kv_num_blocks.sum()) > 0 and int(bm.kv_num_blocks.sum()) > 0
    for full in (True, False):
        o = fa.sparse_attention_flex(q, k, v, idx, scale, {**fa.FLEX_CONFIG, "FULL_BLOCKS": full})
        torch.testing.assert_close(o, ref, atol=1e-10, rtol=1e-10)
    assert o[1, 77].abs().max() == 0

    # the block lists (eager FlexAttention reads mask_mod everywhere, so they are checked here, as the compiled
    # kernel walks them): every selected pair lies in a listed block, and a full block selects all its pairs
    _check_blocks(bm, idx, T)
    short = fa.selection_block_mask(idx, T, T, full_blocks=True)
    short.kv_num_blocks.sub_(1).clamp_(min=0)  # stopping one key block short loses selected pairs
    with pytest.raises(AssertionError, match="not in a listed block"):
        _check_blocks(short, idx, T)
    wrong = fa.selection_block_mask(idx, T, T, full_blocks=True)
    n = wrong.full_kv_num_blocks[0, 0, -1]  # the last query block's diagonal key block (partial) listed as full
    wrong.full_kv_indices[0, 0, -1, n] = wrong.kv_indices[0, 0, -1, 0]
    wrong.full_kv_num_blocks[0, 0, -1] += 1
    with pytest.raises(AssertionError, match="full block"):
        _check_blocks(wrong, idx, T)
    stale = fa.selection_block_mask(idx, T, T, full_blocks=True)
    stale.q_num_blocks[0, 0, 0] -= 1  # the backward's lists missing a block of the forward's
    with pytest.raises(AssertionError, match="query lists"):
        _check_blocks(stale, idx, T)


@pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                    reason="inductor's CPU backend needs a C++ compiler")
def test_compiled_flex_walks_the_block_lists():
    """The compiled FlexAttention (inductor's CPU kernel: it walks the block lists as the GPU one does; eager
    FlexAttention reads mask_mod everywhere) on the selection's BlockMask equals the reference, in float32; a block
    list one key block short of a query block's largest selected key fails."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    B, T, H, D, DV = 2, 512, 2, 32, 16
    q, k = (torch.randn(B, T, H, D, generator=g) for _ in range(2))
    v = torch.randn(B, T, H, DV, generator=g)
    idx = _indices(B, T, int(torch.randint(260, 380, ())), g, torch.float32)
    ref = sparse_attention_reference(q, k, v, idx, 0.2)
    flex = torch.compile(torch.nn.attention.flex_attention.flex_attention, dynamic=False)

    def run(bm):
        with torch.no_grad():
            return flex(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=bm,
                        scale=0.2).transpose(1, 2)

    for full in (True, False):
        torch.testing.assert_close(run(fa.selection_block_mask(idx, T, T, full)), ref, atol=2e-5, rtol=2e-5)
    short = fa.selection_block_mask(idx, T, T, full_blocks=True)
    short.kv_num_blocks.sub_(1).clamp_(min=0)
    assert (run(short) - ref).abs().max() > 1e-2


def _check_blocks(bm, idx, T):
    """Every selected pair lies in a listed block, a full block selects all its pairs, a listed block holds a
    selected pair, and the query lists (the backward's) are the key lists transposed."""
    B, nb = idx.shape[0], T // fa.BLOCK
    sel = torch.zeros(B, T, T, dtype=torch.bool)
    rows = torch.arange(T)[None, :, None].expand_as(idx)
    b = torch.arange(B)[:, None, None].expand_as(idx)
    ok = idx >= 0
    sel[b[ok], rows[ok], idx[ok]] = True
    per_block = sel.view(B, nb, fa.BLOCK, nb, fa.BLOCK)

    def listed(num, ix, transpose=False):
        flags = torch.zeros(B, nb, nb, dtype=torch.bool)
        if num is None:
            return flags
        for bb in range(B):
            for r in range(nb):
                flags[bb, r, ix[bb, 0, r, :num[bb, 0, r]].long()] = True
        return flags.transpose(1, 2) if transpose else flags

    part, full = listed(bm.kv_num_blocks, bm.kv_indices), listed(bm.full_kv_num_blocks, bm.full_kv_indices)
    any_sel = per_block.any(4).any(2)
    assert not (any_sel & ~(part | full)).any(), "a selected pair is not in a listed block"
    assert per_block.all(4).all(2)[full].all(), "a full block holds an unselected pair"
    assert not ((part | full) & ~any_sel).any(), "a listed block selects nothing"
    assert not (part & full).any(), "a block listed as partial and full"
    assert torch.equal(listed(bm.q_num_blocks, bm.q_indices, True), part), "query lists are not the key lists'"
    assert torch.equal(listed(bm.full_q_num_blocks, bm.full_q_indices, True), full), "full query lists differ"



def test_dense_tiles_apply_only_where_they_pay():
    """The MHA layout takes the dense tiles on CUDA only, one selection per token, T a multiple of 128, and a
    dense enough selection; the MLA layer takes the MHA form where its FLOPs are lower."""
    assert fa.selected_pairs(4, 2) == 1 + 2 + 2 + 2
    assert fa.selected_pairs(3, 8) == 6
    mla = (192, 128, 576, 512)  # DeepSeek's dims: nope + rope, vd | kv_lora_rank + rope, kv_lora_rank
    on = {**fa.FLEX_CONFIG, "MHA_FORM": True}

    def pays(T, cuda=True, cfg=on, heads=64):
        return fa.mha_form_pays(T, 2048, *mla, is_cuda=cuda, cfg=cfg, heads=heads)

    assert pays(4096) and pays(4096, heads=16)
    assert not pays(4096, cfg={**on, "MHA_FORM": False})
    assert not pays(4096, cuda=False)
    assert not pays(4096 + 64)
    assert pays(8192) and pays(12288)  # 0.67 and 0.96 of the absorbed FLOPs
    assert not pays(16384) and not pays(16384, heads=48)  # 1.25: over MHA_FORM_COST
    assert pays(16384, heads=16) and pays(16384, heads=32)  # under MHA_FORM_COST_FEW_HEADS
    assert pays(18432, heads=16) and not pays(20480, heads=16)  # selected pairs 0.21 / 0.19 of the causal ones
    assert not pays(8192, cfg={**on, "MHA_FORM_COST": 0.5})
    assert not pays(65536, heads=16)  # top-2048 of 64k: 6% of causal pairs
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):  # as selective activation checkpointing's modes: must see each op
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Seen():
        assert not pays(4096)
    q = torch.zeros(1, 256, 4, 8)
    idx = torch.zeros(1, 256, 200, dtype=torch.int32)
    assert not fa.dense_tiles_apply(q, q, idx)  # CPU
    assert not fa.dense_tiles_apply(q, q[:, :, :1], idx)  # one KV head: the gathering kernels


def _layer(seed, **kw):
    from moeadapt.models.dsa_attn import DSAAttention
    from moeadapt.models.model import build_model, materialize
    from tests.conftest import micro_spec

    spec = micro_spec(attn_output_gate=True, **kw)
    model = materialize(build_model(spec), seed=seed)
    layer = next(m for m in model.modules() if isinstance(m, DSAAttention))
    return spec, layer.double()


@pytest.mark.parametrize("lora", [False, True])
def test_layer_mha_form_matches_absorbed(lora):
    """The DSA layer in MHA form (per-head keys / values from wkv_b) computes what the absorbed form does: output,
    the input's and every parameter's gradient (float64), with a LoRA on wkv_b and the indexer's KL loss."""
    from moeadapt.lora.layers import LoRALinear
    from moeadapt.models.common import rope_cos_sin

    seed = int(torch.randint(0, 1000, ()))
    spec, layer = _layer(seed, index_loss_coef=0.1)
    if lora:
        layer.wkv_b = LoRALinear(layer.wkv_b.requires_grad_(False), rank=4, alpha=8.0).double()
        torch.nn.init.normal_(layer.wkv_b.lora_B.weight, std=0.3)
    layer.train()
    B, T = 2, int(torch.randint(10, 24, ()))
    x = torch.randn(B, T, spec.hidden_size, dtype=torch.float64)
    dy = torch.randn(B, T, spec.hidden_size, dtype=torch.float64)
    cos, sin = rope_cos_sin(torch.arange(T), spec.qk_rope_head_dim, spec.rope_theta)
    cos, sin = cos.double(), sin.double()

    def run(form):
        layer.form = form
        layer.zero_grad(set_to_none=True)
        xx = x.clone().requires_grad_(True)
        y, aux = layer(xx, cos=cos, sin=sin)
        ((y * dy).sum() + aux["index_kl"]).backward()
        return [y, xx.grad, aux["index_kl"]] + [p.grad for p in layer.parameters() if p.requires_grad]

    absorbed, mha = run("absorbed"), run("mha")
    assert len(absorbed) == len(mha)
    for a, b in zip(mha, absorbed):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9)

    # the comparison sees the key part of wkv_b: a change of 1e-5 in it shows
    with torch.no_grad():
        layer.wkv_b.weight[:spec.qk_nope_head_dim] += 1e-5
    assert not torch.allclose(run("mha")[0], absorbed[0], atol=1e-10, rtol=1e-9)


def test_layer_form_rejects_unknown():
    _, layer = _layer(0)
    layer.form = "dense"
    from moeadapt.models.common import rope_cos_sin

    cos, sin = rope_cos_sin(torch.arange(8), layer.rope, 10000.0)
    with pytest.raises(ValueError, match="form='dense' is not one of"):
        layer(torch.randn(1, 8, layer.spec.hidden_size, dtype=torch.float64), cos=cos.double(), sin=sin.double())


def test_forms_plot(tmp_path):
    """bench_dsa.py --plot-forms draws --forms rows (the MHA form's tiles alone where a row lacks the whole form)
    without a GPU; a file without --forms rows is one clear error."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[2] / "benchmarks" / "bench_dsa.py"
    rows = [{"T": T, "H": H, "absorbed_fwdbwd_ms": 0.002 * T / H ** -0.5, "tiles_default": {"fwdbwd_ms": 1e-4 * T}}
            for T in (4096, 8192) for H in (16, 64)]
    rows[0]["mha_fwdbwd_ms"] = 0.5
    (tmp_path / "a.json").write_text(json.dumps({"forms": rows}))
    (tmp_path / "empty.json").write_text(json.dumps({"rows": []}))
    out = tmp_path / "forms.png"
    run = subprocess.run([sys.executable, str(bench), "--plot-forms", str(tmp_path / "a.json"), "--out", str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr[-2000:]
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "4 rows" in run.stdout
    bad = subprocess.run([sys.executable, str(bench), "--plot-forms", str(tmp_path / "empty.json"), "--out",
                          str(tmp_path / "x.png")], capture_output=True, text=True)
    assert bad.returncode != 0 and "no --forms rows" in bad.stderr and "Traceback" not in bad.stderr
    assert not (tmp_path / "x.png").exists()
