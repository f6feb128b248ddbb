"""kernels/histogram.py: abs_histogram, kth_bin, bin_threshold, histogram_threshold and
exact_threshold against their references.

Histogram threshold tolerance (tested below): with >= k nonzero finite entries the count
``c = #{|x| >= t}`` satisfies ``k <= c`` always and ``c <= 1.01 k`` for k >= 1000 on normal,
student-t and lognormal data (measured at n = 2^22, k = 1000 ... 419430: c <= 1.001 k); with
ties ``c_exact <= c <= c_exact + 0.01 k`` where c_exact is the count at the exact k-th largest
value (measured: c == c_exact).  The threshold is the lower edge of a bin of relative width
2^-14, so c exceeds k by at most the population of that bin.
"""

import oktopk_triton.kernels as K
import pytest
import torch
from kernel_cases import BACKENDS, DEV, GRAD_DTYPES, abs_bits, gen, needs_triton, tail_count
from oktopk_triton.kernels import (
    HIST_BINS,
    abs_histogram,
    bin_threshold,
    exact_threshold,
    histogram_threshold,
    kth_bin,
)


# ----------------------------------------------------------------------------------------------
# histograms and thresholds
# ----------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("n", [1, 7, 1000, 65537])
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
def test_abs_histogram_matches_reference(n, dtype):
    x = (torch.randn(n, generator=gen(n)) * 3).to(GRAD_DTYPES[dtype])
    x[::5] = 0
    if n > 10:
        x[3], x[4], x[6] = float("nan"), float("inf"), -float("inf")
    x = x.to(DEV)
    ranges = [(None, None), (n // 3, n - n // 4),
              (torch.tensor(n // 5, device=DEV), torch.tensor(n, device=DEV)), (n // 2, n // 2)]
    for start, end in ranges:
        h0 = {be: abs_histogram(x, start=start, end=end, backend=be) for be in ("torch", "triton")}
        assert torch.equal(h0["torch"], h0["triton"])
        s = 0 if start is None else int(start)
        e = n if end is None else int(end)
        seg = x[s:e].float().cpu()
        assert int(h0["torch"].sum()) == int(((seg != 0) & seg.isfinite()).sum())
        b, _ = kth_bin(h0["torch"], 1)
        h1 = {be: abs_histogram(x, prefix=b, start=start, end=end, backend=be)
              for be in ("torch", "triton")}
        assert torch.equal(h1["torch"], h1["triton"])
        assert int(h1["torch"].sum()) == int(h0["torch"][b])


def test_kth_bin_edge_cases():
    h = torch.zeros(HIST_BINS, dtype=torch.int64)
    h[[3, 10, 100]] = torch.tensor([5, 2, 1])
    assert [int(v) for v in kth_bin(h, 1)] == [100, 0]
    assert [int(v) for v in kth_bin(h, 2)] == [10, 1]
    assert [int(v) for v in kth_bin(h, 3)] == [10, 1]
    assert [int(v) for v in kth_bin(h, 4)] == [3, 3]
    assert [int(v) for v in kth_bin(h, 8)] == [3, 3]
    assert [int(v) for v in kth_bin(h, 9)] == [0, 8]              # total below k: bin 0
    assert [int(v) for v in kth_bin(h, 0)] == [HIST_BINS - 1, 0]
    assert [int(v) for v in kth_bin(h, torch.tensor(2))] == [10, 1]  # k as a tensor
    z = torch.zeros(HIST_BINS, dtype=torch.int64)
    assert [int(v) for v in kth_bin(z, 1)] == [0, 0]
    b, above = kth_bin(h, 2)
    assert b.dtype == torch.int64 and b.dim() == 0 and above.dim() == 0


def test_bin_threshold_edges():
    x = torch.tensor([1.0, 2.0, 3.5, 1e-30, 3e38])
    for v in x:
        bits = int(v.view(torch.int32))
        b0 = torch.tensor(bits >> 20)
        b1 = torch.tensor((bits >> 9) & 2047)
        assert float(bin_threshold(b0)) <= float(v)
        t = float(bin_threshold(b0, b1))
        assert t <= float(v) and (float(v) - t) <= float(v) * 2 ** -14
    assert bin_threshold(torch.tensor(0)).dtype == torch.float32


DISTS = {
    "normal": lambda n, g: torch.randn(n, generator=g),
    "student_t2": lambda n, g: torch.distributions.StudentT(2.0).sample((n,)),
    "lognormal": lambda n, g: (torch.exp(2 * torch.randn(n, generator=g))
                               * torch.sign(torch.randn(n, generator=g))),
}


@needs_triton
@pytest.mark.parametrize("dist", list(DISTS))
@pytest.mark.parametrize("k", [1000, 5000])
def test_histogram_threshold_tolerance(dist, k):
    torch.manual_seed(k)
    n = 1 << 17
    x = DISTS[dist](n, gen(k)).to(DEV)
    for be in ("torch", "triton"):
        t = histogram_threshold(x, k, backend=be)
        c = tail_count(x, t)
        assert k <= c <= 1.01 * k, (be, c)
        assert float(t) <= float(exact_threshold(x, k))
    assert (float(histogram_threshold(x, k, backend="torch"))
            == float(histogram_threshold(x, k, backend="triton")))


@needs_triton
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_histogram_threshold_with_ties(dtype):
    n, k = 1 << 16, 1000
    x = (torch.randn(n, generator=gen(1)) * 100).round() / 100      # ~dozens of ties per value
    x = x.to(GRAD_DTYPES[dtype]).to(DEV)
    t_exact = exact_threshold(x, k)
    c_exact = tail_count(x, t_exact)
    assert c_exact > k                                              # the data do tie at k
    for be in ("torch", "triton"):
        t = histogram_threshold(x, k, backend=be)
        c = tail_count(x, t)
        assert c_exact <= c <= c_exact + 0.01 * k, (be, c, c_exact)


@needs_triton
def test_histogram_threshold_small_cases():
    x = torch.tensor([0.0, -3.0, 0.0, 2.0, float("nan"), 1.0], device=DEV)
    for be in ("torch", "triton"):
        assert float(histogram_threshold(x, 1, backend=be)) <= 3.0
        assert tail_count(x, histogram_threshold(x, 1, backend=be)) == 1
        assert tail_count(x, histogram_threshold(x, 3, backend=be)) == 3
        assert float(histogram_threshold(x, 10, backend=be)) == 0.0   # fewer than k: all nonzero
        # start/end as device tensors
        t = histogram_threshold(x, 1, start=torch.tensor(2, device=DEV),
                                end=torch.tensor(6, device=DEV), backend=be)
        assert tail_count(x[2:6], t) == 1 and float(t) <= 2.0
    one = torch.tensor([-0.25], device=DEV)
    assert float(histogram_threshold(one, 1, backend="triton")) == 0.25
    assert float(exact_threshold(one, 1)) == 0.25
    assert float(exact_threshold(x[:1], 0)) == 0.0


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
