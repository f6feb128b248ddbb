"""Helpers every benchmark shares: the source a result came from, the versions it ran with, the
algorithms a command line names and byte counts for tables. One home each, so every result
JSON records its commit the same way (through :mod:`oktopk_triton.bench.records`)."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Optional, Sequence, Tuple

# git is asked from the package's own folder: inside a checkout it answers for that checkout,
# outside one (an installed wheel) it does not answer and the commit is None
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def git_commit(short: bool = False) -> Optional[str]:
    """HEAD of the checkout the package runs from, with ``-dirty`` when tracked files differ
    from it; ``None`` outside a checkout or without git."""
    try:
        args = ["git", "rev-parse"] + (["--short"] if short else []) + ["HEAD"]
        head = subprocess.run(args, cwd=_PACKAGE_DIR, capture_output=True, text=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=_PACKAGE_DIR, capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except Exception:  # noqa: BLE001 - no git, not a checkout
        return None


def versions(modules=("torch", "triton", "numpy", "cupy", "oktopk_triton")
             ) -> Dict[str, Optional[str]]:
    """Python's and each module's version (``None`` when it does not import)."""
    out: Dict[str, Optional[str]] = {"python": sys.version.split()[0]}
    for mod in modules:
        try:
            out[mod] = getattr(__import__(mod), "__version__", None)
        except Exception:  # noqa: BLE001 - an optional module
            out[mod] = None
    return out


def resolve_algorithms(names: Sequence[str], command: str, *,
                       everything: Optional[Sequence[str]] = None, extra: Sequence[str] = (),
                       implemented: bool = True) -> Tuple[List[str], List[Tuple[str, str]]]:
    """(algorithms to run, [(skipped, why)]) from a command line's ``--algorithms``: lowered,
    in order, once each. The one home of algorithm names for every benchmark.

    1. ``all`` stands for ``everything`` (default: every registered algorithm, dense first).
    2. ``extra``: names a command runs besides the registry's (train's baselines), only when
       named (never in ``all``), after the registry's.
    3. ``implemented``: a registered algorithm whose module does not import is skipped with why;
       False keeps every registered name (the cost model prices algorithms, it does not run them).

    An unknown name exits with one line naming the choices."""
    from ..algorithms import REGISTRY, available_algorithms
    lowered = [x.lower() for x in names]
    if "all" in lowered:
        lowered = [*(everything if everything is not None else REGISTRY),
                   *(x for x in lowered if x in extra)]
    avail = available_algorithms() if implemented else list(REGISTRY)
    run: List[str] = []
    skipped: List[Tuple[str, str]] = []
    for a in lowered:
        if a not in REGISTRY and a not in extra:
            raise SystemExit(f"oktopk-bench {command}: unknown algorithm {a!r}; choose from "
                             f"{sorted(REGISTRY) + list(extra)} or 'all'")
        if a in REGISTRY and a not in avail:
            skipped.append((a, "not implemented yet (its module did not import)"))
        elif a not in run:
            run.append(a)
    return [a for a in run if a not in extra] + [a for a in run if a in extra], skipped


def fmt_bytes(b: float, digits: int = 1) -> str:
    """``b`` bytes as a short human string with ``digits`` decimals: ``512 B``, ``12.3 kB``,
    ``4.2 MB``, ``1.1 GB`` (``n/a`` for NaN)."""
    if b != b:  # nan
        return "n/a"
    for unit, f in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(b) >= f:
            return f"{b / f:.{digits}f} {unit}"
    return f"{b:.0f} B"


def nccl_version_text(v) -> Optional[str]:
    """An NCCL version (a tuple, or NCCL_VERSION_CODE as an int) as ``major.minor.patch``."""
    if v is None:
        return None
    if isinstance(v, (tuple, list)):
        return ".".join(str(int(x)) for x in v)
    v = int(v)
    if v >= 20900:  # NCCL_VERSION_CODE = major*10000 + minor*100 + patch since 2.9
        return f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
    return f"{v // 1000}.{(v % 1000) // 100}.{v % 100}"
