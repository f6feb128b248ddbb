"""``oktopk-bench launches``: what one steady step issues, counted on CPU (the launch budget).

For each algorithm, wire format and mode, ranks run as threads (:class:`LocalCluster`: the
collectives are counted, not sent over a network); after the warm-up calls (the first steps
calibrate) rank 0 traces ONE call with a ``TorchDispatchMode``. Its columns (per steady call:
dispatches, launches, collectives, host reads, full passes) are defined in the note below.

The kernels run their torch references (each records the launches of its CUDA path);
``--interpreted`` (with ``TRITON_INTERPRET=1``) traces the Triton path itself instead.

Modes: ``gradients`` (``SparseAllreduce.forward``), ``updates`` (``reduce_updates`` with SGD),
``local`` (a non-sync ``reduce_updates`` call with ``sync_every=4``), ``sync`` (its sync call),
``optimizer`` (the optimizer's step alone, what ``local`` is measured against).

Measured why: docs/research/design-notes.md, ``oktopk_triton/bench/launches.py``.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
from typing import Any, Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from . import _args as A
from ..algorithms._wire import packed
from ..kernels import _dispatch

MODES = ("gradients", "updates", "local", "sync", "optimizer")
SYNC_EVERY = 4
BUDGET_FILE = os.path.join(os.path.dirname(__file__), "launch_budget.json")
COLUMNS = ("dispatches", "glue", "kernel", "launches", "collectives", "host_reads",
           "full_passes")

# aten ops that never launch a kernel: allocation without a fill, metadata, no-op lifts, and
# the profiler's ranges (``torch.optim``'s ``record_function`` around every ``step()``: a
# host-side annotation)
_NO_LAUNCH = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided",
              "resize_", "set_", "lift_fresh", "detach", "alias", "size", "stride",
              "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
              "_reshape_alias", "_unsafe_view", "view", "as_strided",
              "_record_function_enter", "_record_function_enter_new", "_record_function_exit"}
# aten ops that read the host on CUDA (the value decides a shape or a Python value)
_HOST_READ = {"_local_scalar_dense", "nonzero", "masked_select", "unique", "_unique",
              "_unique2", "unique_consecutive", "unique_dim", "is_nonzero", "equal",
              "allclose", "bincount", "repeat_interleave", "nonzero_numpy"}


# ops that touch only the indexed entries of their first operand: a full pass only when the index
# (or what is written) has n entries, not because the vector indexed into has
_SPARSE_ACCESS = {"index_select", "gather", "take", "index", "index_put", "index_put_", "scatter",
                  "scatter_", "scatter_add", "scatter_add_", "scatter_reduce", "scatter_reduce_",
                  "index_add", "index_add_", "index_copy", "index_copy_", "index_fill_"}


def _is_view(func) -> bool:
    """An op whose outputs alias an input without writing it (view, slice, expand, ...)."""
    schema = func._schema
    if schema.is_mutable:
        return False
    rets = schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write
                              for r in rets)


def _tensors(x) -> List[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


class StepTrace(TorchDispatchMode):
    """Counts the aten ops of this thread by the columns' rules (see the module docstring)."""

    def __init__(self, n: int) -> None:
        super().__init__()
        self.n = n
        self.c = dict.fromkeys(COLUMNS, 0)
        self.ops: Dict[str, int] = {}
        self.in_comm = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if _dispatch.in_kernel() or self.in_comm:
            return out
        name = func.overloadpacket.__name__
        c = self.c
        c["dispatches"] += 1
        ins, outs = _tensors((args, kwargs)), _tensors(out)
        if name in _HOST_READ or (name in ("index", "index_put", "index_put_") and any(
                t.dtype == torch.bool for t in _tensors(args[1:2]))):
            c["host_reads"] += 1
            return out
        if name in _NO_LAUNCH or _is_view(func) or (outs and all(t.numel() == 0 for t in outs)):
            return out
        c["glue"] += 1
        self.ops[name] = self.ops.get(name, 0) + 1
        if name in _SPARSE_ACCESS:   # the index and the values, and a new output
            touched = _tensors((args[1:], kwargs)) + ([] if name.endswith("_") else outs)
        else:
            touched = ins + outs
        if any(t.numel() >= self.n for t in touched):
            c["full_passes"] += 1
        return out


