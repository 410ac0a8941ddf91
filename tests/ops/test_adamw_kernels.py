"""The multi-tensor AdamW / gradient-norm kernels (ops/optim) and CopyAdamW against the float64 reference and
torch's AdamW, on random tensor lists whose sizes straddle the kernels' blocks."""

import os

import pytest
import torch

from moeadapt.ops.optim import (
    TensorBlocks,
    TensorTable,
    adamw_,
    adamw_reference,
    grad_norm_reference,
    grad_sq_sum,
)
from moeadapt.ops.optim.triton_adamw import BLOCK
from moeadapt.parallel.optim import CopyAdamW


def _sizes():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    return [BLOCK + 1 + int(torch.randint(0, 300, (), generator=g)), 7, 2 * BLOCK,
            int(torch.randint(1, 3000, (), generator=g))]


def _assert_copy(c, p):
    """c is p rounded to bf16: exactly (round to nearest even) when compiled; Triton's interpreter truncates, so
    there within one bf16 step."""
    want = p.detach().to(torch.bfloat16)
    if os.environ.get("TRITON_INTERPRET") == "1":
        step = want.float().abs() * 2.0 ** -7
        assert ((c.float() - want.float()).abs() <= step).all()
        assert ((c.float() - p.detach()).abs() <= step).all()
    else:
        assert torch.equal(c, want)


def _tables(ts):
    return TensorTable(ts, ts[0].device)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scaled", [False, True])
def test_adamw_kernel_matches_reference(seed, grad_dtype, scaled):
    sizes = _sizes()
    p = [torch.randn(n) for n in sizes]
    g = [torch.randn(n).to(grad_dtype) for n in sizes]
    m = [torch.randn(n) * 0.1 for n in sizes]
    v = [torch.rand(n) * 0.01 for n in sizes]
    steps = [torch.full((), float(s)) for s in (3, 1, 7, 2)]  # this step's count, per tensor
    c = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
    want = [adamw_reference(pi.double(), gi.double(), mi.double(), vi.double(), int(si), 3e-3, (0.9, 0.95), 1e-8,
                            0.1, grad_scale=2.5 if scaled else None) for pi, gi, mi, vi, si in zip(p, g, m, v, steps)]
    tabs = {"p": _tables(p), "g": _tables(g), "m": _tables(m), "v": _tables(v), "step": _tables(steps),
            "c": _tables(c)}
    adamw_(tabs, TensorBlocks(sizes, p[0].device), lr=3e-3, betas=(0.9, 0.95), eps=1e-8,
           weight_decay=0.1, grad_scale=torch.tensor(2.5) if scaled else None, found_inf=torch.tensor(0.0))
    for got, ref in zip(zip(p, m, v), want):
        for x, y in zip(got, ref):
            torch.testing.assert_close(x.double(), y, rtol=2e-5, atol=1e-6)
    for ci, pi in zip(c, p):
        _assert_copy(ci, pi)


def test_adamw_kernel_skip_changes_nothing(seed):
    sizes = _sizes()
    ts = {k: [torch.randn(n) for n in sizes] for k in "pgmv"}
    ts["v"] = [x.abs() for x in ts["v"]]
    before = {k: [x.clone() for x in v] for k, v in ts.items()}
    steps = [torch.ones(()) for _ in sizes]
    tabs = {k: _tables(v) for k, v in ts.items()} | {"step": _tables(steps)}
    adamw_(tabs, TensorBlocks(sizes, torch.device("cpu")), lr=1e-2, betas=(0.9, 0.95), eps=1e-8,
           weight_decay=0.0, found_inf=torch.tensor(1.0))
    for k in ts:
        for x, y in zip(ts[k], before[k]):
            assert torch.equal(x, y)


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_grad_sq_sum_matches_reference(seed, grad_dtype):
    sizes = _sizes()
    g = [(torch.randn(n) * 3).to(grad_dtype) for n in sizes]
    got = grad_sq_sum(_tables(g), TensorBlocks(sizes, torch.device("cpu"))).sqrt()
    torch.testing.assert_close(got.double(), grad_norm_reference(g), rtol=1e-5, atol=0)


def test_tensor_table_refuses_strided_tensors():
    with pytest.raises(ValueError, match="contiguous"):
        TensorTable([torch.randn(8, 8).t()], torch.device("cpu"))


