"""The frozen-variance Adam and the density schedule (oktopk_triton/modes/frozen_adam.py and
oktopk_triton/modes/density_schedule.py, re-exported by oktopk_triton/techniques.py)."""
import pytest
import torch

from conservation import mixed, run_steps
from oktopk_triton import SparseAllreduce
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.kernels import _dispatch


def test_removed_techniques_are_unknown_options():
    # ef_decay, local_clip, flush_every and dense_tail were measured and did not pay
    # (docs/research/techniques.md)
    for opt in ("ef_decay", "local_clip", "flush_every", "dense_tail"):
        with pytest.raises(TypeError, match=rf"unknown option\(s\) \['{opt}'\].*warmup_steps"):
            run_steps("oktopk", P=1, n=100, steps=1, density=0.1, grad_fn=mixed(0),
                      **{opt: 0.9})


def test_techniques_re_exports_the_components():
    """``from oktopk_triton.techniques import FrozenAdam, DensitySchedule`` keeps working: the
    same classes as the components' own modules."""
    from oktopk_triton import techniques
    from oktopk_triton.modes import density_schedule, frozen_adam
    assert techniques.FrozenAdam is frozen_adam.FrozenAdam
    assert techniques.DensitySchedule is density_schedule.DensitySchedule
    assert sorted(techniques.__all__) == ["DensitySchedule", "FrozenAdam", "ScheduleSpec"]


