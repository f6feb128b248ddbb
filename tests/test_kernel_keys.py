"""kernels/keys.py: the int64 keys of the deterministic top-k. The Triton path (the interpreter
on CPU) writes the torch reference's keys bit for bit (signed zeros, NaN, infinities, ties,
partial blocks), so TopkA's and gTop-k's local top-k is the same on both paths; bad input is
named."""
import pytest
import torch
from kernel_cases import DEV, gen, needs_triton
from oktopk_triton import kernels as K
from oktopk_triton.algorithms._sparse import topk_entries
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.kernels import keys as KK


def _values(n, seed=0):
    x = torch.randn(n, generator=gen(seed))
    x[: min(n, 6)] = torch.tensor([0.0, -0.0, float("nan"), float("inf"), -float("inf"),
                                   -1.5])[: min(n, 6)]
    if n > 20:
        x[10:20] = 0.25 * torch.sign(x[10:20])       # ties: the lower index first
    return x.to(DEV)


@needs_triton
@pytest.mark.parametrize("n", [1, 7, 2048, 2049, 10001])
def test_triton_keys_are_the_reference(n):
    x = _values(n, seed=n)
    ref = KK.magnitude_keys(x, backend="torch")
    tri = KK.magnitude_keys(x, backend="triton")
    assert ref.dtype == torch.int64 and torch.equal(ref, tri)
    ar = torch.arange(n, device=DEV)
    assert torch.equal(ref, KK.magnitude_key(x, ar))
    # the order the keys encode: |x| descending, then the index ascending
    order = torch.argsort(ref, descending=True)
    mags = x.abs().nan_to_num(nan=float("inf"))[order]
    assert bool((mags[:-1] >= mags[1:]).all())


@needs_triton
def test_topk_entries_same_on_both_paths():
    x = _values(5000, seed=3)
    x[2] = 0.0                                       # no NaN in a gradient the top-k sees
    a = topk_entries(x, 50, backend="torch")
    b = topk_entries(x, 50, backend="triton")
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert bool((a[0][1:] > a[0][:-1]).all())        # ascending indices


@needs_triton
@pytest.mark.parametrize("name", ["topka", "gtopk"])
def test_algorithm_steps_same_on_both_paths(name):
    from oktopk_triton.algorithms import get_algorithm

    def body(comm, backend):
        a = get_algorithm(name)(3000, comm, 0.02, backend=backend)
        outs = [a(torch.randn(3000, generator=gen(10 * t + comm.rank))).clone()
                for t in range(3)]
        return outs, a.residual.clone()
    for (o1, r1), (o2, r2) in zip(LocalCluster(3).run(body, "torch"),
                                  LocalCluster(3).run(body, "triton")):
        assert all(torch.equal(x, y) for x, y in zip(o1, o2)) and torch.equal(r1, r2)


def test_launch_recorded_and_bad_input_named():
    x = torch.randn(100)
    before = K.counters()
    KK.magnitude_keys(x, backend="torch")
    after = K.counters()
    assert after["launches"] - before["launches"] == 1
    assert after["bytes"] - before["bytes"] == 12 * 100
    with pytest.raises(ValueError, match="x must be a contiguous 1-dim float32 tensor"):
        KK.magnitude_keys(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be"):
        KK.magnitude_keys(torch.zeros(8)[::2])
    comm = LocalCluster(1).communicator(0)
    from oktopk_triton.algorithms.topka import TopkA
    with pytest.raises(ValueError, match="topka: backend must be one of"):
        TopkA(100, comm, 0.1, backend="gpu")
    from oktopk_triton.algorithms.oktopk import OkTopk
    with pytest.raises(ValueError, match="oktopk: backend must be one of"):
        OkTopk(100, comm, 0.1, backend="gpu")          # at construction, not at the first step
