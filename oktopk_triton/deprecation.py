"""The old keyword spellings of the fronts, translated to the settings objects (one version).

``SparseAllreduce(..., sync_every=4, momentum=0.9)`` was how local steps and an algorithm's
options were passed; they are now ``local_steps=LocalSteps(sync_every=4)`` and
``algorithm=OkTopk(momentum=0.9)`` (:mod:`oktopk_triton.config`). :func:`old_keywords` wraps a
front's ``__init__``: the old keywords still work, each with a ``DeprecationWarning`` naming
its new spelling, and ``inspect.signature`` shows the clean ``__init__``. :func:`split_options`
is the translation itself (no warning), for code that builds a front from a dict of options.
:data:`MOVED_MODULES`: modules that moved into a subpackage, importable by their old names with a
``DeprecationWarning`` (:func:`install_moved_modules`, run when the package is imported).
"""
from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.abc
import importlib.util
import inspect
import sys
import warnings
from typing import Any, Callable, Dict, Mapping, Optional, Tuple, Union

from .config import DEFAULT_ALGORITHM, AlgorithmConfig, LocalSteps, Registered, as_config

__all__ = ["old_keywords", "split_options", "LOCAL_STEP_KEYWORDS", "MOVED_MODULES",
           "install_moved_modules"]

LOCAL_STEP_KEYWORDS = tuple(f.name for f in dataclasses.fields(LocalSteps))


def split_options(algorithm: Union[str, AlgorithmConfig], options: Mapping[str, Any],
                  local_steps: Optional[LocalSteps] = None, owner: str = "SparseAllreduce"
                  ) -> Tuple[AlgorithmConfig, Optional[LocalSteps]]:
    """The algorithm object and the local steps that ``algorithm`` and the old keywords
    ``options`` (an algorithm's settings and the local-step ones) spell; an unknown name raises
    the algorithm's one-line ``TypeError``."""
    steps = {k: v for k, v in options.items() if k in LOCAL_STEP_KEYWORDS}
    rest = {k: v for k, v in options.items() if k not in LOCAL_STEP_KEYWORDS}
    config = as_config(algorithm)
    if rest:
        config = config.replace(**rest)
    if steps:
        if local_steps is not None:
            raise TypeError(f"{owner}: pass local_steps=LocalSteps(...) or the old keywords "
                            f"{sorted(steps)}, not both")
        local_steps = LocalSteps(**steps)
    return config, local_steps


def _new_spelling(key: str, value: Any, config: AlgorithmConfig) -> str:
    if key in LOCAL_STEP_KEYWORDS:
        return f"local_steps=LocalSteps({key}={value!r})"
    if isinstance(config, Registered) and key in config.extra:
        return f"algorithm=Registered(registered={config.registered!r}, extra={{{key!r}: " \
               f"{value!r}}})"
    return f"algorithm={type(config).__name__}({key}={value!r})"


def old_keywords(owner: str, refuse_local_steps: Optional[str] = None) -> Callable:
    """Decorate a front's clean ``__init__`` (which takes ``algorithm`` and, where local steps
    apply, ``local_steps``): keywords it does not take are read as the old spellings, merged
    into ``algorithm`` / ``local_steps`` (:func:`split_options`), each warned about, and the
    clean ``__init__`` is called. ``refuse_local_steps``: the one-line ``ValueError`` of a
    front that cannot take local steps (``{names}`` is filled in)."""
    def decorate(init: Callable) -> Callable:
        sig = inspect.signature(init)

        @functools.wraps(init)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> None:
            old: Dict[str, Any] = {k: kwargs.pop(k) for k in list(kwargs)
                                   if k not in sig.parameters}
            if not old:
                return init(self, *args, **kwargs)
            steps = sorted(set(old) & set(LOCAL_STEP_KEYWORDS))
            if steps and refuse_local_steps is not None:
                raise ValueError(refuse_local_steps.format(names=steps))
            bound = sig.bind_partial(self, *args, **kwargs)
            given = bound.arguments
            config, local_steps = split_options(
                given.get("algorithm", sig.parameters["algorithm"].default) or DEFAULT_ALGORITHM,
                old, given.get("local_steps"), owner)
            for key, value in old.items():
                warnings.warn(f"{owner}(..., {key}={value!r}) is deprecated: use "
                              f"{_new_spelling(key, value, config)}", DeprecationWarning,
                              stacklevel=2)
            given["algorithm"] = config
            if local_steps is not None:
                given["local_steps"] = local_steps
            return init(*bound.args, **bound.kwargs)
        return wrapper
    return decorate


# old module name -> where it lives now (one version: imported by the old name, it warns)
MOVED_MODULES = {
    **{f"oktopk_triton.{m}": f"oktopk_triton.modes.{m}" for m in (
        "local_steps", "updates", "frozen_adam", "density_schedule", "moments", "realign",
        "flat_params", "graph", "ledger")},
    "oktopk_triton.front_state": "oktopk_triton.modes.state",
    **{f"oktopk_triton.ddp_{m}": f"oktopk_triton.ddp.{m}" for m in (
        "flat", "bucket", "layout", "reduce")},
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports a moved module by its old name: the module at its new place (one object, so
    classes and pickles stay the same), with a ``DeprecationWarning`` naming the new place."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name not in MOVED_MODULES:
            return None
        return importlib.util.spec_from_loader(name, self)

    def create_module(self, spec: Any) -> Any:
        new = MOVED_MODULES[spec.name]
        warnings.warn(f"{spec.name} moved to {new}: import it from there (the old name goes "
                      f"in the next version)", DeprecationWarning, stacklevel=2)
        module = importlib.import_module(new)
        self._spec = module.__spec__          # the import then sets the old name's spec on it
        return module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self._spec


def install_moved_modules() -> None:
    """Put the finder of :data:`MOVED_MODULES` on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
        sys.meta_path.append(_MovedModules())
