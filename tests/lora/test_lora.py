import json

import pytest
import torch
import torch.nn.functional as F

from moeadapt.config import LoRASpec
from moeadapt.lora import GroupedLoRALinear, LoRALinear, export_peft, inject_lora, load_peft, merge_lora
from moeadapt.models.model import build_model, materialize
from tests.conftest import micro_spec

TARGETS = ["attn.q_proj", "attn.o_proj", "attn.wq_b", "attn.wkv_a", "attn.wo", "experts.w1", "experts.w2", "experts.w3"]


def model_with_lora(seed, rank=4):
    m = materialize(build_model(micro_spec(), "meta"), "cpu", seed=seed)
    names = inject_lora(m, LoRASpec(rank=rank, alpha=2 * rank, targets=TARGETS))
    with torch.no_grad():  # non-zero B so the adapters matter
        for mod in m.modules():
            if isinstance(mod, (LoRALinear, GroupedLoRALinear)):
                (mod.lora_B.weight if isinstance(mod, LoRALinear) else mod.lora_B).normal_(std=0.2)
    return m, names


def test_injected_names_and_only_adapters_train(seed):
    m, names = model_with_lora(seed)
    assert any(n.endswith("experts.w1") for n in names) and any(n.endswith("attn.q_proj") for n in names)
    trainable = [n for n, p in m.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A" in n or ".lora_B" in n for n in trainable)
    x = torch.randint(0, 256, (2, 16))
    out = m(x, x)
    out.loss.backward()
    assert all(p.grad is None for n, p in m.named_parameters() if not p.requires_grad)
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for n, p in m.named_parameters() if p.requires_grad)


def test_zero_init_b_is_identity(seed):
    m = materialize(build_model(micro_spec(), "meta"), "cpu", seed=seed).eval()
    x = torch.randint(0, 256, (1, 12))
    with torch.no_grad():
        before = m(x).logits
        inject_lora(m, LoRASpec(rank=4, targets=TARGETS))
        torch.testing.assert_close(m(x).logits, before)


def test_grouped_lora_matches_explicit_delta(seed):
    m, _ = model_with_lora(seed)
    g = next(mod for mod in m.modules() if isinstance(mod, GroupedLoRALinear))
    E, I = g.n_experts, g.in_features
    counts = torch.tensor([3, 0, 5, 2])[:E]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(int(counts.sum()), I)
    y = g(x, offs)
    ref, start = [], 0
    for e in range(E):
        xe = x[start:start + counts[e]].double()
        w = g.weight[e].double() + g.delta_weight()[e].double()
        ref.append(xe @ w.T)
        start += counts[e]
    torch.testing.assert_close(y.double(), torch.cat(ref), rtol=1e-5, atol=1e-5)


def test_merge_equals_adapter_output(seed):
    m, _ = model_with_lora(seed)
    m.eval()
    x = torch.randint(0, 256, (2, 20))
    with torch.no_grad():
        a = m(x).logits
        assert merge_lora(m) > 0
        assert not any(isinstance(mod, (LoRALinear, GroupedLoRALinear)) for mod in m.modules())
        torch.testing.assert_close(m(x).logits, a, rtol=1e-4, atol=1e-4)


