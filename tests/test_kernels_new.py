"""The kernels against their torch references: fused_select's velocity and in-pass
histogram, magnitude_threshold / window_pass, scatter_rows, the dense step kernels, histogram
``skip`` and clear_sent with a velocity.

On CPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1), so sizes
stay small: the window path of magnitude_threshold is reached either above its exact cut-off
(``EXACT_BELOW`` = 2^16, with n = 70001) or with the cut-off patched to 0 for tiny n.  Offsets
past 2^31 are covered only by the sm_90 compile check (tests/test_kernels.py).
"""
import math

import numpy as np
import pytest
import torch

import oktopk_triton.kernels as K
from oktopk_triton.kernels import threshold as T
from oktopk_triton.kernels.selection import SELECT_HIST_BINS, SELECT_HIST_SHIFT
from test_kernels import (CUDA, DEV, GRAD_DTYPES, check_selection, gen, needs_triton,
                          region_layout)

INF_BITS = 0x7F800000
BACKENDS = ("torch", "triton")


def abs_bits(x):
    """int64 bit patterns of |x| as fp32."""
    return (x.float().contiguous().view(torch.int32) & 0x7FFFFFFF).to(torch.int64)


def finite_nonzero(x):
    b = abs_bits(x)
    return (b != 0) & (b < INF_BITS)


def same_bits(a, b):
    """Bitwise equality of two fp32 tensors (NaN payloads included)."""
    return torch.equal(a.cpu().contiguous().view(torch.int32),
                       b.cpu().contiguous().view(torch.int32))


def tail_count(x, t):
    """#{nonzero finite entries with |x| >= t}."""
    x = x.float().cpu()
    return int(((x.abs() >= float(t)) & finite_nonzero(x)).sum())


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


# ----------------------------------------------------------------------------------------------
# magnitude_threshold: the k-th largest |x| (window pass + candidate sort; histogram fallback)
# ----------------------------------------------------------------------------------------------
N_WINDOW = 70001     # odd, above EXACT_BELOW (2^16): the Triton path takes the window pass

DATA = {
    "normal": lambda n, g: torch.randn(n, generator=g),
    "student_t": lambda n, g: torch.randn(n, generator=g) / torch.sqrt(
        torch.distributions.Chi2(torch.tensor(2.0)).sample((n,)) / 2),
    "lognormal": lambda n, g: torch.exp(2 * torch.randn(n, generator=g)) * torch.sign(
        torch.randn(n, generator=g)),
    "cauchy": lambda n, g: torch.tan(math.pi * (torch.rand(n, generator=g, dtype=torch.float64)
                                                - 0.5)).float(),
}


def kth_largest(x, k):
    """The k-th largest |x| among the finite nonzero entries (sort; 0 when fewer than k)."""
    x = x.float().cpu()
    a = x[finite_nonzero(x)].abs().sort(descending=True).values
    return float(a[k - 1]) if a.numel() >= k else 0.0


def threshold_both(x, k, **kw):
    out = {}
    for be in BACKENDS:
        info = {}
        out[be] = (float(K.magnitude_threshold(x, k, backend=be, info=info, **kw)), info)
    return out


@needs_triton
@pytest.mark.parametrize("dist", list(DATA))
def test_magnitude_threshold_distributions(dist, k=700):
    torch.manual_seed(k)
    x = DATA[dist](N_WINDOW, gen(k)).to(DEV)
    want = kth_largest(x, k)
    res = threshold_both(x, k)
    assert res["torch"][0] == want
    t, info = res["triton"]
    assert bool(info["window_ok"]), "the window missed: this case should not need the fallback"
    assert t == want                          # the window path is exact
    assert k <= tail_count(x, t) <= max(k, 1.01 * k)


@needs_triton
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
def test_magnitude_threshold_dtypes_and_ties(dtype):
    """bf16/fp16 data are full of ties; rounded fp32 too: the count is the count at the exact
    k-th largest, on both paths."""
    x = torch.randn(N_WINDOW, generator=gen(7))
    if dtype == "fp32":
        x = (x * 100).round() / 100
    x = x.to(GRAD_DTYPES[dtype]).to(DEV)
    k = 1000
    want = kth_largest(x, k)
    c_exact = tail_count(x, want)
    assert c_exact > k                                            # the data do tie at k
    res = threshold_both(x, k)
    for be in BACKENDS:
        assert res[be][0] == want, be
        assert tail_count(x, res[be][0]) == c_exact
    assert bool(res["triton"][1]["window_ok"])


