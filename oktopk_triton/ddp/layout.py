"""The DDP hook's parameter order (:class:`Layout`) and the views of a bucket's gradients.

Used by :mod:`oktopk_triton.ddp` and its modes (:mod:`oktopk_triton.ddp.flat`,
:mod:`oktopk_triton.ddp.bucket`).
"""
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

__all__ = ["Layout", "bucket_views", "numel_of"]


class Layout:
    """The hook's element order, fixed by parameters rather than by DDP's buckets.

    DDP lays out a fresh instance's buckets in one order for its first iteration and rebuilds
    them in gradient-ready order after it. A residual kept in bucket order would therefore, on a
    resume whose first iteration runs before the rebuild, be applied to other parameters than
    those it was computed for (same length, no error). Here every parameter gets a *canonical
    index*: its position in the first iteration this state sees (a fresh DDP's first layout,
    identical for an uninterrupted run and for a resumed one), and every reducer reads and writes
    its vector in canonical order. ``groups`` (bucket mode) are the parameter sets of the
    reducers, fixed by the first sparse iteration's buckets and saved with the state.
    """

    __slots__ = ("index", "shapes", "groups", "group_of", "group_index", "expected")

    def __init__(self) -> None:
        self.index: Dict[int, int] = {}            # id(parameter) -> canonical index
        self.shapes: List[Tuple[int, ...]] = []     # canonical index -> shape
        self.groups: Optional[List[Tuple[int, ...]]] = None
        self.group_of: Dict[int, int] = {}
        self.group_index: Dict[Tuple[int, ...], int] = {}
        self.expected: Optional[List[Tuple[int, ...]]] = None   # shapes of a loaded state

    def indices(self, params: List[torch.Tensor]) -> List[int]:
        """Canonical indices of a bucket's parameters, assigning new ones on first sight."""
        out = []
        for p in params:
            c = self.index.get(id(p))
            if c is None:
                c = len(self.shapes)
                self.index[id(p)] = c
                self.shapes.append(tuple(p.shape))
                if self.expected is not None and (c >= len(self.expected)
                                                  or self.expected[c] != self.shapes[c]):
                    raise ValueError(
                        "sparse_allreduce_hook: the loaded state was saved for other parameters "
                        f"(parameter {c} has shape {self.shapes[c]}, the saved state expects "
                        f"{self.expected[c] if c < len(self.expected) else 'no such parameter'}); "
                        "load a state saved from this model")
            out.append(c)
        return out

    def check_complete(self) -> None:
        if self.expected is not None and len(self.shapes) != len(self.expected):
            raise ValueError(f"sparse_allreduce_hook: the loaded state was saved for "
                             f"{len(self.expected)} parameters, this model has {len(self.shapes)}")

    def set_groups(self, groups: List[Tuple[int, ...]]) -> None:
        self.groups = [tuple(g) for g in groups]
        self.group_of = {c: gi for gi, g in enumerate(self.groups) for c in g}
        self.group_index = {g: gi for gi, g in enumerate(self.groups)}

    def known_shapes(self) -> List[Tuple[int, ...]]:
        """The canonical shapes: those seen, else those of a loaded state (not yet seen)."""
        return self.shapes if self.shapes or self.expected is None else self.expected

    def state_dict(self) -> Dict[str, Any]:
        return {"shapes": [list(s) for s in self.known_shapes()],
                "groups": None if self.groups is None else [list(g) for g in self.groups]}

    def load(self, sd: Dict[str, Any]) -> None:
        # a state saved before the hook saw any parameter constrains none
        self.expected = [tuple(s) for s in sd["shapes"]] or None
        if self.expected is None:
            return
        if self.shapes:      # already seen: check now
            for c, s in enumerate(self.shapes):
                if c >= len(self.expected) or self.expected[c] != s:
                    raise ValueError("SparseAllreduceState.load_state_dict: the state was saved "
                                     f"for other parameters (parameter {c}: shape {s} here, "
                                     f"{self.expected[c] if c < len(self.expected) else 'none'} "
                                     "saved)")
        if sd.get("groups") is not None:
            self.set_groups([tuple(g) for g in sd["groups"]])


def bucket_views(bucket: dist.GradBucket, buf: torch.Tensor) -> List[torch.Tensor]:
    """The flat view of each parameter's gradient inside the bucket buffer (DDP packs them in
    ``bucket.parameters()`` order, back to back)."""
    views, off = [], 0
    flat = buf.reshape(-1)
    for p in bucket.parameters():
        views.append(flat[off:off + p.numel()])
        off += p.numel()
    if off != flat.numel():
        raise RuntimeError(f"sparse_allreduce_hook: bucket {bucket.index()} holds {flat.numel()} "
                           f"elements but its parameters {off}")
    return views


def numel_of(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
