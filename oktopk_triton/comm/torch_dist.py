"""``TorchCommunicator``: the primitives on a torch.distributed process group (gloo for CPU
tensors, nccl for CUDA tensors).

Every primitive is issued with ``async_op=True`` and then waited on: with NCCL ``Work.wait()`` only
makes the current stream wait for the communication stream (no host synchronisation); with gloo it
blocks until the transfer is complete, bounded by ``timeout`` (or the process group's timeout).

Failures seen while waiting are re-raised as :class:`CommTimeout` (a timeout) or
:class:`CommAborted` (anything else, typically a peer that died: "Connection reset by peer"), with
the original error chained. Peers in the API are ranks of ``group``.

A lost peer is named: gloo reports only a socket address, so each communicator registers its
rank's (host, pid) in the default store when built and reads the others' after its first
completed primitive (``peers.StorePeerTable``); at a failure it checks which peer processes of this
host no longer run and says so in the error (``exc.lost_ranks``). A process killed with
``kill -9`` closes its sockets, so on gloo every peer connected to it fails at once; a peer that
only waits on ranks that are still alive fails within ``timeout``. After a failure the
communicator is broken: every later call raises the same error at once.
"""
from __future__ import annotations

import datetime
from typing import List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from .base import CommAborted, CommError, CommTimeout, Communicator
from .peers import StorePeerTable

# torch >= 2.13 names it all_gather_single (all_gather_into_tensor warns on every call there)
_ALL_GATHER_SINGLE = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

__all__ = ["TorchCommunicator"]


def _wrap_error(exc: BaseException, what: str, lost=(), lost_text: str = "") -> CommError:
    """The communicator error for ``exc``: :class:`CommAborted` when a peer is known lost or the
    error is not a timeout, else :class:`CommTimeout`; ``lost_ranks`` lists the lost peers."""
    text = str(exc).strip()
    low = text.lower()
    msg = f"{what}: {text}" + (f" [{lost_text}]" if lost_text else "")
    if not lost and ("timed out" in low or "timeout" in low):
        err: CommError = CommTimeout(msg)
    else:
        err = CommAborted(msg)
    err.lost_ranks = list(lost)
    return err


