"""Gaussiank specifics: about k selected on normal data, the under-selection on heavy tails
that its threshold correction fixes, capacity overflow kept in the residual, bad options."""
from __future__ import annotations

import pytest
import torch

from oktopk_triton.algorithms.gaussiank import Gaussiank
from oktopk_triton.comm.local import LocalCluster


def _gk_body(comm, n, density, grad_kind, opts):
    g = torch.Generator().manual_seed(comm.rank + 17)
    if grad_kind == "normal":
        grad = torch.randn(n, generator=g)
    elif grad_kind == "heavy":   # normal plus 0.1 % huge coordinates (x1000)
        grad = torch.randn(n, generator=g)
        grad[torch.randperm(n, generator=g)[: n // 1000]] *= 1000
    else:                        # bimodal: 10 % at +-1, the rest 0
        grad = torch.zeros(n)
        grad[: n // 10] = torch.sign(torch.randn(n // 10, generator=g))
    a = Gaussiank(n, comm, density, **opts)
    acc = a.residual + grad
    out = a(grad)
    st = {k: (v.item() if isinstance(v, torch.Tensor) else v) for k, v in a.stats.items()}
    return acc, out, a.residual.clone(), st, a.k, a.cap


def test_gaussiank_normal_data_selects_about_k():
    (acc, out, resid, st, k, cap), = LocalCluster(1).run(_gk_body, 20000, 0.01, "normal", {})
    assert 0.75 * k <= st["selected_before_capacity"] <= 1.25 * k
    assert st["overflow"] == 0


def test_gaussiank_heavy_tail_under_selects_and_correction_fixes_it():
    n, density = 20000, 0.01
    (_, _, _, plain, k, _), = LocalCluster(1).run(_gk_body, n, density, "heavy", {"iters": 0})
    (_, _, _, fixed, _, _), = LocalCluster(1).run(_gk_body, n, density, "heavy", {})
    assert plain["selected_before_capacity"] < 0.2 * k      # the documented weakness
    assert 0.5 * k <= fixed["selected_before_capacity"] <= 1.5 * k


def test_gaussiank_overflow_stays_in_residual():
    n, density, P = 2000, 0.01, 2
    res = LocalCluster(P).run(_gk_body, n, density, "bimodal", {"iters": 0, "slack": 1.0})
    for acc, out, resid, st, k, cap in res:
        assert cap == k
        assert st["selected_before_capacity"] == n // 10 and st["overflow"] == n // 10 - cap
        sent = resid == 0
        # exactly the first `cap` selected indices (ascending) were sent, the rest kept whole
        assert int((sent & (acc != 0)).sum()) == cap
        assert torch.equal(resid[~sent], acc[~sent])
    lhs = sum(r[0].double() for r in res)
    rhs = P * res[0][1].double() + sum(r[2].double() for r in res)
    assert torch.equal(lhs, rhs)
    assert torch.equal(res[0][1], res[1][1])


def test_gaussiank_bad_options():
    cluster = LocalCluster(1)
    for opts in ({"slack": 0.5}, {"iters": -1}, {"lo": 1.5}, {"hi": 0.5}, {"nope": 1}):
        with pytest.raises((ValueError, TypeError)):
            cluster.run(lambda comm: Gaussiank(100, comm, 0.1, **opts))
