"""``oktopk-bench kernels``: every selection kernel, and the whole selection against torch.topk.

For each n (default 2^24, 2^26, 2^28 on CUDA; 2^16 on CPU), on the same input (acc = residual +
grad, k = density * n, P regions), it times each selection kernel and the torch ops it
replaced (the list, with each row's bytes formula, is in the note linked below).

Every row has ``kernel`` (a stable id), ``n``, ``ms`` (median), its bytes formula, GB/s and
the % of the copy bandwidth of the same run.  CUDA: CUDA events after warm-up, median of >= 10
repeats; JSON to ``bench/results/kernels/gpu-kernels-<date>.json`` unless ``--json`` says
otherwise.  CPU: the torch path (or the Triton interpreter) at small n, a functionality check
and no performance claim.  The kernel goals are printed (and stored under ``goals``) against the
rows.

Measured why: docs/research/design-notes.md, ``oktopk_triton/bench/kernels.py``.
"""
from __future__ import annotations

import argparse
import sys
import datetime
import math
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from . import _args as A
from . import records

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_DEFAULT_SIZES = [1 << 16]
GPU_DEFAULT_SIZES = [1 << 24, 1 << 26, 1 << 28]
MIN_CUDA_REPEATS = 10

# The kernel goals (H100): threshold <= 0.8 ms at 2^28 and >= 7x torch.topk there, >= 5x at
# 2^24 and 2^26; the fused select >= 80% of the copy bandwidth on its bytes at 2^28.
THRESHOLD_MS_GOAL = {1 << 28: 0.8}
THRESHOLD_SPEEDUP_GOAL = {1 << 24: 5.0, 1 << 26: 5.0, 1 << 28: 7.0}
FUSED_PCT_COPY_GOAL = {1 << 28: 80.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=A.positive_int, nargs="+", default=None,
                   help="elements, one or more (default 2^24 2^26 2^28 on CUDA, 2^16 on CPU)")
    p.add_argument("--density", type=A.density, default=0.01, help="k / n (default 0.01)")
    p.add_argument("--dtype", choices=list(DTYPES), nargs="+", default=["fp32", "bf16"],
                   help="gradient dtypes of the fused select rows (default fp32 bf16)")
    p.add_argument("--regions", type=A.positive_int, default=8,
                   help="regions P of the fused select (default 8)")
    p.add_argument("--repeats", type=A.positive_int, default=None,
                   help=f"timed repeats (default 20 on CUDA, at least {MIN_CUDA_REPEATS}; "
                        "5 on CPU)")
    p.add_argument("--warmup", type=A.nonneg_int, default=3,
                   help="untimed warm-up runs (default 3)")
    p.add_argument("--device", type=A.device, default=None,
                   help="cuda or cpu (default: cuda when available)")
    p.add_argument("--backend", choices=["auto", "triton", "torch"], default=None,
                   help="kernel backend (default: auto on CUDA, torch on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=A.out_path, default=None, metavar="PATH",
                   help="write the results as JSON here (default on CUDA: "
                        "bench/results/kernels/gpu-kernels-<date>.json; none on CPU)")


def _timer(device: torch.device, fn: Callable[[], object], repeats: int, warmup: int,
           setup: Optional[Callable[[], object]] = None) -> List[float]:
    """Seconds per call; ``setup`` runs untimed before each call (CUDA: synchronised first)."""
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    times = []
    cuda = device.type == "cuda"
    for _ in range(repeats):
        if setup:
            setup()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return times


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"CPU ({platform.processor() or platform.machine()}, {os.cpu_count()} cores, " \
           f"torch threads {torch.get_num_threads()})"


def _abs_bits(v: float) -> int:
    return int(torch.tensor([abs(v)], dtype=torch.float32).view(torch.int32))


