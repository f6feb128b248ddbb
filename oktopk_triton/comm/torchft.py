"""``ManagerCommunicator``: the primitives on a torchft ``Manager``'s process group.

torchft (``pip install torchft``) reconfigures one process group at every quorum: its members are
the replica groups the lighthouse admitted. This communicator runs every primitive the algorithms
use on that group, so P is the quorum's participants and this process's rank is its replica
rank::

    manager = torchft.Manager(pg=torchft.ProcessGroupGloo(), use_async_quorum=False, ...)
    comm = ManagerCommunicator(manager)
    manager.start_quorum()
    if comm.refresh():             # the membership changed since the last quorum
        sar.reconfigure(comm)      # SparseAllreduce rebuilds what depends on P

The integration in :mod:`oktopk_triton.integrations.torchft` does this at every sync. A primitive
that fails (a peer died, a timeout) raises :class:`~oktopk_triton.comm.CommAborted` or
:class:`~oktopk_triton.comm.CommTimeout` and reports the error to the Manager, so that
``should_commit()`` is false on every replica; the communicator stays broken until the next
:meth:`ManagerCommunicator.refresh`. Needs a synchronous quorum (``use_async_quorum=False``):
with it every replica in the process group participates (a healed one after loading its state).
"""
from __future__ import annotations

import datetime
from typing import Any, List, Optional, Sequence, Tuple

import torch

from .base import CommAborted, CommError, CommTimeout, Communicator

__all__ = ["ManagerCommunicator"]


def _is_timeout(exc: BaseException) -> bool:
    low = str(exc).lower()
    return "timed out" in low or "timeout" in low


