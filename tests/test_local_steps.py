"""Local steps of SparseAllreduce.reduce_updates (oktopk_triton/modes/local_steps.py): conservation
in update space with the decay's bookkeeping, replicas identical after every sync and free between
syncs, sync_every=1 equal to plain reduce_updates bit for bit, resume in the middle of an
interval, a NaN at a sync, refused combinations and values."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from conservation import flat as _flat
from conservation import host_syncs_raise, toy_calls, whole_and_resumed
from conservation import toy_model as _model
from distutil import run_pooled_torch
from oktopk_triton import SparseAllreduce
from oktopk_triton.algorithms import SPARSE_ALGORITHMS
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.modes.local_steps import LocalSteps

ALL = ("dense",) + tuple(SPARSE_ALGORITHMS)


def _opts(alg):
    return {"backend": "torch"} if alg == "oktopk" else {}


def _backward(m, gen):
    m(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()


# -- conservation, replicas, the outer step, stats: every algorithm ---------------------------
def _interval_body(comm, alg, H, calls, lr, mom, decay):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.02)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.1, algorithm=alg, sync_every=H,
                          outer_lr=lr, outer_momentum=mom, residual_decay=decay, **_opts(alg))
    ls = sar.local_steps
    fed = {}

    def after_step(*_):      # the pseudo-gradient the sync will reduce: weights - anchor
        if ls.position + 1 == H:
            fed["delta"] = _flat(m.parameters()) - _flat(ls.anchor)
    opt.register_step_post_hook(after_step)
    gen = torch.Generator().manual_seed(50 + comm.rank)
    n = sar.numel
    sum_fed, sum_out, decayed = (torch.zeros(n, dtype=torch.float64) for _ in range(3))
    v = torch.zeros(n)
    synced_weights, local_weights, moved_by_step, stats = [], [], [], []
    for _ in range(calls):
        opt.zero_grad()
        _backward(m, gen)
        anchor = _flat(ls.anchor) if ls.anchor is not None else _flat(m.parameters())
        res_before = sar.residual.clone()
        out = sar.reduce_updates(opt)
        st = sar.stats
        stats.append((bool(st["synced"]), int(st["bytes_sent"]), float(st["bytes_per_step"]),
                      int((out != 0).sum())))
        w = _flat(m.parameters())
        if not st["synced"]:
            local_weights.append(w)
            continue
        synced_weights.append(w)
        sum_fed += fed["delta"].double()
        sum_out += out.double()
        decayed += res_before.double() - (res_before * decay).double()
        v = v * mom + out if mom else v         # the documented Nesterov rule, replayed here
        step = (out + v * mom) * lr if mom else out * lr
        moved_by_step.append(torch.equal(w, anchor + step))
    return (sum_fed, sum_out, decayed, sar.residual.double(), synced_weights, local_weights,
            moved_by_step, stats, sar.step_count)


@pytest.mark.parametrize("alg", ALL)
def test_intervals_conserve_and_sync_replicas(alg):
    P, H, calls = 3, 3, 10
    res = LocalCluster(P).run(_interval_body, alg, H, calls, 0.8, 0.5, 0.9)
    # conservation in update space: fed = P*out + residuals' + what the decay dropped
    lhs = sum(r[0] for r in res)
    rhs = P * res[0][1] + sum(r[3] for r in res) + sum(r[2] for r in res)
    assert torch.allclose(lhs, rhs, rtol=0, atol=1e-5), (lhs - rhs).abs().max()
    assert res[0][1].abs().sum() > 0
    if alg != "dense":
        assert sum(r[3] for r in res).abs().sum() > 0 and sum(r[2] for r in res).abs().sum() > 0
    for r in res:
        assert len(r[4]) == calls // H and r[8] == calls // H     # syncs = algorithm steps
        assert all(r[6])                                       # weights = anchor + outer step
        for i, (synced, sent, per_step, nnz) in enumerate(r[7]):
            assert synced == ((i + 1) % H == 0)
            if synced:
                assert sent > 0 and per_step == sent / H
            else:
                assert sent == 0 and per_step == 0 and nnz == 0
    for t in range(calls // H):                       # replicas bitwise identical at each sync
        assert all(torch.equal(res[0][4][t], r[4][t]) for r in res[1:])
    # between syncs each rank's weights are its own
    assert all(not torch.equal(res[0][5][t], res[1][5][t]) for t in range(len(res[0][5])))


# -- sync_every=1 is plain reduce_updates -----------------------------------------------------
def _h1_body(comm):
    def make():
        m = _model()
        return m, torch.optim.AdamW(m.parameters(), lr=0.02)
    (a, oa), (b, ob), (c, oc) = make(), make(), make()
    sa = SparseAllreduce(a.parameters(), comm=comm, density=0.1, sync_every=1, backend="torch")
    sb = SparseAllreduce(b.parameters(), comm=comm, density=0.1, backend="torch")
    sb.local_steps = LocalSteps(sync_every=1)       # the local-steps path at H=1
    ref = SparseAllreduce(sum(p.numel() for p in c.parameters()), comm=comm, density=0.1,
                          backend="torch")
    gen = torch.Generator().manual_seed(comm.rank)
    same = []
    for _ in range(6):
        x = torch.randn(6, 8, generator=gen)
        for m, o in ((a, oa), (b, ob), (c, oc)):
            o.zero_grad()
            m(x).pow(2).mean().backward()
        out_a, out_b = sa.reduce_updates(oa), sb.reduce_updates(ob)
        with torch.no_grad():        # the rule written out: before + reduce(after - before)
            before = _flat(c.parameters()).clone()
            oc.step()
            out_c = ref(_flat(c.parameters()) - before)
            for p, w in zip(c.parameters(), (before + out_c).split(
                    [p.numel() for p in c.parameters()])):
                p.copy_(w.view(p.shape))
        wa, wb, wc = (_flat(m.parameters()) for m in (a, b, c))
        same.append(torch.equal(wa, wb) and torch.equal(wa, wc) and torch.equal(out_a, out_b)
                    and torch.equal(out_a, out_c) and torch.equal(sa.residual, sb.residual))
    return sa.local_steps is None, same


def test_sync_every_one_is_plain_reduce_updates():
    for plain, same in LocalCluster(3).run(_h1_body):
        assert plain and all(same)


# -- resume in the middle of an interval (gloo ranks, a density schedule) ----------------------
def _resume_body(comm, calls, cut):
    def make():
        m = _model(4)
        opt = torch.optim.AdamW(m.parameters(), lr=0.02)
        sar = SparseAllreduce(m.parameters(), comm=comm, density=0.1, algorithm="oktopk",
                              density_schedule=[(0, 0.3), (2, 0.1)], sync_every=4,
                              outer_lr=0.7, outer_momentum=0.6, residual_decay=0.9,
                              backend="torch")
        return m, opt, sar

    def run(m, opt, sar, first, last):
        toy_calls(comm.rank, m, opt, sar, first, last)

    whole, resumed, mid = whole_and_resumed(make, run, calls, cut,
                                            at_load=lambda r: r[2].local_steps.position)
    w, r = _flat(whole[0].parameters()), _flat(resumed[0].parameters())
    return (mid, torch.equal(w, r), torch.equal(whole[2].residual, resumed[2].residual),
            whole[2].algorithm.density, w)


def test_resume_mid_interval_continues_bit_for_bit():
    # the ranks run the torch kernels (not the Triton interpreter conftest turns on: ~10x slower)
    res = run_pooled_torch(3, _resume_body, 16, 6)      # cut after 6 calls: 2 into the 2nd interval
    for mid, same_w, same_r, density, _ in res:
        assert mid == 2 and same_w and same_r
        assert density == 0.1                       # the schedule reached its last stage
    assert all(torch.equal(res[0][4], r[4]) for r in res[1:])   # 16 calls end on a sync


def _state_errors_body(comm):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.2, sync_every=3, backend="torch")
    m(torch.randn(2, 8)).sum().backward()
    sar.reduce_updates(opt)                            # mid-interval: position 1
    sd = sar.state_dict()
    errors = []
    for other in (dict(), dict(sync_every=1, outer_lr=0.5)):
        fresh = SparseAllreduce(m.parameters(), comm=comm, density=0.2, backend="torch", **other)
        try:
            fresh.load_state_dict(sd)
            errors.append("")
        except ValueError as e:
            errors.append(str(e))
    return errors


def test_mid_interval_state_refused_by_a_reducer_without_the_interval():
    errors = LocalCluster(1).run(_state_errors_body)[0]
    assert "local steps" in errors[0] and "sync_every=3" in errors[0]
    assert "interval position 1" in errors[1] and "sync_every=1" in errors[1]


# -- a NaN at a sync, a GradScaler skipping a local step -----------------------------------------
def _nan_body(comm):
    m = _model(5)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.1, algorithm="oktopk",
                          sync_every=3, outer_momentum=0.5, residual_decay=0.9, backend="torch")
    scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
    gen = torch.Generator().manual_seed(7 + comm.rank)
    ls, log = sar.local_steps, {}
    for t in range(9):
        opt.zero_grad()
        scaler.scale(m(torch.randn(6, 8, generator=gen)).pow(2).mean()).backward()
        if comm.rank == 1 and t in (3, 5):        # 3: a local step, 5: the sync
            next(m.parameters()).grad[0, 0] = float("nan")
        use = scaler if t != 5 else None          # at 5 the NaN reaches the weights
        if t == 5:
            scaler.unscale_(opt)
            anchor = _flat(ls.anchor)
            resid, vel = sar.residual.clone(), ls.velocity.clone()
        sar.reduce_updates(opt, scaler=use)
        if use is not None:
            scaler.update()
        else:
            scaler = torch.amp.GradScaler("cpu", init_scale=256.0)
        w = _flat(m.parameters())
        if t == 5:
            log.update(nan_sync=bool(sar.stats["synced"]) and int(sar.stats["nonfinite"]) > 0,
                       at_anchor=torch.equal(w, anchor),
                       resid_kept=torch.equal(sar.residual, resid),
                       vel_kept=torch.equal(ls.velocity, vel),
                       anchor_kept=torch.equal(_flat(ls.anchor), anchor))
        log[t] = w
    return log


def test_nan_at_a_sync_returns_every_replica_to_the_anchor():
    res = LocalCluster(3).run(_nan_body)
    for r in res:
        assert r["nan_sync"] and r["at_anchor"] and r["resid_kept"] and r["vel_kept"]
        assert r["anchor_kept"]
    for t in (2, 5, 8):              # every sync: identical replicas, finite weights
        assert all(torch.equal(res[0][t], r[t]) for r in res[1:])
        assert torch.isfinite(res[0][t]).all()
    assert not torch.equal(res[0][8], res[0][5])      # training went on after the NaN sync


def _raise_body(comm):
    m = _model(5)
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.1, algorithm="oktopk",
                          sync_every=2, residual_decay=0.5, check_finite="raise",
                          backend="torch")
    gen = torch.Generator().manual_seed(comm.rank)
    for t in range(4):
        opt.zero_grad()
        _backward(m, gen)
        if t == 3 and comm.rank == 0:
            next(m.parameters()).grad[0, 0] = float("inf")
        resid = sar.residual.clone()
        try:
            sar.reduce_updates(opt)
        except FloatingPointError:
            return t, torch.equal(sar.residual, resid), sar.local_steps.position
    return None


def test_check_finite_raise_at_a_sync_keeps_the_residual():
    for r in LocalCluster(2).run(_raise_body):
        assert r == (3, True, 1)          # raised on every rank; the next call syncs again


def _cuda_sync_body(comm):
    dev = comm.device
    g = torch.Generator().manual_seed(1)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    with torch.no_grad():                           # identical weights on every rank
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    m = m.to(dev)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3, capturable=True)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.05, algorithm="oktopk",
                          sync_every=2, outer_momentum=0.5, residual_decay=0.9)
    xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(comm.rank * 10 + t))
          .to(dev) for t in range(8)]
    def call(x):
        opt.zero_grad(set_to_none=False)
        m(x).pow(2).mean().backward()
        sar.reduce_updates(opt)

    for x in xs[:4]:                # two syncs (calibration, velocity built), syncs allowed
        call(x)
    with host_syncs_raise(comm):    # steady local and sync calls
        for x in xs[4:]:
            call(x)
    return True


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_local_steps_never_sync():
    """Steady local and sync calls on CUDA under torch.cuda.set_sync_debug_mode('error')."""
    assert LocalCluster(2, device="cuda").run(_cuda_sync_body) == [True, True]


# -- refused ------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw, match", [
    (dict(sync_every=0), "sync_every must be a positive int"),
    (dict(sync_every=2.0), "sync_every must be a positive int"),
    (dict(sync_every=True), "sync_every must be a positive int"),
    (dict(outer_lr=0.0), "outer_lr must be a finite number > 0"),
    (dict(outer_lr=float("nan")), "outer_lr must be a finite number > 0"),
    (dict(outer_momentum=1.0), r"outer_momentum must be a number in \[0, 1\)"),
    (dict(outer_momentum=-0.1), r"outer_momentum must be a number in \[0, 1\)"),
    (dict(residual_decay=0.0), r"residual_decay must be a number in \(0, 1\]"),
    (dict(residual_decay=1.5), r"residual_decay must be a number in \(0, 1\]"),
    (dict(sync_every=2, adam="frozen", momentum=0.9), "adam='frozen'"),
])
def test_bad_values_refused(kw, match):
    with pytest.raises(ValueError, match=match) as e:
        SparseAllreduce(_model().parameters(), density=0.1, **kw)
    assert "\n" not in str(e.value)


def test_other_entry_points_refused():
    m = _model()
    sar = SparseAllreduce(m.parameters(), density=0.1, sync_every=2)
    m(torch.randn(2, 8)).sum().backward()
    for call in (sar.reduce_gradients, lambda: sar(torch.zeros(sar.numel)),
                 lambda: sar.reduce_adam(torch.optim.AdamW(m.parameters()))):
        with pytest.raises(RuntimeError, match="cannot take local steps.*reduce_updates"):
            call()
    with pytest.raises(ValueError, match="built from parameters"):
        SparseAllreduce(100, density=0.1, sync_every=2)
    from oktopk_triton.ddp import SparseAllreduceState
    with pytest.raises(ValueError, match="DDP hook cannot take local steps"):
        SparseAllreduceState(density=0.1, sync_every=4)


# -- what a call costs: dispatches counted on CPU (a TorchDispatchMode spy) ---------------------
class _Dispatches(TorchDispatchMode):
    """Counts op dispatches; records each op outside the algorithm's own step (``front``) and
    each op that allocates storage of ``numel`` elements or more (``allocs``)."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.count, self.front, self.allocs, self.inside = numel, 0, [], [], 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        if not self.inside:
            self.front.append(str(func))
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                if isinstance(t, torch.Tensor)}
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in seen and \
                    t.untyped_storage().nbytes() >= self.numel * t.element_size():
                self.allocs.append((str(func), "alg" if self.inside else "front"))
        return out


