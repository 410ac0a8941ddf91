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
    moment_bits,
    stochastic_round_bf16,
)
from moeadapt.ops.optim.triton_adamw import BLOCK
from moeadapt.parallel.optim import CopyAdamW


def _sizes():
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    return [BLOCK + 1 + int(torch.randint(0, 300, (), generator=g, device="cpu")), 7, 2 * BLOCK,
            int(torch.randint(1, 3000, (), generator=g, device="cpu"))]


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
    got = grad_sq_sum(_tables(g), TensorBlocks(sizes, g[0].device)).sqrt()
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


def _ulp(x: torch.Tensor) -> torch.Tensor:
    """bf16's spacing at |x| (fp32 tensor): 2^(e - 7) for |x| in [2^e, 2^(e + 1))."""
    return torch.where(x == 0, torch.full_like(x, 2.0 ** -133), torch.ldexp(torch.ones_like(x), torch.frexp(x)[1] - 8))


def _bf16_step_tol(want: torch.Tensor, got: torch.Tensor, before: torch.Tensor) -> torch.Tensor:
    """How far a bf16 weight updated in fp32 may sit from the float64 update `want` (float64): one bf16 step of the
    result, or fp32's rounding of the update's operands where the new weight is their near-cancelling difference
    (a weight of 0.074 stepped to ~8e-7: fp32's error there, ~1e-8, is many bf16 steps of the result)."""
    fp32_err = 4 * 2.0 ** -23 * (before.double().abs() + (before.double() - want).abs())
    return torch.maximum(torch.maximum(_ulp(want.float()), _ulp(got.float())).double(), fp32_err)


def test_adamw_kernel_bf16_moments_match_reference(seed):
    """bf16 moments: the weights as the float64 step on the same (bf16-valued) moments; the stored moments the
    reference's stochastic rounding with the same random bits (`moment_bits`), bit for bit but for the few
    elements whose fp32 value lands on the other side of a rounding threshold from the float64 one."""
    sizes = _sizes()
    p = [torch.randn(n) for n in sizes]
    g = [torch.randn(n).to(torch.bfloat16) for n in sizes]
    m = [(torch.randn(n) * 0.1).to(torch.bfloat16) for n in sizes]
    v = [(torch.rand(n) * 0.01).to(torch.bfloat16) for n in sizes]
    steps = [torch.full((), float(s)) for s in (3, 1, 7, 2)]
    s0 = int(torch.randint(0, 2**31, ()))
    want = [adamw_reference(pi.double(), gi.double(), mi.double(), vi.double(), int(si), 3e-3, (0.9, 0.95), 1e-8,
                            0.1, bits=moment_bits(s0, i, int(si), pi.numel()))
            for i, (pi, gi, mi, vi, si) in enumerate(zip(p, g, m, v, steps))]
    tabs = {"p": _tables(p), "g": _tables(g), "m": _tables(m), "v": _tables(v), "step": _tables(steps)}
    adamw_(tabs, TensorBlocks(sizes, p[0].device), lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
           seed=s0)
    for pi, mi, vi, (wp, wm, wv) in zip(p, m, v, want):
        torch.testing.assert_close(pi.double(), wp, rtol=2e-5, atol=1e-6)
        for got, ref in ((mi, wm), (vi, wv)):
            assert got.dtype == torch.bfloat16
            off = got.float() != ref.float()
            assert off.float().mean() < 0.01, off.float().mean()
            # one bf16 step, plus fp32 rounding where m cancels near zero
            assert ((got.float() - ref.float()).abs() <= torch.maximum(_ulp(ref.float()), _ulp(got.float())) + 1e-6).all()


def _bias_in_ulps(stored: torch.Tensor, exact: torch.Tensor) -> float:
    return float(((stored.double() - exact.double()) / _ulp(exact.float()).double()).mean())


