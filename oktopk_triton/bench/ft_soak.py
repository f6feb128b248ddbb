"""A soak of seeded fault schedules against the real ``torchft_lighthouse`` (``make soak``).

    python -m oktopk_triton.bench.ft_soak --schedules 20 [--jobs 3] [--json PATH]

Each schedule is one small run (3 replicas of the MLP, :class:`SparseDiLoCo` with Ok-Topk at 10%,
``syncs`` syncs of 2 inner steps; odd seeds as Streaming DiLoCo, 2 fragments, each fragment's
reduce started one inner step early) with one fault drawn from its seed: a SIGKILL inside a sync's
collectives or between syncs, with or without a restart that rejoins, or a collective that fails
on every replica, retried at once or at the next sync. A schedule passes when every replica that
finished ends at the same step with the same weights, every committed sync was conserved over
its participants (relative error <= 1e-6, checked before it committed), the victim of a
restart was healed as a newcomer, and nothing hung (every wait is bounded). Replicas are forked
from worker processes that hold torch already, so a schedule costs its training, not start-ups.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import random
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

KINDS = ("kill-in-sync", "kill-in-sync-rejoin", "kill-between", "kill-between-rejoin",
         "fail-commit")
SYNCS = 6
WAIT = 120.0


def schedule(seed: int) -> Dict[str, Any]:
    """The fault of schedule ``seed``: its kind (seed mod 5, so any 5 consecutive seeds cover
    every kind), the victim, where it strikes and when the victim rejoins."""
    rng = random.Random(seed)
    kind = KINDS[seed % len(KINDS)]
    sync = rng.randint(2, 3)
    return {"seed": seed, "kind": kind, "victim": rng.randrange(3), "sync": sync,
            "collective": rng.randint(1, 4), "step": 2 * sync - rng.randint(1, 2),
            "rejoin_at": sync + 1, "retry": rng.random() < 0.5, "fragments": 1 + seed % 2}


def _fault(s: Dict[str, Any]) -> Dict[str, Any]:
    if s["kind"].startswith("kill-in-sync"):
        return {"die": {"sync": s["sync"], "collective": s["collective"]}}
    if s["kind"].startswith("kill-between"):
        return {"die": {"step": s["step"]}}
    return {}


def run_schedule(seed: int, workdir: str, fork: bool = True) -> Dict[str, Any]:
    """Run schedule ``seed``; returns its record (``ok``, ``why``, the counts)."""
    from .ft_cluster import ClusterError, Lighthouse, Replica, wait_for, wait_ready
    s = schedule(seed)
    d = tempfile.mkdtemp(prefix=f"soak{seed}-", dir=workdir)
    gates = {k: os.path.join(d, k) for k in ("all", "rejoin")}
    cfg = dict(syncs=SYNCS, sync_every=2, density=0.1, algorithm="oktopk", audit=True,
               min_replicas=2, seed=seed, hold=[{"at": 0, "file": gates["all"]},
                                                {"at": s["rejoin_at"], "file": gates["rejoin"]}])
    if s["fragments"] > 1:         # a sync every 2 inner steps still: one fragment each
        cfg.update(fragments=s["fragments"], sync_every=2 * s["fragments"], fragment_sync_delay=1)
    if s["kind"] == "fail-commit":
        cfg.update(fail={"sync": s["sync"], "collective": s["collective"]}, retry=s["retry"])
    t0 = time.monotonic()
    rec: Dict[str, Any] = {**s, "ok": False, "why": None}
    try:
        with Lighthouse(min_replicas=2) as lh:
            def start(i: int, **extra: Any) -> Replica:
                return Replica(dict(cfg, replica=i, lighthouse=lh.address, **extra), d, fork)
            reps = [start(i, **(_fault(s) if i == s["victim"] else {})) for i in range(3)]
            for r in reps:
                wait_ready(r, WAIT)
            open(gates["all"], "w").close()
            rejoin = s["kind"].endswith("rejoin")
            if s["kind"] != "fail-commit":
                code = reps[s["victim"]].proc.wait(timeout=WAIT)
                if code != -9:
                    raise ClusterError(f"the victim exited with {code}, not by SIGKILL")
                first = (s["victim"] + 1) % 3
                wait_for(reps, first, s["rejoin_at"], WAIT)
                if rejoin:
                    reps[s["victim"]] = start(s["victim"])
                    wait_ready(reps[s["victim"]], WAIT)
                else:
                    reps.pop(s["victim"])
            open(gates["rejoin"], "w").close()
            results = [r.result(WAIT) for r in reps]
        rec.update(_judge(s, results))
    except Exception as exc:  # noqa: BLE001 - a schedule's failure is its record
        rec["why"] = f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    rec["seconds"] = round(time.monotonic() - t0, 2)
    return rec


def _judge(s: Dict[str, Any], results: List[Dict[str, Any]]) -> Dict[str, Any]:
    import torch
    bad = [r for r in results if r["returncode"] != 0]
    if bad:
        return {"why": f"a replica failed: {bad[0].get('error') or bad[0]['log'][-300:]}"}
    weights = [torch.load(r["weights"], weights_only=True) for r in results]
    same = all(w.keys() == weights[0].keys() and all(torch.equal(w[k], weights[0][k])
                                                     for k in w) for w in weights)
    steps = {r["step"] for r in results}
    hist = [h for r in results for h in r["history"]]
    errs = [h["relative_error"] for h in hist if h["committed"]]
    worst = max((e for e in errs if e is not None), default=None)
    out = {"replicas": len(results), "max_relative_error": worst,
           "rolled_back": max(sum(not h["committed"] for h in r["history"]) for r in results),
           "heals": sum(1 for h in hist if h["healed"]),
           "committed": max(sum(h["committed"] for h in r["history"]) for r in results)}
    newcomer = any(h["healed"] and h["newcomer"] for h in hist)
    out["recovery_s"] = _recovery(results)
    why = None
    if not same:
        why = "the replicas' weights differ"
    elif steps != {SYNCS}:
        why = f"replicas ended at steps {sorted(steps)}"
    elif any(e is None for e in errs) or worst is None or worst > 1e-6:
        why = f"a committed sync was not conserved (max relative error {worst})"
    elif s["kind"].endswith("rejoin") and not newcomer:
        why = "the restarted replica was not healed as a newcomer"
    return {**out, "ok": why is None, "why": why}


def _recovery(results: List[Dict[str, Any]]) -> Optional[float]:
    """Seconds from a sync that did not commit to the next one that did (the longest, over the
    replicas): how long the survivors took to go on. None without a failed sync."""
    worst = None
    for r in results:
        h = [x for x in r["history"] if x.get("time")]
        for a, b in zip(h, h[1:]):
            if not a["committed"] and b["committed"]:
                worst = max(worst or 0.0, b["time"] - a["time"])
    return None if worst is None else round(worst, 2)


def run(seeds: List[int], jobs: int) -> List[Dict[str, Any]]:
    """Every schedule of ``seeds``, ``jobs`` at a time (worker processes that fork replicas),
    in a working directory (gates, weights, logs) removed when they are done."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(prefix="oktopk-soak-") as workdir, \
            cf.ProcessPoolExecutor(max_workers=jobs, mp_context=ctx, initializer=_warm) as pool:
        futs = [pool.submit(run_schedule, seed, workdir) for seed in seeds]
        return [f.result(timeout=len(seeds) * WAIT) for f in futs]


