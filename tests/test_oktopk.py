"""Ok-Topk (oktopk_triton/algorithms/oktopk.py): conservation, agreement, counts, volume, the
steady step's cost (passes, launches, collectives), exactness against a plain-torch reference,
gloo == LocalCluster, state_dict continuation.

Run with ``-s`` to see the measured distributions (|I| / k, bytes per step against the bound).
"""

import pytest
import torch

from conservation import (assert_bitwise_agreement, assert_conservation, continued_from_save,
                          mixed, moving_hotspots, one_big_rank, run_steps,
                          steady_steps_never_sync, student_t)
from oktopk_triton.algorithms.oktopk import OkTopk, source_order
from oktopk_triton.comm.local import LocalCluster

BE = "torch"   # the kernels' torch references: the CPU path (the interpreter is tested elsewhere)
Q = torch.tensor([0.0, 0.05, 0.5, 0.95, 1.0], dtype=torch.float64)


def _q(x):
    return [round(v, 2) for v in x.double().quantile(Q).tolist()]


# -- conservation and agreement ---------------------------------------------------------------
@pytest.mark.parametrize("P", [1, 2, 3, 4, 5, 7, 8])
def test_conservation_and_agreement(P):
    res = run_steps("oktopk", P, 6000, 60, 0.01, mixed(P), backend=BE)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    ovf = res.stat_array("overflow")
    print(f"\nP={P}: staged-not-sent entries/step mean {ovf.float().mean():.1f}; "
          f"|I|/k {_q(res.stat_array('global_selected')[1:, 0] / res.k)}")


@pytest.mark.parametrize("P,gen", [(3, "hot"), (5, "big"), (8, "t")])
def test_conservation_under_forced_overflow(P, gen):
    """stage_factor=1 (staging rows of cap_r + 1) and a tiny budget: the staging rows overflow
    (entries the select pass could not stage stay in the residual) and the gathered slots hold
    more than k: conservation and agreement hold all the same."""
    fn = {"hot": moving_hotspots(1), "big": one_big_rank(2, big=P - 1), "t": student_t(3)}[gen]
    res = run_steps("oktopk", P, 4000, 60, 0.02, fn, backend=BE, stage_factor=1.0,
                    volume_budget=1.5)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    red = res.stat_array("reduce_overflow")
    assert red.sum() > 0, "the one-slot staging margin should overflow"
    # mass does get through: out is nonzero on every step
    assert all(int((r[0] != 0).sum()) > 0 for r in res.outs)


# -- counts -------------------------------------------------------------------------------------
@pytest.mark.parametrize("gen", ["mixed", "t"])
def test_global_count_after_calibration(gen):
    """|I| (the entries applied per step) stays near k: at most k + ties, at least k/2 after the
    first steps; every rank sees the same |I|."""
    P, n = 4, 20000
    fn = mixed(7) if gen == "mixed" else student_t(7)
    res = run_steps("oktopk", P, n, 60, 0.01, fn, backend=BE)
    k = res.k
    sel = res.stat_array("global_selected")
    assert torch.equal(sel, sel[:, :1].expand(-1, P)), "every rank applies the same |I|"
    after = sel[3:, 0].double() / k
    local = res.stat_array("local_selected")[3:].flatten().double() / k
    print(f"\n[{gen}] k={k}: |I|/k quantiles (0,5,50,95,100%) {_q(after)}; "
          f"staged/k {_q(local)}")
    assert bool((after >= 0.5).all()), f"|I| fell under k/2: {_q(after)}"
    assert bool((sel[:, 0] <= k + 2).all())


# -- the rank threshold -------------------------------------------------------------------------
@pytest.mark.parametrize("target", [50, 400, 3000])
def test_rank_threshold_from_histograms_with_different_centres(target):
    """_rank_threshold_at: rows binned around different thresholds (one row capped higher, as
    the staging fill does) still add up: the returned |acc| holds the target within a bin's
    worth (1/8 binade) of entries."""
    from oktopk_triton import kernels as K
    from oktopk_triton.kernels.selection import select_hist_bins
    g = torch.Generator().manual_seed(0)
    P, n = 3, 30000
    acc = torch.randn(n, generator=g) * torch.linspace(0.5, 2.0, n)
    rid = torch.arange(n) * P // n
    th = torch.tensor([1.5, 2.5, 1.8])        # each row's own centre
    hist = torch.zeros(P, K.SELECT_HIST_BINS, dtype=torch.int64)
    bins = select_hist_bins(acc, (th.view(torch.int32) & 0x7FFFFFFF)[rid])
    hist.index_put_((rid, bins), torch.ones(n, dtype=torch.int64), accumulate=True)
    x = OkTopk._rank_threshold_at(hist, th, torch.tensor([float(target)]))
    got = int((acc.abs() >= x).sum())
    lo = int((acc.abs() >= x * 2 ** 0.125).sum())
    hi = int((acc.abs() >= x / 2 ** 0.125).sum())
    assert lo <= target <= hi, (target, got, lo, hi)


