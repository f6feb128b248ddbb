"""SparseAllreduce.reconfigure: a change of membership inside a run. Four thread ranks step,
rank 3 leaves (the others switch to a 3-rank group and keep what they owe), they step on with
conservation over the new group, then rank 3 joins again with ``joined=True`` and owes nothing;
``out`` stays bitwise identical on every member and a running audit stays meaningful."""
import pytest
import torch

from oktopk_triton import SparseAllreduce
from oktopk_triton.comm.local import LocalCluster

N, STEPS = 3000, 3


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", False)


def _grad(who, t):
    g = torch.Generator().manual_seed(1000 * who + t)
    return torch.randn(N, generator=g) * (1 + who) + (t % 3 == who % 3) * 3.0


def _steps(sar, who, first):
    """STEPS steps; per step (acc, out, residual after) of this rank."""
    rec = []
    alg = sar.algorithm
    for t in range(first, first + STEPS):
        g = _grad(who, t)
        u = g if alg.velocity is None else alg.velocity * alg.momentum + g
        acc = sar.residual.double() + u.double()
        out = sar(g)
        rec.append((acc, out.clone(), sar.residual.double().clone()))
    return rec


def _owed(sar):
    alg = sar.algorithm
    signs = getattr(alg, "_signs", None)
    return (sar.residual.clone(), None if alg.velocity is None else alg.velocity.clone(),
            None if signs is None else signs.clone(), sar.step_count)


def _member(comm, alg, options, three, four):
    who = comm.rank
    sar = SparseAllreduce(N, comm, density=0.02, algorithm=alg, **options)
    ledger = sar.audit()
    phases = {"four": _steps(sar, who, 0)}
    before = _owed(sar)
    if who != 3:                       # rank 3 left: the others go on as a 3-rank group,
        # through the same communicator object, its rank and world size changed in place (as
        # a torchft Manager's after a new quorum)
        comm.cluster, comm.world_size, comm._seq = three, 3, 0
        sar.reconfigure(comm)
        after = _owed(sar)
        phases["three"] = _steps(sar, who, STEPS)
        before = _owed(sar)
    else:
        after = None
    sar.reconfigure(four.communicator(who), joined=who == 3)
    joined = _owed(sar)
    phases["again"] = _steps(sar, who, 2 * STEPS)
    return phases, before, after, joined, ledger.check(), sar.algorithm.P


def _conserved(recs):
    """Σ acc == P·out + Σ residual' on every step of the members' records; out agrees."""
    P = len(recs)
    for t in range(len(recs[0])):
        outs = [r[t][1] for r in recs]
        assert all(torch.equal(o, outs[0]) for o in outs), t
        acc = sum(r[t][0] for r in recs)
        res = sum(r[t][2] for r in recs)
        err = (acc - P * outs[0].double() - res).abs()
        scale = sum(r[t][0].abs() for r in recs) + P * outs[0].double().abs()
        assert bool((err <= 1e-6 * scale + 1e-12).all()), (t, float(err.max()))
        assert float(outs[0].abs().sum()) > 0


CASES = [("oktopk", {"consistency": 0.9, "momentum": 0.9}),
         ("oktopk", {"consistency": 0.9, "wire_format": "compact"}),
         ("topka", {}), ("gtopk", {}), ("dense", {})]


@pytest.mark.parametrize("alg,options", CASES, ids=[f"{a}-{o.get('wire_format', 'fp32')}"
                                                    for a, o in CASES])
def test_leave_and_join(alg, options):
    three, four = LocalCluster(3, timeout=30), LocalCluster(4, timeout=30)
    res = LocalCluster(4, timeout=30).run(_member, alg, options, three, four)
    _conserved([r[0]["four"] for r in res])
    _conserved([r[0]["three"] for r in res[:3]])
    _conserved([r[0]["again"] for r in res])
    for who, (_, before, after, joined, check, P) in enumerate(res):
        assert P == 4
        if who < 3:          # a survivor keeps what it owes, its velocity and sign EMA
            for a, b in zip(before, joined):
                assert (a is None and b is None) or (a == b if isinstance(a, int)
                                                     else torch.equal(a, b))
            assert after[3] == STEPS
            if alg != "dense":
                assert float(joined[0].abs().sum()) > 0
        else:                # the one that joined owes nothing, keeps its step count
            assert all(t is None or float(t.abs().sum()) == 0 for t in joined[:3])
            assert joined[3] == before[3] == STEPS
        # the audit was rebased at each change: it checks the last group's epoch
        assert check["checked"] and check["relative_error"] < 1e-6, check
        assert check["calls"] == (3 * STEPS if who < 3 else 2 * STEPS)


def _mixed_numel(comm, group):
    from oktopk_triton.comm.local import SingleCommunicator
    n = N + (1 if comm.rank == 1 else 0)
    sar = SparseAllreduce(n, SingleCommunicator(), density=0.02)
    sar(_grad(comm.rank, 0)[:1].expand(n).contiguous())
    owed = sar.residual.clone()
    try:
        sar.reconfigure(group.communicator(comm.rank))
    except ValueError as e:
        return str(e), torch.equal(owed, sar.residual), sar.algorithm.P
    return None, True, sar.algorithm.P


def test_another_numel_is_refused_on_every_member():
    group = LocalCluster(2, timeout=30)
    for err, kept, P in LocalCluster(2, timeout=30).run(_mixed_numel, group):
        assert err is not None and "\n" not in err and "numel per rank = [3000, 3001]" in err
        assert kept and P == 1          # the reducer is left as it was


def test_joined_must_be_a_bool():
    from oktopk_triton.comm.local import SingleCommunicator
    sar = SparseAllreduce(100, SingleCommunicator(), density=0.1)
    with pytest.raises(TypeError, match="joined must be True or False"):
        sar.reconfigure(SingleCommunicator(), joined="yes")


def _hook_state(comm, three):
    """The DDP hook's state, its flat reducer driven directly (no DDP: the reducer is what
    reconfigure rebuilds)."""
    from oktopk_triton.ddp import SparseAllreduceState
    state = SparseAllreduceState(density=0.02, comm=comm, momentum=0.9)
    buf = torch.empty(N)
    for t in range(STEPS):
        state.reducer(-1, buf)(_grad(comm.rank, t))
    owed = _owed_alg(state.reducers[-1])
    if comm.rank == 3:
        return owed, None, None
    state.reconfigure(comm=three.communicator(comm.rank))
    red = state.reducer(-1, buf)
    kept = _owed_alg(red)
    rec = []
    for t in range(STEPS, 2 * STEPS):
        g = _grad(comm.rank, t)
        acc = red.residual.double() + red.velocity.double() * red.momentum + g.double()
        out = red(g)
        rec.append((acc, out.clone(), red.residual.double().clone()))
    return owed, kept, (rec, red.P)


def _owed_alg(alg):
    return alg.residual.clone(), alg.velocity.clone(), alg.step_count


def test_ddp_hook_state_reconfigures():
    three = LocalCluster(3, timeout=30)
    res = LocalCluster(4, timeout=30).run(_hook_state, three)
    for owed, kept, _ in res[:3]:
        assert torch.equal(owed[0], kept[0]) and torch.equal(owed[1], kept[1])
        assert kept[2] == owed[2] == STEPS and float(owed[0].abs().sum()) > 0
    assert all(r[2][1] == 3 for r in res[:3])
    _conserved([r[2][0] for r in res[:3]])
