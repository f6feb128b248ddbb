"""What one steady step of an algorithm puts on the wire: a list of :class:`CollectiveSpec`.

Every algorithm class has a classmethod ``schedule(n, k, P, **options) -> list[CollectiveSpec]``,
one spec per communicator call of one steady step of one rank, in the order the step issues
them (the same calls that ``collectives_issued`` counts). The cost model of
``oktopk-bench project`` prices these lists; ``tests/test_schedule.py`` checks them against the
traffic a recording communicator sees, for every algorithm at P = 2..16.

Measured why: docs/research/design-notes.md, ``oktopk_triton/algorithms/schedule.py``.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Dict, List, Optional, Sequence

from ..comm.base import ring_allreduce_bytes
from . import _wire as W

__all__ = ["CollectiveSpec", "KINDS", "resolve_options", "allreduce", "allgather", "alltoall",
           "broadcast", "send_recv", "flag_specs", "dense_step_specs", "total_bytes",
           "total_rounds", "critical", "schedule_of", "bytes_per_step", "density_for_bytes"]

KINDS = ("send_recv", "allgather", "allreduce", "alltoall", "broadcast")
_INT32 = 4

# base-class options that a schedule accepts (besides the class's OPTIONS)
_BASE_OPTIONS = ("check_finite", "dtype", "rank", "warmup_steps", "momentum",
                 "momentum_masking", "device", "wire_format")
_DTYPE_BYTES = {"fp32": 4, "float32": 4, "float": 4, "bf16": 2, "bfloat16": 2, "fp16": 2,
                "float16": 2, "half": 2}


@dataclasses.dataclass(frozen=True)
class CollectiveSpec:
    """One communicator call of a step (see the module docstring for each field)."""

    kind: str
    bytes_per_rank: int
    rounds: int
    peers: int
    data_dependent: int = 0
    recv_bytes: Optional[int] = None

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"CollectiveSpec: kind must be one of {KINDS}, got {self.kind!r}")
        if self.bytes_per_rank < 0 or not 0 <= self.data_dependent <= self.bytes_per_rank:
            raise ValueError(f"CollectiveSpec: need 0 <= data_dependent <= bytes_per_rank, got "
                             f"{self.data_dependent} and {self.bytes_per_rank}")

    @property
    def min_bytes(self) -> int:
        """The fewest bytes the call can count (``bytes_per_rank - data_dependent``)."""
        return self.bytes_per_rank - self.data_dependent

    @property
    def received(self) -> int:
        """Bytes this rank receives in a ``send_recv`` (the same as sent unless stated)."""
        return self.bytes_per_rank if self.recv_bytes is None else self.recv_bytes


# -- options ------------------------------------------------------------------------------------
def _dtype_bytes(dtype: Any) -> int:
    if dtype is None:
        return 4
    size = getattr(dtype, "itemsize", None)
    if isinstance(size, int):
        return size
    key = str(dtype).lower().replace("torch.", "")
    if key not in _DTYPE_BYTES:
        raise ValueError(f"schedule: unknown gradient dtype {dtype!r}")
    return _DTYPE_BYTES[key]


def resolve_options(cls, n: int, k: int, P: int, options: Dict[str, Any],
                    extra: Sequence[str] = ()) -> Dict[str, Any]:
    """Check the arguments like the constructor does; return the class's options merged with
    its defaults, plus the schedule-only names in ``extra`` (None when not given),
    ``check_finite`` (normalised), ``grad_bytes`` (element size of the gradient) and ``rank``."""
    for name, v in (("n", n), ("k", k), ("P", P)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{cls.name}.schedule: {name} must be a positive int, got {v!r}")
    if k > n:
        raise ValueError(f"{cls.name}.schedule: k={k} exceeds n={n}")
    own = dict(getattr(cls, "OPTIONS", {}))
    extra = set(extra)
    unknown = sorted(set(options) - set(own) - set(_BASE_OPTIONS) - extra)
    if unknown:
        raise TypeError(f"{cls.name}.schedule: unknown option(s) {unknown}; known options: "
                        f"{sorted(set(own) | set(_BASE_OPTIONS) | extra)}")
    o = {**own, **{key: None for key in extra},
         **{key: v for key, v in options.items() if key in own or key in extra}}
    cf = options.get("check_finite", "skip")
    if cf is True:
        cf = "skip"
    elif cf is False or cf is None:
        cf = "off"
    if cf not in ("skip", "raise", "off"):
        raise ValueError(f"{cls.name}.schedule: check_finite must be skip, raise or off, got "
                         f"{cf!r}")
    o["check_finite"] = cf
    o["grad_bytes"] = _dtype_bytes(options.get("dtype"))
    o["wire_format"] = options.get("wire_format", "fp32")
    o["compact"] = cls.check_wire(o["wire_format"])
    rank = options.get("rank")
    if rank is not None and not (isinstance(rank, int) and 0 <= rank < P):
        raise ValueError(f"{cls.name}.schedule: rank must be None or in [0, {P}), got {rank!r}")
    o["rank"] = rank
    return o


# -- one spec per primitive, bytes as comm/base.py counts them ------------------------------------
def allreduce(nbytes: int, P: int) -> CollectiveSpec:
    return CollectiveSpec("allreduce", ring_allreduce_bytes(nbytes, P), 2 * (P - 1), P - 1)


def allgather(chunk_bytes: int, P: int, data_dependent: int = 0) -> CollectiveSpec:
    """``data_dependent``: of the (P−1)·chunk bytes counted."""
    return CollectiveSpec("allgather", (P - 1) * chunk_bytes, P - 1, P - 1, data_dependent)


def alltoall(nbytes: int, P: int) -> CollectiveSpec:
    """``nbytes``: the whole input (P equal chunks)."""
    return CollectiveSpec("alltoall", (P - 1) * nbytes // P, P - 1, P - 1)


def broadcast(nbytes: int, P: int, root: bool) -> CollectiveSpec:
    return CollectiveSpec("broadcast", nbytes if root else 0, P - 1, P - 1)


def send_recv(sends: Sequence[int], recvs: Sequence[int], peers: int) -> CollectiveSpec:
    """A batch: ``sends``/``recvs`` list the byte sizes of the messages to/from OTHER ranks."""
    sent, got = int(sum(sends)), int(sum(recvs))
    return CollectiveSpec("send_recv", sent, max(len(sends), len(recvs)), peers,
                          recv_bytes=None if got == sent else got)


def flag_specs(P: int, o: Dict[str, Any]) -> List[CollectiveSpec]:
    """The base class's non-finite flag: one allreduce of one int32 (``check_finite`` on)."""
    return [allreduce(_INT32, P)] if P > 1 and o["check_finite"] != "off" else []