def _warm() -> None:
    """Import once per worker what every forked replica needs."""
    os.environ.setdefault("RUST_LOG", "error")
    import torch
    import torchft  # noqa: F401
    from ..integrations import torchft as _ft  # noqa: F401
    torch.set_num_threads(1)


def main(argv: List[str] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oktopk_triton.bench.ft_soak",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--schedules", type=int, default=20, help="how many (seeds 0..N-1)")
    p.add_argument("--first", type=int, default=0, help="the first seed")
    p.add_argument("--seeds", type=int, nargs="*", default=None,
                   help="these seeds instead of --first/--schedules")
    p.add_argument("--jobs", type=int, default=3, help="schedules at a time")
    p.add_argument("--json", default=None, help="write the records here")
    args = p.parse_args(argv)
    t0 = time.monotonic()
    seeds = args.seeds or list(range(args.first, args.first + args.schedules))
    recs = run(seeds, args.jobs)
    wall = time.monotonic() - t0
    for r in recs:
        state = "ok  " if r["ok"] else "FAIL"
        print(f"{state} seed {r['seed']:2d} {r['kind']:<20} victim {r['victim']} "
              f"rolled back {r.get('rolled_back', '-')} heals {r.get('heals', '-')} "
              f"max rel err {r.get('max_relative_error')} went on after "
              f"{r.get('recovery_s')} s; {r['seconds']:.1f} s"
              + (f"  {r['why']}" if r["why"] else ""))
    passed = sum(r["ok"] for r in recs)
    worst = max((r.get("max_relative_error") or 0.0 for r in recs), default=0.0)
    slowest = max((r.get("recovery_s") or 0.0 for r in recs), default=0.0)
    print(f"{passed} of {len(recs)} schedules passed; max relative error {worst:.3g}; "
          f"survivors went on within {slowest:.1f} s of a failed sync; {wall:.0f} s")
    if args.json:
        from . import records
        records.write(args.json, {**records.header("faults-soak", vars(args)),
                                  "summary": {"passed": passed, "schedules": len(recs),
                                              "max_relative_error": worst,
                                              "max_recovery_s": slowest},
                                  "wall_s": wall, "schedules": recs})
    return 0 if passed == len(recs) else 1


if __name__ == "__main__":
    sys.exit(main())
