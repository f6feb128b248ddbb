"""Deep Gradient Compression's sparsity warm-up: the ``density_schedule`` option of
``SparseAllreduce`` (see ``docs/research/techniques.md``).

Why: a sparse reducer that starts at its target density from random weights stalls where the
gradient is spread widely; DGC starts dense-ish and ramps the density down. This module holds
the schedule (:class:`DensitySchedule`); ``SparseAllreduce`` builds one reducer per stage, each
taking over the last one's state.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple, Union
from .host import Host

__all__ = ["DensitySchedule", "ScheduleSpec"]

# density_schedule=: (step, density) pairs, or a DGC ramp {"ramp_steps": R, "start", "factor"}
ScheduleSpec = Union[Sequence[Tuple[int, float]], Dict[str, Union[int, float]], None]


class DensitySchedule:
    """The density a reducer runs at, by step: stages ``[(first_step, density), ...]`` from step
    0, each density held until the next stage's first step, the last one (the target) after.

    Deep Gradient Compression ramps the density down exponentially over the first epochs (75%,
    93.75%, 98.4%, 99.6%, 99.9% sparsity): ``{"ramp_steps": R, "start": 0.25, "factor": 4}``
    builds that ramp, ``start, start/factor, start/factor², ...`` while above the target, the
    stages evenly spread over the first R steps, then the target.
    """

    def __init__(self, stages: Sequence[Tuple[int, float]]) -> None:
        stages = [(int(a), float(d)) for a, d in stages]
        if not stages or stages[0][0] != 0:
            raise ValueError(f"density_schedule: stages must start at step 0, got {stages!r}")
        for (a, _), (b, _) in zip(stages, stages[1:]):
            if b <= a:
                raise ValueError(f"density_schedule: stage steps must increase, got {stages!r}")
        if any(not 0.0 < d <= 1.0 for _, d in stages):
            raise ValueError(f"density_schedule: densities must be in (0, 1], got {stages!r}")
        self.stages = stages

    @classmethod
    def build(cls, spec: ScheduleSpec, target: float) -> Optional["DensitySchedule"]:
        """``None`` → None; a list of ``(step, density)`` pairs ending at ``target``; or a DGC
        ramp ``{"ramp_steps": R, "start": 0.25, "factor": 4.0}`` down to ``target``."""
        if spec is None:
            return None
        if isinstance(spec, dict):
            unknown = sorted(set(spec) - {"ramp_steps", "start", "factor"})
            R, start = spec.get("ramp_steps"), float(spec.get("start", 0.25))
            factor = float(spec.get("factor", 4.0))
            if unknown or isinstance(R, bool) or not isinstance(R, int) or R < 1 or \
                    not 0.0 < start <= 1.0 or not factor > 1.0:
                raise ValueError(f"density_schedule: expected {{'ramp_steps': int >= 1, "
                                 f"'start': (0, 1], 'factor': > 1}}, got {spec!r}")
            densities = []
            d = start
            while d > target * (1 + 1e-9):
                densities.append(d)
                d /= factor
            S = len(densities)
            stages = [(R * i // max(S, 1), x) for i, x in enumerate(densities)]
            stages = [(a, x) for j, (a, x) in enumerate(stages) if j == 0 or a > stages[j - 1][0]]
            spec = stages + [(R, target)] if stages else [(0, target)]
        elif not isinstance(spec, (list, tuple)) or not all(
                isinstance(x, (list, tuple)) and len(x) == 2 for x in spec):
            raise ValueError(f"density_schedule: expected a list of (step, density) pairs or a "
                             f"dict with ramp_steps, got {spec!r}")
        out = cls(spec)
        if abs(out.stages[-1][1] - float(target)) > 1e-12:
            raise ValueError(f"density_schedule: the last stage's density "
                             f"{out.stages[-1][1]:g} must be the reducer's density {target:g}")
        return out

    def density_at(self, step: int) -> float:
        d = self.stages[0][1]
        for first, x in self.stages:
            if step >= first:
                d = x
        return d

    def advance(self, sar: Host) -> None:
        """At a stage's first step, a reducer at the stage's density takes over ``sar``'s
        current one: its residual, velocity and step count (its capacities are the new
        density's; Ok-Topk keeps its regions, and its first step calibrates on them)."""
        d = self.density_at(sar.algorithm.step_count)
        if d != sar.algorithm.density:
            self.switch(sar, d)

    @staticmethod
    def switch(sar: Host, density: float) -> None:
        """Replace ``sar``'s reducer by one at ``density`` that takes the current one over."""
        new = sar.parts.factory(density, sar.comm)
        new.take_over(sar.algorithm)
        sar.algorithm = new
