"""``GraphedStep``: replay a captured CUDA graph of an algorithm's steady step.

    step = GraphedStep(algorithm)          # after building it; CUDA tensors, NCCL or one rank
    for batch in loader:
        ...backward...
        out = step(flat_grad)              # the same tensor every step: use it before the next

Measured why: docs/research/design-notes.md, ``oktopk_triton/modes/graph.py``.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ..algorithms.base import Algorithm, LossScale

EAGER_STEPS = 3
# Why "thread_local": under the default "global" mode a CUDA call from ANY thread (an event
# query by a communicator's watchdog, a pinned-memory copy of a loader thread) during the capture
# invalidates it (cudaErrorStreamCaptureInvalidated at capture_end, seen on NCCL ranks at
# n = 2^26, where the eager steps before the capture left events for the watchdog to query).
# "thread_local" still refuses unsafe calls on the capturing thread (what would really break the
# graph) and lets other threads, whose calls are not captured, go on.
CAPTURE_ERROR_MODE = "thread_local"


class GraphedStep:
    """One captured steady step of ``algorithm``, replayed on every call after ``eager_steps``.

    ``graph_factory`` and ``capture`` default to ``torch.cuda.CUDAGraph`` and
    ``torch.cuda.graph``; tests pass stand-ins to check the bookkeeping without a GPU."""

    def __init__(self, algorithm: Algorithm, *, eager_steps: int = EAGER_STEPS,
                 graph_factory: Optional[Callable[[], Any]] = None,
                 capture: Optional[Callable[..., Any]] = None) -> None:
        if not isinstance(algorithm, Algorithm):
            raise TypeError(f"GraphedStep: expected an Algorithm, got {type(algorithm).__name__}")
        if isinstance(eager_steps, bool) or not isinstance(eager_steps, int) or eager_steps < 1:
            raise ValueError(f"GraphedStep: eager_steps must be an int >= 1, got {eager_steps!r}")
        fake = graph_factory is not None
        if not fake and algorithm.device.type != "cuda":
            raise ValueError(f"GraphedStep: needs CUDA tensors, the algorithm runs on "
                             f"{algorithm.device}")
        if not getattr(algorithm.comm, "graph_capturable", False):
            raise ValueError(f"GraphedStep: {type(algorithm.comm).__name__} synchronises in "
                             "Python and cannot be captured; use NCCL (NcclCommunicator) or one "
                             "rank")
        self.algorithm = algorithm
        self.eager_steps = eager_steps
        self._graph_factory = graph_factory or torch.cuda.CUDAGraph
        self._capture = capture or torch.cuda.graph
        self._graph: Any = None
        self._grad: Optional[torch.Tensor] = None      # the static input
        self._out: Optional[torch.Tensor] = None       # the static output
        self._calls = 0
        self._step_delta = 0
        self._bytes_delta = 0
        self._collectives_delta = 0

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def reset(self) -> None:
        """Drop the captured graph: the next ``eager_steps`` calls run eagerly, then capture."""
        self._graph = self._grad = self._out = None
        self._calls = 0

    def __call__(self, grad: torch.Tensor, scale: LossScale = None) -> torch.Tensor:
        alg = self.algorithm
        if scale is not None:
            raise ValueError("GraphedStep: a loss scale cannot be replayed; pass scale to the "
                             "algorithm itself and do not graph its steps")
        self._calls += 1
        if self._calls <= self.eager_steps or alg.step_count < alg.warmup_steps:
            return alg(grad)
        if self._graph is None:
            return self._capture_step(grad)
        if grad.shape != self._grad.shape or grad.dtype != self._grad.dtype or \
                grad.device != self._grad.device:
            raise ValueError(f"GraphedStep: gradient {tuple(grad.shape)} {grad.dtype} on "
                             f"{grad.device}; the captured step takes "
                             f"{tuple(self._grad.shape)} {self._grad.dtype} on {self._grad.device}")
        self._grad.copy_(grad)
        self._replay()
        return self._out

    def _replay(self) -> None:
        """Launch the graph; then the Python side of the replayed step (no host read)."""
        alg = self.algorithm
        self._graph.replay()
        comm = alg.comm
        comm.track_replay()
        alg.step_count += self._step_delta
        comm.bytes_sent += self._bytes_delta
        if self._collectives_delta:
            comm.collectives_issued += self._collectives_delta

    def _capture_step(self, grad: torch.Tensor) -> torch.Tensor:
        alg = self.algorithm
        alg.check_input(grad)
        self._grad = grad.detach().clone()
        comm = alg.comm
        steps, sent = alg.step_count, comm.bytes_sent
        colls = getattr(comm, "collectives_issued", 0)
        self._graph = self._graph_factory()
        try:
            # the watchdog paused first, then the capture (see CAPTURE_ERROR_MODE): left in
            # reverse order
            with comm.capture_guard(), \
                    self._capture(self._graph, capture_error_mode=CAPTURE_ERROR_MODE):
                self._out = alg(self._grad)
        except BaseException:
            # nothing was run: the counters go back and the next call captures afresh
            self._graph = self._grad = self._out = None
            self._calls -= 1
            alg.step_count, comm.bytes_sent = steps, sent
            if hasattr(comm, "collectives_issued"):
                comm.collectives_issued = colls
            raise
        # capture records the step's kernels without running them (its Python side did run,
        # counters included): the counters go back, and this call replays like every later one
        self._step_delta, alg.step_count = alg.step_count - steps, steps
        self._bytes_delta, comm.bytes_sent = comm.bytes_sent - sent, sent
        self._collectives_delta = getattr(comm, "collectives_issued", 0) - colls
        if self._collectives_delta:
            comm.collectives_issued = colls
        self._replay()
        return self._out
