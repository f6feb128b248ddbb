"""Adam's first moment realigned to the common step after each sync of the local steps, at no
bytes (``moment_realign=a``).

Why: averaging both Adam moments at every sync lowered the 4m GPT's floor (dense
pseudo-gradients every 4 steps) from 1.26 to 1.13 of dense's steps, at three times the floor's
bytes; the first moment averaged alone diverged (an averaged ``m`` over one rank's small ``v``
makes Adam's step unbounded). Every replica already holds the common step the sync applied: it
is the ranks' mean Adam direction over the interval, scaled by the learning rates. This
component writes that direction back into each rank's ``exp_avg``, measured in the rank's own
``exp_avg_sq`` and clipped, so the next local step starts along the common direction with a
bounded size, and sends nothing. A fraction 0.3 of the way took TopkA at 2% of dense's bytes on
the 4m GPT from 1.24 to 1.16 of dense's steps (three seeds); the full way stalled Ok-Topk.

Used through ``SparseAllreduce(params, ..., local_steps=LocalSteps(sync_every=H,
moment_realign=a))``; see :class:`MomentRealign`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..checks import check_local_steps

__all__ = ["MomentRealign", "OPTIONS", "CLIP"]

# the SparseAllreduce keyword arguments this component owns
OPTIONS = ("moment_realign",)
# the largest |direction| written back, in units of one Adam step (|m_hat|/sqrt(v_hat)); Adam's
# own steps stay about this size where the gradient keeps its sign
CLIP = 1.0


class MomentRealign:
    """After each sync, each rank's ``exp_avg`` moves towards the common step's direction.

    With ``s`` the step every replica's weights took at the sync (the outer step, bitwise
    identical on every rank) and ``L`` the sum of the group's learning rates over the interval's
    optimizer steps, the common Adam direction is ``u = clip(-s / L, -CLIP, CLIP)`` (AdamW's
    decoupled weight decay, ``lr * wd * w`` a step, is taken out first). In this rank's own
    scale, Adam steps along ``u`` when ``exp_avg = u * (1 - beta1^t) * (sqrt(v / (1 -
    beta2^t)) + eps)``; the moment becomes ``exp_avg + a * (that - exp_avg)`` wherever ``s`` is
    not zero (a sparse step leaves the moments of the entries it did not move alone).

    * ``a`` (``moment_realign``, in (0, 1]; 0 is off and :meth:`build` returns ``None``): 1
      replaces the moment on the moved entries, less blends.

    No bytes, no host read: per sync one pass over the moments; per local call one addition of
    each group's learning rate (a Python float, or a tensor where the group holds one). Needs an
    Adam-style optimizer (``exp_avg``, ``exp_avg_sq``, ``step`` in its state, ``betas`` and
    ``eps`` in its groups). The weights, ``out`` and conservation are untouched: only the
    optimizer's state changes, on every rank alike in direction.
    """

    def __init__(self, amount: float) -> None:
        check_local_steps(moment_realign=amount)      # (build() turns 0 off)
        self.amount = float(amount)
        self.lr_sums: List[Any] = []        # per param group: sum of lr over the interval

    @classmethod
    def build(cls, moment_realign: float = 0.0) -> Optional["MomentRealign"]:
        """The validated component, or ``None`` for 0 (off)."""
        check_local_steps(moment_realign=moment_realign)
        return None if moment_realign == 0 else cls(moment_realign)

    def describe(self) -> Dict[str, Any]:
        return dict(moment_realign=self.amount)

    # -- every call and every sync -----------------------------------------------------------------
    def after_step(self, optimizer: torch.optim.Optimizer) -> None:
        """Called after each local optimizer step: adds each group's learning rate."""
        lrs = [g["lr"] for g in optimizer.param_groups]
        if len(self.lr_sums) != len(lrs):
            self.lr_sums = [0.0] * len(lrs)
        self.lr_sums = [s + lr for s, lr in zip(self.lr_sums, lrs)]

    @torch.no_grad()
    def after_sync(self, optimizer: torch.optim.Optimizer, params: List[torch.Tensor],
                   steps: List[torch.Tensor]) -> None:
        """Called once per sync on every rank, with ``steps`` the step each parameter took
        (views of the outer step, in ``params``' order). Starts the next interval's sums."""
        sums, self.lr_sums = self.lr_sums, []
        if not sums:
            return
        step_of = {id(p): s for p, s in zip(params, steps)}
        for group, lr_sum in zip(optimizer.param_groups, sums):
            beta1, beta2 = group["betas"]
            eps, wd = group["eps"], group.get("weight_decay", 0.0)
            decoupled = group.get("decoupled_weight_decay",
                                  isinstance(optimizer, torch.optim.AdamW))
            for p in group["params"]:
                state = optimizer.state.get(p, {})
                m, v, t = state.get("exp_avg"), state.get("exp_avg_sq"), state.get("step")
                s = step_of.get(id(p))
                if s is None or m is None or v is None or t is None:
                    continue                   # not reduced here, or never stepped
                self._realign(m, v, t, s, p, lr_sum, beta1, beta2, eps, wd if decoupled else 0.0)

    def _realign(self, m: torch.Tensor, v: torch.Tensor, t: Any, s: torch.Tensor,
                 w: torch.Tensor, lr_sum: Any, beta1: float, beta2: float, eps: float,
                 wd: float) -> None:
        """One parameter's moment (in place)."""
        s = s.to(m.dtype)
        u = s / -lr_sum
        if wd:
            u = u - wd * w.to(m.dtype)
        u = u.clamp_(-CLIP, CLIP)
        t = t.to(m.device, m.dtype) if isinstance(t, torch.Tensor) else float(t)
        target = u * (1 - beta1 ** t) * (v.sqrt() / torch.sqrt(torch.as_tensor(
            1 - beta2 ** t, dtype=m.dtype, device=m.device)) + eps)
        m.copy_(torch.where(s != 0, m + self.amount * (target - m), m))

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {**self.describe(), "lr_sums": [s.clone() if isinstance(s, torch.Tensor) else s
                                               for s in self.lr_sums]}

    def load_state_dict(self, sd: Optional[Dict[str, Any]]) -> None:
        """Restore the interval's learning-rate sums (``None``: saved without it, start afresh)."""
        self.lr_sums = [] if sd is None else list(sd.get("lr_sums", []))
