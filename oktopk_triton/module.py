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
from .density_schedule import DensitySchedule
from .flat_params import FlatParams, ParamSlice, parse_params
from .frozen_adam import FrozenAdam
from .graph import GraphedStep
from .ledger import ConservationLedger
from .config import AlgorithmConfig, LocalSteps, as_config
from .deprecation import old_keywords, split_options
from .local_steps import LocalStepper
from .updates import UpdateReduction

__all__ = ["SparseAllreduce", "ParamSlice", "keywords"]


def _default_communicator(device: torch.device) -> Communicator:
    from .comm import default_communicator
    return default_communicator(device)


class SparseAllreduce(torch.nn.Module):
    """Sparse (or dense) gradient allreduce with error feedback over one flat vector.

    Args:
        numel_or_params: an int (the flat gradient length), or the parameters whose ``.grad``
            :meth:`reduce_gradients` reduces (an iterable of tensors or an ``nn.Module``; only
            those with ``requires_grad``, each once).
        comm: a :class:`~oktopk_triton.comm.Communicator`; ``None`` → ``default_communicator``
            (a world of one unless torch.distributed is initialised).
        density: fraction of entries selected, in (0, 1]; ``k = round(density * numel)``.
        algorithm: an algorithm object of :mod:`oktopk_triton.config` (``OkTopk(momentum=0.9,
            wire_format="q2")``, ``TopkA()``, ``Dense()``, ...: the settings every algorithm
            takes and its own, each with advice), or a registered name (its defaults).
        local_steps: a :class:`~oktopk_triton.config.LocalSteps` for :meth:`reduce_updates`
            (DiLoCo / SparseLoCo: each call steps the optimizer locally, every
            ``sync_every``-th call reduces the change since the last sync and moves every
            replica by the outer step; Adam's moments averaged or realigned); ``None`` (or its
            defaults): every call syncs. Needs parameters; not with :meth:`reduce_gradients`,
            :meth:`reduce_adam` or ``forward``; with ``cuda_graph=True`` every sync replays the
            captured step (:class:`~oktopk_triton.local_steps.LocalStepper`).
        device: for an int ``numel``: where the gradients live (default: the communicator's
            device). For parameters it defaults to the first parameter's device.
        check_finite: ``"skip"`` (default: a NaN/Inf on any rank makes ``out`` NaN on every
            rank and leaves every residual unchanged), ``"raise"`` or ``"off"``.
        density_schedule, adam, cuda_graph: keyword-only options of ``SparseAllreduce`` itself:
            ``density_schedule`` (see :class:`~oktopk_triton.density_schedule.DensitySchedule`),
            ``adam="frozen"`` (for :meth:`reduce_adam`) and ``cuda_graph=True`` (CUDA, NCCL or
            one rank: steady steps are replayed from a captured CUDA graph,
            :class:`~oktopk_triton.graph.GraphedStep`; not with a density schedule, Adam mode or
            loss scale; an Ok-Topk step at n = 2^26 on an H100 went from 5.6 to 2.1 ms).

    The old keywords (``sync_every=``, ``momentum=``, ... an algorithm's settings and the local
    steps') still work for one version, with a ``DeprecationWarning`` naming the new spelling
    (:mod:`oktopk_triton.deprecation`).
    """

    @old_keywords("SparseAllreduce")
    def __init__(self, numel_or_params: Union[int, Iterable[torch.Tensor], torch.nn.Module],
                 comm: Optional[Communicator] = None, density: float = 0.01,
                 algorithm: Union[str, AlgorithmConfig] = "oktopk", *,
                 local_steps: Optional[LocalSteps] = None,
                 device: Optional[Union[str, torch.device]] = None, check_finite: str = "skip",
                 density_schedule: Any = None, adam: Optional[str] = None,
                 cuda_graph: bool = False) -> None:
        super().__init__()
        self.config = as_config(algorithm)     # one validated object (clear unknown names)
        if local_steps is not None and not isinstance(local_steps, LocalSteps):
            raise TypeError(f"SparseAllreduce: local_steps must be a LocalSteps or None, got "
                            f"{type(local_steps).__name__}")
        # local_steps.LocalStepper: None with the defaults (every call syncs)
        self.local_steps = LocalStepper.from_config(local_steps)
        cls = get_algorithm(self.config.algorithm)
        numel, params, device = parse_params(numel_or_params, device)
        if comm is None:
            comm = _default_communicator(resolve_device(device) if device is not None
                                         else torch.device("cpu"))
        self.comm = comm
        _check_modes(self.local_steps, params, density_schedule, adam, cuda_graph)
        # density_schedule.DensitySchedule: one reducer per stage, each taking over the last's
        self._schedule = DensitySchedule.build(density_schedule, density)
        self._cls = cls
        self._build = dict(device=resolve_device(device if device is not None else comm.device),
                           check_finite=check_finite, **self.config.options())
        first = self._schedule.density_at(0) if self._schedule else density
        self.algorithm: Algorithm = cls(numel, comm, first, **self._build)
        self.algorithm_name = self.algorithm.name
        self.numel = numel
        self.density = float(density)                # the target (the last stage's)
        self.k = max(1, min(numel, int(round(self.density * numel))))
        self.device = self.algorithm.device
        # the modes' components: the flat layout of the parameters (flat_params.FlatParams)
        # that every mode shares, the update mode (updates.UpdateReduction), the local steps
        # (above), the frozen Adam (frozen_adam.FrozenAdam); a CUDA graph of the step
        # (graph.GraphedStep) and the run-long audit (ledger.ConservationLedger)
        self._params = params
        self.flat_params: Optional[FlatParams] = FlatParams(params) if params else None
        self._updates = UpdateReduction()
        self._adam = FrozenAdam.build(adam, self.algorithm, params)
        self._graphed: Optional[GraphedStep] = GraphedStep(self.algorithm) if cuda_graph else None
        self._ledger: Optional[ConservationLedger] = None

    # -- the reduction ---------------------------------------------------------------------------
    def forward(self, flat_grad: torch.Tensor, scale: LossScale = None) -> torch.Tensor:
        """Reduce ``flat_grad`` (``numel`` elements, any shape); returns ``out`` of the same shape,
        dtype and device, bitwise identical on every rank. ``scale``: the loss scale the
        gradient carries (a ``torch.amp.GradScaler``, a tensor or a number; see
        :meth:`Algorithm.__call__`)."""
        self._refuse_local_steps("forward")
        self._advance()
        return self._reduce(flat_grad, scale)

    def _refuse_local_steps(self, what: str) -> None:
        if self.local_steps is not None:
            raise RuntimeError(f"SparseAllreduce: {what} cannot take local steps (built with "
                               f"{self.local_steps.describe()}); use reduce_updates(optimizer)")

    def _reduce(self, flat: torch.Tensor, scale: LossScale) -> torch.Tensor:
        """One step of the algorithm, replayed from its CUDA graph with ``cuda_graph=True``."""
        ledger = self._ledger
        if ledger is not None:
            ledger.fed_in(flat, scale)
        if self._graphed is not None:
            out = self._graphed(flat, scale=scale)
        else:
            out = self.algorithm(flat, scale=scale)
        if ledger is not None:
            ledger.delivered(out)
        return out

    def audit(self) -> ConservationLedger:
        """Start a run-long conservation audit (:mod:`oktopk_triton.ledger`): from now on every
        reduction adds its input and output to a balance (fp64) and its input to an fp32 sum on
        the device, 12 bytes an element (no host read, nothing sent). ``sar.audit().check()``
        at the end, on every rank, allreduces once and returns ``{"checked", "calls",
        "relative_error", "unchecked"}``. Calling it again starts afresh."""
        self._ledger = ConservationLedger(self)
        return self._ledger

    def _advance(self) -> None:
        """With a density schedule: at a stage's first step, a reducer at the stage's density
        takes over the current one's residual, velocity and step count (its capacities are the
        new density's; Ok-Topk keeps its regions, and its first step calibrates on them)."""
        if self._schedule is None:
            return
        d = self._schedule.density_at(self.algorithm.step_count)
        if d != self.algorithm.density:
            self._switch(d)

    def _switch(self, density: float) -> None:
        new = self._cls(self.numel, self.comm, density, **self._build)
        new.take_over(self.algorithm)
        self.algorithm = new

    def reconfigure(self, comm: Communicator, *, joined: bool = False) -> None:
        """Switch to ``comm`` between steps: a change of membership inside a run (ranks left or
        joined; a torchft quorum). Every member of the new group calls it together (building
        the new reducer checks numel with one small collective; another numel raises a
        one-line ``ValueError`` on every member and leaves this reducer as it was). ``comm``
        may have another world size and another rank for this process, or be the same object
        whose ``rank`` / ``world_size`` changed.

        A survivor keeps its residual, velocity, Ok-Topk's sign EMA, step count, loss scale and
        the local steps' state (anchor, outer velocity, position in the interval); with
        ``joined=True`` this rank owes nothing (residual, velocity, sign EMA zero) and keeps the
        rest as it is (e.g. as a heal loaded it). What depends on the world size is a fresh
        reducer's at the new size (regions, capacities, thresholds: Ok-Topk calibrates afresh),
        a captured CUDA graph is dropped (captured again after its eager steps) and a running
        :meth:`audit` starts a new epoch (:meth:`ConservationLedger.rebase`). Conservation then
        holds over the new group; what a rank that left still owed is not delivered."""
        if joined not in (True, False):
            raise TypeError(f"SparseAllreduce.reconfigure: joined must be True or False, "
                            f"got {joined!r}")
        old = self.algorithm
        new = self._cls(self.numel, comm, old.density, **self._build)
        new.take_owed(old, owed=not joined)
        graphed = (None if self._graphed is None
                   else GraphedStep(new, eager_steps=self._graphed.eager_steps))
        self.comm, self.algorithm, self._graphed = comm, new, graphed
        if self.local_steps is not None:
            self.local_steps.regroup()
        if self._ledger is not None:
            self._ledger.rebase()

    @torch.no_grad()
    def reduce_gradients(self, scale: LossScale = None) -> torch.Tensor:
        """Flatten the parameters' ``.grad`` (``None`` → zeros), reduce, and write the result back
        to ``.grad``: afterwards each ``.grad`` is a view of one persistent flat buffer (the copy
        in is skipped for grads that already are). Returns the flat reduced gradient.

        With mixed precision pass the scaler: ``scaler.scale(loss).backward();
        sar.reduce_gradients(scale=scaler); scaler.step(opt); scaler.update()``. What each rank
        still owes then follows the scaler's backoffs and growths (read on the device)."""
        self._refuse_local_steps("reduce_gradients()")
        return self._reduce_grads(scale)

    def _reduce_grads(self, scale: LossScale = None) -> torch.Tensor:
        """reduce_gradients without the local-steps refusal: the reduction every mode that
        works on parameters goes through (updates.UpdateReduction and local_steps.LocalSteps
        after writing the change into ``.grad``, frozen_adam.FrozenAdam)."""
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
        """Error feedback in update space, for adaptive optimizers (Adam, AdamW, ...).

        Runs ``optimizer.step()`` on this rank's own ``.grad`` (its state stays local to the
        rank), takes the parameter change it made, reduces that change with the algorithm
        (error feedback included: the residual holds the update not yet applied) and sets every
        replica's weights to ``before + out``. Returns the flat reduced update; afterwards each
        ``.grad`` is a view of it. Why, what it costs, what a non-finite step does:
        :class:`~oktopk_triton.updates.UpdateReduction`. The optimizer's state differs across
        ranks (save it per rank); the weights stay bitwise identical. Not available through the
        DDP hook (it runs before the step).

        ``scaler``: a ``torch.amp.GradScaler`` (mixed precision): the step is taken with
        ``scaler.step(optimizer)`` (unscaled; skipped on this rank when its gradient is not
        finite), so the residual holds updates in the weights' units and a change of loss scale
        does not touch what is owed. Call ``scaler.update()`` afterwards.

        With local steps (``sync_every=H > 1``, see :class:`~oktopk_triton.local_steps.
        LocalSteps`): a call steps the optimizer and the weights stay local (returns a zero
        vector that costs nothing, ``stats["synced"]`` False, no bytes); every H-th call reduces
        the change since the last sync and sets every replica to the anchor plus the outer step
        (returns the reduced change).
        """
        if self.flat_params is None:
            raise RuntimeError("reduce_updates needs a SparseAllreduce built from parameters")
        self.flat_params.check_optimizer(optimizer)
        if self.local_steps is not None:
            return self.local_steps.step(self, optimizer, scaler)
        return self._updates.step(self, optimizer, scaler)

    def reduce_adam(self, optimizer: torch.optim.Optimizer) -> torch.Tensor:
        """AdamW with a dense warm-up, then frozen variance and the preconditioned gradient
        reduced sparsely (build with ``adam="frozen"``; see :class:`~oktopk_triton.frozen_adam.
        FrozenAdam`). Replaces ``optimizer.step()``, whose hyper-parameters (lr, betas, eps,
        weight_decay) it reads; the optimizer's own state is unused."""
        self._refuse_local_steps("reduce_adam")
        if self._adam is None:
            raise RuntimeError("reduce_adam needs a SparseAllreduce built with adam='frozen'")
        self._advance()
        return self._adam.step(self, optimizer)

    # -- views of the algorithm ----------------------------------------------------------------
    @property
    def residual(self) -> torch.Tensor:
        """fp32 [numel]: what this rank still owes (zeros for dense)."""
        return self.algorithm.residual

    @property
    def stats(self) -> Dict[str, Any]:
        """The last step's: the algorithm's stats; with local steps also ``synced`` (whether the
        call synced) and ``bytes_per_step`` (a sync's ``bytes_sent / sync_every``; a local call
        reports 0 for both, its bytes are paid by the sync)."""
        if self.local_steps is not None:
            return self.local_steps.stats
        return self.algorithm.stats

    @property
    def step_count(self) -> int:
        return self.algorithm.step_count

    # -- state (as the module's extra state) -------------------------------------------------
    def get_extra_state(self) -> Dict[str, Any]:
        sd = self.algorithm.state_dict()
        if self._adam is not None:
            sd["frozen_adam"] = self._adam.state_dict()
        if self.local_steps is not None:
            sd["local_steps"] = self.local_steps.state_dict()
        return sd

    def set_extra_state(self, state: Dict[str, Any]) -> None:
        if self._schedule is not None and float(state.get("density", -1)) != self.algorithm.density:
            self._switch(float(state["density"]))    # the stage the state was saved in
        self.algorithm.load_state_dict(state)
        if self._graphed is not None:     # the loaded state may live at new addresses
            self._graphed.reset()
        if self._adam is not None:
            if "frozen_adam" not in state:
                raise ValueError("SparseAllreduce: built with adam='frozen' but the state holds "
                                 "no frozen_adam entry")
            self._adam.load_state_dict(state["frozen_adam"])
        saved = state.get("local_steps")
        if self.local_steps is not None and saved is not None:
            self.local_steps.load_state_dict(saved, self._params)
        elif saved is not None and (saved["position"] or saved.get("velocity") is not None):
            raise ValueError("SparseAllreduce: the state was saved with local steps "
                             f"(sync_every={saved['sync_every']}) in the middle of an interval "
                             "or with an outer velocity; build this reducer with the same "
                             "local-step options")

    # -- per-rank files (oktopk_triton.checkpoint) ------------------------------------------
    def fingerprint(self) -> Dict[str, Any]:
        """What a saved state must match: the algorithm, numel and, when built from parameters,
        their shapes and dtypes in order."""
        from .checkpoint import param_fingerprint
        fp = param_fingerprint(self._params) if self._params is not None else {}
        fp.update(algorithm=self.algorithm_name, numel=self.numel)
        return fp

    def save(self, directory: str, name: str = "oktopk") -> str:
        """Write this rank's state (:meth:`get_extra_state`) to
        ``directory/{name}-rank{r}-of{P}.pt`` (every rank calls it; readable with
        ``torch.load(weights_only=True)``). Returns the path."""
        from .checkpoint import save_rank
        return save_rank(directory, "SparseAllreduce", self.comm.rank, self.comm.world_size,
                         self.fingerprint(), self.get_extra_state(), name)

    def load(self, directory: str, name: str = "oktopk") -> None:
        """Restore this rank's state saved by :meth:`save` (every rank calls it: the ranks agree
        through the communicator). Files saved at another world size are resharded
        (:meth:`Algorithm.reshard_state`: what is owed summed and rescaled, the world-size
        state a fresh reducer's, the rest from old rank 0). A missing file, another algorithm
        or other parameters raise ``CheckpointError`` (a ``ValueError``) on every rank."""
        from .checkpoint import gather_comm, load_rank
        rank, world = self.comm.rank, self.comm.world_size
        f = load_rank(directory, "SparseAllreduce", rank, world, self.fingerprint(),
                      gather_comm(self.comm), name, map_location=self.device,
                      reshard=functools.partial(self._cls.reshard_state, rank=rank,
                                                world_size=world))
        self.set_extra_state(f["state"])

    def extra_repr(self) -> str:
        return (f"numel={self.numel}, density={self.density:g}, algorithm={self.algorithm_name!r}, "
                f"world_size={self.comm.world_size}, rank={self.comm.rank}, device={self.device}")

    def param_slices(self) -> List[ParamSlice]:
        """The parameters in the order they are flattened, each with its slice of the flat
        gradient (read-only view; empty for a SparseAllreduce built from a length)."""
        return [] if self.flat_params is None else self.flat_params.slices()


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
