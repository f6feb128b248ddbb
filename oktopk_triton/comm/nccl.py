"""``NcclCommunicator``: NCCL through ``cupy.cuda.nccl`` on torch's current CUDA stream.

Every primitive is enqueued on ``torch.cuda.current_stream(device)`` by passing raw
``data_ptr()``s; nothing synchronises with the host. Point-to-point batches and the all-to-all are
one NCCL group (``groupStart()/groupEnd()``). cupy is imported only here, when a communicator is
built, so the package works without it.

Construction:

* ``NcclCommunicator(rank, world_size, unique_id, device=None, *, timeout=600, peers=None)``:
  ``unique_id`` is what ``NcclCommunicator.get_unique_id()`` (or cupy's ``nccl.get_unique_id()``)
  made on one rank, shared by the caller (``device``: default the current CUDA device);
* ``NcclCommunicator.from_torch_distributed(group=None)``: rank and size from the torch.distributed
  group; the unique id made on group rank 0 and every rank's (host, pid) are exchanged through the
  group (any backend: a gloo group is the usual bootstrap).

Running several ranks on one GPU: NCCL refuses duplicate GPUs in one communicator unless every
rank looks like a different host, e.g. ``NCCL_HOSTID=rank<r>`` set per process before
construction (see ``tests/distutil.py::run_nccl`` and ``oktopk-bench collectives --backend
nccl``); start the MPS daemon first, or the ranks are time-sliced on the GPU.

Measured why: docs/research/design-notes.md, ``oktopk_triton/comm/nccl.py``.
"""
from __future__ import annotations

import collections
import contextlib
import platform
import threading
import time
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .base import CommAborted, CommError, CommTimeout, Communicator, resolve_device
from .peers import PeerIdentity, describe_lost, my_identity, process_alive

__all__ = ["NcclCommunicator", "nccl_dtype", "unique_id_bytes", "NCCL_UNIQUE_ID_BYTES"]

NCCL_UNIQUE_ID_BYTES = 128

# ncclDataType_t values (stable NCCL ABI); bf16 = ncclBfloat16 = 9 (cupy may not export it)
_NCCL_DTYPES = {
    torch.int8: 0,
    torch.uint8: 1,
    torch.int32: 2,
    torch.int64: 4,
    torch.float16: 6,
    torch.float32: 7,
    torch.float64: 8,
    torch.bfloat16: 9,
}
_NCCL_SUM = 0
_NCCL_UINT8 = 1


def nccl_dtype(dtype: torch.dtype) -> int:
    try:
        return _NCCL_DTYPES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by NcclCommunicator") from None


def _import_nccl():
    try:
        from cupy.cuda import nccl
    except Exception as exc:  # pragma: no cover - depends on the environment
        raise ImportError("NcclCommunicator needs cupy with NCCL support "
                          "(pip install 'oktopk-triton[cuda12]' or '[cuda13]')") from exc
    return nccl


def unique_id_bytes(unique_id) -> bytes:
    """The 128 raw bytes of an NCCL unique id given as ``bytes`` (cupy >= 14) or as a sequence of
    128 C chars (older cupy: ints in -128..127, or 0..255 where char is unsigned)."""
    if isinstance(unique_id, (bytes, bytearray, memoryview)):
        raw = bytes(unique_id)
    else:
        vals = [int(x) for x in unique_id]
        if any(not -128 <= v <= 255 for v in vals):
            raise ValueError("an NCCL unique id holds byte values (-128..255)")
        raw = bytes(v & 0xFF for v in vals)
    if len(raw) != NCCL_UNIQUE_ID_BYTES:
        raise ValueError(f"an NCCL unique id has {NCCL_UNIQUE_ID_BYTES} bytes, got {len(raw)}")
    return raw


def _char_is_signed() -> bool:
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def _unique_id_forms(raw: bytes) -> List[object]:
    """The forms a cupy ``NcclCommunicator`` may accept, the likeliest first."""
    signed = tuple(b - 256 if b > 127 else b for b in raw)
    unsigned = tuple(raw)
    tuples = [signed, unsigned] if _char_is_signed() else [unsigned, signed]
    return [raw] + tuples