def _calib_body(comm, n, steps):
    alg = OkTopk(n, comm, 0.02, backend=BE, calibrate_steps=steps)
    g = torch.Generator().manual_seed(10 + comm.rank)
    staged = []
    for t in range(steps + 2):
        alg(torch.randn(n, generator=g) * (1.0 + 0.5 * t))   # a scale that moves every step
        staged.append(int(alg.stats["local_selected"]))
    return staged, alg.k


def test_calibrate_steps_stage_the_exact_k():
    """calibrate_steps: those steps place the rows at this rank's exact k-th largest, so a rank
    stages exactly k (continuous values, no row at its staging cap); then the prediction."""
    for staged, k in LocalCluster(3).run(_calib_body, 6000, 4):
        assert staged[:4] == [k] * 4, staged


# -- volume -------------------------------------------------------------------------------------
@pytest.mark.parametrize("P", [2, 4, 7, 8])
@pytest.mark.parametrize("check_finite", ["skip", "off"])
def test_bytes_per_step_within_budget(P, check_finite):
    """Every step, headers and the non-finite flag included, within volume_budget·k(P−1)/P
    words (default 4: SparDL's volume)."""
    n, density = 20000, 0.01
    res = run_steps("oktopk", P, n, 30, density, mixed(11), backend=BE, check_finite=check_finite)
    k = res.k
    bound = 4 * k * (P - 1) / P * 4
    b = res.stat_array("bytes_sent").double()
    assert bool((b <= bound).all()), (float(b.max()), bound)
    assert float(b.min()) >= 0.8 * bound     # static sizes: the budget is used, not wasted
    print(f"\nP={P} k={k}: bytes/step/rank {b.mean():.0f}, bound 4k(P-1)/P words = {bound:.0f} B")


# -- the steady step's cost ---------------------------------------------------------------------
def _cost_body(comm, n, momentum):
    a = OkTopk(n, comm, 0.01, backend=BE, momentum=momentum)
    fn = mixed(3)
    rows = []
    for t in range(6):
        a(fn(comm.rank, t, n))
        s = a.stats
        rows.append((int(s["kernel_launches"]), int(s["kernel_bytes"]), int(s["collectives"])))
    return rows, a.cap_r, a.cap_s, a.cap_g


@pytest.mark.parametrize("P", [2, 4, 8])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_steady_step_cost_within_bounds(P, momentum, monkeypatch):
    """Counted by the dispatch and communicator layers (stats): a steady step issues at most 3
    collectives (non-finite flag, one send/recv batch, one allgather), touches the
    gradient-sized vectors in at most two passes (the fused select over grad, residual (and
    velocity), plus the flag's read of grad and out's memset), and its launches do not grow
    with n. The select runs its reference, counted as the kernel's one pass (the CPU path's
    own traffic is bounded in test_cpu_path.py)."""
    from oktopk_triton.kernels import selection
    monkeypatch.setattr(selection, "REFERENCE", True)
    per_n = {}
    for n in (20000, 80000):
        rows, cap_r, cap_s, cap_g = LocalCluster(P).run(_cost_body, n, momentum)[0]
        steady = rows[2:]
        launches = {r[0] for r in steady}
        assert all(r[2] <= 3 for r in steady), steady
        sel_pass = n * (4 + 8 + (8 if momentum else 0))      # grad read, residual (velocity) r+w
        other_dense = 4 * n + 4 * n                          # non-finite read of grad, out memset
        sparse = 64 * P * (cap_s + cap_r + cap_g) + 4096     # rows, slots, scatter, clear (ample)
        # the rank threshold's sample: m = min(65536, n) positions of grad and residual (and
        # velocity) gathered, |acc| written (kernels/sample.py counts it; the torch ops did not)
        sparse += min(65536, n) * (16 + (4 if momentum else 0))
        for r in steady:
            assert r[1] <= sel_pass + other_dense + sparse, (r, sel_pass, other_dense, sparse)
        per_n[n] = launches
    assert per_n[20000] == per_n[80000], per_n       # launches independent of n
    print(f"\nP={P} m={momentum}: launches/step {per_n[20000]}")


