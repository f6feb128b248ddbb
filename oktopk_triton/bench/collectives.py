"""``oktopk-bench collectives``: bytes per rank per step and step time of every algorithm over
world sizes, against the formulas of ALGORITHMS.md §6 and the lower bound ``2k(P-1)/P`` words.

    oktopk-bench collectives --algorithms all --world-sizes 2 4 8 16 32 --n 4194304 \\
        --density 0.01 [--steps 3] [--backend local|gloo|nccl] [--json PATH] [--plot PATH]

Backends:

* ``local``: ``LocalCluster`` (P threads in one process, CPU). Volumes are exact (every backend
  counts bytes the same way); step times are those of P threads sharing this machine's cores, so
  they only compare algorithms with one another on the same run. Intra-op threads are set to 1.
* ``gloo``: P real processes on this machine (``torch.multiprocessing`` spawn, loopback TCP),
  ``TorchCommunicator`` on a gloo group, CPU tensors.
* ``nccl``: P processes, one per GPU (``cuda:rank``), ``TorchCommunicator`` on an NCCL group;
  world sizes above the number of GPUs are skipped with a note (NCCL does not put two ranks on
  one GPU). Step times are taken after ``torch.cuda.synchronize``.

Gradients: deterministic from ``--seed``, heavy tailed and correlated across ranks like real
data-parallel gradients: ``g = scale * (common_t + own_{rank,t})`` with a fixed log-normal
per-coordinate ``scale`` (``exp(1.5 z)``) and standard normal ``common_t`` / ``own``.

Per (algorithm, P) the measured bytes are ``comm.bytes_sent`` around each call (checked equal to
the algorithm's ``stats["bytes_sent"]``); they include the 4-byte non-finite flag allreduce of
``check_finite="skip"`` (``check_bytes`` in the JSON; ``--check-finite off`` removes it). The
mean is over steps after the first (calibration) step and over ranks; the max over all steps and
ranks. ``nnz`` is the number of nonzeros of ``out`` (mean over the steps after the first).
"""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import resource
import socket
import sys
import time
import traceback
from typing import Any, Dict, List

__all__ = ["add_arguments", "main", "run_benchmark", "make_grad", "formula_words",
           "lower_bound_words"]


# -- arguments -------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--algorithms", nargs="+", default=["all"],
                   help="algorithm names, or 'all' = dense + every available sparse algorithm")
    p.add_argument("--world-sizes", nargs="+", type=int, default=[2, 4, 8],
                   help="world sizes P to run (default: 2 4 8)")
    p.add_argument("--n", type=int, default=1 << 22, help="gradient length (default 2^22)")
    p.add_argument("--density", type=float, default=0.01, help="k = density * n (default 0.01)")
    p.add_argument("--steps", type=int, default=3,
                   help="steps per run; the first is the calibration step (default 3)")
    p.add_argument("--backend", choices=("local", "gloo", "nccl"), default="local")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-finite", choices=("skip", "off", "raise"), default="skip",
                   help="the algorithms' non-finite check (skip adds a 4-byte allreduce)")
    p.add_argument("--timeout", type=float, default=900.0,
                   help="seconds one (algorithm, P) run may take (default 900)")
    p.add_argument("--json", default=None, help="write the results JSON here")
    p.add_argument("--plot", default=None, help="write a bytes-vs-P plot (PNG) here")
    p.add_argument("--quiet", action="store_true", help="print only the final table")


# -- formulas -----------------------------------------------------------------------------------------
def _log2ceil(P: int) -> int:
    return 0 if P <= 1 else (P - 1).bit_length()


def formula_words(name: str, n: int, k: int, P: int):
    """(low, high) words per rank per step by ALGORITHMS.md §6 (headers not included).

    Uses ``oktopk_triton.algorithms._sparse.volume_formula_range`` when present."""
    try:
        from ..algorithms._sparse import volume_formula_range
        lo, hi = volume_formula_range(name, n, k, P)
        return float(lo), float(hi)
    except (ImportError, AttributeError):
        pass
    if P <= 1:
        return 0.0, 0.0
    f = (P - 1) / P
    table = {
        "dense": (2.0 * n * f, 2.0 * n * f),
        "topka": (2.0 * k * (P - 1),) * 2,
        "gtopk": (2.0 * k * _log2ceil(P),) * 2,
        "topkdsa": (4.0 * k * f, (2.0 * k + n) * f),
        "spardl": (4.0 * k * f,) * 2,
        "oktopk": (2.0 * k * f, 6.0 * k * f),
        "gaussiank": (2.0 * math.ceil(1.5 * k) * (P - 1),) * 2,
    }
    return table.get(name, (float("nan"), float("nan")))


