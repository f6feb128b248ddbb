"""Ok-Topk (oktopk_triton/algorithms/oktopk.py): conservation, agreement, counts, volume,
exactness against a plain-torch reference, gloo == LocalCluster, state_dict continuation.

Run with ``-s`` to see the measured distributions (global count / k, bytes per step vs bound).
"""
import io

import pytest
import torch

from conservation import (assert_bitwise_agreement, assert_conservation, mixed, moving_hotspots,
                          one_big_rank, run_steps, student_t)
from oktopk_triton.algorithms.oktopk import OkTopk, source_order
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.kernels import HIST_BINS

BE = "torch"   # the kernels' torch references: the CPU path (the interpreter is tested elsewhere)
Q = torch.tensor([0.0, 0.05, 0.5, 0.95, 1.0], dtype=torch.float64)


def _q(x):
    return [round(v, 2) for v in x.quantile(Q).tolist()]


# -- conservation and agreement ---------------------------------------------------------------
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 7, 8])
def test_conservation_and_agreement(P):
    res = run_steps("oktopk", P, 6000, 200, 0.01, mixed(P), backend=BE, tau=16, tau_prime=16,
                    region_period=32)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    ovf = res.stat_array("overflow")
    print(f"\nP={P}: overflow entries/step mean {ovf.mean():.1f}; "
          f"global/k {_q(res.stat_array('global_count')[1:, 0] / res.k)}")


@pytest.mark.parametrize("P,gen", [(3, "hot"), (5, "big"), (8, "t")])
def test_conservation_under_forced_overflow(P, gen):
    fn = {"hot": moving_hotspots(1), "big": one_big_rank(2, big=P - 1), "t": student_t(3)}[gen]
    res = run_steps("oktopk", P, 4000, 200, 0.02, fn, backend=BE, capacity_slack=0.3,
                    adapt_capacity=False)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    red = res.stat_array("reduce_overflow")
    gat = res.stat_array("gather_overflow")
    assert red.sum() > 0 and gat.sum() > 0, "the small slack should overflow both buffers"
    # nothing is lost: the residuals carry everything past capacity (checked by conservation);
    # and mass does get through: out is nonzero on every step
    assert all(int((r[0] != 0).sum()) > 0 for r in res.outs)


# -- counts -------------------------------------------------------------------------------------
@pytest.mark.parametrize("gen", ["mixed", "t"])
def test_global_count_after_calibration(gen):
    P, n = 4, 20000
    fn = mixed(7) if gen == "mixed" else student_t(7)
    res = run_steps("oktopk", P, n, 200, 0.01, fn, backend=BE)
    k = res.k
    g = res.stat_array("global_count")[:, 0]
    sel = res.stat_array("global_selected")[:, 0]
    assert torch.equal(res.stat_array("global_count"),
                       g[:, None].expand(-1, P)), "every rank sees the same global count"
    after = g[1:] / k
    print(f"\n[{gen}] k={k}: global count/k quantiles (0,5,50,95,100%) {_q(after)}; "
          f"in out/k {_q(sel[1:] / k)}; local/k {_q(res.stat_array('local_selected')[1:].flatten() / k)}")
    assert bool(((after >= 0.5) & (after <= 2.0)).all()), f"global count left [0.5k, 2k]: {_q(after)}"
    assert bool((sel[1:] / k >= 0.5).all())


@pytest.mark.parametrize("P", [1, 3, 4])
def test_global_select_gathered(P):
    """global_select="gathered": I = the k largest gathered |sums| every step (|I| = k when at
    least k sums were gathered), conservation and bitwise agreement as in the threshold mode."""
    res = run_steps("oktopk", P, 6000, 60, 0.01, mixed(P + 30), backend=BE,
                    global_select="gathered")
    assert_conservation(res)
    assert_bitwise_agreement(res)
    sel = res.stat_array("global_selected")[:, 0]
    assert bool((sel[1:] >= res.k).all()) and bool((sel <= res.k + 2).all()), _q(sel / res.k)


