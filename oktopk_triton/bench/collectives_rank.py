"""What one rank of ``oktopk-bench collectives`` does (:mod:`oktopk_triton.bench.collectives` is
the driver): its gradients, its timed steps and probes, the GPU it runs on, and its process
entry point for the gloo / nccl backends (``local`` runs the ranks as threads here)."""
from __future__ import annotations

import json
import os
import time
from typing import Any, Dict, List, Tuple

from ._common import nccl_version_text
from .measure import checksum
from .ranks import init_rank, make_comm


# -- gradients -------------------------------------------------------------------------------------
def make_grad(n: int, seed: int, rank: int, step: int, device=None, scale=None):
    """Heavy-tailed gradient of ``rank`` at ``step`` (see the module docstring)."""
    import torch
    if scale is None:
        scale = grad_scale(n, seed)
    g1 = torch.Generator().manual_seed(seed * 1_000_003 + 7 * step + 1)
    g2 = torch.Generator().manual_seed(seed * 1_000_003 + 104_729 * (rank + 1) + 7 * step + 2)
    x = torch.randn(n, generator=g1)
    x.add_(torch.randn(n, generator=g2)).mul_(scale)
    return x if device is None else x.to(device)


def grad_scale(n: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed * 1_000_003 + 999_983)
    return torch.randn(n, generator=g).mul_(1.5).exp_()


# -- variants --------------------------------------------------------------------------------------
GRAPH_KEY = "graph"


def parse_variant(spec: str) -> Tuple[str, Dict[str, Any], bool]:
    """``NAME[:KEY=VALUE[,KEY=VALUE...]]`` -> ``(name, constructor options, graph)``: the run
    label of one configuration of an algorithm, e.g. ``oktopk:wire_format=compact,graph=1``.
    VALUE is read as JSON where it is JSON (``0.9``, ``true``), else a string; the key ``graph``
    (true/1) replays the steady step from a CUDA graph (``oktopk_triton.modes.graph.GraphedStep``)
    instead of being passed to the constructor."""
    name, _, rest = spec.partition(":")
    opts: Dict[str, Any] = {}
    for item in filter(None, rest.split(",")):
        key, eq, text = item.partition("=")
        if not eq or not key:
            raise ValueError(f"{spec!r}: expected NAME:KEY=VALUE[,KEY=VALUE...], got {item!r}")
        try:
            opts[key] = json.loads(text)
        except ValueError:
            opts[key] = text
    graph = opts.pop(GRAPH_KEY, False)
    if graph not in (True, False, 0, 1):
        raise ValueError(f"{spec!r}: graph must be 1/true or 0/false, got {graph!r}")
    return name.lower(), opts, bool(graph)


def build_step(comm, spec: str, n: int, density: float, check_finite: str):
    """``(algorithm, step)`` of a variant: the algorithm built with the variant's options, and
    what a step calls (the algorithm, or a
    :class:`~oktopk_triton.modes.graph.GraphedStep` of it)."""
    from ..algorithms import get_algorithm
    name, opts, graph = parse_variant(spec)
    alg = get_algorithm(name)(n, comm, density, check_finite=check_finite, **opts)
    return alg, (graphed_step(alg) if graph else alg)


def graphed_step(alg):
    """The graphed step of ``alg`` (a module attribute, so a CPU test can put a fake here)."""
    from ..modes.graph import GraphedStep
    return GraphedStep(alg)


# -- one rank --------------------------------------------------------------------------------------
def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _start_together(comm) -> None:
    """Every rank leaves here after every rank arrived and its GPU is idle: a barrier (on NCCL it
    is enqueued on the stream), then the host waits for the stream."""
    comm.barrier()
    _sync(comm.device)


def count_host_syncs(fn):
    """``(number of synchronizing CUDA calls, fn())`` with ``torch.cuda.set_sync_debug_mode
    ("warn")`` around ``fn`` (one warning per host synchronisation)."""
    import warnings

    import torch
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            result = fn()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    n = sum(1 for w in caught if "synchroniz" in str(w.message).lower())
    return n, result