def _new_nccl_comm(nccl, world_size: int, raw: bytes, rank: int):
    """``nccl.NcclCommunicator(world_size, id, rank)`` with the id in the form this cupy takes.

    cupy checks the argument's type (TypeError) and the char range (OverflowError) before it
    calls NCCL, so a refused form has no side effect and the next one is tried."""
    refusals = []
    for uid in _unique_id_forms(raw):
        try:
            return nccl.NcclCommunicator(world_size, uid, rank)
        except (TypeError, OverflowError) as exc:
            refusals.append(f"{type(uid).__name__}: {type(exc).__name__}: {exc}")
    raise TypeError("cupy's NcclCommunicator accepts no known form of the unique id ("
                    + "; ".join(refusals) + ")")


class NcclCommunicator(Communicator):
    """Rank ``rank`` of an NCCL communicator of ``world_size`` ranks (see the module docstring).

    Args:
        unique_id: the NCCL unique id made on one rank (bytes or a tuple of 128 chars).
        device: this rank's CUDA device (default: the current one).
        timeout: seconds a primitive may stay incomplete on the GPU before the watchdog aborts
            the communicator (``None``: no watchdog, the NCCL default of waiting forever).
        peers: every rank's ``(host, pid)``, to name a lost peer in errors
            (``from_torch_distributed`` fills it).
        poll_interval: seconds between two checks of the watchdog.
    """

    graph_capturable = True     # NCCL calls on torch's current stream, nothing in Python

    def __init__(self, rank: int, world_size: int, unique_id, device=None, *,
                 timeout: Optional[float] = 600.0,
                 peers: Optional[Sequence[PeerIdentity]] = None,
                 poll_interval: float = 0.05) -> None:
        super().__init__()
        self._nccl = _import_nccl()
        import cupy

        device = resolve_device(device if device is not None else "cuda")
        if device.type != "cuda":
            raise ValueError(f"NcclCommunicator needs a CUDA device, got {device}")
        self.device = device
        self.rank = int(rank)
        self.world_size = int(world_size)
        self.timeout = None if timeout is None else float(timeout)
        self.peers: Dict[int, PeerIdentity] = (
            {r: (str(h), int(p)) for r, (h, p) in enumerate(peers)} if peers is not None else {})
        raw = unique_id_bytes(unique_id)
        with cupy.cuda.Device(device.index):
            self._comm = _new_nccl_comm(self._nccl, self.world_size, raw, self.rank)
        self._failure: Optional[CommError] = None
        self._lock = threading.Lock()
        # (issue time, what, event) of enqueued primitives, oldest first; spare events
        self._pending: collections.deque = collections.deque()
        self._spare_events: collections.deque = collections.deque()
        self._stop = threading.Event()
        # held by the watchdog for each poll and by capture_guard for a whole capture
        self._poll_lock = threading.RLock()
        self._watchdog: Optional[threading.Thread] = None
        if self.timeout is not None and self.world_size > 1:
            self._watchdog = threading.Thread(
                target=_watchdog_loop, args=(weakref.ref(self), self._stop, float(poll_interval)),
                name=f"NcclCommunicator-watchdog-rank{self.rank}", daemon=True)
            self._watchdog.start()

    @staticmethod
    def get_unique_id() -> bytes:
        """A new NCCL unique id as its 128 raw bytes (whatever form this cupy returns)."""
        return unique_id_bytes(_import_nccl().get_unique_id())

    @classmethod
    def from_torch_distributed(cls, group=None, device=None, **kwargs) -> "NcclCommunicator":
        """Collective over ``group``: rank 0 makes the unique id; the id and every rank's
        (host, pid) travel in one ``all_gather_object`` (the id as 128 raw bytes)."""
        import contextlib

        import torch.distributed as dist

        if not dist.is_initialized():
            raise CommError("from_torch_distributed: torch.distributed is not initialised")
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        mine = (cls.get_unique_id() if rank == 0 else None, *my_identity())
        items: List[Optional[tuple]] = [None] * world_size
        backend = str(dist.get_backend(group)).lower()
        ctx = contextlib.nullcontext()
        if "nccl" in backend and device is not None:
            ctx = torch.cuda.device(torch.device(device))  # the device object collectives use
        with ctx:
            dist.all_gather_object(items, mine, group=group)
        uid = items[0][0]
        peers = [(h, p) for _, h, p in items]
        return cls(rank, world_size, uid, device=device, peers=peers, **kwargs)

    # -- helpers -----------------------------------------------------------------------------
    def _stream(self) -> int:
        return torch.cuda.current_stream(self.device).cuda_stream

    def _check(self, *tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.device != self.device:
                raise ValueError(f"NcclCommunicator on {self.device} got a tensor on {t.device}")

    @staticmethod
    def _bytes_view(t: torch.Tensor) -> Tuple[int, int]:
        """(count, dtype) for a transfer that only moves bytes (any dtype)."""
        if t.dtype in _NCCL_DTYPES:
            return t.numel(), _NCCL_DTYPES[t.dtype]
        return t.numel() * t.element_size(), _NCCL_UINT8

    # -- failures ----------------------------------------------------------------------------
    def _diagnose(self) -> Tuple[List[int], str]:
        if not self.peers:
            return [], "peers unknown (build with from_torch_distributed or pass peers=)"
        from .peers import _lost_with_grace
        lost, unchecked = _lost_with_grace(self.peers, self.rank, process_alive, 1.0)
        return lost, describe_lost(self.peers, lost, unchecked, self.rank)

    def _record_failure(self, exc: Optional[BaseException], what: str,
                        timed_out: bool = False) -> CommError:
        """Abort the NCCL communicator and keep the error every later call raises."""
        with self._lock:
            if self._failure is not None:
                return self._failure
            lost, text = self._diagnose()
            msg = f"rank {self.rank}: {what}"
            if exc is not None:
                msg += f": {type(exc).__name__}: {exc}"
            if text:
                msg += f" [{text}]"
            err: CommError = (CommTimeout(msg) if timed_out and not lost else CommAborted(msg))
            err.lost_ranks = lost
            if exc is not None:
                err.__cause__ = exc
            self._failure = err
            self._abort_nccl()
        self._stop.set()
        return err

    def _abort_nccl(self) -> None:
        comm = getattr(self, "_comm", None)
        if comm is None:
            return
        try:
            comm.abort()  # the kernels waiting on a lost peer return; the comm is freed
        except Exception:  # noqa: BLE001 - NCCL < 2.4 has no abort; nothing more to do
            pass

    def _raise_if_failed(self) -> None:
        if self._failure is not None:
            raise type(self._failure)(str(self._failure)) from self._failure

    def check(self) -> None:
        """Raise the recorded failure, if any, after polling NCCL's asynchronous error once."""
        self._raise_if_failed()
        self.check_async_error()

    def check_async_error(self) -> None:
        """``ncclCommGetAsyncError``: an error makes the communicator abort and raise."""
        self._raise_if_failed()
        if self._comm is None:
            raise CommError(f"rank {self.rank}: NcclCommunicator is closed")
        try:
            self._comm.check_async_error()
        except Exception as exc:  # noqa: BLE001 - cupy's NcclError
            raise self._record_failure(exc, "NCCL asynchronous error") from exc

    def synchronize(self, timeout: Optional[float] = None) -> None:
        """Wait until this rank's stream has done everything enqueued so far, without blocking in
        CUDA: polls the stream, so a failure the watchdog (or this loop) finds is raised here."""
        self._raise_if_failed()
        stream = torch.cuda.current_stream(self.device)
        ev = torch.cuda.Event()
        ev.record(stream)
        limit = self.timeout if timeout is None else timeout
        deadline = None if limit is None else time.monotonic() + limit
        while not ev.query():
            if self._watchdog is None or not self._watchdog.is_alive():
                self.check_async_error()
            self._raise_if_failed()
            if deadline is not None and time.monotonic() > deadline:
                raise self._record_failure(None, f"synchronize: not done after {limit:g}s",
                                           timed_out=True)
            time.sleep(0.0002)
        self._raise_if_failed()

    def _track(self, what: str) -> None:
        """Record an event after the primitive just enqueued, for the watchdog's timeout. Not
        while a CUDA graph is being captured (the watchdog's query of such an event, from its
        thread, would break the capture): replays of a graph are not tracked."""
        if self._watchdog is None or torch.cuda.is_current_stream_capturing():
            return
        ev = self._spare_events.popleft() if self._spare_events else torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._pending.append((time.monotonic(), what, ev))

    @contextlib.contextmanager
    def capture_guard(self):
        """Pause the watchdog around the capture of a CUDA graph (see the module docstring):
        waits for a poll in progress, then the watchdog makes no CUDA call until the block ends.
        Primitives pending meanwhile get the paused time added to their deadline."""
        with self._poll_lock:
            t0 = time.monotonic()
            try:
                yield
            finally:
                paused = time.monotonic() - t0
                self._pending = collections.deque(
                    (t + paused, what, ev) for t, what, ev in self._pending)

    def track_replay(self) -> None:
        """A captured step was just replayed on the current stream: the watchdog times it out
        like any primitive (an event recorded after the replay)."""
        self._raise_if_failed()
        self._track("graph replay")

    @contextlib.contextmanager
    def _enqueue(self, what: str):
        """Around the NCCL calls of one primitive: a failure to enqueue breaks the communicator;
        success records the primitive for the watchdog."""
        self._raise_if_failed()
        try:
            yield
        except (CommError, TypeError, ValueError):
            raise
        except Exception as exc:  # noqa: BLE001 - cupy's NcclError and CUDA errors
            raise self._record_failure(exc, what) from exc
        self._track(what)

    def abort(self) -> None:
        """Abort the NCCL communicator (unblocks ranks stuck in NCCL after a peer failed)."""
        self._stop.set()
        if getattr(self, "_comm", None) is not None:
            self._comm.abort()
            self._comm = None

    def close(self) -> None:
        self._stop.set()
        if getattr(self, "_comm", None) is not None:
            self._comm.destroy()
            self._comm = None

    # -- primitives --------------------------------------------------------------------------
    def send_recv(self, sends: Sequence[Tuple[int, torch.Tensor]],
                  recvs: Sequence[Tuple[int, torch.Tensor]]) -> None:
        self._raise_if_failed()
        sends, recvs, self_pairs = self._check_send_recv(sends, recvs)
        for _, t in sends + recvs:
            self._check(t)
        for s, r in self_pairs:
            r.copy_(s.reshape(r.shape))
        send_bufs = [(p, t.contiguous()) for p, t in sends]
        recv_bufs = []
        copy_back = []
        for p, t in recvs:
            buf = t if t.is_contiguous() else torch.empty_like(
                t, memory_format=torch.contiguous_format)
            if buf is not t:
                copy_back.append((t, buf))
            recv_bufs.append((p, buf))
        if send_bufs or recv_bufs:
            stream = self._stream()
            nccl = self._nccl
            with self._enqueue("send_recv"):
                nccl.groupStart()
                try:
                    for p, t in send_bufs:
                        count, dt = self._bytes_view(t)
                        self._comm.send(t.data_ptr(), count, dt, p, stream)
                    for p, t in recv_bufs:
                        count, dt = self._bytes_view(t)
                        self._comm.recv(t.data_ptr(), count, dt, p, stream)
                finally:
                    nccl.groupEnd()
            # keep temporaries alive until the stream has used them
            for _, t in send_bufs:
                t.record_stream(torch.cuda.current_stream(self.device))
        for t, buf in copy_back:
            t.copy_(buf)
        for p, t in sends:
            self._count_send(t, p)

    def allgather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._raise_if_failed()
        self._check_allgather(output, input)
        self._check(output, input)
        inp = input.contiguous()
        count, dt = self._bytes_view(inp)
        with self._enqueue("allgather"):
            self._comm.allGather(inp.data_ptr(), output.data_ptr(), count, dt, self._stream())
        self._count_allgather(input)

    def allreduce(self, tensor: torch.Tensor) -> None:
        self._raise_if_failed()
        self._check(tensor)
        dt = nccl_dtype(tensor.dtype)
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        if self.world_size > 1:
            with self._enqueue("allreduce"):
                self._comm.allReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(), dt, _NCCL_SUM,
                                     self._stream())
        if buf is not tensor:
            tensor.copy_(buf)
        self._count_allreduce(tensor)

    def alltoall(self, output: torch.Tensor, input: torch.Tensor) -> None:
        self._raise_if_failed()
        P = self.world_size
        m = self._check_alltoall(output, input)
        self._check(output, input)
        inp = input.reshape(-1).contiguous()
        if inp.data_ptr() == output.data_ptr():
            inp = inp.clone()
        out = output.view(-1)
        r = self.rank
        out[r * m:(r + 1) * m].copy_(inp[r * m:(r + 1) * m])
        if P > 1 and m > 0:
            stream = self._stream()
            nccl = self._nccl
            with self._enqueue("alltoall"):
                nccl.groupStart()
                try:
                    for q in range(P):
                        if q == r:
                            continue
                        s = inp[q * m:(q + 1) * m]
                        d = out[q * m:(q + 1) * m]
                        count, dt = self._bytes_view(s)
                        self._comm.send(s.data_ptr(), count, dt, q, stream)
                        self._comm.recv(d.data_ptr(), count, dt, q, stream)
                finally:
                    nccl.groupEnd()
            if inp is not input:
                inp.record_stream(torch.cuda.current_stream(self.device))
        self._count_alltoall(input)

    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        self._raise_if_failed()
        self._check_peer(root)
        self._check(tensor)
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        if self.world_size > 1:
            count, dt = self._bytes_view(buf)
            with self._enqueue("broadcast"):
                self._comm.broadcast(buf.data_ptr(), buf.data_ptr(), count, dt, root,
                                     self._stream())
        self._end_broadcast(tensor, buf, root)

    def barrier(self) -> None:
        """A one-element allreduce on the stream: orders the streams, never blocks the host."""
        if self.world_size == 1:
            return
        self._raise_if_failed()
        t = torch.zeros(1, device=self.device)
        with self._enqueue("barrier"):
            self._comm.allReduce(t.data_ptr(), t.data_ptr(), 1, _NCCL_DTYPES[torch.float32],
                                 _NCCL_SUM, self._stream())