def _costs_body(comm, monkeypatch, H):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-3)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.05, sync_every=H,
                          backend="torch")
    spy = [None]
    alg_call = type(sar.algorithm).__call__

    def counted(self, *a, **k):              # the algorithm's own step is not the front's
        spy[0].inside += 1
        try:
            return alg_call(self, *a, **k)
        finally:
            spy[0].inside -= 1
    monkeypatch.setattr(type(sar.algorithm), "__call__", counted)
    x = torch.randn(16, 32)

    def call(fn):
        m(x).square().mean().backward()
        spy[0] = _Dispatches(sar.numel)
        with spy[0]:
            out = fn()
        opt.zero_grad()
        return spy[0], out
    for _ in range(2 * H):                   # warm: optimizer state, anchor, flat buffer
        call(lambda: sar.reduce_updates(opt))
    local, out1 = call(lambda: sar.reduce_updates(opt))
    assert not sar.stats["synced"]
    _, out2 = call(lambda: sar.reduce_updates(opt))
    bare, _ = call(opt.step)                 # the optimizer step alone, on the same state
    for _ in range(H - 3):
        call(lambda: sar.reduce_updates(opt))
    sync, _ = call(lambda: sar.reduce_updates(opt))
    assert sar.stats["synced"]
    return dict(local=local, bare=bare, sync=sync, out1=out1, out2=out2, numel=sar.numel)