# -- exactness against a plain-torch reference --------------------------------------------------
def _exact_body(comm, n, steps, seed):
    alg = OkTopk(n, comm, 0.02, backend=BE, exact_thresholds=True, volume_budget=None)
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
    kept = (s.abs() >= thg) & (s != 0)       # the paper's I: the global top-k of the sum
    out = torch.where(kept, s * torch.tensor(1.0 / P, dtype=torch.float32), 0.0)
    res = [torch.where(m & kept, 0.0, a) for a, m in zip(accs, sel)]
    return out, res, int(kept.sum())


@pytest.mark.parametrize("P", [1, 3, 4])
def test_exact_thresholds_match_reference(P):
    """exact_thresholds=True, volume_budget=None: every rank sends its exact local top-k, the
    owners sum in source order, I is the exact global top-k of the sums: out and residuals equal
    a plain-torch Top-k sparse allreduce bit for bit, with the regions the step used."""
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
    alg = OkTopk(n, comm, 0.01, backend=BE)
    fn = mixed(21)
    outs = []
    for t in range(steps):
        outs.append(alg(fn(comm.rank, t, n)).clone())
    return torch.stack(outs), alg.residual.clone(), comm.bytes_sent, comm.collectives_issued


def test_gloo_matches_local_cluster():
    distutil = pytest.importorskip("distutil")
    n, steps = 3000, 12
    local = LocalCluster(3).run(_gloo_body, n, steps)
    gloo = distutil.run_pooled(3, _gloo_body, n, steps)
    for p in range(3):
        assert torch.equal(local[p][0], gloo[p][0]), f"rank {p}: outs differ"
        assert torch.equal(local[p][1], gloo[p][1]), f"rank {p}: residuals differ"
        assert local[p][2] == gloo[p][2], "byte counts differ"
        assert local[p][3] == gloo[p][3], "collective counts differ"


# -- state_dict continuation --------------------------------------------------------------------
def _state_body(comm, n, steps, cut, **extra):
    opts = dict(backend=BE, momentum=0.9, **extra)
    fn = mixed(33)
    a, outs, b, outs2 = continued_from_save(lambda: OkTopk(n, comm, 0.01, **opts),
                                            lambda alg, t: alg(fn(comm.rank, t, n)).clone(),
                                            steps, cut)
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
    with pytest.raises(TypeError, match="unknown option"):
        OkTopk(100, comm, 0.1, tau=1)       # removed: thresholds come from the select pass
    with pytest.raises(ValueError, match="volume_budget"):
        OkTopk(100, comm, 0.1, volume_budget=0)
    with pytest.raises(ValueError, match="capacity_split"):
        OkTopk(100, comm, 0.1, capacity_split=1.0)
    with pytest.raises(ValueError, match="stage_factor"):
        OkTopk(100, comm, 0.1, stage_factor=0.5)
    with pytest.raises(ValueError, match="row_threshold"):
        OkTopk(100, comm, 0.1, row_threshold="global")
    with pytest.raises(ValueError, match="threshold_sample"):
        OkTopk(100, comm, 0.1, threshold_sample=-1)


def test_nonfinite_step_keeps_state():
    res = run_steps("oktopk", 3, 3000, 30, 0.01, mixed(4), backend=BE,
                    nonfinite={0: 1, 5: 2, 16: 0})
    assert_conservation(res)   # non-finite steps: out NaN everywhere, residuals bitwise unchanged
    assert_bitwise_agreement(res)
    for t in (0, 5, 16):
        assert res.unchanged[t]
        assert all(bool(torch.isnan(o).all()) for o in res.outs[t])
    assert all(int((o[0] != 0).sum()) > 0 for t, o in enumerate(res.outs) if t not in (0, 5, 16))
    # thresholds and regions are those of the step before a non-finite step
    ths = [s["th_rows"] for s in res.stats[0]] if isinstance(res.stats[0], list) else None
    del ths


def test_warmup_steps_dense():
    res = run_steps("oktopk", 3, 2000, 12, 0.01, mixed(5), backend=BE, warmup_steps=3)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    assert all(int((res.outs[t][0] != 0).sum()) == 2000 for t in range(3))
    assert float(res.residual_sums[2].abs().max()) == 0.0


