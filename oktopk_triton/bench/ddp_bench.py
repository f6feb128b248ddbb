"""``oktopk-bench ddp``: what each DDP communication choice costs on a real model.

    oktopk-bench ddp [--world-size 4] [--hooks all] [--algorithms all] [--density 0.01] \\
        [--width 2048 --layers 16 --batch 64] [--steps 10 --warmup 3] [--backend auto|gloo|nccl] \\
        [--json PATH] [--markdown PATH]

The model is a stack of ``Linear(W, W)`` layers with ReLU between them (W=2048, 16 layers:
67.1M parameters on CUDA; W=256, 4 layers on CPU), trained with SGD (momentum 0.9) on a fixed
random regression batch per rank, wrapped in ``DistributedDataParallel`` (``--bucket-cap-mb``,
default 25 as DDP's). The hooks (``--hooks``), the choices a user of this box has, are listed
in the note linked below.

A step is ``zero_grad``, forward, loss, backward (DDP's communication runs inside it), optimizer
step, then ``torch.cuda.synchronize`` on CUDA; the ranks meet at a barrier before each step (not
timed). Each step's time is the slowest rank's; ``step_ms_mean`` / ``step_ms_min`` are over the
``--steps`` steps after ``--warmup`` untimed ones (which must cover PowerSGD's and the sparse
hook's dense start iterations and their first compressed iteration).

Replicas: after the run every rank hashes its parameters; ``replicas_identical`` says whether
all ranks ended with bitwise-equal parameters (true for every averaging hook, false for
``none``). ``final_loss`` is the mean over ranks of the last step's loss.

Measured why: docs/research/design-notes.md, ``oktopk_triton/bench/ddp_bench.py``.
"""
from __future__ import annotations

import datetime
import os
import platform
import sys
import time
import traceback
from typing import Any, Callable, Dict, List, Optional

from . import _args as A
from ..comm.base import ring_allreduce_bytes
from ..comm.select import _cupy_available
from . import records
from ._common import resolve_algorithms
from .ddp_hooks import HOOKS, SPARSE_START_ITER, _register_hook, sparse_modes
from .ddp_report import _error_line, _summary, _write, format_markdown, format_table
from .measure import params_checksum
from .ranks import Ranks, detect_mps, init_rank, make_comm

__all__ = ["add_arguments", "main", "run_benchmark", "format_markdown", "format_table",
           "HOOKS", "make_model", "sparse_modes", "default_json_path"]

CPU_MODEL = {"width": 256, "layers": 4, "batch": 32}
GPU_MODEL = {"width": 2048, "layers": 16, "batch": 64}
STALL_AFTER_ERROR_S = 60.0  # after a hook failed somewhere, the ranks must report within this


# -- arguments -------------------------------------------------------------------------------------
def add_arguments(p) -> None:
    p.add_argument("--hooks", nargs="+", default=["all"],
                   help=f"hooks to run, or 'all' (default): {' '.join(HOOKS)}")
    p.add_argument("--algorithms", nargs="+", default=["all"],
                   help="algorithms of the sparse hook, or 'all' = every available sparse one")
    p.add_argument("--density", type=A.density, default=0.01,
                   help="sparse hook density (default 0.01)")
    p.add_argument("--modes", nargs="+", default=["auto"],
                   help="SparseAllreduceState modes (bucket, flat); 'auto' = every mode the state "
                        "accepts, or its one behaviour when it has no mode argument")
    p.add_argument("--world-size", "-P", type=A.positive_int, default=None,
                   help="ranks P (default 4 on CUDA, 2 on CPU)")
    p.add_argument("--width", type=A.positive_int, default=None,
                   help=f"layer width W (default {GPU_MODEL['width']} on CUDA, "
                        f"{CPU_MODEL['width']} on CPU)")
    p.add_argument("--layers", type=A.positive_int, default=None,
                   help=f"Linear(W, W) layers (default {GPU_MODEL['layers']} on CUDA, "
                        f"{CPU_MODEL['layers']} on CPU)")
    p.add_argument("--batch", type=A.positive_int, default=None,
                   help=f"samples per rank per step (default {GPU_MODEL['batch']} on CUDA, "
                        f"{CPU_MODEL['batch']} on CPU)")
    p.add_argument("--steps", type=A.positive_int, default=10, help="timed steps (default 10)")
    p.add_argument("--warmup", type=A.nonneg_int, default=3,
                   help="untimed steps first (default 3; at least PowerSGD's start iteration)")
    p.add_argument("--backend", choices=("auto", "gloo", "nccl"), default="auto",
                   help="auto: nccl when CUDA is available, else gloo")
    p.add_argument("--comm", choices=("auto", "cupy", "torch"), default="auto",
                   help="the sparse hook's communicator on nccl (default auto: cupy if importable)")
    p.add_argument("--kernel-backend", choices=("auto", "triton", "torch"), default=None,
                   help="kernels of the sparse algorithms (default: torch on CPU, auto on CUDA)")
    p.add_argument("--bucket-cap-mb", type=A.positive_float, default=25.0,
                   help="DDP bucket size (default 25)")
    p.add_argument("--powersgd-rank", type=A.positive_int, default=4)
    p.add_argument("--powersgd-start-iter", type=A.nonneg_int, default=2)
    p.add_argument("--lr", type=A.positive_float, default=0.01)
    p.add_argument("--threads", type=A.positive_int, default=1,
                   help="torch threads per rank on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=A.positive_float, default=600.0,
                   help="seconds the whole run may take (default 600)")
    p.add_argument("--json", type=A.out_path, default=None, metavar="PATH",
                   help="write the results JSON here")
    p.add_argument("--markdown", type=A.out_path, default=None, metavar="PATH",
                   help="write the README table (markdown) here")
    p.add_argument("--quiet", action="store_true", help="print only the final table")


