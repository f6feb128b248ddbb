"""kernels/consistency.py (the sign EMA) and the ``weight`` of the kernels that rank Ok-Topk's
own entries (fused_select, staged_magnitudes, sample_magnitudes): the score ``|acc|·|w|``
against a plain recount, the EMA fused into the select pass (``weight_rate``) and previewed by
the sample against ``sign_ema``, the CPU fast path against the reference, and the Triton path
(interpreter on CPU) against the torch reference, bit for bit."""

import pytest
import torch
from kernel_cases import DEV, gen, needs_triton, region_layout
from oktopk_triton import kernels as K
from oktopk_triton.kernels import selection as SEL

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


def _grad(n, seed, dtype=torch.float32):
    g = torch.randn(n, generator=gen(seed))
    g[::7] = 0.0                                     # sign 0 too
    return g.to(dtype).to(DEV)


# -- sign_ema -----------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sign_ema_is_the_formula(backend, dtype):
    n = 5000
    ema = torch.zeros(n, device=DEV)
    g0, g1 = _grad(n, 0, dtype), _grad(n, 1, dtype)
    K.sign_ema(g0, ema, 0.0, backend=backend)          # the first step: the signs themselves
    assert torch.equal(ema, torch.sign(g0.float()))
    want = ema * 0.9 + torch.sign(g1.float()) * float(1.0 - 0.9)
    K.sign_ema(g1, ema, 0.9, backend=backend)
    assert torch.equal(ema, want)
    assert float(ema.abs().max()) <= 1.0


@pytest.mark.parametrize("backend", BACKENDS)
def test_sign_ema_skip_leaves_it(backend):
    n = 3000
    ema = torch.rand(n, generator=gen(2)).to(DEV)
    before = ema.clone()
    bad = _grad(n, 3)
    bad[5] = float("nan")
    K.sign_ema(bad, ema, 0.8, skip=torch.ones(1, dtype=torch.int32, device=DEV), backend=backend)
    assert torch.equal(ema, before)
    K.sign_ema(bad, ema, 0.8, skip=torch.zeros(1, dtype=torch.int32, device=DEV), backend=backend)
    assert torch.equal(ema, before * 0.8 + torch.sign(bad) * float(1.0 - 0.8))
    assert float(ema[5]) == float(before[5] * 0.8)         # a NaN counts as sign 0


@needs_triton
def test_sign_ema_triton_matches_torch():
    n = 9000                                           # more than one program
    a = torch.rand(n, generator=gen(4)).to(DEV) * 2 - 1
    b = a.clone()
    for t, rate in enumerate((0.0, 0.9, 0.5, 0.97)):
        g = _grad(n, 10 + t, torch.float16)
        K.sign_ema(g, a, rate, backend="torch")
        K.sign_ema(g, b, rate, backend="triton")
        assert torch.equal(a, b)


def test_sign_ema_refuses_bad_input():
    ema = torch.zeros(10, device=DEV)
    for rate in (1.0, -0.1, True, "0.9"):
        with pytest.raises(ValueError, match="rate must be a number in \\[0, 1\\)"):
            K.sign_ema(torch.ones(10, device=DEV), ema, rate)
    with pytest.raises(ValueError, match="grad has 9 elements, ema 10"):
        K.sign_ema(torch.ones(9, device=DEV), ema, 0.5)
    with pytest.raises(ValueError, match="ema must be a contiguous float32"):
        K.sign_ema(torch.ones(10, device=DEV), ema.double(), 0.5)
    with pytest.raises(ValueError, match="skip must be a one-element int32"):
        K.sign_ema(torch.ones(10, device=DEV), ema, 0.5, skip=torch.zeros(1, device=DEV))


# -- fused_select with a weight ----------------------------------------------------------------
def _select(backend, n, P, weight, hist=True, reference=False, monkeypatch=None, rate=None,
            skip=None):
    grad = _grad(n, 20)
    res = (torch.randn(n, generator=gen(21)) * 0.5).to(DEV)
    offs = region_layout(n, P, seed=3)
    th = torch.full((P,), 0.6, device=DEV) if P > 1 else torch.tensor(0.6, device=DEV)
    h = torch.zeros(P, K.SELECT_HIST_BINS, dtype=torch.int32, device=DEV) if hist else None
    if monkeypatch is not None:
        monkeypatch.setattr(SEL, "REFERENCE", reference)
    out = K.fused_select(grad, res, th, offs, n, hist=h, weight=weight, weight_rate=rate,
                         skip=skip, backend=backend)
    return out, res, h, offs, th