def dense_step_specs(n: int, P: int, o: Dict[str, Any]) -> List[CollectiveSpec]:
    """A dense step of the base class (k >= n, or a warm-up step): flag + fp32 allreduce of n."""
    return flag_specs(P, o) + ([allreduce(4 * n, P)] if P > 1 else [])


def step_start(cls, n: int, k: int, P: int, options: Dict[str, Any]):
    """(resolved options, the specs of a step so far, whether they are the whole step): the
    dense step when k >= n, else the flag, which is all of a step on one rank."""
    o = resolve_options(cls, n, k, P, options)
    if k >= n:
        return o, dense_step_specs(n, P, o), True
    return o, flag_specs(P, o), P == 1


# -- helpers for the cost model and the tests ---------------------------------------------------
def total_bytes(specs: Sequence[CollectiveSpec]) -> int:
    return sum(s.bytes_per_rank for s in specs)


def total_rounds(specs: Sequence[CollectiveSpec]) -> int:
    return sum(s.rounds for s in specs)


def critical(per_rank: Sequence[List[CollectiveSpec]]) -> List[CollectiveSpec]:
    """Of several ranks' lists, the one the step waits for: most rounds, then most bytes
    (sent or received), then the lowest rank."""
    def key(i):
        specs = per_rank[i]
        return (-total_rounds(specs), -sum(max(s.bytes_per_rank, s.received) for s in specs), i)
    return list(per_rank[min(range(len(per_rank)), key=key)])


def schedule_of(name: str, n: int, k: int, P: int, **options: Any) -> List[CollectiveSpec]:
    """``get_algorithm(name).schedule(n, k, P, **options)``."""
    from . import get_algorithm
    return get_algorithm(name).schedule(n, k, P, **options)


def bytes_per_step(name: str, n: int, P: int, density: float, wire_format: str = "fp32",
                   sync_every: int = 1, **options: Any) -> float:
    """Bytes one rank sends per training step: the steady step of ``name`` at ``density``
    (``k = round(density·n)``, as the constructors take it) in ``wire_format``, divided by
    ``sync_every`` (local steps: one sync every H steps). Compare wire formats at equal bytes
    with :func:`density_for_bytes`."""
    k = max(1, min(n, int(round(float(density) * n))))
    if W.packed(wire_format):
        options["wire_format"] = wire_format
    return total_bytes(schedule_of(name, n, k, P, **options)) / int(sync_every)


def density_for_bytes(name: str, n: int, P: int, budget: float, wire_format: str = "fp32",
                      sync_every: int = 1, **options: Any) -> float:
    """The largest density ``k/n`` whose :func:`bytes_per_step` fits ``budget`` bytes (a step's
    bytes grow with k: bisection over k); ``1/n`` when even one entry does not fit."""
    def fits(k):
        return bytes_per_step(name, n, P, k / n, wire_format, sync_every, **options) <= budget
    lo, hi = 1, n
    if fits(n):
        return 1.0
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo / n