def test_peft_roundtrip(tmp_path, seed):
    m, _ = model_with_lora(seed)
    m.eval()
    spec = LoRASpec(rank=4, alpha=8, targets=TARGETS)
    d = export_peft(m, spec, tmp_path / "adapter", base_model="micro")
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and cfg["lora_alpha"] == 8
    from safetensors.torch import load_file
    t = load_file(str(d / "adapter_model.safetensors"))
    k = next(k for k in t if k.endswith("attn.q_proj.lora_A.weight"))
    assert k.startswith("base_model.model.layers.") and t[k].shape == (4, 32)  # PEFT layout [r, in]
    kg = next(k for k in t if k.endswith("experts.w1.lora_A.weight"))
    assert t[kg].shape == (4, 4, 16)  # [E, r, in]
    m2 = materialize(build_model(micro_spec(), "meta"), "cpu", seed=seed).eval()
    m2.load_state_dict({k: v for k, v in m.state_dict().items() if "lora_" not in k}, strict=False)
    load_peft(m2, d)
    x = torch.randint(0, 256, (1, 16))
    with torch.no_grad():
        torch.testing.assert_close(m2(x).logits, m(x).logits)
    # a corrupt adapter file names the problem
    (d / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_peft(m2, d)


def test_no_target_matches_is_clear():
    m = materialize(build_model(micro_spec(), "meta"), "cpu")
    with pytest.raises(ValueError, match="matched no module"):
        inject_lora(m, LoRASpec(targets=["attn.nothing"]))


def test_grouped_lora_layer_keeps_one_weight_and_fused_matches(seed):
    """GroupedLoRALinear stores its base weight inside the [W | B] buffer (a view, no second copy), the
    fused path gives the reference's output and adapter gradients, and .to() re-establishes the view."""
    from moeadapt.ops.moe.fused_lora import padded_rank

    m, _ = model_with_lora(seed)
    g = next(mod for mod in m.modules() if isinstance(mod, GroupedLoRALinear))
    E, I = g.n_experts, g.in_features
    assert g._wcat is not None and g._wcat.shape == (E, g.out_features, I + padded_rank(g.rank))
    assert g.weight.data_ptr() == g._wcat.data_ptr() and g.cat_weight(g.weight.dtype) is not None
    assert not g.weight.requires_grad
    counts = torch.tensor([3, 0, 5, 2])[:E]
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = torch.randn(int(counts.sum()), I)
    dy = torch.randn(int(counts.sum()), g.out_features)
    res = {}
    for backend in ("reference", "fused"):
        g.backend = backend
        g.lora_A.grad = g.lora_B.grad = None
        xx = x.clone().requires_grad_(True)
        y = g(xx, offs)
        (y * dy).sum().backward()
        res[backend] = (y.detach(), xx.grad, g.lora_A.grad.clone(), g.lora_B.grad.clone())
    for a, b in zip(res["reference"], res["fused"]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert g.weight.grad is None
    g.to(torch.float64)
    assert g._wcat.dtype == torch.float64 and g.weight.data_ptr() == g._wcat.data_ptr()
    # the export contract: A and B stay separate parameters
    names = {n for n, _ in g.named_parameters()}
    assert names == {"weight", "lora_A", "lora_B"}


def _count_calls(monkeypatch, module, **names):
    """Wrap module.<fn> for each key=fn so that calls[key] counts its calls."""
    calls = dict.fromkeys(names, 0)
    for key, attr in names.items():
        fn = getattr(module, attr)

        def counted(*a, _fn=fn, _key=key, **k):
            calls[_key] += 1
            return _fn(*a, **k)
        monkeypatch.setattr(module, attr, counted)
    return calls


def _logits_and_grads_per_path(m, x, paths):
    """{path: [...]}: logits and every trainable gradient of one backward of mean(logits²), with every
    GroupedExperts' lora_path set to each of `paths` in turn."""
    from moeadapt.models.moe import GroupedExperts

    res = {}
    for on in paths:
        for mod in m.modules():
            if isinstance(mod, GroupedExperts):
                mod.lora_path = on
        m.zero_grad(set_to_none=True)
        logits = m(x).logits
        (logits.float().square().mean()).backward()
        res[on] = [logits.detach()] + [p.grad.clone() for n, p in m.named_parameters() if p.requires_grad]
    return res


@pytest.mark.parametrize("backend", ["fused", "auto"])
def test_fold_io_model_matches(seed, monkeypatch, backend):
    """GroupedExperts.lora_path "fold" vs "layers": the whole model (permute gather folded into the w1/w3 LoRA-in pass,
    SwiGLU into w2's) gives the unfolded model's logits and every adapter gradient, and the folds run with
    backend "fused"; "auto" folds only where it would pick the fused GEMM (CUDA, >= FUSED_MIN_ROWS rows per
    expert), so not here."""
    from moeadapt.ops.moe import fused_lora

    m, _ = model_with_lora(seed)
    grouped = [mod for mod in m.modules() if isinstance(mod, GroupedLoRALinear)]
    for mod in grouped:
        mod.backend = backend
    x = torch.randint(0, 256, (2, 11))
    calls = _count_calls(monkeypatch, fused_lora, gather="grouped_lora_fused_gather",
                         swiglu="grouped_lora_fused_swiglu")
    res = _logits_and_grads_per_path(m, x, ("layers", "fold"))  # "auto" would take lean first
    n_moe = len(grouped) // 3  # w1, w3, w2 per MoE layer
    if backend == "fused":
        assert calls["gather"] == 2 * n_moe and calls["swiglu"] == n_moe, calls
    else:
        assert calls == {"gather": 0, "swiglu": 0}, calls
    for a, b in zip(res["layers"], res["fold"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", ["fused", "auto"])
def test_lean_model_matches(seed, monkeypatch, backend):
    """GroupedExperts.lora_path "auto" vs "layers": the whole model with its LoRA'd experts through lean_lora.py (w1 / w3 GEMMs at
    native width, their rank terms in the gather / SwiGLU passes) gives the plain model's logits and every adapter
    gradient; it runs with backend "fused" and, with "auto", only where the fused GEMM would (CUDA), so not here.
    With "fused", w1's and w3's weights become views of the experts' gate/up buffer (stored once), which lean_lora
    gets (wk_gu): its backward's one dx GEMM."""
    from moeadapt.models.moe import GroupedExperts
    from moeadapt.ops.moe import lean_lora

    m, _ = model_with_lora(seed)
    grouped = [mod for mod in m.modules() if isinstance(mod, GroupedLoRALinear)]
    for mod in grouped:
        mod.backend = backend
        torch.nn.init.normal_(mod.lora_B, std=0.1)  # nonzero B: the rank terms matter
    before = {n: p.detach().clone() for n, p in m.named_parameters()}
    x = torch.randint(0, 256, (2, 11))
    bufs = []
    real = lean_lora.lean_lora_experts

    def spy(*a, **k):
        bufs.append(k.get("wk_gu"))
        return real(*a, **k)
    monkeypatch.setattr(lean_lora, "lean_lora_experts", spy)
    res = _logits_and_grads_per_path(m, x, ("layers", "auto"))
    n_moe = len(grouped) // 3
    assert len(bufs) == (n_moe if backend == "fused" else 0), bufs
    assert all(b is not None for b in bufs)
    for a, b in zip(res["layers"], res["auto"]):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    for n, p in m.named_parameters():  # the weights moved into the buffers unchanged, the adapter rows aside
        assert torch.equal(p, before[n]), n
    if backend == "fused":
        for ex in (mod for mod in m.modules() if isinstance(mod, GroupedExperts)):
            wk = ex._gu_cat
            assert wk is not None and ex.w1._wcat is None and ex.w3._wcat is None  # stored once
            assert ex.w1.weight.data_ptr() == wk.data_ptr() and ex.gate_up_cat(wk.dtype) is wk
            ex.w1.cast_base_(torch.float64)  # the weight has new storage: the buffer is dropped, not reused
            assert ex.gate_up_cat(torch.float32) is None and ex._gu_cat is None


def test_lora_linear_under_autocast_matches_float64_and_skips_fp32_copy(seed):
    """Under bf16 autocast the adapter's product runs in bf16 whatever x's dtype, so LoRALinear does not cast x to
    its fp32 adapter dtype first (that copy was cast straight back) and adds s (x A^T) B^T to y in one addmm:
    output and gradients match the float64 formula with bf16-rounded operands, and no fp32 copy of the activation
    appears."""
    torch.manual_seed(seed)
    base = torch.nn.Linear(48, 40, bias=False).to(torch.bfloat16)
    lin = LoRALinear(base, rank=8, alpha=16.0)
    torch.nn.init.normal_(lin.lora_B.weight, std=0.5)
    x = torch.randn(3, 7, 48).to(torch.bfloat16).requires_grad_(True)
    casts = []

    class Spy(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten._to_copy.default and args[0].shape == x.shape:
                casts.append((args[0].dtype, out.dtype))
            return out

    with torch.autocast("cpu", dtype=torch.bfloat16), Spy():
        y = lin(x)
    assert not casts, f"activation-sized casts under autocast: {casts}"

    # float64 reference: the bf16-rounded adapter weights, each product's output rounded to bf16 as autocast does
    A = lin.lora_A.weight.detach().to(torch.bfloat16).double()
    B = lin.lora_B.weight.detach().to(torch.bfloat16).double()
    x64 = x.detach().double()
    xa = (x64 @ A.T).to(torch.bfloat16).double()
    ref = x64 @ base.weight.double().T + (xa @ B.T).to(torch.bfloat16).double() * lin.scaling
    assert torch.allclose(y.double(), ref, rtol=2e-2, atol=2e-2), (y.double() - ref).abs().max()
    dy = torch.randn_like(y)
    y.backward(dy)
    g_ref = dy.double() @ base.weight.double() + (dy.double() * lin.scaling) @ B @ A
    err = (x.grad.double() - g_ref).norm() / g_ref.norm()
    assert err < 2e-2, err
    gB = lin.lora_B.weight.grad
    assert gB is not None and gB.dtype == torch.float32 and lin.lora_A.weight.grad.dtype == torch.float32
    gB_ref = lin.scaling * dy.double().reshape(-1, 40).T @ xa.reshape(-1, 8)
    assert (gB.double() - gB_ref).norm() / gB_ref.norm() < 2e-2


@pytest.mark.parametrize("bias, x_dtype", [(False, torch.bfloat16), (True, torch.float32)])
def test_frozen_lora_linear_folds_match_autograds_composition(seed, bias, x_dtype):
    """A frozen base under autocast takes layers._FrozenLoRA (the adapter term added into y in place; the adapter's
    dx added into the base's dx by the same GEMM): output and every gradient as autograd's composition of the same
    bf16 products computes them, and against float64."""
    torch.manual_seed(seed)
    n_in, n_out, r = 48 + int(torch.randint(0, 16, ())), 40, 8
    base = torch.nn.Linear(n_in, n_out, bias=bias).to(torch.bfloat16).requires_grad_(False)
    lin = LoRALinear(base, rank=r, alpha=16.0)
    torch.nn.init.normal_(lin.lora_B.weight, std=0.5)
    x = torch.randn(3, 7, n_in).to(x_dtype).requires_grad_(True)
    dy = torch.randn(3, 7, n_out).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = lin(x)
    assert y.grad_fn is not None and "_FrozenLoRA" in type(y.grad_fn).__name__
    y.backward(dy)
    got = [y.detach(), x.grad, lin.lora_A.weight.grad, lin.lora_B.weight.grad]
    assert got[1].dtype == x_dtype and got[2].dtype == got[3].dtype == torch.float32
    # autograd's composition of the same bf16 products
    x2 = x.detach().clone().requires_grad_(True)
    A = lin.lora_A.weight.detach().clone().requires_grad_(True)
    B = lin.lora_B.weight.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y2 = F.linear(x2, base.weight, base.bias)
        y2 = torch.addmm(y2.reshape(-1, n_out), F.linear(x2, A).reshape(-1, r), B.t(), alpha=lin.scaling).view(y2.shape)
    y2.backward(dy)
    want = [y2.detach(), x2.grad, A.grad, B.grad]
    for g, w in zip(got, want):
        torch.testing.assert_close(g.float(), w.float(), rtol=2e-2, atol=2e-2)
    # float64
    W, b = base.weight.double(), (base.bias.double() if bias else 0.0)
    Ab, Bb = A.detach().to(torch.bfloat16).double(), B.detach().to(torch.bfloat16).double()
    x64, dy64 = x.detach().to(torch.bfloat16).double(), dy.double()
    ref = x64 @ W.T + b + lin.scaling * (x64 @ Ab.T) @ Bb.T
    dx_ref = dy64 @ W + lin.scaling * (dy64 @ Bb) @ Ab
    for g, w in ((got[0], ref), (got[1], dx_ref)):
        err = (g.double() - w).norm() / w.norm()
        assert err < 1e-2, err


@pytest.mark.parametrize("mode", ["selective", "full"])
def test_lean_gate_up_buffer_under_recompute(seed, monkeypatch, mode):
    """The experts through _LeanCatFn (the gate/up buffer) under selective and full activation recompute give the
    logits and adapter gradients of the run without recompute (the backward refills the buffer's adapter rows;
    selective's dispatch mode sees the block's GEMMs)."""
    from moeadapt.ops.moe import lean_lora
    from moeadapt.parallel.activation import apply_activation_checkpointing

    bufs = []
    real = lean_lora.lean_lora_experts

    def spy(*a, **k):
        bufs.append(k.get("wk_gu") is not None)
        return real(*a, **k)
    monkeypatch.setattr(lean_lora, "lean_lora_experts", spy)
    x = torch.randint(0, 256, (2, 11))
    res = {}
    for ac in ("none", mode):
        m, _ = model_with_lora(seed)
        for mod in m.modules():
            if isinstance(mod, GroupedLoRALinear):
                mod.backend = "fused"
        apply_activation_checkpointing(m, ac)
        logits = m(x).logits
        logits.float().square().mean().backward()
        res[ac] = [logits.detach()] + [p.grad.clone() for n, p in m.named_parameters() if p.requires_grad]
    assert bufs and all(bufs), bufs
    for a, b in zip(res["none"], res[mode]):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
