"""``TorchCommunicator`` (oktopk_triton/comm/torch_dist.py) and the peer table
(oktopk_triton/comm/peers.py) in this process: a gloo group of one rank, and the failure
handling driven by stand-in works and stores.

* every primitive on one rank gives what ``SingleCommunicator`` gives, and sends nothing;
* a full algorithm step through it equals the same step through a ``LocalCluster`` of one rank
  (the output, the residual and the bytes);
* a failure while waiting is a ``CommTimeout`` (a timeout) or ``CommAborted`` (anything else,
  or a lost peer), names the lost peer, and breaks the communicator: every later call raises;
* an issue error that is not about the connection passes through unchanged;
* the peer table: identities through the store, lost processes named, a store that is gone
  blames the rank that hosts it.
"""
import os

import pytest
import torch
import torch.distributed as dist

from oktopk_triton.comm import CommAborted, CommError, CommTimeout, LocalCluster
from oktopk_triton.comm import peers as peers_mod
from oktopk_triton.comm.peers import StorePeerTable, describe_lost, lost_peers
from oktopk_triton.comm.torch_dist import TorchCommunicator, _wrap_error




def test_it_refuses_to_build_without_a_process_group():
    assert not dist.is_initialized()
    with pytest.raises(CommError, match="torch.distributed is not initialised"):
        TorchCommunicator()


def test_primitives_on_one_rank_copy_and_send_nothing(gloo1):
    comm = TorchCommunicator(timeout=5.0)
    assert (comm.rank, comm.world_size, comm.device.type) == (0, 1, "cpu")
    assert "gloo" in comm.backend and not comm.is_nccl
    x = torch.arange(6, dtype=torch.float32)
    # send to self: a copy into the receive buffer (a non-contiguous one too)
    out = torch.zeros(3, 2).t()
    comm.send_recv([(0, x)], [(0, out)])
    assert torch.equal(out.reshape(-1), x) or torch.equal(out, x.reshape(out.shape))
    with pytest.raises(CommError, match="send to self of 6 elements into a buffer of 4"):
        comm.send_recv([(0, x)], [(0, torch.zeros(4))])
    with pytest.raises(CommError, match="1 sends to self but 0 receives"):
        comm.send_recv([(0, x)], [])
    with pytest.raises(ValueError, match="peer 1 out of range"):
        comm.send_recv([(1, x)], [])
    g = torch.zeros(6)
    comm.allgather(g, x)
    assert torch.equal(g, x)
    comm.allgather(x, x)                          # in place: the same memory
    t = x.clone()
    comm.allreduce(t)
    assert torch.equal(t, x)
    a = torch.zeros(6)
    comm.alltoall(a, x)
    assert torch.equal(a, x)
    b = x.clone()
    comm.broadcast(b, root=0)
    assert torch.equal(b, x)
    with pytest.raises(ValueError, match="out of range"):
        comm.broadcast(b, root=1)
    comm.barrier()
    assert comm.bytes_sent == 0


def test_a_subgroup_maps_its_ranks_to_global_ones(gloo1):
    sub = dist.new_group([0])
    comm = TorchCommunicator(sub)
    assert comm._global == [0] and comm.world_size == 1
    y = torch.ones(3)
    comm.allreduce(y)
    assert torch.equal(y, torch.ones(3))


@pytest.mark.parametrize("alg", ["oktopk", "topka", "gtopk"])
def test_an_algorithm_step_equals_a_local_cluster_of_one(gloo1, alg):
    from oktopk_triton.algorithms import get_algorithm
    n, steps = 300, 3
    grads = [torch.randn(n, generator=torch.Generator().manual_seed(s)) for s in range(steps)]

    def run(comm):
        red = get_algorithm(alg)(n, comm, 0.1)
        outs = [red(g.clone()).clone() for g in grads]
        return outs, red.residual.clone(), comm.bytes_sent

    ref = LocalCluster(1).run(run)[0]
    got = run(TorchCommunicator())
    for a, b in zip(got[0], ref[0]):
        assert torch.equal(a, b)
    assert torch.equal(got[1], ref[1])
    assert got[2] == ref[2] == 0
    assert float(got[1].abs().sum()) > 0         # sparse at P = 1: it owes the rest


class _Work:
    def __init__(self, exc=None):
        self.exc, self.waited = exc, []

    def wait(self, timeout=None):
        self.waited.append(timeout)
        if self.exc is not None:
            raise self.exc
        return True


def test_a_timeout_while_waiting_breaks_the_communicator(gloo1):
    comm = TorchCommunicator(timeout=2.0)
    ok = _Work()
    comm._wait([ok], "allreduce")
    assert ok.waited and ok.waited[0].total_seconds() == 2.0
    comm._wait(None, "nothing")
    with pytest.raises(CommTimeout, match="rank 0: allreduce: Wait timed out after 2s"):
        comm._wait(_Work(RuntimeError("Wait timed out after 2s")), "allreduce")
    # broken: every later call raises the same kind at once
    with pytest.raises(CommTimeout, match="broken by an earlier failure"):
        comm.send_recv([], [])
    with pytest.raises(CommTimeout, match="broken by an earlier failure"):
        comm._issue("barrier", lambda: None)


