"""Local steps (DiLoCo, SparseLoCo): each rank takes ``sync_every`` optimizer steps on its own
gradients, then the ranks reduce their accumulated weight change (the pseudo-gradient) with the
sparse algorithm, error feedback included, and every replica restarts from the same weights.

Used through ``SparseAllreduce(params, ..., local_steps=LocalSteps(sync_every=H))``
and ``reduce_updates(optimizer)``; this module holds the state between syncs
(:class:`LocalStepper`). See ``docs/research/techniques.md``.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..algorithms import get_algorithm
from ..checks import check_local_steps
from ..config import LocalSteps as LocalStepsConfig
from .flat_params import finite_or_zero, nonfinite_mask, optimizer_step, zero_if_flagged_
from .moments import OPTIONS as MOMENT_OPTIONS
from .moments import MomentAverager
from ..outer import capped_momentum
from .realign import OPTIONS as REALIGN_OPTIONS
from .realign import MomentRealign
from .host import Host

__all__ = ["LocalStepper", "LocalSteps", "OPTIONS"]

# the SparseAllreduce keyword arguments this component owns (one home for the names), with
# moments.MomentAverager's (optimizer moments averaged every K syncs)
# (config.LocalSteps's fields, in order)
OPTIONS = ("sync_every", "outer_lr", "outer_momentum", "residual_decay") + MOMENT_OPTIONS \
    + REALIGN_OPTIONS

class LocalStepper:
    """What ``SparseAllreduce.reduce_updates`` keeps between syncs with local steps on.

    Every call steps the optimizer on this rank's own gradient (the weights move locally). Every
    ``sync_every``-th call is a sync:

    * ``delta_p = weights_p - anchor`` (this rank's pseudo-gradient, in the weights' dtypes);
    * ``residual *= residual_decay`` (SparseLoCo's decayed error feedback), then the algorithm
      reduces ``delta_p``: ``out`` is the average over ranks of what it selects of
      ``residual + delta``, the residual keeps the rest (error feedback in update space);
    * the outer step: ``step = outer_lr * out``, or with ``outer_momentum = m > 0`` Nesterov as
      DiLoCo writes it, ``v = m*v + out; step = outer_lr * (out + m*v)``;
    * every replica's weights become ``anchor + step`` (bitwise identical on every rank), and the
      anchor becomes those weights.

    Invariant, per sync, summed over the ranks (``decayed`` is what the decay removed: dropped on
    purpose, never delivered)::

        sum_p delta_p == P * out + sum_p (residual_p' - residual_p) + sum_p decayed_p

    The outer step transforms ``out`` after it is delivered; it does not enter the invariant.

    A sync whose ``out`` is not finite (a NaN or Inf pseudo-gradient on any rank, with the
    default ``check_finite="skip"``) is a no-op for the state: every replica's weights return to
    the anchor (the interval's local progress is dropped on every rank, which also recovers a
    rank whose weights went NaN), and the residual (decay included), the outer velocity and the
    anchor stay as they were. The interval starts again. The optimizer's own state is the
    user's: a rank whose optimizer took a NaN keeps it (rebuild that optimizer). With
    ``check_finite="raise"`` the sync raises on every rank with the residual as it was, and the
    next call syncs again.

    Its settings, with advice on each: :class:`oktopk_triton.config.LocalSteps` (measured
    numbers: docs/research/design-notes.md, ``LocalSteps``).

    Costs: the anchor (one copy of the weights, their dtypes), and with ``outer_momentum`` an
    fp32 velocity of ``numel``. A local call: the optimizer step and a few Python lines, no
    pass over ``numel`` and no allocation (it returns one persistent zero vector;
    ``tests/test_local_steps.py`` counts its dispatches). A sync: the change written straight
    into the flat gradient (a copy and a subtraction), the algorithm's step, one pass that
    zeroes a flagged non-finite step (the algorithm's flag, no isfinite pass), an addition into
    the anchor and its copy into the weights (and one residual copy with a decay). No host read.

    Counting: the algorithm's steps (``step_count``, ``warmup_steps``, a ``density_schedule``'s
    stages) count syncs, not calls. The interval position counts calls on every rank alike, a
    call whose step a ``GradScaler`` skipped included, so the ranks sync together.
    """

    def __init__(self, sync_every: int = 1, outer_lr: float = 1.0, outer_momentum: float = 0.0,
                 residual_decay: float = 1.0) -> None:
        check_local_steps(sync_every=sync_every, outer_lr=outer_lr,
                          outer_momentum=outer_momentum, residual_decay=residual_decay)
        self.sync_every = sync_every
        self.outer_lr = float(outer_lr)
        self.outer_momentum = float(outer_momentum)
        self.residual_decay = float(residual_decay)
        self.position = 0                                 # calls since the last sync
        self.anchor: Optional[List[torch.Tensor]] = None  # the weights at the last sync
        self.velocity: Optional[torch.Tensor] = None      # the outer Nesterov momentum (fp32)
        self.moments: Optional[MomentAverager] = None     # moments.MomentAverager (build sets it)
        self.realign: Optional[MomentRealign] = None      # realign.MomentRealign (build sets it)
        self.stats: Dict[str, Any] = {}

    @classmethod
    def from_config(cls, config: Optional[LocalStepsConfig],
                    algorithm: Any = None) -> Optional["LocalStepper"]:
        """The component for a :class:`~oktopk_triton.config.LocalSteps`, or ``None`` for
        ``None`` and the defaults (plain ``reduce_updates``). ``moment_sync_every`` > 0 or
        ``moment_realign`` > 0 turn local steps on even at ``sync_every=1``. ``algorithm`` (its
        settings object): with a sparse one, whose error feedback carries what is unsent, an
        outer momentum above :data:`~oktopk_triton.outer.MOMENTUM_CAP` is served capped (one
        log line)."""
        if config is not None and not isinstance(config, LocalStepsConfig):
            raise TypeError(f"local_steps must be a LocalSteps or None, got "
                            f"{type(config).__name__}")
        if config is None or not config.enabled:
            return None
        sparse = algorithm is not None and get_algorithm(algorithm.algorithm).sparse
        momentum = capped_momentum(config.outer_momentum, sparse, "LocalSteps")
        ls = cls(config.sync_every, config.outer_lr, momentum, config.residual_decay)
        ls.moments = MomentAverager.build(config.moment_sync_every, config.moment_sync,
                                          config.moment_dtype)
        ls.realign = MomentRealign.build(config.moment_realign)
        return ls

    @classmethod
    def build(cls, **options: Any) -> Optional["LocalStepper"]:
        """:meth:`from_config` from the settings by name (checked)."""
        return cls.from_config(LocalStepsConfig(**options))

    def describe(self) -> Dict[str, Any]:
        ms = {} if self.moments is None else self.moments.describe()
        if self.realign is not None:
            ms.update(self.realign.describe())
        return dict(sync_every=self.sync_every, outer_lr=self.outer_lr,
                    outer_momentum=self.outer_momentum, residual_decay=self.residual_decay, **ms)

    # -- one call of reduce_updates --------------------------------------------------------------
    @torch.no_grad()
    def step(self, sar: Host, optimizer: torch.optim.Optimizer, scaler: Any) -> torch.Tensor:
        """One ``reduce_updates`` call: the local step, and every H-th call the sync. Returns
        the reduced pseudo-gradient on a sync; on a local call zeros (nothing was reduced;
        ``.grad`` then keeps this rank's gradient), as one persistent read-only zero vector
        (:meth:`FlatParams.zeros`): a local call costs the optimizer step and no pass, no
        allocation. Uses ``sar.flat_params``, ``sar.algorithm``, ``sar.comm`` and
        ``sar.gradient_step()`` (the gradient mode's reduction)."""
        fp = sar.flat_params                   # flat_params.FlatParams: the weights' layout
        params = fp.params
        if self.anchor is None:
            self.anchor = [p.detach().clone() for p in params]
        optimizer_step(optimizer, scaler)
        if self.realign is not None:
            self.realign.after_step(optimizer)
        self.position += 1
        if self.position < self.sync_every:
            self.stats = {"synced": False, "bytes_sent": 0, "bytes_per_step": 0,
                          "local_step": self.position}
            return fp.zeros()
        fp.change_into_grads(self.anchor)
        saved = self._decay(sar.algorithm.residual)
        try:
            out = sar.gradient_step()
        except BaseException:         # check_finite="raise": what is owed stays as it was
            if saved is not None:
                sar.algorithm.residual.copy_(saved)
            self.position = self.sync_every - 1      # the next call syncs again
            raise
        self.position = 0
        alg = sar.algorithm                    # a density schedule may have switched it
        nonfinite = alg.stats.get("nonfinite")
        if saved is not None:
            self._account_decay(sar, saved, nonfinite)
        step = self._outer_step(out, nonfinite)
        fp.move_to(self.anchor, step)          # weights = anchor += step
        if self.realign is not None:           # Adam's first moment along the common step
            self.realign.after_sync(optimizer, params, fp.of(step))
        sent = alg.stats.get("bytes_sent", 0)
        per_sync = sent
        if self.moments is not None:       # Adam's moments averaged every K syncs (DES-LOC)
            moment_bytes = self.moments.after_sync(sar.comm, optimizer, params)
            per_sync = sent + self.moments.amortised(sar.comm, optimizer, params)
            sent = sent + moment_bytes
        self.stats = {**alg.stats, "synced": True, "bytes_sent": sent,
                      "bytes_per_step": per_sync / self.sync_every,
                      "local_step": self.sync_every}
        return out

    def _decay(self, residual: torch.Tensor) -> Optional[torch.Tensor]:
        """``residual *= decay`` before the reduction; returns the undecayed copy (restored when
        the sync turns out non-finite), or ``None`` without a decay."""
        if self.residual_decay == 1.0:
            return None
        saved = residual.clone()
        residual.mul_(self.residual_decay)
        return saved

    def _account_decay(self, sar: Host, saved: torch.Tensor,
                       nonfinite: Optional[torch.Tensor]) -> None:
        """After a decayed sync: a non-finite one gets the undecayed residual back; a running
        audit (ledger.ConservationLedger) is told what the decay dropped, so it still checks."""
        alg = sar.algorithm
        if nonfinite is not None:
            alg.residual.copy_(torch.where(nonfinite > 0, saved, alg.residual))
        ledger = sar.parts.ledger
        if ledger is not None:
            after = saved * self.residual_decay          # the bits residual.mul_ wrote
            if nonfinite is not None:                    # restored: nothing dropped
                after = torch.where(nonfinite > 0, saved, after)
            ledger.dropped(saved, after)

    def _outer_step(self, out: torch.Tensor, nonfinite: Optional[torch.Tensor]) -> torch.Tensor:
        """What the anchor moves by: ``out`` through the outer optimizer; 0 on a sync the
        algorithm flagged non-finite (the velocity is kept then; flat_params.nonfinite_mask:
        the flag, no isfinite pass over ``out``)."""
        if self.outer_momentum == 0.0:
            if self.outer_lr == 1.0:
                return finite_or_zero(out, nonfinite)     # out is the caller's: a masked copy
            return zero_if_flagged_(out * self.outer_lr, nonfinite)
        d = out.float()
        if self.velocity is None:
            self.velocity = torch.zeros_like(d)
        m = self.outer_momentum
        skip = nonfinite_mask(d, nonfinite)
        torch.where(skip, self.velocity, self.velocity * m + d, out=self.velocity)
        return zero_if_flagged_((d + self.velocity * m) * self.outer_lr, nonfinite)

    def regroup(self) -> None:
        """After a change of membership (``SparseAllreduce.reconfigure``): the anchor, outer
        velocity and position go on (the same on every rank); what a moment averaging sends
        is counted again at the new world size."""
        if self.moments is not None:
            self.moments.sent_bytes = 0

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {**self.describe(), "position": self.position,
                "anchor": None if self.anchor is None else [a.clone() for a in self.anchor],
                "velocity": None if self.velocity is None else self.velocity.clone(),
                "moments": None if self.moments is None else self.moments.state_dict(),
                "realign": None if self.realign is None else self.realign.state_dict()}

    def load_state_dict(self, sd: Dict[str, Any], params: List[torch.Tensor]) -> None:
        position = int(sd["position"])
        if not 0 <= position < self.sync_every:
            raise ValueError(f"SparseAllreduce: the saved interval position {position} does not "
                             f"fit sync_every={self.sync_every}")
        anchor = sd.get("anchor")
        if anchor is not None and (len(anchor) != len(params) or any(
                a.shape != p.shape for a, p in zip(anchor, params))):
            raise ValueError("SparseAllreduce: the saved anchor does not match the parameters")
        self.position = position
        self.anchor = None if anchor is None else [
            a.to(device=p.device, dtype=p.dtype).clone() for a, p in zip(anchor, params)]
        v = sd.get("velocity")
        self.velocity = None if v is None else v.to(params[0].device).clone()
        if self.moments is not None:
            self.moments.load_state_dict(sd.get("moments"))
        if self.realign is not None:
            self.realign.load_state_dict(sd.get("realign"))

# the component's former name (oktopk_triton.LocalSteps is now the settings object)
LocalSteps = LocalStepper