# -- what is kept is the largest, not the lowest indices ----------------------------------------
def _largest_body(comm, n, budget):
    alg = OkTopk(n, comm, 0.05, backend=BE, volume_budget=budget)
    # the same gradient on every rank, |value| growing with the index: within any range the
    # largest are the highest indices
    g = torch.Generator().manual_seed(3)
    grad = torch.linspace(0.1, 1.0, n) * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0)
    offs = alg.region_offsets.clone()
    out = alg(grad)
    return out, offs, alg.cap_r, alg.cap_g


@pytest.mark.parametrize("P", [1, 2, 3])
@pytest.mark.parametrize("budget", [1.0, 4.0])
def test_rows_and_slots_keep_the_largest(P, budget):
    """A row sends the cap_r largest of what its region staged, an owner's slot keeps the cap_g
    largest sums of its region, I the k largest of the slots: in every region what reaches out
    is a suffix (the largest), never the lowest indices of the selection."""
    n = 4000
    for out, offs, cap_r, cap_g in LocalCluster(P).run(_largest_body, n, budget):
        nz = torch.nonzero(out).flatten()
        assert nz.numel() > 0
        for j in range(P):
            lo, hi = int(offs[j]), int(offs[j + 1])
            got = nz[(nz >= lo) & (nz < hi)]
            assert got.numel() <= min(cap_r, cap_g)
            assert torch.equal(got, torch.arange(hi - got.numel(), hi)), \
                f"region {j}: kept {got.numel()} entries from {int(got.min())}, not the largest"


# -- bf16 values on the wire -------------------------------------------------------------------
def _wire_body(comm, n, wire):
    alg = OkTopk(n, comm, 0.02, backend=BE, wire_dtype=wire)
    fn = mixed(8)
    rows = []
    for t in range(8):
        acc = alg.residual + fn(comm.rank, t, n)
        out = alg(fn(comm.rank, t, n)).clone()
        rows.append((acc, out, alg.residual.clone(), int(alg.stats["bytes_sent"])))
    return rows, alg.cap_r, alg.cap_g


@pytest.mark.parametrize("P", [2, 3, 4])
def test_bf16_wire_keeps_the_rounding_in_the_residual(P):
    """wire_dtype='bf16': the rows carry bf16 values (4/3 as many entries in the same budget);
    what the rounding dropped stays in the sender's residual, so conservation still holds
    (sum of acc = P·out + sum of residuals, to fp32 rounding), out agrees bitwise, and a
    delivered entry's residual is its rounding error, not 0."""
    n = 6000
    b16 = LocalCluster(P).run(_wire_body, n, "bf16")
    f32 = LocalCluster(P).run(_wire_body, n, "fp32")
    assert b16[0][1] > f32[0][1], "bf16 rows should hold more entries"
    assert b16[0][2] == f32[0][2]
    k = round(0.02 * n)
    for t in range(8):
        outs = [b16[p][0][t][1] for p in range(P)]
        assert all(torch.equal(outs[0], o) for o in outs)
        lhs = sum(b16[p][0][t][0].double() for p in range(P))
        rhs = P * outs[0].double() + sum(b16[p][0][t][2].double() for p in range(P))
        torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-4)
        for p in range(P):
            assert b16[p][0][t][3] <= 4 * k * (P - 1) / P * 4
    # delivered entries: residual = acc - bf16(acc) (nonzero for most)
    leftover = 0
    for p in range(P):
        acc, out, res, _ = b16[p][0][-1]
        hit = (out != 0) & (res != acc)
        want = acc[hit] - acc[hit].to(torch.bfloat16).float()
        assert torch.equal(res[hit], want)
        leftover += int((res[hit] != 0).sum())
    assert leftover > 0