def _model():
    """The same weights on every rank (a local generator: the ranks are threads, and the global
    RNG would interleave their draws)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _adam_body(comm, steps, warmup, save_at=None, state=None, density=0.05):
    model = _model()
    sar = SparseAllreduce(model.parameters(), comm=comm, density=density, adam="frozen",
                          momentum=0.9, warmup_steps=warmup)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    start = 0
    if state is not None:
        model.load_state_dict(state[comm.rank]["model"])
        sar.load_state_dict(state[comm.rank]["sar"])
        start = save_at
    g = torch.Generator().manual_seed(comm.rank)
    xs = [torch.randn(8, 16, generator=g) for _ in range(steps)]
    saved, outs = None, []
    for t in range(start, steps):
        if t == save_at and state is None:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "sar": {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                             for k, v in sar.state_dict().items()}}
        opt.zero_grad()
        model(xs[t]).pow(2).mean().backward()
        outs.append(sar.reduce_adam(opt).clone())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, outs, saved, sar


def test_frozen_adam_dense_warmup_is_adamw():
    """Density 1 and warmup past the end: the weights follow torch's AdamW on the mean gradient."""
    P, steps = 2, 6
    res = LocalCluster(P).run(_adam_body, steps, steps + 1, None, None, 1.0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    gens = [torch.Generator().manual_seed(r) for r in range(P)]
    xs = [[torch.randn(8, 16, generator=g) for _ in range(steps)] for g in gens]
    for t in range(steps):
        opt.zero_grad()
        sum(model(xs[r][t]).pow(2).mean() for r in range(P)).div(P).backward()
        opt.step()
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(res[0][0], ref, rtol=1e-4, atol=1e-5)


def test_frozen_adam_replicas_identical_and_resume_bit_exact(monkeypatch):
    # the kernels' torch references (bit for bit the interpreted Triton kernels: test_oktopk.py
    # test_triton_kernels_match_torch_path): what is checked is the optimizer's state
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    P, steps, warmup, cut = 3, 10, 3, 6
    full = LocalCluster(P).run(_adam_body, steps, warmup, cut)
    for r in range(1, P):
        assert torch.equal(full[r][0], full[0][0])
    # the sparse phase happened: after the warm-up out is not dense
    assert int((full[0][1][-1] != 0).sum()) < full[0][1][-1].numel()
    states = [f[2] for f in full]
    resumed = LocalCluster(P).run(_adam_body, steps, warmup, cut, states)
    assert torch.equal(resumed[0][0], full[0][0])


def test_frozen_adam_needs_momentum_and_params():
    comm = LocalCluster(1).communicator(0)
    with pytest.raises(ValueError, match="momentum"):
        SparseAllreduce([torch.nn.Parameter(torch.zeros(4))], comm=comm, adam="frozen",
                        warmup_steps=2)
    with pytest.raises(ValueError, match="warmup_steps"):
        SparseAllreduce([torch.nn.Parameter(torch.zeros(4))], comm=comm, adam="frozen",
                        momentum=0.9)
    # a variance tracked from factored statistics (adam="tracked") was measured and removed
    with pytest.raises(ValueError, match="None or 'frozen'"):
        SparseAllreduce([torch.nn.Parameter(torch.zeros(4))], comm=comm, adam="tracked",
                        momentum=0.9, warmup_steps=2)


# -- density schedule (Deep Gradient Compression's sparsity warm-up) ---------------------------
from oktopk_triton.techniques import DensitySchedule  # noqa: E402


def test_dgc_ramp_stages():
    s = DensitySchedule.build({"ramp_steps": 120}, 0.01)
    assert s.stages == [(0, 0.25), (40, 0.0625), (80, 0.015625), (120, 0.01)]
    assert [s.density_at(t) for t in (0, 39, 40, 119, 120, 10_000)] == [
        0.25, 0.25, 0.0625, 0.015625, 0.01, 0.01]
    assert DensitySchedule.build({"ramp_steps": 3, "start": 0.5, "factor": 2.0}, 0.3).stages == \
        [(0, 0.5), (3, 0.3)]
    assert DensitySchedule.build([(0, 0.1), (5, 0.02)], 0.02).density_at(4) == 0.1
    assert DensitySchedule.build(None, 0.01) is None


@pytest.mark.parametrize("spec,match", [
    ([(1, 0.1), (5, 0.01)], "start at step 0"), ([(0, 0.1), (0, 0.01)], "must increase"),
    ([(0, 0.1), (5, 0.02)], "must be the reducer's density"), ([(0, 2.0), (5, 0.01)], r"\(0, 1\]"),
    ({"ramp_steps": 0}, "ramp_steps"), ({"ramp": 5}, "ramp_steps"), ("dgc", "pairs"),
])
def test_bad_density_schedules(spec, match):
    with pytest.raises(ValueError, match=match):
        DensitySchedule.build(spec, 0.01)


def _schedule_body(comm, algorithm, steps, cut=None, state=None):
    n = 3000
    sched = [(0, 0.2), (3, 0.05), (6, 0.01)]
    sar = SparseAllreduce(n, comm=comm, density=0.01, algorithm=algorithm, momentum=0.9,
                          density_schedule=sched)
    if state is not None:
        sar.set_extra_state(state)
    gen = torch.Generator().manual_seed(11 + comm.rank)
    rows = []
    for t in range(steps):
        g = torch.randn(n, generator=gen) * (1 + t)
        if state is not None and t < cut:
            continue                                  # the resumed run skips what was done
        before_r = sar.residual.clone()
        before_v = sar.algorithm.velocity.clone()
        out = sar(g)
        rows.append((sar.algorithm.density, out.clone(), before_r, before_v, g,
                     sar.residual.clone(), int(sar.stats["bytes_sent"])))
        if cut is not None and state is None and t + 1 == cut:
            return rows, sar.get_extra_state()
    return rows, None


@pytest.mark.parametrize("algorithm", ["oktopk", "gtopk", "topka"])
def test_density_schedule_conserves_and_switches(algorithm):
    P, steps = 3, 9
    res = LocalCluster(P).run(_schedule_body, algorithm, steps)
    dens = [row[0] for row in res[0][0]]
    assert dens == [0.2] * 3 + [0.05] * 3 + [0.01] * 3
    bytes_ = [row[6] for row in res[0][0]]
    assert bytes_[0] > bytes_[4] > bytes_[8] > 0     # fewer bytes as the density falls
    for t in range(steps):
        outs = [r[0][t][1] for r in res]
        assert all(torch.equal(outs[0], o) for o in outs[1:])          # bitwise across ranks
        # momentum correction: acc = residual + (m·u + g); conservation over ranks
        acc = sum(r[0][t][2] + (0.9 * r[0][t][3] + r[0][t][4]) for r in res)
        after = sum(r[0][t][5] for r in res)
        torch.testing.assert_close(acc, P * outs[0] + after, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("cut", [3, 5])
def test_density_schedule_resumes_bit_for_bit(cut, monkeypatch):
    """Saved at a stage boundary (3) and inside a stage (5), restored into a fresh reducer."""
    # the kernels' torch references (bit for bit the interpreted Triton kernels: test_oktopk.py
    # test_triton_kernels_match_torch_path; the schedule's switches on the interpreted kernels:
    # test_density_schedule_conserves_and_switches[oktopk])
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    P, steps = 3, 9
    full = LocalCluster(P).run(_schedule_body, "oktopk", steps)
    saved = LocalCluster(P).run(_schedule_body, "oktopk", steps, cut)
    resumed = LocalCluster(P).run(lambda comm: _schedule_body(
        comm, "oktopk", steps, cut, saved[comm.rank][1]))
    for r in range(P):
        tail = full[r][0][cut:]
        assert len(resumed[r][0]) == len(tail)
        for a, b in zip(tail, resumed[r][0]):
            assert a[0] == b[0] and torch.equal(a[1], b[1]) and torch.equal(a[5], b[5])


def _carry_body(comm, mode, steps_before):
    """Ok-Topk at 5% for ``steps_before`` steps on moving hot spots (the regions re-balance
    away from equal), then a reducer at 2% takes over and steps once."""
    from conservation import moving_hotspots
    from oktopk_triton.algorithms.oktopk import OkTopk
    n, fn = 6000, moving_hotspots(3)
    old = OkTopk(n, comm, 0.05, row_threshold=mode)
    for t in range(steps_before):
        old(fn(comm.rank, t, n))
    new = OkTopk(n, comm, 0.02, row_threshold=mode)
    new.take_over(old)
    taken = (new.region_offsets.clone(), new.row_target.clone(), new._carried,
             new.th_global.clone())
    g = fn(comm.rank, steps_before, n)
    before = new.residual.clone()
    out = new(g)
    return old, taken, before + g, out, new.residual.clone(), new.region_offsets.clone()


@pytest.mark.parametrize("mode", ["rank", "region"])
def test_oktopk_take_over_carries_the_regions(mode):
    """A density stage goes on from the regions the last stage balanced (not equal ones), with
    the rank mode's steered row target rescaled to the new k; the first step calibrates on
    them, conserves and agrees across ranks (P = 3)."""
    P = 3
    res = LocalCluster(P).run(_carry_body, mode, 3)
    equal = torch.tensor([6000 * j // P for j in range(P + 1)])
    for old, (offs, target, carried, th), _, _, _, _ in res:
        assert carried and torch.equal(offs, old.region_offsets)
        assert th > 0 and torch.equal(th, old.th_global)
        assert not torch.equal(offs, equal)            # the hot spots moved them
        if mode == "rank":
            torch.testing.assert_close(target, old.row_target * 0.4)
    outs = [r[3] for r in res]
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert outs[0].count_nonzero() > 0
    acc = sum(r[2] for r in res)
    torch.testing.assert_close(acc, P * outs[0] + sum(r[4] for r in res), rtol=1e-5, atol=1e-5)


def test_oktopk_take_over_from_a_fresh_reducer_carries_no_regions():
    """Nothing to carry before the first step: equal regions, the new k's own target."""
    res = LocalCluster(3).run(_carry_body, "rank", 0)
    for old, (offs, target, carried, th), _, _, _, _ in res:
        assert not carried and th == 0
        assert torch.equal(offs, torch.tensor([0, 2000, 4000, 6000]))
        assert torch.equal(target, torch.full((3,), 120.0))


def _switch_body(comm):
    """Ok-Topk at 2% for 8 steps on moving hot spots; then the 9th step three ways: continued,
    by a reducer at a density 0.06% higher that took over, and by the same with the regions and
    threshold a fresh reducer starts from (equal regions, 0)."""
    from conservation import moving_hotspots
    from oktopk_triton.algorithms.oktopk import OkTopk
    n, P, fn = 30_000, comm.world_size, moving_hotspots(1)
    base = OkTopk(n, comm, 0.02, wire_format="q2", backend="torch")
    for t in range(8):
        base(fn(comm.rank, t, n))
    sd, g, outs = base.state_dict(), fn(comm.rank, 8, n), {}
    for way in ("continued", "carried", "fresh"):
        old = OkTopk(n, comm, 0.02, wire_format="q2", backend="torch")
        old.load_state_dict(sd)
        alg = old
        if way != "continued":
            alg = OkTopk(n, comm, 0.02 * 1.0006, wire_format="q2", backend="torch")
            alg.take_over(old)
        if way == "fresh":
            alg.region_offsets.copy_(torch.tensor([n * j // P for j in range(P + 1)]))
            alg.th_global.zero_()
            alg._carried = False
        outs[way] = alg(g.clone()).clone()
    return outs


def test_oktopk_density_switch_goes_on_from_the_balance_reached():
    """The step after a switch to a nearly equal density delivers what the continued reducer
    does (P = 5); from equal regions it would deliver a different set, and less of it."""
    outs = LocalCluster(5).run(_switch_body)[0]
    ref = outs["continued"]
    dist = {w: float((outs[w] - ref).norm() / ref.norm()) for w in ("carried", "fresh")}
    assert dist["carried"] < 0.05 and dist["fresh"] > 0.3, dist
    assert outs["fresh"].count_nonzero() < ref.count_nonzero()
