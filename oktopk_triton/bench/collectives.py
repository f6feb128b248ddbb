"""``oktopk-bench collectives``: bytes per rank per step and step time of every algorithm over
world sizes, against the formulas of docs/algorithms.md §6 and the lower bound ``2k(P-1)/P`` words.

    oktopk-bench collectives --algorithms all --world-sizes 2 4 8 16 32 --n 4194304 \\
        --density 0.01 [--steps 3] [--warmup 1] [--backend local|gloo|nccl] [--comm cupy|torch]
        [--json PATH] [--plot PATH]

For the process backends, one group of P processes runs the probes and then every algorithm in
turn (CUDA and NCCL start once per P); an algorithm that fails ends its group and the remaining
algorithms run in a new one.

Gradients: deterministic from ``--seed``, heavy tailed and correlated across ranks like real
data-parallel gradients: ``g = scale * (common_t + own_{rank,t})`` with a fixed log-normal
per-coordinate ``scale`` (``exp(1.5 z)``) and standard normal ``common_t`` / ``own``.

Variants: ``--algorithms dense oktopk oktopk:wire_format=compact oktopk:graph=1`` runs one
configuration of an algorithm per label (its constructor's options after the colon, as
``SparseAllreduce`` takes them; ``graph=1`` times the steady step replayed from a CUDA graph,
``oktopk_triton.modes.graph.GraphedStep``, NCCL only, with ``--warmup`` past its eager steps). The
label is the result's ``algorithm``; ``base_algorithm``, ``options`` and ``graph`` say what it
ran. A variant that its algorithm refuses exits with one line before any rank starts.

Measured why: docs/research/design-notes.md, ``oktopk_triton/bench/collectives.py``.
"""
from __future__ import annotations

import datetime
import os
import platform
import resource
import sys
import time
from typing import Any, Dict, List, Optional

from ..algorithms._sparse import volume_formula_range
from . import _args as A
from . import records
from ._common import fmt_bytes
from ._common import resolve_algorithms
from .collectives_rank import _rank_main, _run_local, _run_local_probes, parse_variant
from .measure import step_stats
from .ranks import Ranks, detect_mps, mps_warning, placement, ranks_share_gpu, warn_loudly

__all__ = ["add_arguments", "main", "run_benchmark", "formula_words", "lower_bound_words",
           "rank_env", "default_json_path"]


# -- arguments -------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--algorithms", nargs="+", default=["all"],
                   help="algorithm names, or 'all' = dense + every available sparse algorithm; "
                        "a variant: NAME:KEY=VALUE[,KEY=VALUE] with the algorithm's options "
                        "(oktopk:wire_format=compact) and graph=1 (the steady step replayed "
                        "from a CUDA graph; --backend nccl)")
    p.add_argument("--world-sizes", nargs="+", type=A.positive_int, default=[2, 4, 8],
                   help="world sizes P to run (default: 2 4 8)")
    p.add_argument("--n", type=A.positive_int, default=1 << 22,
                   help="gradient length (default 2^22)")
    p.add_argument("--density", type=A.density, default=0.01, help="k = density * n (default 0.01)")
    p.add_argument("--steps", type=A.positive_int, default=3,
                   help="steps per run; the first is the calibration step (default 3)")
    p.add_argument("--warmup", type=A.nonneg_int, default=1,
                   help="steps left out of the step times' mean/min/median (default 1; "
                        "< --steps)")
    p.add_argument("--backend", choices=("local", "gloo", "nccl"), default="local")
    p.add_argument("--comm", choices=("cupy", "torch"), default="cupy",
                   help="nccl backend: NcclCommunicator (cupy) or TorchCommunicator on an NCCL "
                        "group (torch)")
    p.add_argument("--probe-reps", type=A.nonneg_int, default=10,
                   help="timed calls of each probe allreduce per P (0: no probes; default 10)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-finite", choices=("skip", "off", "raise"), default="skip",
                   help="the algorithms' non-finite check (skip adds a 4-byte allreduce)")
    p.add_argument("--timeout", type=A.positive_float, default=900.0,
                   help="seconds one (algorithm, P) run may take (default 900)")
    p.add_argument("--comm-timeout", type=A.positive_float, default=300.0,
                   help="seconds a collective may wait on a peer before the communicator fails "
                        "(gloo group timeout, NcclCommunicator watchdog; default 300)")
    p.add_argument("--json", type=A.out_path, default=None,
                   help="write the results JSON here (nccl default: "
                        "bench/results/collectives/gpu-collectives-<date>-<device>.json)")
    p.add_argument("--plot", type=A.out_path, default=None,
                   help="write a bytes-vs-P plot (PNG) here")
    p.add_argument("--quiet", action="store_true", help="print only the final table")


