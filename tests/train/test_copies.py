"""bf16 weight copies (train/copies.py): the same loss and gradients as autocast's per-use casts, gradients kept
in bf16 (fp32 where the lean experts path computes them in fp32), for full fine-tuning and LoRA, and the runs
that must not take them."""

import contextlib

import pytest
import torch

from moeadapt.config import RunConfig
from moeadapt.models.model import build_model, materialize
from moeadapt.models.moe import GroupedLinear
from moeadapt.models.router import Router
from moeadapt.train.copies import WeightCopies, copy_targets, why_not
from moeadapt.train.local import LocalRun
from tests.conftest import micro_spec


def _loss(model, x, y):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(x, y, return_logits=False)
        return out.loss + out.aux_loss


def test_lent_copies_give_autocasts_loss_and_gradients(seed):
    spec = micro_spec(tie_word_embeddings=True)
    model = materialize(build_model(spec, "meta"), "cpu", seed=seed % 1000)
    for mod in model.modules():
        if isinstance(mod, GroupedLinear):
            mod.backend = "reference"
    x = torch.randint(0, spec.vocab_size, (2, 24))
    y = torch.randint(0, spec.vocab_size, (2, 24))
    want = _loss(model, x, y)
    want.backward()
    ref = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)

    targets = copy_targets(model)
    names = {id(p): n for n, p in model.named_parameters()}
    got_names = {names[id(w)] for _, _, w in targets}
    assert any(".experts.w1" in n for n in got_names) and any("attn" in n for n in got_names)
    assert "embed.weight" not in got_names  # shared with the LM head: left to autocast
    assert not any("router" in n or "norm" in n for n in got_names)
    copies = WeightCopies(targets)
    with copies.lent():
        got = _loss(model, x, y)
    assert all(m._parameters[n] is w for (m, n), w in zip(copies.slots, copies.weights))  # given back
    got.backward()
    assert torch.equal(got, want)
    for n, p in model.named_parameters():
        if p.grad is None:
            assert n not in ref
            continue
        if n in got_names:
            assert p.grad.dtype == torch.bfloat16, n
            # autocast made this same bf16 gradient and cast it up exactly
            assert torch.equal(p.grad.float(), ref[n]), n
        else:
            assert p.grad.dtype == torch.float32
            torch.testing.assert_close(p.grad, ref[n], rtol=0, atol=0)


def test_refresh_follows_the_weights(seed):
    model = materialize(build_model(micro_spec(), "meta"), "cpu", seed=seed % 1000)
    copies = WeightCopies(copy_targets(model))
    with torch.no_grad():
        for w in copies.weights:
            w.mul_(2)
    copies.refresh()
    for c, w in zip(copies.copies, copies.weights):
        assert torch.equal(c, w.detach().to(torch.bfloat16))


@pytest.mark.parametrize("change, why", [
    (dict(train=dict(weight_copies=False)), "weight_copies is off"),
    (dict(train=dict(grad_accum_steps=2)), "grad_accum_steps"),
    (dict(parallel=dict(activation_checkpointing="full")), "recompute"),
    (dict(train=dict(dtype="fp32")), "without bf16 autocast"),
])
def test_runs_that_keep_autocasts_casts(change, why):
    cfg = RunConfig(model=micro_spec(), **change)
    assert why in why_not(cfg, LocalRun(cfg, torch.device("cuda")), torch.device("cuda"))
    for ok in (RunConfig(model=micro_spec()), RunConfig(model=micro_spec(), lora=dict(rank=4))):  # LoRA included
        assert why_not(ok, LocalRun(ok, torch.device("cuda")), torch.device("cuda")) is None
        assert "autocast" in why_not(ok, LocalRun(ok, torch.device("cpu")), torch.device("cpu"))


@pytest.mark.parametrize("moments, weights", [(torch.float32, "fp32"), (torch.bfloat16, "fp32"),
                                              (torch.bfloat16, "bf16"), (torch.float32, "bf16"),
                                              (torch.float32, "fp32_split")])
