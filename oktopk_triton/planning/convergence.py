"""Time to dense's loss: a *steps ratio*, how many times dense's steps an algorithm needs to
reach the loss it ends at, from validation curves (:func:`steps_ratio`,
:func:`ratios_from_train`), times a projected step (:func:`time_to_loss`)."""
from __future__ import annotations

import math
from typing import Any, Dict, Iterable, List, Optional


def steps_ratio(dense_steps: List[float], dense_loss: List[float], run_steps: float,
                final_loss: float) -> Dict[str, Any]:
    """How many times dense's steps this run needed to reach its final loss.

    ``run_steps`` divided by the step at which dense's (mean) validation curve first reaches
    ``final_loss``, linearly interpolated between evaluations. 1.0 = no slower than dense. When
    dense never gets that low the ratio is clamped to run_steps / dense's last step (a lower bound
    on how much faster dense is: reported as ``clamped: "never"``); when dense's first evaluation
    is already at or below it, the crossing is clamped to that first step (``clamped: "first"``;
    a first evaluation at step 0, before any training, gives ``inf``: a run that ended no better
    than an untrained model, a diverged one).
    """
    if len(dense_steps) != len(dense_loss) or not dense_steps:
        raise ValueError(f"steps_ratio: expected equal, non-empty step and loss lists, got "
                         f"{len(dense_steps)} and {len(dense_loss)}")
    if dense_loss[0] <= final_loss:
        ratio = run_steps / dense_steps[0] if dense_steps[0] > 0 else float("inf")
        return {"ratio": ratio, "dense_step": dense_steps[0], "clamped": "first"}
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


def time_to_loss(rows: List[Dict[str, Any]], ratios: Dict[str, float],
                 compute_ms: float = 0.0) -> List[Dict[str, Any]]:
    """Per (P, algorithm) with a ratio: ``(step_ms + compute_ms) × ratio``, the projected time to
    reach the loss the algorithm ends at, in units of dense steps' time, and whether it is first
    at its P. A row with ``overlap`` (local steps whose sync runs behind the next steps'
    compute) costs ``max(step_ms, compute_ms)`` a step instead of the sum."""
    def total(r):
        return (max(r["step_ms"], compute_ms) if r.get("overlap")
                else r["step_ms"] + compute_ms)
    out = [{"P": r["P"], "algorithm": r["algorithm"], "ratio": ratios[r["algorithm"]],
            "step_ms": total(r), "time_ms": total(r) * ratios[r["algorithm"]]}
           for r in rows if r["algorithm"] in ratios]
    for P in {r["P"] for r in out}:
        here = [r for r in out if r["P"] == P]
        best = min(here, key=lambda r: r["time_ms"])
        for r in here:
            r["first"] = r is best
    return out
