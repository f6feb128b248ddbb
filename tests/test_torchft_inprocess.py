"""The torchft integration (oktopk_triton/integrations/torchft.py, comm/torchft.py) with its
replicas as threads of one process: every replica has a stand-in Manager whose process group is
a LocalCluster (tests/ftfakes.py). Real lighthouses and processes are
tests/test_torchft_integration.py's; here the logic is checked fast and exactly:

* ``ManagerCommunicator``'s primitives give what the cluster's own give, and count the bytes;
* ``SparseDiLoCo`` with ``SGD(lr=1)`` as the outer optimizer is bitwise the local-steps reduce
  (``SparseAllreduce(..., local_steps=LocalSteps(H)).reduce_updates``), every committed sync
  conserved (the audit), the replicas identical;
* a sync whose collective fails on every replica rolls back: no commit, what is owed restored,
  the next sync commits and the replicas agree again;
* a replica healed at its first quorum is a newcomer and owes nothing; one healed later keeps
  its unsynced change as owed;
* ``SparseGradients`` at density 1 gives every replica the average gradient.
"""
import threading

import pytest
import torch

pytest.importorskip("torchft")

from ftfakes import FakeManager  # noqa: E402

from oktopk_triton.comm import CommAborted, LocalCluster  # noqa: E402
from oktopk_triton.comm.torchft import ManagerCommunicator  # noqa: E402
from oktopk_triton.integrations.torchft import SparseDiLoCo, SparseGradients  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", False)


_INIT = threading.Lock()


def _model():
    """The same initial weights on every replica: the ranks are threads sharing torch's global
    generator, so one builds at a time."""
    with _INIT:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Tanh(),
                                   torch.nn.Linear(12, 3))