def test_checkpoint_round_trip_with_copy_adamw(seed, tmp_path, moments, weights):
    """A CopyAdamW run saved and resumed (train/checkpoint.py) continues exactly: weights (fp32 with copies, or
    bf16 or fp32_split: train.weight_dtype, the split weights' int16 low halves with them), moments (fp32 or bf16:
    the file keeps their dtype), step counts and copies as they were, and the next step the same as the unbroken
    run's."""
    from moeadapt.parallel.optim import CopyAdamW
    from moeadapt.train.checkpoint import load_checkpoint, save_checkpoint
    from moeadapt.train.copies import store_bf16

    spec = micro_spec(n_layers=2)
    x = torch.randint(0, spec.vocab_size, (2, 16))
    y = torch.randint(0, spec.vocab_size, (2, 16))

    def setup():
        model = materialize(build_model(spec, "meta"), "cpu", seed=seed % 1000)
        for mod in model.modules():
            if isinstance(mod, GroupedLinear):
                mod.backend = "reference"
        if weights != "fp32":
            store_bf16(model)
        copies = WeightCopies(copy_targets(model))  # none of bf16 weights
        params = [p for p in model.parameters() if p.requires_grad]
        routers = {id(m.weight) for m in model.modules() if isinstance(m, Router)}
        assert routers
        assert all(p.dtype == (torch.float32 if weights == "fp32" or id(p) in routers else torch.bfloat16)
                   for p in params)  # the routers' weights stay fp32 (store_bf16)
        opt = CopyAdamW(params, copies.by_weight(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1,
                        moment_dtype=moments, split_weights=weights == "fp32_split")
        return model, copies, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    def step(model, copies, opt):
        with copies.lent():
            loss = _loss(model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    a = setup()
    step(a[0], a[1], a[3])
    path = save_checkpoint(tmp_path, 1, a[0], a[3], a[4], {"pos": 0})
    b = setup()
    load_checkpoint(path, b[0], b[3], b[4])
    b[1].refresh()
    a[1].refresh()  # Triton's interpreter truncates to bf16 where the compiled kernel rounds as torch does
    for ca, cb in zip(a[1].copies, b[1].copies):
        assert torch.equal(ca, cb)
    step(a[0], a[1], a[3])
    step(b[0], b[1], b[3])
    for pa, pb in zip(a[2], b[2]):
        assert torch.equal(pa, pb)
        split = weights == "fp32_split" and pa.dtype == torch.bfloat16
        for k in ("exp_avg", "exp_avg_sq", "step") + (("weight_lo",) if split else ()):
            assert torch.equal(a[3].state[pa][k], b[3].state[pb][k]), k
        assert b[3].state[pb]["exp_avg"].dtype == moments
    if weights == "fp32_split":  # the low halves were saved and loaded as int16, and they are not all zero
        halves = [p for p in b[2] if p.dtype == torch.bfloat16]
        assert all(b[3].state[p]["weight_lo"].dtype == torch.int16 for p in halves)
        assert any(bool(b[3].state[p]["weight_lo"].any()) for p in halves)
        assert all("weight_lo" not in b[3].state[p] for p in b[2] if p.dtype == torch.float32)


def test_a_split_checkpoint_whose_router_was_split_resumes_it_whole(seed, tmp_path):
    """A fp32_split checkpoint saved while the routers' weights were split too (bf16 high half in the model file,
    int16 low half in the optimizer state) resumes into a run that keeps them fp32 (store_bf16): the two halves are
    joined into the exact fp32 weight and no low half is left in the state."""
    from moeadapt.ops.optim import split_fp32
    from moeadapt.parallel.optim import CopyAdamW
    from moeadapt.train.checkpoint import load_checkpoint, save_checkpoint
    from moeadapt.train.copies import store_bf16

    spec = micro_spec(n_layers=2)

    def setup(split_routers):
        model = materialize(build_model(spec, "meta"), "cpu", seed=seed % 1000)
        lows = {}
        store_bf16(model, lows)
        if split_routers:  # as store_bf16 did before the routers stayed fp32
            for m in model.modules():
                if isinstance(m, Router):
                    m.weight.data, lows[m.weight] = split_fp32(m.weight.data)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = CopyAdamW(params, lr=1e-2, split_weights=True)
        opt.seed_low_halves(lows)
        return model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    want = {n: p.detach().clone() for n, p in setup(False)[0].named_parameters() if n.endswith("router.weight")}
    old = setup(True)
    assert all(old[0].get_parameter(n).dtype == torch.bfloat16 for n in want)
    path = save_checkpoint(tmp_path, 1, *old, {"pos": 0})
    new = setup(False)
    with torch.no_grad():
        for n in want:
            new[0].get_parameter(n).zero_()
    load_checkpoint(path, *new)
    for n, w in want.items():
        p = new[0].get_parameter(n)
        assert p.dtype == torch.float32 and torch.equal(p.detach().view(torch.int32), w.view(torch.int32)), n
        assert "weight_lo" not in new[1].state.get(p, {}), n


def test_a_misaligned_trainable_tensor_keeps_autocasts_casts(seed):
    """A trainable tensor that is a view at an odd offset cannot be stepped by the multi-tensor AdamW: the run keeps
    autocast's casts and torch's AdamW, and says why."""
    cfg = RunConfig(model=micro_spec())
    run = LocalRun(cfg, torch.device("cuda"))
    model = materialize(build_model(micro_spec(), "meta"), "cpu", seed=seed % 1000)
    assert why_not(cfg, run, torch.device("cuda"), model) is None
    norm = next(m for n, m in model.named_modules() if n.endswith("norm") and hasattr(m, "weight"))
    buf = torch.zeros(norm.weight.numel() + 1)
    buf[1:].copy_(norm.weight.detach())
    norm.weight.data = buf[1:]
    assert "aligned storage" in why_not(cfg, run, torch.device("cuda"), model)


# ---------------------------------------------------------------- LoRA: the adapters' copies
def _lora_model(seed, expert_path):
    """The micro model LoRA'd as the trainer makes it (fp32 adapters, frozen bf16 base; B nonzero so that every
    adapter's gradient matters), its experts on `expert_path`: "reference" (CPU's "auto"), "lean", "fold" (the
    gather / SwiGLU folds of fused_lora) or "layers" (fused_lora per layer)."""
    from moeadapt.config import LoRASpec
    from moeadapt.lora import GroupedLoRALinear, cast_frozen_, inject_lora
    from moeadapt.models.moe import GroupedExperts

    model = materialize(build_model(micro_spec(), "meta"), "cpu", seed=seed % 1000)
    inject_lora(model, LoRASpec(rank=4))
    cast_frozen_(model, torch.bfloat16)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(std=0.02)
    for m in model.modules():
        if isinstance(m, GroupedLoRALinear):
            m.backend = "auto" if expert_path == "reference" else "fused"
        if isinstance(m, GroupedExperts):
            m.lora_path = "auto" if expert_path in ("reference", "lean") else expert_path
    return model


def _torch_twins(monkeypatch):
    """fused_lora / lean_lora's passes as their torch forms (the Triton interpreter does not run them in bf16).
    Their K-grouped dA / dB round to bf16 before the fp32 output, as the GPU kernel does not: the GPU test
    checks the fp32 gradients' bits (tests/gpu/test_copies_gpu.py)."""
    from moeadapt.ops.moe import fused_lora, lean_lora

    monkeypatch.setattr(fused_lora, "_use_triton", lambda t: False)
    monkeypatch.setattr(lean_lora, "_use_triton", lambda t: False)


@pytest.mark.parametrize("expert_path", ["reference", "lean", "fold", "layers"])
def test_lora_copies_give_the_casts_loss_and_gradients(seed, monkeypatch, expert_path):
    """Every adapter (LoRALinear's lora_A / lora_B, the grouped experts' lora_A / lora_B) is copied; the lent step
    computes the same loss and gradients, bit for bit, on every expert path. The gradients come bf16 (the same bf16
    GEMM outputs the casts' backward cast up), except lean's, which computes the experts' adapter gradients in
    fp32 and hands them to the fp32 adapters as they are."""
    from moeadapt.lora import GroupedLoRALinear
    from moeadapt.ops.moe import lean_lora

    _torch_twins(monkeypatch)
    model = _lora_model(seed, expert_path)
    x = torch.randint(0, 264, (2, 24))
    y = torch.randint(0, 264, (2, 24))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    copies = WeightCopies(copy_targets(model))
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(w)] for w in copies.weights} == trained  # every adapter, and nothing else
    calls = []
    lean = lean_lora.lean_lora_experts
    monkeypatch.setattr(lean_lora, "lean_lora_experts", lambda *a, **k: calls.append(k["copies"]) or lean(*a, **k))

    def step(lend):
        model.zero_grad(set_to_none=True)
        calls.clear()
        with copies.lent() if lend else contextlib.nullcontext():
            loss = _loss(model, x, y)
        loss.backward()
        return loss, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    want, ref = step(False)
    assert all(g.dtype == torch.float32 for g in ref.values())
    got, grads = step(True)
    assert all(not m.lent for m in model.modules() if isinstance(m, GroupedLoRALinear))  # given back
    assert (len(calls) == 3 and all(c is not None for c in calls)) if expert_path == "lean" else not calls
    assert torch.equal(got, want)
    assert grads.keys() == ref.keys() == trained
    for n, g in grads.items():
        fp32 = expert_path == "lean" and ".experts." in n
        assert g.dtype == (torch.float32 if fp32 else torch.bfloat16), n
        assert torch.equal(g.float(), ref[n]), n