def test_issue_errors_are_classified(gloo1):
    comm = TorchCommunicator()

    def boom(exc):
        def f(*a, **k):
            raise exc
        return f
    with pytest.raises(TypeError):
        comm._issue("x", boom(TypeError("bad argument")))
    with pytest.raises(RuntimeError, match="^some other failure$"):
        comm._issue("x", boom(RuntimeError("some other failure")))
    assert comm._failure is None                  # not about the connection: not broken
    assert comm._issue("x", lambda v: v + 1, 1) == 2
    with pytest.raises(CommAborted, match="rank 0: send_recv: Connection reset by peer"):
        comm._issue("send_recv", boom(RuntimeError("Connection reset by peer")))
    with pytest.raises(CommAborted, match="broken by an earlier failure"):
        comm._issue("x", lambda: None)


def test_wrap_error_names_lost_peers_and_tells_timeouts_apart():
    e = _wrap_error(RuntimeError("operation timed out"), "rank 0: allreduce")
    assert isinstance(e, CommTimeout) and e.lost_ranks == []
    e = _wrap_error(RuntimeError("operation timed out"), "rank 0: allreduce", [2], "lost peer")
    assert isinstance(e, CommAborted) and e.lost_ranks == [2]
    assert str(e) == "rank 0: allreduce: operation timed out [lost peer]"
    e = _wrap_error(RuntimeError("Connection closed by peer"), "w")
    assert isinstance(e, CommAborted) and not isinstance(e, CommTimeout)


# -- the peer table ------------------------------------------------------------------------------
def test_the_peer_table_names_a_lost_process_on_this_host():
    store = dist.HashStore()
    host = peers_mod.socket.gethostname()
    tables = [StorePeerTable({0: 0, 1: 1, 2: 2}, g, store=store) for g in range(3)]
    tables[0].publish()
    assert not tables[0].fetch()                 # ranks 1 and 2 have not registered yet
    store.set(peers_mod.STORE_PREFIX + "1", f"{host}:4242")
    store.set(peers_mod.STORE_PREFIX + "2", "elsewhere:7")
    assert tables[0].fetch()
    assert tables[0].table[0] == (host, os.getpid()) and tables[0].table[1] == (host, 4242)
    lost, text = tables[0].diagnose(0, alive=lambda pid: pid != 4242, grace=0)
    assert lost == [1]
    assert text == (f"lost peer: rank 1 (pid 4242 on host {host}), no longer running; "
                    "ranks [2] on other hosts not checked")
    lost, text = tables[0].diagnose(0, alive=lambda pid: True, grace=0)
    assert lost == [] and text.startswith("every peer process on this host is still running")


def test_a_peer_that_never_registered_is_named():
    store = dist.HashStore()
    t = StorePeerTable({0: 0, 1: 1}, 0, store=store)
    t.publish()
    lost, text = t.diagnose(0, alive=lambda pid: True, grace=0)
    assert lost == [] and text == "ranks [1] never registered"


class _GoneStore:
    def set(self, *a):
        raise RuntimeError("Connection refused")

    def check(self, *a):
        raise RuntimeError("Connection refused")


def test_an_unreachable_store_blames_the_rank_that_hosts_it():
    t = StorePeerTable({0: 3, 1: 0}, 3, store=_GoneStore())
    t.publish()
    assert t.store_error.startswith("store unreachable")
    lost, text = t.diagnose(0, alive=lambda pid: True, grace=0)
    assert lost == [1]
    assert "lost peer: rank 1 (it hosts the rendezvous store, which is unreachable" in text
    # no rank hosts it (global rank 0 not in the group): the store's error only
    t = StorePeerTable({0: 3, 1: 4}, 3, store=_GoneStore())
    lost, text = t.diagnose(0, alive=lambda pid: True, grace=0)
    assert lost == [] and "store unreachable" in text


def test_without_a_default_group_there_is_no_store():
    assert not dist.is_initialized()
    t = StorePeerTable({0: 0}, 0)
    assert t.store is None and t.store_error.startswith("no store")
    t.publish()
    assert not t.fetch()


def test_process_alive_and_lost_peers_on_real_pids():
    assert peers_mod.process_alive(os.getpid())
    assert not peers_mod.process_alive(2 ** 22 + 12345)   # above pid_max: never a process
    host = "h"
    peers = {0: (host, 1), 1: (host, 2), 2: ("other", 3)}
    assert lost_peers(peers, 0, alive=lambda p: p != 2, host=host) == ([1], [2])
    assert describe_lost(peers, [1, 0]).startswith("lost peers: rank 1 (pid 2 on host h), rank 0")
    assert peers_mod.peers_from_list([("a", "5")]) == {0: ("a", 5)}