def lower_bound_words(k: int, P: int) -> float:
    return 2.0 * k * (P - 1) / P


# -- gradients ------------------------------------------------------------------------------------------
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


# -- one rank -------------------------------------------------------------------------------------------
def _rank_run(comm, name: str, n: int, density: float, steps: int, seed: int,
              check_finite: str, scale=None) -> Dict[str, Any]:
    import torch
    from ..algorithms import get_algorithm
    dev = comm.device
    cuda = dev.type == "cuda"
    alg = get_algorithm(name)(n, comm, density, check_finite=check_finite)
    if scale is None:
        scale = grad_scale(n, seed)
    rec: Dict[str, Any] = {"bytes": [], "stats_bytes": [], "time_s": [], "nnz": []}
    for t in range(steps):
        g = make_grad(n, seed, comm.rank, t, device=dev, scale=scale)
        if cuda:
            torch.cuda.synchronize(dev)
        comm.barrier()
        b0 = comm.bytes_sent
        t0 = time.perf_counter()
        out = alg(g)
        if cuda:
            torch.cuda.synchronize(dev)
        dt = time.perf_counter() - t0
        rec["bytes"].append(int(comm.bytes_sent - b0))
        rec["stats_bytes"].append(int(alg.stats.get("bytes_sent", -1)))
        rec["time_s"].append(dt)
        rec["nnz"].append(int((out != 0).sum().item()))
        del out, g
    rec["k"] = alg.k
    return rec


# -- backends -------------------------------------------------------------------------------------------
def _run_local(name, P, n, density, steps, seed, check_finite, timeout):
    from ..comm.local import LocalCluster
    scale = grad_scale(n, seed)
    return LocalCluster(P, timeout=timeout).run(_rank_run, name, n, density, steps, seed,
                                                check_finite, scale)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_entry(rank, P, port, backend, name, n, density, steps, seed, check_finite, timeout, q):
    try:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        from ..comm.torch_dist import TorchCommunicator
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=P, timeout=datetime.timedelta(seconds=timeout))
        try:
            comm = TorchCommunicator()
            if backend == "nccl":
                comm.device = torch.device("cuda", rank)
            rec = _rank_run(comm, name, n, density, steps, seed, check_finite)
        finally:
            dist.destroy_process_group()
        q.put((rank, "ok", rec))
    except BaseException:  # noqa: BLE001 - reported to the parent
        q.put((rank, "error", traceback.format_exc()))


def _run_procs(backend, name, P, n, density, steps, seed, check_finite, timeout):
    import queue as _queue

    import torch.multiprocessing as mp
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_proc_entry, args=(r, P, port, backend, name, n, density, steps,
                                                   seed, check_finite, timeout, q), daemon=True)
             for r in range(P)]
    for pr in procs:
        pr.start()
    results: List[Any] = [None] * P
    deadline = time.monotonic() + timeout + 60
    try:
        got = 0
        while got < P:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{backend}: {name} P={P} did not finish in {timeout:g}s")
            try:
                rank, status, payload = q.get(timeout=min(left, 5.0))
            except _queue.Empty:
                dead = [r for r, pr in enumerate(procs)
                        if not pr.is_alive() and pr.exitcode not in (0, None) and results[r] is None]
                if dead:
                    raise RuntimeError(f"{backend}: ranks {dead} died (exit codes "
                                       f"{[procs[r].exitcode for r in dead]})")
                continue
            if status != "ok":
                raise RuntimeError(f"{backend}: rank {rank} failed:\n{payload}")
            results[rank] = payload
            got += 1
    finally:
        for pr in procs:
            pr.join(timeout=5)
            if pr.is_alive():
                pr.kill()
    return results


