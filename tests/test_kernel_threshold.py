"""kernels/threshold.py: magnitude_threshold (the k-th largest |x|: window pass + candidate
sort, histogram fallback) and window_pass against their references.

On CPU the Triton kernels run in the interpreter, so sizes stay small: the window path of
magnitude_threshold is reached either above its exact cut-off (``EXACT_BELOW`` = 2^16, with
n = 70001) or with the cut-off patched to 0 for tiny n.  Offsets past 2^31 are covered only by
the sm_90 compile check (tests/test_kernel_dispatch.py).
"""
import math

import oktopk_triton.kernels as K
import pytest
import torch
from kernel_cases import (
    BACKENDS,
    DEV,
    GRAD_DTYPES,
    INF_BITS,
    abs_bits,
    finite_nonzero,
    gen,
    needs_triton,
    range_kwargs,
    tail_count,
)
from oktopk_triton.kernels import threshold as T

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
    kw = range_kwargs(s, e, device_range)
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
    assert bool(info["window_ok"]) and t == want
    # all equal: the sample ties at both ranks, the window is the one value [v, v + 1), far more
    # populated than the candidate buffer (n > cap: the spill overflows) and still exact
    assert c == (n if which == "all equal" else k)
    if which == "all equal":
        assert int(info["stats"][1]) == n > int(info["spilled"]) > info["cap"]


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