def test_bf16_moments_are_unbiased_where_round_to_nearest_is_not(seed):
    """Every element of v the same and g^2 the same: the fp32 update lands a random fraction f of a bf16 step
    above a bf16 value. The kernel's stored v averages to the fp32 value (within 0.02 of a step over 64k
    elements; the noise is ~0.002), where round-to-nearest is off by min(f, 1 - f) steps, which the same check
    refuses."""
    n = 16 * BLOCK
    v0 = float(torch.empty(()).uniform_(0.5, 1.0).to(torch.bfloat16))
    f = float(torch.empty(()).uniform_(0.15, 0.85))
    b2 = 0.95
    g2 = v0 + f * float(_ulp(torch.tensor(v0))) / (1 - b2)  # v' = v0 + (1 - b2) (g^2 - v0) = v0 + f bf16 steps
    p, g = torch.randn(n), torch.full((n,), g2 ** 0.5).to(torch.float32)
    m, v = torch.zeros(n, dtype=torch.bfloat16), torch.full((n,), v0, dtype=torch.bfloat16)
    exact = torch.full((n,), b2 * v0 + (1 - b2) * float(g[0].double() ** 2), dtype=torch.float64)
    tabs = {"p": _tables([p]), "g": _tables([g]), "m": _tables([m]), "v": _tables([v]),
            "step": _tables([torch.full((), 5.0)])}
    adamw_(tabs, TensorBlocks([n], p.device), lr=1e-3, betas=(0.9, b2), eps=1e-8, weight_decay=0.0, seed=7)
    assert abs(_bias_in_ulps(v, exact)) < 0.02
    assert abs(_bias_in_ulps(exact.float().to(torch.bfloat16), exact)) > 0.1  # round to nearest fails the check


def test_bf16_moments_track_a_slow_second_moment():
    """beta2 = 0.999 and |g| steady 2% above sqrt(v): each step moves v by 0.004% of itself, a tenth of bf16's
    spacing. Stored round-to-nearest, v never moves; stochastically rounded (the reference's rounding, the
    kernel's bit for bit above), its mean follows the fp32 trajectory."""
    n, b2, steps = 8192, 0.999, 300
    v32 = torch.ones(n, dtype=torch.float64)
    v_sr = v_rn = torch.ones(n, dtype=torch.bfloat16)
    g2 = 1.02 ** 2
    for t in range(1, steps + 1):
        v32 = b2 * v32 + (1 - b2) * g2
        up = lambda v: b2 * v.double() + (1 - b2) * g2  # noqa: E731
        v_sr = stochastic_round_bf16(up(v_sr).float(), moment_bits(3, 0, t, n) >> 16)
        v_rn = up(v_rn).float().to(torch.bfloat16)
    moved = float(v32[0]) - 1.0  # ~0.0105
    assert abs(float(v_sr.double().mean()) - float(v32[0])) < 0.03 * moved
    assert float(v_rn.double().mean()) == 1.0  # round to nearest: stuck


def test_copy_adamw_bf16_moments(seed):
    """CopyAdamW with bf16 moments: bf16 state, weights within a few bf16-moment rounding steps of torch's fp32
    AdamW after three steps, and a state dict that loads back bit for bit (into either moment dtype and into
    torch's AdamW)."""
    shapes = [(3, BLOCK // 2 + 5), (11,), (2, 3, 40)]
    ps = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    copies = {ps[0]: torch.empty(shapes[0], dtype=torch.bfloat16)}
    ps[0].grad_dtype = torch.bfloat16
    kw = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.05)
    opt = CopyAdamW(ps, copies, moment_dtype=torch.bfloat16, seed=11, **kw)
    topt = torch.optim.AdamW(ref, **kw)
    for _ in range(3):
        for p, r in zip(ps, ref):
            gr = torch.randn(p.shape).to(torch.bfloat16 if p in copies else torch.float32)
            p.grad, r.grad = gr, gr.float()
        opt.step()
        topt.step()
    for p, r in zip(ps, ref):
        assert opt.state[p]["exp_avg"].dtype == torch.bfloat16 and opt.state[p]["exp_avg_sq"].dtype == torch.bfloat16
        # each step's update is lr x m / sqrt(v), both within ~0.4% of torch's: 3 steps stay under 3 x 1.5% of lr
        torch.testing.assert_close(p.detach(), r.detach(), rtol=0, atol=3 * 0.015 * kw["lr"])
        assert (p.detach() - r.detach()).abs().max() > 0  # the moments' rounding shows: not the fp32 run itself
    _assert_copy(copies[ps[0]], ps[0])
    sd = opt.state_dict()
    back = CopyAdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], None, moment_dtype=torch.bfloat16, **kw)
    back.load_state_dict(sd)
    wide = CopyAdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], None, **kw)
    wide.load_state_dict(sd)
    t2 = torch.optim.AdamW([torch.nn.Parameter(p.detach().clone()) for p in ps], **kw)
    t2.load_state_dict(sd)
    for p, pb, pw, pt in zip(ps, back.param_groups[0]["params"], wide.param_groups[0]["params"],
                             t2.param_groups[0]["params"]):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(back.state[pb][k], opt.state[p][k])
            assert wide.state[pw][k].dtype == torch.float32 and torch.equal(wide.state[pw][k], opt.state[p][k].float())
            assert torch.equal(t2.state[pt][k], opt.state[p][k].float())


