"""What an algorithm and the local steps are set to: one validated object each.

    from oktopk_triton import SparseAllreduce, OkTopk, LocalSteps

    sar = SparseAllreduce(model.parameters(), density=0.01,
                          algorithm=OkTopk(momentum=0.9, wire_format="q2"),
                          local_steps=LocalSteps(sync_every=4))

An algorithm object (:class:`OkTopk`, :class:`TopkA`, :class:`GTopk`, :class:`SparDL`,
:class:`TopkDSA`, :class:`Gaussiank`, :class:`Dense`) holds the settings every algorithm takes
(:class:`AlgorithmConfig`) and its own; ``SparseAllreduce``, the DDP hook's
``SparseAllreduceState`` and FSDP's ``SparseReplicaReduce`` take the same objects, or a
registered name (its defaults). Each is made from its algorithm's description (its options,
their defaults and rules, written once in the algorithm's file:
:mod:`oktopk_triton.algorithms.description`) and checked when it is built: a one-line
``ValueError`` names the field and what it expects.
"""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, ClassVar, Dict, Mapping, Optional, Tuple, Union

from .checks import check_local_steps, check_options, refuse_unknown

if TYPE_CHECKING:
    from .algorithms.description import Description

# importing this module stays cheap (no torch, no kernels): the algorithms' settings objects are
# made on first use, when the algorithms are imported (module __getattr__ below)
_STATIC = ["AlgorithmConfig", "Registered", "LocalSteps", "CONFIGS", "as_config", "settings_class"]


def _get_algorithm(name: str) -> type:
    from .algorithms import get_algorithm
    return get_algorithm(name)


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
    description: ClassVar[Optional["Description"]] = None

    wire_format: str = "fp32"
    momentum: float = 0.0
    momentum_masking: Optional[bool] = None
    warmup_steps: int = 0

    def __post_init__(self) -> None:
        values = self.options()
        check_options(self.algorithm, values, self.description)
        _get_algorithm(self.algorithm).check_wire(values["wire_format"])

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
        return tuple(getattr(_get_algorithm(self.registered), "OPTIONS", {}))

    def replace(self, **changes: Any) -> "AlgorithmConfig":
        common = {f.name for f in dataclasses.fields(AlgorithmConfig)}
        own = {k: v for k, v in changes.items() if k not in common}
        refuse_unknown(self.registered, own, self.own_options())
        return dataclasses.replace(self, extra={**self.extra, **own},
                                   **{k: v for k, v in changes.items() if k in common})


def settings_class(description: "Description") -> type:
    """The settings object of an algorithm, made from its description: a frozen, keyword-only
    dataclass named ``description.config`` whose fields are the common settings and the
    algorithm's own options with their defaults, its docstring the description's advice. Made
    once per description."""
    cls = _MADE.get(description.name)
    if cls is not None and cls.description is description:
        return cls
    fields = [(k, o.annotation, dataclasses.field(default=o.default))
              for k, o in description.options.items()]
    cls = dataclasses.make_dataclass(
        description.config, fields, bases=(AlgorithmConfig,), frozen=True, kw_only=True,
        namespace={"name": description.name, "description": description,
                   "__doc__": description.advice, "__module__": __name__})
    cls.__qualname__ = description.config
    _MADE[description.name] = cls
    return cls


_MADE: Dict[str, type] = {}

_BUILTIN: Dict[str, type] = {}


def _builtin() -> Dict[str, type]:
    """The built-in algorithms' settings objects (OkTopk, TopkA, GTopk, SparDL, TopkDSA,
    Gaussiank, Dense) by algorithm name, made from their descriptions on first use: each
    algorithm's file is where its options are written."""
    if not _BUILTIN:
        from .algorithms import descriptions
        _BUILTIN.update({n: settings_class(d) for n, d in descriptions(builtin=True).items()})
    return _BUILTIN


def __getattr__(name: str) -> Any:
    """``CONFIGS`` (``{name: settings object}`` of the built-in algorithms), each settings
    object by its class name (``config.OkTopk``), and ``__all__``."""
    if name == "CONFIGS":
        return _builtin()
    if name == "__all__":
        return _STATIC + [c.__name__ for c in _builtin().values()]
    if name[:1].isupper():          # a settings object's class name (not __path__ and the like)
        for cls in _builtin().values():
            if cls.__name__ == name:
                return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
    d = _get_algorithm(algorithm).description
    return settings_class(d)() if d is not None else Registered(registered=algorithm.lower())


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
