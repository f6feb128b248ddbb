"""What ``SparseAllreduce`` keeps across a restart or a change of membership: its state as the
module's extra state, its per-rank files (:mod:`oktopk_triton.checkpoint`) and the switch to
another group (:func:`reconfigure`). The front's methods of the same names call these."""
from __future__ import annotations

import functools
from typing import Any, Dict, List

__all__ = ["extra_state", "load_extra_state", "fingerprint", "save", "load", "reconfigure"]


def extra_state(sar: Any) -> Dict[str, Any]:
    """``SparseAllreduce.get_extra_state``: the algorithm's state, with the frozen Adam's and
    the local steps' when on."""
    sd = sar.algorithm.state_dict()
    if sar._adam is not None:
        sd["frozen_adam"] = sar._adam.state_dict()
    if sar.local_steps is not None:
        sd["local_steps"] = sar.local_steps.state_dict()
    return sd


def load_extra_state(sar: Any, state: Dict[str, Any]) -> None:
    """``SparseAllreduce.set_extra_state``: restore :func:`extra_state` (a density schedule
    switches to the stage it was saved in)."""
    if sar._schedule is not None and float(state.get("density", -1)) != sar.algorithm.density:
        sar._schedule.switch(sar, float(state["density"]))
    sar.algorithm.load_state_dict(state)
    if sar._graphed is not None:     # the loaded state may live at new addresses
        sar._graphed.reset()
    if sar._adam is not None:
        if "frozen_adam" not in state:
            raise ValueError("SparseAllreduce: built with adam='frozen' but the state holds "
                             "no frozen_adam entry")
        sar._adam.load_state_dict(state["frozen_adam"])
    saved = state.get("local_steps")
    if sar.local_steps is not None and saved is not None:
        sar.local_steps.load_state_dict(saved, sar._params)
    elif saved is not None and (saved["position"] or saved.get("velocity") is not None):
        raise ValueError("SparseAllreduce: the state was saved with local steps "
                         f"(sync_every={saved['sync_every']}) in the middle of an interval "
                         "or with an outer velocity; build this reducer with the same "
                         "local-step options")


def fingerprint(sar: Any) -> Dict[str, Any]:
    """What a saved state must match: the algorithm, numel and, when built from parameters,
    their shapes and dtypes in order."""
    from ..checkpoint import param_fingerprint
    fp = param_fingerprint(sar._params) if sar._params is not None else {}
    fp.update(algorithm=sar.algorithm_name, numel=sar.numel)
    return fp


def save(sar: Any, directory: str, name: str = "oktopk") -> str:
    """Write this rank's state (:func:`extra_state`) to ``directory/{name}-rank{r}-of{P}.pt``
    (every rank calls it; readable with ``torch.load(weights_only=True)``). Returns the path."""
    from ..checkpoint import save_rank
    return save_rank(directory, "SparseAllreduce", sar.comm.rank, sar.comm.world_size,
                     fingerprint(sar), extra_state(sar), name)


def load(sar: Any, directory: str, name: str = "oktopk") -> None:
    """Restore this rank's state saved by :func:`save` (every rank calls it: the ranks agree
    through the communicator). Files saved at another world size are resharded
    (:meth:`Algorithm.reshard_state`: what is owed summed and rescaled, the world-size state a
    fresh reducer's, the rest from old rank 0). A missing file, another algorithm or other
    parameters raise ``CheckpointError`` (a ``ValueError``) on every rank."""
    from ..checkpoint import gather_comm, load_rank
    rank, world = sar.comm.rank, sar.comm.world_size
    f = load_rank(directory, "SparseAllreduce", rank, world, fingerprint(sar),
                  gather_comm(sar.comm), name, map_location=sar.device,
                  reshard=functools.partial(sar._cls.reshard_state, rank=rank,
                                            world_size=world))
    load_extra_state(sar, f["state"])


def reconfigure(sar: Any, comm: Any, *, joined: bool = False) -> None:
    """Switch ``sar`` to ``comm`` between steps: a change of membership inside a run (ranks left
    or joined; a torchft quorum). Every member of the new group calls it together (building
    the new reducer checks numel with one small collective; another numel raises a one-line
    ``ValueError`` on every member and leaves the reducer as it was). ``comm`` may have another
    world size and another rank for this process, or be the same object whose ``rank`` /
    ``world_size`` changed.

    A survivor keeps its residual, velocity, Ok-Topk's sign EMA, step count, loss scale and the
    local steps' state (anchor, outer velocity, position in the interval); with ``joined=True``
    this rank owes nothing (residual, velocity, sign EMA zero) and keeps the rest as it is (e.g.
    as a heal loaded it). What depends on the world size is a fresh reducer's at the new size
    (regions, capacities, thresholds: Ok-Topk calibrates afresh), a captured CUDA graph is
    dropped (captured again after its eager steps) and a running audit starts a new epoch
    (:meth:`ConservationLedger.rebase`). Conservation then holds over the new group; what a
    rank that left still owed is not delivered."""
    from .graph import GraphedStep
    if joined not in (True, False):
        raise TypeError(f"SparseAllreduce.reconfigure: joined must be True or False, "
                        f"got {joined!r}")
    old = sar.algorithm
    new = sar._cls(sar.numel, comm, old.density, **sar._build)
    new.take_owed(old, owed=not joined)
    graphed = (None if sar._graphed is None
               else GraphedStep(new, eager_steps=sar._graphed.eager_steps))
    sar.comm, sar.algorithm, sar._graphed = comm, new, graphed
    if sar.local_steps is not None:
        sar.local_steps.regroup()
    if sar._ledger is not None:
        sar._ledger.rebase()


def extra_repr(sar: Any) -> str:
    return (f"numel={sar.numel}, density={sar.density:g}, algorithm={sar.algorithm_name!r}, "
            f"world_size={sar.comm.world_size}, rank={sar.comm.rank}, device={sar.device}")


def param_slices(sar: Any) -> List[Any]:
    """The parameters in the order they are flattened, each with its slice of the flat
    gradient (a ``ParamSlice``, read-only view; empty for a SparseAllreduce built from a
    length)."""
    return [] if sar.flat_params is None else sar.flat_params.slices()
