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
import queue as _queue
import sys
import time
import traceback
from typing import Any, Callable, List

from oktopk_triton.bench._procs import environ, exit_rank, free_port

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


def _worker(rank: int, world_size: int, port: int, fn: Callable, args: tuple, q,
            pg_timeout: float, backend: str = "gloo") -> None:
    code = 0
    try:
        import datetime

        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        from oktopk_triton.comm import TorchCommunicator

        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        if backend == "nccl-cupy":
            # several ranks may share one GPU: make each look like its own host to NCCL
            os.environ.setdefault("NCCL_HOSTID", f"oktopk-test-rank{rank}")
            torch.cuda.set_device(rank % torch.cuda.device_count())
            from oktopk_triton.comm import NcclCommunicator
            comm = NcclCommunicator.from_torch_distributed()
        else:
            comm = TorchCommunicator()
        result = fn(comm, *args)
        if backend == "nccl-cupy":
            torch.cuda.synchronize()
        q.put((rank, True, pickle.dumps(_to_cpu(result))))
        try:  # keep our sockets open until every rank is done with them
            dist.barrier()
        except Exception:
            pass
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        code = 1
        try:
            q.put((rank, False, (type(exc).__name__, traceback.format_exc())))
        except Exception:
            pass
    finally:
        exit_rank(q, code)


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
    import torch.multiprocessing as mp

    if pg_timeout is None:
        pg_timeout = min(float(timeout), 60.0)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = free_port()
    procs = []
    with environ({"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}):
        for r in range(world_size):
            p = ctx.Process(target=_worker,
                            args=(r, world_size, port, fn, args, q, pg_timeout, backend),
                            name=f"run_gloo-rank{r}", daemon=True)
            try:
                p.start()
            except BaseException:
                for started in procs:  # e.g. fn or args not picklable
                    started.kill()
                    started.join(timeout=5.0)
                raise
            procs.append(p)

    results: List[Any] = [None] * world_size
    got = [False] * world_size
    errors = []  # (rank, type, tb) in arrival order
    deadline = time.monotonic() + timeout
    grace_end = None
    try:
        while not all(got):
            now = time.monotonic()
            if grace_end is not None and now > grace_end:
                break
            if now > deadline:
                missing = [r for r in range(world_size) if not got[r]]
                if errors:
                    break
                raise TimeoutError(f"run_gloo: ranks {missing} did not finish within {timeout}s")
            try:
                rank, ok, payload = q.get(timeout=0.2)
            except _queue.Empty:
                # a child that died without reporting (segfault, os._exit, kill)
                for r, p in enumerate(procs):
                    if not got[r] and p.exitcode is not None:
                        # it may have reported just before exiting: drain once more
                        try:
                            while True:
                                rank, ok, payload = q.get(timeout=0.5)
                                _record(rank, ok, payload, results, got, errors)
                        except _queue.Empty:
                            pass
                        if not got[r]:
                            got[r] = True
                            errors.append((r, "ProcessDied",
                                           f"rank {r} exited with code {p.exitcode} "
                                           f"without reporting\n"))
                if errors and grace_end is None:
                    grace_end = time.monotonic() + 5.0
                continue
            _record(rank, ok, payload, results, got, errors)
            if errors and grace_end is None:
                grace_end = time.monotonic() + 5.0  # let the others report their errors
    finally:
        for p in procs:
            p.join(timeout=2.0 if not errors else 0.5)
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5.0)
        q.close()
        try:
            q.join_thread()
        except Exception:
            pass
    if errors:
        # report the origin: a rank's own error before the communication errors it caused
        secondary = ("CommAborted", "CommTimeout")
        errors.sort(key=lambda e: e[1] in secondary)  # stable: arrival order otherwise
        rank, typ, tb = errors[0]
        others = "".join(f"  rank {r}: {t}: {b.strip().splitlines()[-1] if b.strip() else ''}\n"
                         for r, t, b in errors[1:])
        raise RemoteError(rank, typ, tb, others)
    return results


def _record(rank, ok, payload, results, got, errors) -> None:
    got[rank] = True
    if ok:
        results[rank] = pickle.loads(payload)
    else:
        errors.append((rank, payload[0], payload[1]))
