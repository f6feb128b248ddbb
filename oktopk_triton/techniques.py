"""Training techniques on top of the sparse reducers (see ``docs/techniques.md``).

The frozen-variance Adam of 1-bit Adam (:class:`FrozenAdam`, ``SparseAllreduce.reduce_adam``),
and Deep Gradient Compression's sparsity warm-up (:class:`DensitySchedule`, the
``density_schedule`` option of ``SparseAllreduce``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple, Union

import torch

if TYPE_CHECKING:
    from .algorithms.base import Algorithm
    from .module import SparseAllreduce

# density_schedule=: (step, density) pairs, or a DGC ramp {"ramp_steps": R, "start", "factor"}
ScheduleSpec = Union[Sequence[Tuple[int, float]], Dict[str, Union[int, float]], None]

__all__ = ["FrozenAdam", "DensitySchedule"]


class FrozenAdam:
    """AdamW with a dense warm-up, then the variance frozen and the preconditioned gradient
    reduced sparsely with error feedback (1-bit Adam, Tang et al. 2021).

    Needs a reducer built with ``momentum=beta1`` and ``warmup_steps=W`` (``SparseAllreduce``
    does this for ``adam="frozen"``). Steps 1..W: the reducer sends every rank's velocity
    ``u = beta1*u + g`` densely; the average gradient is ``out_t - beta1*out_{t-1}`` (identical on
    every rank), which feeds ``v``; the weights take AdamW's step with ``m = (1-beta1)*out``.
    After W: ``v`` is frozen, every rank feeds ``g / (sqrt(v_hat) + eps)`` (linear in g, so what
    error feedback delivers late is delivered exactly), and the weights move by
    ``-lr * (1-beta1)/(1-beta1^t) * out`` plus AdamW's decoupled weight decay.
    """

    def __init__(self, numel: int, device: torch.device, warmup_steps: int) -> None:
        if warmup_steps < 1:
            raise ValueError(f"adam='frozen' needs warmup_steps >= 1 (dense steps that fill the "
                             f"variance), got {warmup_steps}")
        self.warmup_steps = warmup_steps
        self.v = torch.zeros(numel, dtype=torch.float32, device=device)
        self.prev_out = torch.zeros(numel, dtype=torch.float32, device=device)
        self.denom: Optional[torch.Tensor] = None
        self.t = 0

    @classmethod
    def build(cls, adam: Optional[str], alg: Algorithm,
              params: Optional[List[torch.Tensor]]) -> Optional["FrozenAdam"]:
        """``adam=None`` → None; ``adam="frozen"`` → a FrozenAdam over ``alg``'s vector."""
        if adam is None:
            return None
        if adam != "frozen":
            raise ValueError(f"adam must be None or 'frozen', got {adam!r}")
        if params is None:
            raise ValueError("adam='frozen' needs a SparseAllreduce built from parameters")
        if alg.momentum <= 0.0:
            raise ValueError("adam='frozen' needs momentum=beta1 (Adam's first moment is the "
                             "reducer's momentum correction)")
        return cls(alg.numel, alg.device, alg.warmup_steps)

    @staticmethod
    def hyper(optimizer: torch.optim.Optimizer) -> Dict[str, Any]:
        g = optimizer.param_groups[0]
        if len(optimizer.param_groups) != 1:
            raise ValueError("reduce_adam: expected an optimizer with one param group")
        return dict(lr=float(g["lr"]), betas=tuple(g.get("betas", (0.9, 0.999))),
                    eps=float(g.get("eps", 1e-8)), wd=float(g.get("weight_decay", 0.0)))

    def _denominator(self, t: int, b2: float, eps: float) -> torch.Tensor:
        return (self.v / (1 - b2 ** t)).sqrt_().add_(eps)

    @torch.no_grad()
    def step(self, sar: SparseAllreduce, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        h = self.hyper(optimizer)
        b1, b2 = h["betas"]
        alg = sar.algorithm
        if abs(alg.momentum - b1) > 1e-12:
            raise ValueError(f"reduce_adam: the reducer's momentum {alg.momentum} must equal "
                             f"Adam's beta1 {b1}")
        slices = sar.param_slices()
        warm = self.t < self.warmup_steps
        if not warm:
            if self.denom is None or self.t == self.warmup_steps:
                self.denom = self._denominator(self.warmup_steps, b2, h["eps"])
                if self.t == self.warmup_steps and alg.velocity is not None:
                    alg.velocity.div_(self.denom)      # the velocity moves into the new space
            for p, off, n in slices:
                if p.grad is not None:
                    p.grad.div_(self.denom[off:off + n].view(p.shape).to(p.grad.dtype))
        out = sar.reduce_gradients().float()
        self.t += 1
        if warm:
            gbar = out - b1 * self.prev_out
            self.prev_out.copy_(out)
            self.v.mul_(b2).addcmul_(gbar, gbar, value=1 - b2)
            upd = out / self._denominator(self.t, b2, h["eps"])
        else:
            upd = out
        upd = upd * ((1 - b1) / (1 - b1 ** self.t))
        upd = torch.where(torch.isfinite(upd), upd, torch.zeros((), device=upd.device))
        for p, off, n in slices:
            if h["wd"]:
                p.mul_(1 - h["lr"] * h["wd"])
            p.add_(upd[off:off + n].view(p.shape).to(p.dtype), alpha=-h["lr"])
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"t": self.t, "v": self.v.clone(), "prev_out": self.prev_out.clone(),
                "warmup_steps": self.warmup_steps}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.t = int(sd["t"])
        self.v.copy_(sd["v"])
        self.prev_out.copy_(sd["prev_out"])
        self.denom = None


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