def test_the_lent_forward_reads_the_copies(seed, monkeypatch):
    """Inside `lent` the adapters' products read the copies, not the adapters (a stale copy gives the old loss);
    outside it, and after `refresh`, the model computes from the adapters as they are now. (On the lean path the
    gate/up A would still be read from the adapters: see GroupedExperts.forward_lean.)"""
    _torch_twins(monkeypatch)
    model = _lora_model(seed, "fold")
    x = torch.randint(0, 264, (2, 24))
    y = torch.randint(0, 264, (2, 24))
    copies = WeightCopies(copy_targets(model))
    with torch.no_grad():
        want = _loss(model, x, y)
        for w in copies.weights:
            w.mul_(1.5)  # the optimizer's step, without the copies
        changed = _loss(model, x, y)
        with copies.lent():
            stale = _loss(model, x, y)
        copies.refresh()
        with copies.lent():
            fresh = _loss(model, x, y)
    assert torch.equal(stale, want) and not torch.equal(changed, want)
    assert torch.equal(fresh, changed)


def test_lora_copies_leave_saved_and_exported_adapters_alone(seed, monkeypatch, tmp_path):
    """The copies are no parameters: after a lent step checkpoint_tensors, the state dict and the peft export see
    the fp32 adapters (the same tensors, and the same files as without copies); the forward outside `lent` (eval,
    export checks) is unchanged."""
    from moeadapt.config import LoRASpec
    from moeadapt.lora import export_peft
    from moeadapt.models.model import checkpoint_tensors

    _torch_twins(monkeypatch)
    model = _lora_model(seed, "lean")
    x = torch.randint(0, 264, (2, 24))
    y = torch.randint(0, 264, (2, 24))
    before = checkpoint_tensors(model)
    keys = list(model.state_dict())
    with torch.no_grad():
        loss = _loss(model, x, y)
    export_peft(model, LoRASpec(rank=4), tmp_path / "plain")
    copies = WeightCopies(copy_targets(model))
    with copies.lent():
        _loss(model, x, y).backward()
    after = checkpoint_tensors(model)
    assert before.keys() == after.keys()
    assert all(after[k] is before[k] and before[k].dtype == torch.float32 for k in before)
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        assert torch.equal(_loss(model, x, y), loss)
    export_peft(model, LoRASpec(rank=4), tmp_path / "copied")
    a, b = (tmp_path / "plain" / "adapter_model.safetensors"), (tmp_path / "copied" / "adapter_model.safetensors")
    assert a.read_bytes() == b.read_bytes()


