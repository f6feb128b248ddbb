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

``run_pooled(world_size, fn, *args, timeout=120) -> list``: the same contract as ``run_gloo``,
but on a pool of ``world_size`` gloo ranks that this test process starts once and reuses (a
spawn costs ~2-4 s). Each call gets a fresh communicator, the torch seed of a fresh process, the
environment, working directory and kernel dispatch of before the call; a call that fails on any
rank, dies or passes ``timeout`` raises as ``run_gloo`` does and the pool is stopped (the next
call starts a new one); so is a pool whose body destroyed the default process group. For
well-behaved bodies only: tests of failures, dead ranks and process-group timeouts, and bodies
that tear down global state, keep ``run_gloo``.

``run_pooled_torch(world_size, fn, *args, timeout=120) -> list``: ``run_pooled`` with the
kernels on their torch references in the ranks (``_dispatch.INTERPRET = False`` for the call;
the pool puts it back): what a test that unsets ``TRITON_INTERPRET`` before ``run_pooled`` gets,
on the same pool as the other tests instead of a pool of its own (a start-up, and another pool
pushed out).

``run_gloo(world_size, fn, *args, timeout=120, pg_timeout=None) -> list``:

* starts ``world_size`` processes (``torch.multiprocessing``'s *forkserver* context: forked from
  a server of this test process that imported torch once, each in this process's environment of
  the moment; children get ``OMP_NUM_THREADS=1`` and ``torch.set_num_threads(1)``), each
  initialising a gloo process group on ``tcp://127.0.0.1:<a free port chosen for this run>``
  with the process-group timeout
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
module under ``tests/``). A start costs ~1 s of CPU a rank (importing the test module and what
it imports; a spawned rank imported torch too: ~3 s): put several checks in one ``fn``.
"""
from __future__ import annotations

import atexit
import os
import pickle
import sys
import time
from typing import Any, Callable, List, Tuple

from oktopk_triton.bench.ranks import Ranks, free_port, init_rank, make_comm

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
if _TESTS_DIR not in sys.path:  # so spawned children (and odd import modes) find test modules
    sys.path.insert(0, _TESTS_DIR)

# how ranks start: forked from a server that imported torch (oktopk_triton.bench.ranks.Ranks)
START = "forkserver"

__all__ = ["run_gloo", "run_pooled", "run_pooled_torch", "run_nccl", "RemoteError",
           "free_port"]


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
                  env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, start_method=START)
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
        raise _remote_error(errors)
    return results


def _remote_error(errors: list) -> RemoteError:
    """The :class:`RemoteError` of ``errors`` ((rank, type, traceback) in arrival order): the
    origin first, a rank's own error before the communication errors it caused."""
    secondary = ("CommAborted", "CommTimeout")
    errors = sorted(errors, key=lambda e: e[1] in secondary)  # stable: arrival order otherwise
    rank, typ, tb = errors[0]
    others = "".join(f"  rank {r}: {t}: {b.strip().splitlines()[-1] if b.strip() else ''}\n"
                     for r, t, b in errors[1:])
    return RemoteError(rank, typ, tb, others)


# -- a pool of gloo ranks reused across calls (run_pooled) ---------------------------------------
_POOL_PG_TIMEOUT = 60.0
_POOLS_KEPT = 2          # live pools in this process (each rank ~0.4 GB)


def _pool_worker(rank: int, world_size: int, port: int, send, jobs, pg_timeout: float) -> None:
    import torch
    import torch.distributed as dist

    from oktopk_triton.kernels import _dispatch
    dev = init_rank(rank, world_size, port, gpu=False, group="gloo", timeout=pg_timeout)
    seed, env, cwd = torch.initial_seed(), dict(os.environ), os.getcwd()
    interpret, dtype = _dispatch.INTERPRET, torch.get_default_dtype()
    while True:
        job = jobs[rank].get()
        if job is None:
            return
        job_id, fn, args = pickle.loads(job)
        torch.manual_seed(seed)
        torch.set_num_threads(1)
        result = fn(make_comm("torch", dev), *args)   # raising ends the rank: "fatal"
        healthy = dist.is_initialized()
        send("result", (job_id, pickle.dumps(_to_cpu(result)), healthy))
        # what the body may have changed, back as a fresh process has it
        os.environ.clear()
        os.environ.update(env)
        os.chdir(cwd)
        _dispatch.INTERPRET = interpret
        torch.set_default_dtype(dtype)
        if not healthy:
            return


