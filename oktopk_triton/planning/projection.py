"""One steady step of every algorithm priced (communication + selection, :func:`step_time`),
from P = 2 to 1024 GPUs (:func:`project`), and which algorithm is fastest where
(:func:`fastest_ranges`)."""
from __future__ import annotations

import dataclasses
import math
from typing import Any, Dict, List, Optional, Sequence

from ..algorithms import REGISTRY, descriptions
from ..algorithms._wire import packed
from .communication import comm_time, spec_time
from .kernel_costs import KernelCosts, selection_time
from .network import Network

ALGORITHMS = tuple(REGISTRY)  # the built-in algorithms, dense first (project() prices every
#                               algorithm registered when it is called)

MODEL_PRESETS = {"resnet50": 25_600_000, "bert-large": 340_000_000, "gpt2-xl": 1_500_000_000}


def _k(n: int, density: float) -> int:
    return max(1, min(n, int(round(density * n))))


def topkdsa_fill_factor(P: int) -> float:
    """Largest reduced region / cap, fitted to the LocalCluster collectives run (see above)."""
    return 0.74 + 0.465 * math.log2(max(P, 1))


def topkdsa_state(n: int, k: int, P: int, fill_factor: Optional[float] = None,
                  slack: float = 1.25, gather_slack: float = 1.25,
                  fill: float = 1.0 / 3.0) -> Dict[str, Any]:
    """TopkDSA's gather mode and cap2 after a decision, as its ``_decide`` takes them, for a
    largest region of ``fill_factor·cap`` entries (the fit when None; all regions alike)."""
    L = -(-n // P)
    cap = max(1, min(L, math.ceil(slack * k / P)))
    f = topkdsa_fill_factor(P) if fill_factor is None else float(fill_factor)
    mx = min(L, max(1, int(round(f * cap))))
    cap2 = max(1, min(L, math.ceil(gather_slack * mx)))
    if P * mx > fill * n or 1 + 2 * cap2 >= L:
        return {"mode": "dense", "cap2": None}
    return {"mode": "sparse", "cap2": cap2}


def algorithm_schedule(name: str, n: int, k: int, P: int, check_finite: str = "skip",
                       dtype: str = "fp32", topkdsa_fill: Optional[float] = None,
                       topkdsa_bytes: Optional[float] = None, wire_format: str = "fp32"):
    """The schedule the projection prices. TopkDSA: its gather from the fill model, or (when
    ``topkdsa_bytes``, a measured total per step, is given) the cap2 that reproduces it (both
    in fp32 words). ``wire_format``: the sparse algorithms' (dense ignores it)."""
    from ..algorithms.schedule import schedule_of
    opts: Dict[str, Any] = {"check_finite": check_finite}
    if name == "dense":
        opts["dtype"] = dtype
    elif packed(wire_format):
        opts["wire_format"] = wire_format
    if name == "topkdsa" and P > 1 and k < n:
        if topkdsa_bytes is not None:
            bound = schedule_of(name, n, k, P, **opts)
            static = sum(s.bytes_per_rank for s in bound[:-1])
            chunk = (topkdsa_bytes - static) / (P - 1) / 4.0        # words of the gathered slot
            L = -(-n // P)
            if chunk >= L:
                opts.update(mode="dense")
            else:
                opts.update(mode="sparse", cap2=max(1, min(L, int(round((chunk - 1) / 2)))))
        else:
            opts.update(topkdsa_state(n, k, P, topkdsa_fill))
    return schedule_of(name, n, k, P, **opts)


def step_time(name: str, n: int, density: float, P: int, net: Network, kernels: KernelCosts,
              ranks_per_gpu: int = 1, sync_every: int = 1, overlap: bool = False,
              **schedule_kw) -> Dict[str, Any]:
    """One step of ``name`` priced: communication + selection, in ms.

    ``sync_every=H`` (local steps; sparse algorithms only, dense is always priced per step):
    the algorithm's step at ``density`` (the density of one sync) happens every H steps, so
    its time and bytes per step are divided by H. ``overlap``: that sync could run behind the
    next H steps' compute (recorded on the row; :func:`time_to_loss` then charges
    ``max(compute, step)`` instead of ``compute + step``). The library's sync blocks: overlap
    prices what a pipelined outer step would give, not what ships."""
    H = 1 if name == "dense" else sync_every
    if H < 1:
        raise ValueError(f"sync_every: expected an integer >= 1, got {sync_every!r}")
    k = _k(n, density)
    specs = algorithm_schedule(name, n, k, P, **schedule_kw)
    comm = comm_time(specs, P, net) / H
    sel = selection_time(name, n, kernels, ranks_per_gpu, k, P) / H
    return {"algorithm": name, "P": P, "n": n, "k": k, "comm_ms": 1e3 * comm,
            "select_ms": 1e3 * sel, "step_ms": 1e3 * (comm + sel),
            "bytes_per_rank": sum(s.bytes_per_rank for s in specs) / H,
            "messages": sum(s.rounds for s in specs), "calls": len(specs),
            "sync_every": H, "overlap": bool(overlap and H > 1),
            "collectives": [dataclasses.asdict(s) | {"algorithm_priced": spec_time(s, P, net)[1]}
                            for s in specs]}


def project(n: int, density: float, world_sizes: Sequence[int], net: Network,
            kernels: KernelCosts, algorithms: Optional[Sequence[str]] = None,
            sync_every: int = 1, overlap: bool = False,
            **schedule_kw) -> List[Dict[str, Any]]:
    """Every algorithm (default: each registered one with a description) priced at each world
    size (:func:`step_time` rows)."""
    if algorithms is None:
        algorithms = tuple(descriptions())
    return [step_time(a, n, density, P, net, kernels, sync_every=sync_every, overlap=overlap,
                      **schedule_kw)
            for P in world_sizes for a in algorithms]


def fastest_ranges(rows: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Consecutive world sizes with the same fastest algorithm: [{P_from, P_to, algorithm,
    speedup_vs_dense: (min, max) or None}]."""
    out: List[Dict[str, Any]] = []
    for P in sorted({r["P"] for r in rows}):
        here = [r for r in rows if r["P"] == P]
        best = min(here, key=lambda r: r["step_ms"])
        dense = next((r for r in here if r["algorithm"] == "dense"), None)
        sp = dense["step_ms"] / best["step_ms"] if dense else None
        if out and out[-1]["algorithm"] == best["algorithm"]:
            out[-1]["P_to"] = P
            if sp is not None:
                lo, hi = out[-1]["speedup_vs_dense"]
                out[-1]["speedup_vs_dense"] = (min(lo, sp), max(hi, sp))
        else:
            out.append({"P_from": P, "P_to": P, "algorithm": best["algorithm"],
                        "speedup_vs_dense": (sp, sp) if sp is not None else None})
    return out


def describe_ranges(ranges: List[Dict[str, Any]]) -> str:
    parts = []
    for r in ranges:
        span = f"P={r['P_from']}" if r["P_from"] == r["P_to"] else f"P={r['P_from']}-{r['P_to']}"
        sp = r["speedup_vs_dense"]
        extra = ""
        if sp and r["algorithm"] != "dense":
            extra = (f" ({sp[0]:.1f}x dense)" if abs(sp[0] - sp[1]) < 0.05
                     else f" ({sp[0]:.1f}-{sp[1]:.1f}x dense)")
        parts.append(f"{span}: {r['algorithm']}{extra}")
    return "; ".join(parts)