def _watch_comm(comm, trace: StepTrace):
    """Count the communicator's calls on ``trace`` and keep their own torch ops out of it."""
    names = ("send_recv", "allgather", "allreduce", "alltoall", "broadcast")

    def wrap(f):
        def call(*a, **k):
            trace.c["collectives"] += 1
            trace.in_comm += 1
            try:
                return f(*a, **k)
            finally:
                trace.in_comm -= 1
        return call
    saved = {m: getattr(comm, m) for m in names}
    for m, f in saved.items():
        setattr(comm, m, wrap(f))
    return lambda: [setattr(comm, m, f) for m, f in saved.items()]


def _host_methods(trace: StepTrace):
    """``.tolist()`` and ``.numpy()`` read the host without an aten op on CPU: counted here."""
    saved = {m: getattr(torch.Tensor, m) for m in ("tolist", "numpy")}

    def wrap(f):
        def call(self, *a, **k):
            if not _dispatch.in_kernel() and not trace.in_comm:
                trace.c["host_reads"] += 1
            return f(self, *a, **k)
        return call
    for m, f in saved.items():
        setattr(torch.Tensor, m, wrap(f))
    return lambda: [setattr(torch.Tensor, m, f) for m, f in saved.items()]


def trace_call(call, n: int, comm) -> Dict[str, Any]:
    """Run ``call()`` once under a :class:`StepTrace` on this thread; the columns and the glue
    ops by name."""
    trace = StepTrace(n)
    undo_comm = _watch_comm(comm, trace) if comm is not None else (lambda: None)
    undo_host = _host_methods(trace)
    calls_before = _dispatch.launcher_calls()
    try:
        with _dispatch.recording() as log, trace:
            call()
    finally:
        undo_host()
        undo_comm()
    c = dict(trace.c)
    c["kernel"] = sum(launches for launches, _ in log)
    c["full_passes"] += sum(1 for _, nbytes in log if nbytes >= 2 * n)
    c["launches"] = c["glue"] + c["kernel"]
    c["triton_launcher_calls"] = _dispatch.launcher_calls() - calls_before
    c["glue_ops"] = dict(sorted(trace.ops.items(), key=lambda kv: -kv[1]))
    return c


