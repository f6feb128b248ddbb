"""Per-rank checkpoint files: what each rank still owes survives a resume.

Every rank of a sparse allreduce holds its own state (the error-feedback residual, thresholds,
the step count): the residuals differ across ranks, and the sum over ranks of what was sent plus
what is owed is what conservation keeps. A framework that saves on rank 0 only therefore loses
P - 1 ranks' residuals. Here each rank writes its own file into one directory:

    <directory>/<name>-rank{r}-of{P}.pt

holding ``{"format", "kind", "version", "rank", "world_size", "fingerprint", "state"}``: plain
dicts, lists, ints, floats, strs and tensors only, so ``torch.load(path, weights_only=True)``
reads it. ``fingerprint`` describes the parameters the state was computed for (shapes, dtypes,
numel, the algorithm); loading into another model or another algorithm, or from a directory
without this rank's file, raises a one-line error, on every rank (the ranks agree before any of
them continues, so a rank whose file is fine does not train on alone). Files saved at another
world size are resharded (:func:`load_rank`'s ``reshard``; docs/checkpointing.md, "Changing the
world size").

Used by ``SparseAllreduceState.save/load`` (the DDP hook), ``SparseAllreduce.save/load`` and the
framework integrations (``oktopk_triton.integrations``).
"""
from __future__ import annotations

import glob
import logging
import os
import re
from collections import Counter
from typing import Any, Callable, Dict, Iterable, List, Optional

import torch

__all__ = ["FORMAT", "CheckpointError", "rank_file", "param_fingerprint", "fingerprint_differs",
           "save_rank", "load_rank", "agree", "saved_world_sizes", "saved_at"]

FORMAT = 1
DEFAULT_NAME = "oktopk"
log = logging.getLogger(__name__)


class CheckpointError(ValueError):
    """A per-rank checkpoint that does not fit (other world size, other model, missing file)."""


def rank_file(directory: str, rank: int, world_size: int, name: str = DEFAULT_NAME) -> str:
    """The path of rank ``rank``'s file among ``world_size`` ranks."""
    return os.path.join(os.fspath(directory), f"{name}-rank{rank}-of{world_size}.pt")


def saved_world_sizes(directory: str, name: str = DEFAULT_NAME) -> List[int]:
    """The world sizes for which ``directory`` holds files of ``name`` (for error messages)."""
    pat = re.compile(rf"{re.escape(name)}-rank\d+-of(\d+)\.pt$")
    found = {int(m.group(1)) for f in glob.glob(os.path.join(glob.escape(os.fspath(directory)),
                                                              f"{glob.escape(name)}-rank*-of*.pt"))
             if (m := pat.search(os.path.basename(f)))}
    return sorted(found)


def param_fingerprint(params: Iterable[torch.Tensor]) -> Dict[str, Any]:
    """Shapes, dtypes and total numel of ``params`` in their order (plain lists and strs)."""
    shapes, dtypes, numel = [], [], 0
    for p in params:
        shapes.append(list(p.shape))
        dtypes.append(str(p.dtype).replace("torch.", ""))
        numel += p.numel()
    return {"numel": numel, "shapes": shapes, "dtypes": dtypes}


def fingerprint_differs(saved: Dict[str, Any], mine: Dict[str, Any]) -> Optional[str]:
    """The first thing on which two fingerprints disagree, in a few words: the first mismatched
    parameter (by name or index, with both shapes) before any total, then other keys (a key only
    one of them has is not compared: e.g. a state saved before it saw any parameters)."""
    why = _param_differs(saved, mine)
    if why is not None:
        return why
    for key in sorted(set(saved) & set(mine)):
        a, b = saved[key], mine[key]
        if a == b:
            continue
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            i = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
            return f"{key}[{i}] is {a[i]!r} in the file, {b[i]!r} here"
        if isinstance(a, list) and isinstance(b, list):
            return f"{key} has {len(a)} entries in the file, {len(b)} here"
        return f"{key} is {a!r} in the file, {b!r} here"
    return None


def _sizes(fp: Dict[str, Any], key: str) -> str:
    n = len(fp[key])
    return f"{n} parameter{'s' if n != 1 else ''} of {fp.get('numel', '?')} elements"