@pytest.mark.parametrize("P", [1, 3, 4])
def test_fused_select_weight_selects_on_the_score(P, monkeypatch):
    """The staged entries are exactly those with |acc|·|w| >= th (and nonzero), their values
    acc; the histogram counts the score; the CPU fast path and the reference agree."""
    n = 4000
    w = (torch.rand(n, generator=gen(5)) * 2 - 1).to(DEV)
    w[::11] = 0.0
    fast = _select("torch", n, P, w, reference=False, monkeypatch=monkeypatch)
    ref = _select("torch", n, P, w, reference=True, monkeypatch=monkeypatch)
    acc, offs = fast[1], fast[3].tolist()
    score = acc.abs() * w.abs()
    for j in range(P):
        lo, hi = offs[j], offs[j + 1]
        want = ((score[lo:hi] >= 0.6) & (score[lo:hi] != 0)).nonzero().reshape(-1)
        for out in (fast[0], ref[0]):
            c = int(out.counts[j])
            assert c == want.numel()
            assert torch.equal(out.indices[j, :c].long(), want)
            assert torch.equal(out.values[j, :c], acc[lo:hi][want])
    assert torch.equal(fast[2], ref[2])
    # the histogram is the score's: bins over the score's bits, relative to the threshold
    th_bits = torch.tensor(0.6).view(torch.int32) & 0x7FFFFFFF
    bins = SEL.select_hist_bins(score, th_bits)
    for j in range(P):
        lo, hi = offs[j], offs[j + 1]
        live = score[lo:hi] != 0
        want = torch.bincount(bins[lo:hi][live], minlength=K.SELECT_HIST_BINS)
        assert torch.equal(fast[2][j].long(), want)
    unweighted = _select("torch", n, P, None, monkeypatch=monkeypatch)
    assert not torch.equal(unweighted[0].counts, fast[0].counts)


@needs_triton
@pytest.mark.parametrize("P", [1, 4])
def test_fused_select_weight_triton_matches_torch(P, monkeypatch):
    n = 6000
    w = (torch.rand(n, generator=gen(6)) * 2 - 1).to(DEV)
    tri = _select("triton", n, P, w)
    ref = _select("torch", n, P, w, reference=True, monkeypatch=monkeypatch)
    for j in range(P):                                 # the interpreter fills in ascending order
        c = int(ref[0].counts[j])
        assert int(tri[0].counts[j]) == c
        assert torch.equal(tri[0].indices[j, :c], ref[0].indices[j, :c])
        assert torch.equal(tri[0].values[j, :c], ref[0].values[j, :c])
    assert torch.equal(tri[1], ref[1]) and torch.equal(tri[2], ref[2])


def test_fused_select_refuses_a_bad_weight():
    n = 100
    with pytest.raises(ValueError, match="weight must be a contiguous fp32 tensor of 100"):
        _select("torch", n, 2, torch.ones(99, device=DEV))
    with pytest.raises(ValueError, match="weight must be a contiguous fp32 tensor of 100"):
        _select("torch", n, 2, torch.ones(n, dtype=torch.float64, device=DEV))