class _Setup:
    """One n's inputs (gradients per dtype, residual, velocity, their sum ``acc``, the threshold
    and the selection buffers) and the rows timed on them (:meth:`add`)."""

    def __init__(self, n, density, grad_dtypes, regions, repeats, warmup, dev, backend, seed):
        from oktopk_triton import kernels as K
        self.K, self.n, self.dev, self.backend = K, n, dev, backend
        self.repeats, self.warmup, self.grad_dtypes = repeats, warmup, grad_dtypes
        gen = torch.Generator(device=dev).manual_seed(seed)
        grad32 = torch.randn(n, device=dev, generator=gen, dtype=torch.float32)
        self.grads = {gd: grad32 if gd == "fp32" else grad32.to(DTYPES[gd]) for gd in grad_dtypes}
        self.residual0 = torch.randn(n, device=dev, generator=gen, dtype=torch.float32) * 0.5
        self.velocity0 = torch.randn(n, device=dev, generator=gen, dtype=torch.float32) * 0.1
        self.residual, self.velocity = self.residual0.clone(), self.velocity0.clone()
        self.acc = self.residual0 + self.grads[grad_dtypes[0]].float()
        self.k = k = max(1, int(round(density * n)))
        self.P = P = max(1, int(regions))
        self.region_offsets = torch.tensor([(n * p) // P for p in range(P + 1)],
                                           dtype=torch.int64, device=dev)
        self.info: Dict = {}
        self.threshold = K.magnitude_threshold(self.acc, k, backend=backend, info=self.info)
        self.thr_rows = self.threshold.reshape(1).expand(P).contiguous()
        self.capacity = int(math.ceil(1.5 * k / P)) + 16
        self.sel_out = K.empty_selection(P, self.capacity, dev)
        self.hist = torch.zeros(P, K.SELECT_HIST_BINS, dtype=torch.int32, device=dev)
        # untimed host reads: the selected count and the threshold's own statistics
        info = self.info
        self.selected = int(((self.acc.abs() >= self.threshold) & (self.acc != 0)).sum())
        self.window_ok = bool(info["window_ok"]) if "window_ok" in info else None
        self.cand_count = int(info["stats"][1]) if "stats" in info else 0
        self.S = int(info.get("S", 0))
        self.rows: List[Dict] = []

    def reset(self):
        self.residual.copy_(self.residual0)

    def reset_all(self):
        self.residual.copy_(self.residual0)
        self.velocity.copy_(self.velocity0)
        self.hist.zero_()

    def add(self, kernel, name, fn, setup, nbytes, formula, **variant):
        times = _timer(self.dev, fn, self.repeats, self.warmup, setup)
        med = statistics.median(times)
        self.rows.append({"kernel": kernel, "name": name, "n": self.n, **variant,
                          "ms": med * 1e3, "median_ms": med * 1e3, "min_ms": min(times) * 1e3,
                          "repeats": len(times), "bytes": int(nbytes), "bytes_formula": formula,
                          "gbps": nbytes / med / 1e9})
        if self.dev.type == "cuda":
            torch.cuda.empty_cache()


def _time_references(b: _Setup) -> None:
    """copy, read, torch.topk (+ gather) and the two threshold searches."""
    K, acc, n, k, backend = b.K, b.acc, b.n, b.k, b.backend
    dst = torch.empty_like(acc)
    b.add("copy", "copy", lambda: dst.copy_(acc), None, 8 * n, "8n (read + write fp32)")
    b.add("read", "read (amax)", lambda: acc.amax(), None, 4 * n, "4n (read fp32)")
    b.add("torch_topk", "torch.topk", lambda: torch.topk(acc.abs(), k, sorted=False), None,
          4 * n, "4n (one read of acc; abs inside the time)")

    def topk_gather():
        idx = torch.topk(acc.abs(), k, sorted=False).indices
        return acc.gather(0, idx)

    b.add("topk_gather", "topk + gather", topk_gather, None, 4 * n + 24 * k,
          "4n + 24k (read acc; topk writes fp32 values + int64 indices; gather reads them, "
          "writes k values)")
    b.add("hist_threshold", "hist threshold",
          lambda: K.histogram_threshold(acc, k, backend=backend),
          None, 8 * n, "2 * 4n (two histogram passes over acc)")
    b.add("magnitude_threshold", "magnitude_threshold",
          lambda: K.magnitude_threshold(acc, k, backend=backend), None,
          4 * n + 4 * b.S + 8 * b.cand_count,
          f"4n + 4S + 8*candidates (one pass; S = {b.S} samples, {b.cand_count} candidates "
          f"written and sorted)", window_ok=b.window_ok)


def _time_window_pass(b: _Setup) -> None:
    """window_pass alone, with the window magnitude_threshold would use (+-z*sqrt(r) sample
    ranks)."""
    from oktopk_triton.kernels import threshold as T
    K, acc, n, k, dev = b.K, b.acc, b.n, b.k, b.dev
    S_w = T.sample_size(k, n)
    w = int(T.WINDOW_Z * math.sqrt(k * S_w / n) * n / S_w) + 1
    top = torch.topk(acc.abs(), min(n, k + w), sorted=True).values
    hi_bits = _abs_bits(float(top[k - w - 1])) if k - w >= 1 else 0x7F800000
    lo_bits = max(1, _abs_bits(float(top[min(n, k + w) - 1])))
    del top
    bounds = torch.tensor([lo_bits, max(lo_bits, hi_bits)], dtype=torch.int32, device=dev)
    cap = T.candidate_capacity(k, n, S_w)
    nseg = max(1, min(T.WINDOW_SEGMENTS, T._programs(dev, n, T.WINDOW_BLOCK)))
    cand = torch.full((nseg, -(-5 * cap // (4 * nseg)) + 64), -1, dtype=torch.int32, device=dev)
    seg_count = torch.zeros(nseg, dtype=torch.int64, device=dev)
    stats = torch.zeros(2, dtype=torch.int64, device=dev)

    def window_reset():
        seg_count.zero_()
        stats.zero_()

    window_reset()
    K.window_pass(acc, bounds, cand, seg_count, stats, backend=b.backend)
    inside = int(seg_count.sum())
    b.add("window_pass", "window_pass",
          lambda: K.window_pass(acc, bounds, cand, seg_count, stats, backend=b.backend),
          window_reset, 4 * n + 4 * inside, f"4n + 4*candidates ({inside} in the window)")


def _time_selects(b: _Setup) -> None:
    """The fused select per gradient dtype, with and without velocity and histogram, and the
    unfused torch selection."""
    K, n = b.K, b.n
    for gd in b.grad_dtypes:
        grad = b.grads[gd]
        s_g = grad.element_size()
        base = (s_g + 8) * n + 8 * b.selected
        for vel, with_hist in ((False, False), (False, True), (True, False), (True, True)):
            label = (f"fused select {gd}" + (" +velocity" if vel else "")
                     + (" +hist" if with_hist else ""))

            def fused(grad=grad, vel=vel, with_hist=with_hist):
                K.fused_select(grad, b.residual, b.thr_rows if with_hist else b.threshold,
                               b.region_offsets, b.capacity, out=b.sel_out,
                               velocity=b.velocity if vel else None, momentum=0.9,
                               mask_velocity=vel, hist=b.hist if with_hist else None,
                               backend=b.backend)

            b.add("fused_select", label, fused, b.reset_all, base + (8 * n if vel else 0),
                  f"(s_g + 8)n + 8*selected{' + 8n (velocity)' if vel else ''}, s_g = {s_g}"
                  f"{'; hist atomics not counted' if with_hist else ''}",
                  grad_dtype=gd, velocity=vel, hist=with_hist)
    gd0 = b.grad_dtypes[0]
    grad0 = b.grads[gd0]

    def unfused():
        a = b.residual + grad0.float()
        mask = (a.abs() >= b.threshold) & (a != 0)
        idx = mask.nonzero().reshape(-1)
        vals = a[idx]
        b.residual.copy_(a)
        return idx.to(torch.int32), vals

    b.add("unfused_torch", "unfused torch", unfused, b.reset,
          (grad0.element_size() + 8) * n + 8 * b.selected,
          f"(s_g + 8)n + 8*selected, s_g = {grad0.element_size()}", grad_dtype=gd0)


def _time_scatters(b: _Setup) -> None:
    """scatter: the P rows of one selection into a dense out, against index_put_."""
    K, P, capacity, dev = b.K, b.P, b.capacity, b.dev
    grad0 = b.grads[b.grad_dtypes[0]]
    b.reset()
    sel = K.fused_select(grad0, b.residual, b.threshold, b.region_offsets, capacity,
                         backend=b.backend)
    b.reset()
    written = int(sel.counts.clamp(max=capacity).sum())
    row_base = b.region_offsets[:P].contiguous()
    out = K.dense_zeros(b.n, dev)
    b.add("scatter_rows", "scatter_rows",
          lambda: K.scatter_rows(out, sel.indices, sel.values, sel.counts, row_base,
                                 backend=b.backend),
          None, 12 * written, f"12*written ({written} entries: index, value, out)", regions=P)
    slot = torch.arange(capacity, device=dev)
    valid = slot.reshape(1, -1) < sel.counts.reshape(-1, 1).to(torch.int64)
    gidx = torch.where(valid, row_base.reshape(-1, 1) + sel.indices.to(torch.int64),
                       torch.zeros_like(valid, dtype=torch.int64)).reshape(-1)
    gval = torch.where(valid, sel.values, torch.zeros_like(sel.values)).reshape(-1)
    b.add("index_put", "index_put_ (accumulate)",
          lambda: out.index_put_((gidx,), gval, accumulate=True), None, 12 * P * capacity,
          f"12*P*capacity (every padded slot; padding writes index 0), P = {P}", regions=P)


def _time_selection(b: _Setup) -> None:
    """The whole selection: threshold + compaction, against topk + gather."""
    K, gd0 = b.K, b.grad_dtypes[0]
    grad0 = b.grads[gd0]

    def selection():
        t = K.magnitude_threshold(b.acc, b.k, backend=b.backend)
        K.fused_select(grad0, b.residual, t, b.region_offsets, b.capacity, out=b.sel_out,
                       backend=b.backend)

    b.add("selection", f"selection (threshold + fused select {gd0})", selection, b.reset,
          4 * b.n + 4 * b.S + 8 * b.cand_count + (grad0.element_size() + 8) * b.n
          + 8 * b.selected, "magnitude_threshold + fused select formulas", grad_dtype=gd0)


def _time_competitors(b: _Setup) -> None:
    """The competitors' kernels against the torch ops they replaced (their references): TopkA's
    and gTop-k's top-k keys, Gaussiank's threshold (8 corrections) and its selection."""
    K, acc, n, k = b.K, b.acc, b.n, b.k
    for be, what in ((b.backend, ""), ("torch", " (torch ops)")):
        if be == b.backend and what:
            continue
        b.add("magnitude_keys" + ("_torch" if what else ""), "magnitude_keys" + what,
              lambda be=be: K.magnitude_keys(acc, backend=be), None,
              92 * n if what else 12 * n,
              "92n (arange and five int64 passes)" if what else "12n (read fp32, write int64)")
        z, lo, hi = 2.5758293035489004, 0.75 * k, 1.25 * k
        b.add("gaussian_threshold" + ("_torch" if what else ""), "gaussian_threshold" + what,
              lambda be=be: K.gaussian_threshold(acc, z, lo, hi, 8, backend=be), None,
              (12 + 8 * 14) * n if what else (4 + 8 * 4) * n,
              "12n + 8 * 14n (|acc|, then >=, !=, &, sum a step)" if what
              else "4n + 8 * 4n (std_mean, then one count pass a step)")
        thr = K.gaussian_threshold(acc, z, lo, hi, 8, backend=be)
        cap = int(math.ceil(1.5 * k))
        b.add("select_above" + ("_torch" if what else ""), "select_above" + what,
              lambda be=be, thr=thr: K.select_above(acc, thr, cap, backend=be), None,
              136 * n if what else 9 * n + 8 * cap,
              "136n (mask, int64 cumsum, where, arange, two scatters)" if what
              else "9n + 8*cap (acc read twice, the kept mask, the slots)")


def run(n: int, density: float, dtype="fp32", regions: int = 8, repeats: int = 5,
        warmup: int = 2, device: Optional[str] = None, backend: Optional[str] = None,
        seed: int = 0) -> Dict:
    """Time every kernel at one n; return that run's dictionary (also used by tools/).

    ``dtype``: one gradient dtype name or a list of them (the fused select rows per dtype; the
    unfused torch row uses the first)."""
    from oktopk_triton import kernels as K

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if backend is None:
        backend = "auto" if dev.type == "cuda" else "torch"
    used_backend = K.choose(backend, dev)
    grad_dtypes = [dtype] if isinstance(dtype, str) else list(dtype)
    b = _Setup(n, density, grad_dtypes, regions, repeats, warmup, dev, backend, seed)
    for timed in (_time_references, _time_window_pass, _time_selects, _time_scatters,
                  _time_selection, _time_competitors):
        timed(b)
    rows = b.rows
    byname = {r["kernel"]: r for r in rows}
    copy_gbps, read_gbps = byname["copy"]["gbps"], byname["read"]["gbps"]
    topk_ms, tg_ms = byname["torch_topk"]["ms"], byname["topk_gather"]["ms"]
    for r in rows:
        r["pct_copy_bw"] = 100.0 * r["gbps"] / copy_gbps
        r["pct_read_bw"] = 100.0 * r["gbps"] / read_gbps
        r["speedup_vs_topk"] = topk_ms / r["ms"]
    byname["selection"]["speedup_vs_topk_gather"] = tg_ms / byname["selection"]["ms"]
    import triton
    return {
        "benchmark": "kernels",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(dev), "device_type": dev.type,
        "torch": torch.__version__, "triton": triton.__version__,
        "kernel_backend": used_backend,
        "n": n, "density": density, "k": b.k, "dtype": grad_dtypes[0],
        "grad_dtypes": grad_dtypes, "regions": b.P, "capacity": b.capacity,
        "threshold": float(b.threshold), "selected": b.selected,
        "window_ok": b.window_ok, "repeats": repeats, "warmup": warmup,
        "copy_gbps": copy_gbps, "read_gbps": read_gbps,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "results": rows,
    }


def evaluate_goals(runs: List[Dict]) -> List[Dict]:
    """The kernel goals against the rows: ``met`` is None off CUDA (the goals are an H100's)."""
    goals = []
    for res in runs:
        n, cuda = res["n"], res["device_type"] == "cuda"

        def goal(what, row, value, target, ok):
            goals.append({"goal": what, "kernel": row["kernel"], "name": row["name"], "n": n,
                          "value": value, "target": target, "met": bool(ok) if cuda else None})

        for r in res["results"]:
            if r["kernel"] == "magnitude_threshold":
                if n in THRESHOLD_MS_GOAL:
                    goal("threshold ms <=", r, r["ms"], THRESHOLD_MS_GOAL[n],
                         r["ms"] <= THRESHOLD_MS_GOAL[n])
                if n in THRESHOLD_SPEEDUP_GOAL:
                    goal("threshold speedup vs torch.topk >=", r, r["speedup_vs_topk"],
                         THRESHOLD_SPEEDUP_GOAL[n],
                         r["speedup_vs_topk"] >= THRESHOLD_SPEEDUP_GOAL[n])
            if r["kernel"] == "fused_select" and n in FUSED_PCT_COPY_GOAL:
                goal("fused select % of copy bandwidth >=", r, r["pct_copy_bw"],
                     FUSED_PCT_COPY_GOAL[n], r["pct_copy_bw"] >= FUSED_PCT_COPY_GOAL[n])
    return goals


def format_table(res: Dict) -> str:
    lines = [f"device: {res['device']}   torch {res['torch']}   triton {res['triton']}   "
             f"kernel backend: {res['kernel_backend']}",
             f"n = {res['n']} (2^{math.log2(res['n']):.4g})   density {res['density']}   "
             f"k = {res['k']}   selected = {res['selected']}   P = {res['regions']}   "
             f"repeats = {res['repeats']}   window_ok = {res.get('window_ok')}"]
    if res["device_type"] != "cuda":
        lines.append("NOTE: no CUDA device — this times the torch reference path (or the Triton "
                     "interpreter) on CPU with a small n; the Triton numbers need a GPU.")
        if res.get("load_average") is not None:
            lines.append(f"NOTE: CPU load average {res['load_average']:.1f} over "
                         f"{os.cpu_count()} cores during the run (timings are noisy when > cores).")
    # not records.table: fixed widths that line up across the runs of several n printed one
    # under another, and a free-text last column (the byte formula and the gather speed-up)
    hdr = f"{'kernel':<42}{'median ms':>11}{'GB/s':>9}{'% copy':>9}{'vs topk':>9}   bytes"
    lines += [hdr, "-" * len(hdr)]
    for r in res["results"]:
        extra = (f"   ({r['speedup_vs_topk_gather']:.2f}x topk + gather)"
                 if "speedup_vs_topk_gather" in r else "")
        lines.append(f"{r['name']:<42}{r['ms']:>11.3f}{r['gbps']:>9.1f}"
                     f"{r['pct_copy_bw']:>8.1f}%{r['speedup_vs_topk']:>8.2f}x   "
                     f"{r['bytes_formula']}{extra}")
    return "\n".join(lines)


def format_goals(goals: List[Dict]) -> str:
    lines = ["goals (H100):"]
    for g in goals:
        state = {True: "met", False: "MISSED", None: "not evaluated (not CUDA)"}[g["met"]]
        lines.append(f"  n=2^{math.log2(g['n']):.4g} {g['name']:<36} {g['goal']} {g['target']:g}: "
                     f"{g['value']:.3f} — {state}")
    if len(lines) == 1:
        lines.append("  (none at these n: the goals are set at n = 2^24, 2^26, 2^28)")
    return "\n".join(lines)


def default_json_path(date: str) -> str:
    return records.results_path(f"gpu-kernels-{date}.json")


def main(args) -> int:
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    cuda = dev.type == "cuda"
    sizes = args.n or (GPU_DEFAULT_SIZES if cuda else CPU_DEFAULT_SIZES)
    repeats = args.repeats or (20 if cuda else 5)
    if cuda and repeats < MIN_CUDA_REPEATS:
        print(f"--repeats {repeats} raised to {MIN_CUDA_REPEATS} on CUDA (median of >= 10)")
        repeats = MIN_CUDA_REPEATS
    head = records.header("kernels", args, device=device_name(dev))
    path = args.json or (default_json_path(head["date"][:10]) if cuda else None)
    import triton
    report = {**head, "device_type": dev.type,
              "torch": torch.__version__, "triton": triton.__version__,
              "density": args.density, "regions": args.regions, "grad_dtypes": list(args.dtype),
              "repeats": repeats, "warmup": args.warmup, "sizes": list(sizes),
              "timing": "CUDA events after warm-up, median" if cuda else "perf_counter, median",
              "runs": [], "entries": [], "goals": []}

    def save():
        if path:
            records.write(path, report)

    for n in sizes:
        res = run(n, args.density, list(args.dtype), args.regions, repeats, args.warmup, str(dev),
                  args.backend, args.seed)
        print(format_table(res), flush=True)
        report["runs"].append(res)
        report["entries"].extend(res["results"])
        report["kernel_backend"] = res["kernel_backend"]
        report["goals"] = evaluate_goals(report["runs"])
        save()
        if cuda:
            torch.cuda.empty_cache()
    print(format_goals(report["goals"]))
    if path:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":  # python -m oktopk_triton.bench.kernels: the CLI's checked path
    from ..cli import main as _cli_main
    raise SystemExit(_cli_main(["kernels", *sys.argv[1:]]))
