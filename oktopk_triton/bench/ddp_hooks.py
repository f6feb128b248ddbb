"""The communication hooks ``oktopk-bench ddp`` compares, set up on a DDP model: none (the
compute floor), DDP's allreduce, ``fp16_compress_hook``, PowerSGD and the sparse hook
(:func:`_register_hook`), with the sparse state's modes (:func:`sparse_modes`).

Measured why: docs/research/design-notes.md, ``oktopk_triton/bench/ddp_bench.py``.
"""
from __future__ import annotations

import inspect
from typing import Any, Dict, List, Optional

from .baselines import count_hook_bytes, powersgd_module, powersgd_state

HOOKS = ("none", "allreduce", "fp16", "powersgd", "sparse")
SPARSE_START_ITER = 1   # SparseAllreduceState's dense iterations (DDP rebuilds buckets after one)


def sparse_modes() -> List[Optional[str]]:
    """The modes ``SparseAllreduceState`` accepts: ``["bucket", "flat"]`` when it has a ``mode``
    argument, else ``[None]`` (its one, per-bucket behaviour)."""
    from ..ddp import SparseAllreduceState
    try:
        params = inspect.signature(SparseAllreduceState.__init__).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return [None]
    return ["bucket", "flat"] if "mode" in params else [None]


def _none_hook(state, bucket):
    """Communicates nothing: the bucket's local gradients, as they are."""
    import torch
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _powersgd_one_bucket_at_a_time(state, bucket):
    """PowerSGD for gloo: each bucket's reduction completes before the hook returns.

    ``powerSGD_hook`` issues its second and third allreduce from future callbacks; with several
    buckets in flight on gloo these interleave in a different order on different ranks and the
    group deadlocks (seen here: 4 x Linear(64, 64) in 10 kB buckets, 2 ranks). Waiting keeps one
    order; on gloo the sparse hook is synchronous too. NCCL runs the plain hook."""
    fut = powersgd_module().powerSGD_hook(state, bucket)
    fut.wait()
    return fut


def _make_sparse_state(cfg: Dict[str, Any], comm, algorithm: str, mode: Optional[str]):
    """The hook point for the sparse hook's options: ``mode`` is passed only when the state
    accepts it (``sparse_modes()``)."""
    from ..algorithms import get_algorithm
    from ..config import CONFIGS
    from ..ddp import SparseAllreduceState
    settings: Dict[str, Any] = {}
    if "backend" in getattr(get_algorithm(algorithm), "OPTIONS", {}):
        settings["backend"] = cfg["kernel_backend"]
    extra = {} if mode is None else {"mode": mode}
    return SparseAllreduceState(density=cfg["density"],
                                algorithm=CONFIGS[algorithm](**settings),
                                start_iter=SPARSE_START_ITER, comm=comm, **extra)


def _register_hook(ddp, spec: Dict[str, Any], cfg: Dict[str, Any], cuda: bool, get_comm):
    """Register ``spec``'s communication hook on ``ddp``; (communicator, hook state, counter of
    torch's hooks' bytes), each None when the hook has none."""
    hook, comm, state, counted = spec["hook"], None, None, None
    if hook in ("fp16", "powersgd"):
        counted = {"bytes_sent": 0}
        count_hook_bytes(counted)
    if hook == "none":
        ddp.register_comm_hook(None, _none_hook)
    elif hook == "fp16":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook
        ddp.register_comm_hook(None, fp16_compress_hook)
    elif hook == "powersgd":
        state = powersgd_state(cfg["powersgd_rank"], cfg["powersgd_start_iter"], cfg["seed"])
        ddp.register_comm_hook(state, powersgd_module().powerSGD_hook if cuda
                               else _powersgd_one_bucket_at_a_time)
    elif hook == "sparse":
        comm = get_comm()
        state = _make_sparse_state(cfg, comm, spec["algorithm"], spec["mode"])
        from ..ddp import sparse_allreduce_hook
        ddp.register_comm_hook(state, sparse_allreduce_hook)
    elif hook != "allreduce":
        raise ValueError(f"unknown hook {hook!r}")
    return comm, state, counted
