"""A DistributedDataParallel communication hook that averages gradients with a sparse allreduce.

    from torch.nn.parallel import DistributedDataParallel as DDP
    from oktopk_triton.ddp import SparseAllreduceState, sparse_allreduce_hook

    model = DDP(model)
    state = SparseAllreduceState(density=0.01, algorithm="oktopk")
    model.register_comm_hook(state, sparse_allreduce_hook)
    # ... the ordinary loop: loss.backward() now reduces every bucket sparsely

How it works (cf. ``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``):

* DDP hands the hook one *bucket* at a time (a flat buffer of some parameters' gradients). The
  hook keeps one :class:`~oktopk_triton.algorithms.Algorithm` per bucket index, created on first
  use, each with its own error-feedback residual and its own thresholds/regions (``k =
  density * bucket size`` per bucket).
* DDP rebuilds its buckets after the first iteration (in the order the gradients became ready),
  so a reducer built in iteration 0 would be built for the wrong bucket. Until
  ``state.start_iter`` iterations have completed (default 1, the smallest safe value), the hook
  does a plain dense allreduce (``buffer / world_size`` then a sum, as DDP's default hook does).
* ``mode="flat"`` (the default): the buckets of an iteration are collected and, when the last
  one arrives, the whole iteration's gradient is reduced as ONE flat vector by one reducer (k =
  density · all parameters: the top entries of the whole model, not of each bucket); the earlier
  buckets' futures complete then. ``mode="bucket"``: one reducer per bucket, each reduced as it
  arrives. Why flat is the default: a sparse step has a fixed cost per call that a bucket pays
  again and again (3 collectives, each a network latency, and ~20 small kernel launches of
  15-60 µs each on a GPU), while the hook is synchronous either way (it does not overlap with the
  backward pass the way DDP's asynchronous allreduce does). Measured on CPU gloo (P=2, see
  ``oktopk-bench ddp``); the GPU comparison is owed (README).
* Iterations are counted on the bucket for which ``bucket.is_last()`` is true.
* The sparse result (``out``: the average over ranks, bitwise identical on every rank) is
  returned as an already completed ``torch.futures.Future`` of the bucket buffer's shape: the
  algorithms are synchronous with respect to the host on gloo and enqueue on the current stream
  on NCCL, so no extra work has to be chained.

Every rank must process the buckets in the same order, which DDP guarantees (buckets are
launched in index order). Unused parameters (``find_unused_parameters=True``) are fine: their
slots in the bucket hold zeros.
"""
import warnings
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

__all__ = ["SparseAllreduceState", "sparse_allreduce_hook"]