def test_copy_adamw_matches_torch_adamw(seed):
    """Three steps (clip divisor, then a skipped step, then a plain one): CopyAdamW on bf16 gradients with copies
    vs torch's AdamW on the same gradients in fp32; the state dict loads into torch's AdamW and back."""
    shapes = [(3, BLOCK // 2 + 5), (11,), (2, 3, 40)]
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    copies = {ps[0]: torch.empty(shapes[0], dtype=torch.bfloat16), ps[2]: torch.empty(shapes[2], dtype=torch.bfloat16)}
    for p in copies:
        p.grad_dtype = torch.bfloat16
    kw = dict(lr=2e-2, betas=(0.9, 0.95), weight_decay=0.05)
    opt, topt = CopyAdamW(ps, copies, **kw), torch.optim.AdamW(ref, **kw)
    for scale, skip in [(3.0, 0.0), (1.0, 1.0), (None, 0.0)]:
        for p, r in zip(ps, ref):
            g = torch.randn(p.shape).to(torch.bfloat16 if p in copies else torch.float32)
            p.grad, r.grad = g, g.float()
        norm = opt.grad_norm()
        torch.testing.assert_close(norm.double(), grad_norm_reference([r.grad for r in ref]), rtol=1e-5, atol=0)
        opt.found_inf = torch.tensor(skip)
        if scale is not None:
            opt.grad_scale = torch.tensor(scale)
        opt.step()
        opt.__dict__.pop("grad_scale", None)
        if not skip:
            for r in ref:
                r.grad.div_(scale or 1.0)
            topt.step()
        for p, r in zip(ps, ref):
            torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)
        for p, c in copies.items():
            _assert_copy(c, p)
    assert all(int(opt.state[p]["step"]) == 2 for p in ps)  # the skipped step did not count
    # the state dict is torch's AdamW's: it loads into torch's optimizer and back
    t2 = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], **kw)
    t2.load_state_dict(opt.state_dict())
    back = CopyAdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], None, **kw)
    back.load_state_dict(t2.state_dict())
    for st in back.state.values():
        assert st["step"].dtype == torch.float32 and st["step"].dim() == 0 and int(st["step"]) == 2


def test_copy_adamw_takes_state_set_from_outside(seed):
    """The DCP resume writes AdamW state straight into optimizer.state (a host step count, moments as DCP made
    them): CopyAdamW's next step reads them as its own, as torch's AdamW would."""
    ps = [torch.nn.Parameter(torch.randn(5, 70)), torch.nn.Parameter(torch.randn(33))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.0)
    opt, topt = CopyAdamW(ps, None, **kw), torch.optim.AdamW(ref, **kw)
    for p, r in zip(ps, ref):
        m, v = torch.randn(p.shape), torch.rand(p.shape)
        opt.state[p] = {"step": torch.tensor(4.0, dtype=torch.float64), "exp_avg": m.clone(),
                        "exp_avg_sq": v[None].expand(2, *p.shape)[0]}
        topt.state[r] = {"step": torch.tensor(4.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
        g = torch.randn(p.shape)
        p.grad, r.grad = g, g.clone()
    opt.step()
    topt.step()
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)
        assert opt.state[p]["step"].dtype == torch.float32 and int(opt.state[p]["step"]) == 5


def test_copy_adamw_takes_row_blocks_of_one_gradient(seed):
    """Gradients that are row blocks of one tensor (shared_input.py hands the adapters' dA over that way when they
    are bf16: views of one GEMM's output) and fp32 gradients of copied weights (the lean experts path): CopyAdamW
    steps them as torch's AdamW does, a block off the kernels' 16-element boundary given its own storage."""
    shapes = [(2, 24), (3, 24), (1, 24)]  # the second and third start 48 and 120 elements in: 120 is off the grid
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes] + [torch.nn.Parameter(torch.randn(4, 9))]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    copies = {p: torch.empty(p.shape, dtype=torch.bfloat16) for p in ps}
    kw = dict(lr=2e-2, betas=(0.9, 0.95), weight_decay=0.05)
    opt, topt = CopyAdamW(ps, copies, **kw), torch.optim.AdamW(ref, **kw)
    rows = torch.randn(6, 24).to(torch.bfloat16)
    for p, g in zip(ps, [*rows.split([2, 3, 1]), torch.randn(4, 9)]):
        p.grad_dtype = None
        p.grad = g
    for p, r in zip(ps, ref):
        r.grad = p.grad.float()
    torch.testing.assert_close(opt.grad_norm().double(), grad_norm_reference([r.grad for r in ref]), rtol=1e-5, atol=0)
    assert ps[2].grad._base is None and ps[1].grad._base is rows  # the block off the grid was copied, only it
    opt.step()
    topt.step()
    for p, r in zip(ps, ref):
        torch.testing.assert_close(p.detach(), r.detach(), rtol=1e-5, atol=1e-6)
        _assert_copy(copies[p], p)