# -- the model -------------------------------------------------------------------------------------
def make_model(width: int, layers: int):
    """``layers`` x ``Linear(width, width)`` with ReLU between them (none after the last)."""
    import torch.nn as nn
    mods: List[Any] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width))
        if i + 1 < layers:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def param_count(width: int, layers: int) -> int:
    return layers * (width * width + width)


# -- environment facts -----------------------------------------------------------------------------
def _load_avg() -> Optional[float]:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):  # pragma: no cover - not on every platform
        return None


def default_json_path(backend: str, date: Optional[str] = None) -> str:
    date = date or datetime.date.today().isoformat()
    return records.results_path(f"ddp-{backend}-{date}.json")


# -- the runs --------------------------------------------------------------------------------------
def _plan(args) -> List[Dict[str, Any]]:
    """One entry per (hook, algorithm, mode) to run, in the order they run."""
    from ..algorithms import SPARSE_ALGORITHMS
    hooks = list(HOOKS) if any(h.lower() == "all" for h in args.hooks) else \
        [h.lower() for h in args.hooks]
    for h in hooks:
        if h not in HOOKS:
            raise SystemExit(f"oktopk-bench ddp: unknown hook {h!r}; choose from {HOOKS} or 'all'")
    plan: List[Dict[str, Any]] = []
    for h in HOOKS:          # always in this order: the floor and the dense baseline first
        if h not in hooks:
            continue
        if h != "sparse":
            plan.append({"hook": h, "algorithm": None, "mode": None})
            continue
        algs, skipped = resolve_algorithms(args.algorithms, "ddp", everything=SPARSE_ALGORITHMS)
        for a, why in skipped:
            print(f"note: skipping {a}: {why}", flush=True)
        accepted = sparse_modes()
        if any(m.lower() == "auto" for m in args.modes):
            modes = accepted
        else:
            modes = [m.lower() for m in args.modes]
            if accepted == [None]:
                if modes != ["bucket"]:
                    raise SystemExit("oktopk-bench ddp: this SparseAllreduceState has no `mode` "
                                     "argument (it reduces bucket by bucket); use --modes auto")
                modes = [None]
            else:
                bad = [m for m in modes if m not in accepted]
                if bad:
                    raise SystemExit(f"oktopk-bench ddp: unknown mode(s) {bad}; "
                                     f"choose from {accepted}")
        for a in algs:
            for m in modes:
                plan.append({"hook": "sparse", "algorithm": a, "mode": m})
    return plan


