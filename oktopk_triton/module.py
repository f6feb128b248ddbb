"""``SparseAllreduce``: the public front of the library (a ``torch.nn.Module``).

    from oktopk_triton import SparseAllreduce

    # over a model's gradients (SGD and friends: the optimizer steps on the reduced gradient)
    sar = SparseAllreduce(model.parameters(), density=0.01)      # algorithm="oktopk"
    loss.backward(); sar.reduce_gradients(); opt.step()

    # over the optimizer's updates (Adam and friends, see reduce_updates)
    loss.backward(); sar.reduce_updates(opt)

    # over a flat vector
    sar = SparseAllreduce(n, comm=comm, density=0.01, algorithm="oktopk", device="cuda")
    out = sar(flat_grad)   # the average over ranks of the globally selected entries

``out`` has the input's shape, device and dtype and is bitwise identical on every rank.
``sar.residual`` (fp32, ``numel``) is what this rank still owes (error feedback); ``sar.stats``
describes the last step (``bytes_sent``, ``local_selected``, ``global_selected``, ``overflow``,
...; values may be 0-dim device tensors, reading them is a host sync on a GPU).

Measured why: docs/research/design-notes.md, ``oktopk_triton/module.py``.
"""
from __future__ import annotations

import functools
import inspect
from typing import Any, Dict, Iterable, List, Optional, Union

import torch

from .algorithms import get_algorithm
from .algorithms.base import Algorithm, LossScale
from .comm.base import Communicator, resolve_device
from .modes.density_schedule import DensitySchedule
from .modes.flat_params import FlatParams, ParamSlice, parse_params
from .modes.frozen_adam import FrozenAdam
from .modes.graph import GraphedStep
from .modes.host import Parts
from .modes.state import FrontState
from .modes.ledger import ConservationLedger
from .config import AlgorithmConfig, LocalSteps, front_config, front_density
from .deprecation import old_keywords, split_options
from .modes.local_steps import LocalStepper
from .presets import Preset, from_preset
from .modes.updates import UpdateReduction

__all__ = ["SparseAllreduce", "ParamSlice", "keywords"]


def _default_communicator(device: torch.device) -> Communicator:
    from .comm import default_communicator
    return default_communicator(device)


