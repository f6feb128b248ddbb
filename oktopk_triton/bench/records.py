"""The one result record: every JSON the project writes (the benchmarks, ``tools/gpu_check.py``,
the campaigns' merges) starts with the same header, is written by :func:`write` and read back by
:func:`read`, and its tables are drawn by :func:`table`. docs/results-format.md describes it.

Header (top-level keys, :func:`header`):

* ``benchmark``: what wrote it (``kernels``, ``collectives``, ``ddp``, ``train``, ``project``,
  ``gpu-check``, ``lm-merge``, ...);
* ``date``: ISO 8601, UTC, to the second;
* ``commit`` and ``dirty``: the checkout's HEAD and whether tracked files differed from it
  (None outside a git checkout);
* ``device``: the GPU's name, or the CPU's;
* ``versions``: python, torch, triton, numpy, cupy, oktopk_triton, cuda and nccl (None
  without a GPU);
* ``mps``: :func:`oktopk_triton.bench.ranks.detect_mps`'s answer where ranks share GPUs, else
  None; ``env``: the ``NCCL_*`` and ``CUDA_MPS_*`` variables set when it ran;
* ``arguments``: the command line's options.

Files written before the header (``git`` or ``git_commit`` holding ``SHA[-dirty]``, no
``benchmark``) read the same through :func:`read`. Default output paths are relative to one
base, :func:`results_dir`, with one folder per benchmark in it (:func:`results_path`);
``index.json`` there lists every file by its path relative to the base (:func:`index`).
"""
from __future__ import annotations

import datetime
import glob
import json
import os
import platform
import sys
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

from ._common import git_commit, nccl_version_text, versions

RESULTS_ENV = "OKTOPK_RESULTS"
HEADER_KEYS = ("benchmark", "date", "commit", "dirty", "device", "versions", "mps", "env",
               "arguments")


def results_dir() -> str:
    """Where results go unless a path is given: ``$OKTOPK_RESULTS``, else ``bench/results``
    under the current directory (the repository root when run from a checkout)."""
    return os.environ.get(RESULTS_ENV) or os.path.join("bench", "results")


# file-name prefix -> (its folder under results_dir, the benchmark of a file from before the
# header); the longer prefix first
_PLACES = (("gpu-kernel-variants", "kernels", "kernel-variants"),
           ("gpu-kernels", "kernels", "kernels"), ("gpu-collectives", "collectives", "collectives"),
           ("collectives", "collectives", "collectives"), ("ddp", "ddp", "ddp"),
           ("gpu-check", "gpu-check", "gpu-check"), ("gpu-tests", "gpu-check", None),
           ("gpu-profile", "gpu-profile", "gpu-profile"), ("train", "train", "train"),
           ("techniques", "techniques", "train"), ("lm-", "lm", "lm-merge"),
           ("project", "project", "project"), ("teardown", "teardown", "teardown-loop"),
           ("faults", "faults", "faults"), ("diloco", "diloco", "diloco"))


def folder_of(name: str) -> str:
    """The benchmark folder a result file of this name belongs in (``""``: none known)."""
    base = os.path.basename(name)
    return next((folder for prefix, folder, _ in _PLACES if base.startswith(prefix)), "")


def results_path(name: str) -> str:
    """``name``'s default path: its benchmark's folder under :func:`results_dir`."""
    return os.path.join(results_dir(), folder_of(name), name)


def now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def split_commit(text: Optional[str]) -> Tuple[Optional[str], Optional[bool]]:
    """``"SHA-dirty"`` -> ``("SHA", True)``; ``None`` -> ``(None, None)``."""
    if not text:
        return None, None
    return text.removesuffix("-dirty"), text.endswith("-dirty")


def device_name(device=None) -> str:
    """The GPU's name for a CUDA device, else the CPU's."""
    if device is not None and str(device).startswith("cuda"):
        import torch
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def _versions() -> Dict[str, Any]:
    v: Dict[str, Any] = dict(versions(), cuda=None, nccl=None)
    try:
        import torch
        if torch.cuda.is_available():
            v["cuda"] = torch.version.cuda
            v["nccl"] = nccl_version_text(torch.cuda.nccl.version())
    except Exception:  # noqa: BLE001
        pass
    return v


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items() if not str(k).startswith("_")}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)