# -- CUDA: a steady step never synchronises with the host -------------------------------------
def _sync_body(comm, n, momentum, wire):
    fmt = ({"wire_format": wire[:2], "complete_sums": True} if wire == "q2+complete" else
           {"wire_format": "compact"} if wire == "compact" else {"wire_dtype": wire})
    alg = OkTopk(n, comm, 0.01, momentum=momentum, device=comm.device, **fmt)
    return steady_steps_never_sync(alg, comm, n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("P", [1, 2, 4])
@pytest.mark.parametrize("momentum,wire", [(0.0, "fp32"), (0.9, "bf16"), (0.9, "compact"),
                                           (0.9, "q2+complete")])
def test_cuda_steady_step_never_syncs(P, momentum, wire):
    """Compiled kernels on CUDA tensors, steps 2-4 under
    torch.cuda.set_sync_debug_mode('error') (any synchronising CUDA call raises)."""
    assert LocalCluster(P, device="cuda").run(_sync_body, 1 << 20, momentum, wire) == [True] * P


# -- the interpreted Triton kernels give the torch path's step bit for bit --------------------
def _backend_body(comm, n, backend, wire="fp32", **extra):
    alg = OkTopk(n, comm, 0.02, backend=backend, momentum=0.9, wire_format=wire, **extra)
    fn = mixed(12)
    outs = [alg(fn(comm.rank, t, n)).clone() for t in range(5)]
    return torch.stack(outs), alg.residual.clone(), alg.velocity.clone()


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs TRITON_INTERPRET=1 (the interpreter runs Triton on CPU tensors)")
@pytest.mark.parametrize("wire", ["fp32", "compact"])
def test_triton_kernels_match_torch_path(wire):
    """P = 3, momentum: the Triton kernels (interpreted on CPU) and the torch references give the
    same out, residual and velocity bit for bit (rows fill in another order, but each row keeps
    its cap_r largest and every index is added once per source; the compact wire sorts them)."""
    n = 3000
    tri = LocalCluster(3).run(_backend_body, n, "triton", wire)
    ref = LocalCluster(3).run(_backend_body, n, "torch", wire)
    for p in range(3):
        for a, b in zip(tri[p], ref[p]):
            assert torch.equal(a, b)


# -- complete_sums: every rank's part of the chosen entries ------------------------------------
def _owed_at_out(res):
    """What the ranks still owe, after the last step, at the entries it delivered, against
    what it delivered there (both summed over the entries)."""
    at = res.outs[-1][0] != 0
    owed = sum(r[at].abs().sum() for r in res.residuals)
    return float(owed / (res.P * res.outs[-1][0][at].abs().sum()))


@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("wire", ["fp32", "q2"])
def test_complete_sums_conservation_agreement_and_nothing_owed(P, wire):
    args = ("oktopk", P, 4000, 12, 0.02, mixed(P))
    res = run_steps(*args, backend=BE, wire_format=wire, complete_sums=True)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    plain = run_steps(*args, backend=BE, wire_format=wire)
    owed, owed_plain = _owed_at_out(res), _owed_at_out(plain)
    print(f"\nP={P} {wire}: owed at out / delivered {owed:.3f} (without: {owed_plain:.3f})")
    if wire == "fp32":     # every rank's part arrived whole
        assert owed == 0.0 < owed_plain
    else:                  # what is left is the 2-bit rounding of the parts
        assert owed < 0.6 * owed_plain


def test_complete_sums_nonfinite_step_moves_nothing():
    res = run_steps("oktopk", 3, 3000, 12, 0.02, mixed(4), backend=BE, wire_format="q2",
                    complete_sums=True, nonfinite={0: 1, 5: 2})
    assert_conservation(res)   # non-finite steps: out NaN everywhere, residuals bitwise unchanged
    assert_bitwise_agreement(res)
    assert res.unchanged[0] and res.unchanged[5]


def test_complete_sums_masks_the_velocity_it_delivers():
    res = run_steps("oktopk", 3, 3000, 6, 0.02, mixed(1), backend=BE, complete_sums=True,
                    momentum=0.9)
    assert_conservation(res)
    at = res.outs[-1][0] != 0
    for alg in res.algs:
        assert not bool(alg.velocity[at].any())


def test_complete_sums_refuses_a_non_bool():
    def build(comm):
        OkTopk(100, comm, 0.1, complete_sums="yes")
    with pytest.raises(Exception, match="complete_sums must be True or False, got 'yes'"):
        LocalCluster(1, timeout=10).run(build)


# -- consistency: a rank ranks its own entries by |acc|·|EMA_b(sign(grad))| ---------------------
@pytest.mark.parametrize("P", [2, 3, 5])
@pytest.mark.parametrize("wire,complete", [("fp32", False), ("q2", True), ("compact", False)])
def test_consistency_conservation_and_agreement(P, wire, complete):
    res = run_steps("oktopk", P, 4000, 14, 0.02, mixed(P), backend=BE, wire_format=wire,
                    complete_sums=complete, consistency=0.9, momentum=0.9)
    assert_conservation(res)
    assert_bitwise_agreement(res)


def _flipping_and_steady(rank, t, n):
    """Entries 0-199 of size 3 with a random sign every step (on every rank its own), 200-399
    of size 0.5 with a steady sign, the rest small noise."""
    gen = torch.Generator().manual_seed(100 * rank + t)
    g = torch.randn(n, generator=gen) * 0.01
    g[:200] += 3.0 * (torch.randint(0, 2, (200,), generator=gen) * 2 - 1)
    g[200:400] += 0.5
    return g


@pytest.mark.parametrize("b", [0.0, 0.9])
def test_consistency_prefers_steady_signs(b):
    """By |acc| the noisy entries take most of the budget (k = 80) every step; ranked by
    |acc|·|EMA(sign)| the steady ones do once their EMA has seen a few steps."""
    res = run_steps("oktopk", 2, 4000, 12, 0.02, _flipping_and_steady, backend=BE,
                    consistency=b)
    assert_conservation(res)
    sent = torch.stack([(o[0] != 0) for o in res.outs[6:]]).float()
    flipping, steady = float(sent[:, :200].sum()), float(sent[:, 200:400].sum())
    print(f"\nb={b}: noisy {flipping:.0f}, steady {steady:.0f} of 6 steps' out")
    if b == 0:
        assert flipping > 4 * steady
    else:
        assert steady > 1.5 * flipping


def test_consistency_state_dict_round_trip_continues_bitwise():
    for r in LocalCluster(3).run(_state_body, 3000, 24, 9, consistency=0.9):
        o1, o2, r1, r2, c1, c2 = r
        assert all(torch.equal(x, y) for x, y in zip(o1, o2))
        assert torch.equal(r1, r2)


def _signs_body(comm, n):
    fn = mixed(5)
    a = OkTopk(n, comm, 0.02, backend=BE, consistency=0.8)
    for t in range(3):
        a(fn(comm.rank, t, n))
    plain = OkTopk(n, comm, 0.02, backend=BE)
    plain(fn(comm.rank, 0, n))
    fresh = OkTopk(n, comm, 0.02, backend=BE, consistency=0.8)
    fresh.load_state_dict(plain.state_dict())          # no EMA saved: it starts afresh
    taken = OkTopk(n, comm, 0.05, backend=BE, consistency=0.8)
    taken.take_over(a)                                 # a density stage goes on with the EMA
    nf = OkTopk(n, comm, 0.02, backend=BE, consistency=0.8)
    nf(fn(comm.rank, 0, n))
    before = nf._signs.clone()
    bad = fn(comm.rank, 1, n)
    bad[3] = float("inf")
    nf(bad)                                            # a non-finite step leaves the EMA
    return (a._signs.clone(), a._signs_started, fresh._signs.clone(), fresh._signs_started,
            taken._signs.clone(), taken._signs_started, "consistency_signs" in plain.state_dict(),
            torch.equal(nf._signs, before))


def test_consistency_state_take_over_and_nonfinite():
    for signs, started, fresh, fresh_started, taken, taken_started, in_plain, kept in \
            LocalCluster(2).run(_signs_body, 2000):
        assert started and bool((signs.abs() > 0).any()) and float(signs.abs().max()) <= 1
        assert not fresh_started and not bool(fresh.any()) and not in_plain
        assert taken_started and torch.equal(taken, signs)
        assert kept


def test_consistency_refuses_bad_values():
    for b in (1.0, -0.5, True, "0.9"):
        def build(comm, b=b):
            OkTopk(100, comm, 0.1, consistency=b)
        with pytest.raises(Exception, match="consistency must be a number in \\[0, 1\\)"):
            LocalCluster(1, timeout=10).run(build)


@pytest.mark.skipif(__import__("os").environ.get("TRITON_INTERPRET") != "1",
                    reason="needs TRITON_INTERPRET=1 (the interpreter runs Triton on CPU tensors)")
def test_consistency_triton_kernels_match_torch_path():
    n = 3000
    tri = LocalCluster(3).run(_backend_body, n, "triton", "q2", consistency=0.9,
                              complete_sums=True)
    ref = LocalCluster(3).run(_backend_body, n, "torch", "q2", consistency=0.9,
                              complete_sums=True)
    for p in range(3):
        for a, b in zip(tri[p], ref[p]):
            assert torch.equal(a, b)
