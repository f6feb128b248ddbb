"""What an algorithm and the local steps are set to: one validated object each.

    from oktopk_triton import SparseAllreduce, OkTopk, LocalSteps

    sar = SparseAllreduce(model.parameters(), density=0.01,
                          algorithm=OkTopk(momentum=0.9, wire_format="q2"),
                          local_steps=LocalSteps(sync_every=4))

An algorithm object (:class:`OkTopk`, :class:`TopkA`, :class:`GTopk`, :class:`SparDL`,
:class:`TopkDSA`, :class:`Gaussiank`, :class:`Dense`) holds the settings every algorithm takes
(:class:`AlgorithmConfig`) and its own; ``SparseAllreduce``, the DDP hook's
``SparseAllreduceState`` and FSDP's ``SparseReplicaReduce`` take the same objects, or a
registered name (its defaults). Each is checked when it is built: a one-line ``ValueError``
names the field and what it expects (the checks: :mod:`oktopk_triton.checks`, their one home).
"""
from __future__ import annotations

import dataclasses
from typing import Any, ClassVar, Dict, Mapping, Optional, Tuple, Union

from .checks import check_local_steps, check_options, refuse_unknown

__all__ = ["AlgorithmConfig", "OkTopk", "TopkA", "GTopk", "SparDL", "TopkDSA", "Gaussiank",
           "Dense", "Registered", "LocalSteps", "CONFIGS", "as_config"]


# -- the algorithm objects ------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class AlgorithmConfig:
    """The settings every algorithm takes. Advice:

    1. ``wire_format`` (default ``"fp32"``: an entry is an int32 index and an fp32 value):
       ``"compact"`` sends an entry as one int32 word (bf16 value, 16-bit index), half the
       bytes, its rounding kept in the residual; ``"q2"`` / ``"q4"`` quantize the values to 2 or
       4 bits on the algorithms that keep the quantization error (Ok-Topk). ``Dense`` refuses
       the packed formats.
    2. ``momentum`` (default 0): momentum correction, recommended for the sparse algorithms:
       the reducer keeps the velocity ``u = m·u + grad`` and sparsifies it; use the optimizer
       without momentum then. 0.9 as with SGD.
    3. ``momentum_masking`` (default ``None``: on for the sparse algorithms, off for
       ``Dense``): zero the velocity of the entries a step delivered, as Deep Gradient
       Compression does. Leave it at the default.
    4. ``warmup_steps`` (default 0): the first steps are a dense allreduce; a few hundred
       help a sparse run whose first steps move the weights most.
    """

    name: ClassVar[str] = ""

    wire_format: str = "fp32"
    momentum: float = 0.0
    momentum_masking: Optional[bool] = None
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        values = self.options()
        check_options(self.algorithm, values)
        from .algorithms import get_algorithm
        get_algorithm(self.algorithm).check_wire(values["wire_format"])

    @property
    def algorithm(self) -> str:
        """The registered name the object builds (``get_algorithm(cfg.algorithm)``)."""
        return self.name

    def options(self) -> Dict[str, Any]:
        """The keyword arguments the algorithm class takes (every field)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def own_options(self) -> Tuple[str, ...]:
        """The names of this algorithm's own settings (not the common ones)."""
        common = {f.name for f in dataclasses.fields(AlgorithmConfig)}
        return tuple(f.name for f in dataclasses.fields(self) if f.name not in common)

    def replace(self, **changes: Any) -> "AlgorithmConfig":
        """A copy with ``changes`` (checked; an unknown name raises the one-line ``TypeError``
        that lists the options)."""
        common = [f.name for f in dataclasses.fields(AlgorithmConfig)]
        refuse_unknown(self.algorithm, set(changes) - set(common), self.own_options())
        return dataclasses.replace(self, **changes)

    def describe(self) -> Dict[str, Any]:
        """``{"algorithm": name, **settings}``."""
        return {"algorithm": self.algorithm, **self.options()}


