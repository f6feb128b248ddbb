"""Multi-process test helper: run a function on ``world_size`` gloo ranks.

Usage from a test module in ``tests/`` (pytest puts ``tests/`` on ``sys.path`` because the
directory has no ``__init__.py``, so ``distutil`` is importable as a top-level module)::

    from distutil import run_gloo

    def _body(comm, n):                 # MUST be a module-level function (pickled by name)
        t = torch.full((n,), float(comm.rank))
        comm.allreduce(t)
        return t                        # anything picklable; tensors are moved to CPU

    def test_allreduce():
        results = run_gloo(3, _body, 10)    # list indexed by rank
        assert all(r[0] == 3.0 for r in results)

``run_gloo(world_size, fn, *args, timeout=120, pg_timeout=None) -> list``:

* spawns ``world_size`` processes (``torch.multiprocessing`` *spawn* context; children get
  ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``), each initialising a gloo process group
  on ``tcp://127.0.0.1:<a free port chosen for this run>`` with the process-group timeout
  ``pg_timeout`` (default ``min(timeout, 60)`` s), builds a
  :class:`oktopk_triton.comm.TorchCommunicator` and calls ``fn(comm, *args)``;
* returns the results ordered by rank (every tensor inside lists/tuples/dicts moved to CPU);
* raises :class:`RemoteError` (a ``RuntimeError``) in the caller when any rank fails, carrying the
  failing rank, the remote exception type name and its traceback text in the message
  (the first failure reported; later failures of other ranks are summarised);
* kills every child still alive when it returns or raises (``timeout`` bounds the whole run,
  then :class:`TimeoutError`).

Arguments and results cross process boundaries by pickling; ``fn`` and ``args`` must be
picklable, and ``fn`` must be importable in a fresh interpreter (defined at module level in a
module under ``tests/``). Spawning costs ~2-4 s per call: put several checks in one ``fn``.
"""
from __future__ import annotations

import os
import pickle
import sys
import time
from typing import Any, Callable, List

from oktopk_triton.bench.ranks import Ranks, free_port, init_rank, make_comm

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:  # so spawned children (and odd import modes) find test modules
    sys.path.insert(0, _TESTS_DIR)

__all__ = ["run_gloo", "run_nccl", "RemoteError", "free_port"]


class RemoteError(RuntimeError):
    """A rank of :func:`run_gloo` failed. ``rank``, ``exc_type`` (name) and ``remote_traceback``."""

    def __init__(self, rank: int, exc_type: str, tb: str, others: str = "") -> None:
        self.rank = rank
        self.exc_type = exc_type
        self.remote_traceback = tb
        msg = f"rank {rank} failed with {exc_type}:\n{tb}"
        if others:
            msg += f"\nother ranks:\n{others}"
        super().__init__(msg)


def _to_cpu(obj: Any) -> Any:
    import torch
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, list):
        return [_to_cpu(o) for o in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(_to_cpu(o) for o in obj)
    if isinstance(obj, tuple):  # NamedTuple
        return type(obj)(*[_to_cpu(o) for o in obj])
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def _worker(rank: int, world_size: int, port: int, send, fn: Callable, args: tuple,
            pg_timeout: float, backend: str = "gloo") -> None:
    import torch
    import torch.distributed as dist
    nccl = backend == "nccl-cupy"
    # several ranks may share one GPU: placement gives each its own NCCL_HOSTID
    dev = init_rank(rank, world_size, port, gpu=nccl, group="gloo", timeout=pg_timeout)
    comm = make_comm("cupy", dev) if nccl else make_comm("torch", dev)
    result = fn(comm, *args)
    if nccl:
        torch.cuda.synchronize()
    send("result", pickle.dumps(_to_cpu(result)))
    try:  # keep our sockets open until every rank is done with them
        dist.barrier()
    except Exception:
        pass


def run_gloo(world_size: int, fn: Callable, *args: Any, timeout: float = 120,
             pg_timeout: float | None = None) -> List[Any]:
    """Run ``fn(comm, *args)`` on ``world_size`` gloo processes; results by rank (see the
    module doc)."""
    return _run(world_size, fn, args, timeout, pg_timeout, "gloo")


def run_nccl(world_size: int, fn: Callable, *args: Any, timeout: float = 180,
             pg_timeout: float | None = None) -> List[Any]:
    """Like :func:`run_gloo`, but ``comm`` is a :class:`NcclCommunicator` (CuPy NCCL) on
    ``cuda:(rank % device_count)``, bootstrapped through a gloo group. Several ranks may share
    one GPU: each process gets its own ``NCCL_HOSTID``. Callers skip without CUDA or cupy."""
    return _run(world_size, fn, args, timeout, pg_timeout, "nccl-cupy")


def _run(world_size: int, fn: Callable, args: tuple, timeout: float,
         pg_timeout: float | None, backend: str) -> List[Any]:
    if pg_timeout is None:
        pg_timeout = min(float(timeout), 60.0)
    ranks = Ranks(world_size, _worker, (fn, args, pg_timeout, backend), name="run_gloo-rank",
                  env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"})
    results: List[Any] = [None] * world_size
    got = [False] * world_size
    errors = []  # (rank, type, tb) in arrival order
    deadline = time.monotonic() + timeout
    try:
        while not all(got):
            # after the first error the others get 5 s to report theirs
            rank, kind, payload = ranks.get(deadline, poll=0.2)
            if kind == "timeout":
                if errors:
                    break
                missing = [r for r in range(world_size) if not got[r]]
                raise TimeoutError(f"run_gloo: ranks {missing} did not finish within {timeout}s")
            if kind == "result":
                got[rank] = True
                results[rank] = pickle.loads(payload)
            elif kind in ("fatal", "died") and not got[rank]:
                got[rank] = True
                errors.append((rank, *payload) if kind == "fatal"
                              else (rank, "ProcessDied", payload + "\n"))
                deadline = min(deadline, time.monotonic() + 5.0)
    finally:
        ranks.stop(2.0 if not errors else 0.5)
    if errors:
        # report the origin: a rank's own error before the communication errors it caused
        secondary = ("CommAborted", "CommTimeout")
        errors.sort(key=lambda e: e[1] in secondary)  # stable: arrival order otherwise
        rank, typ, tb = errors[0]
        others = "".join(f"  rank {r}: {t}: {b.strip().splitlines()[-1] if b.strip() else ''}\n"
                         for r, t, b in errors[1:])
        raise RemoteError(rank, typ, tb, others)
    return results