def _rank_body(comm, algorithm: str, wire: str, mode: str, n: int, density: float,
               warm: int, options: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    from ..module import SparseAllreduce, keywords
    torch.manual_seed(1000 + comm.rank)
    gen = torch.Generator().manual_seed(7 + comm.rank)

    def grad(t: int) -> torch.Tensor:
        g = torch.randn(n, generator=gen)
        return g * (1.0 + 0.1 * t)
    local = mode in ("local", "sync")
    opts = dict(options)
    if packed(wire):
        opts["wire_format"] = wire
    if mode == "gradients":
        sar = SparseAllreduce(n, comm, density, **keywords(algorithm, opts))
        for t in range(warm):
            sar(grad(t))
        comm.barrier()
        g = grad(warm)
        res = trace_call(lambda: sar(g), n, comm) if comm.rank == 0 else sar(g)
        comm.barrier()
        return res if comm.rank == 0 else None
    w = torch.nn.Parameter(torch.zeros(n))
    if local:
        opts["sync_every"] = SYNC_EVERY
    sar = SparseAllreduce([w], comm, density, **keywords(algorithm, opts))
    opt = torch.optim.SGD([w], lr=0.1)
    calls = warm * (SYNC_EVERY if local else 1)
    for t in range(calls):
        w.grad = grad(t)
        sar.reduce_updates(opt)
    # the traced call: a non-sync call (position 1 of the interval) or the interval's sync
    if mode == "sync":
        for t in range(SYNC_EVERY - 1):
            w.grad = grad(calls + t)
            sar.reduce_updates(opt)
    w.grad = grad(calls + SYNC_EVERY)
    comm.barrier()
    if mode == "optimizer":
        fn = opt.step
    else:
        def fn():
            sar.reduce_updates(opt)
    res = trace_call(fn, n, comm) if comm.rank == 0 else fn()
    comm.barrier()
    return res if comm.rank == 0 else None


def count_step(algorithm: str, wire: str = "fp32", mode: str = "gradients", *, n: int = 1 << 18,
               density: float = 0.01, world_size: int = 4, warm: int = 3,
               interpreted: bool = False, **options: Any) -> Dict[str, Any]:
    """The columns of one steady call of ``algorithm`` (rank 0 of ``world_size`` threads).

    ``interpreted=False`` (default): every kernel runs its torch reference (its recorded
    launches are the CUDA path's); ``True`` (needs ``TRITON_INTERPRET=1``): the Triton path
    itself, through the interpreter (the same launch columns, a few more views dispatched)."""
    if not interpreted:
        with _torch_kernels():
            return count_step(algorithm, wire, mode, n=n, density=density,
                              world_size=world_size, warm=warm, interpreted=True, **options)
    from ..comm.local import LocalCluster
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if mode == "optimizer":   # every rank steps its optimizer alone: no collective
        from ..comm.local import SingleCommunicator
        return _rank_body(SingleCommunicator(), algorithm, wire, mode, n, density, warm, options)
    # the selection's CPU shortcut records one launch; its reference records the CUDA path's
    from ..kernels import selection
    saved, selection.REFERENCE = selection.REFERENCE, True
    try:
        cluster = LocalCluster(world_size, timeout=900.0)   # a busy machine is slow, not stuck
        res = cluster.run(_rank_body, algorithm, wire, mode, n, density, warm, options)
    finally:
        selection.REFERENCE = saved
    return res[0]


def supports(algorithm: str, wire: str) -> bool:
    """Whether ``algorithm`` takes ``wire_format=wire`` (its constructor refuses otherwise)."""
    from ..algorithms import get_algorithm
    from ..comm.local import SingleCommunicator
    try:
        get_algorithm(algorithm)(256, SingleCommunicator(), 0.1, wire_format=wire)
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def _torch_kernels():
    """Every kernel takes its torch reference while open (process-wide: the ranks are threads)."""
    choose = _dispatch.choose
    _dispatch.choose = lambda backend, device: "torch"
    try:
        yield
    finally:
        _dispatch.choose = choose


def _combos(algorithms, wires, modes):
    for a in algorithms:
        for w in wires:
            if packed(w) and not supports(a, w):
                continue
            for m in modes:
                if m == "optimizer" and (a, w) != (algorithms[0], wires[0]):
                    continue
                yield a, w, m


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..algorithms import available_algorithms
    from ..algorithms._wire import WIRE_FORMATS
    p.add_argument("--algorithms", nargs="+", default=available_algorithms(),
                   choices=available_algorithms(), help="default: all")
    p.add_argument("--wire-formats", nargs="+", default=list(WIRE_FORMATS),
                   choices=list(WIRE_FORMATS), help="default: all (a format an algorithm "
                   "refuses is left out)")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--n", type=A.positive_int, default=1 << 18,
                   help="gradient length (default 262144, above Ok-Topk's threshold sample of "
                        "65536; beyond that the counts do not depend on it)")
    p.add_argument("--density", type=A.density, default=0.01)
    p.add_argument("--world-size", type=A.positive_int, default=4)
    p.add_argument("--warm", type=A.positive_int, default=3,
                   help="calls (syncs with local steps) before the traced one (default 3)")
    p.add_argument("--ops", action="store_true", help="also list each row's glue ops by name")
    p.add_argument("--check", action="store_true",
                   help="exit 1 when a row exceeds its budget in launch_budget.json")
    p.add_argument("--interpreted", action="store_true",
                   help="trace the Triton path under the interpreter (needs TRITON_INTERPRET=1; "
                        "default: the kernels' torch references, whose recorded launches are "
                        "the CUDA path's)")
    p.add_argument("--record-budget", action="store_true",
                   help="write these rows' counts as their budgets into launch_budget.json "
                        "(other rows' budgets are kept)")
    p.add_argument("--option", action="append", default=[], metavar="KEY=VALUE",
                   type=_parse_option,
                   help="an option for every algorithm traced (repeatable; VALUE as JSON where "
                        "it parses), e.g. complete_sums=true; not with --check or "
                        "--record-budget (the budgets are the default options')")
    p.add_argument("--json", type=A.out_path, default=None, help="write the rows here")