def _param_differs(saved: Dict[str, Any], mine: Dict[str, Any]) -> Optional[str]:
    """The first parameter that differs. ``shapes``/``dtypes`` are in parameter order (compared
    by index); ``sorted_shapes`` (the DDP hook's, whose order is DDP's) are compared as a
    multiset, the parameter named from ``names``/``model_shapes`` when this side has them."""
    if "shapes" in saved and "shapes" in mine:
        a, b = saved["shapes"], mine["shapes"]
        da, db = saved.get("dtypes") or [], mine.get("dtypes") or []
        totals = f"{_sizes(saved, 'shapes')} in the file, {_sizes(mine, 'shapes')} here"
        for i in range(max(len(a), len(b))):
            if i >= len(a) or i >= len(b):
                side = "here" if i >= len(a) else "in the file"
                return (f"parameter {i} (shape {(b if i >= len(a) else a)[i]}) exists only "
                        f"{side}; {totals}")
            if a[i] != b[i]:
                return f"parameter {i} has shape {a[i]} in the file, {b[i]} here; {totals}"
            if i < len(da) and i < len(db) and da[i] != db[i]:
                return f"parameter {i} has dtype {da[i]} in the file, {db[i]} here"
        return None
    if "sorted_shapes" not in saved or "sorted_shapes" not in mine:
        return None
    pool = Counter(tuple(s) for s in saved["sorted_shapes"])
    names = mine.get("names")
    order = mine.get("model_shapes") or mine["sorted_shapes"]
    first = None
    for i, s in enumerate(order):
        if pool[tuple(s)] > 0:
            pool[tuple(s)] -= 1
        elif first is None:
            first = (names[i] if names else None, list(s))
    left = sorted(pool.elements())
    if first is None and not left:
        return None
    totals = f"{_sizes(saved, 'sorted_shapes')} in the file, {_sizes(mine, 'sorted_shapes')} here"
    unmatched = (f"the file's first unmatched shape is {list(left[0])}" if left
                 else "the file has no parameter left to match it")
    if first is None:
        return f"the file has a parameter of shape {list(left[0])} that is not here; {totals}"
    who = f"parameter {first[0]!r}" if first[0] else "a parameter"
    return f"{who} has shape {first[1]} here, which no parameter in the file has ({unmatched}; " \
           f"{totals})"


def save_rank(directory: str, kind: str, rank: int, world_size: int,
              fingerprint: Dict[str, Any], state: Dict[str, Any],
              name: str = DEFAULT_NAME) -> str:
    """Write this rank's file (atomically: a crash mid-write leaves the old file). Returns its
    path."""
    from . import __version__
    os.makedirs(directory, exist_ok=True)
    path = rank_file(directory, rank, world_size, name)
    tmp = f"{path}.tmp{os.getpid()}"
    torch.save({"format": FORMAT, "kind": kind, "version": __version__, "rank": int(rank),
                "world_size": int(world_size), "fingerprint": fingerprint, "state": state}, tmp)
    os.replace(tmp, path)
    log.info("%s: rank %d of %d saved to %s", kind, rank, world_size, path)
    return path


def _read(directory: str, kind: str, rank: int, world_size: int,
          fingerprint: Optional[Dict[str, Any]], name: str,
          map_location: Any) -> Dict[str, Any]:
    """This rank's file, checked; raises CheckpointError with a one-line reason."""
    path = rank_file(directory, rank, world_size, name)
    if not os.path.isfile(path):
        others = [p for p in saved_world_sizes(directory, name) if p != world_size]
        hint = (f"; the directory holds files for world size {', '.join(map(str, others))}, "
                "resume with that many ranks" if others else "")
        raise CheckpointError(f"{kind}.load: no file {path} for rank {rank} of {world_size}"
                              f"{hint}")
    try:
        f = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:   # truncated, not a torch file, unsafe content
        raise CheckpointError(f"{kind}.load: cannot read {path}: "
                              f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r}"
                              ) from e
    if not isinstance(f, dict) or f.get("format") != FORMAT:
        raise CheckpointError(f"{kind}.load: {path} is not a per-rank checkpoint of format "
                              f"{FORMAT}")
    if f.get("kind") != kind:
        raise CheckpointError(f"{kind}.load: {path} was saved by {f.get('kind')}, not {kind}")
    if (f.get("rank"), f.get("world_size")) != (rank, world_size):
        raise CheckpointError(f"{kind}.load: {path} holds rank {f.get('rank')} of "
                              f"{f.get('world_size')}, expected rank {rank} of {world_size}")
    if fingerprint is not None:
        why = fingerprint_differs(f.get("fingerprint") or {}, fingerprint)
        if why is not None:
            raise CheckpointError(f"{kind}.load: {path} was saved for other parameters ({why})")
    return f


# fingerprint entries that depend on the world size: not compared when a load reshards
WORLD_KEYS = ("group_size", "replicas")
# reshard(group states, old rank 0's state) -> this rank's state (see load_rank)
Reshard = Callable[[List[Dict[str, Any]], Dict[str, Any]], Dict[str, Any]]