def _rank_run(comm, name: str, n: int, density: float, steps: int, seed: int,
              check_finite: str, scale=None, count_syncs: bool = True) -> Dict[str, Any]:
    """``steps`` timed steps of the variant ``name`` (:func:`parse_variant`) on this rank; on
    CUDA one more step counted under the sync debug mode (not timed, not in the per-step
    lists; with ``graph=1`` a replay)."""
    dev = comm.device
    cuda = dev.type == "cuda"
    alg, step = build_step(comm, name, n, density, check_finite)
    if scale is None:
        scale = grad_scale(n, seed)
    rec: Dict[str, Any] = {"bytes": [], "stats_bytes": [], "time_s": [], "nnz": [],
                           "checksum": [], "collectives": [], "host_syncs": None}
    for t in range(steps):
        g = make_grad(n, seed, comm.rank, t, device=dev, scale=scale)
        _start_together(comm)
        b0 = comm.bytes_sent
        t0 = time.perf_counter()
        out = step(g)
        _sync(dev)
        dt = time.perf_counter() - t0
        rec["bytes"].append(int(comm.bytes_sent - b0))
        rec["stats_bytes"].append(int(alg.stats.get("bytes_sent", -1)))
        rec["collectives"].append(alg.stats.get("collectives"))
        rec["time_s"].append(dt)
        rec["nnz"].append(int((out != 0).sum().item()))
        rec["checksum"].append(checksum(out))
        del out, g
    if cuda and count_syncs:
        g = make_grad(n, seed, comm.rank, steps, device=dev, scale=scale)
        _start_together(comm)
        rec["host_syncs"], out = count_host_syncs(lambda: step(g))
        _sync(dev)
        del out, g
    elif not cuda:      # one more step, rank 0 under the profiler's memory view (not timed;
        # one profiler per process: LocalCluster's ranks are threads of one)
        g = make_grad(n, seed, comm.rank, steps, device=dev, scale=scale)
        _start_together(comm)
        if comm.rank == 0:
            rec["peak_transient_bytes"] = peak_transient_bytes(lambda: step(g))
        else:
            step(g)
        del g
    rec["persistent_bytes"] = alg.persistent_bytes()
    rec["k"] = alg.k
    return rec


def peak_transient_bytes(fn) -> int:
    """The peak of the bytes ``fn`` allocated and had not yet freed, on this thread, from the
    torch profiler's memory view (CPU): each op's own allocations and frees in time order.
    What stays allocated after ``fn`` (its result) counts up to the peak too."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events()
                    if e.self_cpu_memory_usage)
    cur = peak = 0
    for _, b in events:
        cur += b
        peak = max(peak, cur)
    return int(peak)


def probe_sizes(n: int) -> List[int]:
    """Bytes of the probe allreduces: the dense gradient (4n), 4 bytes and 64 KiB (a
    latency/bandwidth model is fitted to these)."""
    return [4 * n, 4, 64 * 1024]


def _rank_probes(comm, n: int, reps: int) -> List[Dict[str, Any]]:
    """fp32 allreduces of each probe size: one warm-up, then ``reps`` timed calls, each started
    together on all ranks and timed to the end of the stream."""
    import torch
    out = []
    for nbytes in probe_sizes(n):
        t = torch.zeros(max(1, nbytes // 4), device=comm.device)
        times = []
        for i in range(reps + 1):
            _start_together(comm)
            t0 = time.perf_counter()
            comm.allreduce(t)
            _sync(comm.device)
            if i:
                times.append(time.perf_counter() - t0)
        out.append({"op": "allreduce", "bytes": nbytes, "time_s": times})
        del t
    return out


# -- backends --------------------------------------------------------------------------------------
def _run_local(name, P, n, density, steps, seed, check_finite, timeout):
    from ..comm.local import LocalCluster
    scale = grad_scale(n, seed)
    return LocalCluster(P, timeout=timeout).run(_rank_run, name, n, density, steps, seed,
                                                check_finite, scale)


def _run_local_probes(P, n, reps, timeout):
    from ..comm.local import LocalCluster
    return LocalCluster(P, timeout=timeout).run(_rank_probes, n, reps)


def _rank_main(rank: int, P: int, port: int, send, cfg: Dict[str, Any], algs: List[str]):
    """One rank's process (:class:`oktopk_triton.bench.ranks.Ranks` target): its environment
    first (before NCCL initialises), the communicator, the probes, then each algorithm in turn;
    every result goes to the parent as soon as it exists. A failing rank reports and exits at
    once: its peers then fail fast (lost peer) instead of waiting."""
    os.environ.update(cfg["env"][rank])
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist
    nccl, timeout = cfg["backend"] == "nccl", float(cfg["comm_timeout"])
    group = "nccl" if nccl and cfg["comm"] == "torch" else "gloo"   # cupy: a gloo bootstrap
    dev = init_rank(rank, P, port, gpu=nccl, ngpu=cfg["ngpu"], group=group, timeout=timeout)
    info: Dict[str, Any] = {"pid": os.getpid(), "env": cfg["env"][rank],
                            "NCCL_HOSTID": os.environ.get("NCCL_HOSTID")}  # as NCCL will see it
    if nccl:
        info.update(device=str(dev), device_name=torch.cuda.get_device_name(dev),
                    nccl=_nccl_version(cfg["comm"]))
    comm = make_comm(cfg["comm"] if nccl else "torch", dev,
                     timeout=None if group == "nccl" else timeout)
    send("ready", info)
    if cfg["probes"]:
        send("probes", _rank_probes(comm, cfg["n"], cfg["probe_reps"]))
    for name in algs:
        rec = _rank_run(comm, name, cfg["n"], cfg["density"], cfg["steps"], cfg["seed"],
                        cfg["check_finite"])
        send("alg", (name, rec))
    dist.barrier()  # keep this rank's sockets open until every rank is done


def _nccl_version(comm: str):
    try:
        if comm == "torch":
            import torch
            return nccl_version_text(torch.cuda.nccl.version())
        from cupy.cuda import nccl
        return nccl_version_text(nccl.get_version())
    except Exception:  # noqa: BLE001
        return None