# -- formulas --------------------------------------------------------------------------------------


def formula_words(name: str, n: int, k: int, P: int):
    """(low, high) words per rank per step by docs/algorithms.md §6 (headers not included)."""
    lo, hi = volume_formula_range(name, n, k, P)
    return float(lo), float(hi)


def lower_bound_words(k: int, P: int) -> float:
    return 2.0 * k * (P - 1) / P


# -- process groups --------------------------------------------------------------------------------
def rank_env(rank: int, P: int, ngpu: int) -> Dict[str, str]:
    """What rank ``rank``'s process sets before NCCL initialises (its :func:`ranks.placement`)."""
    return placement(rank, P, ngpu)[1] if ngpu else {}


def _run_group(P: int, algs: List[str], cfg: Dict[str, Any], log=print) -> Dict[str, Any]:
    """Run ``algs`` (and the probes when ``cfg["probes"]``) on one group of P processes.

    Returns ``{"results": {name: per-rank records}, "probes": per-rank probes or None,
    "info": per-rank info, "error": None or {"algorithm", "error"}, "remaining": names not
    run because of the error}``. A failure ends the group (its processes are killed); the caller
    starts a new group for the remaining algorithms."""
    ranks = Ranks(P, _rank_main, (cfg, algs), name="oktopk-bench-rank")
    out: Dict[str, Any] = {"results": {}, "probes": None, "info": [None] * P, "error": None,
                           "remaining": []}
    per_alg: Dict[str, List[Any]] = {a: [None] * P for a in algs}
    probes: List[Any] = [None] * P
    timeout = float(cfg["timeout"])
    deadline = time.monotonic() + timeout + float(cfg["startup_timeout"])

    def failed_at(rank: int) -> Optional[str]:
        """What ``rank`` was running when it failed: setup (a new group would fail the same
        way), an algorithm, or the teardown."""
        if out["info"][rank] is None or (cfg["probes"] and probes[rank] is None):
            return "<setup>"
        return next((a for a in algs if per_alg[a][rank] is None), "<teardown>")

    def take(rank, kind, payload) -> None:
        nonlocal deadline
        if kind == "ready":
            out["info"][rank] = payload
        elif kind == "probes":
            probes[rank] = payload
            if all(p is not None for p in probes):
                out["probes"] = probes
        elif kind == "alg":
            name, rec = payload
            per_alg[name][rank] = rec
            if all(x is not None for x in per_alg[name]):
                out["results"][name] = per_alg[name]
                deadline = time.monotonic() + timeout
                log(f"  {name:9s} P={P:3d} done")
        elif kind == "fatal":
            out["error"] = {"algorithm": failed_at(rank),
                            "error": f"rank {rank} failed:\n{payload[1]}"}
        elif kind == "died":
            out["error"] = {"algorithm": None, "error": payload}
        elif kind == "timeout":
            current = next((a for a in algs if a not in out["results"]), None)
            out["error"] = {"algorithm": None, "error": f"TimeoutError: P={P} "
                            f"{current or 'probes'} did not finish in {timeout:g}s"}

    try:
        while ranks.pending() and out["error"] is None:
            take(*ranks.get(deadline))
        if out["error"] is not None:   # other ranks' results sent before the failure
            for item in ranks.drain(5.0):
                if item[1] in ("alg", "probes", "ready"):
                    take(*item)
    finally:
        ranks.stop(5.0 if out["error"] is None else 0.5)
    err = out["error"]
    if err is not None:
        if err["algorithm"] is None:
            err["algorithm"] = next((a for a in algs if a not in out["results"]), None)
        if err["algorithm"] != "<setup>":   # a group that could not start: nothing to retry
            out["remaining"] = [a for a in algs
                                if a not in out["results"] and a != err["algorithm"]]
    return out


