"""Every algorithm's ``schedule`` against the traffic a recording communicator really sees.

Each rank of a LocalCluster is wrapped in a recorder that logs every primitive call: its kind,
the bytes the communicator counted (``bytes_sent`` before and after), and for a send/recv batch
the bytes received, the messages and the distinct peers. A steady step's log must equal the
schedule call by call: kinds and counts exactly, bytes exactly for the static sizes, and within
the stated data-dependent part where there is one (TopkDSA's gather; exact again once its mode
and cap2 are passed).
"""
from __future__ import annotations

import pytest
import torch
from conservation import torch_kernels

from oktopk_triton.algorithms import REGISTRY, get_algorithm
from oktopk_triton.algorithms.schedule import CollectiveSpec, schedule_of
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.kernels import _dispatch

WORLD_SIZES = (2, 3, 4, 5, 8, 16)


class RecordingComm:
    """A communicator that forwards to ``inner`` and logs each primitive call."""

    def __init__(self, inner):
        self.inner = inner
        self.log = []

    def __getattr__(self, name):            # rank, world_size, device, bytes_sent, ...
        return getattr(self.inner, name)

    def _call(self, kind, fn, *args, **extra):
        before = self.inner.bytes_sent
        fn(*args)
        self.log.append(dict(kind=kind, bytes=self.inner.bytes_sent - before, **extra))

    def send_recv(self, sends, recvs):
        me = self.inner.rank
        out = [(p, t) for p, t in sends if p != me]
        inn = [(p, t) for p, t in recvs if p != me]
        self._call("send_recv", self.inner.send_recv, sends, recvs,
                   recv_bytes=sum(t.numel() * t.element_size() for _, t in inn),
                   rounds=max(len(out), len(inn)),
                   peers=len({p for p, _ in out} | {p for p, _ in inn}))

    def allgather(self, output, input):
        self._call("allgather", self.inner.allgather, output, input)

    def allreduce(self, tensor):
        self._call("allreduce", self.inner.allreduce, tensor)

    def alltoall(self, output, input):
        self._call("alltoall", self.inner.alltoall, output, input)

    def broadcast(self, tensor, root=0):
        self._call("broadcast", self.inner.broadcast, tensor, root)

    def barrier(self):
        self.inner.barrier()


def _grad(rank, step, n):
    g = torch.Generator().manual_seed(1000 * step + rank)
    common = torch.Generator().manual_seed(77 + step)
    return torch.randn(n, generator=common) + 0.5 * torch.randn(n, generator=g)


def record(name, P, n, density, steps, dtype=torch.float32, **options):
    """Run ``steps`` steps on P ranks; return per rank: (k, [log of step t], [alg state])."""
    def body(comm):
        rec = RecordingComm(comm)
        alg = get_algorithm(name)(n, rec, density, **options)
        logs, states = [], []
        for t in range(steps):
            rec.log = []
            states.append({"mode": getattr(alg, "mode", None), "cap2": getattr(alg, "cap2", None)})
            alg(_grad(comm.rank, t, n).to(dtype))
            logs.append(rec.log)
            assert sum(e["bytes"] for e in rec.log) == alg.stats["bytes_sent"]
        return alg.k, logs, states
    return LocalCluster(P, timeout=60).run(body)


def assert_matches(specs, log, exact=True):
    assert [s.kind for s in specs] == [e["kind"] for e in log]
    for s, e in zip(specs, log):
        if exact or s.data_dependent == 0:
            assert e["bytes"] == s.bytes_per_rank, (s, e)
        else:
            assert s.min_bytes <= e["bytes"] <= s.bytes_per_rank, (s, e)
        if s.kind == "send_recv":
            assert (e["recv_bytes"], e["rounds"], e["peers"]) == (s.received, s.rounds, s.peers)
        else:
            assert s.peers == e.get("peers", s.peers)


def _opts(name):
    return torch_kernels(name)


STATIC = [a for a in REGISTRY if a != "topkdsa"]


@pytest.mark.parametrize("P", WORLD_SIZES)
@pytest.mark.parametrize("name", STATIC)
def test_static_schedules_match_recorded_traffic(name, P):
    n, density = 1000 + 7 * P, 0.05
    res = record(name, P, n, density, steps=2, **_opts(name))
    for rank, (k, logs, _) in enumerate(res):
        mine = schedule_of(name, n, k, P, rank=rank, **_opts(name))
        for log in logs:                         # calibration step and steady step alike
            assert_matches(mine, log)
            assert len(log) == len(mine) > 0
    # rank=None is the list of some rank: the one with the most rounds
    k = res[0][0]
    crit = schedule_of(name, n, k, P, **_opts(name))
    assert crit in [schedule_of(name, n, k, P, rank=r, **_opts(name)) for r in range(P)]
    assert sum(s.rounds for s in crit) == max(
        sum(s.rounds for s in schedule_of(name, n, k, P, rank=r, **_opts(name)))
        for r in range(P))