def _expert_grads(experts, x, offs, dy, pairs: bool, swap: bool = False):
    """Output and (w1, w3, w2, x) gradients of a GroupedExperts step with lent copies (pairs: w1's and w3's
    copies the halves of one buffer, which the forward then reads as one GEMM; swap: the halves exchanged)."""
    from moeadapt.train.copies import gate_up_pairs

    for w in experts.parameters():
        w.grad = None
    targets = copy_targets(experts)
    copies = WeightCopies(targets, gate_up_pairs(experts, targets) if pairs else ())
    if swap:
        c1, c3 = (copies.by_weight()[m.weight] for m in (experts.w1, experts.w3))
        tmp = c1.clone()
        c1.copy_(c3)
        c3.copy_(tmp)
    xg = x.detach().requires_grad_()
    with copies.lent():
        assert (experts._gate_up_pair(xg) is not None) == pairs
        y = experts(xg, offs)
    y.backward(dy)
    return [y.detach().float()] + [t.grad.float() for t in (experts.w1.weight, experts.w3.weight, experts.w2.weight,
                                                             xg)]


def test_gate_up_pair_computes_the_two_projections(seed):
    """Full fine-tuning's experts with w1's and w3's copies in one buffer (ops/moe/gate_up.py): one GEMM each way
    gives the output and every gradient of the two-GEMM path (bf16 GEMMs: to rounding), and the weights'
    gradients come back bf16 and contiguous; exchanging the two halves of the buffer fails the comparison."""
    from moeadapt.models.moe import GroupedExperts
    from moeadapt.ops.optim.triton_adamw import BLOCK

    E, L = 3, 512
    F = BLOCK // L  # each expert's [F, L] half one optimizer block
    experts = GroupedExperts(E, L, F)
    for w in experts.parameters():
        torch.nn.init.normal_(w, std=L ** -0.5)
        w.grad_dtype = None
    for w in (experts.w1, experts.w3, experts.w2):
        w.backend = "torch"  # torch._grouped_mm, as on CUDA
    counts = torch.tensor([5, 0, 11])
    offs = torch.cumsum(counts, 0, dtype=torch.int32)
    x = torch.randn(int(counts.sum()), L).to(torch.bfloat16)
    dy = torch.randn(x.shape[0], L).to(torch.bfloat16)
    want = _expert_grads(experts, x, offs, dy, pairs=False)
    got = _expert_grads(experts, x, offs, dy, pairs=True)
    assert experts.w1.weight.grad.dtype == torch.bfloat16 and experts.w1.weight.grad.is_contiguous()
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * float(w.abs().max()))
    bad = _expert_grads(experts, x, offs, dy, pairs=True, swap=True)
    assert not torch.allclose(bad[0], want[0], rtol=2e-2, atol=2e-2 * float(want[0].abs().max()))


