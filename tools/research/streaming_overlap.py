"""Streaming DiLoCo's overlap over a slow link: an interval's wall time with a fragment's sync in
flight, against the same inner steps without communication.

    python -m tools.research.streaming_overlap [--link-ms 30] [--width 2048] [--batch 256]
                                               [--syncs 12] [--sync-every 8] [--json OUT.json]

Two replica processes (``oktopk_triton.bench.ft_replica``) on the real ``torchft_lighthouse``
train the MLP of the fault tests at ``--width`` with SGD, in three runs: ``local`` (the inner
steps alone: no Manager, no sync), ``blocking`` (SparseDiLoCo, 2 fragments, ``--sync-every``
H, ``fragment_sync_delay=0``: each fragment's sync waits for its reduce) and ``overlapped``
(the same with ``fragment_sync_delay = H/2 - 1``, the most torchft allows: the reduce runs on a
thread while that many inner steps go on). Every primitive of the sparse reduce first sleeps
``--link-ms`` (``link_delay_ms``), as over a slow link. An interval is the ``H / 2`` inner
steps between two fragment syncs; its wall time is read from each replica's step times (the
first two intervals left out), and the table gives the median and the 10th-90th percentiles
over both replicas. The overlap can hide a sync only when the delay's inner steps take longer
than the sync's link time (Ok-Topk's steady sync makes several collectives, each ``--link-ms``).
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
from typing import Any, Dict, List

from oktopk_triton.bench import records
from oktopk_triton.bench.ft_cluster import Lighthouse, Replica

FRAGMENTS = 2


def runs(sync_every: int) -> Dict[str, Dict[str, Any]]:
    """The three runs at ``sync_every``: local, blocking, and overlapped as far as torchft
    allows (``fragment_sync_delay < sync_every / fragments``)."""
    return {"local": dict(mode="local"),
            "blocking": dict(mode="sparse", fragment_sync_delay=0),
            "overlapped": dict(mode="sparse",
                               fragment_sync_delay=sync_every // FRAGMENTS - 1)}


def intervals(step_times: List[float], interval: int = 4, skip: int = 2) -> List[float]:
    """The wall time of each interval of ``interval`` inner steps, the first ``skip`` left out
    (``step_times[0]`` is the start, then one time per inner step)."""
    k = (len(step_times) - 1) // interval
    return [step_times[(i + 1) * interval] - step_times[i * interval] for i in range(skip, k)]


def run(name: str, args: Any, workdir: str) -> Dict[str, Any]:
    cfg = dict(model="mlp", width=args.width, batch=args.batch, syncs=args.syncs,
               sync_every=args.sync_every, fragments=FRAGMENTS, density=0.1,
               algorithm="oktopk", audit=False, min_replicas=2, lr=0.05,
               link_delay_ms=args.link_ms, **runs(args.sync_every)[name])
    with Lighthouse(min_replicas=2) as lh:
        reps = [Replica(dict(cfg, replica=i, lighthouse=lh.address), workdir) for i in range(2)]
        results = [r.result(timeout=args.timeout) for r in reps]
    bad = [r.get("error") or r.get("log") for r in results if r.get("returncode") != 0]
    if bad:
        raise SystemExit(f"streaming_overlap: the {name} run failed: {bad[0]}")
    every = args.sync_every // FRAGMENTS
    times = sorted(t for r in results for t in intervals(r["step_times"], every))
    q = statistics.quantiles(times, n=10)
    return {"run": name, "sync_every": args.sync_every,
            "fragment_sync_delay": cfg.get("fragment_sync_delay"),
            "intervals": len(times), "median_ms": 1000 * statistics.median(times),
            "p10_ms": 1000 * q[0], "p90_ms": 1000 * q[-1],
            "committed": [sum(h["committed"] for h in r["history"]) for r in results]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--link-ms", type=float, default=30.0)
    ap.add_argument("--width", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--syncs", type=int, default=12, help="committed fragment syncs per run")
    ap.add_argument("--sync-every", type=int, default=8,
                    help="inner steps per sync of the whole model (an even number >= 4)")
    ap.add_argument("--timeout", type=float, default=300.0)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.sync_every < 4 or args.sync_every % FRAGMENTS:
        ap.error(f"--sync-every must be an even number >= 4, got {args.sync_every}")
    with tempfile.TemporaryDirectory(prefix="oktopk-overlap-") as d:
        rows = [run(name, args, d) for name in runs(args.sync_every)]
    base = rows[0]["median_ms"]
    for r in rows:
        r["vs_local"] = r["median_ms"] / base
    print(records.table(rows, [("run", lambda r: r["run"]),
                               ("interval ms (median)", lambda r: f"{r['median_ms']:.1f}"),
                               ("p10-p90 ms", lambda r: f"{r['p10_ms']:.1f}-{r['p90_ms']:.1f}"),
                               ("vs local", lambda r: f"{r['vs_local']:.2f}"),
                               ("intervals", lambda r: r["intervals"])]))
    if args.json:
        records.write(args.json, {**records.header("streaming-overlap", args), "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