def _watchdog_loop(ref, stop: threading.Event, interval: float) -> None:
    """The watchdog of one communicator (held weakly: a dropped communicator ends its thread).

    Every ``interval`` seconds: ``check_async_error()`` (a peer that died shows up here), then the
    oldest enqueued primitives: done ones are dropped, one incomplete after ``timeout`` seconds
    aborts the communicator. Each poll holds ``_poll_lock``: while a graph capture holds it
    (``capture_guard``) the watchdog waits and makes no CUDA call."""
    while not stop.wait(interval):
        comm = ref()
        if comm is None or comm._failure is not None:
            return
        try:
            with comm._poll_lock:
                if not _poll(comm):
                    return
        finally:
            del comm


def _poll(comm: "NcclCommunicator") -> bool:
    """One poll of the watchdog (under ``_poll_lock``); False when the watchdog should end."""
    if comm._failure is not None or comm._stop.is_set():
        return False
    nccl_comm = comm._comm
    if nccl_comm is None:
        return False
    try:
        nccl_comm.check_async_error()
    except Exception as exc:  # noqa: BLE001 - cupy's NcclError
        comm._record_failure(exc, "NCCL asynchronous error (a peer failed or is gone)")
        return False
    pending = comm._pending
    while pending:
        t_issued, what, ev = pending[0]
        if ev.query():
            pending.popleft()
            comm._spare_events.append(ev)
            continue
        if time.monotonic() - t_issued > comm.timeout:
            comm._record_failure(None, f"{what} not completed after {comm.timeout:g}s",
                                 timed_out=True)
            return False
        break
    return True

