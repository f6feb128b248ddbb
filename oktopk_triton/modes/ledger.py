"""A run-long conservation audit of a :class:`SparseAllreduce`: no gradient lost, checked.

The invariant of every algorithm, per step: summed over the ranks, what each rank accumulated
equals P times what was delivered plus what the ranks still owe. Summed over a whole run it
reads, with ``fed_p`` what rank p handed to the reducer over all its calls and ``out`` what every
call delivered (identical on every rank):

    sum_p (fed_p - (residual_p,end - residual_p,start)) == P * sum_calls out

:meth:`SparseAllreduce.audit` starts a :class:`ConservationLedger`. Each rank keeps one fp64
vector, its *balance* ``residual_p,start + fed_p - sum_calls out``, and one fp32 vector, ``fed_p``
alone, which only scales the error: the sum above is ``sum_p balance_p == sum_p residual_p,end``.
A reduction adds its input into both and takes its output off the balance (three additions over
n a call, each reading its input as it is, no fp64 temporary; no host read, nothing on the wire;
nothing at all while no audit is on); :meth:`ConservationLedger.check` allreduces two vectors
once, at the end, and returns the relative error. Why run-long and not per step: a per-step
check costs an allreduce of n words a step, as much as dense's; this one costs 12 bytes an
element of memory and one allreduce per run, so a benchmark can afford it on every recorded run.
Why one balance and not separate fp64 sums of input, output and starting residual: 12 bytes an
element instead of 24, which is 3.1 GB on the 4m GPT at 64 thread ranks of one process.

A change of membership (:meth:`SparseAllreduce.reconfigure`) rebases the ledger
(:meth:`ConservationLedger.rebase`); ``calls`` keeps counting. Measured why:
docs/research/design-notes.md, ``oktopk_triton/modes/ledger.py``.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch
from .host import Host


class ConservationLedger:
    """One rank's running balance (fp64) and input (fp32) since :meth:`SparseAllreduce.audit`."""

    def __init__(self, sar: Host) -> None:
        self._sar = sar
        n, dev = sar.numel, sar.device
        # residual at the start + fed - delivered; fp64, so that nothing cancels away
        self.balance = sar.residual.detach().reshape(-1).to(torch.float64, copy=True)
        # fed alone, for the error's scale only: fp32 is plenty for a norm
        self.fed = torch.zeros(n, dtype=torch.float32, device=dev)
        self.calls = 0
        self.unchecked: Optional[str] = None
        self._why_not()

    def _why_not(self) -> None:
        if self.unchecked is not None:
            return
        if self._sar.parts.adam is not None:
            self.unchecked = "adam='frozen' rescales the velocity at the end of its warm-up"

    def fed_in(self, flat: torch.Tensor, scale: Any) -> None:
        """Before a reduction: its input (``flat``, any dtype)."""
        if scale is not None and self.unchecked is None:
            self.unchecked = "a loss scale: the residual follows the scaler"
        alg = self._sar.algorithm
        m = float(getattr(alg, "momentum", 0.0) or 0.0)
        if m > 0.0 and getattr(alg, "velocity", None) is not None:
            self._feed(alg.velocity, m)             # u = m·u + grad: the m·u part
        self._feed(flat.detach().reshape(-1))

    def _feed(self, x: torch.Tensor, alpha: float = 1.0) -> None:
        # added in fp64 as it is read (an in-place add promotes): no fp64 copy of n per call
        self.balance.add_(x.reshape(-1), alpha=alpha)
        self.fed.add_(x.reshape(-1), alpha=alpha)

    def dropped(self, before: torch.Tensor, after: torch.Tensor) -> None:
        """At a sync with a residual decay: the residual ``before`` and ``after`` it (fp32, the
        bits the decay wrote); what it dropped leaves the balance and ``fed`` (in-place
        additions, no fp64 temporary)."""
        self._feed(before, -1.0)
        self._feed(after)

    def rebase(self) -> None:
        """Start a new epoch at the reducer's current residual (after a change of membership:
        ``SparseAllreduce.reconfigure`` calls it); ``calls`` keeps its count."""
        self.balance.copy_(self._sar.residual.detach().reshape(-1))
        self.fed.zero_()

    def delivered(self, out: torch.Tensor) -> None:
        """After a reduction: its output."""
        self.balance.sub_(out.detach().reshape(-1))
        self.calls += 1

    def check(self) -> Dict[str, Any]:
        """Allreduce once (every rank must call it) and compare; ``relative_error`` is
        ``|sum_p (fed_p - d residual_p) - P*out| / |sum_p fed_p|`` (2-norms), None when not
        checked. One host read."""
        self._why_not()
        sar = self._sar
        both = torch.stack([self.balance - sar.residual.detach().reshape(-1).double(),
                            self.fed.double()])
        sar.comm.allreduce(both)
        ref = float(torch.linalg.vector_norm(both[1]))
        err = float(torch.linalg.vector_norm(both[0]))
        rel = err / ref if ref > 0 else err
        finite = bool(torch.isfinite(torch.tensor(rel)))
        reason = self.unchecked or (None if finite else "a call delivered a non-finite value")
        return {"checked": reason is None, "calls": self.calls,
                "relative_error": rel if reason is None else None,
                "unchecked": reason}
