"""The checks of every setting, one home: the common ones of every algorithm, the local steps',
the density, and the predicates an algorithm's own rules are made of (each algorithm's own rules
live in its description, :mod:`oktopk_triton.algorithms.description`).

Each rule is ``(accepts, expected)``; a value it refuses raises a one-line ``ValueError``
``"{owner}: {field} must be {expected}, got {value!r}"``. The settings objects of
:mod:`oktopk_triton.config` check through it when they are built, and so do the algorithms
(``Algorithm.__init__``) and the local-step components when they are built from keywords.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Tuple

__all__ = ["COMMON", "COMMON_RULES", "LOCAL_STEPS_RULES", "Rule", "BACKEND", "number", "real",
           "int_at_least", "at_least_one", "one_of", "check_density", "check_options",
           "check_backend", "check_local_steps", "refuse_unknown"]

Rule = Tuple[Callable[[Any], bool], str]       # (accepts the value, what is expected)


# -- the predicates the rules are made of ---------------------------------------------------------
def number(x: Any) -> bool:
    """An int or a float (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def real(x: Any) -> bool:
    """A finite :func:`number`."""
    return number(x) and math.isfinite(x)


def int_at_least(lo: int) -> Callable[[Any], bool]:
    """An int (not a bool) >= ``lo``."""
    return lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= lo


def at_least_one(x: Any) -> bool:
    """A value whose float is >= 1."""
    try:
        return float(x) >= 1.0
    except (TypeError, ValueError):
        return False


def one_of(*values: Any) -> Rule:
    """The rule of a choice among ``values``."""
    return (lambda x: x in values), f"one of {values}"


def _backend(x: Any) -> bool:
    from .kernels import BACKENDS
    return x in BACKENDS


BACKEND: Rule = (_backend, "one of ('auto', 'triton', 'torch')")     # the kernels' backend

# the settings every algorithm takes (the algorithms' own come with their descriptions)
COMMON_RULES: Dict[str, Rule] = {
    "momentum": (lambda x: number(x) and 0.0 <= float(x) < 1.0, "a float in [0, 1)"),
    "warmup_steps": (int_at_least(0), "an int >= 0"),
}
COMMON = ("check_finite", "density", "device", "momentum", "momentum_masking", "warmup_steps",
          "wire_format")

LOCAL_STEPS_RULES: Dict[str, Rule] = {
    "sync_every": (int_at_least(1), "a positive int (optimizer steps per sync)"),
    "outer_lr": (lambda x: real(x) and x > 0, "a finite number > 0"),
    "outer_momentum": (lambda x: real(x) and 0.0 <= x < 1.0, "a number in [0, 1)"),
    "residual_decay": (lambda x: real(x) and 0.0 < x <= 1.0, "a number in (0, 1]"),
    "moment_sync_every": (int_at_least(0),
                          "an int >= 1 (syncs between moment averagings; 0 turns it off)"),
    "moment_sync": one_of("both", "second"),
    "moment_dtype": one_of("fp32", "bf16"),
    "moment_realign": (lambda x: real(x) and 0.0 <= x <= 1.0,
                       "a number in (0, 1] (0 turns it off)"),
}


def _check(owner: str, rules: Mapping[str, Rule], values: Mapping[str, Any]) -> None:
    for field, value in values.items():
        rule = rules.get(field)
        if rule is not None and not rule[0](value):
            raise ValueError(f"{owner}: {field} must be {rule[1]}, got {value!r}")


def check_density(density: Any, owner: str = "") -> float:
    """``density`` as a float in (0, 1], or a one-line ``ValueError`` (naming ``owner``)."""
    if not number(density) or not 0.0 < float(density) <= 1.0:
        raise ValueError(f"{owner + ': ' if owner else ''}density must be in (0, 1], "
                         f"got {density!r}")
    return float(density)


def refuse_unknown(name: str, given: Any, own: Any) -> None:
    """A one-line ``TypeError`` naming the options of ``given`` that ``name`` does not take."""
    unknown = sorted(set(given) - set(own))
    if unknown:
        raise TypeError(f"{name}: unknown option(s) {unknown}; its own options: "
                        f"{sorted(own) or 'none'}; every algorithm's: {list(COMMON)}")


def check_options(name: str, values: Mapping[str, Any], description: Any = None) -> None:
    """Check algorithm ``name``'s settings by field name: the common ones, and its own rules
    and its rule across options when it has a ``description``
    (:class:`~oktopk_triton.algorithms.description.Description`): what an algorithm object
    checks when it is built, and an algorithm built from keywords."""
    _check(name, {**COMMON_RULES, **(description.rules() if description else {})}, values)
    if description is not None and description.check is not None:
        description.check(values)


def check_backend(name: str, backend: Any) -> None:
    """The ``backend`` option's check (also for a registered algorithm that takes one)."""
    _check(name, {"backend": BACKEND}, {"backend": backend})


def check_local_steps(**values: Any) -> None:
    """Check local-step settings by field name (``config.LocalSteps``'s checks)."""
    _check("LocalSteps", LOCAL_STEPS_RULES, values)

