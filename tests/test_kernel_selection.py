"""kernels/selection.py: fused_select (error-feedback accumulation, threshold comparison,
compaction into region slots, the in-pass histogram, momentum velocity) against its torch
reference."""

import numpy as np
import oktopk_triton.kernels as K
import pytest
import torch
from kernel_cases import (
    BACKENDS,
    CUDA,
    DEV,
    GRAD_DTYPES,
    abs_bits,
    check_selection,
    finite_nonzero,
    gen,
    make_grad,
    needs_triton,
    region_layout,
    run_pair,
    same_bits,
)
from oktopk_triton.kernels import Selection, fused_select
from oktopk_triton.kernels.selection import SELECT_HIST_BINS, SELECT_HIST_SHIFT


# ----------------------------------------------------------------------------------------------
# fused_select
# ----------------------------------------------------------------------------------------------
# large n: every mode in fp32, one mode per low-precision dtype (keeps the file fast); 16385 =
# 4 interpreter programs of 4096 and a 1-element tail (65537 cost 4x the interpreter time)
SELECT_CASES = [(n, dtype, mode) for n in (1, 7, 1000, 16385) for dtype in GRAD_DTYPES
                for mode in ("nothing", "some", "everything")
                if n != 16385 or dtype == "fp32" or mode == "some"]