# -- the benchmark ---------------------------------------------------------------------------------
def _summary(name, P, n, density, per_rank, wall_s, check_finite,
             warmup: int = 1) -> Dict[str, Any]:
    steps = len(per_rank[0]["bytes"])
    later = list(range(1, steps)) if steps > 1 else [0]
    timed = list(range(warmup, steps)) if steps > warmup else list(range(steps))
    k = per_rank[0]["k"]
    base, options, graph = parse_variant(name)
    by = [[r["bytes"][t] for r in per_rank] for t in range(steps)]       # [step][rank]
    sb = [[r["stats_bytes"][t] for r in per_rank] for t in range(steps)]
    nnz = [per_rank[0]["nnz"][t] for t in range(steps)]
    lo, hi = formula_words(base, n, k, P)
    check_bytes = (2 * (P - 1) * 4 // P) if (check_finite != "off" and P > 1) else 0
    mean_b = sum(sum(by[t]) for t in later) / (len(later) * P)
    st = step_stats([r["time_s"] for r in per_rank], timed)
    step_s = st["step_s"]
    sums = [[r.get("checksum", [None] * steps)[t] for r in per_rank] for t in range(steps)]
    colls = [[r.get("collectives", [None] * steps)[t] for r in per_rank] for t in range(steps)]
    steady_colls = [c for t in timed for c in colls[t] if c is not None]
    syncs = [r.get("host_syncs") for r in per_rank]
    return {
        "algorithm": name, "P": P, "n": n, "density": density, "k": k, "steps": steps,
        "warmup": warmup, "base_algorithm": base, "options": options, "graph": graph,
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
        "time_s_per_step": step_s,
        "time_s_mean": sum(step_s[t] for t in later) / len(later),
        "nnz_per_step": nnz,
        "nnz_mean": sum(nnz[t] for t in later) / len(later),
        "wall_s": wall_s,
        # the one-GPU benchmark's figures
        "step_ms_mean": st["ms_mean"],
        "step_ms_min": st["ms_min"],
        "step_ms_median": st["ms_median"], "step_ms_p25": st["ms_p25"],
        "step_ms_p75": st["ms_p75"],
        "mb_sent_per_rank": mean_b / 1e6,
        "ratio_to_dense": None,            # filled in once the run's dense result is known
        "bytes_ratio_to_dense": None,
        "host_syncs": None if any(x is None for x in syncs) else max(syncs),
        "host_syncs_per_rank": syncs,
        "out_checksums_per_step": [row[0] for row in sums],
        "out_bitwise_equal": all(None not in row and len(set(row)) == 1 for row in sums),
        "collectives_per_rank_per_step": colls,
        "collectives_per_step": max(steady_colls) if steady_colls else None,
        # between steps (the reducer's tensors) and within one step (CPU: profiler), in units
        # of n fp32 words, the largest rank's
        "persistent_words_per_n": max(r.get("persistent_bytes", 0) for r in per_rank) / (4.0 * n),
        "peak_transient_words_per_n": (per_rank[0]["peak_transient_bytes"] / (4.0 * n)
                                       if per_rank[0].get("peak_transient_bytes") is not None
                                       else None),
    }


def _fill_dense_ratios(results: List[Dict[str, Any]]) -> None:
    """``ratio_to_dense``: step_ms_mean / dense's step_ms_mean at the same P in this run
    (below 1: faster than dense); ``bytes_ratio_to_dense`` likewise for bytes_mean."""
    dense = {r["P"]: r for r in results if r["algorithm"] == "dense"}
    for r in results:
        d = dense.get(r["P"])
        if d is None:
            continue
        if d["step_ms_mean"] > 0:
            r["ratio_to_dense"] = r["step_ms_mean"] / d["step_ms_mean"]
        if d.get("step_ms_median"):
            r["median_ratio_to_dense"] = r["step_ms_median"] / d["step_ms_median"]
        if d["bytes_mean"] > 0:
            r["bytes_ratio_to_dense"] = r["bytes_mean"] / d["bytes_mean"]


def _probe_summary(P: int, per_rank: List[List[Dict[str, Any]]]) -> List[Dict[str, Any]]:
    out = []
    for i, first in enumerate(per_rank[0]):
        reps = len(first["time_s"])
        st = step_stats([r[i]["time_s"] for r in per_rank], range(reps))
        out.append({"P": P, "op": first["op"], "bytes": first["bytes"],
                    "ms_mean": st["ms_mean"], "ms_min": st["ms_min"],
                    "reps": reps, "ms_per_rep": [1e3 * x for x in st["step_s"]]})
    return out


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


def device_slug(name: str) -> str:
    import re
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-") or "unknown"


def default_json_path(report: Dict[str, Any]) -> str:
    """``gpu-collectives-<date>-<device>.json`` in :func:`records.results_dir`."""
    return records.results_path(f"gpu-collectives-{report['date'][:10]}-"
                                f"{device_slug(report['device'])}.json")


def _gpu_count() -> int:
    """GPUs visible, without creating a CUDA context in this (parent) process."""
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:  # noqa: BLE001
        return 0


def resolve_variants(raw: List[str], backend: str, warmup: int):
    """(run labels, [(skipped, why)]) from ``--algorithms``: plain names and ``all`` as every
    benchmark reads them, variants (:func:`parse_variant`) checked before any rank starts: a
    known name, options its constructor takes (built once at a tiny size on one CPU rank), and
    ``graph=1`` only on NCCL with every eager step left out of the timing. A bad variant exits
    with one line."""
    from ..algorithms import get_algorithm
    from ..comm.local import SingleCommunicator
    from ..modes.graph import EAGER_STEPS
    plain = [a for a in raw if ":" not in a]
    names, skipped = resolve_algorithms(plain, "collectives") if plain else ([], [])
    labels: List[str] = []
    for a in raw:
        if ":" not in a:
            labels += [x for x in names if x not in labels and (a.lower() in (x, "all"))]
            continue
        try:
            base, opts, graph = parse_variant(a)
        except ValueError as exc:
            raise SystemExit(f"oktopk-bench collectives: {exc}") from None
        resolve_algorithms([base], "collectives")
        label = a.partition(":")[0].lower() + ":" + a.partition(":")[2]
        try:
            get_algorithm(base)(256, SingleCommunicator(), 0.1, **opts)
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"oktopk-bench collectives: {a!r}: "
                             f"{str(exc).splitlines()[0]}") from None
        if graph and backend != "nccl":
            raise SystemExit(f"oktopk-bench collectives: {a!r}: graph=1 needs --backend nccl "
                             f"(CUDA graphs; the {backend} ranks synchronise in Python)")
        if graph and warmup <= EAGER_STEPS:
            raise SystemExit(f"oktopk-bench collectives: {a!r}: graph=1 needs --warmup > "
                             f"{EAGER_STEPS} (the eager steps before the capture), got {warmup}")
        if label not in labels:
            labels.append(label)
    return labels, skipped