def _batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randint(0, 3, (6,), generator=g)


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_manager_communicator_primitives_match_the_cluster():
    def body(lc):
        m = FakeManager(lc, {})
        comm = ManagerCommunicator(m)
        assert comm.refresh() and comm.world_size == 3 and comm.device.type == "cpu"
        r, P = comm.rank, comm.world_size
        x = torch.arange(6, dtype=torch.float32) + 10 * r
        out = {}
        # send_recv: a ring, two transfers to the same peer (tags 0 and 1), a self pair and a
        # non-contiguous receive buffer
        nxt, prv = (r + 1) % P, (r - 1) % P
        a, b = torch.zeros(6), torch.zeros(3, 2).t()
        own = torch.zeros(6)
        comm.send_recv([(nxt, x), (nxt, x * 2), (r, x)], [(prv, a), (prv, b), (r, own)])
        out["recv"] = (a.clone(), b.clone(), own.clone())
        g = torch.zeros(6 * P)
        comm.allgather(g, x)
        out["gather"] = g
        t = x.clone()
        comm.allreduce(t)
        out["sum"] = t
        nc = torch.stack([x, x]).t()[:, 0]          # non-contiguous: reduced via a copy
        comm.allreduce(nc)
        out["sum_nc"] = nc.clone()
        y = torch.arange(6, dtype=torch.float32) + 100 * r
        z = torch.zeros(6)
        comm.alltoall(z, y)
        out["a2a"] = z
        comm.alltoall(y, y)                          # in place
        out["a2a_inplace"] = y
        bc = x.clone()
        comm.broadcast(bc, root=1)
        out["bcast"] = bc
        comm.barrier()
        out["bytes"] = comm.bytes_sent
        return out

    res = LocalCluster(3).run(body)
    xs = [torch.arange(6, dtype=torch.float32) + 10 * r for r in range(3)]
    for r, o in enumerate(res):
        prv = (r - 1) % 3
        assert torch.equal(o["recv"][0], xs[prv])
        assert torch.equal(o["recv"][1], (xs[prv] * 2).view(2, 3))
        assert torch.equal(o["recv"][2], xs[r])
        assert torch.equal(o["gather"], torch.cat(xs))
        assert torch.equal(o["sum"], sum(xs)) and torch.equal(o["sum_nc"], sum(xs))
        ys = [torch.arange(6, dtype=torch.float32) + 100 * q for q in range(3)]
        want = torch.cat([ys[q][2 * r:2 * r + 2] for q in range(3)])
        assert torch.equal(o["a2a"], want) and torch.equal(o["a2a_inplace"], want)
        assert torch.equal(o["bcast"], xs[1])
    # bytes: 2 sends of 24 B, allgather 2*24, two allreduces of 24 B (ring: 2*2/3*24),
    # an alltoall twice (2/3 of 24), the root's broadcast of 24 B
    base = 2 * 24 + 2 * 24 + 2 * (2 * 2 * 24 // 3) + 2 * (2 * 24 // 3)
    assert [o["bytes"] for o in res] == [base, base + 24, base]


def test_a_one_replica_quorum_runs_its_primitives_locally():
    def body(lc):
        comm = ManagerCommunicator(FakeManager(lc, {}))
        comm.refresh()
        x = torch.arange(4.0)
        g, a = torch.zeros(4), torch.zeros(4)
        comm.allgather(g, x)
        comm.alltoall(a, x)
        comm.barrier()
        comm.allreduce(x)
        return g, a, comm.bytes_sent
    g, a, sent = LocalCluster(1).run(body)[0]
    assert torch.equal(g, torch.arange(4.0)) and torch.equal(a, torch.arange(4.0)) and sent == 0


def test_a_failed_quorum_is_refused():
    class Errored(FakeManager):
        def errored(self):
            return RuntimeError("lighthouse gone")

    def body(lc):
        with pytest.raises(CommAborted, match="the quorum failed: lighthouse gone"):
            ManagerCommunicator(Errored(lc, {})).refresh()
    LocalCluster(1).run(body)


def _diloco_body(lc, H, syncs, fail_at=(), heal_at=None, shared=None, decay=None,
                 algorithm="oktopk"):
    m = FakeManager(lc, shared, fail_at=set(fail_at), heal_at=heal_at)
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    d = SparseDiLoCo(m, [model], inner, outer, sync_every=H, density=0.2, algorithm=algorithm,
                     residual_decay=decay, audit=True)
    weights, owed = [], []
    with d:
        for step in range(H * syncs):
            x, y = _batch(lc.rank, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            owed_before = d.reducer.residual.clone()
            inner.step()
            inner.zero_grad()
            if d.local_step == 0:
                weights.append(_flat(model))
                owed.append((owed_before, d.reducer.residual.clone()))
    return {"history": d.history, "weights": weights, "final": _flat(model), "owed": owed,
            "bytes": d.reducer.comm.bytes_sent, "committed": d.replica.committed,
            "anchor": torch.cat([a.reshape(-1) for a in d.anchor])}


def _reference_body(lc, H, syncs):
    from oktopk_triton.config import LocalSteps
    from oktopk_triton.module import SparseAllreduce
    model = _model()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    sar = SparseAllreduce(model, comm=lc, density=0.2, algorithm="oktopk",
                          local_steps=LocalSteps(sync_every=H))
    for step in range(H * syncs):
        x, y = _batch(lc.rank, step)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        sar.reduce_updates(inner)
        inner.zero_grad()
    return _flat(model)


def test_sparse_diloco_commits_every_sync_and_equals_the_local_steps_reduce():
    res = LocalCluster(2).run(_diloco_body, 2, 3, shared={})
    ref = LocalCluster(2).run(_reference_body, 2, 3)
    for r in res:
        assert [h["committed"] for h in r["history"]] == [True] * 3
        assert all(h["relative_error"] is not None and h["relative_error"] <= 1e-6
                   for h in r["history"])
        assert r["history"][0]["reconfigured"] and r["history"][0]["P"] == 2
        assert r["bytes"] > 0 and r["committed"] == 3
        assert torch.equal(r["final"], res[0]["final"])
        assert torch.equal(r["anchor"], r["final"])     # after a sync the anchor is the weights
    assert torch.equal(res[0]["final"], ref[0])


def test_a_failed_sync_rolls_back_on_every_replica_and_the_next_commits():
    # the process group's calls of a sync: the quorum's joined-flag allreduce (1), then the
    # reduce and the audit; call 8 falls inside the second sync
    shared = {}
    res = LocalCluster(2).run(_diloco_body, 2, 3, fail_at=(8,), shared=shared)
    for r in res:
        hist = r["history"]
        assert [h["committed"] for h in hist] == [True, False, True]
        assert "Connection reset by peer" in hist[1]["error"]
        assert not hist[0]["error"] and not hist[2]["error"]
        # rolled back: what is owed is what was owed before the sync
        before, after = r["owed"][1]
        assert torch.equal(before, after)
        assert torch.equal(r["final"], res[0]["final"])
        assert r["committed"] == 2


@pytest.mark.parametrize("wire", ["fp32", "compact", "q2", "q4"])
def test_algorithm_objects_with_every_wire_format_commit_conserved(wire):
    from oktopk_triton.config import OkTopk
    # call 4 falls inside the first sync's reduce, between a point-to-point send and its
    # receive on Ok-Topk's exchange
    res = LocalCluster(2).run(_diloco_body, 2, 3, shared={}, fail_at=(4,),
                              algorithm=OkTopk(wire_format=wire))
    for r in res:
        assert [h["committed"] for h in r["history"]] == [False, True, True]
        assert all(h["relative_error"] <= 1e-6 for h in r["history"] if h["committed"])
        assert torch.equal(r["final"], res[0]["final"])


def test_a_decayed_residual_is_audited_and_a_failed_sync_undoes_the_decay():
    res = LocalCluster(2).run(_diloco_body, 2, 3, fail_at=(8,), shared={}, decay=0.5)
    for r in res:
        assert [h["committed"] for h in r["history"]] == [True, False, True]
        assert all(h["relative_error"] <= 1e-6 for h in r["history"] if h["committed"])
        before, after = r["owed"][1]           # rolled back: not even the decay stays
        assert torch.equal(before, after)
        assert torch.equal(r["final"], res[0]["final"])


def _nesterov_body(lc, algorithm, syncs, H=8):
    """DiLoCo's outer optimizer (SGD 0.7, Nesterov 0.9) with AdamW inside, on a synthetic
    task: the final loss on the whole task."""
    from tools.research.outer_optimizer import _task
    with _INIT:                # the task's teacher draws from the global generator too
        x, y, model = _task(0)
    gen = torch.Generator().manual_seed(lc.rank)
    inner = torch.optim.AdamW(model.parameters(), lr=3e-3)
    outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    kw = {} if algorithm == "preset" else dict(density=1.0, algorithm="dense")
    with SparseDiLoCo(FakeManager(lc, {}), [model], inner, outer, sync_every=H, **kw):
        for _ in range(H * syncs):
            idx = torch.randint(0, len(x), (32,), generator=gen)
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            inner.step()
            inner.zero_grad()
    with torch.no_grad():
        return torch.nn.functional.cross_entropy(model(x), y).item()


def test_dilocos_nesterov_outer_optimizer_learns_over_the_sparse_preset(monkeypatch):
    """The DiLoCo user's optimizer over the default preset (1/10 of the bytes): served at
    momentum 0.5 it learns, ends within 10% of dense DiLoCo with the same optimizer, and well
    below the same run with momentum 0.9 as given (the cap lifted)."""
    import oktopk_triton.outer as outer
    sparse = LocalCluster(3).run(_nesterov_body, "preset", 16)
    dense = LocalCluster(3).run(_nesterov_body, "dense", 16)
    monkeypatch.setattr(outer, "MOMENTUM_CAP", 0.99)
    as_given = LocalCluster(3).run(_nesterov_body, "preset", 16)
    assert len(set(sparse)) == 1 and len(set(dense)) == 1          # the replicas agree
    assert sparse[0] < 0.7 * 3.0 and sparse[0] <= 1.1 * dense[0], (sparse[0], dense[0])
    assert sparse[0] <= 0.9 * as_given[0], (sparse[0], as_given[0])


def test_a_replica_healed_at_its_first_quorum_is_a_newcomer_and_one_healed_later_is_not():
    shared = {}
    res = LocalCluster(2).run(_diloco_body, 2, 3, heal_at={0: (0, 1), 2: (0, 1)},
                              shared=shared)
    h1 = res[1]["history"]
    assert h1[0]["healed"] and h1[0]["newcomer"] and h1[0]["reconfigured"]
    assert h1[2]["healed"] and not h1[2]["newcomer"]
    assert not any(h["healed"] for h in res[0]["history"])
    assert all(h["committed"] for r in res for h in r["history"])
    assert all(h["relative_error"] <= 1e-6 for r in res for h in r["history"])
    assert torch.equal(res[0]["final"], res[1]["final"])


def test_sparse_gradients_at_density_one_gives_every_replica_the_average():
    def body(lc):
        m = FakeManager(lc, {})
        model = _model()
        ft = SparseGradients(m, model, density=1.0, algorithm="topka", audit=True)
        out = []
        for step in range(2):
            x, y = _batch(lc.rank, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            mine = torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])
            assert ft.reduce()
            got = torch.cat([p.grad.reshape(-1).clone() for p in model.parameters()])
            out.append((mine, got))
            model.zero_grad()
        return out, ft.history
    res = LocalCluster(2).run(body)
    for step in range(2):
        avg = (res[0][0][step][0] + res[1][0][step][0]) / 2
        for r in range(2):
            torch.testing.assert_close(res[r][0][step][1], avg, rtol=1e-6, atol=1e-7)
    assert all(h["committed"] for h in res[0][1])


def test_sparse_gradients_rolls_back_a_failed_step():
    def body(lc):
        m = FakeManager(lc, {}, fail_at={1})        # the first reduce's first collective
        model = _model()
        ft = SparseGradients(m, model, density=0.3, algorithm="oktopk")
        x, y = _batch(lc.rank, 0)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        mine = [p.grad.clone() for p in model.parameters()]
        ok = ft.reduce()
        kept = all(torch.equal(p.grad, g) for p, g in zip(model.parameters(), mine))
        owed = float(ft.reducer.residual.abs().sum())
        return ok, kept, owed, ft.history[-1]
    for ok, kept, owed, rec in LocalCluster(2).run(body):
        assert not ok and kept and owed == 0.0
        assert not rec["committed"] and "Connection reset" in rec["error"]


# -- Streaming DiLoCo: fragments ----------------------------------------------------------------
def _stream_body(lc, H, cycles, delay=0, alpha=0.0, fail_at=(), heal_at=None, shared=None):
    m = FakeManager(lc, shared if shared is not None else {}, fail_at=set(fail_at),
                    heal_at=heal_at)
    with _INIT:
        torch.manual_seed(0)
        frags = [torch.nn.Linear(8, 12), torch.nn.Sequential(torch.nn.Tanh(),
                                                             torch.nn.Linear(12, 3))]
    model = torch.nn.Sequential(*frags)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = torch.optim.SGD(model.parameters(), lr=1.0)
    d = SparseDiLoCo(m, frags, inner, outer, sync_every=H, fragment_sync_delay=delay,
                     fragment_update_alpha=alpha, density=0.2, algorithm="oktopk", audit=True)
    threads = []
    with d:
        for step in range(H * cycles):
            x, y = _batch(lc.rank, step)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            inner.step()
            inner.zero_grad()
            if d._work is not None and "thread" in d._work:
                threads.append(d._work["thread"].name)
    return {"history": d.history, "threads": threads, "final": _flat(model),
            "anchor": torch.cat([a.reshape(-1) for a in d.anchor]),
            "owed": [s.residual.clone() for s in d.replica.sars]}


@pytest.mark.parametrize("delay,alpha", [(0, 0.0), (1, 0.0), (1, 0.5)])
def test_fragments_sync_in_turn_conserved_and_alike(delay, alpha):
    res = LocalCluster(2).run(_stream_body, 4, 3, delay, alpha)
    for r in res:
        hist = r["history"]
        assert [h["fragment"] for h in hist] == [0, 1] * 3      # one fragment every H/F steps
        assert all(h["committed"] and h["relative_error"] <= 1e-6 for h in hist)
        assert torch.equal(r["anchor"], res[0]["anchor"])       # the common weights agree
        # with a delay the reduce ran on its own thread while an inner step went on
        assert (len(r["threads"]) > 0) == (delay > 0)
    if alpha == 0.0:      # the last fragment synced last: its weights are the common ones
        assert torch.equal(res[0]["final"][-39:], res[1]["final"][-39:])


def test_a_failed_fragment_sync_rolls_back_and_the_same_fragment_retries():
    res = LocalCluster(2).run(_stream_body, 4, 3, 1, 0.0, (8,))
    for r in res:
        hist = r["history"]
        assert [h["committed"] for h in hist] == [True, False, True, True, True, True]
        assert [h["fragment"] for h in hist] == [0, 1, 1, 0, 1, 0]
        assert all(h["relative_error"] <= 1e-6 for h in hist if h["committed"])
        assert torch.equal(r["anchor"], res[0]["anchor"])


def test_a_replica_healed_in_a_fragment_sync_restarts_every_fragment_and_owes_nothing():
    res = LocalCluster(2).run(_stream_body, 4, 3, 1, 0.0, (), {0: (0, 1), 3: (0, 1)}, {})
    h1 = res[1]["history"]
    assert h1[0]["healed"] and h1[0]["newcomer"] and h1[0]["reconfigured"]
    assert h1[3]["healed"] and not h1[3]["newcomer"]   # fell behind: keeps what it owes
    assert not any(h["healed"] for h in res[0]["history"])
    assert all(h["committed"] and h["relative_error"] <= 1e-6 for r in res for h in r["history"])
    assert torch.equal(res[0]["anchor"], res[1]["anchor"])
