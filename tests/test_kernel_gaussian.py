"""oktopk_triton/kernels/gaussian.py: Gaussiank's fitted and corrected threshold. The Triton path
(the interpreter on CPU) gives the torch reference's threshold bit for bit on normal, heavy-
tailed, tied, sparse, all-zero and non-finite inputs and every number of steps; a Gaussiank
step is the same on both paths; it launches ``1 + 2·iters`` times."""
import pytest
import torch
from kernel_cases import DEV, gen, needs_triton, same_bits
from oktopk_triton import kernels as K
from oktopk_triton.algorithms.gaussiank import Gaussiank
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.kernels import _dispatch
from oktopk_triton.kernels import gaussian as G


def _acc(kind, n, seed=0):
    g = gen(seed)
    x = torch.randn(n, generator=g)
    if kind == "heavy":          # 0.1% of the entries x1000: the fit's sigma far too high
        x[torch.randperm(n, generator=g)[: max(1, n // 1000)]] *= 1000
    elif kind == "ties":         # few distinct magnitudes: counts jump past the band
        x = (x * 4).round() / 4
    elif kind == "sparse":       # 90% exact zeros (never counted)
        x[torch.rand(n, generator=g) < 0.9] = 0.0
    elif kind == "zeros":
        x = torch.zeros(n)
    elif kind == "nan":
        x[n // 3] = float("nan")
    elif kind == "huge":         # near fp32's top: 4·thr and lo·hi overflow to inf
        x = x * 1e37
    return x.to(DEV)


def _same(a, b):
    """The same bits, or both NaN (a NaN threshold selects nothing; its payload is the
    platform's)."""
    a, b = a.reshape(1), b.reshape(1)
    return same_bits(a, b) or bool(torch.isnan(a) & torch.isnan(b))


def _both(acc, k, iters, lo=0.75, hi=1.25):
    z = 2.5758293035489004       # the two-sided quantile of density 1%
    args = (acc, z, lo * k, hi * k, iters)
    return (G.gaussian_threshold(*args, backend="torch"),
            G.gaussian_threshold(*args, backend="triton"))


@needs_triton
@pytest.mark.parametrize("kind", ["normal", "heavy", "ties", "sparse", "zeros", "nan", "huge"])
@pytest.mark.parametrize("iters", [0, 1, 8])
def test_triton_threshold_is_the_reference_bit_for_bit(kind, iters):
    n = 10001                    # not a multiple of the block: the last program is partial
    acc = _acc(kind, n, seed=iters)
    ref, tri = _both(acc, 5 if kind == "huge" else 100, iters)   # huge: gallop up to inf
    assert ref.shape == () and ref.dtype == torch.float32
    assert _same(ref, tri), (float(ref), float(tri))
    if kind not in ("nan", "zeros"):
        assert torch.isfinite(ref) or (kind == "huge" and iters == 8)


@needs_triton
@pytest.mark.parametrize("n,k", [(1, 1), (7, 2), (4096, 40), (4097, 400)])
def test_small_and_block_edge_sizes(n, k):
    ref, tri = _both(_acc("normal", n, seed=n), k, 8)
    assert _same(ref, tri)


def test_the_correction_moves_the_count_into_the_band():
    """What the steps are for: on heavy tails the fit alone selects far fewer than k, eight
    steps bring the count into the band (the reference, on CPU)."""
    acc, k = _acc("heavy", 20000, seed=3), 200

    def count(t):
        return int(((acc.abs() >= t) & (acc != 0)).sum())
    fit, fixed = (G.gaussian_threshold(acc, 2.5758293035489004, 0.75 * k, 1.25 * k, it,
                                       backend="torch") for it in (0, 8))
    assert count(fit) < 0.2 * k
    assert 0.75 * k <= count(fixed) <= 1.25 * k


@needs_triton
def test_launches_recorded_and_made():
    """The recorded launches are the Triton launchers' calls (a steady Gaussiank step's host
    reads are counted by the launch budget, tests/test_launch_budget.py)."""
    acc = _acc("normal", 5000)
    before, calls = K.counters()["launches"], _dispatch.launcher_calls()
    G.gaussian_threshold(acc, 2.0, 30.0, 60.0, 5, backend="triton")
    assert K.counters()["launches"] - before == 1 + 2 * 5
    assert _dispatch.launcher_calls() - calls == 1 + 2 * 5


@needs_triton
@pytest.mark.parametrize("P", [1, 3])
def test_gaussiank_step_same_on_both_paths(P):
    def body(comm, backend):
        a = Gaussiank(3000, comm, 0.02, backend=backend)
        outs = []
        for t in range(3):
            g = torch.randn(3000, generator=gen(10 * t + comm.rank))
            g[comm.rank * 7] = 50.0 * (t + 1)          # a heavy coordinate
            outs.append(a(g).clone())
        return outs, a.residual.clone(), float(a.stats["threshold"])
    ref = LocalCluster(P).run(body, "torch")
    tri = LocalCluster(P).run(body, "triton")
    for (o1, r1, t1), (o2, r2, t2) in zip(ref, tri):
        assert all(same_bits(x, y) for x, y in zip(o1, o2)) and same_bits(r1, r2)
        assert t1 == t2


def test_bad_input_is_named():
    with pytest.raises(ValueError, match="acc must be a contiguous non-empty 1-dim float32"):
        G.gaussian_threshold(torch.zeros(4, dtype=torch.float64), 2.0, 1.0, 2.0, 1)
    with pytest.raises(ValueError, match="acc must be"):
        G.gaussian_threshold(torch.zeros(0), 2.0, 1.0, 2.0, 1)
    with pytest.raises(ValueError, match="iters must be an int >= 0"):
        G.gaussian_threshold(torch.zeros(4), 2.0, 1.0, 2.0, -1)
    comm = LocalCluster(1).communicator(0)
    with pytest.raises(ValueError, match="gaussiank: backend must be one of"):
        Gaussiank(100, comm, 0.1, backend="cuda")


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=needs_triton)])
def test_select_above_small_cases(backend):
    """Ascending order, the capacity cut (the true count kept), -1 / 0 padding, zeros never
    selected."""
    x = torch.tensor([0., 3., 0., -1., 4., 5.], device=DEV)
    thr = torch.zeros((), device=DEV)
    idx, val, count, kept = G.select_above(x, thr, 3, backend=backend)
    assert idx.tolist() == [1, 3, 4] and val.tolist() == [3., -1., 4.] and int(count) == 4
    assert kept.tolist() == [False, True, False, True, True, False]
    idx, val, count, kept = G.select_above(x, thr + 3.5, 3, backend=backend)
    assert idx.tolist() == [4, 5, -1] and val.tolist() == [4., 5., 0.] and int(count) == 2
    assert kept.tolist() == [False] * 4 + [True, True]


@needs_triton
@pytest.mark.parametrize("n,cap,kind", [(10001, 150, "normal"), (10001, 40, "ties"),
                                        (4096, 5000, "sparse"), (3, 8, "zeros"),
                                        (9000, 100, "nan")])
def test_select_above_is_the_reference(n, cap, kind):
    """Several blocks, a capacity cut inside a block, a capacity above n (padding past every
    block), nothing selected, a NaN (never at or above a threshold)."""
    acc = _acc(kind, n, seed=cap)
    thr = acc.abs().nan_to_num(0.0).kthvalue(max(1, n - 120)).values.clamp(min=0.0)
    ref = G.select_above(acc, thr, cap, backend="torch")
    tri = G.select_above(acc, thr, cap, backend="triton")
    for a, b in zip(ref, tri):
        assert a.dtype == b.dtype and torch.equal(a, b)


def test_select_above_bad_input():
    with pytest.raises(ValueError, match="cap must be an int >= 1"):
        G.select_above(torch.ones(4), torch.zeros(()), 0)
    with pytest.raises(ValueError, match="thr must be a one-element float32 tensor"):
        G.select_above(torch.ones(4), torch.zeros(2), 2)
