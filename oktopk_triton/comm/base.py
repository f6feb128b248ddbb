"""The communicator interface every algorithm is written against.

All primitives take tensors whose sizes the caller fixed in advance (static sizes), so that on a
GPU every call can be enqueued on the current stream without reading anything back to the host.

Byte counting (``bytes_sent``) is the same on every backend and counts the per-rank volume of the
bandwidth-optimal algorithm for each primitive, so measured volumes compare with the papers'
formulas (docs/algorithms.md §6):

=====================  ======================================
primitive              bytes added to ``bytes_sent``
=====================  ======================================
send of b bytes        b
allgather, chunk c     (P-1)·c
allreduce of b bytes   2(P-1)/P·b
alltoall of b bytes    (P-1)/P·b   (b = the whole input)
broadcast of b bytes   b on the root, 0 elsewhere
barrier                0
=====================  ======================================
"""
from __future__ import annotations

import abc
import contextlib
import functools
from typing import ContextManager, Sequence, Tuple

import torch

__all__ = ["Communicator", "CommError", "CommAborted", "CommTimeout", "tensor_bytes",
           "ring_allreduce_bytes"]


class CommError(RuntimeError):
    """Base class of communication failures."""


class CommAborted(CommError):
    """Raised on a rank when another rank failed (the group is torn down)."""


class CommTimeout(CommError):
    """Raised when a peer did not arrive within the communicator's timeout."""


def resolve_device(device) -> torch.device:
    """``torch.device(device)`` with a bare ``"cuda"`` pinned to the current CUDA device, so that
    it compares equal to the device of the tensors made on it (``cuda:0 != cuda``)."""
    dev = torch.device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


def tensor_bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


_PRIMITIVES = ("send_recv", "allgather", "allreduce", "alltoall", "broadcast")


def ring_allreduce_bytes(nbytes: int, P: int) -> int:
    """Bytes one rank sends in a ring allreduce of ``nbytes``: ``2(P-1)/P`` of them (what
    ``allreduce`` adds to ``bytes_sent``)."""
    return 2 * (P - 1) * int(nbytes) // P


def _counted(primitive):
    """Wrap a primitive so that each outermost call with P > 1 adds 1 to ``collectives_issued``
    (a backend that builds one primitive from another counts once)."""
    @functools.wraps(primitive)
    def call(self, *args, **kwargs):
        if self.__dict__.get("_in_primitive", False):
            return primitive(self, *args, **kwargs)
        if self.world_size > 1:
            self.collectives_issued = self.__dict__.get("collectives_issued", 0) + 1
        self._in_primitive = True
        try:
            return primitive(self, *args, **kwargs)
        finally:
            self._in_primitive = False
    call._counted = True
    return call


