"""One file per algorithm, all keeping the step contract of :mod:`.base` (docs/algorithms.md §1).

``get_algorithm(name)`` returns the class; files are imported on first use.
``register_algorithm(name, cls)`` adds an algorithm defined outside the package.
"""
from __future__ import annotations

import importlib

from .base import Algorithm

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
SPARSE_ALGORITHMS = ("oktopk", "topka", "gtopk", "spardl", "topkdsa", "gaussiank")

__all__ = ["Algorithm", "REGISTRY", "SPARSE_ALGORITHMS", "get_algorithm", "available_algorithms",
           "register_algorithm"]
_BUILTIN = frozenset(REGISTRY)


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
