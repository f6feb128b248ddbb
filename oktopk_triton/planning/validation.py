"""The cost model against measured steps: α and β fitted to a collectives JSON's allreduce
probes and dense steps (:func:`fit_network`), every algorithm's step predicted with them
(:func:`validate`), and a synthetic JSON from a known network to test the fit
(:func:`synthetic_collectives`)."""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Sequence, Tuple

from ..algorithms._sparse import _log2ceil
from .communication import _fit_coefficients, comm_time
from .kernel_costs import DEFAULT_KERNELS, PASSES, KernelCosts, selection_time
from .network import Network
from .projection import ALGORITHMS, _k, algorithm_schedule, step_time


def _result_name(r: Dict[str, Any]) -> str:
    return str(r.get("name", r.get("algorithm", ""))).lower()


def _ranks_per_gpu(d: Dict[str, Any], P: int, override: Optional[int]) -> int:
    if override:
        return int(override)
    for src in (d, d.get("config", {})):
        if src.get("ranks_per_gpu"):
            return int(src["ranks_per_gpu"])
    gpus = d.get("machine", {}).get("gpus")
    if gpus:
        return max(1, math.ceil(P / len(gpus)))
    return P          # the one-GPU benchmark: every rank on the one GPU


def _lstsq2(rows: List[Tuple[float, float, float]]) -> Tuple[float, float]:
    """Least squares of t = c·α + b·x (x = 1/β) with relative weights (1/t)."""
    s_cc = s_cb = s_bb = s_ct = s_bt = 0.0
    for c, b, t in rows:
        w = 1.0 / max(t, 1e-12) ** 2
        s_cc += w * c * c
        s_cb += w * c * b
        s_bb += w * b * b
        s_ct += w * c * t
        s_bt += w * b * t
    det = s_cc * s_bb - s_cb * s_cb
    if abs(det) < 1e-300 * max(1.0, s_cc * s_bb):
        raise ValueError("fit: the probes do not separate latency from bandwidth (need a small "
                         "and a large allreduce)")
    alpha = (s_ct * s_bb - s_bt * s_cb) / det
    x = (s_cc * s_bt - s_cb * s_ct) / det
    return alpha, x


