"""Dense allreduce: the baseline every sparse method must beat in time and match in accuracy.

``out = allreduce(grad) / P`` (the sum in fp32 for fp32 gradients; in the gradient's own dtype
otherwise, as DDP does, so the bytes counted are what a real dense allreduce sends). The
residual stays zero. Volume 2n(P-1)/P words (ring).
"""
from __future__ import annotations

from typing import Optional

import torch

from .base import Algorithm


class DenseAllreduce(Algorithm):
    name = "dense"
    sparse = False

    def step(self, grad: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        buf = grad.clone()
        if self.P > 1:
            self.comm.allreduce(buf)
        out.copy_(buf.float().div_(self.P))
        self.stats.update(local_selected=self.numel, global_selected=self.numel, overflow=0)
