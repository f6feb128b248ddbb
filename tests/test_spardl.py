"""SparDL specifics (the cross-algorithm suite in test_algorithms.py covers the rest): teams,
the block budget at any P, bytes against the formula, non-finite steps, and one rank being plain
top-k (SparDL and TopkDSA).

All on ``LocalCluster`` (threads), n ~ 1e3..4e3, a few dozen steps.
"""
from __future__ import annotations

import math

import pytest
import torch

from conservation import (PS, assert_bitwise_agreement, assert_conservation,
                          flag_bytes, mixed, run_steps, student_t)
from oktopk_triton.algorithms.spardl import SparDL, _rounds_rs
from oktopk_triton.algorithms.topkdsa import TopkDSA
from oktopk_triton.comm.local import LocalCluster, SingleCommunicator


@pytest.mark.parametrize("P", PS)
def test_spardl_conservation_and_agreement(P):
    n = 2003 if P in (3, 5) else 2400  # odd n: unequal blocks, padded layout
    res = run_steps("spardl", P=P, n=n, steps=30, density=0.02, grad_fn=mixed(seed=P))
    assert_conservation(res)
    assert_bitwise_agreement(res)


@pytest.mark.parametrize("P,teams", [(4, 2), (6, 2), (6, 3), (8, 4), (8, 8)])
def test_spardl_teams_conservation(P, teams):
    res = run_steps("spardl", P=P, n=2400, steps=15, density=0.02, grad_fn=mixed(seed=7),
                    teams=teams)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    # same total volume as teams=1: 2(P-1) blocks
    kb = res.algs[0].kb
    want = 2 * (P - 1) * (1 + 2 * kb) * 4 + flag_bytes(P)
    assert all(b == want for row in res.stat("bytes_sent") for b in row)


def test_spardl_bad_teams():
    with pytest.raises(ValueError, match="teams"):
        LocalCluster(4).run(lambda c: SparDL(100, c, 0.1, teams=3))


@pytest.mark.parametrize("P", [3, 5, 6, 7])
def test_spardl_block_budget_non_power_of_two(P):
    """out holds at most k_b nonzeros in every block, and the block is its owner's top-k_b."""
    n = 1000 + P
    res = run_steps("spardl", P=P, n=n, steps=12, density=0.05, grad_fn=student_t(seed=P))
    assert_conservation(res)
    assert_bitwise_agreement(res)
    kb = res.algs[0].kb
    assert kb == max(1, round(res.k / P))
    bounds = [n * b // P for b in range(P + 1)]
    for t, row in enumerate(res.outs):
        o = row[0]
        for b in range(P):
            nz = int((o[bounds[b]:bounds[b + 1]] != 0).sum())
            assert nz <= kb, f"step {t} block {b}: {nz} nonzeros > k_b={kb}"
        # with dense heavy-tailed gradients every block is full
        assert int((o != 0).sum()) == P * kb


def test_spardl_schedule_any_P():
    for G in range(1, 40):
        ds = _rounds_rs(G)
        assert len(ds) == (math.ceil(math.log2(G)) if G > 1 else 0)
        # blocks sent per round: G - 2^(R-1), 2^(R-2), ..., 1  -> G - 1 in all
        m, sent = G, 0
        for d in ds:
            assert m - d <= d
            sent += max(0, m - d)
            m = d
        assert m == 1 or G == 1
        assert sent == G - 1


@pytest.mark.parametrize("P", [2, 3, 5, 8])
def test_spardl_bytes_match_formula(P):
    n = 4000
    res = run_steps("spardl", P=P, n=n, steps=3, density=0.01, grad_fn=student_t(seed=1))
    k, kb = res.k, res.algs[0].kb
    want = 2 * (P - 1) * (1 + 2 * kb) * 4 + flag_bytes(P)  # ONE message per round, fixed size
    formula = 4 * k * (P - 1) / P * 4                           # §6: 4k(P-1)/P words
    for row in res.stat("bytes_sent"):
        for b in row:
            assert b == want
            # headers (one word per block) + rounding of k_b = k/P are the only slack
            assert b <= formula * (1 + 2 * P / k) + 2 * (P - 1) * 4 + 8 * (P - 1) * 4


def test_spardl_nonfinite_leaves_residual():
    res = run_steps("spardl", P=3, n=900, steps=6, density=0.05, grad_fn=mixed(seed=3),
                    nonfinite={2: 1})
    assert_conservation(res)          # checks NaN out everywhere + residual unchanged at step 2
    assert res.unchanged[2]
    assert_bitwise_agreement(res)


@pytest.mark.parametrize("cls", [SparDL, TopkDSA], ids=["spardl", "topkdsa"])
def test_p1_is_topk(cls):
    comm = SingleCommunicator()
    alg = cls(500, comm, 0.04)
    g = torch.randn(500, generator=torch.Generator().manual_seed(0))
    out = alg(g)
    top = torch.topk(g.abs(), alg.k).indices
    want = torch.zeros(500)
    want[top] = g[top]
    assert torch.equal(out, want)
    assert torch.equal(alg.residual + out, g)