def fit_network(d: Dict[str, Any], use_dense: bool = True, kernels: KernelCosts = DEFAULT_KERNELS,
                ranks_per_gpu: Optional[int] = None, stat: str = "ms_mean",
                only_P: Optional[int] = None) -> Dict[str, Any]:
    """α and β from the allreduce probes and (``use_dense``) the dense steps of a collectives
    JSON (only those at ``only_P`` when given), under the same model the projection uses (the
    ring/tree branch of each point is re-chosen with the current α, β until it no longer
    changes). Relative least squares: every point weighs the same, small or large."""
    from ..algorithms.schedule import allreduce
    points = []          # (P, [specs], measured seconds, what, fixed seconds)
    for p in d.get("probes", []):
        if str(p.get("op", "")).lower() != "allreduce" or p.get(stat) is None:
            continue
        P = int(p["P"])
        if only_P is not None and P != only_P:
            continue
        points.append((P, [allreduce(int(p["bytes"]), P)], float(p[stat]) * 1e-3,
                       f"allreduce {int(p['bytes'])} B", 0.0))
    if use_dense:
        rstat = "step_ms_mean" if stat == "ms_mean" else "step_ms_min"
        for r in d.get("results", []):
            if _result_name(r) != "dense" or r.get(rstat) is None:
                continue
            P, n = int(r["P"]), int(r["n"])
            if only_P is not None and P != only_P:
                continue
            specs = algorithm_schedule("dense", n, int(r.get("k") or _k(n, 0.01)), P,
                                       check_finite=d.get("config", {}).get("check_finite", "skip"))
            fixed = selection_time("dense", n, kernels, _ranks_per_gpu(d, P, ranks_per_gpu), 1, P)
            points.append((P, specs, float(r[rstat]) * 1e-3, f"dense step n={n}", fixed))
    if len(points) < 2:
        raise ValueError("fit: need at least two allreduce probes / dense results")
    # start: α from the smallest message, β from the largest
    small = min(points, key=lambda p: sum(s.bytes_per_rank for s in p[1]))
    large = max(points, key=lambda p: sum(s.bytes_per_rank for s in p[1]))
    alpha = max(small[2] - small[4], 1e-9) / max(1, 2 * _log2ceil(small[0]))
    beta = sum(s.bytes_per_rank for s in large[1]) / max(large[2] - large[4], 1e-12)
    net = Network(beta, alpha)
    for _ in range(50):
        rows = []
        for P, specs, t, _, fixed in points:
            c = b = 0.0
            for s in specs:
                ci, bi = _fit_coefficients(s, P, net)
                c += ci
                b += bi
            rows.append((c, b, t - fixed))
        a_new, x = _lstsq2(rows)
        if x <= 0 or a_new < 0:
            raise ValueError(f"fit: no positive solution (alpha={a_new:.3g} s, 1/beta={x:.3g})")
        new = Network(1.0 / x, a_new)
        if math.isclose(new.latency, net.latency, rel_tol=1e-12) and \
                math.isclose(new.bandwidth, net.bandwidth, rel_tol=1e-12):
            net = new
            break
        net = new
    resid = []
    for P, specs, t, what, fixed in points:
        pred = comm_time(specs, P, net) + fixed
        resid.append({"P": P, "what": what, "measured_ms": 1e3 * t, "fitted_ms": 1e3 * pred,
                      "error_pct": 100.0 * (pred - t) / t})
    return {"network": Network(net.bandwidth, net.latency, "fitted"), "points": resid}


def validate(d: Dict[str, Any], kernels: KernelCosts = DEFAULT_KERNELS,
             world_sizes: Sequence[int] = (4, 8), ranks_per_gpu: Optional[int] = None,
             use_dense: bool = True, stat: str = "mean", target_pct: float = 25.0,
             fit: str = "per-P") -> Dict[str, Any]:
    """Fit α, β (:func:`fit_network`), then predict every algorithm's measured step at the
    world sizes asked for. TopkDSA's data-dependent gather is sized from the measured bytes.

    ``fit="per-P"`` (default): one (α, β) per world size, from that world size's probes and dense
    step: on one box the P ranks share the host's loopback and CPU, so the bandwidth per rank
    falls with P (docs/research/gpu-measurements.md: 3.0 GB/s per rank at P=4, 1.9 at P=8 for the
    dense allreduce); a world size without two usable points falls back to the global fit.
    ``fit="global"``: one (α, β) for all, as on a cluster whose links do not depend on P."""
    if fit not in ("per-P", "global"):
        raise ValueError(f"validate: fit must be 'per-P' or 'global', got {fit!r}")
    glob_fit = fit_network(d, use_dense, kernels, ranks_per_gpu, "ms_" + stat)
    fits: Dict[Optional[int], Dict[str, Any]] = {None: glob_fit}
    if fit == "per-P":
        for P in world_sizes:
            try:
                fits[P] = fit_network(d, use_dense, kernels, ranks_per_gpu, "ms_" + stat, P)
            except ValueError:
                fits[P] = glob_fit
    cf = d.get("config", {}).get("check_finite", "skip")
    rows = []
    for r in d.get("results", []):
        name, P = _result_name(r), int(r["P"])
        if P not in world_sizes or name not in PASSES or r.get("step_ms_" + stat) is None:
            continue
        net = fits.get(P, glob_fit)["network"]
        n = int(r["n"])
        k = int(r.get("k") or _k(n, float(d.get("config", {}).get("density", 0.01))))
        measured_bytes = r.get("mb_sent_per_rank")
        kw: Dict[str, Any] = {"check_finite": cf}
        if name == "topkdsa" and measured_bytes is not None:
            kw["topkdsa_bytes"] = float(measured_bytes) * 1e6
        specs = algorithm_schedule(name, n, k, P, **kw)
        rpg = _ranks_per_gpu(d, P, ranks_per_gpu)
        comm = comm_time(specs, P, net)
        sel = selection_time(name, n, kernels, rpg, k, P)
        meas = float(r["step_ms_" + stat])
        pred = 1e3 * (comm + sel)
        rows.append({"algorithm": name, "P": P, "n": n, "k": k, "ranks_per_gpu": rpg,
                     "alpha_s": net.latency, "beta_Bps": net.bandwidth,
                     "measured_ms": meas, "predicted_ms": pred, "comm_ms": 1e3 * comm,
                     "select_ms": 1e3 * sel, "error_pct": 100.0 * (pred - meas) / meas,
                     "schedule_mb": sum(s.bytes_per_rank for s in specs) / 1e6,
                     "measured_mb": measured_bytes})
    within = [abs(x["error_pct"]) <= target_pct for x in rows]

    def net_json(f, P):
        net = f["network"]
        return {"P": P, "bandwidth_Bps": net.bandwidth, "latency_s": net.latency,
                "describe": net.describe(), "points": f["points"],
                "fallback_to_global": P is not None and f is glob_fit}
    return {"synthetic": bool(d.get("synthetic")), "synthetic_from": d.get("synthetic_from"),
            "note": d.get("note"), "fit": fit,
            "networks": [net_json(f, P) for P, f in fits.items()],
            "rows": rows, "target_pct": target_pct,
            "all_within_target": bool(rows) and all(within),
            "kernels": {"source": kernels.source, "device": kernels.device}}


