"""What ``SparseAllreduce`` keeps across a restart or a change of membership: its state as the
module's extra state, its per-rank files (:mod:`oktopk_triton.checkpoint`) and the switch to
another group (:meth:`FrontState.reconfigure`). ``SparseAllreduce`` inherits these methods from
:class:`FrontState`, which uses only the front's :class:`~.host.Host` interface."""
from __future__ import annotations

import functools
from typing import Any, Dict, List

from .host import Host

__all__ = ["FrontState"]


class FrontState:
    """The state methods of ``SparseAllreduce`` (a mixin over :class:`~.host.Host`)."""

    def get_extra_state(self: Host) -> Dict[str, Any]:
        """The algorithm's state, with the frozen Adam's and the local steps' when on."""
        sd = self.algorithm.state_dict()
        if self.parts.adam is not None:
            sd["frozen_adam"] = self.parts.adam.state_dict()
        if self.local_steps is not None:
            sd["local_steps"] = self.local_steps.state_dict()
        return sd

    def set_extra_state(self: Host, state: Dict[str, Any]) -> None:
        """Restore :meth:`get_extra_state` (a density schedule switches to the stage it was
        saved in)."""
        _load_extra_state(self, state)

    def fingerprint(self: Host) -> Dict[str, Any]:
        """What a saved state must match: the algorithm, numel and, when built from parameters,
        their shapes and dtypes in order."""
        from ..checkpoint import param_fingerprint
        params = self.parts.params
        fp = param_fingerprint(params) if params is not None else {}
        fp.update(algorithm=self.algorithm_name, numel=self.numel)
        return fp

    def save(self: Host, directory: str, name: str = "oktopk") -> str:
        """Write this rank's state (:meth:`get_extra_state`) to
        ``directory/{name}-rank{r}-of{P}.pt`` (every rank calls it; readable with
        ``torch.load(weights_only=True)``). Returns the path."""
        from ..checkpoint import save_rank
        return save_rank(directory, "SparseAllreduce", self.comm.rank, self.comm.world_size,
                         self.fingerprint(), self.get_extra_state(), name)

    def load(self: Host, directory: str, name: str = "oktopk") -> None:
        """Restore this rank's state saved by :meth:`save` (every rank calls it: the ranks agree
        through the communicator). Files saved at another world size are resharded
        (:meth:`Algorithm.reshard_state`: what is owed summed and rescaled, the world-size state
        a fresh reducer's, the rest from old rank 0). A missing file, another algorithm or other
        parameters raise ``CheckpointError`` (a ``ValueError``) on every rank."""
        from ..checkpoint import gather_comm, load_rank
        rank, world = self.comm.rank, self.comm.world_size
        f = load_rank(directory, "SparseAllreduce", rank, world, self.fingerprint(),
                      gather_comm(self.comm), name, map_location=self.device,
                      reshard=functools.partial(self.parts.reshard, rank=rank,
                                                world_size=world))
        _load_extra_state(self, f["state"])

    def reconfigure(self: Host, comm: Any, *, joined: bool = False) -> None:
        """Switch to ``comm`` between steps: a change of membership inside a run (ranks left or
        joined; a torchft quorum). Every member of the new group calls it together (building
        the new reducer checks numel with one small collective; another numel raises a one-line
        ``ValueError`` on every member and leaves the reducer as it was). ``comm`` may have
        another world size and another rank for this process, or be the same object whose
        ``rank`` / ``world_size`` changed.

        A survivor keeps its residual, velocity, Ok-Topk's sign EMA, step count, loss scale and
        the local steps' state (anchor, outer velocity, position in the interval); with
        ``joined=True`` this rank owes nothing (residual, velocity, sign EMA zero) and keeps the
        rest as it is (e.g. as a heal loaded it). What depends on the world size is a fresh
        reducer's at the new size (regions, capacities, thresholds: Ok-Topk calibrates afresh),
        a captured CUDA graph is dropped (captured again after its eager steps) and a running
        audit starts a new epoch (:meth:`ConservationLedger.rebase`). Conservation then holds
        over the new group; what a rank that left still owed is not delivered."""
        _reconfigure(self, comm, joined)

    def extra_repr(self: Host) -> str:
        return (f"numel={self.numel}, density={self.density:g}, "
                f"algorithm={self.algorithm_name!r}, world_size={self.comm.world_size}, "
                f"rank={self.comm.rank}, device={self.device}")

    def param_slices(self: Host) -> List[Any]:
        """The parameters in the order they are flattened, each with its slice of the flat
        gradient (a ``ParamSlice``, read-only view; empty for a SparseAllreduce built from a
        length)."""
        return [] if self.flat_params is None else self.flat_params.slices()


def _load_extra_state(sar: Host, state: Dict[str, Any]) -> None:
    parts = sar.parts
    if parts.schedule is not None and float(state.get("density", -1)) != sar.algorithm.density:
        parts.schedule.switch(sar, float(state["density"]))
    sar.algorithm.load_state_dict(state)
    if parts.graph is not None:     # the loaded state may live at new addresses
        parts.graph.reset()
    if parts.adam is not None:
        if "frozen_adam" not in state:
            raise ValueError("SparseAllreduce: built with adam='frozen' but the state holds "
                             "no frozen_adam entry")
        parts.adam.load_state_dict(state["frozen_adam"])
    saved = state.get("local_steps")
    if sar.local_steps is not None and saved is not None:
        sar.local_steps.load_state_dict(saved, parts.params)
    elif saved is not None and (saved["position"] or saved.get("velocity") is not None):
        raise ValueError("SparseAllreduce: the state was saved with local steps "
                         f"(sync_every={saved['sync_every']}) in the middle of an interval "
                         "or with an outer velocity; build this reducer with the same "
                         "local-step options")



def _reconfigure(sar: Host, comm: Any, joined: bool) -> None:
    from .graph import GraphedStep
    if joined not in (True, False):
        raise TypeError(f"SparseAllreduce.reconfigure: joined must be True or False, "
                        f"got {joined!r}")
    parts, old = sar.parts, sar.algorithm
    new = parts.factory(old.density, comm)
    new.take_owed(old, owed=not joined)
    graphed = (None if parts.graph is None
               else GraphedStep(new, eager_steps=parts.graph.eager_steps))
    sar.comm, sar.algorithm, parts.graph = comm, new, graphed
    if sar.local_steps is not None:
        sar.local_steps.regroup()
    if parts.ledger is not None:
        parts.ledger.rebase()