@pytest.mark.parametrize("change, why", [
    (dict(lora=dict(rank=4)), "for full fine-tuning"),
    (dict(train=dict(grad_accum_steps=2)), "merge_microbatches"),
    (dict(train=dict(dtype="fp32")), "bf16 autocast"),
])
@pytest.mark.parametrize("weights", ["bf16", "fp32_split"])
def test_bf16_weights_refused_where_they_cannot_run(change, why, weights):
    from moeadapt.train.copies import why_not_bf16

    change = {k: dict(v) for k, v in change.items()}
    train = dict(weight_dtype=weights) | change.pop("train", {})
    cfg = RunConfig(model=micro_spec(), train=train, **change)
    cuda = torch.device("cuda")
    assert why in why_not_bf16(cfg, LocalRun(cfg, cuda), cuda)
    assert "weight_dtype: fp32" in why_not_bf16(cfg, LocalRun(cfg, cuda), cuda)
    assert f"weight_dtype: {weights} " in why_not_bf16(cfg, LocalRun(cfg, cuda), cuda)
    ok = RunConfig(model=micro_spec(), train=dict(weight_dtype=weights))
    assert why_not_bf16(ok, LocalRun(ok, cuda), cuda) is None
    assert "GPU" in why_not_bf16(ok, LocalRun(ok, torch.device("cpu")), torch.device("cpu"))
    merged = RunConfig(model=micro_spec(), train=dict(weight_dtype=weights, grad_accum_steps=2,
                                                     merge_microbatches=True))
    assert why_not_bf16(merged, LocalRun(merged, cuda), cuda) is None


def test_store_bf16_keeps_the_parameters_and_pairs_the_experts(seed):
    """store_bf16: every trainable parameter bf16 but the routers' weights (fp32: they pick the experts), the same
    Parameter objects and names, the values rounded to bf16 (with `lows`, split exactly: the int16 low halves
    kept); the experts whose [F, L] is a whole number of
    optimizer blocks get w1 / w3 as one buffer's halves,
    which their forward then reads as one GEMM, with the output and gradients of the two-GEMM path on the same
    bf16 weights (bf16 GEMMs: to rounding)."""
    from moeadapt.models.moe import GroupedExperts
    from moeadapt.ops.optim import join_fp32
    from moeadapt.ops.optim.triton_adamw import BLOCK
    from moeadapt.train.copies import store_bf16

    model = materialize(build_model(micro_spec(), "meta"), "cpu", seed=seed % 1000)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    assert store_bf16(model) == 0  # micro_spec's experts are smaller than one block
    routers = [n for n, _ in model.named_parameters() if n.endswith("router.weight")]
    assert routers
    for n, p in model.named_parameters():
        want = torch.float32 if n in routers else torch.bfloat16
        assert p is before[n][0] and p.dtype == want, (n, p.dtype)
        assert torch.equal(p.detach(), before[n][1].to(want)), n

    E, L = 3, 512
    F = BLOCK // L
    torch.manual_seed(seed)
    experts = GroupedExperts(E, L, F)
    for w in (experts.w1, experts.w3, experts.w2):
        torch.nn.init.normal_(w.weight, std=0.05)
    twin = GroupedExperts(E, L, F)
    twin.load_state_dict(experts.state_dict())
    for w in (*experts.children(), *twin.children()):
        w.backend = "torch"  # torch._grouped_mm, as on CUDA
    w1 = experts.w1.weight
    w32 = {n: p.detach().clone() for n, p in experts.named_parameters()}
    lows = {}
    assert store_bf16(experts, lows) == 1 and store_bf16(twin) == 1
    for n, p in experts.named_parameters():  # split exactly (fp32_split), the paired halves included
        assert torch.equal(join_fp32(p.detach(), lows[p]).view(torch.int32), w32[n].view(torch.int32)), n
    twin._gu_pair = None  # the twin runs the two GEMMs on the same values (twin: rounded to nearest even)
    assert experts.w1.weight is w1 and experts.w1.weight.dtype == torch.bfloat16
    counts = torch.tensor([70, 0, 58])
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), L).to(torch.bfloat16)
    dy = torch.randn(int(counts.sum()), L).to(torch.bfloat16)
    outs = []
    for m in (experts, twin):
        xg = x.clone().requires_grad_()
        assert (m._gate_up_pair(xg) is not None) == (m is experts)
        y = m(xg, offs)
        y.backward(dy)
        outs.append([y.detach().float()] + [t.grad.float() for t in (m.w1.weight, m.w3.weight, m.w2.weight, xg)])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2 * float(b.abs().max()))
    assert experts.w1.weight.grad.dtype == torch.bfloat16 and experts.w1.weight.grad.is_contiguous()
    with torch.no_grad():  # the halves exchanged: the same check fails
        buf = experts._gu_pair
        buf.copy_(torch.cat([buf[:, F:], buf[:, :F]], 1))
        y = experts(x, offs).float()
    assert not torch.allclose(y, outs[1][0], rtol=2e-2, atol=2e-2 * float(outs[1][0].abs().max()))


