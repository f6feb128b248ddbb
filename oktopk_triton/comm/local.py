"""In-process communicators: ``LocalCluster`` runs one thread per rank, ``SingleCommunicator`` is a
world of one.

``LocalCluster(world_size, timeout=60.0).run(fn, *args)`` calls ``fn(comm, *args)`` on every rank in
its own thread and returns the results ordered by rank. Tensors are copied between ranks (no rank
ever sees another rank's storage after a call returns). Failure handling:

* when a rank raises, the cluster is aborted: every other rank's pending (or next) communicator
  call raises :class:`CommAborted` at once (waiters are woken), ``run`` joins every thread and
  re-raises the first failure (the original exception, with the rank noted);
* a rank waiting on a peer that does not arrive raises :class:`CommTimeout` after ``timeout``
  seconds (at once if every missing peer has already returned from ``fn``).
* ``run`` gives up on a rank (:class:`CommTimeout`, "did not finish") only when no collective
  has completed for ``2·timeout + 30`` seconds (``timeout + 30`` after a failure): a long run
  that keeps communicating is never cut off, a rank stuck in its own code is.

Collectives are rendezvous ("rounds") keyed by a per-rank sequence number, so every rank must call
the same collectives in the same order (checked: a mismatch raises :class:`CommError`). Point-to-
point sends are eager (the payload is copied into a mailbox and the send returns); receives wait.

``allreduce`` sums every element in rank order exactly once (rank r reduces the r-th slice of the
flat tensor, in parallel), so the result is bitwise identical on every rank. Per call the copies
are O(P·n) in total (each rank reduces n/P elements over P inputs and copies n out), never P² full
copies.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .base import CommAborted, CommError, CommTimeout, Communicator, resolve_device

__all__ = ["LocalCluster", "LocalCommunicator", "SingleCommunicator"]


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):
        exc.add_note(text)
    else:  # pragma: no cover - Python < 3.11
        try:
            exc.args = tuple(exc.args) + (text,)
        except Exception:
            pass


class _Round:
    __slots__ = ("op", "sig", "payloads", "arrived", "departed", "shared")

    def __init__(self, op: str, sig: Any, P: int) -> None:
        self.op = op
        self.sig = sig
        self.payloads: List[Any] = [None] * P
        self.arrived = 0
        self.departed = 0
        self.shared: Dict[str, Any] = {}


class LocalCluster:
    """``world_size`` ranks as threads of this process (see the module docstring)."""

    GRACE = 30.0     # seconds beyond the timeout before run() gives up on a silent rank

    def __init__(self, world_size: int, timeout: float = 60.0,
                 device: Optional[torch.device | str] = None) -> None:
        if world_size < 1:
            raise ValueError("world_size must be >= 1")
        self.world_size = int(world_size)
        self.timeout = float(timeout)
        self.device = resolve_device(device if device is not None else "cpu")
        self._reset()

    def _reset(self) -> None:
        self._cond = threading.Condition()
        self._rounds: Dict[int, _Round] = {}
        self._mail: Dict[Tuple[int, int], List[torch.Tensor]] = {}
        self._aborted: Optional[BaseException] = None
        self._abort_rank: Optional[int] = None
        self._finished = [False] * self.world_size
        self._first_failure: Optional[Tuple[int, BaseException]] = None
        self._progress = time.monotonic()   # when a wait last ended (any rank)

    # -- public ------------------------------------------------------------------------------
    def communicator(self, rank: int) -> "LocalCommunicator":
        return LocalCommunicator(self, rank)

    def run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> List[Any]:
        """Run ``fn(comm, *args, **kwargs)`` on every rank (one thread each); results by rank."""
        self._reset()
        P = self.world_size
        results: List[Any] = [None] * P
        comms = [LocalCommunicator(self, r) for r in range(P)]

        def body(r: int) -> None:
            try:
                results[r] = fn(comms[r], *args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - re-raised by run()
                self._fail(r, exc)
            finally:
                with self._cond:
                    self._finished[r] = True
                    self._cond.notify_all()

        threads = [threading.Thread(target=body, args=(r,), name=f"LocalCluster-rank{r}",
                                    daemon=True) for r in range(P)]
        for t in threads:
            t.start()
        stuck = []
        for r, t in enumerate(threads):
            # A rank blocked in the communicator ends at most `timeout` after the abort; a rank
            # stuck in user code cannot be interrupted: give up on it once nothing has moved for
            # a generous bound (a long run that keeps communicating is not cut off).
            while True:
                t.join(1.0)
                quiet = time.monotonic() - self._progress
                bound = self.timeout * (2 if self._first_failure is None else 1) + self.GRACE
                if not t.is_alive() or quiet > bound:
                    break
            if t.is_alive():
                stuck.append(r)
        if self._first_failure is not None:
            r, exc = self._first_failure
            raise exc
        if stuck:
            raise CommTimeout(f"LocalCluster: ranks {stuck} did not finish")
        return results

    # -- failure handling --------------------------------------------------------------------
    def _fail(self, rank: int, exc: BaseException) -> None:
        with self._cond:
            if self._first_failure is None and not (
                    isinstance(exc, CommAborted) and self._aborted is not None):
                _note(exc, f"(raised on LocalCluster rank {rank} of {self.world_size})")
                self._first_failure = (rank, exc)
            if self._aborted is None:
                self._aborted = exc
                self._abort_rank = rank
            self._cond.notify_all()

    def _check_abort(self) -> None:
        if self._aborted is not None:
            raise CommAborted(f"communicator aborted: rank {self._abort_rank} failed with "
                              f"{type(self._aborted).__name__}: {self._aborted}")

    def _wait(self, pred: Callable[[], bool], rank: int, what: str,
              missing: Callable[[], List[int]]) -> None:
        """Wait (holding ``_cond``) until ``pred()``; raises on abort or timeout."""
        deadline = time.monotonic() + self.timeout
        while True:
            self._check_abort()
            if pred():
                self._progress = time.monotonic()
                return
            miss = missing()
            if miss and all(self._finished[m] for m in miss):
                raise CommTimeout(f"rank {rank}: {what}: ranks {miss} returned without joining")
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommTimeout(f"rank {rank}: {what}: timed out after {self.timeout:g}s "
                                  f"waiting for ranks {miss}")
            self._cond.wait(min(left, 1.0))


class LocalCommunicator(Communicator):
    """Rank ``rank`` of a :class:`LocalCluster`."""

    def __init__(self, cluster: LocalCluster, rank: int) -> None:
        super().__init__()
        self.cluster = cluster
        self.rank = int(rank)
        self.world_size = cluster.world_size
        self.device = cluster.device
        self._seq = 0

    # -- rendezvous machinery ----------------------------------------------------------------
    def _arrive(self, op: str, sig: Any, payload: Any) -> _Round:
        c = self.cluster
        P = self.world_size
        with c._cond:
            c._check_abort()
            seq = self._seq
            self._seq += 1
            rnd = c._rounds.get(seq)
            if rnd is None:
                rnd = c._rounds[seq] = _Round(op, sig, P)
                rnd.shared["seq"] = seq
            elif rnd.op != op or rnd.sig != sig:
                raise CommError(f"rank {self.rank}: collective #{seq} mismatch: this rank called "
                                f"{op}{sig}, another rank {rnd.op}{rnd.sig}")
            rnd.payloads[self.rank] = payload
            rnd.arrived += 1
            if rnd.arrived == P:
                c._cond.notify_all()
            else:
                def missing() -> List[int]:
                    return [r for r in range(P) if rnd.payloads[r] is None]

                c._wait(lambda: rnd.arrived == P, self.rank, f"{op} #{seq}", missing)
            return rnd

    def _depart(self, rnd: _Round, wait: bool) -> None:
        c = self.cluster
        P = self.world_size
        with c._cond:
            rnd.departed += 1
            if rnd.departed == P:
                c._rounds.pop(rnd.shared["seq"], None)
                c._cond.notify_all()
                return
            if wait:
                done = rnd.shared.setdefault("departed_ranks", set())
                done.add(self.rank)
                c._wait(lambda: rnd.departed == P, self.rank, f"{rnd.op} (completion)",
                        lambda: [r for r in range(P) if r not in done])
            else:
                rnd.shared.setdefault("departed_ranks", set()).add(self.rank)

    # -- primitives --------------------------------------------------------------------------
    def send_recv(self, sends: Sequence[Tuple[int, torch.Tensor]],
                  recvs: Sequence[Tuple[int, torch.Tensor]]) -> None:
        c = self.cluster
        for peer, _ in list(sends) + list(recvs):
            self._check_peer(peer)
        staged = [(peer, t.detach().clone(memory_format=torch.contiguous_format))
                  for peer, t in sends]  # copied outside the lock
        with c._cond:
            c._check_abort()
            for (peer, t), (_, orig) in zip(staged, sends):
                c._mail.setdefault((self.rank, peer), []).append(t)
                self._count_send(orig, peer)
            if staged:
                c._cond.notify_all()
        for peer, out in recvs:
            key = (peer, self.rank)
            with c._cond:
                c._wait(lambda: bool(c._mail.get(key)), self.rank, f"recv from {peer}",
                        lambda: [peer])
                msg = c._mail[key].pop(0)
            if msg.numel() != out.numel() or msg.dtype != out.dtype:
                raise CommError(f"rank {self.rank}: recv from {peer}: got {msg.numel()} x "
                                f"{msg.dtype}, buffer holds {out.numel()} x {out.dtype}")
            out.copy_(msg.view(out.shape))

    def allgather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        P = self.world_size
        m = self._check_allgather(output, input)
        rnd = self._arrive("allgather", (m, input.dtype), input)
        try:
            out = output.view(-1)
            for r in range(P):
                src = rnd.payloads[r]
                dst = out[r * m:(r + 1) * m]
                if r == self.rank and src.data_ptr() == dst.data_ptr() and src.is_contiguous():
                    continue
                dst.copy_(src.reshape(-1))
        finally:
            self._depart(rnd, wait=True)
        self._count_allgather(input)

    def allreduce(self, tensor: torch.Tensor) -> None:
        P = self.world_size
        n = tensor.numel()
        if P == 1:
            return
        rnd = self._arrive("allreduce", (n, tensor.dtype), tensor)
        ok = False
        try:
            with self.cluster._cond:
                res = rnd.shared.get("result")
                if res is None:
                    res = rnd.shared["result"] = torch.empty(n, dtype=tensor.dtype,
                                                             device=tensor.device)
            # rank r reduces the r-th slice, summing in rank order: bitwise identical everywhere
            lo, hi = n * self.rank // P, n * (self.rank + 1) // P
            if hi > lo:
                acc = res[lo:hi]
                acc.copy_(rnd.payloads[0].reshape(-1)[lo:hi])
                for q in range(1, P):
                    acc.add_(rnd.payloads[q].reshape(-1)[lo:hi])
            ok = True
        finally:
            self._depart_phase(rnd, "reduced", ok)
        tensor.copy_(res.view(tensor.shape))
        self._count_allreduce(tensor)

    def _depart_phase(self, rnd: _Round, name: str, ok: bool) -> None:
        """An intermediate barrier inside a round (every rank passes it once)."""
        c = self.cluster
        P = self.world_size
        with c._cond:
            done = rnd.shared.setdefault(name, set())
            done.add(self.rank)
            if not ok:
                return
            if len(done) == P:
                c._cond.notify_all()
                rnd.departed = P  # no later phase reads the round: drop it
                c._rounds.pop(rnd.shared["seq"], None)
                return
            c._wait(lambda: len(done) == P, self.rank, f"{rnd.op} (reduce)",
                    lambda: [r for r in range(P) if r not in done])

    def alltoall(self, output: torch.Tensor, input: torch.Tensor) -> None:
        P = self.world_size
        b = input.numel()
        m = self._check_alltoall(output, input)
        rnd = self._arrive("alltoall", (b, input.dtype), input)
        try:
            out = output.view(-1)
            r0 = self.rank
            for q in range(P):
                out[q * m:(q + 1) * m].copy_(rnd.payloads[q].reshape(-1)[r0 * m:(r0 + 1) * m])
        finally:
            self._depart(rnd, wait=True)
        self._count_alltoall(input)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        self._check_peer(root)
        if self.world_size == 1:
            return
        rnd = self._arrive("broadcast", (tensor.numel(), tensor.dtype, root), tensor)
        try:
            if self.rank != root:
                tensor.copy_(rnd.payloads[root].view(tensor.shape)
                             if rnd.payloads[root].is_contiguous()
                             else rnd.payloads[root].reshape(tensor.shape))
        finally:
            self._depart(rnd, wait=(self.rank == root))
        self._count_broadcast(tensor, root)

    def barrier(self) -> None:
        if self.world_size == 1:
            return
        rnd = self._arrive("barrier", (), True)
        self._depart(rnd, wait=False)


class SingleCommunicator(Communicator):
    """A world of one: every primitive is a local copy or a no-op; ``bytes_sent`` stays 0."""

    graph_capturable = True     # copies and no-ops on the current stream

    def __init__(self, device: torch.device | str = "cpu") -> None:
        super().__init__()
        self.rank = 0
        self.world_size = 1
        self.device = resolve_device(device)

    def send_recv(self, sends, recvs) -> None:
        sends = list(sends)
        for peer, _ in sends + list(recvs):
            self._check_peer(peer)
        for (_, s), (_, r) in zip(sends, recvs):
            r.copy_(s.reshape(r.shape))
        if len(sends) != len(recvs):
            raise CommError("SingleCommunicator: unmatched send/recv to self")

    def allgather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if output.numel() != input.numel():
            raise ValueError("allgather: output must hold world_size * input.numel() elements")
        if output.data_ptr() != input.data_ptr():
            output.view(-1).copy_(input.reshape(-1))

    def allreduce(self, tensor: torch.Tensor) -> None:
        return None

    def alltoall(self, output: torch.Tensor, input: torch.Tensor) -> None:
        if output.numel() != input.numel():
            raise ValueError("alltoall: output and input must have the same numel")
        if output.data_ptr() != input.data_ptr():
            output.view(-1).copy_(input.reshape(-1))

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        self._check_peer(root)

    def barrier(self) -> None:
        return None