# -- the benchmark ----------------------------------------------------------------------------------------
def _summary(name, P, n, density, per_rank, wall_s, check_finite) -> Dict[str, Any]:
    steps = len(per_rank[0]["bytes"])
    later = list(range(1, steps)) if steps > 1 else [0]
    k = per_rank[0]["k"]
    by = [[r["bytes"][t] for r in per_rank] for t in range(steps)]       # [step][rank]
    sb = [[r["stats_bytes"][t] for r in per_rank] for t in range(steps)]
    tm = [[r["time_s"][t] for r in per_rank] for t in range(steps)]
    nnz = [per_rank[0]["nnz"][t] for t in range(steps)]
    lo, hi = formula_words(name, n, k, P)
    check_bytes = (2 * (P - 1) * 4 // P) if (check_finite != "off" and P > 1) else 0
    mean_b = sum(sum(by[t]) for t in later) / (len(later) * P)
    return {
        "algorithm": name, "P": P, "n": n, "density": density, "k": k, "steps": steps,
        "bytes_per_rank_per_step": by,
        "stats_bytes_per_rank_per_step": sb,
        "bytes_match_stats": by == sb,
        "bytes_mean": mean_b,
        "bytes_max": max(max(row) for row in by),
        "bytes_first_step_max": max(by[0]),
        "check_bytes": check_bytes,
        "formula_words_low": lo, "formula_words_high": hi,
        "formula_bytes_low": 4.0 * lo, "formula_bytes_high": 4.0 * hi,
        "lower_bound_bytes": 4.0 * lower_bound_words(k, P),
        "ratio_to_formula_high": (mean_b - check_bytes) / (4.0 * hi) if hi > 0 else None,
        "ratio_to_formula_low": (mean_b - check_bytes) / (4.0 * lo) if lo > 0 else None,
        "ratio_to_lower_bound": (mean_b - check_bytes) / (4.0 * lower_bound_words(k, P))
        if P > 1 else None,
        "time_s_per_step": [max(row) for row in tm],
        "time_s_mean": sum(max(tm[t]) for t in later) / len(later),
        "nnz_per_step": nnz,
        "nnz_mean": sum(nnz[t] for t in later) / len(later),
        "wall_s": wall_s,
    }


def _machine() -> Dict[str, Any]:
    info: Dict[str, Any] = {"hostname": platform.node(), "platform": platform.platform(),
                            "processor": platform.processor() or platform.machine(),
                            "cpu_count": os.cpu_count()}
    try:
        with open("/proc/meminfo") as f:
            info["mem_total_kb"] = int(f.readline().split()[1])
    except Exception:  # noqa: BLE001
        pass
    try:
        import torch
        if torch.cuda.is_available():
            info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    except Exception:  # noqa: BLE001
        pass
    return info


def _versions() -> Dict[str, Any]:
    v: Dict[str, Any] = {"python": sys.version.split()[0]}
    for mod in ("torch", "triton", "numpy", "oktopk_triton"):
        try:
            v[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            v[mod] = None
    return v


def resolve_algorithms(names: List[str]):
    """(to run, skipped notes)."""
    from ..algorithms import REGISTRY, SPARSE_ALGORITHMS, available_algorithms
    avail = available_algorithms()
    if any(x.lower() == "all" for x in names):
        wanted = ["dense"] + [a for a in SPARSE_ALGORITHMS]
    else:
        wanted = [x.lower() for x in names]
    run, skipped = [], []
    for a in wanted:
        if a not in REGISTRY:
            raise SystemExit(f"oktopk-bench collectives: unknown algorithm {a!r}; "
                             f"choose from {sorted(REGISTRY)} or 'all'")
        if a in avail:
            if a not in run:
                run.append(a)
        else:
            skipped.append({"algorithm": a, "reason": "not implemented yet (module missing)"})
    return run, skipped


def run_benchmark(args, log=print) -> Dict[str, Any]:
    import torch
    algs, skipped = resolve_algorithms(args.algorithms)
    for s in skipped:
        log(f"note: skipping {s['algorithm']}: {s['reason']}")
    backend = args.backend
    ngpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "local":
        torch.set_num_threads(1)
    results, errors = [], []
    for P in args.world_sizes:
        if P < 1:
            raise SystemExit(f"world size must be >= 1, got {P}")
        if backend == "nccl" and P > ngpu:
            note = (f"nccl: P={P} skipped: {ngpu} GPU(s) present (one rank per GPU)"
                    if ngpu else "nccl: skipped: no CUDA GPU present")
            log("note: " + note)
            skipped.append({"P": P, "reason": note})
            continue
        for name in algs:
            t0 = time.perf_counter()
            try:
                if backend == "local":
                    per_rank = _run_local(name, P, args.n, args.density, args.steps, args.seed,
                                          args.check_finite, args.timeout)
                else:
                    per_rank = _run_procs(backend, name, P, args.n, args.density, args.steps,
                                          args.seed, args.check_finite, args.timeout)
            except Exception as exc:  # noqa: BLE001 - one failing algorithm does not stop the rest
                msg = f"{type(exc).__name__}: {exc}"
                log(f"error: {name} P={P}: {msg.splitlines()[0] if msg else msg}")
                errors.append({"algorithm": name, "P": P, "error": msg})
                continue
            wall = time.perf_counter() - t0
            s = _summary(name, P, args.n, args.density, per_rank, wall, args.check_finite)
            s["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
            results.append(s)
            if not getattr(args, "quiet", False):
                log(f"  {name:9s} P={P:3d}  {s['bytes_mean'] / 1e6:10.4f} MB/rank/step  "
                    f"({wall:.1f}s)")
    return {
        "benchmark": "collectives",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": _machine(),
        "versions": _versions(),
        "config": {"algorithms": algs, "world_sizes": list(args.world_sizes), "n": args.n,
                   "density": args.density, "steps": args.steps, "backend": backend,
                   "seed": args.seed, "check_finite": args.check_finite,
                   "gradients": "scale*(common_t + own_rank_t), scale=exp(1.5 z) fixed, "
                                "z, common, own ~ N(0,1)"},
        "results": results,
        "skipped": skipped,
        "errors": errors,
    }


def _fmt_bytes(b: float) -> str:
    if b != b:  # nan
        return "n/a"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= f:
            return f"{b / f:.3f} {unit}"
    return f"{b:.0f} B"


def format_table(report: Dict[str, Any]) -> str:
    hdr = ("algorithm", "P", "bytes/rank/step (mean)", "max", "formula §6", "meas/formula",
           "lower bound", "meas/LB", "step ms", "nnz(out)")
    rows = [hdr]
    for s in report["results"]:
        lo, hi = s["formula_bytes_low"], s["formula_bytes_high"]
        form = _fmt_bytes(hi) if lo == hi else f"{_fmt_bytes(lo)}..{_fmt_bytes(hi)}"
        r1 = s["ratio_to_formula_high"]
        if lo != hi and s.get("ratio_to_formula_low") is not None:  # a range: show both ends
            ratio = f"{s['ratio_to_formula_low']:.3f} lo/{r1:.3f} hi"
        else:
            ratio = "-" if r1 is None else f"{r1:.3f}"
        r2 = s["ratio_to_lower_bound"]
        rows.append((s["algorithm"], str(s["P"]), _fmt_bytes(s["bytes_mean"]),
                     _fmt_bytes(s["bytes_max"]), form,
                     ratio, _fmt_bytes(s["lower_bound_bytes"]),
                     "-" if r2 is None else f"{r2:.2f}", f"{1e3 * s['time_s_mean']:.1f}",
                     f"{s['nnz_mean']:.0f}"))
    w = [max(len(r[i]) for r in rows) for i in range(len(hdr))]
    lines = [" | ".join(c.ljust(w[i]) if i == 0 else c.rjust(w[i]) for i, c in enumerate(r))
             for r in rows]
    lines.insert(1, "-+-".join("-" * x for x in w))
    return "\n".join(lines)


def plot(report: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cfg = report["config"]
    fig, ax = plt.subplots(figsize=(7.5, 5))
    names = []
    for s in report["results"]:
        if s["algorithm"] not in names:
            names.append(s["algorithm"])
    for name in names:
        rs = sorted((s for s in report["results"] if s["algorithm"] == name), key=lambda s: s["P"])
        rs = [s for s in rs if s["P"] > 1]
        if rs:
            ax.plot([s["P"] for s in rs], [s["bytes_mean"] for s in rs], marker="o", label=name)
    lb = {}
    for s in report["results"]:
        if s["P"] > 1:
            lb[s["P"]] = s["lower_bound_bytes"]
    if lb:
        ps = sorted(lb)
        ax.plot(ps, [lb[p] for p in ps], "k--", label="lower bound 2k(P-1)/P words")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size P")
    ax.set_ylabel("bytes sent per rank per step")
    ax.set_title(f"collectives ({cfg['backend']}): n={cfg['n']}, density={cfg['density']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args) -> int:
    log = (lambda *a, **k: None) if args.quiet else (lambda *a, **k: print(*a, **k, flush=True))
    if args.steps < 1:
        raise SystemExit("--steps must be >= 1")
    report = run_benchmark(args, log=log)
    print(format_table(report), flush=True)
    for s in report["skipped"]:
        print(f"skipped: {s}", flush=True)
    for e in report["errors"]:
        print(f"error: {e['algorithm']} P={e['P']}: {e['error'].splitlines()[0]}", flush=True)
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}", flush=True)
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}", flush=True)
    return 1 if report["errors"] else 0


if __name__ == "__main__":  # python -m oktopk_triton.bench.collectives
    import argparse
    _p = argparse.ArgumentParser(prog="oktopk-bench collectives")
    add_arguments(_p)
    sys.exit(main(_p.parse_args()))
