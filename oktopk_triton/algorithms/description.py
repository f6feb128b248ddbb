"""What an algorithm is, written once beside its code: its options with their defaults and the
rules they obey, its volume formula, its cost entry and the name reports give it.

An algorithm file ends its class with one :class:`Description`::

    class Halves(Algorithm):
        description = Description(
            name="halves", config="Halves", display="Halves",
            advice="Halves: ... Advice: 1. ``slack`` (default 1.5, >= 1): ...",
            options={"slack": Option(1.5, at_least(1.0), ">= 1")},
            volume=lambda n, k, P, **o: (2.0 * k * (P - 1), 2.0 * k * (P - 1)),
            passes=(40, 0, 1), entry_work=lambda k, P: (0.0, 20.0 * P * k))

and is registered by one line (``REGISTRY`` for a built-in, :func:`register_algorithm` for
one defined elsewhere). Everything else reads the description:

* the class's ``OPTIONS`` (the defaults), ``name`` and ``sparse``;
* the settings object (``oktopk_triton.config``: a frozen dataclass named ``config`` whose
  fields are the options, its docstring ``advice``), and its checks (``Algorithm.__init__``
  checks the same rules when built from keywords);
* the volume formulas (``_sparse.volume_formula_range``), the planner's cost of the selection
  passes (``planning.kernel_costs``) and the reports' display name.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from ..checks import Rule

__all__ = ["Option", "Description"]

Volume = Callable[..., Tuple[float, float]]          # (n, k, P, **options) -> (low, high) words


@dataclasses.dataclass(frozen=True)
class Option:
    """One option: its ``default``, and the rule a value obeys (``accepts`` it, described by
    ``expected`` in the one-line error); ``accepts=None``: any value."""

    default: Any
    accepts: Optional[Callable[[Any], bool]] = None
    expected: str = ""
    annotation: Any = Any                             # the settings object's field type

    def rule(self) -> Optional[Rule]:
        return None if self.accepts is None else (self.accepts, self.expected)


def _no_entry_work(k: int, P: int) -> Tuple[float, float]:
    return (0.0, 0.0)


@dataclasses.dataclass(frozen=True)
class Description:
    """An algorithm described once.

    * ``name``: the registered name (lower case); ``config``: the settings object's class name;
      ``display``: how reports name it; ``advice``: the settings object's docstring.
    * ``options``: its own options (not the common ones), each an :class:`Option`;
      ``check``: a rule across options, ``check(values)`` raising a one-line ``ValueError``.
    * ``volume(n, k, P, **options)``: (low, high) words a rank sends per step by the
      docs/algorithms.md §6 formula, for P > 1 (headers not included).
    * ``passes``: one steady step's (bytes per element of its memory-bound passes over n,
      fused select passes, torch.topk passes over n in fp32 units); ``entry_work(k, P)``: its
      work on the selected entries (elements through a sort or top-k, bytes of scatters).
    * ``sparse``: False for a dense allreduce.
    """

    name: str
    config: str
    display: str
    advice: str
    volume: Volume
    passes: Tuple[float, float, float]
    options: Mapping[str, Option] = dataclasses.field(default_factory=dict)
    entry_work: Callable[[int, int], Tuple[float, float]] = _no_entry_work
    check: Optional[Callable[[Mapping[str, Any]], None]] = None
    sparse: bool = True

    def defaults(self) -> Dict[str, Any]:
        """``{option: default}`` (the algorithm class's ``OPTIONS``)."""
        return {k: o.default for k, o in self.options.items()}

    def rules(self) -> Dict[str, Rule]:
        """``{option: (accepts, expected)}`` for the options that have a rule."""
        return {k: r for k, o in self.options.items() if (r := o.rule()) is not None}
