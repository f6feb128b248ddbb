"""The DDP hook's flat mode: one reducer over the whole iteration's gradient."""
from typing import Any, Dict, List, Tuple

import torch

from .reduce import reduce_members, settle

__all__ = ["FlatMode", "FLAT"]

FLAT = -1   # the reducers key of the flat reducer


class FlatMode:
    """The state of flat mode between buckets: the buckets held until the last one."""

    def __init__(self) -> None:
        self.pending: List[Tuple[torch.Tensor, "torch.futures.Future[torch.Tensor]",
                                 Dict[int, torch.Tensor]]] = []

    def step(self, state: Any, buf: torch.Tensor, canon: List[int], views: List[torch.Tensor],
             last: bool) -> "torch.futures.Future[torch.Tensor]":
        """Flat mode: hold the buckets until the last one arrives, then reduce the whole gradient as
        one vector in canonical order and complete every held future (each with its own buffer:
        DDP re-points its views into the future's tensor with as_strided, which ignores a slice's
        storage offset)."""
        fut: torch.futures.Future = torch.futures.Future()
        self.pending.append((buf, fut, dict(zip(canon, views))))
        if not last:
            return fut
        pending, self.pending = self.pending, []
        try:
            grads: Dict[int, torch.Tensor] = {}
            for _, _, g in pending:
                grads.update(g)
            reduce_members(state, FLAT, list(range(len(state.layout.shapes))), grads)
            for b, f, _ in pending:
                f.set_result(b)
        except BaseException as e:   # every held bucket fails, none is left waiting
            settle(pending, e)
            raise
        return fut