@pytest.mark.parametrize("kept", ["bf16", "fp32_split"])
def test_bf16_weights_train_in_the_trainers_loop(seed, monkeypatch, kept):
    """train.weight_dtype bf16 / fp32_split through the trainer's own loop (make_optimizer -> store_bf16 ->
    CopyAdamW, the clip as its grad_scale, the skip flag on the device) on the tiny model against the fp32 run from
    the same weights and batches: every loss within 1% and every gradient norm within 3% over three steps, the
    weights' updates within half their size of the fp32 run's, the weights bf16 and the experts' w1 / w3 paired;
    split weights start as the fp32 weights bit for bit (their low halves seeded). On the CPU, in Triton's
    interpreter: the GPU-only refusal is lifted here (the same test on a GPU: tests/gpu/test_copies_gpu.py)."""
    from moeadapt.config import get_preset
    from moeadapt.models.moe import GroupedExperts
    from moeadapt.train import trainer
    from tests.conftest import trainer_loop

    monkeypatch.setattr(trainer, "why_not_bf16", lambda *a: None)
    spec = get_preset("tiny")
    g = torch.Generator().manual_seed(seed)
    data = [torch.randint(3, spec.vocab_size, (2, 65), generator=g) for _ in range(3)]
    base = materialize(build_model(spec, "meta"), "cpu", seed=seed % 1000)
    runs, moved = {}, {}
    for w in ("fp32", kept):
        cfg = RunConfig.model_validate({"model": spec.model_dump(), "train": {
            "device": "cpu", "dtype": "bf16", "micro_batch_size": 2, "seq_len": 64, "steps": 3, "lr": 1e-3,
            "warmup_steps": 0, "weight_dtype": w}})
        lp, params, _ = trainer_loop(cfg, base, data)
        m = lp.model
        start = [p.detach().float().clone() for p in params]
        if w == "fp32":
            fp32_start = start
        elif w == "fp32_split":  # the fp32 weights exactly: bf16 halves + seeded low halves
            start = [lp.opt.full_weight(p).clone() for p in params]
            assert all(torch.equal(a.view(torch.int32), b.view(torch.int32)) for a, b in zip(start, fp32_start))
        stats = []
        for step in range(3):
            lp.step = step
            stats.append(trainer.train_step(lp))
        stats = [s for s in stats + [trainer.settle(lp)] if s is not None]
        assert [s.step for s in stats] == [0, 1, 2] and all(s.skipped is None for s in stats)
        runs[w] = [(float(s.loss), float(s.grad_norm)) for s in stats]
        now = [lp.opt.full_weight(p) if w == "fp32_split" else p.detach().float() for p in params]
        moved[w] = torch.cat([(p - s).flatten() for p, s in zip(now, start)])
        routers = {id(r.weight) for r in m.modules() if isinstance(r, Router)}
        assert all(p.dtype == (torch.float32 if w == "fp32" or id(p) in routers else torch.bfloat16) for p in params)
        if w != "fp32":
            assert all(e._gu_pair is not None for e in m.modules() if isinstance(e, GroupedExperts))
    for (la, na), (lb, nb) in zip(runs[kept], runs["fp32"]):
        assert abs(la - lb) < 1e-2 * lb and abs(na - nb) < 3e-2 * nb, (runs[kept], runs["fp32"])
    rel = float((moved[kept] - moved["fp32"]).norm() / moved["fp32"].norm())
    assert rel < 0.5, f"the weights' updates differ by {rel:.3f} (relative)"  # no update at all: 1.0