class ManagerCommunicator(Communicator):
    """Communicator over ``manager``'s process group (torchft 0.2).

    Args:
        manager: a ``torchft.Manager`` built with ``use_async_quorum=False``.
        timeout: seconds each primitive may wait (default: the Manager's ``timeout``).

    ``rank`` and ``world_size`` are the replica rank and the number of participants of the
    last quorum, read by :meth:`refresh` (1 and 0 before the first one).
    """

    def __init__(self, manager: Any, timeout: Optional[float] = None) -> None:
        super().__init__()
        missing = [a for a in ("start_quorum", "should_commit", "num_participants",
                               "participating_rank", "report_error", "_pg")
                   if not hasattr(manager, a)]
        if manager is None or missing:
            raise TypeError(f"ManagerCommunicator: expected a torchft.Manager, got "
                            f"{type(manager).__name__}")
        if getattr(manager, "_use_async_quorum", False):
            raise ValueError("ManagerCommunicator: the Manager must be built with "
                             "use_async_quorum=False (a sparse sync needs every replica of the "
                             "quorum to participate, healed ones included)")
        self.manager = manager
        # torchft 0.2 keeps the process group it reconfigures at each quorum in Manager._pg
        # (its own ManagedProcessGroup reads it the same way)
        self.pg = manager._pg
        backend = str(getattr(self.pg, "getBackendName", lambda: "")()).lower()
        self.device = (torch.device("cuda", torch.cuda.current_device()) if "nccl" in backend
                       else torch.device("cpu"))
        wait = timeout if timeout is not None else manager._timeout.total_seconds()
        self.timeout = datetime.timedelta(seconds=float(wait))
        self.rank, self.world_size = 0, 1
        self.quorum_id: Optional[int] = None
        self._failure: Optional[CommError] = None

    # -- the quorum ---------------------------------------------------------------------------
    def refresh(self) -> bool:
        """Read the quorum ``manager.start_quorum()`` formed: this rank, P, the quorum id. Returns
        True when this rank or P changed since the last call, so the reducer must be
        reconfigured (a member replaced by a newcomer keeps both: the integration asks the group
        whether anyone joined). Clears a failure of the last quorum's primitives."""
        m = self.manager
        rank, size = m.participating_rank(), m.num_participants()
        if m.errored() is not None:
            raise CommAborted(f"ManagerCommunicator: the quorum failed: {m.errored()}")
        if rank is None:
            raise CommError("ManagerCommunicator: this replica does not participate in the "
                            "quorum (a spare of WorldSizeMode.FIXED_WITH_SPARES is not supported)")
        if size != self.pg.size():
            raise CommError(f"ManagerCommunicator: {size} participants but a process group of "
                            f"{self.pg.size()}: the Manager must use use_async_quorum=False")
        qid = int(getattr(m, "_quorum_id", -1))
        changed = (rank, size) != (self.rank, self.world_size)
        self.quorum_id, self.rank, self.world_size = qid, int(rank), int(size)
        self._failure = None
        return changed

    # -- failures -----------------------------------------------------------------------------
    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(f"rank {self.rank}: communicator broken by an earlier "
                                      f"failure in this quorum: {self._failure}")

    def _run(self, what: str, issue) -> None:
        """Issue one primitive (``issue()`` returns its Works) and wait for it, bounded."""
        self._raise_if_failed()
        try:
            works = issue()
            for w in works if isinstance(works, (list, tuple)) else [works]:
                w.wait(self.timeout)
        except Exception as exc:  # noqa: BLE001 - re-raised as a communicator error
            text = " ".join(str(exc).split())[:300]
            cls = CommTimeout if _is_timeout(exc) else CommAborted
            err = cls(f"rank {self.rank} of {self.world_size}: {what} failed in quorum "
                      f"{self.quorum_id}: {text}")
            self._failure = err
            self.manager.report_error(err)
            raise err from exc

    # -- primitives ---------------------------------------------------------------------------
    def send_recv(self, sends: Sequence[Tuple[int, torch.Tensor]],
                  recvs: Sequence[Tuple[int, torch.Tensor]]) -> None:
        sends, recvs, self_pairs = self._check_send_recv(sends, recvs)
        for s, r in self_pairs:
            r.copy_(s.reshape(r.shape))
        bufs = [(t, t if t.is_contiguous() else torch.empty_like(
            t, memory_format=torch.contiguous_format)) for _, t in recvs]
        plan: List[Tuple[bool, int, torch.Tensor, int]] = []
        tags: dict = {}
        for peer, t in sends:       # the j-th transfer of a pair carries tag j on both sides
            tags[("s", peer)] = tags.get(("s", peer), -1) + 1
            plan.append((True, peer, t.contiguous(), tags[("s", peer)]))
        for (peer, _), (_, buf) in zip(recvs, bufs):
            tags[("r", peer)] = tags.get(("r", peer), -1) + 1
            plan.append((False, peer, buf, tags[("r", peer)]))
        if plan:
            pg = self.pg
            self._run("send_recv", lambda: [
                pg.send([t], peer, tag) if is_send else pg.recv([t], peer, tag)
                for is_send, peer, t, tag in plan])
        for peer, t in sends:
            self._count_send(t, peer)
        for t, buf in bufs:
            if buf is not t:
                t.copy_(buf)

    def allgather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        m = self._check_allgather(output, input)
        inp, out = input.reshape(-1).contiguous(), output.view(-1)
        if self.world_size == 1:
            out.copy_(inp)
            return
        from torch.distributed.distributed_c10d import AllgatherOptions
        chunks = list(out.split(m))
        self._run("allgather", lambda: self.pg.allgather([chunks], [inp.clone()],
                                                         AllgatherOptions()))
        self._count_allgather(input)

    def allreduce(self, tensor: torch.Tensor) -> None:
        if self.world_size == 1:
            return
        from torch.distributed.distributed_c10d import AllreduceOptions, ReduceOp
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        opts = AllreduceOptions()
        opts.reduceOp = ReduceOp.SUM
        self._run("allreduce", lambda: self.pg.allreduce([buf], opts))
        if buf is not tensor:
            tensor.copy_(buf)
        self._count_allreduce(tensor)

    def alltoall(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._check_alltoall(output, input)
        inp, out = input.reshape(-1).contiguous(), output.view(-1)
        if self.world_size == 1:
            out.copy_(inp)
            return
        if inp.data_ptr() == out.data_ptr():
            inp = inp.clone()
        from torch.distributed.distributed_c10d import AllToAllOptions
        self._run("alltoall", lambda: self.pg.alltoall_base(out, inp, [], [],
                                                            AllToAllOptions()))
        self._count_alltoall(input)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        buf = self._broadcast_buffer(tensor, root)
        if buf is None:
            return
        from torch.distributed.distributed_c10d import BroadcastOptions
        opts = BroadcastOptions()
        opts.rootRank = root
        self._run("broadcast", lambda: self.pg.broadcast([buf], opts))
        self._end_broadcast(tensor, buf, root)

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        from torch.distributed.distributed_c10d import BarrierOptions
        self._run("barrier", lambda: self.pg.barrier(BarrierOptions()))