# -- volume -------------------------------------------------------------------------------------
@pytest.mark.parametrize("P,tau", [(2, 1), (4, 1), (7, 1), (4, 32), (7, 32)])
def test_bytes_per_step_within_bound(P, tau):
    """Every step within 6k(P-1)/P words + headers, plus the global threshold exchange on the
    steps that recompute th_global (every step with the default tau=1; with the paper's tau=32
    only steps 0, 1, 2, 4, ... and every 32nd)."""
    n, density = 20000, 0.01
    res = run_steps("oktopk", P, n, 100, density, mixed(11), backend=BE, tau=tau)
    k = res.k
    bound = 6 * k * (P - 1) / P * 4
    headers = 4 * (P - 1) * 4 + 8          # 2 header words per message/slot; nonfinite flag
    hist_dtype_bytes = 4 if P * n < 2 ** 31 else 8
    hist = 2 * (2 * (P - 1) * HIST_BINS * hist_dtype_bytes // P)
    cap_g = max(int(s["cap_g"]) for row in res.stats for s in row)
    hist = min(hist, (P - 1) * min(k, 2 * cap_g) * 4)   # recalibration steps only: top-m or histograms
    b = res.stat_array("bytes_sent")
    cal = torch.tensor([[bool(s["calibrated"]) for s in row] for row in res.stats])
    assert bool((b[~cal] <= bound + headers).all()), (b[~cal].max(), bound + headers)
    assert bool((b[cal] <= bound + headers + hist).all())
    assert bool(cal.all()) == (tau == 1)
    plain = b[~cal] if tau > 1 else b
    print(f"\nP={P} k={k} tau={tau}: bytes/step/rank mean {b.mean():.0f} (steady steps "
          f"{plain.mean():.0f}, max {plain.max():.0f}); bound 6k(P-1)/P words = {bound:.0f} B; "
          f"recalibration steps add at most {hist} B (global threshold exchange)")


# -- exactness against a plain-torch reference --------------------------------------------------
def _exact_body(comm, n, steps, seed):
    alg = OkTopk(n, comm, 0.02, backend=BE, exact_thresholds=True, capacity_slack=100.0,
                 volume_budget=None, adapt_capacity=False, region_period=2)
    fn = mixed(seed)
    rows = []
    for t in range(steps):
        offs = alg.region_offsets.clone()
        acc = alg.residual + fn(comm.rank, t, n)
        out = alg(fn(comm.rank, t, n))
        rows.append((acc, offs, out.clone(), alg.residual.clone(),
                     int(alg.stats["overflow"])))
    return rows


def _reference_step(accs, offs, k):
    P = len(accs)
    n = accs[0].numel()
    sel = []
    for a in accs:
        th = torch.topk(a.abs(), k, sorted=False).values.min()
        sel.append((a.abs() >= th) & (a != 0))
    s = torch.zeros(n, dtype=torch.float32)
    for j in range(P):
        lo, hi = int(offs[j]), int(offs[j + 1])
        for src in source_order(j, P):
            s[lo:hi] += torch.where(sel[src][lo:hi], accs[src][lo:hi], 0.0)
    thg = torch.topk(s.abs(), k, sorted=False).values.min()
    I = (s.abs() >= thg) & (s != 0)
    out = torch.where(I, s * torch.tensor(1.0 / P, dtype=torch.float32), 0.0)
    res = [torch.where(m & I, 0.0, a) for a, m in zip(accs, sel)]
    return out, res, int(I.sum())


@pytest.mark.parametrize("P", [1, 3, 4])
def test_exact_thresholds_match_reference(P):
    n, steps = 3000, 6
    per_rank = LocalCluster(P).run(_exact_body, n, steps, 5)
    k = round(0.02 * n)
    for t in range(steps):
        accs = [per_rank[p][t][0] for p in range(P)]
        offs = per_rank[0][t][1]
        assert all(per_rank[p][t][4] == 0 for p in range(P)), "no overflow expected"
        out, res, nI = _reference_step(accs, offs, k)
        assert k <= nI <= k + 2
        for p in range(P):
            assert torch.equal(per_rank[p][t][2], out), f"step {t} rank {p}: out differs"
            assert torch.equal(per_rank[p][t][3], res[p]), f"step {t} rank {p}: residual differs"


# -- gloo processes == LocalCluster -----------------------------------------------------------
def _gloo_body(comm, n, steps):
    alg = OkTopk(n, comm, 0.01, backend=BE, tau=4, tau_prime=4, region_period=4)
    fn = mixed(21)
    outs = []
    for t in range(steps):
        outs.append(alg(fn(comm.rank, t, n)).clone())
    return torch.stack(outs), alg.residual.clone(), comm.bytes_sent


def test_gloo_matches_local_cluster():
    distutil = pytest.importorskip("distutil")
    n, steps = 3000, 12
    local = LocalCluster(3).run(_gloo_body, n, steps)
    gloo = distutil.run_gloo(3, _gloo_body, n, steps)
    for p in range(3):
        assert torch.equal(local[p][0], gloo[p][0]), f"rank {p}: outs differ"
        assert torch.equal(local[p][1], gloo[p][1]), f"rank {p}: residuals differ"
        assert local[p][2] == gloo[p][2], "byte counts differ"


# -- state_dict continuation --------------------------------------------------------------------
def _state_body(comm, n, steps, cut):
    opts = dict(backend=BE, tau=4, tau_prime=3, region_period=5)
    fn = mixed(33)
    a = OkTopk(n, comm, 0.01, **opts)
    outs, blob = [], None
    for t in range(steps):
        if t == cut:
            buf = io.BytesIO()
            torch.save(a.state_dict(), buf)
            blob = buf.getvalue()
        outs.append(a(fn(comm.rank, t, n)).clone())
    b = OkTopk(n, comm, 0.01, **opts)
    b.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
    outs2 = [b(fn(comm.rank, t, n)).clone() for t in range(cut, steps)]
    return outs[cut:], outs2, a.residual.clone(), b.residual.clone(), (a.cap_r, a.cap_g), \
        (b.cap_r, b.cap_g)


@pytest.mark.parametrize("P", [1, 3])
def test_state_dict_round_trip_continues_bitwise(P):
    for r in LocalCluster(P).run(_state_body, 3000, 24, 9):
        o1, o2, r1, r2, c1, c2 = r
        assert all(torch.equal(x, y) for x, y in zip(o1, o2))
        assert torch.equal(r1, r2) and c1 == c2


# -- options and non-finite ---------------------------------------------------------------------
def test_unknown_option_and_bad_values():
    comm = LocalCluster(1).communicator(0)
    with pytest.raises(TypeError, match="unknown option"):
        OkTopk(100, comm, 0.1, bogus=1)
    with pytest.raises(ValueError, match="tau"):
        OkTopk(100, comm, 0.1, tau=0)


def test_nonfinite_step_keeps_state():
    res = run_steps("oktopk", 3, 3000, 40, 0.01, mixed(4), backend=BE, nonfinite={0: 1, 5: 2, 16: 0},
                    tau=8, tau_prime=8)
    assert_conservation(res)   # non-finite steps: out NaN everywhere, residuals bitwise unchanged
    assert_bitwise_agreement(res)
    for t in (0, 5, 16):
        assert res.unchanged[t]
        assert all(bool(torch.isnan(o).all()) for o in res.outs[t])
    assert all(int((o[0] != 0).sum()) > 0 for t, o in enumerate(res.outs) if t not in (0, 5, 16))


def test_warmup_steps_dense():
    res = run_steps("oktopk", 3, 2000, 12, 0.01, mixed(5), backend=BE, warmup_steps=3)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    assert all(int((res.outs[t][0] != 0).sum()) == 2000 for t in range(3))
    assert float(res.residual_sums[2].abs().max()) == 0.0


# -- a full gather slot keeps the largest sums, not the lowest indices --------------------------
def _cap_body(comm, n):
    alg = OkTopk(n, comm, 0.05, backend=BE, capacity_slack=(100.0, 0.5), volume_budget=None,
                 adapt_capacity=False)
    # the same gradient on every rank, |value| growing with the index: the largest sums are the
    # highest indices
    g = torch.Generator().manual_seed(3)
    grad = torch.linspace(0.1, 1.0, n) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    out = alg(grad)
    return out, int(alg.stats["gather_overflow"])


@pytest.mark.parametrize("P", [1, 2, 3])
def test_full_gather_slot_keeps_the_largest(P):
    n = 4000
    for out, gat in LocalCluster(P).run(_cap_body, n):
        assert gat > 0, "the small gather slack should overflow"
        nz = torch.nonzero(out).flatten()
        assert nz.numel() > 0
        # ascending fill would keep the lowest indices of the selection; the largest are the top
        assert torch.equal(nz, torch.arange(n - nz.numel(), n)), \
            f"kept {nz.numel()} entries from index {int(nz.min())}, not the largest"


# -- a full reduce row keeps the largest local entries of its region, not the lowest indices ----
def _row_cap_body(comm, n, region_cap):
    alg = OkTopk(n, comm, 0.05, backend=BE, capacity_slack=(0.5, 100.0), volume_budget=None,
                 adapt_capacity=False, region_cap=region_cap)
    g = torch.Generator().manual_seed(3)
    # the same gradient on every rank, |value| growing with the index (steps of 1e-3: many
    # entries share a level-0 histogram bin, so the row threshold needs its level-1 refinement)
    grad = torch.linspace(0.1, 1.0, n) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    out = alg(grad)
    return out, int(alg.stats["reduce_overflow"]), alg.cap_r


@pytest.mark.parametrize("P", [2, 3])
@pytest.mark.parametrize("region_cap", [True, False])
def test_full_reduce_row_keeps_the_largest(P, region_cap):
    n = 4000
    for out, ovf, cap_r in LocalCluster(P).run(_row_cap_body, n, region_cap):
        assert ovf > 0, "the small reduce slack should overflow"
        nz = torch.nonzero(out).flatten()
        assert nz.numel() == cap_r      # the top-k all lie in the last region: one full row
        top = torch.arange(n - cap_r, n)
        if region_cap:
            assert torch.equal(nz, top), f"sent {nz.tolist()[:5]}..., not the largest"
        else:   # the old rule (and the option off): the lowest indices of the selection
            assert int(nz.max()) < n - cap_r