class SparseAllreduceState:
    """The state of :func:`sparse_allreduce_hook` (pass it to ``model.register_comm_hook``).

    Args:
        process_group: the group DDP reduces over (``None``: the default group).
        density: fraction of each bucket's entries each step keeps, in (0, 1].
        algorithm: a registered algorithm name (``"oktopk"``, ``"topka"``, ``"gtopk"``,
            ``"spardl"``, ``"topkdsa"``, ``"gaussiank"``, ``"dense"``).
        start_iter: iterations reduced densely before the sparse reducers start (at least 1,
            because DDP rebuilds its buckets after the first iteration).
        mode: ``"flat"`` (default: one reducer over the whole iteration's gradient, run when the
            last bucket arrives) or ``"bucket"`` (one reducer per bucket).
        comm: a :class:`~oktopk_triton.comm.Communicator` over ``process_group``; ``None``
            builds one on first use (``TorchCommunicator(process_group)`` for a non-default
            group or gloo, else ``default_communicator(device)``, i.e. CuPy NCCL when
            available).
        **options: passed to the algorithm (e.g. ``check_finite="raise"``, algorithm options).

    Attributes:
        iter: completed iterations (counted on the last bucket).
        reducers: ``{bucket index: Algorithm}`` (``{-1: Algorithm}`` in flat mode), created
            lazily.
        bytes_sent: bytes this rank sent in the last completed iteration (all buckets; the
            dense iterations are counted as a ring allreduce, 2(P-1)/P * bucket bytes).
        total_bytes_sent: bytes this rank sent since the state was created.
    """

    __slots__ = ("process_group", "density", "algorithm", "start_iter", "options", "comm",
                 "iter", "reducers", "bytes_sent", "total_bytes_sent", "_iter_bytes",
                 "_pending_state", "mode", "_pending")

    MODES = ("flat", "bucket")
    FLAT = -1   # the reducers key of the flat reducer

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, density: float = 0.01,
                 algorithm: str = "oktopk", start_iter: int = 1, comm: Any = None,
                 mode: str = "flat", **options: Any) -> None:
        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        from .algorithms import get_algorithm
        get_algorithm(algorithm)  # a clear error now for an unknown name
        if not (0.0 < float(density) <= 1.0):
            raise ValueError(f"density must be in (0, 1], got {density!r}")
        if int(start_iter) < 1:
            raise ValueError("start_iter must be >= 1: DDP rebuilds its buckets after the first "
                             "iteration, so sparse reducers built then would be built for the "
                             "wrong buckets")
        self.process_group = process_group
        self.density = float(density)
        self.algorithm = algorithm
        self.start_iter = int(start_iter)
        self.options: Dict[str, Any] = dict(options)
        self.comm = comm
        self.iter = 0
        self.reducers: Dict[int, Any] = {}
        self.bytes_sent = 0
        self.total_bytes_sent = 0
        self._iter_bytes = 0
        self._pending_state: Dict[int, Dict[str, Any]] = {}
        self.mode = mode
        self._pending: List[Tuple[torch.Tensor, "torch.futures.Future[torch.Tensor]"]] = []

    # -- helpers -----------------------------------------------------------------------------
    def _world_size(self) -> int:
        return dist.get_world_size(self.process_group)

    def _get_comm(self, device: torch.device):
        if self.comm is None:
            from .comm import TorchCommunicator
            if self.process_group is not None or device.type != "cuda":
                self.comm = TorchCommunicator(self.process_group)
            else:
                try:
                    from .comm import default_communicator
                    self.comm = default_communicator(device)
                except (ImportError, AttributeError):  # pragma: no cover - select.py missing
                    self.comm = TorchCommunicator(self.process_group)
        return self.comm

    def reducer(self, index: int, buffer: torch.Tensor):
        """The reducer of bucket ``index`` (created on first use for ``buffer``'s size)."""
        red = self.reducers.get(index)
        if red is not None and red.numel != buffer.numel():
            warnings.warn(f"sparse_allreduce_hook: bucket {index} changed size from {red.numel} "
                          f"to {buffer.numel()} elements; its reducer (and residual) is rebuilt")
            red = None
        if red is None:
            from .algorithms import get_algorithm
            comm = self._get_comm(buffer.device)
            red = get_algorithm(self.algorithm)(buffer.numel(), comm, self.density,
                                                device=buffer.device, **self.options)
            if index in self._pending_state:
                red.load_state_dict(self._pending_state.pop(index))
            self.reducers[index] = red
        return red

    # -- checkpointing -----------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        """Iteration count and every bucket reducer's state (residuals, thresholds, ...)."""
        return {"iter": self.iter, "algorithm": self.algorithm, "density": self.density,
                "reducers": {i: r.state_dict() for i, r in self.reducers.items()}}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        """Restore; reducers not yet built load their state when they are."""
        self.iter = int(sd["iter"])
        for i, rsd in sd.get("reducers", {}).items():
            if int(i) in self.reducers:
                self.reducers[int(i)].load_state_dict(rsd)
            else:
                self._pending_state[int(i)] = rsd

    def __repr__(self) -> str:
        return (f"SparseAllreduceState(algorithm={self.algorithm!r}, density={self.density:g}, "
                f"mode={self.mode!r}, start_iter={self.start_iter}, iter={self.iter}, "
                f"reducers={len(self.reducers)})")


def _completed(t: torch.Tensor) -> "torch.futures.Future[torch.Tensor]":
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(t)
    return fut


def sparse_allreduce_hook(state: SparseAllreduceState,
                          bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook: the bucket's gradients averaged over ranks with the sparse
    allreduce ``state.algorithm`` (dense for the first ``state.start_iter`` iterations)."""
    buf = bucket.buffer()
    P = state._world_size()
    if state.iter < state.start_iter:
        # dense, exactly as DDP's default allreduce hook: divide, then sum
        t = buf.div_(P)
        fut = dist.all_reduce(t, group=state.process_group, async_op=True).get_future()
        state._iter_bytes += 2 * (P - 1) * t.numel() * t.element_size() // P
        result = fut.then(lambda f: f.value()[0])
    elif state.mode == "bucket":
        red = state.reducer(bucket.index(), buf)
        out = red(buf)
        state._iter_bytes += int(red.stats.get("bytes_sent", 0))
        result = _completed(out.reshape(buf.shape))
    else:
        result = _flat_step(state, buf, bucket.is_last())
    if bucket.is_last():
        state.bytes_sent = state._iter_bytes
        state.total_bytes_sent += state._iter_bytes
        state._iter_bytes = 0
        state.iter += 1
    return result


def _flat_step(state: SparseAllreduceState, buf: torch.Tensor,
               last: bool) -> "torch.futures.Future[torch.Tensor]":
    """Flat mode: hold the bucket until the last one arrives, then reduce them all as one
    vector and complete every held future with its slice of the result."""
    fut: torch.futures.Future = torch.futures.Future()
    state._pending.append((buf, fut))
    if not last:
        return fut
    pending, state._pending = state._pending, []
    try:
        flat = torch.cat([b.reshape(-1) for b, _ in pending])
        red = state.reducer(SparseAllreduceState.FLAT, flat)
        out = red(flat)
        state._iter_bytes += int(red.stats.get("bytes_sent", 0))
        # each bucket's result goes back into the bucket's own buffer: DDP re-points its views
        # into the future's tensor with as_strided, which ignores a slice's storage offset
        offset = 0
        for b, f in pending:
            b.copy_(out[offset:offset + b.numel()].view(b.shape))
            f.set_result(b)
            offset += b.numel()
    except BaseException as e:   # every held bucket fails, none is left waiting
        for _, f in pending:
            if not f.done():
                f.set_exception(e)
        raise
    return fut