def test_weight_dtype_auto_is_split_where_bf16_parameters_run():
    """train.weight_dtype auto (the default) settles to fp32_split for one-process full fine-tuning on a GPU with
    bf16 autocast and train.weight_copies on, and to fp32 elsewhere (LoRA, torchrun, the CPU, fp32 steps, bf16
    gradients adding over several forwards, copies turned off); explicit values are kept."""
    from types import SimpleNamespace

    from moeadapt.train.copies import resolve_weight_dtype, why_not_bf16

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    one = SimpleNamespace(world=1)

    def settled(device=cuda, run=one, **change):
        train = change.pop("train", {})
        cfg = RunConfig(model=micro_spec(), train=train, **change)
        assert cfg.train.weight_dtype == train.get("weight_dtype", "auto")
        assert why_not_bf16(cfg, run, device) is None or train.get("weight_dtype") not in (None, "auto")
        return resolve_weight_dtype(cfg, run, device).train.weight_dtype

    assert settled() == "fp32_split"
    assert settled(train=dict(grad_accum_steps=2, merge_microbatches=True)) == "fp32_split"
    assert settled(lora=dict(rank=4)) == "fp32"
    assert settled(run=SimpleNamespace(world=2)) == "fp32"
    assert settled(cpu) == "fp32"
    assert settled(train=dict(dtype="fp32")) == "fp32"
    assert settled(train=dict(grad_accum_steps=2)) == "fp32"
    assert settled(train=dict(weight_copies=False)) == "fp32"
    for w in ("fp32", "bf16", "fp32_split"):
        assert settled(train=dict(weight_dtype=w)) == w


def test_split_weights_export_their_fp32_values(seed, tmp_path):
    """A split-weights run (train.weight_dtype fp32_split) exports what the trainer's `_export` writes for it:
    every trained weight in fp32, joined with its int16 low half bit for bit (not the bf16 half the matmuls read,
    which the plain export would write), after two CopyAdamW steps that moved the low halves off zero."""
    from moeadapt.io import load_tensors
    from moeadapt.ops.optim import join_fp32
    from moeadapt.parallel.optim import CopyAdamW
    from moeadapt.parallel.sharded_io import export_sharded
    from moeadapt.train.copies import store_bf16

    spec = micro_spec(n_layers=2)
    model = materialize(build_model(spec, "meta"), "cpu", seed=seed % 1000)
    for mod in model.modules():
        if isinstance(mod, GroupedLinear):
            mod.backend = "reference"
    store_bf16(model)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = CopyAdamW(params, None, lr=1e-2, split_weights=True)
    x, y = (torch.randint(0, spec.vocab_size, (2, 16)) for _ in range(2))
    for _ in range(2):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    export_sharded(model, tmp_path / "model", {"moeadapt": spec.model_dump(mode="json")}, dtype=torch.float32,
                   value=opt.full_weight)
    out = load_tensors(tmp_path / "model" / "model.safetensors")
    names = {id(p): n for n, p in model.named_parameters()}
    differs = 0
    for p in params:
        got = out[names[id(p)]]  # a weight kept whole (the routers', fp32) is written as it is
        want = join_fp32(p.detach(), opt.state[p]["weight_lo"]) if p.dtype == torch.bfloat16 else p.detach()
        assert got.dtype == torch.float32
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
        differs += int((got != p.detach().float()).sum())
    assert differs > 0  # the low halves carry something the bf16 halves alone would lose