def load_rank(directory: str, kind: str, rank: int, world_size: int,
              fingerprint: Optional[Dict[str, Any]],
              gather: Callable[[Optional[str]], List[Optional[str]]],
              name: str = DEFAULT_NAME, map_location: Any = "cpu",
              reshard: Optional[Reshard] = None) -> Dict[str, Any]:
    """Read and check this rank's file, then agree with every rank (``gather``: this rank's
    error or ``None`` -> every rank's); any failure raises on every rank. Returns the file's
    dict (its ``state`` and ``fingerprint``).

    With ``reshard``, a directory that holds files for one other world size P only (none for
    this one) is resharded (:func:`saved_at`): this rank reads the old ranks p ≡ rank (mod
    world_size) and old rank 0, checks each, and its ``state`` is ``reshard(group states,
    rank 0's state)``; the dict then also holds ``resharded_from`` (P)."""
    err: Optional[str] = None
    f: Dict[str, Any] = {}
    old = saved_at(directory, name, world_size) if reshard is not None else None
    try:
        if old is None:
            f = _read(directory, kind, rank, world_size, fingerprint, name, map_location)
        else:
            f = _read_resharded(directory, kind, rank, world_size, old, fingerprint, name,
                                map_location, reshard)
    except CheckpointError as e:
        err = str(e)
    agree(gather(err), err)
    if old is None:
        log.info("%s: rank %d of %d loaded from %s", kind, rank, world_size,
                 rank_file(directory, rank, world_size, name))
    elif rank == 0:
        log.info("%s: resharded %s from %d to %d ranks: new rank q sums what old ranks "
                 "p = q (mod %d) owed, times %d/%d; state shared by every rank from old rank 0",
                 kind, directory, old, world_size, world_size, world_size, old)
    return f


def saved_at(directory: str, name: str, world_size: int) -> Optional[int]:
    """The world size to reshard from: the only one ``directory`` holds files of ``name`` for,
    when it holds none for ``world_size``; else ``None`` (a plain load, whose error names the
    world sizes found when this rank's file is missing)."""
    sizes = saved_world_sizes(directory, name)
    if world_size in sizes or len(sizes) != 1:
        return None
    return sizes[0]


def _read_resharded(directory: str, kind: str, rank: int, world_size: int, old: int,
                    fingerprint: Optional[Dict[str, Any]], name: str, map_location: Any,
                    reshard: Reshard) -> Dict[str, Any]:
    """This rank's file resharded from ``old`` ranks (see :func:`load_rank`)."""
    fp = None if fingerprint is None else {k: v for k, v in fingerprint.items()
                                           if k not in WORLD_KEYS}
    group = list(range(rank, old, world_size))
    files = {p: _read(directory, kind, p, old, fp, name, map_location)
             for p in sorted(set(group) | {0})}
    first = files[0]
    try:
        state = reshard([files[p]["state"] for p in group], first["state"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:   # files that do not agree
        raise CheckpointError(f"{kind}.load: cannot reshard the files of {old} ranks in "
                              f"{directory} to {world_size}: {type(e).__name__}: {e}") from e
    return {**first, "rank": rank, "world_size": world_size, "state": state,
            "resharded_from": old}


def reshard_reducers(group: List[Dict[str, Any]], first: Dict[str, Any], rank: int,
                     world_size: int) -> Dict[str, Any]:
    """A ``reshard`` for states that hold ``{"algorithm", "reducers": {key: algorithm state}}``
    (the DDP hook's, FSDP2's): each reducer resharded with its class's ``reshard_state`` over
    the same key of the group's states (``rank`` / ``world_size``: in the reducers' group);
    the rest is ``first``'s."""
    from .algorithms import get_algorithm
    cls = get_algorithm(first["algorithm"])
    reducers = {i: cls.reshard_state([g["reducers"][i] for g in group], sd, rank, world_size)
                for i, sd in first.get("reducers", {}).items()}
    return {**first, "reducers": reducers}


def agree(errors: List[Optional[str]], mine: Optional[str]) -> None:
    """Raise on every rank when any rank reported an error: this rank's own message, or the
    first failing rank's prefixed with that rank."""
    bad = [(r, e) for r, e in enumerate(errors) if e is not None]
    if not bad:
        return
    more = f" (and {len(bad) - 1} other rank(s) failed)" if len(bad) > 1 else ""
    if mine is not None:
        raise CheckpointError(f"{mine}{more}")
    r, e = bad[0]
    raise CheckpointError(f"rank {r} failed: {e}{more}")


def gather_dist(group: Any = None) -> Callable[[Optional[str]], List[Optional[str]]]:
    """``gather`` over a torch.distributed group (a world of one when it is not initialised)."""
    import torch.distributed as dist

    def run(err: Optional[str]) -> List[Optional[str]]:
        if not (dist.is_available() and dist.is_initialized()):
            return [err]
        out: List[Optional[str]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, err, group=group)
        return out
    return run


def gather_comm(comm: Any) -> Callable[[Optional[str]], List[Optional[str]]]:
    """``gather`` over a :class:`~oktopk_triton.comm.Communicator`: one int per rank (the
    communicators carry tensors, not strings), so another rank's failure is named by its rank."""
    def run(err: Optional[str]) -> List[Optional[str]]:
        flag = torch.tensor([0 if err is None else 1], dtype=torch.int32, device=comm.device)
        out = torch.empty(comm.world_size, dtype=torch.int32, device=comm.device)
        comm.allgather(out, flag)
        flags = out.tolist()
        return [err if r == comm.rank else
                (None if f == 0 else "its checkpoint file did not load (its own error says why)")
                for r, f in enumerate(flags)]
    return run
