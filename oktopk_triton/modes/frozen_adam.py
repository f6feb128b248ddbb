"""The frozen-variance Adam of 1-bit Adam (Tang et al. 2021), ``SparseAllreduce.reduce_adam``
with ``adam="frozen"`` (see ``docs/research/techniques.md``).

Why a component: Adam's variance cannot be reduced sparsely (it is not linear in the gradient),
so a dense warm-up fills it, then it is frozen and the preconditioned gradient, which is linear,
goes through the sparse reducer with error feedback. This module holds that mode's state
(:class:`FrozenAdam`: the variance, the last warm-up output, the step count).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional

import torch
from .host import Host

if TYPE_CHECKING:
    from ..algorithms.base import Algorithm

__all__ = ["FrozenAdam"]


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
    def step(self, sar: Host, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """One ``reduce_adam`` call; uses ``sar.algorithm``, ``sar.param_slices()`` and
        ``sar.reduce_gradients()``."""
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
