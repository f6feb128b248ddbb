"""The update mode of ``SparseAllreduce.reduce_updates`` (no local steps): error feedback in
update space, for adaptive optimizers.

Why: error feedback sends a coordinate's gradient summed over the steps it waited, and an
adaptive optimizer divides that sum by its own running scale, so T steps of owed gradient move
the weight about as far as one dense step (measured on the byte-level GPT, 1% density, 150
AdamW steps: every sparse algorithm stalled at 3.32 nats/byte against dense 2.55, the unigram
level; reducing updates instead gave Ok-Topk 2.96). Reducing the update keeps the sum linear:
what a coordinate is owed is delivered whole. This module holds the mode
(:class:`UpdateReduction`); the local steps (:mod:`oktopk_triton.modes.local_steps`) are its
variant that syncs every H-th call.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .flat_params import finite_or_zero, optimizer_step
from .host import Host

__all__ = ["UpdateReduction"]


class UpdateReduction:
    """One ``reduce_updates`` call without local steps: snapshot the weights, step the
    optimizer on this rank's own ``.grad``, reduce the change it made with the algorithm (the
    residual holds the update not yet applied), and set every replica's weights to
    ``snapshot + out``; a step the algorithm flagged non-finite leaves the weights as they were
    on every rank (with ``check_finite="skip"`` one rank's NaN makes ``out`` NaN everywhere;
    the algorithm's flag, ``stats["nonfinite"]``, says so without another pass over ``out``).

    State: the snapshot (one copy of the weights, their dtypes), scratch within a call; nothing
    outlives a call, so :meth:`state_dict` is empty and the reducer's saved state holds no entry
    for this mode. Per call over the optimizer step: one copy of the weights into the snapshot,
    the change written into the flat gradient (a copy and a subtraction), one pass that zeroes
    a flagged step, and the new weights (an addition and a copy); no host read.
    """

    def __init__(self) -> None:
        self.snapshot: Optional[List[torch.Tensor]] = None

    @torch.no_grad()
    def step(self, sar: Host, optimizer: torch.optim.Optimizer, scaler: Any) -> torch.Tensor:
        """Uses ``sar.flat_params`` (:class:`~oktopk_triton.modes.flat_params.FlatParams`),
        ``sar.algorithm`` and ``sar.gradient_step()`` (the gradient mode's reduction).
        Returns the flat reduced update; afterwards each ``.grad`` is a view of it."""
        fp = sar.flat_params
        if self.snapshot is None:
            self.snapshot = [torch.empty_like(p) for p in fp.params]
        torch._foreach_copy_(self.snapshot, fp.params)
        optimizer_step(optimizer, scaler)
        fp.change_into_grads(self.snapshot)
        out = sar.gradient_step()
        fp.move_to(self.snapshot, finite_or_zero(out, sar.algorithm.stats.get("nonfinite")))
        return out

    def state_dict(self) -> Dict[str, Any]:
        return {}