@needs_triton
@pytest.mark.parametrize("P", [1, 3, 8])
@pytest.mark.parametrize("n,dtype,mode", SELECT_CASES)
def test_fused_select_matches_reference(n, P, dtype, mode):
    grad, residual = make_grad(n, GRAD_DTYPES[dtype], seed=n + P)
    offsets = region_layout(n, P, seed=n * 7 + P)
    thr = {"nothing": float("inf"), "some": 1.5, "everything": 0.0}[mode]
    thr = torch.tensor(thr, dtype=torch.float32, device=DEV)
    capacity = max(1, n // (2 * P))        # overflows in "everything", not in "some"
    outs = run_pair(grad, residual, thr, offsets, capacity)
    acc = residual + grad.float()
    torch.testing.assert_close(outs["triton"][0], acc, rtol=0, atol=0)
    torch.testing.assert_close(outs["torch"][0], acc, rtol=0, atol=0)
    full = fused_select(grad, residual.clone(), thr, offsets, n, backend="torch")
    ref = outs["torch"][1]
    # the reference itself against a plain definition
    sizes = (offsets[1:] - offsets[:-1]).cpu()
    sel = (acc.abs() >= thr) & (acc != 0)
    want = torch.stack([sel[int(offsets[p]):int(offsets[p + 1])].sum() for p in range(P)])
    assert torch.equal(ref.counts.cpu().to(torch.int64), want.cpu().to(torch.int64))
    if mode == "nothing":
        assert int(ref.counts.sum()) == 0
    if mode == "everything":
        assert int(ref.counts.sum()) == int((acc != 0).sum())
    assert sizes.sum() == n
    check_selection(outs["triton"][1], ref, full, acc, offsets, capacity, exact_order=not CUDA)


@needs_triton
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_select_at_benchmark_scale(dtype):
    """On CUDA n = 2^24 + 7 (offset and slot arithmetic at the sizes the GPU benchmarks use,
    which the small cases above never reach), 8 regions, the threshold from the histogram at
    1%, with ample and with tight slots; on CPU the same check at 2^14 + 7."""
    n, P = ((1 << 24) if CUDA else (1 << 14)) + 7, 8
    grad, residual = make_grad(n, GRAD_DTYPES[dtype], seed=24)
    offsets = region_layout(n, P, seed=24)
    acc = residual + grad.float()
    k = n // 100
    thr = K.histogram_threshold(acc, k, backend="triton")
    assert float(thr) == float(K.histogram_threshold(acc, k, backend="torch"))
    full = fused_select(grad, residual.clone(), thr, offsets, n, backend="torch")
    for capacity in (3 * k // P + 64, k // (4 * P)):         # ample, tight (overflows)
        outs = run_pair(grad, residual, thr, offsets, capacity)
        assert torch.equal(outs["triton"][0], acc)
        check_selection(outs["triton"][1], outs["torch"][1], full, acc, offsets, capacity,
                        exact_order=not CUDA)


@needs_triton
@pytest.mark.parametrize("capacity", [0, 1, 5])
def test_fused_select_capacity_overflow(capacity):
    n, P = 5000, 3
    grad, residual = make_grad(n, torch.float32, seed=3)
    offsets = region_layout(n, P, seed=5, empty=False)
    thr = torch.tensor(0.5, device=DEV)
    outs = run_pair(grad, residual, thr, offsets, capacity)
    full = fused_select(grad, residual.clone(), thr, offsets, n, backend="torch")
    ref = outs["torch"][1]
    assert (ref.counts > capacity).all()               # true counts past the capacity
    assert torch.equal(ref.counts, full.counts)
    acc = residual + grad
    check_selection(outs["triton"][1], ref, full, acc, offsets, capacity, exact_order=not CUDA)
    for be in outs:                                    # residual keeps all of acc
        torch.testing.assert_close(outs[be][0], acc, rtol=0, atol=0)


@needs_triton
def test_fused_select_all_regions_empty_but_one():
    n = 3000
    offsets = torch.tensor([0, 0, 0, n, n, n], dtype=torch.int64, device=DEV)
    grad, residual = make_grad(n, torch.float32, seed=9)
    thr = torch.tensor(1.0, device=DEV)
    outs = run_pair(grad, residual, thr, offsets, 2000)
    ref = outs["torch"][1]
    assert ref.counts[[0, 1, 3, 4]].abs().sum() == 0 and ref.counts[2] > 0
    check_selection(outs["triton"][1], ref, ref, residual + grad, offsets, 2000,
                    exact_order=not CUDA)


@needs_triton
@pytest.mark.parametrize("skip", [0, 1])
def test_fused_select_skip_and_nonfinite(skip):
    n = 9000
    grad, residual = make_grad(n, torch.float16, seed=1)
    offsets = torch.tensor([0, 1000, 1000, 5000, n], dtype=torch.int64, device=DEV)
    residual[10] = float("nan")          # region 0
    grad[6000] = float("inf")            # region 3
    skip_t = torch.tensor(skip, dtype=torch.int32, device=DEV)
    thr = torch.tensor(1.0, device=DEV)
    outs = run_pair(grad, residual, thr, offsets, 4000, skip=skip_t)
    for be, (r, sel) in outs.items():
        if skip:
            assert torch.equal(r.nan_to_num(), residual.nan_to_num()), be     # untouched
            assert int(sel.counts.abs().sum()) == 0 and int(sel.nonfinite.sum()) == 0
        else:
            assert sel.nonfinite.tolist() == [1, 0, 0, 1], be
            assert torch.isinf(sel.values[3, :int(sel.counts[3])]).any()   # inf is selected
    if not skip:
        check_selection(outs["triton"][1], outs["torch"][1], outs["torch"][1],
                        residual + grad.float(), offsets, 4000, exact_order=not CUDA)


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_fused_select_out_packed_message_views(backend):
    n, P, cap = 20000, 3, 700
    grad, residual = make_grad(n, torch.bfloat16, seed=4)
    offsets = region_layout(n, P, seed=8, empty=False)
    thr = torch.tensor(1.2, device=DEV)
    msg = torch.full((P, 2 + 2 * cap), -7, dtype=torch.int32, device=DEV)
    out = Selection(msg[:, 2:2 + cap], msg[:, 2 + cap:].view(torch.float32), msg[:, 0], msg[:, 1])
    r = residual.clone()
    got = fused_select(grad, r, thr, offsets, cap, out=out, backend=backend)
    assert got.counts.data_ptr() == msg.data_ptr()
    ref = fused_select(grad, residual.clone(), thr, offsets, cap, backend="torch")
    assert torch.equal(msg[:, 0], ref.counts) and torch.equal(msg[:, 1], ref.nonfinite)
    assert bool((ref.counts > cap).any()), "the test needs an overflowing row"
    # the allowed set of an overflowing row is every selected entry of its region (an uncapped
    # reference), not the capped reference's ascending prefix: compiled Triton fills slots in
    # program order, so on CUDA the row holds any `cap` of them (this was the CUDA failure)
    full = fused_select(grad, residual.clone(), thr, offsets, n, backend="torch")
    check_selection(got, ref, full, residual + grad.float(), offsets, cap, exact_order=not CUDA)


def test_check_selection_accepts_any_order_fill_on_overflow():
    """What compiled Triton legally produces on CUDA: an overflowing row holding a non-prefix
    subset of its region's selection, in any order. check_selection must accept it (with the
    capped reference as the allowed set it did not, which failed the packed-views test on an
    H100) and must still reject an entry that was never selected."""
    n, P, cap = 5000, 2, 100
    grad, residual = make_grad(n, torch.float32, seed=21)
    offsets = region_layout(n, P, seed=3, empty=False)
    thr = torch.tensor(0.5, device=DEV)
    acc = residual + grad.float()
    ref = fused_select(grad, residual.clone(), thr, offsets, cap, backend="torch")
    full = fused_select(grad, residual.clone(), thr, offsets, n, backend="torch")
    assert bool((ref.counts > cap).all())
    sel = Selection(ref.indices.clone(), ref.values.clone(), ref.counts.clone(),
                    ref.nonfinite.clone())
    for p in range(P):             # the LAST cap selected entries of the region, reversed
        c = int(full.counts[p])
        idx = full.indices[p, c - cap:c].flip(0)
        sel.indices[p] = idx
        sel.values[p] = acc[int(offsets[p]) + idx.to(torch.int64)]
    check_selection(sel, ref, full, acc, offsets, cap, exact_order=False)
    bad = Selection(sel.indices.clone(), sel.values.clone(), sel.counts, sel.nonfinite)
    start = int(offsets[0])
    unselected = int(((acc[start:int(offsets[1])].abs() < 0.5)).nonzero()[0])
    bad.indices[0, 0] = unselected
    bad.values[0, 0] = acc[start + unselected]
    with pytest.raises(AssertionError):
        check_selection(bad, ref, full, acc, offsets, cap, exact_order=False)


@needs_triton
@pytest.mark.parametrize("n,P", [(1, 1), (7, 3), (1000, 8), (16385, 5)])
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_fused_select_per_region_thresholds(n, P, dtype):
    """threshold [P]: region j selects |acc| >= threshold[j] (0, inf and NaN thresholds among
    them), in every backend; equal to P scalar-threshold selections restricted to one region."""
    grad, residual = make_grad(n, GRAD_DTYPES[dtype], seed=n + 3 * P)
    offsets = region_layout(n, P, seed=n + P)
    choices = torch.tensor([0.0, 0.4, 1.1, 2.5, float("inf"), float("nan")])
    thr = choices[torch.randint(0, 6, (P,), generator=gen(P))] if P > 1 else choices[2:3]
    thr = thr.to(DEV)
    capacity = max(1, n // (3 * P))
    outs = run_pair(grad, residual, thr, offsets, capacity)
    acc = residual + grad.float()
    ref = outs["torch"][1]
    full = fused_select(grad, residual.clone(), thr, offsets, n, backend="torch")
    for p in range(P):
        lo, hi = int(offsets[p]), int(offsets[p + 1])
        a = acc[lo:hi]
        want = int(((a.abs() >= thr[p]) & (a != 0)).sum())
        assert int(ref.counts[p]) == want, (p, float(thr[p]))
        # the same entries as a scalar-threshold selection, in this region's row
        one = fused_select(grad, residual.clone(), thr[p].reshape(()), offsets, n, backend="torch")
        assert int(one.counts[p]) == want
        assert torch.equal(full.indices[p, :want], one.indices[p, :want])
    check_selection(outs["triton"][1], ref, full, acc, offsets, capacity, exact_order=not CUDA)
    for be in outs:
        torch.testing.assert_close(outs[be][0], acc, rtol=0, atol=0)


def test_fused_select_threshold_shape_is_checked():
    grad, residual = make_grad(100, torch.float32)
    offsets = torch.tensor([0, 50, 100], dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match=r"\[P\] = \[2\]"):
        fused_select(grad, residual, torch.ones(3, device=DEV), offsets, 10)


@pytest.mark.parametrize("cuda_visible", [False, True])
@pytest.mark.parametrize("thr_v", [1.3, 0.0, float("inf")])
def test_fused_select_torch_path_reads_nothing_from_the_host(monkeypatch, thr_v, cuda_visible):
    """The torch path is the one path for CPU tensors, on a CPU-only machine and on a CUDA one
    (a CPU tensor on a CUDA machine once took a path with a host read); it reads no tensor
    value on the host (item / tolist / nonzero / bool / int / float are forbidden while it runs)
    and still selects exactly, non-finite entries included."""
    from oktopk_triton.kernels.selection import _fused_select_torch, empty_selection
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda_visible)
    n, P, cap = 30001, 5, 2000
    grad, residual = make_grad(n, torch.bfloat16, seed=21)
    grad, residual = grad.cpu(), residual.cpu()
    residual[77] = float("inf")
    residual[5] = float("nan")
    offsets = region_layout(n, P, seed=22).cpu()
    thr = torch.tensor(thr_v)
    acc = residual + grad.float()
    r = residual.clone()
    out = empty_selection(P, cap, "cpu")

    def forbid(attr):
        def f(self, *args, **kwargs):
            raise AssertionError(f"Tensor.{attr} called by the torch selection path")
        return f
    for attr in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "__index__"):
        monkeypatch.setattr(torch.Tensor, attr, forbid(attr))
    sel = _fused_select_torch(grad, r, thr, offsets, cap, None, out, None, 0.0, False, None)
    monkeypatch.undo()
    full = fused_select(grad, residual.clone(), thr, offsets, n, backend="torch")
    check_selection(sel, sel, full, acc, offsets, cap, exact_order=True)
    # non-finite entries are flagged in their regions
    want = [int((~acc[int(offsets[p]):int(offsets[p + 1])].isfinite()).any()) for p in range(P)]
    assert sel.nonfinite.tolist() == want and sum(want) >= 1


# ----------------------------------------------------------------------------------------------
# fused_select: velocity (momentum correction) and the in-pass histogram
# ----------------------------------------------------------------------------------------------
def velocity_case(n, dtype, seed):
    """grad, residual, velocity with exact zeros of acc where u' != 0 (residual = -u'), so that
    the velocity mask has something to do."""
    g = gen(seed)
    grad = torch.randn(n, generator=g).to(dtype)
    velocity = torch.randn(n, generator=g)
    residual = torch.randn(n, generator=g) * 0.5
    grad[::11] = 0
    velocity[::11] = 0
    residual[::11] = 0                      # acc == 0 and u' == 0
    u_new = velocity * np.float32(0.9) + grad.float()
    residual[5::13] = -u_new[5::13]         # acc == 0 exactly, u' != 0
    return grad.to(DEV), residual.to(DEV), velocity.to(DEV)


def velocity_expected(grad, residual, velocity, momentum, mask):
    """numpy fp32, one rounding per operation: u' = fl(fl(u * m) + g); acc = fl(r + u')."""
    g = grad.float().cpu().numpy()
    u = velocity.cpu().numpy() * np.float32(momentum)
    u = (u + g).astype(np.float32)
    acc = (residual.cpu().numpy() + u).astype(np.float32)
    if mask:
        u = np.where(acc == 0, np.float32(0), u)
    return torch.from_numpy(acc), torch.from_numpy(u)


@needs_triton
@pytest.mark.parametrize("n,P", [(1, 1), (7, 3), (1000, 3), (20001, 5)])
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("mask", [False, True])
def test_fused_select_velocity_two_roundings(n, P, dtype, mask):
    grad, residual, velocity = velocity_case(n, GRAD_DTYPES[dtype], seed=n + P)
    acc_want, u_want = velocity_expected(grad, residual, velocity, 0.9, mask)
    assert (acc_want == 0).any() or n < 7
    offsets = region_layout(n, P, seed=n)
    thr = torch.tensor(1.1, device=DEV)
    capacity = max(1, n // (2 * P))
    outs = {}
    for be in BACKENDS:
        r, u = residual.clone(), velocity.clone()
        sel = K.fused_select(grad, r, thr, offsets, capacity, velocity=u, momentum=0.9,
                             mask_velocity=mask, backend=be)
        assert same_bits(r, acc_want), be
        assert same_bits(u, u_want), be
        outs[be] = sel
    full = K.fused_select(grad, residual.clone(), thr, offsets, n, velocity=velocity.clone(),
                          momentum=0.9, mask_velocity=mask, backend="torch")
    check_selection(outs["triton"], outs["torch"], full, acc_want.to(DEV), offsets, capacity,
                    exact_order=not CUDA)
    if mask and n >= 7:   # the mask zeroed u where acc == 0 and u' was not
        unmasked = velocity_expected(grad, residual, velocity, 0.9, False)[1]
        assert ((unmasked != 0) & (u_want == 0)).any()


@needs_triton
def test_fused_select_velocity_skip_leaves_everything():
    n, P = 5000, 3
    grad, residual, velocity = velocity_case(n, torch.float32, seed=3)
    offsets = region_layout(n, P, seed=3)
    hist0 = torch.arange(P * SELECT_HIST_BINS, dtype=torch.int32, device=DEV).view(P, -1)
    for be in BACKENDS:
        r, u, h = residual.clone(), velocity.clone(), hist0.clone()
        sel = K.fused_select(grad, r, torch.tensor(0.5, device=DEV), offsets, 100, velocity=u,
                             momentum=0.9, mask_velocity=True, hist=h,
                             skip=torch.tensor(1, dtype=torch.int32, device=DEV), backend=be)
        assert torch.equal(r, residual) and torch.equal(u, velocity) and torch.equal(h, hist0), be
        assert int(sel.counts.sum()) == 0 and int(sel.nonfinite.sum()) == 0, be


def hist_recount(acc, thresholds, offsets):
    """int32 [P, 64]: per region, bin = clamp(((bits(|acc|) - bits(thr)) >> SHIFT) + 32, 0, 63)
    over the finite nonzero |acc| (plain Python loop over regions; independent of the kernels)."""
    acc = acc.cpu()
    offsets = offsets.cpu().tolist()
    P = len(offsets) - 1
    thresholds = thresholds.cpu().float().reshape(-1).expand(P)
    out = torch.zeros(P, SELECT_HIST_BINS, dtype=torch.int32)
    for j in range(P):
        a = acc[offsets[j]:offsets[j + 1]]
        b = abs_bits(a)[finite_nonzero(a)]
        tb = int(abs_bits(thresholds[j:j + 1]))
        bins = ((b - tb) >> SELECT_HIST_SHIFT) + SELECT_HIST_BINS // 2
        bins = bins.clamp(0, SELECT_HIST_BINS - 1)
        out[j] = torch.bincount(bins, minlength=SELECT_HIST_BINS).to(torch.int32)
    return out


def wide_acc_case(n, seed):
    """grad, residual whose acc spans many binades (bins 0..63 all populated around 1.0), with
    exact zeros, NaN and +-Inf."""
    g = gen(seed)
    grad = torch.randn(n, generator=g) * torch.exp(2.5 * torch.randn(n, generator=g))
    residual = torch.randn(n, generator=g) * 0.1
    grad[::17] = 0
    residual[::17] = 0
    if n >= 40:
        grad[3], grad[20], grad[31] = float("nan"), float("inf"), -float("inf")
    return grad.to(DEV), residual.to(DEV)


@needs_triton
@pytest.mark.parametrize("n,P", [(1, 1), (7, 3), (1000, 4), (20001, 5)])
@pytest.mark.parametrize("per_region", [False, True])
@pytest.mark.parametrize("velocity", [False, True])
def test_fused_select_hist_matches_recount(n, P, per_region, velocity):
    grad, residual = wide_acc_case(n, seed=n * 3 + P)
    offsets = region_layout(n, P, seed=n + 1)
    if per_region and P > 1:   # a zero, tiny, ordinary and huge threshold
        vals = [0.0, 1e-30, 1.0, 3.7, 1e30, 0.25]
        thr = torch.tensor([vals[j % len(vals)] for j in range(P)], device=DEV)
    else:
        thr = torch.tensor(1.0, device=DEV)
    u0 = torch.randn(n, generator=gen(9)).to(DEV) if velocity else None
    # every bin edge of the region's threshold, and the bit pattern just below it, as exact acc
    for j in range(P):
        a, b = int(offsets[j]), int(offsets[j + 1])
        if b - a < 2 * SELECT_HIST_BINS:
            continue
        e = K.select_hist_edges(thr.reshape(-1)[j if thr.dim() else 0])[1:-1].cpu()
        e_bits = e.view(torch.int32)
        at_edges = torch.cat([e_bits, (e_bits - 1).clamp(min=0)]).view(torch.float32)
        m = at_edges.numel()
        grad[a:a + m], residual[a:a + m] = at_edges.to(DEV), 0.0
        if velocity:
            u0[a:a + m] = 0.0
    hist0 = torch.randint(0, 5, (P, SELECT_HIST_BINS), generator=gen(2), dtype=torch.int32).to(DEV)
    accs, hists = {}, {}
    for be in BACKENDS:
        r, h = residual.clone(), hist0.clone()
        u = u0.clone() if velocity else None
        K.fused_select(grad, r, thr, offsets, max(1, n // 10), velocity=u, momentum=0.9,
                       mask_velocity=True, hist=h, backend=be)
        accs[be], hists[be] = r, h
    want = hist0.cpu() + hist_recount(accs["torch"], thr, offsets)
    assert same_bits(accs["triton"], accs["torch"])
    assert torch.equal(hists["torch"].cpu(), want)
    assert torch.equal(hists["triton"].cpu(), want)
    if n == 20001 and not per_region:       # the data do reach both open end bins
        add = want - hist0.cpu()
        assert int(add[:, 0].sum()) > 0 and int(add[:, -1].sum()) > 0
        assert int((add.sum(0) > 0).sum()) == SELECT_HIST_BINS


def test_select_hist_edges():
    thr = torch.tensor([0.0, 1e-30, 1.0, 3.7, -2.5, 1e30, 3e38])
    edges = K.select_hist_edges(thr)
    assert edges.shape == (thr.numel(), SELECT_HIST_BINS + 1) and edges.dtype == torch.float32
    assert (edges[:, 0] == 0).all() and torch.isinf(edges[:, -1]).all()
    assert (edges[:, 1:] >= edges[:, :-1]).all()
    for i, t in enumerate(thr.tolist()):
        t = abs(t)
        if t > 0:
            assert float(edges[i, 32]) == t                     # bin 32 starts at the threshold
        if 1e-30 < t < 1e30:                                    # 8 bins = one binade
            assert float(edges[i, 40]) == 2 * t and float(edges[i, 24]) == t / 2
            assert float(edges[i, 48]) == 4 * t and float(edges[i, 16]) == t / 4
    # count(|acc| >= edge[b]) == sum(hist[b:]) for every b, on data spanning all the bins
    x = torch.randn(20000, generator=gen(4)) * torch.exp(3 * torch.randn(20000, generator=gen(5)))
    x[::7] = 0
    x[1], x[2] = float("inf"), float("nan")
    offsets = torch.tensor([0, x.numel()], dtype=torch.int64)
    for i in range(thr.numel()):
        h = hist_recount(x, thr[i], offsets)[0].to(torch.int64)
        suffix = torch.flip(torch.cumsum(torch.flip(h, (0,)), 0), (0,)).tolist() + [0]
        fin = x[finite_nonzero(x)].abs()
        counts = [int((fin >= e).sum()) for e in edges[i].tolist()]
        assert counts == suffix, i
    # [..., 65] for any batch shape; a 0-dim threshold gives [65]
    assert K.select_hist_edges(torch.tensor(1.0)).shape == (SELECT_HIST_BINS + 1,)
    assert K.select_hist_edges(thr.view(7, 1)).shape == (7, 1, SELECT_HIST_BINS + 1)
