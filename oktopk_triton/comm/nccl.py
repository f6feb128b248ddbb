"""``NcclCommunicator``: NCCL through ``cupy.cuda.nccl`` on torch's current CUDA stream.

Every primitive is enqueued on ``torch.cuda.current_stream(device)`` by passing raw
``data_ptr()``s; nothing synchronises with the host. Point-to-point batches and the all-to-all are
one NCCL group (``groupStart()/groupEnd()``). cupy is imported only here, when a communicator is
built, so the package works without it.

Construction:

* ``NcclCommunicator(rank, world_size, unique_id, device=None)``: ``unique_id`` is the tuple of
  ``nccl.get_unique_id()`` made on one rank and shared by the caller (``device``: default the
  current CUDA device);
* ``NcclCommunicator.from_torch_distributed(group=None)``: rank and size from the torch.distributed
  group, the unique id made on group rank 0 and broadcast through the group (any backend).

Running several ranks on one GPU (tests): NCCL refuses duplicate GPUs in one communicator unless
every rank looks like a different host, e.g. ``NCCL_HOSTID=rank<r>`` set per process before
construction (see ``tests/distutil.py::run_nccl``).
"""
from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch

from .base import CommError, Communicator

__all__ = ["NcclCommunicator", "nccl_dtype"]

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
                          "(pip install 'oktopk-triton[cuda12]')") from exc
    return nccl


class NcclCommunicator(Communicator):
    """Rank ``rank`` of an NCCL communicator of ``world_size`` ranks (see the module docstring)."""

    def __init__(self, rank: int, world_size: int, unique_id, device=None) -> None:
        super().__init__()
        self._nccl = _import_nccl()
        import cupy

        if device is None:
            device = torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"NcclCommunicator needs a CUDA device, got {device}")
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.rank = int(rank)
        self.world_size = int(world_size)
        uid = tuple(int(x) for x in unique_id)
        with cupy.cuda.Device(device.index):
            self._comm = self._nccl.NcclCommunicator(self.world_size, uid, self.rank)

    @staticmethod
    def get_unique_id() -> tuple:
        return tuple(_import_nccl().get_unique_id())

    @classmethod
    def from_torch_distributed(cls, group=None, device=None) -> "NcclCommunicator":
        import torch.distributed as dist

        if not dist.is_initialized():
            raise CommError("from_torch_distributed: torch.distributed is not initialised")
        rank = dist.get_rank(group)
        world_size = dist.get_world_size(group)
        src = 0 if group is None else dist.get_global_rank(group, 0)
        obj: List[Optional[tuple]] = [cls.get_unique_id() if rank == 0 else None]
        backend = str(dist.get_backend(group)).lower()
        if "nccl" in backend:
            dev = torch.device(device) if device is not None else torch.device(
                "cuda", torch.cuda.current_device())
            dist.broadcast_object_list(obj, src=src, group=group, device=dev)
        else:
            dist.broadcast_object_list(obj, src=src, group=group)
        return cls(rank, world_size, obj[0], device=device)

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

    def abort(self) -> None:
        """Abort the NCCL communicator (unblocks ranks stuck in NCCL after a peer failed)."""
        if getattr(self, "_comm", None) is not None:
            self._comm.abort()
            self._comm = None

    def close(self) -> None:
        if getattr(self, "_comm", None) is not None:
            self._comm.destroy()
            self._comm = None

    def check_async_error(self) -> None:
        self._comm.check_async_error()

    # -- primitives --------------------------------------------------------------------------
    def send_recv(self, sends: Sequence[Tuple[int, torch.Tensor]],
                  recvs: Sequence[Tuple[int, torch.Tensor]]) -> None:
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
        self._check_allgather(output, input)
        self._check(output, input)
        inp = input.contiguous()
        count, dt = self._bytes_view(inp)
        self._comm.allGather(inp.data_ptr(), output.data_ptr(), count, dt, self._stream())
        self._count_allgather(input)

    def allreduce(self, tensor: torch.Tensor) -> None:
        self._check(tensor)
        dt = nccl_dtype(tensor.dtype)
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        if self.world_size > 1:
            self._comm.allReduce(buf.data_ptr(), buf.data_ptr(), buf.numel(), dt, _NCCL_SUM,
                                 self._stream())
        if buf is not tensor:
            tensor.copy_(buf)
        self._count_allreduce(tensor)

    def alltoall(self, output: torch.Tensor, input: torch.Tensor) -> None:
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
        self._check_peer(root)
        self._check(tensor)
        buf = tensor if tensor.is_contiguous() else tensor.contiguous()
        if self.world_size > 1:
            count, dt = self._bytes_view(buf)
            self._comm.broadcast(buf.data_ptr(), buf.data_ptr(), count, dt, root, self._stream())
        if buf is not tensor:
            tensor.copy_(buf)
        self._count_broadcast(tensor, root)

    def barrier(self) -> None:
        """A one-element allreduce on the stream: orders the streams, never blocks the host."""
        if self.world_size == 1:
            return
        t = torch.zeros(1, device=self.device)
        self._comm.allReduce(t.data_ptr(), t.data_ptr(), 1, _NCCL_DTYPES[torch.float32],
                             _NCCL_SUM, self._stream())
