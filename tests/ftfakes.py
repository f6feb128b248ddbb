"""Stand-ins for torchft in one process: a ``Manager`` and its process group per replica, the
replicas being the threads of a :class:`~oktopk_triton.comm.LocalCluster` (the group's
primitives are the cluster's). Enough of torchft 0.2's surface for ``ManagerCommunicator``,
``ReplicaSync``, ``SparseDiLoCo``, ``SparseGradients`` and ``bench.ft_replica``:

* ``should_commit()`` is a vote of every replica (an allreduce of the cluster): it commits when
  no replica reported an error since the last vote;
* ``fail_at``: the process group's calls (counted from 0 on each replica) that raise, on every
  replica alike, as a peer's death would;
* ``heal_at``: ``{quorum number: (healer, healed)}``: at that quorum the healed replica loads
  the state every registered state-dict function of the healer saves, as torchft heals;
* a vote that fails reconfigures the group at the next quorum, as torchft's Manager does after
  a failed commit: point-to-point messages still in flight from the failed sync are dropped.
"""
from datetime import timedelta
from typing import Any, Dict, Optional, Set, Tuple

import torch


class _Done:
    def __init__(self, fn=None):
        self.fn = fn

    def wait(self, timeout=None):
        if self.fn is not None:
            self.fn()
        return True


class FakePG:
    """A torchft process group whose primitives are a LocalCommunicator's."""

    def __init__(self, lc, fail_at: Set[int] = frozenset()):
        self.lc, self.fail_at, self.calls = lc, set(fail_at), 0

    def _tick(self):
        n, self.calls = self.calls, self.calls + 1
        if n in self.fail_at:
            raise RuntimeError("Connection reset by peer")

    def size(self):
        return self.lc.world_size

    def getBackendName(self):
        return "fake-gloo"

    def allreduce(self, tensors, opts):
        self._tick()
        self.lc.allreduce(tensors[0])
        return _Done()

    def allgather(self, outputs, inputs, opts):
        self._tick()
        chunks, inp = outputs[0], inputs[0]
        out = torch.empty(sum(c.numel() for c in chunks), dtype=inp.dtype)
        self.lc.allgather(out, inp)
        for c, o in zip(chunks, out.split([c.numel() for c in chunks])):
            c.copy_(o.view(c.shape))
        return _Done()

    def alltoall_base(self, out, inp, out_splits, in_splits, opts):
        self._tick()
        self.lc.alltoall(out, inp)
        return _Done()

    def broadcast(self, tensors, opts):
        self._tick()
        self.lc.broadcast(tensors[0], opts.rootRank)
        return [_Done()]

    def barrier(self, opts):
        self._tick()
        self.lc.barrier()
        return _Done()

    def send(self, tensors, peer, tag):
        self._tick()
        self.lc.send_recv([(peer, tensors[0])], [])
        return _Done()

    def recv(self, tensors, peer, tag):
        self._tick()
        return _Done(lambda: self.lc.send_recv([], [(peer, tensors[0])]))


class FakeManager:
    """One replica's torchft Manager over a LocalCluster (see the module docstring)."""

    _use_async_quorum = False
    _timeout = timedelta(seconds=5)

    def __init__(self, lc, shared: Dict[str, Any], fail_at: Set[int] = frozenset(),
                 heal_at: Optional[Dict[int, Tuple[int, int]]] = None):
        self.lc, self.shared = lc, shared
        self._pg = FakePG(lc, fail_at)
        self._quorum_id = 0
        self._step = 0
        self.errors = []
        self.heal_at = heal_at or {}
        self._load_state_dict_fns: Dict[str, Any] = {}
        self._save_fns: Dict[str, Any] = {}
        self.shut = False
        self._reconfigure = False

    def register_state_dict_fn(self, key, load, save):
        assert key not in self._load_state_dict_fns      # as torchft's Manager
        self._load_state_dict_fns[key] = load
        self._save_fns[key] = save

    def start_quorum(self):
        if self._reconfigure:             # a new group: what the failed sync left is gone
            self._reconfigure = False
            self.lc.barrier()
            with self.lc.cluster._cond:
                for (src, dst), box in self.lc.cluster._mail.items():
                    if dst == self.lc.rank:
                        box.clear()
            self.lc.barrier()
        heal = self.heal_at.get(self._quorum_id)
        self._quorum_id += 1
        if heal is None:
            return
        healer, healed = heal
        if self.lc.rank == healer:
            self.shared["heal"] = {k: f() for k, f in self._save_fns.items()}
            self.shared["heal_step"] = self._step
        self.lc.barrier()
        if self.lc.rank == healed:
            sd = self.shared["heal"]
            for k, f in self._load_state_dict_fns.items():
                if k in sd:
                    f(sd[k])
            self._step = self.shared["heal_step"]
        self.lc.barrier()

    def should_commit(self):
        vote = torch.tensor([0.0 if self.errors else 1.0], dtype=torch.float64)
        self.lc.allreduce(vote)
        self.errors = []
        ok = int(vote) == self.lc.world_size
        if ok:
            self._step += 1
        self._reconfigure = not ok
        return ok

    def num_participants(self):
        return self.lc.world_size

    def participating_rank(self):
        return self.lc.rank

    def errored(self):
        return None

    def report_error(self, e):
        self.errors.append(e)

    def current_step(self):
        return self._step

    def shutdown(self, wait=True):
        self.shut = True