# -- staged and sampled magnitudes with a weight ----------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
def test_staged_magnitudes_weight(backend):
    n, P = 3000, 3
    w = (torch.rand(n, generator=gen(7)) * 2 - 1).to(DEV)
    out, acc, _, offs, _ = _select("torch", n, P, w, hist=False)
    mag = K.staged_magnitudes(out, weight=w, offsets=offs, backend=backend)
    plain = K.staged_magnitudes(out, backend=backend)
    o = offs.tolist()
    for j in range(P):
        c = min(int(out.counts[j]), out.values.shape[1])
        pos = out.indices[j, :c].long() + o[j]
        assert torch.equal(mag[j, :c], out.values[j, :c].abs() * w[pos].abs())
        assert torch.equal(plain[j, :c], out.values[j, :c].abs())
        assert bool((mag[j, c:] == -1).all())
    with pytest.raises(ValueError, match="weight and offsets go together"):
        K.staged_magnitudes(out, weight=w, backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_magnitudes_weight(backend):
    n = 5000
    grad, res = _grad(n, 30), torch.randn(n, generator=gen(31)).to(DEV)
    w = (torch.rand(n, generator=gen(32)) * 2 - 1).to(DEV)
    idx = torch.randperm(n, generator=gen(33))[:700].sort().values.to(torch.int32).to(DEV)
    got = K.sample_magnitudes(grad, res, idx, weight=w, backend=backend)
    plain = K.sample_magnitudes(grad, res, idx, backend=backend)
    assert torch.equal(got, plain * w[idx.long()].abs())
    with pytest.raises(ValueError, match="weight must be a contiguous 1-dim float32 tensor of"):
        K.sample_magnitudes(grad, res, idx, weight=w[:10], backend=backend)


# -- the EMA fused into the select pass, and previewed by the sample ----------------------------
@pytest.mark.parametrize("reference", [False, True])
@pytest.mark.parametrize("rate", [0.0, 0.9])
def test_fused_select_updates_the_weight_as_sign_ema(reference, rate, monkeypatch):
    """With ``weight_rate`` the select pass leaves the weight as :func:`sign_ema` would and
    selects on the new one; a skipped step leaves it."""
    n, P = 4000, 3
    w0 = (torch.rand(n, generator=gen(8)) * 2 - 1).to(DEV)
    want = K.sign_ema(_grad(n, 20), w0.clone(), rate, backend="torch")
    w = w0.clone()
    fused = _select("torch", n, P, w, reference=reference, monkeypatch=monkeypatch, rate=rate)
    assert torch.equal(w, want)
    split = _select("torch", n, P, want.clone(), reference=reference, monkeypatch=monkeypatch)
    assert torch.equal(fused[0].counts, split[0].counts)
    assert torch.equal(fused[0].indices, split[0].indices) and torch.equal(fused[2], split[2])
    w = w0.clone()
    _select("torch", n, P, w, reference=reference, monkeypatch=monkeypatch, rate=rate,
            skip=torch.ones((), dtype=torch.int32, device=DEV))
    assert torch.equal(w, w0)


@needs_triton
@pytest.mark.parametrize("P", [1, 4])
def test_fused_select_weight_update_triton_matches_torch(P, monkeypatch):
    n = 6000
    w0 = (torch.rand(n, generator=gen(9)) * 2 - 1).to(DEV)
    wt, wr = w0.clone(), w0.clone()
    tri = _select("triton", n, P, wt, rate=0.9)
    ref = _select("torch", n, P, wr, reference=True, monkeypatch=monkeypatch, rate=0.9)
    assert torch.equal(wt, wr)
    for j in range(P):
        c = int(ref[0].counts[j])
        assert int(tri[0].counts[j]) == c
        assert torch.equal(tri[0].indices[j, :c], ref[0].indices[j, :c])
    assert torch.equal(tri[2], ref[2])


@pytest.mark.parametrize("backend", BACKENDS)
def test_sample_magnitudes_preview_the_update(backend):
    n = 5000
    grad, res = _grad(n, 40, torch.bfloat16), torch.randn(n, generator=gen(41)).to(DEV)
    w = (torch.rand(n, generator=gen(42)) * 2 - 1).to(DEV)
    idx = torch.randperm(n, generator=gen(43))[:900].sort().values.to(torch.int32).to(DEV)
    got = K.sample_magnitudes(grad, res, idx, weight=w, weight_rate=0.9, backend=backend)
    updated = K.sign_ema(grad, w.clone(), 0.9, backend="torch")
    assert torch.equal(got, K.sample_magnitudes(grad, res, idx, weight=updated, backend=backend))
    with pytest.raises(ValueError, match="weight_rate must be a number in \\[0, 1\\) with a"):
        K.sample_magnitudes(grad, res, idx, weight_rate=0.9, backend=backend)
    with pytest.raises(ValueError, match="weight_rate must be a number in \\[0, 1\\) with a"):
        _select(backend, 100, 2, torch.ones(100, device=DEV), rate=1.0)