def run_benchmark(args, log=print) -> Dict[str, Any]:
    import torch
    backend = args.backend
    warmup = int(getattr(args, "warmup", 1))
    algs, skipped_names = resolve_variants(args.algorithms, backend, warmup)
    skipped: List[Dict[str, Any]] = [{"algorithm": a, "reason": why} for a, why in skipped_names]
    for s in skipped:
        log(f"note: skipping {s['algorithm']}: {s['reason']}")
    probe_reps = int(getattr(args, "probe_reps", 10))
    comm_kind = {"local": "local", "gloo": "torch"}.get(backend, getattr(args, "comm", "cupy"))
    comm_timeout = float(getattr(args, "comm_timeout", None) or args.timeout)
    ngpu = _gpu_count() if backend == "nccl" else 0
    mps = detect_mps()
    if backend == "local":
        torch.set_num_threads(1)
    results, errors, probes, warnings_, rank_info = [], [], [], [], {}
    date = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    for P in args.world_sizes:
        if P < 1:
            raise SystemExit(f"world size must be >= 1, got {P}")
        if backend == "nccl" and ngpu == 0:
            note = "nccl: skipped: no CUDA GPU present"
            log("note: " + note)
            skipped.append({"P": P, "reason": note})
            continue
        warn = mps_warning(P, ngpu, mps) if backend == "nccl" else None
        if warn:
            warn_loudly(warn)
            warnings_.append({"P": P, "warning": warn})
        per_alg: Dict[str, Any] = {}
        walls: Dict[str, float] = {}
        if backend == "local":
            probes += _local_world(args, P, algs, probe_reps, per_alg, walls, errors, log)
        else:
            cfg = {"backend": backend, "comm": comm_kind, "n": args.n, "density": args.density,
                   "steps": args.steps, "seed": args.seed, "check_finite": args.check_finite,
                   "timeout": args.timeout, "comm_timeout": comm_timeout,
                   "startup_timeout": 300.0, "ngpu": ngpu, "probes": probe_reps > 0,
                   "probe_reps": probe_reps, "env": [rank_env(r, P, ngpu) for r in range(P)]}
            probes += _process_world(args, P, algs, cfg, per_alg, walls, errors, rank_info, log)
        for name in algs:
            if name not in per_alg:
                continue
            s = _summary(name, P, args.n, args.density, per_alg[name], walls[name],
                         args.check_finite, warmup=warmup)
            s["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
            s["ranks_share_gpu"] = ranks_share_gpu(P, ngpu)
            results.append(s)
            if not getattr(args, "quiet", False):
                log(f"  {name:9s} P={P:3d}  {s['bytes_mean'] / 1e6:10.4f} MB/rank/step  "
                    f"{s['step_ms_mean']:9.2f} ms/step  ({walls[name]:.1f}s)")
    _fill_dense_ratios(results)
    return _report(args, algs, backend, comm_kind, comm_timeout, warmup, probe_reps, ngpu, mps,
                   date, probes, results, rank_info, warnings_, skipped, errors)


def _local_world(args, P, algs, probe_reps, per_alg, walls, errors, log) -> List[Dict]:
    """``--backend local``: every algorithm at world size P in this process (its records into
    ``per_alg``, its wall time into ``walls``, a failure into ``errors``); returns the probes."""
    probes: List[Dict] = []
    if probe_reps > 0:
        probes += _probe_summary(P, _run_local_probes(P, args.n, probe_reps, args.timeout))
    for name in algs:
        t0 = time.perf_counter()
        try:
            per_alg[name] = _run_local(name, P, args.n, args.density, args.steps,
                                       args.seed, args.check_finite, args.timeout)
        except Exception as exc:  # noqa: BLE001 - one failing algorithm does not stop the rest
            msg = f"{type(exc).__name__}: {exc}"
            log(f"error: {name} P={P}: {msg.splitlines()[0] if msg else msg}")
            errors.append({"algorithm": name, "P": P, "error": msg})
            continue
        walls[name] = time.perf_counter() - t0
    return probes


def _process_world(args, P, algs, cfg, per_alg, walls, errors, rank_info, log) -> List[Dict]:
    """gloo / nccl: the algorithms on groups of P processes, a new group after a failure for
    the algorithms left (records into ``per_alg``, wall times into ``walls``, failures into
    ``errors``, the ranks' info into ``rank_info``); returns the probes."""
    probes: List[Dict] = []
    todo = list(algs)
    while True:
        t0 = time.perf_counter()
        quiet = getattr(args, "quiet", False)
        g = _run_group(P, todo, cfg, log=(lambda *a: None) if quiet else log)
        wall = time.perf_counter() - t0
        for name, recs in g["results"].items():
            per_alg[name] = recs
            walls[name] = wall / max(1, len(g["results"]))
        if g["probes"] is not None:
            probes += _probe_summary(P, g["probes"])
        if any(g["info"]):
            rank_info[P] = g["info"]
        if g["error"] is None:
            break
        e = g["error"]
        first = e["error"].strip().splitlines()[-1] if e["error"].strip() else ""
        log(f"error: {e['algorithm']} P={P}: {first}")
        errors.append({"algorithm": e["algorithm"], "P": P, "error": e["error"]})
        cfg["probes"] = False
        todo = g["remaining"]
        if not todo:
            break
    return probes


def _report(args, algs, backend, comm_kind, comm_timeout, warmup, probe_reps, ngpu, mps, date,
            probes, results, rank_info, warnings_, skipped, errors) -> Dict[str, Any]:
    """The collectives report (what the JSON holds)."""
    info0 = next((i[0] for i in rank_info.values() if i and i[0]), {}) or {}
    device = info0.get("device_name") or ("cpu" if backend != "nccl" else None)
    if device is None:
        device = "cuda"
    head = records.header("collectives", args, device=device, mps=mps)
    head["date"] = date
    if info0.get("nccl"):   # the ranks' own NCCL (CuPy's for --comm cupy)
        head["versions"]["nccl"] = info0["nccl"]
    return {
        **head,
        "backend": backend,
        "comm": comm_kind,
        "host": platform.node(),
        "gpus": ngpu if backend == "nccl" else _gpu_count(),
        "config": {"algorithms": algs, "world_sizes": list(args.world_sizes), "n": args.n,
                   "density": args.density, "steps": args.steps, "warmup": warmup,
                   "backend": backend, "comm": comm_kind, "seed": args.seed,
                   "check_finite": args.check_finite, "probe_reps": probe_reps,
                   "timeout": args.timeout, "comm_timeout": comm_timeout,
                   "rank_placement": "rank r on cuda:(r % gpus); NCCL_HOSTID per rank when "
                                     "ranks share a GPU" if backend == "nccl" else None,
                   "rank_env": {str(P): [rank_env(r, P, ngpu) for r in range(P)]
                                for P in args.world_sizes} if backend == "nccl" else None,
                   "timing": "per step: barrier, device synchronize, step, device synchronize; "
                             "a step's time is its slowest rank's; mean/min/median/quartiles "
                             "over the steps after the first `warmup`",
                   "gradients": "scale*(common_t + own_rank_t), scale=exp(1.5 z) fixed, "
                                "z, common, own ~ N(0,1)"},
        "probes": probes,
        "results": results,
        "machine": _machine(),
        "rank_info": {str(P): v for P, v in rank_info.items()},
        "warnings": warnings_,
        "skipped": skipped,
        "errors": errors,
    }


def _formula_cells(s: Dict[str, Any]):
    """(formula §6 bytes, measured/formula) of a result: a range shows both ends."""
    lo, hi = s["formula_bytes_low"], s["formula_bytes_high"]
    form = fmt_bytes(hi, 3) if lo == hi else f"{fmt_bytes(lo, 3)}..{fmt_bytes(hi, 3)}"
    r1 = s["ratio_to_formula_high"]
    if lo != hi and s.get("ratio_to_formula_low") is not None:
        return form, f"{s['ratio_to_formula_low']:.3f} lo/{r1:.3f} hi"
    return form, "-" if r1 is None else f"{r1:.3f}"


def _opt(fmt: str, key: str):
    """A cell of an optional number: ``-`` where the result has none."""
    return lambda s: "-" if s.get(key) is None else format(s[key], fmt)


_COLUMNS = [
    ("algorithm", lambda s: s["algorithm"]), ("P", lambda s: s["P"]),
    ("bytes/rank/step (mean)", lambda s: fmt_bytes(s["bytes_mean"], 3)),
    ("max", lambda s: fmt_bytes(s["bytes_max"], 3)),
    ("formula §6", lambda s: _formula_cells(s)[0]),
    ("meas/formula", lambda s: _formula_cells(s)[1]),
    ("lower bound", lambda s: fmt_bytes(s["lower_bound_bytes"], 3)),
    ("meas/LB", _opt(".2f", "ratio_to_lower_bound")),
    ("step ms mean", lambda s: f"{s['step_ms_mean']:.2f}"),
    ("median", _opt(".2f", "step_ms_median")),
    ("min", lambda s: f"{s['step_ms_min']:.2f}"), ("vs dense", _opt(".3f", "ratio_to_dense")),
    ("syncs", _opt("", "host_syncs")),
    ("bitwise", lambda s: "yes" if s.get("out_bitwise_equal") else "NO"),
    ("colls", _opt("", "collectives_per_step")), ("nnz(out)", lambda s: f"{s['nnz_mean']:.0f}"),
    ("state/n", lambda s: f"{s.get('persistent_words_per_n', 0):.3f}"),
    ("peak/n", _opt(".2f", "peak_transient_words_per_n")),
]


def format_table(report: Dict[str, Any]) -> str:
    lines = [records.table(report["results"], _COLUMNS)]
    if report.get("probes"):
        lines.append("")
        lines.append("probes (allreduce, fp32):   P | bytes        | ms mean  | ms min")
        for pr in report["probes"]:
            lines.append(f"{'':28s}{pr['P']:3d} | {pr['bytes']:12d} | {pr['ms_mean']:8.3f} | "
                         f"{pr['ms_min']:8.3f}")
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
    if not 0 <= getattr(args, "warmup", 1) < args.steps and args.steps > 1:
        raise SystemExit("--warmup must be >= 0 and below --steps")
    report = run_benchmark(args, log=log)
    print(format_table(report), flush=True)
    for w in report["warnings"]:
        warn_loudly(w["warning"])  # again at the end, where it cannot be missed
    for s in report["skipped"]:
        print(f"skipped: {s}", flush=True)
    for e in report["errors"]:
        print(f"error: {e['algorithm']} P={e['P']}: {e['error'].splitlines()[0]}", flush=True)
    path = args.json
    if path is None and args.backend == "nccl" and report["results"]:
        path = default_json_path(report)
    if path:
        records.write(path, report)
        print(f"wrote {path}", flush=True)
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}", flush=True)
    return 1 if report["errors"] else 0


if __name__ == "__main__":  # python -m oktopk_triton.bench.collectives: the CLI's checked path
    from ..cli import main as _cli_main
    raise SystemExit(_cli_main(["collectives", *sys.argv[1:]]))