def synthetic_collectives(net: Network, kernels: KernelCosts = DEFAULT_KERNELS,
                          world_sizes: Sequence[int] = (4, 8),
                          n_of: Optional[Dict[int, int]] = None,
                          density: float = 0.01, noise: float = 0.0, seed: int = 0,
                          topkdsa_fill: Optional[float] = None) -> Dict[str, Any]:
    """A collectives JSON in the schema of ``oktopk-bench collectives --backend nccl`` (probes and
    results), generated from the model with a known α, β (``net``) and P ranks on one GPU, with
    optional multiplicative noise (uniform in ±noise). Marked ``"synthetic": true``."""
    import random
    from ..algorithms.schedule import allreduce
    rnd = random.Random(seed)
    n_of = n_of or {4: 1 << 26, 8: 1 << 25}

    def jitter(x):
        return x * (1.0 + rnd.uniform(-noise, noise)) if noise else x

    probes, results = [], []
    for P in world_sizes:
        n = n_of.get(P, 1 << 24)
        for b in (4, 4 * n):
            t = 1e3 * comm_time([allreduce(b, P)], P, net)
            probes.append({"P": P, "op": "allreduce", "bytes": b, "ms_mean": jitter(t),
                           "ms_min": t})
        for name in ALGORITHMS:
            r = step_time(name, n, density, P, net, kernels, ranks_per_gpu=P,
                          topkdsa_fill=topkdsa_fill)
            results.append({"name": name, "P": P, "n": n, "k": r["k"],
                            "step_ms_mean": jitter(r["step_ms"]), "step_ms_min": r["step_ms"],
                            "mb_sent_per_rank": r["bytes_per_rank"] / 1e6})
    return {"benchmark": "collectives", "synthetic": True,
            "synthetic_from": {"bandwidth_Bps": net.bandwidth, "latency_s": net.latency,
                               "noise": noise, "kernels": kernels.source},
            "note": "SYNTHETIC: generated by oktopk_triton.bench.project.synthetic_collectives "
                    "from a known network, not measured",
            "config": {"backend": "nccl", "density": density, "check_finite": "skip",
                       "ranks_per_gpu": None},
            "machine": {"gpus": ["synthetic GPU"]},
            "probes": probes, "results": results}