@needs_triton
def test_magnitude_threshold_ignores_nan_inf_and_zeros():
    x = torch.randn(N_WINDOW, generator=gen(8))
    x[::3] = 0
    x[1::97] = float("nan")
    x[2::89] = float("inf")
    x[4::83] = -float("inf")
    x = x.to(DEV)
    for k in (500,):
        want = kth_largest(x, k)
        res = threshold_both(x, k)
        assert res["torch"][0] == want and res["triton"][0] == want, k
        assert tail_count(x, want) == k
        assert math.isfinite(want) and want > 0
    # fewer nonzero finite entries than k: 0 (select every nonzero)
    nz = int(finite_nonzero(x).sum())
    assert all(r[0] == 0.0 for r in threshold_both(x, nz + 1).values())
    assert all(r[0] == kth_largest(x, nz) for r in threshold_both(x, nz).values())


@needs_triton
@pytest.mark.parametrize("device_range", [False, True])
def test_magnitude_threshold_range(device_range):
    x = DATA["lognormal"](N_WINDOW + 20000, gen(10)).to(DEV)
    s, e, k = 12345, 12345 + N_WINDOW - 2, 600
    kw = dict(start=s, end=e)
    if device_range:
        kw = dict(start=torch.tensor(s, device=DEV), end=torch.tensor(e, device=DEV),
                  max_len=e - s + 7)
    want = kth_largest(x[s:e], k)
    assert want != kth_largest(x, k)
    res = threshold_both(x, k, **kw)
    assert res["torch"][0] == want and res["triton"][0] == want
    assert bool(res["triton"][1]["window_ok"])


@needs_triton
@pytest.mark.parametrize("which", ["k=1", "k=n", "all equal"])
def test_magnitude_threshold_extremes(which):
    n = N_WINDOW
    x = torch.randn(n, generator=gen(11)).to(DEV)
    if which == "k=1":
        k, want = 1, float(x.abs().max())
    elif which == "k=n":
        x[x == 0] = 1.0
        k, want = n, float(x.abs().min())
    else:
        x = torch.full((n,), -0.75, device=DEV)
        k, want = 1000, 0.75
    res = threshold_both(x, k)
    assert res["torch"][0] == want
    t, info = res["triton"]
    c = tail_count(x, t)
    if which == "all equal":
        # the sample window is empty ([v, v)), so the histogram fallback answers: <= v, all counted
        assert not bool(info["window_ok"])
        assert t <= want and c == n
    else:
        assert t == want and c == k


@needs_triton
def test_magnitude_threshold_fallback_when_the_window_misses(monkeypatch):
    """A degenerate sample (every sample position the same) leaves an empty window: the two-level
    histogram fallback answers, within its bin (relative width 2^-14): k <= count <= 1.01 k."""
    monkeypatch.setattr(T, "_jitter", lambda S, device: torch.zeros(S, dtype=torch.float64,
                                                                     device=device))
    x = DATA["student_t"](N_WINDOW, gen(12)).to(DEV)
    for k in (5000,):
        info = {}
        t = K.magnitude_threshold(x, k, backend="triton", info=info)
        assert not bool(info["window_ok"])
        assert float(t) == float(K.histogram_threshold(x, k, backend="torch"))
        assert k <= tail_count(x, t) <= 1.01 * k
        assert float(t) <= kth_largest(x, k)