def _run_one(spec: Dict[str, Any], cfg: Dict[str, Any], rank: int, dev,
             get_comm) -> Dict[str, Any]:
    """Train ``warmup + steps`` iterations with one hook; this rank's record."""
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP

    cuda = dev.type == "cuda"
    torch.manual_seed(cfg["seed"])                       # the same initial model on every rank
    model = make_model(cfg["width"], cfg["layers"]).to(dev)
    ddp = DDP(model, device_ids=[dev.index] if cuda else None,
              bucket_cap_mb=cfg["bucket_cap_mb"])
    hook = spec["hook"]
    comm, state, counted = _register_hook(ddp, spec, cfg, cuda, get_comm)

    # this rank's data: a few fixed batches of a random regression problem
    g = torch.Generator().manual_seed(cfg["seed"] * 7919 + 1000 * (rank + 1))
    batches = [(torch.randn(cfg["batch"], cfg["width"], generator=g).to(dev),
                torch.randn(cfg["batch"], cfg["width"], generator=g).to(dev)) for _ in range(4)]
    opt = torch.optim.SGD(ddp.parameters(), lr=cfg["lr"], momentum=0.9)
    barrier_kw = {"device_ids": [dev.index]} if cuda else {}
    n_params = sum(p.numel() for p in model.parameters())
    # what a rank sends: the sparse hook's communicator counts; torch's hooks' all_reduce calls
    # are counted as ring allreduces; DDP's C++ allreduce is not visible, so the ring model of
    # all parameters
    def sent() -> float:
        if comm is not None:
            return float(comm.bytes_sent)
        if counted is not None:
            return float(counted["bytes_sent"])
        return 0.0

    times, losses, sent_per_step = [], [], []
    for it in range(cfg["warmup"] + cfg["steps"]):
        x, y = batches[it % len(batches)]
        if cuda:
            torch.cuda.synchronize(dev)
        dist.barrier(**barrier_kw)
        b0 = sent()
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = F.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        if cuda:
            torch.cuda.synchronize(dev)
        times.append(time.perf_counter() - t0)
        sent_per_step.append(float(ring_allreduce_bytes(4 * n_params, cfg["P"]))
                             if hook == "allreduce" else sent() - b0)
        losses.append(float(loss.detach()))
    rec = {"time_s": times, "bytes": sent_per_step, "loss": losses,
           "param_digest": params_checksum(model.parameters()), "params": n_params}
    if hook == "sparse" and state is not None:
        rec["buckets"] = len(getattr(state, "reducers", {}) or {})
    del ddp, model, opt, batches
    if cuda:
        torch.cuda.empty_cache()
    return rec


def _rank_main(rank: int, P: int, port: int, send, cfg: Dict[str, Any],
               plan: List[Dict[str, Any]]) -> None:
    """One rank (a :class:`~oktopk_triton.bench.ranks.Ranks` target): init the group, run every
    planned hook, report each as it completes."""
    import torch
    import torch.distributed as dist
    nccl = cfg["backend"] == "nccl"
    dev = init_rank(rank, P, port, gpu=nccl, group=cfg["backend"], timeout=cfg["pg_timeout"],
                    threads=cfg["threads"])
    comm_box: Dict[str, Any] = {}

    def get_comm():
        if "comm" not in comm_box:
            comm_box["comm"] = make_comm(cfg["comm"] if nccl else "torch", dev)
        return comm_box["comm"]

    for i, spec in enumerate(plan):
        try:
            send("result", (i, _run_one(spec, cfg, rank, dev, get_comm)))
        except Exception:  # noqa: BLE001 - one failing hook does not stop the others
            send("error", (i, traceback.format_exc()))
        # the ranks meet between hooks (a hook that failed on every rank is skipped cleanly)
        if nccl:
            torch.cuda.synchronize(dev)
            dist.barrier(device_ids=[dev.index])
        else:
            dist.barrier()