def test_a_local_call_costs_the_optimizer_step(monkeypatch):
    """A non-sync call dispatches the optimizer step's ops and at most 5 more, allocates
    nothing of numel, and returns zeros that cost nothing: one persistent vector, read-only."""
    r = LocalCluster(1).run(_costs_body, monkeypatch, 4)[0]
    local, bare = r["local"], r["bare"]
    assert bare.count >= 10                     # the spy saw AdamW's foreach ops
    assert local.count <= bare.count + 5, (local.count, bare.count, local.front)
    assert local.allocs == [], local.allocs
    out1, out2 = r["out1"], r["out2"]
    assert out1 is out2 and out1.shape == (r["numel"],) and not bool(out1.any())
    with pytest.raises(RuntimeError):
        out1.add_(1.0)                          # a broadcast of one zero: writing is refused


def test_a_sync_adds_no_pass_of_its_own_for_the_nonfinite_check(monkeypatch):
    """Outside the algorithm's step a sync reads the algorithm's non-finite flag: no isfinite
    (its abs/ne/eq decomposition on CPU) and one n-sized temporary at most (the masked step)."""
    r = LocalCluster(1).run(_costs_body, monkeypatch, 4)[0]
    front = r["sync"].front
    assert "aten._foreach_sub_.List" in front        # the spy saw the front's own ops
    assert not any(op.startswith(("aten.isfinite", "aten.abs", "aten.isnan")) for op in front)
    allocs = r["sync"].allocs
    assert any(where == "alg" for _, where in allocs)   # the algorithm's own were seen
    assert [op for op, where in allocs if where == "front"] == ["aten.where.self"], allocs


def test_local_steps_take_cuda_graph():
    """cuda_graph=True with local steps is refused only for what it needs (a CUDA device), not
    for the local steps: every sync replays the captured step (tests/test_graph.py)."""
    kw = dict(density=0.1, sync_every=2, cuda_graph=True)
    if torch.cuda.is_available():
        sar = SparseAllreduce(_model().cuda().parameters(), **kw)
        assert sar.local_steps is not None and sar.parts.graph is not None
        return
    with pytest.raises(ValueError) as e:
        SparseAllreduce(_model().parameters(), **kw)
    assert "cuda" in str(e.value).lower() and "local steps" not in str(e.value)