@dataclasses.dataclass(frozen=True, kw_only=True)
class OkTopk(AlgorithmConfig):
    """Ok-Topk: threshold selection, a balanced sparse reduce-scatter to region owners and a
    sparse allgather of their sums (docs/algorithms.md). Advice, besides the common settings:

    1. ``volume_budget`` (default 4.0): words a rank sends a step at most, in units of
       ``k(P-1)/P``, everything included (``None``: no bound). Lower it to bound the bytes;
       the entries that do not fit stay owed.
    2. ``capacity_split`` (default 0.5): the budget's share for the reduce rows, the rest for
       the gathered sums. Leave it.
    3. ``stage_factor`` (default 4.0, >= 1): staging rows hold this many times a row's
       capacity of candidates. Leave it.
    4. ``exact_thresholds`` (default False): every row at this rank's exact k-th largest
       (a reference mode, slower).
    5. ``calibrate_steps`` (default 0): the first steps place the rows at exact thresholds.
    6. ``threshold_sample`` (default 65536): the rank threshold from this many fixed random
       positions of the step's accumulator (0: from the last histogram).
    7. ``row_threshold`` (default ``"rank"``: one threshold per rank, the paper's local
       threshold; ``"region"``: each row its own).
    8. ``wire_dtype`` (default ``"fp32"``; ``"bf16"`` halves the reduce rows' values, the
       rounding kept; not with a packed ``wire_format``, which packs the values itself).
    9. ``region_span`` (default ``"auto"``: 4 on a packed wire, else no bound): the widest
       region, as a multiple of n/P.
    10. ``backend`` (default ``"auto"``): where the kernels run, ``"triton"`` or ``"torch"``.
    11. ``complete_sums`` (default False): a values-only second exchange delivers every
        rank's part of the chosen entries, not only the parts sent in the rows.
    12. ``consistency`` (default 0, in [0, 1)): a rank ranks its entries by
        ``|acc|·|EMA_b(sign(grad))|`` (0: by ``|acc|``), favouring entries whose gradient
        keeps its sign.
    """

    name: ClassVar[str] = "oktopk"

    volume_budget: Optional[float] = 4.0
    capacity_split: float = 0.5
    stage_factor: float = 4.0
    exact_thresholds: bool = False
    calibrate_steps: int = 0
    threshold_sample: int = 65536
    row_threshold: str = "rank"
    wire_dtype: str = "fp32"
    region_span: Union[str, float, None] = "auto"
    backend: str = "auto"
    complete_sums: bool = False
    consistency: float = 0.0

@dataclasses.dataclass(frozen=True, kw_only=True)
class TopkA(AlgorithmConfig):
    """TopkA: every rank's top-k allgathered, summed on every rank. Advice: 1. ``backend``
    (default ``"auto"``): where the kernels run, ``"triton"`` or ``"torch"``."""

    name: ClassVar[str] = "topka"
    backend: str = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class GTopk(AlgorithmConfig):
    """gTop-k: a butterfly of pairwise top-k merges (log2 P rounds). Advice: 1. ``backend``
    (default ``"auto"``): where the kernels run, ``"triton"`` or ``"torch"``."""

    name: ClassVar[str] = "gtopk"
    backend: str = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class SparDL(AlgorithmConfig):
    """SparDL: a sparse reduce-scatter and Bruck allgather over blocks. Advice: 1. ``teams``
    (default 1): teams of ranks reducing inside the team first; a divisor of the world size
    (checked when the reducer is built for a group)."""

    name: ClassVar[str] = "spardl"
    teams: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class TopkDSA(AlgorithmConfig):
    """TopkDSA (SparCML-style): a sparse reduce to region owners, then a sparse or dense
    allgather of the regions. Advice:

    1. ``tau`` (default 32): steps between two choices of the allgather's mode.
    2. ``slack`` (default 1.25, >= 1): a region's capacity in units of ``k/P``.
    3. ``gather_slack`` (default 1.25, >= 1): the sparse gather's capacity over the largest
       count seen.
    4. ``fill`` (default 1/3, in (0, 1]): the region fill above which the gather turns dense.
    """

    name: ClassVar[str] = "topkdsa"
    tau: int = 32
    slack: float = 1.25
    gather_slack: float = 1.25
    fill: float = 1.0 / 3.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Gaussiank(AlgorithmConfig):
    """Gaussian-k: a threshold from a Gaussian fit of the accumulator, refined by a few
    counts, then an allgather. Advice:

    1. ``slack`` (default 1.5, >= 1): the message capacity in units of k.
    2. ``iters`` (default 8): refinement counts of the threshold.
    3. ``lo``, ``hi`` (defaults 0.75 and 1.25; ``0 < lo <= 1 <= hi``): the band of selected
       counts, in units of k, the refinement aims at.
    4. ``backend`` (default ``"auto"``): where the kernels run, ``"triton"`` or ``"torch"``.
    """

    name: ClassVar[str] = "gaussiank"
    slack: float = 1.5
    iters: int = 8
    lo: float = 0.75
    hi: float = 1.25
    backend: str = "auto"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Dense(AlgorithmConfig):
    """The dense allreduce (DDP's average), with the common settings (``wire_format`` stays
    ``"fp32"``; ``momentum_masking`` defaults to off)."""

    name: ClassVar[str] = "dense"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Registered(AlgorithmConfig):
    """An algorithm added with ``register_algorithm``: its name, its own ``options`` (checked
    by its class when it is built) and the common settings."""

    registered: str
    extra: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def algorithm(self) -> str:
        return self.registered

    def options(self) -> Dict[str, Any]:
        common = {f.name: getattr(self, f.name) for f in dataclasses.fields(AlgorithmConfig)}
        return {**common, **self.extra}

    def own_options(self) -> Tuple[str, ...]:
        from .algorithms import get_algorithm
        return tuple(getattr(get_algorithm(self.registered), "OPTIONS", {}))

    def replace(self, **changes: Any) -> "AlgorithmConfig":
        common = {f.name for f in dataclasses.fields(AlgorithmConfig)}
        own = {k: v for k, v in changes.items() if k not in common}
        refuse_unknown(self.registered, own, self.own_options())
        return dataclasses.replace(self, extra={**self.extra, **own},
                                   **{k: v for k, v in changes.items() if k in common})


