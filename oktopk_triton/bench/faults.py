"""``oktopk-bench faults`` (``make faults``): sparse DiLoCo on torchft survives a replica's death.

    oktopk-bench faults [--out out/faults] [--steps 512] [--sync-every 32] [--density 0.2]

Four replica groups (one process each, :mod:`.ft_replica`, under a real ``torchft_lighthouse``,
:mod:`.ft_cluster`) train the digits CNN, each on its own shard, ``--steps`` inner steps of data
per replica in every run (syncs x sync_every equal across runs). Runs: (a) ``sparse``:
:class:`~oktopk_triton.integrations.torchft.SparseDiLoCo` (Ok-Topk at ``--density`` every
``--sync-every`` inner steps), no fault; (b) ``sparse+fault``: the same while replica 3 is
SIGKILLed by pid at 25% of the syncs and a fresh process of it started at 50%, healed from a peer
when it joins; (c) ``dense-same-bytes+fault``: torchft's own ``DiLoCo``, same fault, its sync
interval the largest that divides the steps and sends at least (b)'s bytes per inner step; (d)
``dense-H4+fault``: ``DiLoCo`` every 4 inner steps, same fault. The fault falls at a known sync:
the replicas hold (bounded) at 25%, the harness kills replica 3 and releases them; at 50% they
hold until the restarted replica's Manager is up. Bytes: the sparse runs' from each sync's
``history`` record (what the reducer sent); dense ``DiLoCo`` allreduces every fp32 parameter each
sync, counted as a ring allreduce, ``2(P-1)/P * 4n`` per replica. A run fails when a sparse sync's
conservation error (audited before it commits) exceeds 1e-6, or the replicas that finished differ
in weights or last test loss. Two runs at a time, each in a worker process that imported torch
and torchft once and forks its replicas. Output: a table, ``faults.png`` (test loss and bytes
against inner steps, the kill and the restart marked) and ``faults.json`` (a
:mod:`~oktopk_triton.bench.records` record) under ``--out``.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional, Sequence

from . import _args as A
from . import records

# Inner AdamW at 3e-3 on 16-image batches and plain averaging as the outer step (SGD, lr 1):
# the digits CNN (width 8, 18,346 parameters) reaches a test loss near 0.08 in 512 inner steps.
# Sparse, fault-free, 480 steps at the same bytes per step (2026-12-01): H=8 d=0.05 0.108,
# H=16 d=0.1 0.094, H=32 d=0.2 0.075 (dense DiLoCo at H=60, killed replica: 0.077). On the q2 wire
# at d=0.6 (1,164 B/step, seed 0): 0.084 fault-free, 0.073 with the fault; dense H=64 0.069.
DEFAULTS = dict(replicas=4, victim=3, steps=512, sync_every=32, density=0.2, algorithm="oktopk",
                wire_format="fp32",
                dense_every=4, inner="adam", lr=3e-3, outer_lr=1.0, outer_momentum=0.0,
                batch=16, width=32, seed=0, kill_at=0.25, restart_at=0.5)
MAX_CONSERVATION_ERROR = 1e-6
RUNS = ("sparse", "sparse+fault", "dense-same-bytes+fault", "dense-H4+fault")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", type=A.out_dir, default=os.path.join("out", "faults"),
                   help="folder of faults.json and faults.png (default out/faults)")
    p.add_argument("--json", type=A.out_path, default=None,
                   help="the record's path (default OUT/faults.json)")
    p.add_argument("--steps", type=A.positive_int, default=DEFAULTS["steps"],
                   help="inner steps of data per replica in every run (a multiple of 4 x "
                        "--sync-every and of 16)")
    p.add_argument("--sync-every", type=A.positive_int, default=DEFAULTS["sync_every"],
                   help="the sparse runs' inner steps per sync")
    p.add_argument("--density", type=A.density, default=DEFAULTS["density"],
                   help="the sparse runs' density per sync")
    p.add_argument("--algorithm", default=DEFAULTS["algorithm"],
                   help="the sparse runs' algorithm")
    p.add_argument("--wire-format", default=DEFAULTS["wire_format"],
                   choices=["fp32", "compact", "q2", "q4"], help="the sparse runs' wire")
    p.add_argument("--lr", type=A.positive_float, default=DEFAULTS["lr"],
                   help="inner AdamW learning rate")
    p.add_argument("--seed", type=A.nonneg_int, default=DEFAULTS["seed"])
    p.add_argument("--timeout", type=A.positive_float, default=150.0,
                   help="seconds any one run may take before it is stopped (default 150)")


def check_args(args) -> str:
    if args.steps % (4 * args.sync_every) or args.steps % (4 * DEFAULTS["dense_every"]):
        return (f"--steps ({args.steps}) must be a multiple of 4 x --sync-every "
                f"({4 * args.sync_every}) and of {4 * DEFAULTS['dense_every']}: every run's "
                f"fault falls at 25% and 50% of its syncs")
    return ""


# -- the arithmetic ------------------------------------------------------------------------------
def dense_sync_bytes(n_params: int, P: int) -> int:
    """What one replica sends in one dense DiLoCo sync over P replicas: a ring allreduce of n
    fp32 parameters."""
    from ..comm import ring_allreduce_bytes
    return ring_allreduce_bytes(4 * n_params, P) if P > 1 else 0


def same_bytes_interval(steps: int, n_params: int, sparse_bytes_per_step: float,
                        participants: Sequence[int]) -> int:
    """Dense DiLoCo's sync interval at the sparse run's bytes per inner step: the largest H that
    divides ``steps`` with ``steps / H`` a multiple of 4 (the fault at 25% and 50%) and sends at
    least as many bytes per inner step, a sync costing the mean of :func:`dense_sync_bytes` over
    ``participants`` (P of each of the sparse run's committed syncs)."""
    if not participants or sparse_bytes_per_step <= 0:
        return 4
    per_sync = sum(dense_sync_bytes(n_params, P) for P in participants) / len(participants)
    ideal = per_sync / sparse_bytes_per_step
    ok = [h for h in range(1, steps // 4 + 1) if steps % (4 * h) == 0 and h <= ideal]
    return max(ok) if ok else 1


def summarize(name: str, results: List[Dict[str, Any]], wall: float,
              reference: Optional[float] = None,
              max_error: float = MAX_CONSERVATION_ERROR) -> Dict[str, Any]:
    """One table row from a run's replica results (``results[i]``: the last process of
    replica i; ``None`` for one that never finished). Raises ``RuntimeError`` when the finished
    replicas differ or a sparse sync was not conserved to ``max_error``."""
    done = [r for r in results if r is not None]
    if not done:
        raise RuntimeError(f"{name}: no replica finished")
    last = {(r["evals"][-1][0], r["evals"][-1][1]) for r in done}
    if len(last) != 1:
        raise RuntimeError(f"{name}: the replicas that finished end on different test losses: "
                           f"{sorted(last)}")
    full = [r for r in done if r.get("heals", 0) == 0] or done    # ran from the first step
    lead = done[0]
    errs = [h["relative_error"] for r in done for h in r["history"] if h["committed"]]
    sparse = lead["config"]["mode"] == "sparse"
    worst = None
    if sparse:
        if any(e is None for e in errs):
            raise RuntimeError(f"{name}: a committed sync was not audited")
        worst = max(errs) if errs else 0.0
        if worst > max_error:
            raise RuntimeError(f"{name}: a sync was not conserved: relative error {worst:.3g} "
                               f"> {max_error:g}")
    final = float(lead["evals"][-1][1])
    bytes_per_step = sum(r["bytes"] / max(1, r["local_steps"]) for r in full) / len(full)
    # the committed syncs after the first healed one (a sparse record's step is the Manager's
    # at its quorum, a dense one's after its vote)
    healed = [h["step"] + sparse for r in done for h in r["history"] if h.get("healed")]
    return {"run": name, "mode": lead["config"]["mode"], "rejoined_at": min(healed, default=None),
            "sync_every": lead["config"]["sync_every"], "final_loss": final,
            "vs_fault_free_pct": None if reference is None else 100 * (final / reference - 1),
            "bytes_per_step": bytes_per_step, "syncs": lead["step"],
            "inner_steps": lead["local_steps"],
            "rolled_back": sum(not h["committed"] for h in lead["history"]),
            "heals": sum(r.get("heals", 0) for r in done),
            "max_conservation_error": worst, "wall_s": wall}


def format_table(rows: Sequence[Dict[str, Any]]) -> str:
    def pct(r):
        v = r["vs_fault_free_pct"]
        return "—" if v is None else f"{v:+.2f}%"

    def cons(r):
        v = r["max_conservation_error"]
        return "—" if v is None else f"{v:.1e}"
    return records.table(rows, [
        ("run", lambda r: r["run"]), ("H", lambda r: r["sync_every"]),
        ("final test loss", lambda r: f"{r['final_loss']:.4f}"),
        ("vs fault-free", pct),
        ("bytes/replica/step", lambda r: f"{r['bytes_per_step']:,.0f}"),
        ("syncs", lambda r: r["syncs"]), ("rolled back", lambda r: r["rolled_back"]),
        ("heals", lambda r: r["heals"]), ("max cons. err", cons),
        ("wall s", lambda r: f"{r['wall_s']:.1f}")])


def curve(result: Dict[str, Any]) -> Dict[str, List[float]]:
    """A replica's test loss against its inner steps, and its cumulative bytes against the inner
    step of each sync attempt (one every ``sync_every`` steps)."""
    H = result["config"]["sync_every"]
    steps = result.get("eval_steps") or [e[0] * H for e in result["evals"]]
    cum, total = [], 0
    for h in result["history"]:
        total += h["bytes"]
        cum.append(total)
    return {"steps": list(steps), "loss": [float(e[1]) for e in result["evals"]],
            "sync_steps": [H * (i + 1) for i in range(len(cum))], "bytes": cum}


def plot(runs: Sequence[Dict[str, Any]], path: str, kill_step: Optional[int],
         restart_step: Optional[int], title: str) -> str:
    """Two panels against inner steps: test loss (log) and the bytes one replica sent; the kill
    and the restart as vertical lines."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    styles = {"sparse": ("C0", "-"), "sparse+fault": ("C1", "-"),
              "dense-same-bytes+fault": ("C2", "--"), "dense-H4+fault": ("C3", ":")}
    for run in runs:
        c = run["curve"]
        color, ls = styles.get(run["run"], (None, "-"))
        label = f"{run['run']} (H={run['sync_every']}): {run['final_loss']:.3f}"
        ax1.plot(c["steps"], c["loss"], color=color, ls=ls, lw=1.6, label=label)
        pts = [(x, b / 1e6) for x, b in zip(c["sync_steps"], c["bytes"]) if b > 0]
        ax2.plot([x for x, _ in pts], [b for _, b in pts], color=color, ls=ls, lw=1.6,
                 marker="." if len(pts) <= 20 else None)
    for ax in (ax1, ax2):
        for x, what in ((kill_step, "replica 3 killed"), (restart_step, "restarted, healed")):
            if x is not None:
                ax.axvline(x, color="k", lw=1, ls="-." if "killed" in what else "--", alpha=0.6)
                ax.text(x, 0.98, f" {what}", transform=ax.get_xaxis_transform(), va="top",
                        ha="left", fontsize=8, rotation=90)
        ax.set_xlabel("inner steps (replica 0)")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3, which="both")
    ax1.set_yscale("log")
    ax1.set_ylabel("test loss (after each committed sync)")
    ax1.set_title(title)
    ax1.legend(fontsize=8, frameon=False)
    ax2.set_yscale("log")
    ax2.set_ylabel("MB sent by replica 0 (cumulative)")
    ax2.set_title("communication")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


# -- running a cluster ---------------------------------------------------------------------------
def run_cluster(cfg: Dict[str, Any], replicas: int, victim: Optional[int], kill_at: int,
                restart_at: int, workdir: str, timeout: float, fork: bool = True
                ) -> List[Optional[Dict[str, Any]]]:
    """One run: ``replicas`` processes under one lighthouse; with ``victim``, that replica is
    SIGKILLed once every replica holds at ``kill_at`` committed syncs, and a fresh process of it
    is started once the others hold at ``restart_at``. Returns each replica's last process's
    result (every process exits, or is killed, before this returns). ``fork``: the replicas are
    forked from this process (call it from a single-threaded one that imported torch and torchft,
    :func:`_warm`), not started as new interpreters."""
    from .ft_cluster import ClusterError, Lighthouse, Replica, wait_for, wait_ready
    deadline = time.monotonic() + timeout

    def left() -> float:
        return max(1.0, deadline - time.monotonic())
    gates = {g: os.path.join(workdir, g) for g in ("start", "kill", "restart")}
    hold = [{"at": 0, "file": gates["start"]}]
    if victim is not None:
        hold += [{"at": kill_at, "file": gates["kill"]},
                 {"at": restart_at, "file": gates["restart"]}]
    min_replicas = replicas - 1 if victim is not None else replicas
    reps: List[Any] = []
    try:
        with Lighthouse(min_replicas=min_replicas) as lh:
            def start(i: int) -> Any:
                return Replica(dict(cfg, replica=i, lighthouse=lh.address, hold=hold,
                                    min_replicas=min_replicas), workdir, fork=fork)
            reps = [start(i) for i in range(replicas)]
            for r in reps:
                wait_ready(r, left())
            open(gates["start"], "w").close()
            if victim is not None:
                for i in (0, victim):
                    wait_for(reps, i, kill_at, left())
                reps[victim].kill()
                open(gates["kill"], "w").close()
                wait_for(reps, 0, restart_at, left())
                reps[victim] = start(victim)
                _wait_syncing(reps[victim], left())
                time.sleep(0.5)     # its quorum request reaches the lighthouse first
                open(gates["restart"], "w").close()
            out: List[Optional[Dict[str, Any]]] = []
            for i, r in enumerate(reps):
                res = r.result(left())
                if res["returncode"] != 0:
                    raise ClusterError(f"replica {i} failed ({res['returncode']}): "
                                       f"{res.get('error') or res['log']}")
                out.append(res)
            return out
    finally:
        for r in reps:
            r.kill()


def _wait_syncing(replica: Any, timeout: float) -> None:
    """Wait (bounded) until ``replica`` is about to enter its first sync's quorum (its
    ``result.syncing`` file). The survivors, held meanwhile, then find it waiting at the
    lighthouse: without this, torchft's fast quorum (every member of the last quorum present)
    may form without it, and it would join one sync later, or not, by a race."""
    from .ft_cluster import wait_file
    wait_file(replica, ".syncing", "reach its first sync", timeout)


def _weights_equal(results: Sequence[Optional[Dict[str, Any]]]) -> bool:
    import torch
    ws = [torch.load(r["weights"], weights_only=True) for r in results if r is not None]
    return all(w.keys() == ws[0].keys() and all(torch.equal(w[k], ws[0][k]) for k in w)
               for w in ws)


def _n_params(width: int) -> int:
    from .digits import make_model
    return sum(p.numel() for p in make_model("cnn", width=width // 4 or 8).parameters())


def _warm() -> None:
    """A worker's start: import once what every forked replica needs (torch, torchft, the
    integration, the digits data, and what the first optimizer step imports: some 10 s a
    replica on the loaded 2-core machine when each forked replica paid it)."""
    os.environ.setdefault("RUST_LOG", "error")
    import torch
    import torchft  # noqa: F401
    from ..integrations import torchft as _ft  # noqa: F401
    from .digits import load_data, make_model
    torch.set_num_threads(1)
    X, y, _, _ = load_data()
    model = make_model("cnn", width=8)
    for opt in (torch.optim.AdamW(model.parameters()), torch.optim.SGD(model.parameters())):
        torch.nn.functional.cross_entropy(model(X[:4]), y[:4]).backward()
        opt.step()
        opt.zero_grad()


def _run(cfg: Dict[str, Any], fault: bool, timeout: float) -> Dict[str, Any]:
    """One run in a worker process: its replicas' results, whether their weights are equal, and
    its wall time."""
    d = DEFAULTS
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="oktopk-faults-") as work:
        res = run_cluster(cfg, d["replicas"], d["victim"] if fault else None,
                          int(cfg["syncs"] * d["kill_at"]), int(cfg["syncs"] * d["restart_at"]),
                          work, timeout)
        same = _weights_equal(res)
    return {"results": res, "same_weights": same, "wall_s": time.monotonic() - t0}


def main(args) -> int:
    import concurrent.futures as cf
    import multiprocessing as mp
    t_all = time.monotonic()
    d = DEFAULTS
    S, H = args.steps, args.sync_every
    base = dict(model="digits", inner=d["inner"], lr=args.lr, outer_lr=d["outer_lr"],
                outer_momentum=d["outer_momentum"], batch=d["batch"], width=d["width"],
                seed=args.seed, audit=True, algorithm=args.algorithm, density=args.density,
                options={"wire_format": args.wire_format},
                timeout=5.0, quorum_timeout=60.0)
    n = _n_params(d["width"])
    print(f"oktopk-bench faults: {d['replicas']} replicas x digits CNN ({n:,} parameters), "
          f"{S} inner steps each; replica {d['victim']} killed at 25% of the syncs, restarted "
          f"at 50%", flush=True)
    plan = {RUNS[0]: ("sparse", H, False), RUNS[1]: ("sparse", H, True),
            RUNS[3]: ("dense", d["dense_every"], True)}
    rows: Dict[str, Dict[str, Any]] = {}
    runs: Dict[str, Dict[str, Any]] = {}

    def submit(pool: Any, name: str) -> Any:
        mode, every, fault = plan[name]
        cfg = dict(base, mode=mode, sync_every=every, syncs=S // every)
        runs[name] = {"run": name, "config": cfg, "fault": fault}
        return pool.submit(_run, cfg, fault, args.timeout)

    def finish(name: str, fut: Any) -> None:
        out = fut.result(timeout=args.timeout + 60)
        res = out["results"]
        if not out["same_weights"]:
            raise RuntimeError(f"{name}: the replicas that finished differ in weights")
        row = summarize(name, res, out["wall_s"])
        row["curve"] = curve(res[0])
        row["participants"] = [h["P"] for h in res[0]["history"] if h["committed"]]
        rows[name] = row
        runs[name]["replicas"] = [{k: r.get(k) for k in (
            "history", "evals", "eval_steps", "bytes", "heals", "local_steps", "step")}
            for r in res]
        print(f"  {name}: final test loss {row['final_loss']:.4f}, "
              f"{row['bytes_per_step']:,.0f} B/replica/step, {row['syncs']} syncs"
              + (f", replica 3 back at sync {row['rejoined_at']}" if row["rejoined_at"] else "")
              + f", {row['wall_s']:.1f} s", flush=True)

    # two runs at a time, each in a worker that forks its replicas: (a) with (b), then (c),
    # whose interval needs (b)'s bytes, with (d)
    try:
        with cf.ProcessPoolExecutor(max_workers=2, mp_context=mp.get_context("spawn"),
                                    initializer=_warm) as pool:
            fa, fb = submit(pool, RUNS[0]), submit(pool, RUNS[1])
            finish(RUNS[1], fb)
            hd = same_bytes_interval(S, n, rows[RUNS[1]]["bytes_per_step"],
                                     rows[RUNS[1]]["participants"])
            plan[RUNS[2]] = ("dense", hd, True)
            fc = submit(pool, RUNS[2])
            finish(RUNS[0], fa)
            fd = submit(pool, RUNS[3])
            finish(RUNS[2], fc)
            finish(RUNS[3], fd)
    except Exception as exc:  # noqa: BLE001 - one line, as a user sees it
        print(f"oktopk-bench faults: FAILED: {type(exc).__name__}: "
              f"{' '.join(str(exc).split())[:800]}", file=sys.stderr)
        return 1
    ref = rows[RUNS[0]]["final_loss"]
    for row in rows.values():
        row["vs_fault_free_pct"] = 100 * (row["final_loss"] / ref - 1)
    order = [rows[r] for r in RUNS]
    wall = time.monotonic() - t_all
    print()
    print(format_table(order))
    a, b, c, dd = order
    goals = {"faulted_within_2pct": abs(b["vs_fault_free_pct"]) <= 2.0,
             "sparse_beats_dense_same_bytes": b["final_loss"] < c["final_loss"],
             "sparse_fewer_bytes_than_dense_H4": b["bytes_per_step"] < dd["bytes_per_step"]}
    print(f"\nfaulted sparse vs fault-free: {b['vs_fault_free_pct']:+.2f}% "
          f"({'within' if goals['faulted_within_2pct'] else 'outside'} 2%); "
          f"vs dense at the same bytes: {b['final_loss']:.4f} vs {c['final_loss']:.4f} "
          f"({'beats' if goals['sparse_beats_dense_same_bytes'] else 'does not beat'} it); "
          f"bytes per step {b['bytes_per_step']:,.0f} vs dense H=4 {dd['bytes_per_step']:,.0f} "
          f"({dd['bytes_per_step'] / max(1.0, b['bytes_per_step']):.1f}x fewer); "
          f"total {wall:.0f} s")
    os.makedirs(args.out, exist_ok=True)
    png = plot(order, os.path.join(args.out, "faults.png"), S // 4, S // 2,
               f"digits CNN, {d['replicas']} torchft replicas, {args.algorithm} "
               f"d={args.density:g}")
    record = {**records.header("faults", args), "config": {**d, **base, "steps": S,
                                                           "sync_every": H, "n_params": n},
              "summary": order, "goals": goals, "wall_s": wall,
              "runs": [runs[r] for r in RUNS], "plot": png}
    path = records.write(args.json or os.path.join(args.out, "faults.json"), record,
                         compact=True)
    print(f"wrote {path} and {png}")
    return 0