class Communicator(abc.ABC):
    """A group of ``world_size`` ranks; this object is rank ``rank`` of it.

    Attributes:
        rank, world_size: this rank and the group size.
        device: where this rank's tensors live (``cpu`` or ``cuda:i``).
        bytes_sent: cumulative bytes this rank has put on the wire (see the module docstring).
        collectives_issued: cumulative number of primitives issued with P > 1 (a grouped
            ``send_recv`` batch counts as one; ``barrier`` is not counted).
        graph_capturable: every primitive only enqueues work on the current CUDA stream, so a
            step can be captured in a CUDA graph (``oktopk_triton.modes.graph``); False where a
            primitive synchronises in Python (threads, gloo).
    """

    rank: int
    world_size: int
    device: torch.device
    graph_capturable: bool = False

    def __init__(self) -> None:
        self.bytes_sent = 0
        self.collectives_issued = 0

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        for name in _PRIMITIVES:
            f = cls.__dict__.get(name)
            if f is not None and not getattr(f, "_counted", False):
                setattr(cls, name, _counted(f))

    # -- primitives -------------------------------------------------------------------------
    @abc.abstractmethod
    def send_recv(
        self,
        sends: Sequence[Tuple[int, torch.Tensor]],
        recvs: Sequence[Tuple[int, torch.Tensor]],
    ) -> None:
        """Issue a batch of point-to-point transfers together (one NCCL group) and complete them.

        ``sends`` is a list of ``(peer, tensor)``, ``recvs`` of ``(peer, tensor)`` to fill. The
        transfers between one pair of ranks are matched in the order they are listed. Counts the
        bytes of every send (a send to oneself is a local copy and counts nothing).
        """

    @abc.abstractmethod
    def allgather(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """``output`` (numel = P·input.numel(), contiguous) receives rank r's ``input`` as
        chunk r."""

    @abc.abstractmethod
    def allreduce(self, tensor: torch.Tensor) -> None:
        """In-place sum over ranks. The result is bitwise identical on every rank."""

    @abc.abstractmethod
    def alltoall(self, output: torch.Tensor, input: torch.Tensor) -> None:
        """Equal splits: chunk j of ``input`` (numel/P elements) goes to rank j and lands there as
        chunk r of ``output`` (r = this rank)."""

    @abc.abstractmethod
    def broadcast(self, tensor: torch.Tensor, root: int = 0) -> None:
        """In place: every rank ends with ``root``'s tensor."""

    @abc.abstractmethod
    def barrier(self) -> None:
        """Wait until every rank has arrived."""

    # -- CUDA graphs (oktopk_triton.modes.graph) ----------------------------------------------
    def capture_guard(self) -> ContextManager[None]:
        """Entered around the capture of a CUDA graph of a step: a backend whose helper thread
        makes CUDA calls (NCCL's watchdog) pauses it inside. Default: nothing to pause."""
        return contextlib.nullcontext()

    def track_replay(self) -> None:
        """Called after a captured step was replayed on the current stream: a backend that
        watches its primitives for a timeout watches the replay too. Default: nothing."""

    # -- byte counting helpers shared by the backends ---------------------------------------
    def _count_send(self, t: torch.Tensor, peer: int) -> None:
        if peer != self.rank:
            self.bytes_sent += tensor_bytes(t)

    def _count_allgather(self, input: torch.Tensor) -> None:
        self.bytes_sent += (self.world_size - 1) * tensor_bytes(input)

    def _count_allreduce(self, t: torch.Tensor) -> None:
        P = self.world_size
        self.bytes_sent += ring_allreduce_bytes(tensor_bytes(t), P)

    def _count_alltoall(self, input: torch.Tensor) -> None:
        P = self.world_size
        self.bytes_sent += (P - 1) * tensor_bytes(input) // P

    def _count_broadcast(self, t: torch.Tensor, root: int) -> None:
        if self.rank == root and self.world_size > 1:
            self.bytes_sent += tensor_bytes(t)

    def _broadcast_buffer(self, tensor: torch.Tensor, root: int):
        """A broadcast's start: check ``root``; ``None`` when this is the only rank (nothing to
        do), else a contiguous stand-in for ``tensor`` (itself when it is contiguous)."""
        self._check_peer(root)
        if self.world_size == 1:
            return None
        return tensor if tensor.is_contiguous() else tensor.contiguous()

    def _end_broadcast(self, tensor: torch.Tensor, buf: torch.Tensor, root: int) -> None:
        """Copy a broadcast's contiguous stand-in ``buf`` back into ``tensor``; count it."""
        if buf is not tensor:
            tensor.copy_(buf)
        self._count_broadcast(tensor, root)

    # -- checks shared by the backends -------------------------------------------------------
    def _check_peer(self, peer: int) -> None:
        if not (0 <= peer < self.world_size):
            raise ValueError(f"peer {peer} out of range for world_size {self.world_size}")

    def _check_send_recv(self, sends, recvs):
        """Validate peers; return ``(sends, recvs, self_pairs)``: the transfers to other ranks
        and the (send, recv) pairs to oneself (local copies, matched in order)."""
        sends, recvs = list(sends), list(recvs)
        for peer, _ in sends + recvs:
            self._check_peer(peer)
        self_sends = [t for p, t in sends if p == self.rank]
        self_recvs = [t for p, t in recvs if p == self.rank]
        if len(self_sends) != len(self_recvs):
            raise CommError(f"rank {self.rank}: {len(self_sends)} sends to self but "
                            f"{len(self_recvs)} receives from self")
        return ([(p, t) for p, t in sends if p != self.rank],
                [(p, t) for p, t in recvs if p != self.rank],
                list(zip(self_sends, self_recvs)))

    def _check_allgather(self, output: torch.Tensor, input: torch.Tensor) -> int:
        """Validate an allgather's buffers; return the chunk size (elements)."""
        P, m = self.world_size, input.numel()
        if output.numel() != P * m:
            raise ValueError(f"allgather: output has {output.numel()} elements, expected {P}*{m}")
        if not output.is_contiguous():
            raise ValueError("allgather: output must be contiguous")
        if output.dtype != input.dtype:
            raise TypeError(f"allgather: output dtype {output.dtype} differs from input dtype "
                            f"{input.dtype}")
        return m

    def _check_alltoall(self, output: torch.Tensor, input: torch.Tensor) -> int:
        """Validate an alltoall's buffers; return the split size (elements)."""
        P, b = self.world_size, input.numel()
        if b % P or output.numel() != b:
            raise ValueError(f"alltoall: input ({b}) and output ({output.numel()}) must have the "
                             f"same numel, divisible by {P}")
        if not output.is_contiguous():
            raise ValueError("alltoall: output must be contiguous")
        if output.dtype != input.dtype:
            raise TypeError(f"alltoall: output dtype {output.dtype} differs from input dtype "
                            f"{input.dtype}")
        return b // P

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(rank={self.rank}, world_size={self.world_size}, "
                f"device={self.device})")
