"""The checks of every setting, one home: an algorithm's (the common ones and each built-in
algorithm's own), the local steps', the density.

Each rule is ``(accepts, expected)``; a value it refuses raises a one-line ``ValueError``
``"{owner}: {field} must be {expected}, got {value!r}"``. The settings objects of
:mod:`oktopk_triton.config` check through it when they are built, and so do the algorithms
(``Algorithm.__init__``) and the local-step components when they are built from keywords.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Dict, Mapping, Tuple

__all__ = ["COMMON", "COMMON_RULES", "ALGORITHM_RULES", "LOCAL_STEPS_RULES", "check_density",
           "check_options", "check_backend", "check_local_steps", "refuse_unknown"]

Rule = Tuple[Callable[[Any], bool], str]       # (accepts the value, what is expected)


# -- the predicates the rules are made of ---------------------------------------------------------
def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _real(x: Any) -> bool:
    return _number(x) and math.isfinite(x)


def _int(lo: int) -> Callable[[Any], bool]:
    return lambda x: isinstance(x, int) and not isinstance(x, bool) and x >= lo


def _at_least_one(x: Any) -> bool:
    try:
        return float(x) >= 1.0
    except (TypeError, ValueError):
        return False


def _one_of(*values: Any) -> Rule:
    return (lambda x: x in values), f"one of {values}"


def _backend(x: Any) -> bool:
    from .kernels import BACKENDS
    return x in BACKENDS


_BACKEND: Rule = (_backend, "one of ('auto', 'triton', 'torch')")

# the settings every algorithm takes (the algorithms' own come with their objects below)
COMMON_RULES: Dict[str, Rule] = {
    "momentum": (lambda x: _number(x) and 0.0 <= float(x) < 1.0, "a float in [0, 1)"),
    "warmup_steps": (_int(0), "an int >= 0"),
}
COMMON = ("check_finite", "density", "device", "momentum", "momentum_masking", "warmup_steps",
          "wire_format")

# each built-in algorithm's own settings (the fields of its object in oktopk_triton.config)
ALGORITHM_RULES: Dict[str, Dict[str, Rule]] = {
    "oktopk": {
        "volume_budget": (lambda x: x is None or (isinstance(x, (int, float)) and x > 0),
                          "a positive number or None"),
        "capacity_split": (lambda x: isinstance(x, (int, float)) and 0 < x < 1, "in (0, 1)"),
        "stage_factor": (lambda x: isinstance(x, (int, float)) and x >= 1, ">= 1"),
        "threshold_sample": (_int(0), "an int >= 0"),
        "row_threshold": _one_of("rank", "region"),
        "wire_dtype": _one_of("fp32", "bf16"),
        "region_span": (lambda x: x in ("auto", None) or (_number(x) and x >= 1),
                        "'auto', None or a number >= 1 (the widest region as a multiple of n/P)"),
        "backend": _BACKEND,
        "complete_sums": (lambda x: isinstance(x, bool), "True or False"),
        "consistency": (lambda x: _number(x) and 0 <= x < 1,
                        "a number in [0, 1) (the sign EMA's decay; 0: rank by |acc|)"),
    },
    "topka": {"backend": _BACKEND},
    "gtopk": {"backend": _BACKEND},
    "spardl": {"teams": (_int(1), "a positive int")},
    "topkdsa": {
        "tau": (lambda x: isinstance(x, int) and x >= 1, "a positive int"),
        "slack": (_at_least_one, ">= 1"),
        "gather_slack": (_at_least_one, ">= 1"),
        "fill": (lambda x: _number(x) and 0.0 < x <= 1.0, "in (0, 1]"),
    },
    "gaussiank": {
        "slack": (_at_least_one, ">= 1"),
        "iters": (lambda x: isinstance(x, int) and x >= 0, "an int >= 0"),
        "lo": (lambda x: _number(x) and 0.0 < x <= 1.0, "in (0, 1] (0 < lo <= 1 <= hi)"),
        "hi": (lambda x: _number(x) and x >= 1.0, ">= 1 (0 < lo <= 1 <= hi)"),
        "backend": _BACKEND,
    },
}

LOCAL_STEPS_RULES: Dict[str, Rule] = {
    "sync_every": (_int(1), "a positive int (optimizer steps per sync)"),
    "outer_lr": (lambda x: _real(x) and x > 0, "a finite number > 0"),
    "outer_momentum": (lambda x: _real(x) and 0.0 <= x < 1.0, "a number in [0, 1)"),
    "residual_decay": (lambda x: _real(x) and 0.0 < x <= 1.0, "a number in (0, 1]"),
    "moment_sync_every": (_int(0), "an int >= 1 (syncs between moment averagings; 0 turns it "
                                   "off)"),
    "moment_sync": _one_of("both", "second"),
    "moment_dtype": _one_of("fp32", "bf16"),
    "moment_realign": (lambda x: _real(x) and 0.0 <= x <= 1.0,
                       "a number in (0, 1] (0 turns it off)"),
}


def _check(owner: str, rules: Mapping[str, Rule], values: Mapping[str, Any]) -> None:
    for field, value in values.items():
        rule = rules.get(field)
        if rule is not None and not rule[0](value):
            raise ValueError(f"{owner}: {field} must be {rule[1]}, got {value!r}")


def check_density(density: Any, owner: str = "") -> float:
    """``density`` as a float in (0, 1], or a one-line ``ValueError`` (naming ``owner``)."""
    if not _number(density) or not 0.0 < float(density) <= 1.0:
        raise ValueError(f"{owner + ': ' if owner else ''}density must be in (0, 1], "
                         f"got {density!r}")
    return float(density)


def refuse_unknown(name: str, given: Any, own: Any) -> None:
    """A one-line ``TypeError`` naming the options of ``given`` that ``name`` does not take."""
    unknown = sorted(set(given) - set(own))
    if unknown:
        raise TypeError(f"{name}: unknown option(s) {unknown}; its own options: "
                        f"{sorted(own) or 'none'}; every algorithm's: {list(COMMON)}")


def check_options(name: str, values: Mapping[str, Any]) -> None:
    """Check algorithm ``name``'s settings (the common ones and its own, by field name): what
    an algorithm object checks when it is built, and an algorithm built from keywords."""
    _check(name, {**COMMON_RULES, **ALGORITHM_RULES.get(name, {})}, values)
    if name == "oktopk" and values.get("wire_dtype") == "bf16" \
            and values.get("wire_format", "fp32") != "fp32":
        raise ValueError(f"oktopk: wire_dtype='bf16' does not combine with "
                         f"wire_format={values['wire_format']!r} (it packs the values itself)")


def check_backend(name: str, backend: Any) -> None:
    """The ``backend`` option's check (also for a registered algorithm that takes one)."""
    _check(name, {"backend": _BACKEND}, {"backend": backend})


def check_local_steps(**values: Any) -> None:
    """Check local-step settings by field name (``config.LocalSteps``'s checks)."""
    _check("LocalSteps", LOCAL_STEPS_RULES, values)