def _spawn_ranks(cfg: Dict[str, Any], plan: List[Dict[str, Any]], timeout: float,
                 log: Callable[..., None]):
    """Run the ranks; ``({plan index: [record per rank]}, {plan index: error}, [fatal])``."""
    P = cfg["P"]
    # the children read these when they import torch / the kernels: on CPU, the torch kernel
    # references unless the Triton interpreter is asked for (TRITON_INTERPRET is read at import)
    env: Dict[str, Optional[str]] = {}
    if cfg["backend"] == "gloo":
        env["OMP_NUM_THREADS"] = str(cfg["threads"])
        if cfg["kernel_backend"] == "torch":
            env["TRITON_INTERPRET"] = None
        elif cfg["kernel_backend"] == "triton":
            env["TRITON_INTERPRET"] = "1"
    ranks = Ranks(P, _rank_main, (cfg, plan), name="ddp-bench-rank", env=env)
    recs: Dict[int, List[Any]] = {i: [None] * P for i in range(len(plan))}
    errors: Dict[int, str] = {}
    fatal: List[str] = []
    deadline = time.monotonic() + timeout
    stall_end = None   # set by an error: the ranks must show progress again before this
    try:
        while ranks.pending():
            rank, kind, payload = ranks.get(min(deadline, stall_end or deadline))
            if kind == "timeout":
                left = ranks.pending()
                fatal.append(f"timeout: ranks {left} did not finish within {timeout:g}s"
                             if stall_end is None or time.monotonic() > deadline else
                             f"ranks {left} made no progress for {STALL_AFTER_ERROR_S:g}s after "
                             f"an error (a rank left a collective the others wait in): stopped")
                break
            if kind in ("result", "error"):
                i, body = payload
                if kind == "result":
                    recs[i][rank] = body
                    if all(r is not None for r in recs[i]):
                        log(f"  done: {_label(plan[i])}")
                else:
                    errors.setdefault(i, f"rank {rank}: {body}")
            elif kind in ("fatal", "died"):
                fatal.append(f"rank {rank}: {payload[1] if kind == 'fatal' else payload}")
                # a rank died: the others wait for it in a collective until the group timeout
                deadline = min(deadline, time.monotonic() + 10.0)
            stall_end = time.monotonic() + STALL_AFTER_ERROR_S if errors else None
    finally:
        ranks.stop(5.0 if not fatal else 0.5)
    return recs, errors, fatal


def _label(spec: Dict[str, Any]) -> str:
    if spec["hook"] != "sparse":
        return spec["hook"]
    return f"sparse/{spec['algorithm']}" + (f"/{spec['mode']}" if spec["mode"] else "")


