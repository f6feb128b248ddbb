"""Training techniques on top of the sparse reducers (see ``docs/techniques.md``).

Two Adam modes for ``SparseAllreduce.reduce_adam``: the frozen-variance Adam of 1-bit Adam
(:class:`FrozenAdam`, ``adam="frozen"``) and a variance tracked every step from factored
statistics averaged over ranks (:class:`TrackedAdam`, ``adam="tracked"``); and Deep Gradient
Compression's sparsity warm-up (:class:`DensitySchedule`, the ``density_schedule`` option of
``SparseAllreduce``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

__all__ = ["FrozenAdam", "TrackedAdam", "DensitySchedule", "build_adam"]


def build_adam(adam: Any, sar: Any) -> Optional[Any]:
    """``adam=None`` → None; ``"frozen"`` → :class:`FrozenAdam`; ``"tracked"`` →
    :class:`TrackedAdam` (both over ``sar``'s parameters, with its momentum as beta1)."""
    if adam is None:
        return None
    if adam not in ("frozen", "tracked"):
        raise ValueError(f"adam must be None, 'frozen' or 'tracked', got {adam!r}")
    if sar._params is None:
        raise ValueError(f"adam={adam!r} needs a SparseAllreduce built from parameters")
    if sar.algorithm.momentum <= 0.0:
        raise ValueError(f"adam={adam!r} needs momentum=beta1 (Adam's first moment is the "
                         f"reducer's momentum correction)")
    if adam == "frozen":
        return FrozenAdam(sar.numel, sar.device, sar.algorithm.warmup_steps)
    return TrackedAdam(sar._params, sar._offsets, sar.device)


def _adam_hyper(optimizer: torch.optim.Optimizer, alg: Any) -> Dict[str, Any]:
    """lr, betas, eps and weight decay of the optimizer's one param group; beta1 must be the
    reducer's momentum."""
    if len(optimizer.param_groups) != 1:
        raise ValueError("reduce_adam: expected an optimizer with one param group")
    g = optimizer.param_groups[0]
    h = dict(lr=float(g["lr"]), betas=tuple(g.get("betas", (0.9, 0.999))),
             eps=float(g.get("eps", 1e-8)), wd=float(g.get("weight_decay", 0.0)))
    if abs(alg.momentum - h["betas"][0]) > 1e-12:
        raise ValueError(f"reduce_adam: the reducer's momentum {alg.momentum} must equal "
                         f"Adam's beta1 {h['betas'][0]}")
    return h


def _apply_adam_step(sar: Any, upd: torch.Tensor, h: Dict[str, Any], t: int) -> None:
    """Weights ``-= lr·(1-β1)/(1-β1^t)·upd`` (Adam's bias-corrected first moment, the velocity
    being the undamped ``u = β1·u + x``), after AdamW's decoupled weight decay; a non-finite
    entry moves nothing."""
    b1 = h["betas"][0]
    upd = upd * ((1 - b1) / (1 - b1 ** t))
    upd = torch.where(torch.isfinite(upd), upd, torch.zeros((), device=upd.device))
    for p, off in zip(sar._params, sar._offsets):
        if h["wd"]:
            p.mul_(1 - h["lr"] * h["wd"])
        p.add_(upd[off:off + p.numel()].view(p.shape).to(p.dtype), alpha=-h["lr"])


def _precondition(sar: Any, denom: torch.Tensor) -> None:
    """Every ``.grad`` divided in place by its slice of the flat ``denom``."""
    for p, off in zip(sar._params, sar._offsets):
        if p.grad is not None:
            p.grad.div_(denom[off:off + p.numel()].view(p.shape).to(p.grad.dtype))


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

    def _denominator(self, t: int, b2: float, eps: float) -> torch.Tensor:
        return (self.v / (1 - b2 ** t)).sqrt_().add_(eps)

    @torch.no_grad()
    def step(self, sar: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        alg = sar.algorithm
        h = _adam_hyper(optimizer, alg)
        b1, b2 = h["betas"]
        warm = self.t < self.warmup_steps
        if not warm:
            if self.denom is None or self.t == self.warmup_steps:
                self.denom = self._denominator(self.warmup_steps, b2, h["eps"])
                if self.t == self.warmup_steps and alg.velocity is not None:
                    alg.velocity.div_(self.denom)      # the velocity moves into the new space
            _precondition(sar, self.denom)
        out = sar.reduce_gradients().float()
        self.t += 1
        if warm:
            gbar = out - b1 * self.prev_out
            self.prev_out.copy_(out)
            self.v.mul_(b2).addcmul_(gbar, gbar, value=1 - b2)
            upd = out / self._denominator(self.t, b2, h["eps"])
        else:
            upd = out
        _apply_adam_step(sar, upd, h, self.t)
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"t": self.t, "v": self.v.clone(), "prev_out": self.prev_out.clone(),
                "warmup_steps": self.warmup_steps}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        self.t = int(sd["t"])
        self.v.copy_(sd["v"])
        self.prev_out.copy_(sd["prev_out"])
        self.denom = None


class TrackedAdam:
    """AdamW whose variance is tracked on every step from factored statistics averaged over the
    ranks, with the preconditioned gradient reduced sparsely with error feedback.

    Frozen-variance Adam (:class:`FrozenAdam`) needs a dense warm-up to fill ``v``, which costs
    far more bytes than the sparse steps. Here ``v`` never needs the dense gradient: each rank
    sends, per weight matrix ``[R, C]`` (the trailing dimensions flattened), the row and column
    means of its own ``g²`` (Adafactor's factored second moment, Shazeer & Stern 2018), and per
    vector its whole ``g²``; one dense allreduce of those ``Σ(R+C)`` words averages them (on the
    byte-level GPT 19,456 words for 1.04M weights, 117 kB a step at P=4, counted in
    ``stats["bytes_sent"]``). ``v̂ = row ⊗ col / mean(row)``, bias-corrected, EMA ``beta2``.

    Every rank feeds ``g / (sqrt(v̂)+eps)`` to the reducer, whose momentum correction plays
    ``beta1``; the weights move by ``-lr·(1-beta1)/(1-beta1^t)·out`` plus decoupled weight decay.
    What a rank still owes (residual, velocity) is kept in the units of the current
    preconditioner: when ``v̂`` moves, both are multiplied by ``old/new`` denominators, so the
    gradient owed is delivered whole, preconditioned as of its delivery. Identical ``v̂`` on
    every rank (the same averaged statistics), so ``out`` stays bitwise identical and
    conservation holds within each step. A step whose statistics are not finite leaves ``v̂``
    as it was (decided on the device).
    """

    def __init__(self, params: Sequence[torch.Tensor], offsets: Sequence[int],
                 device: torch.device) -> None:
        self.layout: List[Tuple[int, int, int, int]] = []    # (offset, rows, cols, stat offset)
        words = 0
        for p, off in zip(params, offsets):
            rows, cols = (p.shape[0], p.numel() // p.shape[0]) if p.dim() >= 2 else (p.numel(), 0)
            self.layout.append((off, rows, cols, words))
            words += rows + cols
        self.numel = sum(p.numel() for p in params)
        self.stats = torch.zeros(words, dtype=torch.float32, device=device)   # EMA of the mean
        self.denom: Optional[torch.Tensor] = None
        self.t = 0
        self.hyper: Optional[Tuple[float, float]] = None    # (beta2, eps) of the last step

    def _local(self, sar: Any) -> torch.Tensor:
        """This rank's factored ``g²``: row and column means per matrix, ``g²`` per vector."""
        out = torch.zeros_like(self.stats)
        for p, (_, rows, cols, s) in zip(sar._params, self.layout):
            if p.grad is None:
                continue
            g2 = p.grad.detach().float().square()
            if cols:
                g2 = g2.reshape(rows, cols)
                out[s:s + rows] = g2.mean(1)
                out[s + rows:s + rows + cols] = g2.mean(0)
            else:
                out[s:s + rows] = g2.reshape(-1)
        return out

    def _denominator(self, b2: float, eps: float) -> torch.Tensor:
        return self._denominator_at(self.t, self.stats, b2, eps)

    def _denominator_at(self, t: int, stats: torch.Tensor, b2: float, eps: float) -> torch.Tensor:
        st = stats / (1 - b2 ** t)
        v = torch.empty(self.numel, dtype=torch.float32, device=st.device)
        for off, rows, cols, s in self.layout:
            if cols:
                r, c = st[s:s + rows], st[s + rows:s + rows + cols]
                mean = r.mean().clamp_min(1e-30)
                v[off:off + rows * cols] = torch.outer(r, c).div_(mean).view(-1)
            else:
                v[off:off + rows] = st[s:s + rows]
        return v.sqrt_().add_(eps)

    @torch.no_grad()
    def step(self, sar: Any, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        alg = sar.algorithm
        h = _adam_hyper(optimizer, alg)
        b2 = h["betas"][1]
        local = self._local(sar)
        before = alg.comm.bytes_sent
        if alg.P > 1:
            alg.comm.allreduce(local)
        stat_bytes = alg.comm.bytes_sent - before
        local.div_(alg.P)
        old_stats = self.stats.clone() if self.denom is None else None
        new = self.stats * b2 + local * (1 - b2)
        self.stats.copy_(torch.where(torch.isfinite(local).all(), new, self.stats))
        self.t += 1
        denom = self._denominator(b2, h["eps"])
        if self.denom is None and self.hyper is not None:     # resumed: the saved units
            self.denom = self._denominator_at(self.t - 1, old_stats, *self.hyper)
        self.hyper = (b2, h["eps"])
        import os
        if self.denom is not None and not os.environ.get("OKTOPK_NO_RESCALE"):
            ratio = self.denom / denom
            alg.residual.mul_(ratio)
            if alg.velocity is not None:
                alg.velocity.mul_(ratio)
        self.denom = denom
        _precondition(sar, denom)
        out = sar.reduce_gradients().float()
        sar.stats["bytes_sent"] = sar.stats.get("bytes_sent", 0) + stat_bytes
        sar.stats["adam_stat_bytes"] = stat_bytes
        _apply_adam_step(sar, out, h, self.t)
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {"t": self.t, "stats": self.stats.clone(), "hyper": self.hyper}

    def load_state_dict(self, sd: Dict[str, Any]) -> None:
        if "stats" not in sd or sd["stats"].shape != self.stats.shape:
            raise ValueError("adam='tracked': the saved state is not a tracked-variance state "
                             "of these parameters")
        self.t = int(sd["t"])
        self.stats.copy_(sd["stats"])
        self.hyper = None if sd.get("hyper") is None else tuple(float(x) for x in sd["hyper"])
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
    def build(cls, spec: Any, target: float) -> Optional["DensitySchedule"]:
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
