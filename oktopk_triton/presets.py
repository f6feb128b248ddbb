"""Presets: the measured recommendations by name, and :func:`recommend` to choose among them.

    from oktopk_triton import SparseAllreduce, recommend

    sar = SparseAllreduce(model.parameters(), preset="transformer")   # then reduce_updates(opt)
    sar = SparseAllreduce(model.parameters(), preset=recommend(optimizer=opt, bytes=0.002))

A :class:`Preset` is an algorithm object, a sync interval and a byte budget (a fraction of a
dense fp32 allreduce's bytes per step); the density is solved from the budget for the model's
size and the world size (:func:`~oktopk_triton.algorithms.schedule.density_for_bytes`), so a
preset sends the same share of dense's bytes at any P. Building a reducer from one logs one
line: what it chose, the density, and what was measured with it (the records in ``evidence``).

- ``sgd``: SGD-trained models (CNNs), ``reduce_gradients``; Ok-Topk with the momentum in the
  reducer, every step, 2% of dense's bytes.
- ``transformer``: AdamW under 16 ranks, ``reduce_updates``; TopkA on the 2-bit wire, every 4
  steps, 2%.
- ``transformer-lean``: the same at 0.2%, every 2 steps.
- ``many-ranks``: AdamW on 16 ranks and more; Ok-Topk on the 2-bit wire with complete sums and
  consistency 0.9, every 2 steps, 0.45%.

Each transformer preset was checked on a second, untuned transformer (docs/usage.md#presets).
DiLoCo presets (:data:`DILOCO_PRESETS`, :func:`recommend_diloco`; for ``SparseDiLoCo``) set a
budget as a fraction of DiLoCo's dense sync.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any, Optional, Tuple, Union

from .config import AlgorithmConfig, LocalSteps, OkTopk, TopkA

__all__ = ["Preset", "PRESETS", "recommend", "as_preset", "from_preset", "for_hook", "group_size",
           "DILOCO_PRESETS", "recommend_diloco", "diloco_preset"]

log = logging.getLogger("oktopk_triton.presets")

_ADAPTIVE = ("adam", "adamw", "adagrad", "adafactor", "lamb", "lion", "rmsprop", "adamax",
             "nadam", "radam", "sparseadam")


@dataclasses.dataclass(frozen=True)
class Preset:
    """One measured recommendation. Build a reducer with ``SparseAllreduce(params,
    preset=p)``; :meth:`with_bytes` sets another budget (outside what was measured: the log says
    so).

    Fields: ``algorithm`` (an object of :mod:`oktopk_triton.config`), ``sync_every`` (local
    steps; > 1 needs ``reduce_updates``), ``bytes`` (fraction of dense's bytes per step),
    ``reduce`` (``"gradients"`` or ``"updates"``: the call to make), ``measured`` (what the
    records show, one line), ``evidence`` (the records, paths in the repository),
    ``measured_bytes`` (the budget the records used).
    """

    name: str
    algorithm: AlgorithmConfig
    sync_every: int
    bytes: float
    reduce: str
    measured: str
    evidence: Tuple[str, ...]
    measured_bytes: float = 0.0
    residual_decay: float = 1.0
    diloco: bool = False

    def __post_init__(self) -> None:
        if not 0.0 < float(self.bytes) <= 1.0:
            raise ValueError(f"Preset {self.name!r}: bytes must be a fraction of dense's bytes "
                             f"in (0, 1], got {self.bytes!r}")
        if self.reduce not in ("gradients", "updates"):
            raise ValueError(f"Preset {self.name!r}: reduce must be 'gradients' or 'updates', "
                             f"got {self.reduce!r}")
        if not self.measured_bytes:
            object.__setattr__(self, "measured_bytes", float(self.bytes))

    def with_bytes(self, fraction: float) -> "Preset":
        """The same preset at another budget (fraction of dense's bytes per step)."""
        return dataclasses.replace(self, bytes=fraction)       # measured_bytes is kept

    def local_steps(self) -> Optional[LocalSteps]:
        """The :class:`LocalSteps` the preset syncs with (``None``: every step)."""
        if self.sync_every == 1 and self.residual_decay == 1.0:
            return None
        return LocalSteps(sync_every=self.sync_every, residual_decay=self.residual_decay)

    def density(self, numel: int, world_size: int) -> float:
        """The density that sends ``bytes`` of dense's bytes per step, for ``numel`` entries on
        ``world_size`` ranks (the algorithm's own schedule, headers included)."""
        from .algorithms.schedule import bytes_per_step, density_for_bytes
        P = max(1, int(world_size))
        if P == 1:            # nothing is sent: the density of the smallest world it was set for
            P = 2
        options = dict(self.algorithm.options())
        wire = options.pop("wire_format")
        budget = float(self.bytes) * bytes_per_step("dense", int(numel), P, 1.0)
        return density_for_bytes(self.algorithm.algorithm, int(numel), P, budget, wire,
                                 self.sync_every, **options)

    def describe(self, numel: int, world_size: int, density: Optional[float] = None) -> str:
        """The one line logged when a reducer is built from this preset (``density``: the
        one :meth:`density` gives, where the caller has it already)."""
        d = self.density(numel, world_size) if density is None else density
        off = ("" if abs(self.bytes - self.measured_bytes) <= 1e-12 else
               f" (measured at {100 * self.measured_bytes:g}%: this budget is outside it)")
        if self.diloco:
            decay = "" if self.residual_decay == 1.0 else \
                f", residual decay {self.residual_decay:g}"
            return (f"preset {self.name}: {type(self.algorithm).__name__}"
                    f"({_settings(self.algorithm)}), density {d:.4g} = {100 * self.bytes:g}% of "
                    f"DiLoCo's dense sync, n={numel}{decay}{off}; measured: {self.measured}")
        sync = "every step" if self.sync_every == 1 else f"every {self.sync_every} steps"
        return (f"preset {self.name}: {type(self.algorithm).__name__}"
                f"({_settings(self.algorithm)}), {sync}, density {d:.4g} = "
                f"{100 * self.bytes:g}% of dense's bytes at P={world_size}, n={numel}{off}; "
                f"call reduce_{self.reduce}; measured: {self.measured}")


def _settings(config: AlgorithmConfig) -> str:
    """The fields of ``config`` that differ from the defaults, as ``a=1, b='x'``."""
    default = type(config)()
    return ", ".join(f"{f.name}={getattr(config, f.name)!r}"
                     for f in dataclasses.fields(config)
                     if getattr(config, f.name) != getattr(default, f.name))


_LS = "bench/results/lm/local-steps/"
_CHECK = "bench/results/lm/presets/"


def _checked(stem: str, rival: str) -> Tuple[str, ...]:
    """A transformer preset's records: its three seeds on the 4m GPT, its run on the untuned
    480k GPT beside dense's, and the rival (Ok-Topk at the same bytes) on both models."""
    seeds = (_LS + stem.format("4m") + s + ".json" for s in ("", "-s1", "-s2"))
    return (*seeds, _CHECK + stem.format("480k") + ".json", _CHECK + "dense-480k.json",
            _CHECK + rival.format("480k") + ".json", _LS + rival.format("4m") + ".json")
PRESETS = {
    "sgd": Preset(
        "sgd", OkTopk(momentum=0.9), 1, 0.02, "gradients",
        "digits CNN, 4 ranks, 10 seeds: 98.69 +- 0.37% test accuracy, dense 98.62 +- 0.52%",
        ("bench/results/train/train-digits-d0.01-oktopk-seeds10-2026-11-25.json",
         "bench/results/train/train-digits-d0.01-oktopk-seeds3-2026-11-26.json")),
    "transformer": Preset(
        "transformer", TopkA(wire_format="q2"), 4, 0.02, "updates",
        "AdamW, 4 ranks, 3 seeds: 1.24x dense's steps on the 4m GPT (1200 steps), 1.81x on the "
        "untuned 480k GPT (600 steps); Ok-Topk at the same bytes 1.29x and 1.92x",
        _checked("topka-{}-H4-d0.071-q2", "oktopk-{}-H4-d0.08-compact")),
    "transformer-lean": Preset(
        "transformer-lean", TopkA(wire_format="q2"), 2, 0.002, "updates",
        "AdamW, 4 ranks, 3 seeds: 1.46x dense's steps on the 4m GPT (1200 steps), 2.49x on the "
        "untuned 480k GPT (600 steps); Ok-Topk at the same bytes 1.91x and 2.66x",
        _checked("topka-{}-H2-d0.0034-q2", "oktopk-{}-H4-d0.0138-q2")),
    "many-ranks": Preset(
        "many-ranks", OkTopk(wire_format="q2", complete_sums=True, consistency=0.9), 2, 0.0045,
        "updates",
        "AdamW, 64 ranks, 320 steps: ahead of TopkA's best at 0.2 of its bytes (1m GPT, "
        "3 seeds; 4m GPT, 2 seeds; the untuned 480k GPT at the 4m GPT's density, 1 seed)",
        ("bench/results/quality-at-scale/p64-gpt4m-oktopk-H2-d0.0142-complete-cons0.9-s0-span-"
         "320steps.json",
         "bench/results/quality-at-scale/p64-gpt4m-oktopk-H2-d0.0142-complete-cons0.9-s1-span-"
         "320steps.json",
         "bench/results/quality-at-scale/p64-gpt4m-topka-H2-d0.0025-s0-320steps.json",
         "bench/results/quality-at-scale/p64-gpt1m-oktopk-H2-d0.0142-complete-s0-span-"
         "320steps.json")),
}

_DL = "bench/results/lm/diloco/"

# SparseDiLoCo's presets: ``bytes`` is a fraction of DiLoCo's dense sync (sync_every 1: per sync)
DILOCO_PRESETS = {
    "diloco": Preset(
        "diloco", OkTopk(wire_format="q2"), 1, 0.10, "updates",
        "1m GPT, AdamW inner, 4 ranks, H=15, DiLoCo's Nesterov 0.7/0.9 (served at 0.5), 3 "
        "seeds: 2.416 nats/byte against DiLoCo's 2.628 with the same optimizer",
        tuple(_DL + f + s + ".json" for f in ("oktopk-1m-H15-d0.1774-q2-nesterov0.5",
                                              "dense-1m-H15-nesterov0.9")
              for s in ("", "-s1", "-s2")), diloco=True),
    "diloco-lean": Preset(
        "diloco-lean", TopkA(wire_format="q2"), 1, 0.0176, "updates",
        "SparseLoCo's regime, 1m GPT, AdamW inner, 4 ranks, H=15: 2.521 nats/byte with DiLoCo's "
        "Nesterov served at 0.5 (seed 0), 2.521 and 2.502 with plain SGD (seeds 0, 1), DiLoCo "
        "2.612 and 2.561; TopkA's bytes grow with the replicas (an allgather): solved for 4",
        (_DL + "topka-1m-H15-d0.0156-q2-decay0.95-nesterov0.5.json",
         _DL + "topka-1m-H15-d0.0156-q2-decay0.95-sgd1.json",
         _DL + "topka-1m-H15-d0.0156-q2-decay0.95-sgd1-s1.json",
         _DL + "dense-1m-H15-nesterov0.9.json", _DL + "dense-1m-H15-nesterov0.9-s1.json"),
        residual_decay=0.95, diloco=True),
}

# the world size a DiLoCo preset's density is solved for: a SparseDiLoCo reducer is built
# before its first quorum (Ok-Topk's bytes per entry on the 2-bit wire barely depend on P)
DILOCO_SOLVE_P = 4

MANY_RANKS = 16          # from this world size on, Ok-Topk's flat bytes beat TopkA's allgather


def _optimizer_name(optimizer: Any) -> str:
    if isinstance(optimizer, str):
        return optimizer.lower()
    return type(optimizer).__name__.lower()


def recommend(optimizer: Any = "adamw", bytes: Optional[float] = None,
              world_size: Optional[int] = None) -> Preset:
    """The preset for an optimizer (a name or the optimizer object), a byte budget (fraction of
    dense's bytes per step; default: the preset's own) and a world size (default: the
    initialised process group's, else 1). Logs one line: what it chose and why.

    SGD-like optimizers get ``sgd``; adaptive ones (Adam, AdamW, ...) get ``many-ranks`` from
    16 ranks on, else ``transformer-lean`` for budgets up to 0.5%, else ``transformer``.
    """
    name = _optimizer_name(optimizer)
    if world_size is None:
        import torch.distributed as dist
        world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if int(world_size) < 1:
        raise ValueError(f"recommend: world_size must be >= 1, got {world_size!r}")
    if bytes is not None and not 0.0 < float(bytes) <= 1.0:
        raise ValueError(f"recommend: bytes must be a fraction of dense's bytes in (0, 1], "
                         f"got {bytes!r}")
    adaptive = any(a == name or name.startswith(a) for a in _ADAPTIVE)
    if not adaptive:
        chosen, why = PRESETS["sgd"], "not an adaptive optimizer"
    elif world_size >= MANY_RANKS:
        chosen, why = PRESETS["many-ranks"], f"adaptive, {MANY_RANKS} ranks or more"
    elif bytes is not None and bytes <= 0.005:
        chosen, why = PRESETS["transformer-lean"], "adaptive, a budget of 0.5% or less"
    else:
        chosen, why = PRESETS["transformer"], f"adaptive, under {MANY_RANKS} ranks"
    if bytes is not None:
        chosen = chosen.with_bytes(float(bytes))
    log.info("recommend: %s for %s on %d ranks at %g%% of dense's bytes (%s)", chosen.name,
             name, world_size, 100 * chosen.bytes, why)
    return chosen


def as_preset(preset: Union[str, Preset]) -> Preset:
    """A :class:`Preset` from a name of :data:`PRESETS` or a preset (one-line error else)."""
    if isinstance(preset, Preset) and preset.diloco or \
            isinstance(preset, str) and preset in DILOCO_PRESETS:
        name = preset.name if isinstance(preset, Preset) else preset
        raise ValueError(f"preset {name!r} is a DiLoCo preset (a fraction of DiLoCo's dense "
                         f"sync): use it with SparseDiLoCo(..., preset={name!r})")
    if isinstance(preset, Preset):
        return preset
    if isinstance(preset, str) and preset in PRESETS:
        return PRESETS[preset]
    raise ValueError(f"preset must be one of {sorted(PRESETS)} or a Preset, got {preset!r}")


def from_preset(preset: Union[str, Preset], numel: int, world_size: int, *,
                density: Optional[float] = None, algorithm: Any = None,
                local_steps: Optional[LocalSteps] = None, owner: str = "SparseAllreduce"
                ) -> Tuple[float, AlgorithmConfig, Optional[LocalSteps]]:
    """(density, algorithm, local steps) of ``preset`` for ``numel`` entries on ``world_size``
    ranks, logged in one line; giving any of the three beside a preset is refused in one line."""
    p = as_preset(preset)
    _refuse_beside(owner, p, density=density, algorithm=algorithm, local_steps=local_steps)
    d = p.density(numel, world_size)          # a bisection over k: solved once
    log.info("%s", p.describe(numel, world_size, d))
    return d, p.algorithm, p.local_steps()


def _refuse_beside(owner: str, p: Preset, **settings: Any) -> None:
    """A one-line error when any of ``settings`` (what the preset sets) is given too."""
    given = [name for name, value in settings.items() if value is not None]
    if given:
        names = list(settings)
        raise ValueError(f"{owner}: preset={p.name!r} sets {', '.join(names[:-1])} and "
                         f"{names[-1]}; also got {', '.join(given)}: pass one or the other")


def for_hook(preset: Union[str, Preset], world_size: int, owner: str, *,
             density: Optional[float] = None, algorithm: Any = None
             ) -> Tuple[float, AlgorithmConfig]:
    """(density, algorithm) of a per-step gradient preset for a hook that reduces gradients
    inside ``backward`` (DDP's, FSDP's). The density is solved once, for 2^20 entries at
    ``world_size`` (the hooks build their reducers later, per bucket; Ok-Topk's bytes per entry
    do not depend on n). A preset with local steps is refused in one line."""
    p = as_preset(preset)
    if p.reduce != "gradients":
        raise ValueError(f"{owner}: preset={p.name!r} reduces the optimizer's updates "
                         f"(every {p.sync_every} steps), which a gradient hook cannot: it runs "
                         f"before the optimizer; use SparseAllreduce(params, preset={p.name!r}) "
                         f"with reduce_updates")
    d, config, _ = from_preset(p, 1 << 20, world_size, density=density, algorithm=algorithm,
                               owner=owner)
    return d, config


def group_size(group: Any = None, comm: Any = None) -> int:
    """The world size a hook's preset is solved for: the communicator's, else the process
    group's (the default group's for ``None``), else 1 before any group is initialised."""
    if comm is not None:
        return int(comm.world_size)
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(group)
    return 1


def recommend_diloco(bytes: Optional[float] = None) -> Preset:
    """The DiLoCo preset for a byte budget, a fraction of DiLoCo's dense sync (default: 10%,
    ``diloco``): ``diloco-lean`` for budgets up to 2%, else ``diloco``. Logs one line: what it
    chose and why."""
    if bytes is not None and (isinstance(bytes, bool) or not 0.0 < float(bytes) <= 1.0):
        raise ValueError(f"recommend_diloco: bytes must be a fraction of DiLoCo's dense sync in "
                         f"(0, 1], got {bytes!r}")
    lean = bytes is not None and float(bytes) <= 0.02
    chosen = DILOCO_PRESETS["diloco-lean" if lean else "diloco"]
    if bytes is not None:
        chosen = chosen.with_bytes(float(bytes))
    why = ("a budget of 2% or less: TopkA with decayed error feedback" if lean else
           "Ok-Topk on the 2-bit wire")
    log.info("recommend_diloco: %s at %g%% of DiLoCo's dense sync (%s)", chosen.name,
             100 * chosen.bytes, why)
    return chosen


def as_diloco_preset(preset: Union[str, Preset]) -> Preset:
    """A DiLoCo :class:`Preset` from a name of :data:`DILOCO_PRESETS` or a preset."""
    if isinstance(preset, Preset) and preset.diloco:
        return preset
    if isinstance(preset, str) and preset in DILOCO_PRESETS:
        return DILOCO_PRESETS[preset]
    raise ValueError(f"SparseDiLoCo: preset must be one of {sorted(DILOCO_PRESETS)} or a DiLoCo "
                     f"Preset (recommend_diloco), got {preset!r}")


def diloco_preset(preset: Union[str, Preset], numel: int, *, density: Optional[float] = None,
                  algorithm: Any = None, residual_decay: Optional[float] = None
                  ) -> Tuple[float, AlgorithmConfig, float]:
    """(density, algorithm, residual decay) of a DiLoCo preset for ``numel`` entries, logged in
    one line; giving any of the three beside a preset is refused in one line."""
    p = as_diloco_preset(preset)
    _refuse_beside("SparseDiLoCo", p, density=density, algorithm=algorithm,
                   residual_decay=residual_decay)
    d = p.density(numel, DILOCO_SOLVE_P)
    log.info("SparseDiLoCo: %s", p.describe(numel, DILOCO_SOLVE_P, d))
    return d, p.algorithm, p.residual_decay