def _resolve_config(args) -> Dict[str, Any]:
    import torch
    cuda = torch.cuda.is_available()
    backend = args.backend if args.backend != "auto" else ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise SystemExit("oktopk-bench ddp: --backend nccl needs a CUDA GPU")
    on_gpu = backend == "nccl"
    defaults = GPU_MODEL if on_gpu else CPU_MODEL
    P = args.world_size if args.world_size is not None else (4 if on_gpu else 2)
    if P < 2:
        raise SystemExit("oktopk-bench ddp: --world-size must be >= 2")
    if args.steps < 1:
        raise SystemExit("oktopk-bench ddp: --steps must be >= 1")
    if not 0.0 < args.density <= 1.0:
        raise SystemExit(f"oktopk-bench ddp: --density must be in (0, 1], got {args.density}")
    need = max(args.powersgd_start_iter, SPARSE_START_ITER + 1)
    if args.warmup < need:
        raise SystemExit(f"oktopk-bench ddp: --warmup must be >= {need}: PowerSGD's dense "
                         f"iterations (start_powerSGD_iter={args.powersgd_start_iter}) and the "
                         f"sparse hook's dense and first (calibration) iterations are not timed")
    comm = args.comm
    if backend == "nccl" and comm == "auto":
        comm = "cupy" if _cupy_available() else "torch"
    elif backend == "gloo":
        comm = "torch"
    kb = args.kernel_backend or ("auto" if on_gpu else "torch")
    width = args.width or defaults["width"]
    layers = args.layers or defaults["layers"]
    ngpu = torch.cuda.device_count() if on_gpu else 0
    return {"backend": backend, "P": P, "width": width, "layers": layers,
            "batch": args.batch or defaults["batch"], "steps": args.steps,
            "warmup": args.warmup, "density": args.density, "comm": comm, "kernel_backend": kb,
            "bucket_cap_mb": args.bucket_cap_mb, "powersgd_rank": args.powersgd_rank,
            "powersgd_start_iter": args.powersgd_start_iter, "lr": args.lr,
            "threads": args.threads, "seed": args.seed,
            "pg_timeout": max(30.0, min(300.0, args.timeout / 2)),
            "gpus_used": min(P, ngpu) if on_gpu else 0,
            "ranks_per_gpu": -(-P // ngpu) if on_gpu else 0}


def run_benchmark(args, log: Callable[..., None] = print) -> Dict[str, Any]:
    cfg = _resolve_config(args)
    plan = _plan(args)
    on_gpu = cfg["backend"] == "nccl"
    mps = detect_mps() if on_gpu else None
    warnings: List[str] = []
    if on_gpu and cfg["ranks_per_gpu"] > 1 and not mps["active"]:
        msg = (f"WARNING: {cfg['P']} ranks share {cfg['gpus_used']} GPU(s) and the MPS daemon is "
               f"NOT active: the ranks are time-sliced and every step time below is inflated "
               f"(a 4-byte allreduce costs ~18 ms). Start MPS first (nvidia-cuda-mps-control -d).")
        warnings.append(msg)
        bar = "!" * 100
        print(f"{bar}\n{msg}\n{bar}", file=sys.stderr, flush=True)
    log(f"ddp: backend={cfg['backend']} P={cfg['P']} model={cfg['layers']}x"
        f"Linear({cfg['width']}, {cfg['width']}) ({param_count(cfg['width'], cfg['layers'])} "
        f"params) batch={cfg['batch']} steps={cfg['steps']}+{cfg['warmup']} warm-up; "
        f"{len(plan)} runs")
    load_before = _load_avg()
    t0 = time.perf_counter()
    recs, errs, fatal = _spawn_ranks(cfg, plan, args.timeout, log)
    wall = time.perf_counter() - t0
    results, errors = [], []
    for i, spec in enumerate(plan):
        if i in errs or any(r is None for r in recs[i]):
            errors.append({"hook": spec["hook"], "algorithm": spec["algorithm"],
                           "mode": spec["mode"],
                           "error": errs.get(i, "did not complete on every rank")})
            continue
        results.append(_summary(spec, recs[i], cfg))
    base = next((r for r in results if r["hook"] == "allreduce"), None)
    if base is not None:
        for r in results:
            r["ratio_to_allreduce"] = r["step_ms_mean"] / base["step_ms_mean"]
    for f in fatal:
        errors.append({"hook": None, "algorithm": None, "mode": None, "error": f})
    dev_name = records.device_name("cuda:0" if on_gpu else "cpu")
    return {
        **records.header("ddp", args, device=dev_name, mps=mps),
        "backend": cfg["backend"],
        "host": platform.node(),
        "gpus": cfg["gpus_used"],
        "config": {"model": f"{cfg['layers']} x Linear({cfg['width']}, {cfg['width']}) + ReLU, "
                            f"MSE on random data, SGD momentum 0.9",
                   "W": cfg["width"], "layers": cfg["layers"],
                   "params": param_count(cfg["width"], cfg["layers"]), "batch": cfg["batch"],
                   "P": cfg["P"], "steps": cfg["steps"], "warmup": cfg["warmup"],
                   "ranks_per_gpu": cfg["ranks_per_gpu"], "bucket_cap_mb": cfg["bucket_cap_mb"],
                   "comm": cfg["comm"], "kernel_backend": cfg["kernel_backend"],
                   "powersgd_rank": cfg["powersgd_rank"],
                   "powersgd_start_iter": cfg["powersgd_start_iter"],
                   "sparse_start_iter": SPARSE_START_ITER, "lr": cfg["lr"],
                   "threads_per_rank": cfg["threads"] if not on_gpu else None,
                   "seed": cfg["seed"]},
        "results": results,
        "errors": errors,
        "warnings": warnings,
        "wall_s": wall,
        "load_avg_1m_before_after": [load_before, _load_avg()],   # other work on this machine
        "cpu_count": os.cpu_count(),
    }


def main(args) -> int:
    log = (lambda *a, **k: None) if args.quiet else (lambda *a, **k: print(*a, **k, flush=True))
    report = run_benchmark(args, log=log)
    print(format_table(report), flush=True)
    for w in report["warnings"]:
        print(w, file=sys.stderr, flush=True)
    for e in report["errors"]:
        print(f"error: {e['hook']} {e['algorithm'] or ''}: {_error_line(e['error'])}", flush=True)
    if args.json:
        records.write(args.json, report)
        print(f"wrote {args.json}", flush=True)
    if args.markdown:
        _write(args.markdown, format_markdown(report) + "\n")
        print(f"wrote {args.markdown}", flush=True)
    return 1 if report["errors"] else 0


if __name__ == "__main__":  # python -m oktopk_triton.bench.ddp_bench: the CLI's checked path
    from ..cli import main as _cli_main
    raise SystemExit(_cli_main(["ddp", *sys.argv[1:]]))
