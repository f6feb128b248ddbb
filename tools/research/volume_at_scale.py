"""Volume at scale: the bytes each rank RECEIVES per sync of the local steps, Ok-Topk against
TopkA (the allgather exchange SparseLoCo uses), P = 4 .. 64 ranks of a LocalCluster.

    python -m tools.research.volume_at_scale [--world-sizes 4 8 16 32 64] [--numel 65536]
        [--densities 0.08 0.008] [--sync-every 4] [--syncs 3] [--wire-format fp32]
        [--json OUT.json] [--markdown]

Each run is real local steps: every rank holds one parameter vector of ``numel`` entries, takes
``sync_every`` AdamW steps on its own synthetic gradient (a per-coordinate scale shared by the
ranks times a common direction plus rank noise: ``s_i * (c_i + noise * xi_ri)``), then
``SparseAllreduce(..., sync_every=H).reduce_updates`` reduces the pseudo-gradient at ``density``
per sync. The communicators only count bytes SENT, so each rank's communicator is wrapped
(:func:`count_received`) to add up the bytes of the messages it gets: a send/recv batch's
receive buffers from other ranks, an allgather's output less its own chunk, an alltoall's output
less its own chunk, a non-root broadcast's tensor, and for an allreduce the ring's 2(P-1)/P of
the tensor (LocalCluster does not run a ring; every ring rank receives what it sends). Measured
per sync (the mean over the syncs after the first; the largest rank) beside the formula: the sum
of ``received`` over the algorithm's ``schedule`` for that rank (oktopk_triton/algorithms/
schedule.py).

At equal density TopkA delivers the union of the ranks' top-k (up to P·k entries), Ok-Topk the
global top-k (k entries): not the same quality. The ``equal-output`` row runs Ok-Topk at
k = the union size TopkA delivered, the comparison in TopkA's favour (see
docs/research/volume-at-scale.md).
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from oktopk_triton import SparseAllreduce
from oktopk_triton.module import keywords
from oktopk_triton.algorithms._wire import packed
from oktopk_triton.algorithms.schedule import schedule_of
from oktopk_triton.bench import records
from oktopk_triton.comm.base import ring_allreduce_bytes, tensor_bytes
from oktopk_triton.comm.local import LocalCluster

ALGORITHMS = ("oktopk", "topka")


# -- received bytes, counted from the messages a rank gets -----------------------------------
def count_received(comm) -> None:
    """Wrap ``comm``'s primitives (on the instance) so that ``comm.bytes_received`` adds up the
    bytes this rank receives (see the module docstring for each primitive)."""
    comm.bytes_received = 0
    me, P = comm.rank, comm.world_size
    inner = {name: getattr(comm, name) for name in
             ("send_recv", "allgather", "allreduce", "alltoall", "broadcast")}

    def send_recv(sends, recvs):
        recvs = list(recvs)
        inner["send_recv"](sends, recvs)
        comm.bytes_received += sum(tensor_bytes(t) for p, t in recvs if p != me)

    def allgather(output, input):
        inner["allgather"](output, input)
        comm.bytes_received += tensor_bytes(output) - tensor_bytes(input)

    def allreduce(tensor):
        inner["allreduce"](tensor)
        comm.bytes_received += ring_allreduce_bytes(tensor_bytes(tensor), P)

    def alltoall(output, input):
        inner["alltoall"](output, input)
        comm.bytes_received += (P - 1) * tensor_bytes(output) // P

    def broadcast(tensor, root=0):
        inner["broadcast"](tensor, root)
        comm.bytes_received += tensor_bytes(tensor) if me != root and P > 1 else 0

    for f in (send_recv, allgather, allreduce, alltoall, broadcast):
        setattr(comm, f.__name__, f)


def formula_received(algorithm: str, n: int, k: int, P: int, rank: int,
                     wire_format: str = "fp32") -> int:
    """Bytes ``rank`` receives in a steady step, from the algorithm's schedule (a collective
    receives what it counts as sent; a send/recv batch its ``received``)."""
    opts = {"wire_format": wire_format} if packed(wire_format) else {}
    return sum(s.received for s in schedule_of(algorithm, n, k, P, rank=rank, **opts))


# -- one run: local steps on P ranks --------------------------------------------------------------
def _gradient(n: int, rank: int, call: int, noise: float) -> torch.Tensor:
    scale = torch.randn(n, generator=torch.Generator().manual_seed(0)).exp()
    common = torch.randn(n, generator=torch.Generator().manual_seed(1 + call))
    own = torch.randn(n, generator=torch.Generator().manual_seed(10_000 * (rank + 1) + call))
    return scale * (common + noise * own)


def _rank_body(comm, algorithm: str, n: int, density: float, H: int, syncs: int, noise: float,
               wire_format: str) -> Dict[str, Any]:
    count_received(comm)
    w = torch.nn.Parameter(torch.zeros(n))
    opt = torch.optim.AdamW([w], lr=1e-3, weight_decay=0.0)
    opts: Dict[str, Any] = {"backend": "torch"} if algorithm == "oktopk" else {}
    if packed(wire_format):
        opts["wire_format"] = wire_format
    sar = SparseAllreduce([w], comm=comm, density=density,
                          **keywords(algorithm, {**opts, "sync_every": H}))
    received, sent, delivered = [], [], []
    for call in range(H * syncs):
        w.grad = _gradient(n, comm.rank, call, noise)
        r0, s0 = comm.bytes_received, comm.bytes_sent
        sar.reduce_updates(opt)
        if sar.stats["synced"]:
            received.append(comm.bytes_received - r0)
            sent.append(comm.bytes_sent - s0)
            delivered.append(int(sar.stats["global_selected"]))
    return dict(k=sar.k, received=received, sent=sent, delivered=delivered)


def measure(algorithm: str, P: int, n: int, density: float, H: int = 4, syncs: int = 3,
            noise: float = 1.0, wire_format: str = "fp32") -> Dict[str, Any]:
    """One configuration on P ranks: per-sync received bytes (mean over the syncs after the
    first, the largest rank), sent bytes, entries delivered, and the formula."""
    res = LocalCluster(P, timeout=600).run(_rank_body, algorithm, n, density, H, syncs, noise,
                                           wire_format)
    steady = slice(1, None) if syncs > 1 else slice(0, None)

    def per_rank(key):
        return [sum(r[key][steady]) / len(r[key][steady]) for r in res]
    recv, sent = per_rank("received"), per_rank("sent")
    k = res[0]["k"]
    formula = [formula_received(algorithm, n, k, P, r, wire_format) for r in range(P)]
    return dict(algorithm=algorithm, P=P, numel=n, density=density, k=k, sync_every=H,
                syncs=syncs, noise=noise, wire_format=wire_format,
                received_per_sync=max(recv), received_mean=sum(recv) / P,
                received_formula=max(formula), sent_per_sync=max(sent),
                received_sum=sum(recv), sent_sum=sum(sent),
                delivered=sum(res[0]["delivered"][steady]) / len(res[0]["delivered"][steady]),
                matches_formula=all(abs(a - b) < 0.5 for a, b in zip(recv, formula)))


def sweep(world_sizes: List[int], n: int, densities: List[float], H: int, syncs: int,
          noise: float, wire_format: str, equal_output: bool = True,
          log=print) -> List[Dict[str, Any]]:
    """For each density and P: Ok-Topk and TopkA at that density, and (``equal_output``)
    Ok-Topk at k = the union size TopkA delivered. One row per (density, P)."""
    rows = []
    for d in densities:
        for P in world_sizes:
            t0 = time.perf_counter()
            ok = measure("oktopk", P, n, d, H, syncs, noise, wire_format)
            ta = measure("topka", P, n, d, H, syncs, noise, wire_format)
            row = dict(P=P, density=d, numel=n, k=ok["k"], oktopk=ok, topka=ta,
                       ratio=ok["received_per_sync"] / ta["received_per_sync"])
            if equal_output:
                d_eq = min(1.0, max(ta["delivered"], 1) / n)
                eq = measure("oktopk", P, n, d_eq, H, syncs, noise, wire_format)
                row.update(oktopk_equal_output=eq,
                           ratio_equal_output=eq["received_per_sync"] / ta["received_per_sync"])
            rows.append(row)
            log(f"  P={P:3d} density {d:g}: Ok-Topk {ok['received_per_sync']:,.0f} B, TopkA "
                f"{ta['received_per_sync']:,.0f} B, ratio {row['ratio']:.4f}"
                + (f", at equal output {row['ratio_equal_output']:.3f}" if equal_output else "")
                + f"  ({time.perf_counter() - t0:.0f} s)")
    return rows


# -- the table ------------------------------------------------------------------------------------
def _kb(x: float) -> str:
    return f"{x / 1e3:,.1f}"


COLUMNS = [
    ("density", lambda r: f"{r['density']:g}"), ("P", lambda r: str(r["P"])),
    ("k", lambda r: str(r["k"])),
    ("Ok-Topk kB", lambda r: _kb(r["oktopk"]["received_per_sync"])),
    ("formula", lambda r: _kb(r["oktopk"]["received_formula"])),
    ("TopkA kB", lambda r: _kb(r["topka"]["received_per_sync"])),
    ("formula ", lambda r: _kb(r["topka"]["received_formula"])),
    ("Ok-Topk / TopkA", lambda r: f"{r['ratio']:.4f}"),
    ("TopkA delivers", lambda r: f"{r['topka']['delivered']:,.0f}"),
    ("Ok-Topk at that k, kB", lambda r: _kb(r["oktopk_equal_output"]["received_per_sync"])
     if "oktopk_equal_output" in r else "-"),
    ("ratio at equal output", lambda r: f"{r['ratio_equal_output']:.3f}"
     if "ratio_equal_output" in r else "-"),
]


def main(argv: Optional[List[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--numel", type=int, default=1 << 16)
    p.add_argument("--densities", type=float, nargs="+", default=[0.08, 0.008])
    p.add_argument("--sync-every", type=int, default=4)
    p.add_argument("--syncs", type=int, default=3, help="syncs per run (the first is skipped)")
    p.add_argument("--noise", type=float, default=1.0,
                   help="rank noise against the common direction (sets TopkA's union size)")
    p.add_argument("--wire-format", default="fp32")
    p.add_argument("--no-equal-output", action="store_true",
                   help="skip Ok-Topk at TopkA's delivered k")
    p.add_argument("--json", default=None, help="write the record here")
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    print(f"volume at scale: numel {a.numel}, H={a.sync_every}, wire {a.wire_format}, "
          f"P {a.world_sizes}, densities {a.densities}")
    rows = sweep(a.world_sizes, a.numel, a.densities, a.sync_every, a.syncs, a.noise,
                 a.wire_format, equal_output=not a.no_equal_output)
    print("\nbytes each rank receives per sync (largest rank; kB = 1000 B)")
    print(records.table(rows, COLUMNS, markdown=a.markdown))
    bad = [(r["P"], r["density"], alg) for r in rows for alg in ("oktopk", "topka")
           if not r[alg]["matches_formula"]]
    if bad:
        print(f"measured != formula for {bad}")
    if a.json:
        rec = {**records.header("volume-at-scale", vars(a)), "rows": rows}
        records.write(a.json, rec)
        print(f"results: {a.json}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
