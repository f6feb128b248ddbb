"""One file per algorithm, all keeping the step contract of :mod:`.base` (docs/algorithms.md §1).

``get_algorithm(name)`` returns the class; files are imported on first use.
``register_algorithm(name, cls)`` adds an algorithm defined outside the package.
``description_of(name)`` is what the class says of itself (:mod:`.description`): its options,
their rules, its volume formula and cost entry, which the settings objects, the checks, the
planner and the reports read. A new algorithm is its file plus one line in ``REGISTRY``.
"""
from __future__ import annotations

import importlib

from typing import Any, Dict, Optional

from .base import Algorithm
from .description import Description, Option

# name -> "module:Class" (relative to this package), or the class itself (register_algorithm)
REGISTRY = {
    "dense": "dense:DenseAllreduce",
    "oktopk": "oktopk:OkTopk",
    "topka": "topka:TopkA",
    "gtopk": "gtopk:GTopk",
    "spardl": "spardl:SparDL",
    "topkdsa": "topkdsa:TopkDSA",
    "gaussiank": "gaussiank:Gaussiank",
}

__all__ = ["Algorithm", "Description", "Option", "REGISTRY", "SPARSE_ALGORITHMS", "get_algorithm",
           "available_algorithms", "register_algorithm", "description_of", "find_description",
           "descriptions"]
_BUILTIN = tuple(REGISTRY)


def __getattr__(name: str):
    if name == "SPARSE_ALGORITHMS":       # the built-in sparse ones, in REGISTRY's order
        return tuple(a for a in _BUILTIN if description_of(a).sparse)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def get_algorithm(name: str) -> type:
    if not isinstance(name, str) or name.lower() not in REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(REGISTRY)}")
    entry = REGISTRY[name.lower()]
    if isinstance(entry, type):
        return entry
    mod, cls = entry.split(":")
    return getattr(importlib.import_module(f".{mod}", __name__), cls)


def register_algorithm(name: str, cls: type) -> None:
    """Make ``algorithm=name`` (``SparseAllreduce``, :func:`get_algorithm`) resolve to ``cls``.

    ``cls`` subclasses :class:`Algorithm` and keeps its step contract (docs/algorithms.md §1);
    ``name`` is lower case. Registering a name again replaces the class; a built-in name cannot
    be replaced. The registration lasts for the process.
    """
    if not isinstance(name, str) or not name or name != name.lower():
        raise ValueError(f"algorithm name must be a non-empty lower-case string, got {name!r}")
    if not (isinstance(cls, type) and issubclass(cls, Algorithm)):
        raise TypeError(f"{name}: expected a subclass of Algorithm, got {cls!r}")
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is a built-in algorithm and cannot be replaced")
    REGISTRY[name] = cls


def description_of(name: str) -> Optional[Description]:
    """The description of registered algorithm ``name`` (None for a class without one); an
    unknown name raises the one-line ``ValueError`` of :func:`get_algorithm`."""
    return get_algorithm(name).description


def find_description(name: Any) -> Optional[Description]:
    """:func:`description_of` for a registered ``name``; None for any other name (no error)."""
    return description_of(name) if isinstance(name, str) and name in REGISTRY else None


def descriptions(builtin: bool = False) -> Dict[str, Description]:
    """``{name: description}`` of the registered algorithms that have one (``builtin``: only
    the package's own), in ``REGISTRY``'s order."""
    names = _BUILTIN if builtin else tuple(REGISTRY)
    found = {n: description_of(n) for n in names}
    return {n: d for n, d in found.items() if d is not None}


def available_algorithms() -> list:
    """The registered algorithms whose implementation is present."""
    out = []
    for name in REGISTRY:
        try:
            get_algorithm(name)
        except (ImportError, AttributeError):
            continue
        out.append(name)
    return out
