"""What a mode of :class:`~oktopk_triton.SparseAllreduce` gets from it: :class:`Parts`, the
front's components in one small object, and :class:`Host`, the typed protocol that a mode
receives in place of the front (``SparseAllreduce`` implements it; a test's stand-in may too).

    sar.parts.factory(0.02, sar.comm)   # a fresh algorithm of sar's class and settings
    sar.gradient_step()                 # the gradient mode's reduction, which every mode uses
    sar.parts.graph                     # the CUDA graph of the step (cuda_graph=True), or None
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Protocol

import torch

__all__ = ["Parts", "Host"]


@dataclasses.dataclass
class Parts:
    """A ``SparseAllreduce``'s components besides its algorithm, one field each (``None``: off).

    ``factory(density, comm)``: a fresh algorithm of the front's class, numel and settings over
    ``comm`` (a density schedule's stage, a change of membership); ``reshard``: that class's
    ``reshard_state`` (a checkpoint from another world size); ``params``: the parameters it was
    built from; ``schedule`` (:class:`.density_schedule.DensitySchedule`), ``adam``
    (:class:`.frozen_adam.FrozenAdam`), ``graph`` (:class:`.graph.GraphedStep`) and ``ledger``
    (:class:`.ledger.ConservationLedger`, once ``audit()`` started one)."""
    factory: Callable[[float, Any], Any]
    reshard: Callable[..., Any]
    params: Optional[List[torch.Tensor]] = None
    schedule: Any = None
    adam: Any = None
    graph: Any = None
    ledger: Any = None


class Host(Protocol):
    """What the modes read and call on the front (``algorithm`` and ``comm`` are replaced by a
    density switch or a change of membership)."""
    comm: Any
    algorithm: Any
    algorithm_name: str
    numel: int
    density: float
    device: torch.device
    flat_params: Any
    local_steps: Any
    parts: Parts

    @property
    def residual(self) -> torch.Tensor: ...

    def gradient_step(self, scale: Any = None) -> torch.Tensor:
        """Flatten the ``.grad``, reduce (the density schedule advanced, the graph and the
        audit on), write the result back; returns the flat result."""

    def reduce_gradients(self, scale: Any = None) -> torch.Tensor: ...

    def param_slices(self) -> List[Any]: ...