def test_bf16_moments_refused_where_copy_adamw_does_not_run():
    from moeadapt.config import TrainSpec
    from moeadapt.parallel.optim import build_optimizer

    with pytest.raises(ValueError, match="moment_dtype: bf16 .* on the CPU"):
        build_optimizer([torch.nn.Parameter(torch.randn(4))], TrainSpec(moment_dtype="bf16"), torch.device("cpu"))
    with pytest.raises(ValueError, match="moment_dtype"):
        TrainSpec(moment_dtype="fp16")


def test_copy_adamw_writes_copies_that_are_row_blocks(seed):
    """The gate/up pair's copies (train/copies.py): w1's and w3's bf16 copies the two row halves of one
    [E, 2F, L] buffer. Each half holds its weight's copy after a step; a buffer whose halves are not whole
    kernel blocks is refused."""
    E, F, L = 3, 4, BLOCK // 4  # F * L = BLOCK: each expert's half is one block
    w1, w3 = (torch.nn.Parameter(torch.randn(E, F, L)) for _ in range(2))
    buf = torch.full((E, 2 * F, L), float("nan"), dtype=torch.bfloat16)
    copies = {w1: buf[:, :F], w3: buf[:, F:]}
    for w in (w1, w3):
        w.grad_dtype = None
        w.grad = torch.randn(E, F, L).to(torch.bfloat16)
    opt = CopyAdamW([w1, w3], copies, lr=1e-2, betas=(0.9, 0.95))
    opt.step()
    _assert_copy(buf[:, :F], w1)
    _assert_copy(buf[:, F:], w3)
    bad = torch.empty(E, 2 * F + 1, L // 2, dtype=torch.bfloat16)[:, :F]
    with pytest.raises(ValueError, match="whole number of"):
        TensorTable([bad], bad.device, row_blocks=True)
    with pytest.raises(ValueError, match="contiguous"):
        TensorTable([buf[:, :F]], buf.device)  # row blocks only where asked for


def test_bf16_moments_train_like_fp32_moments(seed):
    """A small least-squares fit trained 150 steps by CopyAdamW with bf16 moments and by torch's AdamW (fp32), from
    the same start on the same batches: both fit (loss down > 20x) and the loss curves stay within 5% of each
    other."""
    d_in, d_out, n = 64, 48, 256
    w_true = torch.randn(d_out, d_in) / d_in ** 0.5
    start = torch.randn(d_out, d_in) * 0.02
    runs = {}
    for name in ("bf16", "fp32"):
        w = torch.nn.Parameter(start.clone())
        kw = dict(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
        opt = CopyAdamW([w], None, moment_dtype=torch.bfloat16, seed=seed, **kw) if name == "bf16" else \
            torch.optim.AdamW([w], **kw)
        g = torch.Generator().manual_seed(seed)
        losses = []
        for _ in range(150):
            x = torch.randn(n, d_in, generator=g)
            loss = ((x @ w.t() - x @ w_true.t()) ** 2).mean()
            w.grad = torch.autograd.grad(loss, w)[0]
            opt.step()
            losses.append(float(loss.detach()))
        runs[name] = losses
    for name, ls in runs.items():
        assert ls[-1] < ls[0] / 20, (name, ls[0], ls[-1])
    for a, b in zip(runs["bf16"][10:], runs["fp32"][10:]):
        assert abs(a - b) <= 0.05 * b


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_adamw_kernel_bf16_weights_match_reference(seed, moments):
    """bf16 weights (train.weight_dtype): the stored weight is the reference's stochastic rounding of the fp32
    update with the same random bits (`weight_bits`), bit for bit but for the few elements whose fp32 value lands
    on the other side of a rounding threshold from the float64 one; the moments as with fp32 weights."""
    from moeadapt.ops.optim import weight_bits

    sizes = _sizes()
    p = [torch.randn(n).to(torch.bfloat16) for n in sizes]
    g = [torch.randn(n).to(torch.bfloat16) for n in sizes]
    m = [(torch.randn(n) * 0.1).to(moments) for n in sizes]
    v = [(torch.rand(n) * 0.01).to(moments) for n in sizes]
    steps = [torch.full((), float(s)) for s in (3, 1, 7, 2)]
    s0 = int(torch.randint(0, 2**31, ()))
    bits = [moment_bits(s0, i, int(si), pi.numel()) for i, (pi, si) in enumerate(zip(p, steps))]
    low = moments == torch.bfloat16
    want = [adamw_reference(pi.double(), gi.double(), mi.double(), vi.double(), int(si), 3e-2, (0.9, 0.95), 1e-8,
                            0.1, bits=b if low else None, p_bits=weight_bits(b))
            for pi, gi, mi, vi, si, b in zip(p, g, m, v, steps, bits)]
    p_start = [pi.clone() for pi in p]
    tabs = {"p": _tables(p), "g": _tables(g), "m": _tables(m), "v": _tables(v), "step": _tables(steps)}
    adamw_(tabs, TensorBlocks(sizes, p[0].device), lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
           seed=s0)
    for pi, p0, mi, vi, (wp, wm, wv) in zip(p, p_start, m, v, want):
        assert pi.dtype == torch.bfloat16
        off = pi.float() != wp.float()
        assert off.float().mean() < 0.01, off.float().mean()
        assert ((pi.double() - wp).abs() <= _bf16_step_tol(wp, pi, p0)).all()
        if not low:
            torch.testing.assert_close(mi.double(), wm, rtol=2e-5, atol=1e-6)
            torch.testing.assert_close(vi.double(), wv, rtol=2e-5, atol=1e-6)
    with pytest.raises(ValueError, match="bf16 copy is made of fp32 weights"):
        adamw_(tabs | {"c": _tables([torch.empty(n, dtype=torch.bfloat16) for n in sizes])},
               TensorBlocks(sizes, p[0].device), lr=3e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)


def test_bf16_weights_follow_updates_below_their_spacing(seed):
    """Each step moves the weight by a tenth of bf16's spacing (lr 1e-3 on weights near 1.5, whose spacing is
    2^-7): stored round-to-nearest they never move, stochastically rounded by the kernel their mean follows the
    fp32 trajectory (within 3% of the distance after 200 steps over 16k elements); the same check refuses the
    round-to-nearest weights."""
    n, lr, steps = 4 * BLOCK, 1e-3, 200
    p = torch.full((n,), 1.5, dtype=torch.bfloat16)
    m, v = torch.zeros(n), torch.zeros(n)
    step = torch.zeros(())
    tabs = {"p": _tables([p]), "g": _tables([torch.ones(n, dtype=torch.bfloat16)]), "m": _tables([m]),
            "v": _tables([v]), "step": _tables([step])}
    for _ in range(steps):
        step += 1
        adamw_(tabs, TensorBlocks([n], p.device), lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0, seed=seed)
    exact = 1.5 - lr * steps  # a constant gradient: every Adam step is lr (m / sqrt(v) = 1 after bias correction)
    moved = 1.5 - exact
    assert abs(float(p.double().mean()) - exact) < 0.03 * moved
    rn = torch.tensor(1.5, dtype=torch.bfloat16)
    for _ in range(steps):
        rn = (rn.float() - lr).to(torch.bfloat16)
    assert abs(float(rn) - exact) > 0.5 * moved  # round to nearest: stuck at 1.5


def test_copy_adamw_steps_bf16_weights_in_row_blocks(seed):
    """CopyAdamW on bf16 weights that are the two row halves of one [E, 2F, L] buffer (train.weight_dtype bf16's
    gate/up pair) next to a plain bf16 weight: each half takes the reference step of its own gradient (within one
    bf16 step of the float64 update), the buffer's other rows untouched by the other half's step; a state dict
    loads into torch's AdamW."""
    E, F, L = 2, 4, BLOCK // 4
    buf = torch.randn(E, 2 * F, L).to(torch.bfloat16)
    w1, w3 = torch.nn.Parameter(buf[:, :F]), torch.nn.Parameter(buf[:, F:])
    w1.data, w3.data = buf[:, :F], buf[:, F:]
    other = torch.nn.Parameter(torch.randn(37).to(torch.bfloat16))
    ps = [w1, w3, other]
    before = [p.detach().double().clone() for p in ps]
    grads = [torch.randn(p.shape).to(torch.bfloat16) for p in ps]
    for p, g in zip(ps, grads):
        p.grad = g
    kw = dict(lr=5e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt = CopyAdamW(ps, None, seed=3, **kw)
    opt.step()
    for p, p0, g in zip(ps, before, grads):
        want = adamw_reference(p0, g.double(), torch.zeros_like(p0), torch.zeros_like(p0), 1, kw["lr"], kw["betas"],
                               1e-8, kw["weight_decay"])[0]
        assert p.dtype == torch.bfloat16
        assert ((p.detach().double() - want).abs() <= _bf16_step_tol(want, p.detach(), p0)).all()
    assert w1.data_ptr() == buf.data_ptr() and torch.equal(buf[:, :F], w1.detach())
    t2 = torch.optim.AdamW([torch.nn.Parameter(p.detach().float()) for p in ps], **kw)
    t2.load_state_dict(opt.state_dict())


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.float().contiguous().view(torch.int32)


def test_split_fp32_round_trips_bit_for_bit(seed):
    """split_fp32 / join_fp32 (train.weight_dtype fp32_split) on fp32 values over the whole exponent range, both
    signs, zeros, subnormals, infinities and exact ties: the pair gives the value back bit for bit; the high half
    is torch's bf16 rounding except at exact ties (away from zero there) and the low half is within
    [-2^15, 2^15); dropping the low half loses the value (what the kernel tests below would catch)."""
    from moeadapt.ops.optim import join_fp32, split_fp32

    n = 20000
    x = torch.randn(n) * torch.exp2(torch.randint(-140, 127, (n,)).float())
    ties = (_bits(torch.randn(500)) & ~0xFFFF) | 0x8000
    x = torch.cat([x, ties.view(torch.float32), torch.tensor([0.0, -0.0, 1.0, -1.0, 1e-45, -1e-45, 3.0e38,
                                                              float("inf"), -float("inf")])])
    hi, lo = split_fp32(x)
    assert hi.dtype == torch.bfloat16 and lo.dtype == torch.int16
    assert torch.equal(_bits(join_fp32(hi, lo)), _bits(x))
    tie = (_bits(x) & 0xFFFF) == 0x8000
    rne = x.to(torch.bfloat16)
    assert torch.equal(_bits(hi)[~tie], _bits(rne)[~tie])
    assert (hi.float()[tie].abs() >= x[tie].abs()).all()  # ties away from zero
    assert not torch.equal(_bits(join_fp32(hi, torch.zeros_like(lo))), _bits(x))


@pytest.mark.parametrize("moments", [torch.float32, torch.bfloat16])
def test_adamw_kernel_split_weights_are_the_fp32_weights(seed, moments):
    """Split weights (a bf16 high half + an int16 remainder) take the fp32 weights' update bit for bit: five
    steps of the kernel on both from the same start, gradients and seed give join(hi, lo) equal to the fp32
    weights and the same moments, with hi the split of the fp32 weight. The same weights without their
    remainders (bf16 weights, stochastically rounded) are not the fp32 ones: the check can fail."""
    from moeadapt.ops.optim import join_fp32, split_fp32

    sizes = _sizes()
    p32 = [torch.randn(n) for n in sizes]
    grads = [[torch.randn(n).to(torch.bfloat16) for n in sizes] for _ in range(5)]
    runs = {}
    for kind in ("fp32", "split", "bf16"):
        if kind == "fp32":
            p, lo = [t.clone() for t in p32], None
        else:
            p, lo = map(list, zip(*(split_fp32(t) for t in p32)))
            p = [t.clone() for t in p]
            lo = [t.clone() for t in lo] if kind == "split" else None
        m = [torch.zeros(n, dtype=moments) for n in sizes]
        v = [torch.zeros(n, dtype=moments) for n in sizes]
        steps = [torch.zeros(()) for _ in sizes]
        for gs in grads:
            for s in steps:
                s += 1
            tabs = {"p": _tables(p), "g": _tables(gs), "m": _tables(m), "v": _tables(v), "step": _tables(steps)}
            if lo is not None:
                tabs["lo"] = _tables(lo)
            adamw_(tabs, TensorBlocks(sizes, p[0].device), lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1,
                   grad_scale=torch.tensor(1.5), seed=seed)
        runs[kind] = (p, lo, m, v)
    want, _, wm, wv = runs["fp32"]
    hi, lo, m, v = runs["split"]
    for w, h, low in zip(want, hi, lo):
        assert h.dtype == torch.bfloat16 and low.dtype == torch.int16
        assert torch.equal(_bits(join_fp32(h, low)), _bits(w))
        assert torch.equal(_bits(h), _bits(split_fp32(w)[0]))
    for a, b in zip(m + v, wm + wv):
        assert torch.equal(a, b)
    sr = runs["bf16"][0]
    assert not all(torch.equal(_bits(s), _bits(w)) for s, w in zip(sr, want))


def test_copy_adamw_split_weights_state_dict(seed):
    """CopyAdamW with split_weights on bf16 parameters (the gate/up halves of one buffer and a plain one): three
    steps equal to CopyAdamW's on the fp32 weights bit for bit (join of the parameter and its state's
    `weight_lo`); its state dict loads back (weight_lo kept int16, not cast to the parameter's dtype) and the
    next step still matches; a weight_lo of another dtype is refused; a run without split weights drops it."""
    from moeadapt.ops.optim import join_fp32

    E, F, L = 2, 4, BLOCK // 4
    w32 = [torch.randn(E, F, L).to(torch.bfloat16).float() for _ in range(2)]
    w32.append(torch.randn(37).to(torch.bfloat16).float())  # bf16 values: split starts exact
    grads = [[torch.randn(w.shape).to(torch.bfloat16) for w in w32] for _ in range(4)]

    def make(split):
        if split:
            buf = torch.cat([w32[0], w32[1]], 1).to(torch.bfloat16)
            w1, w3 = torch.nn.Parameter(buf[:, :F]), torch.nn.Parameter(buf[:, F:])
            w1.data, w3.data = buf[:, :F], buf[:, F:]
            ps = [w1, w3, torch.nn.Parameter(w32[2].to(torch.bfloat16))]
        else:
            ps = [torch.nn.Parameter(w.clone()) for w in w32]
            for p in ps:
                p.grad_dtype = None  # bf16 gradients on fp32 weights, as the copies path hands them over
        return ps, CopyAdamW(ps, None, lr=5e-2, betas=(0.9, 0.95), weight_decay=0.1, seed=3, split_weights=split)

    def step(ps, opt, k):
        for p, g in zip(ps, grads[k]):
            p.grad = g.clone()
        opt.step()

    (ps, opt), (ref, ref_opt) = make(True), make(False)
    for k in range(3):
        step(ps, opt, k)
        step(ref, ref_opt, k)
    joined = lambda ps, opt: [join_fp32(p.detach(), opt.state[p]["weight_lo"]) for p in ps]  # noqa: E731
    for a, b in zip(joined(ps, opt), ref):
        assert torch.equal(_bits(a), _bits(b.detach()))
    sd = opt.state_dict()
    ps2, opt2 = make(True)
    with torch.no_grad():
        for a, b in zip(ps2, ps):
            a.copy_(b)
    opt2.load_state_dict(sd)
    assert all(opt2.state[p]["weight_lo"].dtype == torch.int16 for p in ps2)
    step(ps2, opt2, 3)
    step(ref, ref_opt, 3)
    for a, b in zip(joined(ps2, opt2), ref):
        assert torch.equal(_bits(a), _bits(b.detach()))
    bad = {**sd, "state": {i: {**st, "weight_lo": st["weight_lo"].float()} for i, st in sd["state"].items()}}
    with pytest.raises(ValueError, match="weight_lo is not an int16"):
        make(True)[1].load_state_dict(bad)
    plain = CopyAdamW([torch.nn.Parameter(w.clone()) for w in w32], None, lr=5e-2)
    plain.load_state_dict(sd)
    assert all("weight_lo" not in st for st in plain.state.values())