def test_a_split_run_resumes_as_fp32_weights(seed, tmp_path):
    """A checkpoint of a split-weights run (bf16 halves in model.safetensors, int16 low halves in the optimizer's
    state) resumed with train.weight_dtype fp32: the fp32 weights are the joined halves bit for bit, not the bf16
    halves alone."""
    from moeadapt.ops.optim import join_fp32
    from moeadapt.parallel.optim import CopyAdamW
    from moeadapt.train.checkpoint import load_checkpoint, save_checkpoint
    from moeadapt.train.copies import store_bf16

    spec = micro_spec(n_layers=2)
    x, y = (torch.randint(0, spec.vocab_size, (2, 16)) for _ in range(2))

    def setup(split):
        model = materialize(build_model(spec, "meta"), "cpu", seed=seed % 1000)
        for mod in model.modules():
            if isinstance(mod, GroupedLinear):
                mod.backend = "reference"
        if split:
            store_bf16(model)
        params = [p for p in model.parameters() if p.requires_grad]
        opt = CopyAdamW(params, None, lr=1e-2, split_weights=split)
        return model, params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)

    model, params, opt, sched = setup(True)
    for _ in range(2):
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    path = save_checkpoint(tmp_path, 2, model, opt, sched, {"pos": 0})
    want = [join_fp32(p.detach(), opt.state[p]["weight_lo"]) if p.dtype == torch.bfloat16 else p.detach().clone()
            for p in params]  # the routers' weights are kept whole (fp32)
    m2, p2, opt2, sched2 = setup(False)
    load_checkpoint(path, m2, opt2, sched2)
    for p, w in zip(p2, want):
        assert p.dtype == torch.float32
        assert torch.equal(p.detach().view(torch.int32), w.view(torch.int32))
    assert all("weight_lo" not in opt2.state[p] for p in p2)


def test_split_weights_start_from_the_fp32_weights(seed, tmp_path):
    """fp32_split starts from the fp32 weights themselves, not their bf16 rounding: `store_bf16(model, lows)`
    gives every weight its exact low half (join(parameter, low) is the fp32 weight bit for bit; the paired
    gate/up halves: test_store_bf16_keeps_the_parameters_and_pairs_the_experts), CopyAdamW takes them before its
    first step, and a checkpoint of fp32 weights (a run saved with train.weight_dtype fp32) resumed as split
    weights keeps them exactly too; without the halves the weights would differ from the fp32 ones."""
    from moeadapt.ops.optim import join_fp32
    from moeadapt.parallel.optim import CopyAdamW
    from moeadapt.train.checkpoint import load_checkpoint, save_checkpoint
    from moeadapt.train.copies import store_bf16

    spec = micro_spec(n_layers=2)

    def fresh():
        model = materialize(build_model(spec, "meta"), "cpu", seed=seed % 1000)
        for mod in model.modules():
            if isinstance(mod, GroupedLinear):
                mod.backend = "reference"
        return model

    model = fresh()
    names = dict(model.named_parameters())
    fp32 = {n: p.detach().clone() for n, p in names.items() if p.requires_grad}
    lows = {}
    store_bf16(model, lows)
    whole = {n for n in fp32 if n.endswith("router.weight")}  # kept fp32: no low half
    assert whole and {id(p) for p in lows} == {id(names[n]) for n in fp32 if n not in whole}
    for n, w in fp32.items():
        p = names[n]
        if n in whole:
            assert p.dtype == torch.float32 and torch.equal(p.detach(), w), n
            continue
        assert p.dtype == torch.bfloat16
        assert torch.equal(join_fp32(p.detach(), lows[p]).view(torch.int32), w.view(torch.int32)), n
    assert any(not torch.equal(names[n].detach().float(), w) for n, w in fp32.items())
    params = [p for p in model.parameters() if p.requires_grad]
    opt = CopyAdamW(params, None, lr=1e-2, split_weights=True)
    opt.seed_low_halves(lows)
    assert all(torch.equal(opt.state[p]["weight_lo"], lows[p]) for p in params if p in lows)
    with pytest.raises(ValueError, match="int16 halves"):
        opt.seed_low_halves({params[0]: lows[params[0]].float()})

    # a checkpoint of the fp32 weights, resumed as split weights
    ref = fresh()
    ref_params = [p for p in ref.parameters() if p.requires_grad]
    ref_opt = CopyAdamW(ref_params, None, lr=1e-2)
    path = save_checkpoint(tmp_path, 0, ref, ref_opt, torch.optim.lr_scheduler.LambdaLR(ref_opt, lambda s: 1.0),
                           {"pos": 0})
    m2 = fresh()
    store_bf16(m2)
    p2 = [p for p in m2.parameters() if p.requires_grad]
    opt2 = CopyAdamW(p2, None, lr=1e-2, split_weights=True)
    load_checkpoint(path, m2, opt2, torch.optim.lr_scheduler.LambdaLR(opt2, lambda s: 1.0))
    for (n, p), w in zip(((n, p) for n, p in m2.named_parameters() if p.requires_grad), fp32.values()):
        assert torch.equal(opt2.full_weight(p).view(torch.int32), w.view(torch.int32)), n