@pytest.mark.parametrize("P", WORLD_SIZES)
@pytest.mark.parametrize("wire", ["fp32", "compact"])
def test_topkdsa_schedule_within_data_dependent_part_and_exact_with_state(P, wire, monkeypatch):
    # the bytes do not depend on the kernels' backend: the interpreted Triton kernels of the
    # compact wire at P = 2 and 3, their torch references (compared with them in
    # tests/test_wire_kernels.py, tests/test_wire_compact.py) from P = 4 on
    if P >= 4:
        monkeypatch.setattr(_dispatch, "INTERPRET", False)
    n, density = 1200 + 5 * P, 0.05
    res = record("topkdsa", P, n, density, steps=3, tau=1, wire_format=wire)
    modes = {st["mode"] for _, _, states in res for st in states[1:]}
    assert "sparse" in modes             # the data-dependent gather really was exercised
    for k, logs, states in res:
        bound = schedule_of("topkdsa", n, k, P, wire_format=wire)
        assert bound[-1].data_dependent > 0
        for log, st in zip(logs, states):
            assert_matches(bound, log, exact=False)
            assert_matches(schedule_of("topkdsa", n, k, P, wire_format=wire, **st), log)


@pytest.mark.parametrize("P", (4, 6, 8))
@pytest.mark.parametrize("name,options", [
    ("oktopk", {"check_finite": "off", "backend": "torch"}),
    ("oktopk", {"volume_budget": None, "backend": "torch"}),
    ("oktopk", {"volume_budget": 6.0, "capacity_split": 0.3, "backend": "torch"}),
    ("oktopk", {"wire_dtype": "bf16", "backend": "torch"}),
    ("oktopk", {"wire_format": "compact", "backend": "torch"}),
    ("oktopk", {"complete_sums": True, "backend": "torch"}),
    ("oktopk", {"complete_sums": True, "wire_format": "q2", "backend": "torch"}),
    ("topka", {"wire_format": "compact"}),
    ("gtopk", {"wire_format": "compact"}),
    ("spardl", {"teams": 2, "wire_format": "compact"}),
    ("gaussiank", {"wire_format": "compact", "check_finite": "off"}),
    ("spardl", {"teams": 2}),
    ("gaussiank", {"slack": 2.0, "check_finite": "off"}),
    ("dense", {"dtype": torch.bfloat16}),
    ("gtopk", {"check_finite": "raise"}),
])
def test_schedule_options_match_recorded_traffic(name, options, P, monkeypatch):
    # the torch references of the compact wire's kernels (the bytes do not depend on the backend;
    # the interpreted kernels: tests/test_wire_compact.py and the topkdsa test above)
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    n, density = 900, 0.04
    opts = dict(options)
    dtype = opts.pop("dtype", torch.float32)
    res = record(name, P, n, density, steps=2, dtype=dtype, **opts)
    for rank, (k, logs, _) in enumerate(res):
        mine = schedule_of(name, n, k, P, rank=rank, dtype=dtype, **opts)
        for log in logs:
            assert_matches(mine, log)


def test_spardl_four_teams_and_density_one_is_a_dense_step():
    n = 640
    for name, P, density, options in (("spardl", 8, 0.05, {"teams": 4}),
                                      ("topka", 4, 1.0, {}), ("oktopk", 3, 1.0,
                                                              {"backend": "torch"})):
        res = record(name, P, n, density, steps=1, **options)
        k, logs, _ = res[0]
        mine = schedule_of(name, n, k, P, **options)
        assert_matches(mine, logs[0])
    assert [s.kind for s in schedule_of("topka", n, n, 4)] == ["allreduce", "allreduce"]


def test_oktopk_schedule_is_the_rewritten_step():
    n, k, P = 1 << 20, 10486, 8
    specs = schedule_of("oktopk", n, k, P)
    from oktopk_triton.algorithms.oktopk import OkTopk
    cr, cg = OkTopk.capacities(n, k, P, 4.0, 0.5, True)
    assert [s.kind for s in specs] == ["allreduce", "send_recv", "allgather"]
    assert specs[0].bytes_per_rank == 2 * (P - 1) * 4 // P
    assert specs[1].bytes_per_rank == (P - 1) * 4 * (2 + 2 * cr)
    assert (specs[1].rounds, specs[1].peers) == (P - 1, P - 1)
    assert specs[2].bytes_per_rank == (P - 1) * 4 * (2 + 2 * cg)
    # the volume budget holds, all included: 4k(P-1)/P words
    assert sum(s.bytes_per_rank for s in specs) <= 4 * 4.0 * k * (P - 1) / P


def test_schedule_rejects_unknown_options_and_bad_arguments():
    with pytest.raises(TypeError, match="unknown option"):
        schedule_of("topka", 100, 5, 4, slack=2)
    with pytest.raises(ValueError):
        schedule_of("dense", 100, 101, 4)
    with pytest.raises(ValueError, match="teams"):
        schedule_of("spardl", 100, 5, 6, teams=4)
    with pytest.raises(ValueError):
        CollectiveSpec("gossip", 1, 1, 1)
    assert all(schedule_of(a, 100, 5, 1) == [] for a in REGISTRY)
