"""Optimizer moments kept in step across ranks (DES-LOC, arXiv 2505.22549), for local steps.

With local steps (:mod:`oktopk_triton.modes.local_steps`) every rank's Adam keeps its own
``exp_avg`` and ``exp_avg_sq``, so each local step is normalised by one rank's small-batch noise
and the replicas' optimizers drift apart. DES-LOC syncs the weights and Adam's moments on separate
periods. :class:`MomentAverager` averages the moments over the ranks every ``every``-th sync with
one dense allreduce through the reducer's communicator (counted in ``bytes_sent``), optionally
only the second moment and in bf16 (a quarter of "both" in fp32).

Used through ``SparseAllreduce(params, ..., local_steps=LocalSteps(sync_every=H,
moment_sync_every=K))``; options :data:`OPTIONS`.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..comm.base import ring_allreduce_bytes
from ..checks import check_local_steps

__all__ = ["MomentAverager", "MomentSync", "OPTIONS", "MOMENTS", "MOMENT_DTYPES"]

# the SparseAllreduce keyword arguments this component owns (one home for the names)
OPTIONS = ("moment_sync_every", "moment_sync", "moment_dtype")
# which optimizer-state entries each ``moment_sync`` value averages (torch's Adam/AdamW names)
MOMENTS = {"both": ("exp_avg", "exp_avg_sq"), "second": ("exp_avg_sq",)}
MOMENT_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class MomentAverager:
    """Every ``every``-th sync of the local steps, the optimizer's moments become their average
    over the ranks, bitwise identical on every rank.

    * ``every`` (``moment_sync_every``, K >= 1): syncs between two moment averagings (0 = off:
      :meth:`build` returns ``None``).
    * ``moments`` (``moment_sync``): ``"both"`` (``exp_avg`` and ``exp_avg_sq``, DES-LOC) or
      ``"second"`` (``exp_avg_sq`` only: the per-coordinate scale, which moves slowly).
    * ``dtype`` (``moment_dtype``): ``"fp32"`` or ``"bf16"`` on the wire (the ranks sum bf16
      values: about 3 significant digits, ample for a scale; half the bytes). The average is
      written back into the state in the state's dtype, so a bf16 wire rounds every rank's
      moments alike.

    What is averaged: for every parameter the optimizer holds (in the reducer's order), the
    listed entries of ``optimizer.state[p]`` (``step`` and anything else are left alone). An
    entry that is not finite on some rank stays each rank's own there (no host read; a rank whose
    optimizer took a NaN keeps it, as without moment sync); everywhere else the ranks agree.

    Cost per moment sync: copy in, one allreduce of ``numel * len(moments)`` values, copy out
    (a persistent flat buffer of that size). ``sent_bytes`` (2(P-1)/P of the buffer per rank) is
    added to the sync's ``bytes_sent``; :meth:`amortised` spreads it over the K syncs.
    """

    def __init__(self, every: int, moments: str = "both", dtype: str = "fp32") -> None:
        check_local_steps(moment_sync_every=every, moment_sync=moments, moment_dtype=dtype)
        self.every, self.moments, self.dtype = every, moments, dtype
        self.count = 0                                  # syncs since the last moment averaging
        self._flat: Optional[torch.Tensor] = None
        self.sent_bytes = 0                             # what one moment averaging sends

    @classmethod
    def build(cls, moment_sync_every: int = 0, moment_sync: str = "both",
              moment_dtype: str = "fp32") -> Optional["MomentAverager"]:
        """The validated component, or ``None`` when ``moment_sync_every == 0`` (off)."""
        check_local_steps(moment_sync_every=moment_sync_every, moment_sync=moment_sync,
                          moment_dtype=moment_dtype)
        if moment_sync_every == 0:
            return None
        return cls(moment_sync_every, moment_sync, moment_dtype)

    def describe(self) -> Dict[str, Any]:
        return dict(moment_sync_every=self.every, moment_sync=self.moments,
                    moment_dtype=self.dtype)

    # -- one sync ---------------------------------------------------------------------------------
    @torch.no_grad()
    def after_sync(self, comm: Any, optimizer: torch.optim.Optimizer,
                   params: List[torch.Tensor]) -> int:
        """Called once per sync of the local steps, on every rank; every ``every``-th call
        averages the moments. Returns the bytes this call sent (0 between averagings)."""
        self.count += 1
        if self.count < self.every:
            return 0
        self.count = 0
        states = self._moment_tensors(optimizer, params)
        if self._flat is None or self._flat.numel() != sum(t.numel() for t in states):
            self._flat = torch.empty(sum(t.numel() for t in states),
                                     dtype=MOMENT_DTYPES[self.dtype], device=states[0].device)
        flat = self._flat
        views = list(flat.split([t.numel() for t in states]))
        torch._foreach_copy_(views, [t.reshape(-1) for t in states])
        before = comm.bytes_sent
        comm.allreduce(flat)
        self.sent_bytes = comm.bytes_sent - before
        flat.div_(comm.world_size)
        for t, v in zip(states, views):
            v = v.view(t.shape)
            t.copy_(torch.where(torch.isfinite(v), v.to(t.dtype), t))
        return self.sent_bytes

    def amortised(self, comm: Any, optimizer: torch.optim.Optimizer,
                  params: List[torch.Tensor]) -> float:
        """One moment averaging's bytes spread over the ``every`` syncs it covers (the bytes a
        sync pays for it on average, the same on every sync)."""
        if not self.sent_bytes:
            held = self._held(optimizer, params)
            n = sum(p.numel() for p in held) * len(MOMENTS[self.moments])
            size = torch.empty((), dtype=MOMENT_DTYPES[self.dtype]).element_size()
            self.sent_bytes = ring_allreduce_bytes(n * size, comm.world_size)
        return self.sent_bytes / self.every

    @staticmethod
    def _held(optimizer: torch.optim.Optimizer, params: List[torch.Tensor]) -> List[torch.Tensor]:
        """The reducer's parameters that ``optimizer`` steps, in the reducer's order."""
        ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
        return [p for p in params if id(p) in ids]

    def _moment_tensors(self, optimizer: torch.optim.Optimizer,
                        params: List[torch.Tensor]) -> List[torch.Tensor]:
        out = []
        for i, p in enumerate(self._held(optimizer, params)):
            state = optimizer.state.get(p, {})
            for key in MOMENTS[self.moments]:
                t = state.get(key)
                if not isinstance(t, torch.Tensor) or t.shape != p.shape:
                    raise ValueError(
                        f"moment_sync: parameter {i} (shape {tuple(p.shape)}) has no {key!r} of "
                        f"its shape in {type(optimizer).__name__}'s state: moment sync needs an "
                        f"Adam-style optimizer (Adam, AdamW) that has stepped every parameter")
                out.append(t)
        if not out:
            raise ValueError("moment_sync: the optimizer holds none of the reducer's parameters")
        return out

    # -- state ------------------------------------------------------------------------------------
    def state_dict(self) -> Dict[str, Any]:
        return {**self.describe(), "count": self.count}

    def load_state_dict(self, sd: Optional[Dict[str, Any]]) -> None:
        """Restore the position between averagings (``None``: a state saved without moment
        sync, which starts counting afresh)."""
        count = 0 if sd is None else int(sd.get("count", 0))
        if not 0 <= count < self.every:
            raise ValueError(f"SparseAllreduce: the saved moment-sync position {count} does not "
                             f"fit moment_sync_every={self.every}")
        self.count = count


# the component's former name
MomentSync = MomentAverager