CONFIGS: Dict[str, type] = {c.name: c for c in (OkTopk, TopkA, GTopk, SparDL, TopkDSA, Gaussiank,
                                                 Dense)}


DEFAULT_DENSITY = 0.01          # what the fronts take when given no density (and no preset)
DEFAULT_ALGORITHM = "oktopk"     # ... and no algorithm


def front_density(density: Optional[float]) -> float:
    """A front's density: the one given, or :data:`DEFAULT_DENSITY` for ``None``."""
    return DEFAULT_DENSITY if density is None else density


def front_config(algorithm: Union[str, AlgorithmConfig, None]) -> AlgorithmConfig:
    """A front's algorithm object (:func:`as_config`); ``None`` or ``""`` means
    :data:`DEFAULT_ALGORITHM`."""
    return as_config(algorithm or DEFAULT_ALGORITHM)


def as_config(algorithm: Union[str, AlgorithmConfig]) -> AlgorithmConfig:
    """An algorithm object from a registered name (its defaults) or the object itself; an
    unknown name raises the one-line ``ValueError`` of ``get_algorithm``."""
    if isinstance(algorithm, AlgorithmConfig):
        return algorithm
    from .algorithms import get_algorithm
    get_algorithm(algorithm)
    name = algorithm.lower()
    cfg = CONFIGS.get(name)
    return cfg() if cfg is not None else Registered(registered=name)


# -- local steps ---------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True, kw_only=True)
class LocalSteps:
    """Local steps for ``SparseAllreduce.reduce_updates`` (DiLoCo, SparseLoCo): each call
    steps the optimizer locally, every ``sync_every``-th call reduces each rank's change since
    the last sync and moves every replica by the outer step (update rule and invariant:
    :class:`~oktopk_triton.modes.local_steps.LocalStepper`). The defaults sync every call, as plain
    ``reduce_updates``. Advice:

    1. ``sync_every`` (H, default 1): raise the density with H to keep the bytes per step
       (``density = H * per-step density``); H = 2 to 4 did best.
    2. ``outer_lr`` (default 1.0: the replicas take the reduced change as it is): DiLoCo
       tunes it with Nesterov momentum; plain local SGD averaging is 1.0.
    3. ``outer_momentum`` (default 0; Nesterov as DiLoCo writes it): with
       ``algorithm="dense"`` a small one (0.7 at ``outer_lr=0.36``) helped. With a sparse
       algorithm it is served capped at 0.5 (one log line; :mod:`oktopk_triton.outer`): its
       error feedback acts as a momentum already, and DiLoCo's 0.9 on top of it oscillated.
    4. ``residual_decay`` (default 1.0, no decay): SparseLoCo decays what is owed each sync,
       so stale pseudo-gradient mass fades instead of arriving late; 0.9-0.95 are its values.
    5. ``moment_sync_every`` (K, default 0: off), ``moment_sync`` (``"both"`` or
       ``"second"``), ``moment_dtype`` (``"fp32"`` or ``"bf16"`` on the wire): every K-th sync
       averages the optimizer's Adam moments over the ranks (DES-LOC,
       :class:`~oktopk_triton.modes.moments.MomentAverager`); sync both moments.
    6. ``moment_realign`` (a, default 0: off): after each sync every rank's Adam first moment
       moves a fraction ``a`` of the way to the common step's direction, at no bytes
       (:class:`~oktopk_triton.modes.realign.MomentRealign`). Leave it off: it helped one model
       and hurt another, so no preset uses it (docs/usage.md#presets).
    """

    sync_every: int = 1
    outer_lr: float = 1.0
    outer_momentum: float = 0.0
    residual_decay: float = 1.0
    moment_sync_every: int = 0
    moment_sync: str = "both"
    moment_dtype: str = "fp32"
    moment_realign: float = 0.0

    def __post_init__(self) -> None:
        check_local_steps(**self.describe())

    def describe(self) -> Dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @property
    def enabled(self) -> bool:
        """False for the defaults (every call syncs: plain ``reduce_updates``)."""
        return (self.sync_every, self.outer_lr, self.outer_momentum, self.residual_decay) != \
            (1, 1.0, 0.0, 1.0) or self.moment_sync_every > 0 or self.moment_realign != 0
