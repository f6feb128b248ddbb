"""The DDP hook (oktopk_triton/ddp/: the hook, flat.py, bucket.py, reduce.py) in this
process, on a gloo group of one rank (the multi-rank behaviour is tests/test_ddp*.py's, in
pooled ranks).

At P = 1 an average is the gradient itself, so the checks are exact:

* density 1: the hook's training equals plain DDP's, in both modes;
* density < 1, for every way DDP is driven here (unused branches, ``no_sync``, ``static_graph``
  with its bucket rebuild): nothing is lost, ``fed == sum of p.grad + residual`` per parameter;
  unused parameters are held out; bucket mode's groups follow DDP's rebuilt buckets;
* a saved state restores every residual (placed by the bound model before the first backward);
* ``reconfigure`` carries what is owed into the rebuilt reducers; ``joined=True`` drops it;
* the refusals (a per-parameter reducer, a foreign tensor, a mismatched saved state).

The group is created and destroyed around each test (``gloo1``).
"""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from oktopk_triton.ddp import SparseAllreduceState, sparse_allreduce_hook
from test_ddp_modes import _Branchy as _ModesBranchy
from test_ddp_modes import _Recorder




class _Branchy(_ModesBranchy):
    """test_ddp_modes' model with unused branches, as rank 0 runs it."""

    def forward(self, x, step: int, alternate: bool = True):
        return super().forward(x, step, 0, alternate)


def _data(step, micro=0):
    g = torch.Generator().manual_seed(10 * step + micro)
    return torch.randn(8, 12, generator=g), torch.randint(0, 6, (8,), generator=g)


def _run(case, mode, alg="oktopk", density=0.1, steps=4):
    torch.manual_seed(0)
    model = _Branchy()
    kw = dict(bucket_cap_mb=0.0002)
    if case == "static_graph":
        kw["static_graph"] = True
    else:
        kw["find_unused_parameters"] = True
    ddp = DDP(model, **kw)
    state = SparseAllreduceState(density=density, algorithm=alg, mode=mode)
    rec = _Recorder()
    ddp.register_comm_hook(state, rec.hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    params = list(model.parameters())
    reached = [torch.zeros(p.shape, dtype=torch.float64) for p in params]
    alternate = case != "static_graph"
    for i in range(steps):
        opt.zero_grad()
        if case == "no_sync":
            with ddp.no_sync():
                x, y = _data(i, 1)
                F.cross_entropy(ddp(x, i + 1), y).backward()
        x, y = _data(i)
        F.cross_entropy(ddp(x, i, alternate), y).backward()
        for r, p in zip(reached, params):
            if p.grad is not None:
                r += p.grad.double()
        opt.step()
    return ddp, state, rec, params, reached


def _assert_conserved(state, rec, params, reached):
    for i, p in enumerate(params):
        fed = rec.fed.get(id(p), torch.zeros(p.shape, dtype=torch.float64))
        owed = state.residual(p).double()
        torch.testing.assert_close(fed, reached[i] + owed, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("mode", ["flat", "bucket"])
def test_density_one_trains_exactly_as_plain_ddp(gloo1, mode):
    def train(hooked):
        torch.manual_seed(3)
        ddp = DDP(torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.Tanh(),
                                      torch.nn.Linear(16, 6)), bucket_cap_mb=0.0002)
        state = None
        if hooked:
            state = SparseAllreduceState(density=1.0, algorithm="topka", mode=mode)
            ddp.register_comm_hook(state, sparse_allreduce_hook)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
        for i in range(4):
            opt.zero_grad()
            x, y = _data(i)
            y = y % 6
            F.cross_entropy(ddp(x), y).backward()
            opt.step()
        return torch.cat([p.detach().reshape(-1) for p in ddp.parameters()]), state

    ref, _ = train(False)
    got, state = train(True)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-7)
    assert state.iter == 4 and state.bytes_sent == 0 and state.total_bytes_sent == 0
    assert len(state.reducers) == (1 if mode == "flat" else len(state.layout.groups))
    if mode == "bucket":
        assert len(state.layout.groups) >= 2           # small buckets: several groups


@pytest.mark.parametrize("mode", ["flat", "bucket"])
@pytest.mark.parametrize("case", ["alternate", "no_sync", "static_graph"])
def test_nothing_owed_is_lost_however_ddp_is_driven(gloo1, mode, case):
    ddp, state, rec, params, reached = _run(case, mode)
    _assert_conserved(state, rec, params, reached)
    assert state.iter == 4
    assert sum(float(state.residual(p).abs().sum()) for p in params) > 0   # sparse: owes
    if case != "static_graph":
        assert state.held_out >= 1                    # a branch and `never` went unused
    if mode == "bucket" and case == "static_graph":
        # the groups are DDP's buckets of the last iteration (after its rebuild)
        index = {id(p): i for i, p in enumerate(params)}
        canon = {state.layout.index[id(p)]: index[id(p)] for p in params
                 if id(p) in state.layout.index}
        groups = sorted(tuple(sorted(canon[c] for c in g)) for g in state.layout.groups)
        buckets = sorted(tuple(sorted(index[pid] for pid in b)) for b in rec.buckets)
        assert groups == buckets and len(groups) >= 2


