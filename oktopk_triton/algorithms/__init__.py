"""One file per algorithm, all keeping the step contract of :mod:`.base` (docs/algorithms.md §1).

``get_algorithm(name)`` returns the class; files are imported on first use.
"""
from __future__ import annotations

import importlib

from .base import Algorithm

# name -> "module:Class" (relative to this package)
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

__all__ = ["Algorithm", "REGISTRY", "SPARSE_ALGORITHMS", "get_algorithm", "available_algorithms"]


def get_algorithm(name: str) -> type:
    if not isinstance(name, str) or name.lower() not in REGISTRY:
        raise ValueError(f"unknown algorithm {name!r}; choose one of {sorted(REGISTRY)}")
    mod, cls = REGISTRY[name.lower()].split(":")
    return getattr(importlib.import_module(f".{mod}", __name__), cls)


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