class _Pool:
    def __init__(self, world_size: int) -> None:
        import torch.multiprocessing as mp
        ctx = mp.get_context(START)
        self.world_size = world_size
        self.jobs = [ctx.Queue() for _ in range(world_size)]
        self.ranks = Ranks(world_size, _pool_worker, (self.jobs, _POOL_PG_TIMEOUT),
                           name=f"pool{world_size}-rank",
                           env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
                           start_method=START)
        self.next_id = 0

    def alive(self) -> bool:
        return all(p.exitcode is None for p in self.ranks.procs)

    def stop(self) -> None:
        for q in self.jobs:
            try:
                q.put(None)
            except Exception:  # noqa: BLE001
                pass
        self.ranks.stop(1.0)
        for q in self.jobs:
            q.close()
            q.cancel_join_thread()

    def run(self, fn: Callable, args: tuple, timeout: float) -> Tuple[List[Any], bool]:
        """Results by rank and whether the pool may be reused; raises like :func:`run_gloo`."""
        P = self.world_size
        job_id, self.next_id = self.next_id, self.next_id + 1
        job = pickle.dumps((job_id, fn, args))   # here, so that what does not pickle raises here
        for q in self.jobs:
            q.put(job)
        results: List[Any] = [None] * P
        got = [False] * P
        healthy = True
        errors = []
        deadline = time.monotonic() + timeout
        while not all(got):
            rank, kind, payload = self.ranks.get(deadline, poll=0.2)
            if kind == "timeout":
                if errors:
                    break
                missing = [r for r in range(P) if not got[r]]
                raise TimeoutError(f"run_pooled: ranks {missing} did not finish within "
                                   f"{timeout}s")
            if kind == "result" and payload[0] == job_id:
                got[rank] = True
                results[rank] = pickle.loads(payload[1])
                healthy = healthy and payload[2]
            elif kind in ("fatal", "died", "done") and not got[rank]:
                got[rank] = True
                errors.append((rank, *payload) if kind == "fatal"
                              else (rank, "ProcessDied", f"rank {rank} left the pool\n"))
                deadline = min(deadline, time.monotonic() + 5.0)
        if errors:
            raise _remote_error(errors)
        return results, healthy


_pools: "dict[tuple, _Pool]" = {}   # by (world size, environment), least recent first


def _stop_pools() -> None:
    while _pools:
        _pools.popitem()[1].stop()


atexit.register(_stop_pools)


def run_pooled(world_size: int, fn: Callable, *args: Any, timeout: float = 120) -> List[Any]:
    """Like :func:`run_gloo`, on this process's pool of ``world_size`` ranks (module doc) that
    was started with the environment of now (e.g. a test that unset TRITON_INTERPRET gets ranks
    that never had it)."""
    key = (world_size, tuple(sorted((k, v) for k, v in os.environ.items()
                                    if k != "PYTEST_CURRENT_TEST")))
    pool = _pools.pop(key, None)
    if pool is not None and not pool.alive():
        pool.stop()
        pool = None
    while len(_pools) >= _POOLS_KEPT:            # the least recently used goes
        _pools.pop(next(iter(_pools))).stop()
    if pool is None:
        pool = _Pool(world_size)
    try:
        results, healthy = pool.run(fn, args, timeout)
    except BaseException:
        pool.stop()
        raise
    if healthy:
        _pools[key] = pool
    else:
        pool.stop()
    return results


def _on_torch_references(comm, fn: Callable, args: tuple) -> Any:
    from oktopk_triton.kernels import _dispatch
    _dispatch.INTERPRET = False       # the pool worker restores it after the call
    return fn(comm, *args)


def run_pooled_torch(world_size: int, fn: Callable, *args: Any, timeout: float = 120
                     ) -> List[Any]:
    """:func:`run_pooled` with the kernels on their torch references (module doc)."""
    return run_pooled(world_size, _on_torch_references, fn, args, timeout=timeout)