@pytest.mark.parametrize("mode", ["flat", "bucket"])
def test_a_saved_state_restores_every_residual_before_the_first_backward(gloo1, tmp_path,
                                                                         mode):
    ddp, state, rec, params, reached = _run("static_graph", mode, steps=3)
    owed = [state.residual(p).detach().clone() for p in params]
    path = state.save(str(tmp_path))
    assert path.endswith("oktopk-rank0-of1.pt")
    assert state.fingerprint()["group_size"] == 1

    torch.manual_seed(0)
    model2 = _Branchy()
    ddp2 = DDP(model2, bucket_cap_mb=0.0002, static_graph=True)
    fresh = SparseAllreduceState(density=0.1, algorithm="oktopk", mode=mode)
    with pytest.raises(ValueError, match="bind the DDP model"):
        fresh.load(str(tmp_path))           # loads; placing a residual needs the model bound
        fresh.residual(next(model2.parameters()))
    fresh = SparseAllreduceState(density=0.1, algorithm="oktopk", mode=mode)
    fresh.load(str(tmp_path), model=ddp2)
    assert fresh.iter == 3
    for p2, o in zip(model2.parameters(), owed):
        assert torch.equal(fresh.residual(p2), o)
    # saved straight after a load: every residual kept
    sd = fresh.state_dict()
    assert sd["iter"] == 3 and sd["mode"] == mode and len(sd["reducers"]) >= 1
    # the run goes on from there (the loaded reducers are built at the first backward)
    ddp2.register_comm_hook(fresh, sparse_allreduce_hook)
    x, y = _data(9)
    F.cross_entropy(ddp2(x, 9, False), y).backward()
    assert fresh.iter == 4 and fresh.reducers


def test_load_state_dict_refuses_another_algorithm_mode_or_no_layout(gloo1):
    s = SparseAllreduceState(density=0.1, algorithm="oktopk", mode="flat")
    with pytest.raises(ValueError, match="saved with algorithm='topka'"):
        s.load_state_dict({"algorithm": "topka", "iter": 0})
    with pytest.raises(ValueError, match="saved with mode='bucket'"):
        s.load_state_dict({"mode": "bucket", "iter": 0})
    with pytest.raises(ValueError, match="no parameter layout"):
        s.load_state_dict({"iter": 0})
    # before anything was seen or loaded a residual is zeros of the parameter's shape
    w = torch.nn.Linear(3, 2).weight
    assert torch.equal(s.residual(w), torch.zeros(2, 3))


def test_residual_refuses_a_tensor_the_hook_never_saw(gloo1):
    ddp, state, rec, params, reached = _run("alternate", "flat", steps=2)
    with pytest.raises(ValueError, match="not a parameter the hook has seen"):
        state.residual(torch.zeros(3))


@pytest.mark.parametrize("mode", ["flat", "bucket"])
def test_reconfigure_carries_what_is_owed_and_joined_drops_it(gloo1, mode):
    ddp, state, rec, params, reached = _run("static_graph", mode, steps=3)
    owed_before = sum(float(state.residual(p).double().sum()) for p in params)
    assert owed_before != 0
    with pytest.raises(TypeError, match="joined must be True or False"):
        state.reconfigure(None, joined="yes")
    state.reconfigure(None)                   # the same group again: owes what it owed
    assert state.reducers == {} and state._carried
    with pytest.raises(ValueError, match="reconfigured"):
        state.state_dict()
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    opt.zero_grad()
    x, y = _data(7)
    F.cross_entropy(ddp(x, 7, False), y).backward()
    for r, p in zip(reached, params):
        if p.grad is not None:
            r += p.grad.double()
    _assert_conserved(state, rec, params, reached)          # nothing dropped across it
    assert state._carried == {} and state.iter == 4

    state.reconfigure(None, joined=True)      # a newcomer owes nothing
    assert state.reducers == {} and state._carried == {}
    opt.zero_grad()
    x, y = _data(8)
    F.cross_entropy(ddp(x, 8, False), y).backward()
    red = next(iter(state.reducers.values()))
    assert red.step_count == 1                 # fresh reducers: nothing carried over


def test_a_loaded_state_refuses_reconfigure_and_a_per_parameter_reducer(gloo1):
    s = SparseAllreduceState(density=0.1, algorithm="oktopk")
    s._pending_state = {-1: {}}
    with pytest.raises(ValueError, match="load it at the new world size"):
        s.reconfigure(None)
    with pytest.raises(RuntimeError, match="once per parameter"):
        sparse_allreduce_hook(s, (torch.zeros(2), torch.zeros(2)))


def test_bucket_mode_stays_dense_until_it_has_groups(gloo1):
    """A bucket-mode state loaded before its first sparse iteration has no groups: the first
    iteration it sees is dense (DDP's own average), the next one builds the groups."""
    torch.manual_seed(0)
    ddp = DDP(_Branchy(), bucket_cap_mb=0.0002, static_graph=True)
    state = SparseAllreduceState(density=0.1, algorithm="topka", mode="bucket")
    state.iter = 5                             # as if loaded past start_iter
    ddp.register_comm_hook(state, sparse_allreduce_hook)
    x, y = _data(0)
    F.cross_entropy(ddp(x, 0, False), y).backward()
    assert state.layout.groups is None and state.reducers == {}
    F.cross_entropy(ddp(x, 1, False), y).backward()
    assert state.layout.groups and state.reducers
