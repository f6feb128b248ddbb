"""TopkDSA specifics (the cross-algorithm suite in test_algorithms.py covers the rest): the
switch to a dense reduction when the sum fills and back, bytes within the formula, overflow kept
in the residual, non-finite steps and the state dict.

All on ``LocalCluster`` (threads), n ~ 1e3..4e3, a few dozen steps.
"""
from __future__ import annotations

import pytest
import torch

from conservation import (PS, assert_bitwise_agreement, assert_conservation,
                          flag_bytes, mixed, run_steps)
from oktopk_triton.algorithms import get_algorithm
from oktopk_triton.algorithms.topkdsa import TopkDSA
from oktopk_triton.comm.local import SingleCommunicator


@pytest.mark.parametrize("P", PS)
def test_topkdsa_conservation_and_agreement(P):
    n = 2003 if P in (3, 5) else 2400
    res = run_steps("topkdsa", P=P, n=n, steps=30, density=0.02, grad_fn=mixed(seed=P), tau=8)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    assert all(m == "sparse" for row in res.stat("mode") for m in row)


def _fills_later(rank, step, n):
    """Steps < 8: every rank's large entries share one support (the sum stays sparse);
    afterwards independent dense noise (the sum fills in)."""
    g = torch.Generator().manual_seed(rank * 1000 + step)
    if step < 8:
        x = torch.zeros(n)
        m = x[::5].numel()  # spread over every region
        x[::5] = torch.randn(m, generator=g) + 5.0
        return x + 1e-3 * torch.randn(n, generator=g)
    return torch.randn(n, generator=g)


@pytest.mark.parametrize("P", [3, 6])
def test_topkdsa_switches_to_dense_when_sum_fills(P):
    n, tau = 3000, 4
    res = run_steps("topkdsa", P=P, n=n, steps=20, density=0.2, grad_fn=_fills_later, tau=tau)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    modes = [row[0] for row in res.stat("mode")]
    for row in res.stat("mode"):
        assert len(set(row)) == 1  # every rank agrees
    # decisions after steps 0, 4, 8, ...: sparse while the sum is sparse, dense from step 9
    assert all(m == "sparse" for m in modes[1:9]), modes
    assert all(m == "dense" for m in modes[9:]), modes
    fills = [row[0] for row in res.stat("fill")]
    assert fills[8] > n / 3 and all(f <= n / 3 for f in fills[1:8])
    # sizes static between decisions: bytes change only right after a decision step
    by = [row[0] for row in res.stat("bytes_sent")]
    for t in range(1, len(by)):
        if (t - 1) % tau != 0:
            assert by[t] == by[t - 1], (t, by)
    # dense mode volume: (1 + 2 cap)(P-1) words of reduce + L(P-1) words of gather
    alg = res.algs[0]
    want = (P - 1) * (1 + 2 * alg.cap) * 4 + (P - 1) * alg.L * 4 + flag_bytes(P)
    assert by[-1] == want
    assert by[-1] <= (2 * 1.25 * res.k + n) * (P - 1) / P * 4 + (P - 1) * 16 + 8


def test_topkdsa_switches_back_to_sparse():
    def fn(rank, step, n):
        # dense noise first (fills the sum), then one shared support (sparse sum)
        return _fills_later(rank, 100 + step if step < 12 else step % 8, n)
    res = run_steps("topkdsa", P=4, n=2000, steps=24, density=0.2, grad_fn=fn, tau=4)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    modes = [row[0] for row in res.stat("mode")]
    assert "dense" in modes[:12] and modes[-1] == "sparse", modes


@pytest.mark.parametrize("P", [2, 4, 5])
def test_topkdsa_bytes_within_formula(P):
    n = 4000
    res = run_steps("topkdsa", P=P, n=n, steps=10, density=0.01, grad_fn=mixed(seed=2), tau=4)
    k, alg = res.k, res.algs[0]
    lo = 4 * k * (P - 1) / P * 4
    hi = (2 * k + n) * (P - 1) / P * 4
    for t, row in enumerate(res.stat("bytes_sent")):
        if t == 0:
            continue  # calibration step: lossless capacity
        for b in row:
            # slack 1.25 on the reduce, gather_slack 1.25 on the gather, one header word/msg
            assert lo * 0.5 <= b <= max(hi, 1.25 * 1.25 * P * lo) + 4 * (P - 1) * 4 + 8
    # the sparse message sizes are exactly what the capacities say
    b = res.stat("bytes_sent")[-1][0]
    cap2 = res.stat("cap2")[-1][0]
    assert b == (P - 1) * (1 + 2 * alg.cap) * 4 + (P - 1) * (1 + 2 * cap2) * 4 + flag_bytes(P)


def test_topkdsa_overflow_stays_in_residual():
    """All of one rank's top-k in one region: the capacity overflows, the rest stays."""
    def fn(rank, step, n):
        x = 1e-3 * torch.randn(n, generator=torch.Generator().manual_seed(rank + 10 * step))
        x[: n // 8] += 10.0
        return x
    res = run_steps("topkdsa", P=4, n=1600, steps=8, density=0.05, grad_fn=fn, tau=4)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    assert all(o > 0 for o in res.stat("overflow")[0])


def test_topkdsa_nonfinite_and_state_dict():
    res = run_steps("topkdsa", P=3, n=900, steps=6, density=0.05, grad_fn=mixed(seed=3),
                    nonfinite={0: 2, 3: 0}, tau=2)
    assert_conservation(res)
    assert res.unchanged[0] and res.unchanged[3]
    sd = res.algs[0].state_dict()
    for key in ("mode", "cap2", "decisions"):
        assert key in sd
    comm = SingleCommunicator()
    with pytest.raises(TypeError, match="unknown option"):
        TopkDSA(100, comm, 0.1, bogus=1)
    with pytest.raises(ValueError, match="tau"):
        get_algorithm("topkdsa")(100, comm, 0.1, tau=0)
