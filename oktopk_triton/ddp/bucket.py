"""The DDP hook's bucket mode: one reducer per parameter group (a bucket of the first sparse
iteration), each reduced as soon as its parameters have arrived."""
from typing import Any, Dict, List, Tuple

import torch

from .layout import numel_of
from .reduce import reduce_members, settle

__all__ = ["BucketMode"]


class BucketMode:
    """The state of bucket mode inside an iteration (what arrived, what was reduced, whether
    DDP rebuilt its buckets)."""

    def __init__(self) -> None:
        self.pending: List[Tuple[torch.Tensor, "torch.futures.Future[torch.Tensor]",
                                 Dict[int, torch.Tensor]]] = []
        self.end_iteration()

    def end_iteration(self) -> None:
        self.arrived: Dict[int, torch.Tensor] = {}     # this iteration's grads
        self.reduced: set = set()                       # groups reduced this iteration
        self.new_groups = False
        self.now: List[Tuple[int, ...]] = []            # this iteration's buckets
        self.relayout = False                           # DDP rebuilt its buckets

    def step(self, state: Any, buf: torch.Tensor, canon: List[int], views: List[torch.Tensor],
             last: bool) -> "torch.futures.Future[torch.Tensor]":
        """Bucket mode: one reducer per parameter group. The groups are the buckets of the first
        sparse iteration (saved with the state); a group is reduced as soon as all its parameters
        have arrived, and a bucket completes once all its parameters are reduced. In steady state
        the groups are DDP's buckets, so each bucket is reduced as it arrives.

        DDP's rebuild: groups seen in an instance's first two iterations are provisional (a fresh
        DDP's layout before its rebuild, which comes after the first iteration, or the second with
        ``static_graph``). From the third iteration on, a bucket that is not a group means DDP
        rebuilt its buckets: the buckets that are groups are reduced as they come, the others wait
        for the last bucket, where the groups become this iteration's buckets (:meth:`regroup`,
        every residual moved by parameter) and the rest is reduced."""
        lay = state.layout
        key = tuple(canon)
        if lay.groups is None:                    # the first sparse iteration: groups = its buckets
            self.new_groups = True
            lay.set_groups([])
        if self.new_groups:
            lay.set_groups(lay.groups + [key])
        elif state._seen >= 2 and key not in lay.group_index:
            self.relayout = True
        self.now.append(key)
        fut: torch.futures.Future = torch.futures.Future()
        self.pending.append((buf, fut, dict(zip(canon, views))))
        self.arrived.update(zip(canon, views))
        try:
            if self.relayout:                   # only buckets that are whole groups, as they come
                gi = lay.group_index.get(key)
                ready = [] if gi is None else [gi]
            else:
                ready = sorted({lay.group_of[c] for c in canon})
            for gi in ready:
                members = lay.groups[gi]
                if gi not in self.reduced and all(c in self.arrived for c in members):
                    reduce_members(state, gi, list(members), self.arrived)
                    self.reduced.add(gi)
            if last and self.relayout:
                self.regroup(state, self.now)
                for gi, members in enumerate(lay.groups):
                    if gi not in self.reduced:
                        reduce_members(state, gi, list(members), self.arrived)
                        self.reduced.add(gi)
            done = [p for p in self.pending if all(lay.group_of[c] in self.reduced for c in p[2])]
            done_ids = {id(f) for _, f, _ in done}
            self.pending = [p for p in self.pending if id(p[1]) not in done_ids]
            for b, f, _ in done:
                f.set_result(b)
            if last:
                if self.pending:
                    raise RuntimeError("sparse_allreduce_hook: parameter groups left unreduced at "
                                       "the last bucket")
                self.end_iteration()
        except BaseException as e:
            pending, self.pending = self.pending, []
            self.end_iteration()
            settle(pending, e)
            raise
        return fut

    def regroup(self, state: Any, buckets: List[Tuple[int, ...]]) -> None:
        """Make ``buckets`` the groups. A group that was already one keeps its reducer (reduced
        this iteration under its new index); every other parameter's residual and velocity move
        from its old reducer into the reducer of its new group, which takes the step count and
        loss scale over (its thresholds start afresh: its first step calibrates). Nothing owed is
        lost; every rank regroups in the same iteration (DDP gives every rank the same buckets)."""
        lay = state.layout
        old_groups, old_reducers = lay.groups, state.reducers
        sizes = [numel_of(s) for s in lay.shapes]
        res: Dict[int, torch.Tensor] = {}
        vel: Dict[int, torch.Tensor] = {}
        template = None
        for gi, members in enumerate(old_groups):
            red = old_reducers.get(gi)
            if red is None and gi in self.pending_state:    # loaded, never built: build it now
                first = self.arrived[members[0]]
                red = state.reducer(gi, torch.empty(sum(sizes[c] for c in members),
                                                    device=first.device))
            if red is None:
                continue
            template = template or red
            off = 0
            for c in members:
                res[c] = red.residual[off:off + sizes[c]]
                if red.velocity is not None:
                    vel[c] = red.velocity[off:off + sizes[c]]
                off += sizes[c]
        old_index = {g: gi for gi, g in enumerate(old_groups)}
        reduced = self.reduced
        new_reducers: Dict[int, Any] = {}
        new_reduced = set()
        for j, g in enumerate(buckets):
            gi = old_index.get(g)
            if gi is not None and gi in old_reducers:
                new_reducers[j] = old_reducers[gi]
                if gi in reduced:
                    new_reduced.add(j)
                continue
            if template is None:
                continue                          # nothing built yet: reducers come on first use
            red = state._build(sum(sizes[c] for c in g), template.device)
            red.residual.copy_(torch.cat([res[c] if c in res else
                                          torch.zeros(sizes[c], device=template.device)
                                          for c in g]))
            if red.velocity is not None and vel:
                red.velocity.copy_(torch.cat([vel[c] if c in vel else
                                              torch.zeros(sizes[c], device=template.device)
                                              for c in g]))
            red.step_count = template.step_count
            if template.loss_scale is not None:
                red.loss_scale = template.loss_scale.clone()
                red._scale_host = template._scale_host
            new_reducers[j] = red
        state.reducers = new_reducers
        self.pending_state = {}
        lay.set_groups(list(buckets))
        self.reduced = new_reduced
