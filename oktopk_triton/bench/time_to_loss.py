"""Time to dense's loss: a projected step time times a *steps ratio* (how many times dense's
steps an algorithm needs to reach the loss it ends at).

A sparse step is cheaper than a dense one, but it makes less progress: on the 1M-parameter
language model, 1% Ok-Topk needed about twice dense's steps to reach its final loss. Whether a
user's job finishes sooner is the product of the two, per network and P; this module computes the
ratio from a training run's validation curves and the product from ``oktopk-bench project``'s
step times.
"""
from __future__ import annotations

import json
import math
from typing import Any, Dict, Iterable, List, Optional


def steps_ratio(dense_steps: List[float], dense_loss: List[float], run_steps: float,
                final_loss: float) -> Dict[str, Any]:
    """How many times dense's steps this run needed to reach its final loss.

    ``run_steps`` divided by the step at which dense's (mean) validation curve first reaches
    ``final_loss``, linearly interpolated between evaluations. 1.0 = no slower than dense. When
    dense never gets that low the ratio is clamped to run_steps / dense's last step (a lower bound
    on how much faster dense is: reported as ``clamped: "never"``); when dense's first evaluation
    is already at or below it, the crossing is clamped to that first step (``clamped: "first"``).
    """
    if len(dense_steps) != len(dense_loss) or not dense_steps:
        raise ValueError(f"steps_ratio: expected equal, non-empty step and loss lists, got "
                         f"{len(dense_steps)} and {len(dense_loss)}")
    if dense_loss[0] <= final_loss:
        return {"ratio": run_steps / dense_steps[0], "dense_step": dense_steps[0],
                "clamped": "first"}
    for i in range(1, len(dense_steps)):
        lo, hi = dense_loss[i - 1], dense_loss[i]
        if hi <= final_loss:   # first crossing: interpolate between evaluations i-1 and i
            t = (lo - final_loss) / (lo - hi)
            step = dense_steps[i - 1] + t * (dense_steps[i] - dense_steps[i - 1])
            return {"ratio": run_steps / step, "dense_step": step, "clamped": None}
    return {"ratio": run_steps / dense_steps[-1], "dense_step": dense_steps[-1],
            "clamped": "never"}


def mean_curve(runs: Iterable[dict]) -> Optional[tuple]:
    """(steps, mean validation loss) over runs evaluated at the same steps, or None."""
    curves = [r["val_curve"] for r in runs]
    if not curves:
        return None
    steps = [s for s, _ in curves[0]]
    if any([s for s, _ in c] != steps for c in curves):
        raise ValueError("the runs were evaluated at different steps; cannot average them")
    return steps, [sum(c[i][1] for c in curves) / len(curves) for i in range(len(steps))]


def ratios_from_train(report: Dict[str, Any],
                      density: Optional[float] = None) -> Dict[str, Dict[str, Any]]:
    """Per algorithm of a ``oktopk-bench train --model gpt`` report (its ``runs``): the steps
    ratio of its mean final validation loss against dense's mean curve, and its mean bytes per
    step. Needs dense among the runs. ``density``: only the runs at that density (and dense);
    without it, a report that holds an algorithm at two densities is refused."""
    runs = [r for r in report.get("runs", []) if "val_curve" in r]
    if density is not None:
        runs = [r for r in runs if r["algorithm"] == "dense"
                or math.isclose(float(r.get("density", -1)), density)]
    else:
        for alg in {r["algorithm"] for r in runs} - {"dense"}:
            ds = sorted({r.get("density") for r in runs if r["algorithm"] == alg})
            if len(ds) > 1:
                raise ValueError(f"{alg} ran at densities {ds}: expected one density, or the "
                                 f"projection's --density to choose")
    dense = mean_curve(r for r in runs if r["algorithm"] == "dense")
    if dense is None:
        raise ValueError("the train report has no dense run with a validation curve: its "
                         "steps ratios need dense's curve")
    out: Dict[str, Dict[str, Any]] = {}
    for alg in dict.fromkeys(r["algorithm"] for r in runs):
        rs = [r for r in runs if r["algorithm"] == alg]
        final = sum(r["final_val_loss"] for r in rs) / len(rs)
        res = steps_ratio(dense[0], dense[1], rs[0]["steps"], final)
        res.update(final_val_loss=final, seeds=[r["seed"] for r in rs],
                   bytes_per_step=sum(r["bytes_per_step"] for r in rs) / len(rs))
        out[alg] = res
    return out


def load_ratios(paths: List[str], pairs: List[str],
                density: Optional[float] = None) -> Dict[str, float]:
    """``--from-train`` reports (their runs at ``density``), then ``--steps-ratio NAME=R``
    pairs (later ones win)."""
    ratios: Dict[str, float] = {}
    for p in paths:
        try:
            with open(p) as f:
                report = json.load(f)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--from-train {p}: cannot read a train report ({e})")
        try:
            ratios.update({a: r["ratio"]
                           for a, r in ratios_from_train(report, density).items()})
        except ValueError as e:
            raise SystemExit(f"--from-train {p}: {e}")
    for pair in pairs:
        name, sep, val = pair.partition("=")
        try:
            r = float(val)
        except ValueError:
            r = -1.0
        if not sep or not name or not r > 0:
            raise SystemExit(f"--steps-ratio: expected NAME=RATIO with RATIO > 0 (e.g. "
                             f"oktopk=1.98), got {pair!r}")
        ratios[name.lower()] = r
    ratios.setdefault("dense", 1.0)
    return ratios


def time_to_loss(rows: List[Dict[str, Any]], ratios: Dict[str, float],
                 compute_ms: float = 0.0) -> List[Dict[str, Any]]:
    """Per (P, algorithm) with a ratio: ``(step_ms + compute_ms) × ratio``, the projected time to
    reach the loss the algorithm ends at, in units of dense steps' time, and whether it is first
    at its P."""
    out = [{"P": r["P"], "algorithm": r["algorithm"], "ratio": ratios[r["algorithm"]],
            "step_ms": r["step_ms"] + compute_ms,
            "time_ms": (r["step_ms"] + compute_ms) * ratios[r["algorithm"]]}
           for r in rows if r["algorithm"] in ratios]
    for P in {r["P"] for r in out}:
        here = [r for r in out if r["P"] == P]
        best = min(here, key=lambda r: r["time_ms"])
        for r in here:
            r["first"] = r is best
    return out


def format_time_to_loss(rows: List[Dict[str, Any]], title: str) -> str:
    algs = list(dict.fromkeys(r["algorithm"] for r in rows))
    Ps = sorted({r["P"] for r in rows})
    by = {(r["P"], r["algorithm"]): r for r in rows}
    table = [["P"] + [f"{a} (x{by[(Ps[0], a)]['ratio']:.2f})" for a in algs] + ["first"]]
    for P in Ps:
        cells = [str(P)]
        first = "-"
        for a in algs:
            r = by[(P, a)]
            cells.append(f"{r['time_ms']:.1f}" + ("*" if r["first"] else ""))
            first = a if r["first"] else first
        table.append(cells + [first])
    w = [max(len(r[i]) for r in table) for i in range(len(table[0]))]
    lines = [title] + ["  ".join(c.rjust(w[i]) for i, c in enumerate(r)) for r in table]
    lines.insert(2, "  ".join("-" * x for x in w))
    return "\n".join(lines)
