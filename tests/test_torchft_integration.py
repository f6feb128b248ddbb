"""Integration tests of the torchft integration against the real ``torchft_lighthouse``, which
each test starts on loopback, with replica groups as processes over gloo
(:mod:`oktopk_triton.bench.ft_cluster`, :mod:`oktopk_triton.bench.ft_replica`). Every process is
started and killed by pid; every wait is bounded. Each scenario runs in one fresh process
(``isolated``) that imports torch once and forks its replicas from it."""
import multiprocessing as mp
import os

import pytest
import torch

pytest.importorskip("torchft")

from oktopk_triton.bench.ft_cluster import Lighthouse, Replica, wait_for, wait_ready  # noqa: E402
from oktopk_triton.bench.ranks import free_port  # noqa: E402

# the run every scenario here shares: 3 replicas of the small MLP, Ok-Topk at 10% every 2 steps
BASE = dict(syncs=5, sync_every=2, density=0.1, algorithm="oktopk", audit=True)
WAIT = 150          # seconds any one cluster may take, start-up included (2 loaded cores)


def _weights(res):
    return torch.load(res["weights"], weights_only=True)


def _equal(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _ok(results):
    for r in results:
        assert r["returncode"] == 0, r["log"]


def _committed(res):
    return [h for h in res["history"] if h["committed"]]


def _conserved(res):
    """Every committed sync conserved over its participants (checked before it committed)."""
    errs = [h["relative_error"] for h in _committed(res)]
    assert errs and all(e is not None and e <= 1e-6 for e in errs), errs


def isolated(scenario, *args):
    """Run ``scenario(*args)`` (a module-level function) in a fresh single-threaded process,
    which may fork replicas; its return value comes back (bounded by 4 * WAIT)."""
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply_async(scenario, args).get(timeout=4 * WAIT)


def _cluster(n, tmp, **cfg):
    with Lighthouse(min_replicas=n) as lh:
        reps = [Replica(dict(BASE, replica=i, lighthouse=lh.address, min_replicas=n, **cfg),
                        tmp, fork=True) for i in range(n)]
        return [r.result(WAIT) for r in reps]


def _reference(n, tmp, **cfg):
    port = free_port()
    reps = [Replica(dict(BASE, replica=i, mode="reference", world=n, master_port=port, **cfg),
                    tmp, fork=True) for i in range(n)]
    return [r.result(WAIT) for r in reps]


def _no_fault_and_failed(tmp):
    return (_cluster(3, tmp), _reference(3, tmp),
            _cluster(3, tmp, fail={"sync": 3, "collective": 2}, retry=True))


@pytest.mark.slow
def test_no_fault_is_bitwise_the_plain_local_steps_run_and_a_failed_commit_rolls_back(tmp_path):
    """No fault: every replica ends with the weights of SparseAllreduce(sync_every=2) on plain
    torch.distributed, bit for bit. A sync whose collective fails on every replica does not
    commit, rolls back, and its immediate retry delivers the same mass: the run ends on the
    same bits as without the failure."""
    ft, ref, failed = isolated(_no_fault_and_failed, str(tmp_path))
    _ok(ft + ref)
    assert [h["rank"] for h in ft[1]["history"]] == [1] * BASE["syncs"]
    w = _weights(ref[0])
    for r in ft + ref:
        assert _equal(_weights(r), w)
    for r in ft:
        _conserved(r)
        assert r["step"] == BASE["syncs"] and all(h["committed"] for h in r["history"])

    _ok(failed)
    for r in failed:
        h = r["history"]
        assert [x["committed"] for x in h] == [True, True, False, True, True, True]
        assert "injected" in h[2]["error"]
        assert 0 < h[2]["bytes"] < h[3]["bytes"]      # what went out before the failure
        assert h[3]["bytes"] == ft[0]["history"][2]["bytes"]      # the same sync, sent once
        _conserved(r)
        assert _equal(_weights(r), w)


def _killed(tmp):
    gate0, gate1, gate2 = (os.path.join(tmp, g) for g in ("all", "rejoin", "stranger"))
    cfg = dict(BASE, syncs=8, min_replicas=2, hold=[
        {"at": 0, "file": gate0}, {"at": 4, "file": gate1}, {"at": 6, "file": gate2}])
    with Lighthouse(min_replicas=2) as lh:
        def start(i, **extra):
            return Replica(dict(cfg, replica=i, lighthouse=lh.address, **extra), tmp, fork=True)
        reps = [start(0), start(1), start(2, die={"sync": 3, "collective": 2})]
        for r in reps:                      # the first quorum holds all three
            wait_ready(r, WAIT)
        open(gate0, "w").close()
        first = reps[2]
        assert first.proc.wait(timeout=WAIT) == -9                 # killed itself by SIGKILL
        wait_for(reps, 0, 4, WAIT)
        reps[2] = start(2)
        wait_ready(reps[2], WAIT)
        open(gate1, "w").close()
        wait_for(reps, 0, 6, WAIT)
        stranger = start(3, width=48)
        wait_ready(stranger, WAIT)
        open(gate2, "w").close()
        return [r.result(WAIT) for r in reps], stranger.result(WAIT)


@pytest.mark.slow
def test_a_killed_replica_is_survived_rejoins_healed_and_another_model_is_refused(tmp_path):
    """Replica 2 is SIGKILLed inside a sync's collectives: the survivors roll that sync back,
    go on at P = 2 and stay identical, conserving every sync. Restarted, it is healed from a
    peer, owes nothing and ends identical to them. A replica of another model that tries to
    join is refused with a one-line error and the others go on."""
    results, bad = isolated(_killed, str(tmp_path))
    _ok(results)
    w = _weights(results[0])
    for r in results:
        assert r["step"] == 8 and _equal(_weights(r), w)
        _conserved(r)
    for r in results[:2]:                                           # the survivors
        h = r["history"]
        assert not h[2]["committed"] and h[2]["error"]              # the sync it died in
        assert h[3]["P"] == 2 and h[3]["reconfigured"] and h[3]["committed"]
        back = next(x for x in h if x["P"] == 3 and x["step"] >= 4)
        assert back["reconfigured"] and back["committed"] and not back["healed"]
    rejoined = results[2]["history"]
    assert rejoined[0]["healed"] and rejoined[0]["newcomer"] and rejoined[0]["committed"]
    assert rejoined[0]["step"] >= 4
    assert bad["returncode"] == 1 and "\n" not in bad["error"]
    assert bad["error"].startswith("CheckpointError: torchft heal refused: the peer's model is "
                                   "another one (parameter 0 has shape")


def _fsdp(tmp):
    with Lighthouse(min_replicas=2) as lh:
        reps = []
        for i in range(2):
            port = free_port()
            reps += [Replica(dict(BASE, mode="fsdp", replica=i, group_rank=r, group_world=2,
                                  group_port=port, lighthouse=lh.address, min_replicas=2,
                                  syncs=4), tmp, fork=True) for r in range(2)]
        return [r.result(WAIT) for r in reps]


@pytest.mark.slow
def test_fsdp2_inside_each_replica_group_the_sparse_reduce_across_groups(tmp_path):
    """Two replica groups of 2 ranks: FSDP2 shards the model inside each group, and each rank's
    shards are reduced sparsely with the same rank's of the other group through the Manager:
    every step commits, is conserved, and the two groups hold the same shards bit for bit."""
    results = isolated(_fsdp, str(tmp_path))
    _ok(results)
    for r in results:
        assert r["step"] == 4 and all(h["committed"] and h["P"] == 2 for h in r["history"])
        _conserved(r)
    for rank in range(2):                       # group rank r of group 0 and of group 1
        a, b = _weights(results[rank]), _weights(results[2 + rank])
        assert _equal(a, b)
    assert not _equal(_weights(results[0]), _weights(results[1]))   # two different shards