def header(benchmark: str, arguments: Any = None, *, device: Optional[str] = None,
           mps: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
    """The header every result JSON starts with (see the module doc). ``arguments``: an
    ``argparse.Namespace`` or a dict."""
    sha, dirty = split_commit(git_commit())
    if arguments is not None and not isinstance(arguments, dict):
        arguments = vars(arguments)
    return {"benchmark": benchmark, "date": now(), "commit": sha, "dirty": dirty,
            "device": device or device_name(), "host": platform.node(),
            "versions": _versions(), "mps": mps,
            "env": {k: v for k, v in sorted(os.environ.items())
                    if k.startswith(("NCCL_", "CUDA_MPS_"))},
            "arguments": _jsonable(arguments) if arguments is not None else None}


def write(path: str, record: Dict[str, Any], *, compact: bool = False) -> str:
    """Write ``record`` as JSON at ``path`` (folders made): indented, or ``compact`` (the
    training reports, whose curves are long)."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w") as f:
        if compact:
            json.dump(record, f, separators=(",", ":"))
        else:
            json.dump(record, f, indent=1)
    return path


def read(path: str) -> Dict[str, Any]:
    """A result JSON with its header filled in: files from before the header get ``commit``
    and ``dirty`` from ``git`` / ``git_commit`` and ``benchmark`` from their name."""
    with open(path) as f:
        d = json.load(f)
    if not isinstance(d, dict):
        return {"benchmark": None, "records": d}
    if "commit" not in d:
        old = d.get("git_commit", d.get("git"))
        if isinstance(old, list):      # a merge of several runs: every commit
            pairs = [split_commit(x) for x in old]
            d["commit"] = [c for c, _ in pairs]
            d["dirty"] = any(x for _, x in pairs)
        else:
            d["commit"], d["dirty"] = split_commit(old)
    if not d.get("benchmark"):
        name = os.path.basename(path)
        d["benchmark"] = next((b for prefix, _, b in _PLACES if name.startswith(prefix)), None)
    return d


def merge(items: Iterable[Dict[str, Any]], key: Callable[[Dict[str, Any]], Any]
          ) -> List[Dict[str, Any]]:
    """One item per ``key(item)``, a later one replacing an earlier (in the earlier's place)."""
    out: Dict[Any, Dict[str, Any]] = {}
    for it in items:
        out[key(it)] = it
    return list(out.values())


def index(folder: str) -> List[Dict[str, Any]]:
    """One entry per result JSON in ``folder`` and its subfolders: file (its path relative to
    ``folder``), benchmark, date, commit, dirty, device."""
    out = []
    paths = glob.glob(os.path.join(folder, "**", "*.json"), recursive=True)
    for path in sorted(paths, key=lambda p: os.path.relpath(p, folder)):
        rel = os.path.relpath(path, folder).replace(os.sep, "/")
        if rel == "index.json":
            continue
        d = read(path)
        out.append({"file": rel, "benchmark": d.get("benchmark"),
                    "date": str(d.get("date") or "")[:10] or None, "commit": d.get("commit"),
                    "dirty": d.get("dirty"), "device": d.get("device")})
    return out


Column = Tuple[str, Callable[[Any], str]]


def table(rows: Sequence[Any], columns: Sequence[Column], *, markdown: bool = False,
          left: int = 1, sep: str = " | ") -> str:
    """Rows drawn as a table: one column per ``(header, cell of a row)``. Markdown, or plain
    text aligned in columns (the first ``left`` left-aligned, the rest right-aligned) with a
    rule under the header (``-+-`` where ``sep`` is `` | ``, else dashes under each column)."""
    cells = [[h for h, _ in columns]] + [[str(cell(r)) for _, cell in columns] for r in rows]
    if markdown:
        lines = ["| " + " | ".join(c) + " |" for c in cells]
        lines.insert(1, "|" + "---|" * len(columns))
        return "\n".join(lines)
    w = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = [sep.join(c.ljust(w[i]) if i < left else c.rjust(w[i]) for i, c in enumerate(row))
             for row in cells]
    rule = sep.replace(" ", "-").replace("|", "+") if "|" in sep else sep
    lines.insert(1, rule.join("-" * x for x in w))
    return "\n".join(lines)


def main(argv: Optional[List[str]] = None) -> int:
    """``python -m oktopk_triton.bench.records index [FOLDER]``: write FOLDER/index.json."""
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "index":
        print(main.__doc__, file=sys.stderr)
        return 2
    folder = argv[1] if len(argv) > 1 else results_dir()
    entries = index(folder)
    write(os.path.join(folder, "index.json"), {**header("index"), "files": entries})
    print(f"wrote {os.path.join(folder, 'index.json')} ({len(entries)} files)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
