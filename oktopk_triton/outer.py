"""The outer optimizer of local steps (DiLoCo) when the pseudo-gradient goes through a sparse
algorithm with error feedback.

A sparse algorithm keeps what a sync did not send (the residual) and sends it later: the
residual is already a memory of past pseudo-gradients, as momentum is. A strong outer momentum
on top counts that late mass a second time: DiLoCo's default, SGD with Nesterov momentum 0.9,
oscillated and diverged over error feedback, while plain averaging and a momentum of 0.5 both
converged (docs/fault-tolerance.md, "The outer optimizer", has the measurements).

So the library serves an SGD outer optimizer (plain, momentum or Nesterov) and caps its momentum
at :data:`MOMENTUM_CAP` when the algorithm is sparse, saying so in one log line; an outer
optimizer of another kind is refused with a sparse algorithm (it was not measured). With
``algorithm="dense"`` every outer optimizer runs as given.

    from oktopk_triton.outer import serve_outer_optimizer
    serve_outer_optimizer(outer_opt, sparse=True, owner="SparseDiLoCo")   # may cap momentum
"""
from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["MOMENTUM_CAP", "capped_momentum", "serve_outer_optimizer"]

log = logging.getLogger("oktopk_triton.outer")

# the largest outer momentum served over error feedback (measured: docs/fault-tolerance.md)
MOMENTUM_CAP = 0.5

_WHY = ("error feedback already carries the unsent pseudo-gradient, and a stronger outer "
        "momentum on top of it oscillated (docs/fault-tolerance.md, 'The outer optimizer')")


def capped_momentum(momentum: float, sparse: bool, owner: str) -> float:
    """``momentum`` as served: capped at :data:`MOMENTUM_CAP` for a sparse algorithm (one log
    line when it is), as given otherwise."""
    momentum = float(momentum)
    if not sparse or momentum <= MOMENTUM_CAP:
        return momentum
    log.warning("%s: outer momentum %g served as %g with a sparse algorithm: %s", owner,
                momentum, MOMENTUM_CAP, _WHY)
    return MOMENTUM_CAP


def serve_outer_optimizer(optimizer: Any, sparse: bool, owner: str) -> None:
    """Check the outer optimizer a DiLoCo front was given and adapt it in place: with a sparse
    algorithm an SGD's momentum is capped at :data:`MOMENTUM_CAP` in every parameter group
    (Nesterov kept; one log line), and an optimizer of another kind is refused in one line.
    With a dense algorithm nothing changes."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"{owner}: the outer optimizer must be a torch.optim.Optimizer, got "
                        f"{type(optimizer).__name__}")
    if not sparse:
        return
    if type(optimizer) is not torch.optim.SGD:
        raise ValueError(f"{owner}: with a sparse algorithm the outer optimizer must be "
                         f"torch.optim.SGD (plain, momentum or Nesterov), got "
                         f"{type(optimizer).__name__}: only SGD was measured over error "
                         f"feedback; use algorithm='dense' for another outer optimizer")
    given = sorted({float(g.get("momentum", 0.0)) for g in optimizer.param_groups})
    if given[-1] <= MOMENTUM_CAP:
        return
    for group in optimizer.param_groups:
        group["momentum"] = min(float(group.get("momentum", 0.0)), MOMENTUM_CAP)
    nesterov = any(g.get("nesterov", False) for g in optimizer.param_groups)
    log.warning("%s: the outer SGD's momentum %s served as %g%s with a sparse algorithm: %s",
                owner, "/".join(f"{m:g}" for m in given), MOMENTUM_CAP,
                " (Nesterov kept)" if nesterov else "", _WHY)