def _parse_option(s: str):
    from .train import parse_option as parse
    return parse(s)


BUDGET_COLUMNS = ("dispatches", "launches", "collectives", "host_reads", "full_passes")


def check_args(args: argparse.Namespace) -> str:
    """One line when the options cannot run together (the CLI exits 2 with it)."""
    if args.interpreted and not _dispatch.INTERPRET:
        return "--interpreted needs TRITON_INTERPRET=1 in the environment (set before the start)"
    options = dict(getattr(args, "option", None) or [])
    if options and (args.check or args.record_budget):
        return ("--option: the budgets are recorded for the default options; trace with "
                "--option, or check and record without it")
    if options:
        from ..algorithms import get_algorithm
        from ..comm.local import SingleCommunicator
        for a in args.algorithms:
            try:
                get_algorithm(a)(256, SingleCommunicator(), 0.1, **options)
            except (TypeError, ValueError) as e:
                return f"--option: {str(e).splitlines()[0]}"
    return ""


def load_budget() -> Dict[str, Dict[str, int]]:
    with open(BUDGET_FILE) as f:
        return json.load(f)["budget"]


def record_budget(rows: List[Dict[str, Any]], n: int) -> None:
    """Write the rows' counts as their budgets (traced through the torch references, as the
    test traces them)."""
    with open(BUDGET_FILE) as f:
        data = json.load(f)
    for r in rows:
        data["budget"][row_key(r["algorithm"], r["wire"], r["mode"])] = {
            k: r[k] for k in BUDGET_COLUMNS}
    data["n"] = n
    with open(BUDGET_FILE, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")


def row_key(algorithm: str, wire: str, mode: str) -> str:
    return f"{algorithm}/{wire}/{mode}"


def over_budget(row: Dict[str, Any], budget: Dict[str, Dict[str, int]]) -> List[str]:
    """The columns of ``row`` above its recorded budget (none when the row has no budget)."""
    lim = budget.get(row_key(row["algorithm"], row["wire"], row["mode"]))
    if lim is None:
        return []
    return [f"{k} {row[k]} > {v}" for k, v in lim.items() if row[k] > v]


def format_table(rows: List[Dict[str, Any]]) -> str:
    head = ["algorithm", "wire", "mode", *COLUMNS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        lines.append("| " + " | ".join(str(r[h]) for h in head) + " |")
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    rows = []
    options = dict(getattr(args, "option", None) or [])
    budget = load_budget() if args.check else {}
    bad = []
    for a, w, m in _combos(args.algorithms, args.wire_formats, args.modes):
        r = count_step(a, w, m, n=args.n, density=args.density, world_size=args.world_size,
                       warm=args.warm, interpreted=args.interpreted, **options)
        row = {"algorithm": a, "wire": w, "mode": m, **r}
        rows.append(row)
        over = over_budget(row, budget)
        if over:
            bad.append(f"{row_key(a, w, m)}: {', '.join(over)}")
    print(format_table(rows))
    if args.record_budget:
        record_budget(rows, args.n)
    if args.ops:
        for r in rows:
            print(f"{row_key(r['algorithm'], r['wire'], r['mode'])}: {r['glue_ops']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "launches", "n": args.n, "density": args.density,
                       "world_size": args.world_size, "options": options, "rows": rows}, f,
                      indent=1)
    for line in bad:
        print(f"over budget: {line}")
    return 1 if bad else 0