@needs_triton
@pytest.mark.parametrize("n", [1, 7, 1000, 4099])
def test_magnitude_threshold_window_path_small_n(monkeypatch, n):
    """With the exact cut-off patched away the window path runs at n < block and odd n."""
    monkeypatch.setattr(T, "EXACT_BELOW", 0)
    x = torch.randn(n, generator=gen(n)).to(DEV)
    x[::5] = 0
    nz = int(finite_nonzero(x).sum())
    for k in sorted({1, max(1, n // 100), max(1, nz), nz + 1}):
        res = threshold_both(x, k)
        want = kth_largest(x, k)
        assert res["torch"][0] == want, k
        t = res["triton"][0]
        if bool(res["triton"][1]["window_ok"]):
            assert t == want, k
        c = tail_count(x, t)
        assert (c == nz and t == 0.0) if k > nz else (k <= c <= max(k, 1.01 * k)), (k, c)


def test_magnitude_threshold_arguments():
    x = torch.randn(10)
    assert float(K.magnitude_threshold(x[:0], 3, backend="torch")) == 0.0
    assert float(K.magnitude_threshold(x, 3, start=4, end=4, backend="torch")) == 0.0
    with pytest.raises(ValueError):
        K.magnitude_threshold(x, 0)
    with pytest.raises(TypeError):
        K.magnitude_threshold(x.to(torch.int32), 1)


# ----------------------------------------------------------------------------------------------
# window_pass
# ----------------------------------------------------------------------------------------------
def window_recount(x, lo, hi, s, e):
    """(#|x| >= hi, #nonzero finite, sorted bit patterns in [lo, hi)) over x[s:e]."""
    b = abs_bits(x.cpu()[s:e])
    valid = (b != 0) & (b < INF_BITS)
    inside = valid & (b >= lo) & (b < hi)
    return int((valid & (b >= hi)).sum()), int(valid.sum()), b[inside].sort().values


def written(cand, seg_count):
    """Per segment, the written prefix min(count, cap); all of them sorted."""
    cap = cand.shape[1]
    parts = [cand[i, :min(int(c), cap)].to(torch.int64) for i, c in enumerate(seg_count.tolist())]
    return parts, torch.cat(parts).sort().values


@needs_triton
@pytest.mark.parametrize("n", [1, 7, 1000, 20001])     # 20001: 5 blocks on 4 programs
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
@pytest.mark.parametrize("device_range", [False, True])
def test_window_pass_matches_recount(n, dtype, device_range):
    g = gen(n)
    x = (torch.randn(n, generator=g) * 3).to(GRAD_DTYPES[dtype])
    x[::7] = 0
    if n >= 100:
        x[5], x[50], x[60] = float("nan"), float("inf"), -float("inf")
    x = x.to(DEV)
    lo, hi = int(abs_bits(torch.tensor([0.5]))), int(abs_bits(torch.tensor([2.0])))
    bounds = torch.tensor([lo, hi], dtype=torch.int32, device=DEV)
    s, e = (n // 7, n - n // 5) if n > 1 else (0, 1)
    above, nonzero, inside = window_recount(x, lo, hi, s, e)
    for be in BACKENDS:
        cand = torch.full((4, n + 1), -1, dtype=torch.int32, device=DEV)
        seg_count = torch.zeros(4, dtype=torch.int64, device=DEV)
        stats = torch.tensor([10, 20], dtype=torch.int64, device=DEV)     # ADDED to
        kw = dict(start=s, end=e)
        if device_range:
            kw = dict(start=torch.tensor(s, device=DEV), end=torch.tensor(e, device=DEV),
                      max_len=e - s + 3)
        K.window_pass(x, bounds, cand, seg_count, stats, backend=be, **kw)
        assert stats.tolist() == [10 + above, 20 + nonzero], be
        assert int(seg_count.sum()) == inside.numel(), be
        parts, got = written(cand.cpu(), seg_count.cpu())
        assert torch.equal(got, inside), be
        # nothing written past a segment's count
        for i, c in enumerate(seg_count.tolist()):
            assert (cand[i, int(c):] == -1).all(), be


@needs_triton
def test_window_pass_segment_overflow():
    """A segment holding more than seg_cap candidates keeps its true count and writes only its
    first seg_cap slots, each a real candidate (the threshold then falls back)."""
    n = 20001
    x = torch.randn(n, generator=gen(13)).to(DEV)
    lo, hi = int(abs_bits(torch.tensor([0.1]))), int(abs_bits(torch.tensor([1.5])))
    bounds = torch.tensor([lo, hi], dtype=torch.int32, device=DEV)
    _, _, inside = window_recount(x, lo, hi, 0, n)
    for be in BACKENDS:
        cap = 50
        cand = torch.full((4, cap), -1, dtype=torch.int32, device=DEV)
        seg_count = torch.zeros(4, dtype=torch.int64, device=DEV)
        stats = torch.zeros(2, dtype=torch.int64, device=DEV)
        K.window_pass(x, bounds, cand, seg_count, stats, backend=be)
        assert int(seg_count.sum()) == inside.numel() > 4 * cap, be
        parts, got = written(cand.cpu(), seg_count.cpu())
        for i, part in enumerate(parts):
            assert part.numel() == min(int(seg_count[i]), cap)
            assert (part >= lo).all() and (part < hi).all()
        # a sub-multiset of the window population
        vals, cnt = torch.unique(got, return_counts=True)
        pvals, pcnt = torch.unique(inside, return_counts=True)
        pos = torch.searchsorted(pvals, vals)
        assert torch.equal(pvals[pos], vals) and (cnt <= pcnt[pos]).all()


def test_window_pass_empty():
    for be in BACKENDS:
        cand = torch.full((2, 4), -1, dtype=torch.int32)
        seg_count, stats = torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)
        bounds = torch.tensor([1, INF_BITS], dtype=torch.int32)
        K.window_pass(torch.zeros(0), bounds, cand, seg_count, stats, backend=be)
        K.window_pass(torch.ones(9), bounds, cand, seg_count, stats, start=3, end=3, backend=be)
        assert stats.tolist() == [0, 0] and seg_count.tolist() == [0, 0] and (cand == -1).all()


# ----------------------------------------------------------------------------------------------
# scatter_rows
# ----------------------------------------------------------------------------------------------
def scatter_expected(dense, indices, values, counts, row_base, add):
    """Plain Python: rows in order, valid slots i < min(count, cap) with index >= 0."""
    out = dense.clone().cpu()
    S, cap = indices.shape
    for s in range(S):
        for i in range(min(int(counts[s]), cap)):
            j = int(indices[s, i])
            if j < 0:
                continue
            p = int(row_base[s]) + j
            out[p] = (out[p] + values[s, i]) if add else values[s, i]
    return out


@needs_triton
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("S,cap", [(1, 1), (3, 7), (4, 1500)])
def test_scatter_rows_packed_rows(add, S, cap):
    """Rows as views of packed messages (row stride > cap, counts a strided column), -1 slots
    inside the valid prefix, counts past capacity, zero counts.  Without ``add`` rows are disjoint
    regions; with ``add`` they overlap and are summed in row order (bitwise)."""
    g = gen(S * cap)
    region = 2 * cap + 5
    n = S * region + 3
    row_base = torch.arange(S, dtype=torch.int64) * (region if not add else 1) + 1
    span = region if not add else n - S - 1
    idx_msg = torch.full((S, cap + 3), 99, dtype=torch.int32)        # [count, pad, idx..., pad]
    val_msg = torch.randn(S, cap + 2, generator=g)
    for s in range(S):
        idx_msg[s, 2:2 + cap] = torch.randperm(span, generator=g)[:cap].to(torch.int32)
    idx_msg[:, 2 + cap // 2] = -1                                      # an empty slot
    counts_full = torch.tensor([cap, cap + 9, 0, max(cap - 1, 0)], dtype=torch.int32)[:S]
    idx_msg[:, 0] = counts_full
    indices, values, counts = idx_msg[:, 2:2 + cap], val_msg[:, 1:1 + cap], idx_msg[:, 0]
    assert indices.stride(0) == cap + 3 and counts.stride(0) == cap + 3
    dense0 = torch.randn(n, generator=g)
    want = scatter_expected(dense0, indices, values, counts, row_base, add)
    assert not torch.equal(want, dense0) or S == 1 and cap == 1
    idx_msg, val_msg, rb = idx_msg.to(DEV), val_msg.to(DEV), row_base.to(DEV)
    for be in BACKENDS:
        dense = dense0.clone().to(DEV)
        K.scatter_rows(dense, idx_msg[:, 2:2 + cap], val_msg[:, 1:1 + cap], idx_msg[:, 0], rb,
                       add=add, backend=be)
        assert same_bits(dense, want), be


@needs_triton
def test_scatter_rows_empty():
    for be in BACKENDS:
        dense = torch.arange(10, dtype=torch.float32, device=DEV)
        for S, cap in ((0, 5), (3, 0)):
            K.scatter_rows(dense, torch.zeros(S, cap, dtype=torch.int32, device=DEV),
                           torch.ones(S, cap, device=DEV), torch.full((S,), 9, dtype=torch.int32,
                                                                      device=DEV),
                           torch.zeros(S, dtype=torch.int64, device=DEV), backend=be)
        K.scatter_rows(dense, torch.full((2, 4), -1, dtype=torch.int32, device=DEV),
                       torch.ones(2, 4, device=DEV), torch.full((2,), 4, dtype=torch.int32,
                                                                device=DEV),
                       torch.zeros(2, dtype=torch.int64, device=DEV), add=True, backend=be)
        assert dense.tolist() == list(range(10)), be
    with pytest.raises(TypeError):
        K.scatter_rows(torch.zeros(4), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2),
                       torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------
# the dense step kernels: nonfinite_flag, dense_zeros, fill_if
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
def test_nonfinite_flag(dtype):
    dt = GRAD_DTYPES[dtype]
    x = torch.randn(1001, generator=gen(1)).to(dt).to(DEV)
    f = K.nonfinite_flag(x)
    assert f.dtype == torch.int32 and f.shape == (1,) and f.device == x.device and int(f) == 0
    big = torch.tensor(torch.finfo(dt).max, dtype=dt)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for pos in (0, 500, 1000):
            y = x.clone()
            y[pos] = bad
            assert int(K.nonfinite_flag(y)) == 1, (bad, pos)
    y = x.clone()
    y[3] = big
    y[4] = -big
    assert int(K.nonfinite_flag(y)) == 0
    assert int(K.nonfinite_flag(x[:1])) == 0 and int(K.nonfinite_flag(x.view(7, 143))) == 0
    assert int(K.nonfinite_flag(x[:0])) == 0            # empty: holds no NaN/Inf


def test_dense_zeros_and_counters():
    for n in (0, 1, 4097):
        before = K.counters()
        z = K.dense_zeros(n, DEV)
        after = K.counters()
        assert z.shape == (n,) and z.dtype == torch.float32 and z.device.type == DEV.type
        assert (z == 0).all() and not torch.signbit(z).any()
        assert after["launches"] - before["launches"] == 1
        assert after["bytes"] - before["bytes"] == 4 * n


@needs_triton
@pytest.mark.parametrize("n", [0, 1, 7, 4096, 9001])
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
def test_fill_if(n, dtype):
    dt = GRAD_DTYPES[dtype]
    out0 = torch.randn(n, generator=gen(n)).to(dt)
    if n >= 4:   # special bit patterns must survive a flag of 0 unchanged
        out0[0], out0[1], out0[2], out0[3] = -0.0, float("nan"), float("inf"), -float("inf")
    out0 = out0.to(DEV)
    for be in BACKENDS:
        for flag in (torch.zeros((), dtype=torch.int32), torch.zeros(1, dtype=torch.int32)):
            out = out0.clone()
            K.fill_if(out, flag.to(DEV), float("nan"), backend=be)
            assert torch.equal(out.view(torch.int16 if dt != torch.float32 else torch.int32),
                               out0.view(torch.int16 if dt != torch.float32 else torch.int32)), be
        for flag, value in ((torch.ones((), dtype=torch.int32), float("nan")),
                            (torch.full((1,), 7, dtype=torch.int32), -2.5)):
            out = out0.clone()
            K.fill_if(out, flag.to(DEV), value, backend=be)
            want = torch.full((n,), value, dtype=dt)
            assert torch.equal(out.cpu().float().nan_to_num(1234.0),
                               want.float().nan_to_num(1234.0)), be
    before = K.counters()
    K.fill_if(out0.clone(), torch.zeros((), dtype=torch.int32, device=DEV), 0.0)
    assert K.counters()["launches"] - before["launches"] == 1
    assert K.counters()["bytes"] == before["bytes"]
    with pytest.raises(ValueError):
        K.fill_if(torch.zeros(4, 4).t(), torch.zeros((), dtype=torch.int32), 0.0)


# ----------------------------------------------------------------------------------------------
# histogram skip
# ----------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("device_range", [False, True])
def test_abs_histogram_skip(device_range):
    n = 9001
    x = (torch.randn(n, generator=gen(14)) * 5).to(DEV)
    kw = dict(start=100, end=n - 7)
    if device_range:
        kw = dict(start=torch.tensor(100, device=DEV), end=torch.tensor(n - 7, device=DEV))
    prefix = torch.tensor(int(abs_bits(torch.tensor([1.5]))) >> 20, device=DEV)
    for be in BACKENDS:
        for pre in (None, prefix):
            plain = K.abs_histogram(x, prefix=pre, backend=be, **kw)
            assert int(plain.sum()) > 0
            on = torch.zeros((), dtype=torch.int32, device=DEV)
            off = torch.ones((), dtype=torch.int32, device=DEV)
            assert torch.equal(K.abs_histogram(x, prefix=pre, skip=on, backend=be, **kw), plain)
            stale = torch.ones(K.HIST_BINS, dtype=torch.int64, device=DEV)
            skipped = K.abs_histogram(x, prefix=pre, skip=off, out=stale, backend=be, **kw)
            assert int(skipped.abs().sum()) == 0 and skipped.data_ptr() == stale.data_ptr(), be
        k = 500
        t_on = K.histogram_threshold(x, k, skip=torch.zeros((), dtype=torch.int32, device=DEV),
                                     backend=be)
        assert float(t_on) == float(K.histogram_threshold(x, k, backend=be))
        t_off = K.histogram_threshold(x, k, skip=torch.ones((), dtype=torch.int32, device=DEV),
                                      backend=be)
        assert float(t_off) == 0.0


# ----------------------------------------------------------------------------------------------
# clear_sent with a velocity
# ----------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("P", [1, 3, 5])
def test_clear_sent_with_velocity(P):
    """residual and velocity are zeroed at the same positions (sent ∩ the first global_counts of
    the global row); everything else is bitwise unchanged; without a velocity only the residual
    changes."""
    n = 3001
    g = gen(P)
    offsets = region_layout(n, P, seed=P).cpu()
    cap_s, cap_g = 40, 30
    sent = torch.zeros(P, cap_s, dtype=torch.int32)
    glob = torch.zeros(P, cap_g, dtype=torch.int32)
    sent_counts = torch.zeros(P, dtype=torch.int32)
    glob_counts = torch.zeros(P, dtype=torch.int32)
    want = torch.zeros(n, dtype=torch.bool)
    for j in range(P):
        a, b = int(offsets[j]), int(offsets[j + 1])
        L = b - a
        if L == 0:
            continue
        s_idx = torch.randperm(L, generator=g)[:cap_s]
        g_idx = torch.cat([s_idx[: len(s_idx) // 2], torch.randperm(L, generator=g)[:cap_g]])
        g_idx = g_idx.unique()[:cap_g].sort().values
        sent[j, :len(s_idx)] = s_idx.to(torch.int32)
        glob[j, :len(g_idx)] = g_idx.to(torch.int32)
        sent_counts[j] = min(len(s_idx), cap_s - 3)              # the last few sent are stale
        glob_counts[j] = len(g_idx) + (5 if j % 2 else 0)          # past capacity: clamped
        valid_g = set(g_idx.tolist()[:min(int(glob_counts[j]), cap_g)])
        for i in s_idx.tolist()[:int(sent_counts[j])]:
            if i in valid_g:
                want[a + i] = True
    assert want.any()
    r0 = torch.randn(n, generator=g) + 3.0          # nonzero everywhere
    u0 = torch.randn(n, generator=g) + 3.0
    args = [t.to(DEV) for t in (sent, sent_counts, offsets, glob, glob_counts)]
    for be in BACKENDS:
        r, u = r0.clone().to(DEV), u0.clone().to(DEV)
        K.clear_sent(r, *args, velocity=u, backend=be)
        r, u = r.cpu(), u.cpu()
        assert torch.equal(r == 0, want) and torch.equal(u == 0, want), be
        assert same_bits(r[~want], r0[~want]) and same_bits(u[~want], u0[~want]), be
        r = r0.clone().to(DEV)
        K.clear_sent(r, *args, backend=be)
        assert torch.equal(r.cpu() == 0, want), be
