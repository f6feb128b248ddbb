"""Helpers every benchmark shares: the source a result came from, the versions it ran with, and
the algorithms a command line names. One home each, so every result JSON records its commit the
same way."""
from __future__ import annotations

import os
import subprocess
import sys
from typing import Dict, List, Optional, Tuple

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def git_commit(short: bool = False) -> Optional[str]:
    """HEAD of the checkout the package runs from, with ``-dirty`` when tracked files differ
    from it; ``None`` outside a checkout or without git."""
    try:
        args = ["git", "rev-parse"] + (["--short"] if short else []) + ["HEAD"]
        head = subprocess.run(args, cwd=REPO, capture_output=True, text=True, timeout=10)
        if head.returncode != 0 or not head.stdout.strip():
            return None
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True, timeout=10)
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


def resolve_algorithms(names: List[str], command: str) -> Tuple[List[str], List[Tuple[str, str]]]:
    """(algorithms to run, [(skipped, why)]): ``all`` is dense and every sparse algorithm; an
    unknown name exits with one line naming the choices."""
    from ..algorithms import REGISTRY, available_algorithms
    avail = available_algorithms()
    if any(x.lower() == "all" for x in names):
        wanted = list(REGISTRY)
    else:
        wanted = [x.lower() for x in names]
    run: List[str] = []
    skipped: List[Tuple[str, str]] = []
    for a in wanted:
        if a not in REGISTRY:
            raise SystemExit(f"oktopk-bench {command}: unknown algorithm {a!r}; choose from "
                             f"{sorted(REGISTRY)} or 'all'")
        if a not in avail:
            skipped.append((a, "not implemented yet (its module did not import)"))
        elif a not in run:
            run.append(a)
    return run, skipped


def fmt_bytes(b: float) -> str:
    """``b`` bytes as a short human string: ``512 B``, ``12.3 kB``, ``4.2 MB``, ``1.1 GB``."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(b) < 1000 or unit == "GB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{b:.0f} B"
        b /= 1000.0
    return f"{b:.1f}"
