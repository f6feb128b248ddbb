"""Dense allreduce: the baseline every sparse method must beat in time and match in accuracy.

``out = allreduce(grad) / P`` (the sum in fp32 for fp32 gradients; in the gradient's own dtype
otherwise, as DDP does, so the bytes counted are what a real dense allreduce sends). The
residual stays zero. Volume 2n(P-1)/P words (ring).
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import schedule as S
from .base import Algorithm
from .description import Description


DESCRIPTION = Description(
    name="dense", config="Dense", display="dense", sparse=False,
    advice="""The dense allreduce (DDP's average), with the common settings (``wire_format`` stays
    ``"fp32"``; ``momentum_masking`` defaults to off).""",
    volume=lambda n, k, P, **o: (2.0 * n * ((P - 1) / P),) * 2,        # a ring allreduce of n
    passes=(4 + 4 + 24, 0, 0))       # the checks (8); clone (8), div_ (8), copy into out (8)


class DenseAllreduce(Algorithm):
    description = DESCRIPTION
    compact_refusal = "a dense allreduce sends values only, no indices to compact"

    @classmethod
    def schedule(cls, n: int, k: int, P: int, **options) -> List[S.CollectiveSpec]:
        """One steady step: the flag allreduce, then one allreduce of n elements of the
        gradient's dtype (``dtype`` option; fp32 when k >= n: the base class's dense step)."""
        o = S.resolve_options(cls, n, k, P, options)
        if k >= n:
            return S.dense_step_specs(n, P, o)
        return S.flag_specs(P, o) + ([S.allreduce(n * o["grad_bytes"], P)] if P > 1 else [])

    def step(self, grad: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        buf = grad.clone()
        if self.P > 1:
            self.comm.allreduce(buf)
        out.copy_(buf.float().div_(self.P))
        self.stats.update(local_selected=self.numel, global_selected=self.numel, overflow=0)