class SparseAllreduce(FrontState, torch.nn.Module):
    """Sparse (or dense) gradient allreduce with error feedback over one flat vector.

    Args:
        numel_or_params: the flat gradient length, or the parameters whose ``.grad``
            :meth:`reduce_gradients` reduces (tensors or an ``nn.Module``; ``requires_grad``).
        comm: a :class:`~oktopk_triton.comm.Communicator`; ``None``: ``default_communicator``.
        density: fraction of entries selected, in (0, 1]; ``k = round(density * numel)``
            (default 0.01).
        algorithm: an algorithm object of :mod:`oktopk_triton.config` (``OkTopk(momentum=0.9,
            wire_format="q2")``, ``TopkA()``, ..., ``Dense()``: its settings, with advice on
            each) or a registered name (its defaults); default ``"oktopk"``.
        local_steps: a :class:`~oktopk_triton.config.LocalSteps` for :meth:`reduce_updates`
            (DiLoCo / SparseLoCo; :class:`~oktopk_triton.modes.local_steps.LocalStepper`); ``None``:
            every call syncs. Needs parameters; only with :meth:`reduce_updates`.
        preset: a name of :data:`~oktopk_triton.presets.PRESETS` or a ``Preset`` (``recommend``
            returns one): sets ``density``, ``algorithm`` and ``local_steps`` (give none of
            them) and logs one line saying what it chose.
        device: where an int ``numel``'s gradients live (default: the communicator's device).
        check_finite: ``"skip"`` (default: a NaN/Inf on any rank makes ``out`` NaN on every
            rank and leaves every residual unchanged), ``"raise"`` or ``"off"``.
        density_schedule: see :class:`~oktopk_triton.modes.density_schedule.DensitySchedule`.
        adam: ``"frozen"`` for :meth:`reduce_adam`.
        cuda_graph: steady steps replayed from a captured CUDA graph
            (:class:`~oktopk_triton.modes.graph.GraphedStep`; CUDA, NCCL or one rank).

    The old keywords (an algorithm's settings, the local steps') still work for one version,
    with a ``DeprecationWarning`` naming the new spelling (:mod:`oktopk_triton.deprecation`).
    """

    @old_keywords("SparseAllreduce")
    def __init__(self, numel_or_params: Union[int, Iterable[torch.Tensor], torch.nn.Module],
                 comm: Optional[Communicator] = None, density: Optional[float] = None,
                 algorithm: Union[str, AlgorithmConfig, None] = None, *,
                 local_steps: Optional[LocalSteps] = None,
                 preset: Union[str, Preset, None] = None,
                 device: Optional[Union[str, torch.device]] = None, check_finite: str = "skip",
                 density_schedule: Any = None, adam: Optional[str] = None,
                 cuda_graph: bool = False) -> None:
        super().__init__()
        if preset is None:
            self._configure(algorithm, local_steps)     # a clear error before anything is built
        numel, params, device = parse_params(numel_or_params, device)
        if comm is None:
            comm = _default_communicator(resolve_device(device) if device is not None
                                         else torch.device("cpu"))
        self.comm = comm
        if preset is not None:     # density, algorithm and local steps from a measured preset
            density, algorithm, local_steps = from_preset(
                preset, numel, comm.world_size, density=density, algorithm=algorithm,
                local_steps=local_steps)
            self._configure(algorithm, local_steps)
        density = front_density(density)
        cls = get_algorithm(self.config.algorithm)
        _check_modes(self.local_steps, params, density_schedule, adam, cuda_graph)
        build = dict(device=resolve_device(device if device is not None else comm.device),
                     check_finite=check_finite, **self.config.options())
        # the components (modes.host.Parts): the algorithm's factory, a density schedule (one
        # reducer per stage), frozen Adam, a CUDA graph of the step, the audit
        self.parts = Parts(factory=functools.partial(_new_algorithm, cls, numel, build),
                           reshard=cls.reshard_state, params=params,
                           schedule=DensitySchedule.build(density_schedule, density))
        first = self.parts.schedule.density_at(0) if self.parts.schedule else density
        self.algorithm: Algorithm = self.parts.factory(first, comm)
        self.algorithm_name = self.algorithm.name
        self.numel = numel
        self.density = float(density)                # the target (the last stage's)
        self.k = max(1, min(numel, int(round(self.density * numel))))
        self.device = self.algorithm.device
        self.flat_params: Optional[FlatParams] = FlatParams(params) if params else None
        self._updates = UpdateReduction()
        self.parts.adam = FrozenAdam.build(adam, self.algorithm, params)
        self.parts.graph = GraphedStep(self.algorithm) if cuda_graph else None

    def _configure(self, algorithm: Union[str, AlgorithmConfig, None],
                   local_steps: Optional[LocalSteps]) -> None:
        self.config = front_config(algorithm)                        # one validated object
        self.local_steps = LocalStepper.from_config(local_steps, self.config)  # None: per call

    # -- the reduction ---------------------------------------------------------------------------
    def forward(self, flat_grad: torch.Tensor, scale: LossScale = None) -> torch.Tensor:
        """Reduce ``flat_grad`` (``numel`` elements, any shape) to ``out`` (its shape, dtype and
        device; bitwise identical on every rank). ``scale``: the loss scale the gradient carries
        (a ``torch.amp.GradScaler``, a tensor or a number; :meth:`Algorithm.__call__`)."""
        self._refuse_local_steps("forward")
        self._advance()
        return self._reduce(flat_grad, scale)

    def _refuse_local_steps(self, what: str) -> None:
        if self.local_steps is not None:
            raise RuntimeError(f"SparseAllreduce: {what} cannot take local steps (built with "
                               f"{self.local_steps.describe()}); use reduce_updates(optimizer)")

    def _reduce(self, flat: torch.Tensor, scale: LossScale) -> torch.Tensor:
        """One step of the algorithm, replayed from its CUDA graph with ``cuda_graph=True``."""
        ledger, graph = self.parts.ledger, self.parts.graph
        if ledger is not None:
            ledger.fed_in(flat, scale)
        if graph is not None:
            out = graph(flat, scale=scale)
        else:
            out = self.algorithm(flat, scale=scale)
        if ledger is not None:
            ledger.delivered(out)
        return out

    def audit(self) -> ConservationLedger:
        """Start a run-long conservation audit (:class:`~.modes.ledger.ConservationLedger`, 12
        bytes an element, nothing sent; again: afresh): ``sar.audit().check()`` at the end,
        on every rank, returns ``{"checked", "calls", "relative_error", "unchecked"}``."""
        self.parts.ledger = ConservationLedger(self)
        return self.parts.ledger

    def _advance(self) -> None:
        """With a density schedule: :meth:`DensitySchedule.advance` (a stage's first step)."""
        if self.parts.schedule is not None:
            self.parts.schedule.advance(self)

    @torch.no_grad()
    def reduce_gradients(self, scale: LossScale = None) -> torch.Tensor:
        """Flatten the parameters' ``.grad`` (``None`` → zeros), reduce, and write the result back
        (each ``.grad`` then a view of one persistent flat buffer). Returns it.

        With mixed precision pass the scaler: ``scaler.scale(loss).backward();
        sar.reduce_gradients(scale=scaler); scaler.step(opt); scaler.update()``. What each rank
        still owes then follows the scaler's backoffs and growths (read on the device)."""
        self._refuse_local_steps("reduce_gradients()")
        return self.gradient_step(scale)

    def gradient_step(self, scale: LossScale = None) -> torch.Tensor:
        """reduce_gradients without the refusal: what every mode on parameters reduces with."""
        fp = self.flat_params
        if fp is None:
            raise RuntimeError("reduce_gradients needs a SparseAllreduce built from parameters")
        flat = fp.gather_grads()
        self._advance()
        flat.copy_(self._reduce(flat, scale))
        fp.scatter_grads()
        return flat

    @torch.no_grad()
    def reduce_updates(self, optimizer: torch.optim.Optimizer,
                       scaler: Optional[torch.amp.GradScaler] = None) -> torch.Tensor:
        """Error feedback in update space, for adaptive optimizers (Adam, AdamW, ...): runs
        ``optimizer.step()`` on this rank's own ``.grad`` (its state stays local), reduces the
        change it made (the residual holds the update not yet applied) and sets every replica's
        weights to ``before + out``; returns the flat reduced update (each ``.grad`` a view of
        it). Why, costs, a non-finite step: :class:`~oktopk_triton.modes.updates.UpdateReduction`.
        ``scaler``: a ``torch.amp.GradScaler`` (the step is ``scaler.step(optimizer)``; call
        ``scaler.update()`` afterwards). Not available through the DDP hook.

        With ``local_steps``: a call steps the optimizer locally (returns a zero vector,
        ``stats["synced"]`` False, no bytes); every ``sync_every``-th call reduces the change
        since the last sync and moves every replica by the outer step."""
        if self.flat_params is None:
            raise RuntimeError("reduce_updates needs a SparseAllreduce built from parameters")
        self.flat_params.check_optimizer(optimizer)
        if self.local_steps is not None:
            return self.local_steps.step(self, optimizer, scaler)
        return self._updates.step(self, optimizer, scaler)

    def reduce_adam(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """AdamW with a dense warm-up, then frozen variance and the preconditioned gradient
        reduced sparsely (``adam="frozen"``; :class:`~oktopk_triton.modes.frozen_adam.FrozenAdam`).
        Replaces ``optimizer.step()``, reading its lr, betas, eps, weight_decay, not its state."""
        self._refuse_local_steps("reduce_adam")
        if self.parts.adam is None:
            raise RuntimeError("reduce_adam needs a SparseAllreduce built with adam='frozen'")
        self._advance()
        return self.parts.adam.step(self, optimizer)

    # -- views of the algorithm ----------------------------------------------------------------
    @property
    def residual(self) -> torch.Tensor:
        """fp32 [numel]: what this rank still owes (zeros for dense)."""
        return self.algorithm.residual

    @property
    def stats(self) -> Dict[str, Any]:
        """The last step's: the algorithm's stats; with local steps also ``synced`` and
        ``bytes_per_step`` (a sync's ``bytes_sent / sync_every``; 0 on a local call)."""
        if self.local_steps is not None:
            return self.local_steps.stats
        return self.algorithm.stats

    @property
    def step_count(self) -> int:
        return self.algorithm.step_count

    # state across a restart or a change of membership: modes.state.FrontState's methods


def _new_algorithm(cls: Any, numel: int, build: Dict[str, Any], density: float,
                   comm: Communicator) -> Algorithm:
    """``Parts.factory``: an algorithm of the front's class, numel and settings."""
    return cls(numel, comm, density, **build)


def keywords(algorithm: Union[str, AlgorithmConfig], options: Dict[str, Any]) -> Dict[str, Any]:
    """``SparseAllreduce``'s keyword arguments from ``algorithm`` and one dict that mixes its
    own keywords with the old spellings (an algorithm's settings, the local steps'), translated
    without a warning (:func:`~oktopk_triton.deprecation.split_options`): for code that keeps
    its options in one dict, e.g. the benchmarks' ``--option`` entries."""
    front = set(inspect.signature(SparseAllreduce.__init__).parameters)
    old = {k: v for k, v in options.items() if k not in front}
    config, steps = split_options(algorithm, old, options.get("local_steps"))
    return {**{k: v for k, v in options.items() if k in front}, "algorithm": config,
            "local_steps": steps}


def _check_modes(local_steps: Optional[LocalStepper], params: Optional[List[torch.Tensor]],
                 density_schedule: Any, adam: Optional[str], cuda_graph: Any) -> None:
    """The combinations of modes SparseAllreduce refuses, each with a one-line reason."""
    if cuda_graph not in (True, False):
        raise TypeError(f"SparseAllreduce: cuda_graph must be True or False, got {cuda_graph!r}")
    if cuda_graph and (adam is not None or density_schedule is not None):
        raise ValueError("SparseAllreduce: cuda_graph=True replays one fixed step; it cannot "
                         "follow a density_schedule or adam='frozen'")
    if local_steps is not None and (adam is not None or params is None):
        raise ValueError("SparseAllreduce: local steps (local_steps=LocalSteps(...)) need "
                         "a reducer built from "
                         "parameters, used with reduce_updates; not with adam='frozen'")