class TorchCommunicator(Communicator):
    """Communicator over a torch.distributed group (``None``: the default group).

    Args:
        group: the process group (``None`` = ``dist.group.WORLD``).
        timeout: seconds to wait for each operation on gloo (``None``: the process group's
            timeout). Ignored for NCCL, whose waits never block the host.
    """

    def __init__(self, group: Optional[dist.ProcessGroup] = None,
                 timeout: Optional[float] = None) -> None:
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise CommError("TorchCommunicator: torch.distributed is not initialised")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.backend = str(dist.get_backend(group)).lower()
        self.is_nccl = "nccl" in self.backend
        if self.is_nccl:
            self.device = torch.device("cuda", torch.cuda.current_device())
        else:
            self.device = torch.device("cpu")
        self.timeout = timeout
        self._wait_timeout = (datetime.timedelta(seconds=float(timeout))
                              if timeout is not None and not self.is_nccl else None)
        self._use_batch_p2p = True
        self._gather_into_tensor = True
        self._global = [self._global_rank(r) for r in range(self.world_size)]
        self._failure: Optional[CommError] = None
        self._peers = StorePeerTable(dict(enumerate(self._global)), dist.get_rank())
        self._peers.publish()
        self._peer_fetches_left = 0 if self.world_size == 1 else 8

    # -- helpers -----------------------------------------------------------------------------
    def _global_rank(self, r: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return r
        return dist.get_global_rank(self.group, r)

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(f"rank {self.rank}: communicator broken by an earlier "
                                      f"failure: {self._failure}") from self._failure

    def _fail(self, exc: BaseException, what: str) -> CommError:
        """The error to raise for ``exc`` (naming lost peers); the communicator is broken after."""
        lost, text = self._peers.diagnose(self.rank)
        err = _wrap_error(exc, f"rank {self.rank}: {what}", lost, text)
        self._failure = err
        return err

    def _wait(self, works, what: str) -> None:
        if works is None:
            return
        if not isinstance(works, (list, tuple)):
            works = [works]
        try:
            for w in works:
                if self._wait_timeout is not None:
                    w.wait(timeout=self._wait_timeout)
                else:
                    w.wait()
        except CommError:
            raise
        except Exception as exc:  # noqa: BLE001 - re-raised as a communicator error
            raise self._fail(exc, what) from exc
        if self._peer_fetches_left:
            # every rank of the group has reached a primitive, so it has registered itself
            # (a few tries: a group whose ranks talk through raw torch.distributed calls too)
            self._peer_fetches_left = 0 if self._peers.fetch() else self._peer_fetches_left - 1

    def _issue(self, what: str, fn, *args, **kwargs):
        self._raise_if_failed()
        try:
            return fn(*args, **kwargs)
        except (TypeError, ValueError):
            raise
        except RuntimeError as exc:
            low = str(exc).lower()
            if ("connection" in low or "timed out" in low or "timeout" in low
                    or "abort" in low or "closed" in low or "broken pipe" in low
                    or "reset" in low):
                raise self._fail(exc, what) from exc
            raise

    # -- primitives --------------------------------------------------------------------------
    def send_recv(self, sends: Sequence[Tuple[int, torch.Tensor]],
                  recvs: Sequence[Tuple[int, torch.Tensor]]) -> None:
        self._raise_if_failed()
        sends, recvs, self_pairs = self._check_send_recv(sends, recvs)
        ops: List[Tuple[str, int, torch.Tensor]] = []
        copy_back: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for peer, t in sends:
            ops.append(("send", peer, t.contiguous()))
            self._count_send(t, peer)
        for peer, t in recvs:
            buf = t if t.is_contiguous() else torch.empty_like(
                t, memory_format=torch.contiguous_format)
            if buf is not t:
                copy_back.append((t, buf))
            ops.append(("recv", peer, buf))
        for s, r in self_pairs:
            if s.numel() != r.numel():
                raise CommError(f"rank {self.rank}: send to self of {s.numel()} elements into a "
                                f"buffer of {r.numel()}")
            r.copy_(s.reshape(r.shape))
        if ops:
            works = None
            if self._use_batch_p2p:
                p2p = [dist.P2POp(dist.isend if kind == "send" else dist.irecv, t,
                                  self._global[peer], group=self.group)
                       for kind, peer, t in ops]
                try:
                    works = self._issue("send_recv", dist.batch_isend_irecv, p2p)
                except CommError:
                    raise
                except RuntimeError:
                    if self.is_nccl:
                        raise
                    self._use_batch_p2p = False  # fall back to individual isend/irecv
            if works is None:
                works = []
                for kind, peer, t in ops:
                    f = dist.isend if kind == "send" else dist.irecv
                    works.append(self._issue("send_recv", f, t, self._global[peer],
                                             group=self.group))
            self._wait(works, "send_recv")
        for t, buf in copy_back:
            t.copy_(buf)

    def _flat_pair(self, output: torch.Tensor, input: torch.Tensor):
        """(flat contiguous input, flat output) of a collective; None when this is the only
        rank, after copying the input to the output (unless they are the same memory)."""
        inp = input.reshape(-1).contiguous()
        out = output.view(-1)
        if self.world_size == 1:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp)
            return None
        return inp, out

    def allgather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        m = self._check_allgather(output, input)
        pair = self._flat_pair(output, input)
        if pair is None:
            return
        inp, out = pair
        work = None
        if self._gather_into_tensor:
            try:
                work = self._issue("allgather", _ALL_GATHER_SINGLE, out, inp,
                                   group=self.group, async_op=True)
            except CommError:
                raise
            except (RuntimeError, NotImplementedError):
                if self.is_nccl:
                    raise
                self._gather_into_tensor = False
        if work is None:
            chunks = list(out.split(m))
            if inp.data_ptr() == chunks[self.rank].data_ptr():
                inp = inp.clone()  # all_gather may write the output chunk while reading input
            work = self._issue("allgather", dist.all_gather, chunks, inp, group=self.group,
                               async_op=True)
        self._wait(work, "allgather")
        self._count_allgather(input)

    def allreduce(self, tensor: torch.Tensor) -> None:
        if self.world_size == 1:
            return
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        work = self._issue("allreduce", dist.all_reduce, buf, op=dist.ReduceOp.SUM,
                           group=self.group, async_op=True)
        self._wait(work, "allreduce")
        if buf is not tensor:
            tensor.copy_(buf)
        self._count_allreduce(tensor)

    def alltoall(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._check_alltoall(output, input)
        pair = self._flat_pair(output, input)
        if pair is None:
            return
        inp, out = pair
        if inp.data_ptr() == out.data_ptr():
            inp = inp.clone()
        work = self._issue("alltoall", dist.all_to_all_single, out, inp, group=self.group,
                           async_op=True)
        self._wait(work, "alltoall")
        self._count_alltoall(input)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        buf = self._broadcast_buffer(tensor, root)
        if buf is None:
            return
        work = self._issue("broadcast", dist.broadcast, buf, src=self._global[root],
                           group=self.group, async_op=True)
        self._wait(work, "broadcast")
        self._end_broadcast(tensor, buf, root)

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        self._raise_if_failed()
        if self.is_nccl:
            # dist.barrier() synchronises the host on NCCL: a tiny allreduce on the stream does not
            t = torch.zeros(1, device=self.device)
            self._wait(dist.all_reduce(t, group=self.group, async_op=True), "barrier")
            return
        work = self._issue("barrier", dist.barrier, group=self.group, async_op=True)
        self._wait(work, "barrier")
