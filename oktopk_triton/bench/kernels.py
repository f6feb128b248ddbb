"""``oktopk-bench kernels``: the selection step against torch.topk and an unfused torch step.

Times on the same input (acc = residual + grad, k = density * n):

* fused select   — ``kernels.fused_select`` (one pass; Triton on CUDA).
* hist threshold — ``kernels.histogram_threshold`` (two histogram passes over acc).
* torch.topk     — ``torch.topk(acc.abs(), k)`` (what a plain top-k step does).
* unfused torch  — acc = r + g; mask; nonzero; gather; residual copy.
* copy           — ``dst.copy_(src)`` of n fp32: the device copy bandwidth of this run.

Bytes formulas (effective GB/s = bytes / median time):
  fused select, unfused torch: (s_g + 8) * n + 8 * selected   (read grad + read residual +
                               write residual, plus the (int32 index, fp32 value) pairs)
  hist threshold: 2 * 4 * n   (two reads of fp32 acc)
  torch.topk: 4 * n           (one read of fp32 acc; the abs pass is inside the time)
  copy: 8 * n                 (read + write fp32)
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
CPU_DEFAULT_N = 1 << 22
GPU_DEFAULT_N = 1 << 27


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--n", type=int, default=None,
                   help=f"elements (default {GPU_DEFAULT_N} on CUDA, {CPU_DEFAULT_N} on CPU)")
    p.add_argument("--density", type=float, default=0.01, help="k / n (default 0.01)")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="gradient dtype")
    p.add_argument("--regions", type=int, default=8, help="regions P of the fused select (default 8)")
    p.add_argument("--repeats", type=int, default=None, help="timed repeats (default 20 CUDA, 5 CPU)")
    p.add_argument("--warmup", type=int, default=2, help="untimed warm-up runs (default 2)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--backend", choices=["auto", "triton", "torch"], default=None,
                   help="kernel backend (default: auto on CUDA, torch on CPU)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON here")


def _timer(device: torch.device, fn: Callable[[], object], repeats: int, warmup: int,
           setup: Optional[Callable[[], object]] = None) -> List[float]:
    """Seconds per call; ``setup`` runs untimed before each call."""
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


def run(n: int, density: float, dtype: str = "fp32", regions: int = 8, repeats: int = 5,
        warmup: int = 2, device: Optional[str] = None, backend: Optional[str] = None,
        seed: int = 0) -> Dict:
    """Run the benchmark and return the result dictionary (also used by tools/)."""
    from oktopk_triton import kernels as K

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if backend is None:
        backend = "auto" if dev.type == "cuda" else "torch"
    used_backend = K.choose(backend, dev)
    gdt = DTYPES[dtype]
    s_g = torch.tensor([], dtype=gdt).element_size()
    gen = torch.Generator(device=dev).manual_seed(seed)
    grad = torch.randn(n, device=dev, generator=gen, dtype=torch.float32).to(gdt)
    residual0 = torch.randn(n, device=dev, generator=gen, dtype=torch.float32) * 0.5
    residual = residual0.clone()
    acc = residual0 + grad.float()
    k = max(1, int(round(density * n)))
    P = max(1, int(regions))
    region_offsets = torch.tensor([(n * p) // P for p in range(P + 1)], dtype=torch.int64, device=dev)
    threshold = K.histogram_threshold(acc, k, backend=backend)
    capacity = int(math.ceil(1.5 * k / P)) + 16
    sel_out = K.empty_selection(P, capacity, dev)
    selected = int(((acc.abs() >= threshold) & (acc != 0)).sum())   # one host read, untimed

    def reset():
        residual.copy_(residual0)

    def fused():
        K.fused_select(grad, residual, threshold, region_offsets, capacity, out=sel_out,
                       backend=backend)

    def hist():
        K.histogram_threshold(acc, k, backend=backend)

    def topk():
        torch.topk(acc.abs(), k, sorted=False)

    def unfused():
        a = residual + grad.float()
        mask = (a.abs() >= threshold) & (a != 0)
        idx = mask.nonzero().reshape(-1)
        vals = a[idx]
        residual.copy_(a)
        return idx.to(torch.int32), vals

    dst = torch.empty_like(acc)

    def copy():
        dst.copy_(acc)

    rows = []
    specs = [
        ("copy", copy, None, 8 * n, "8n (read + write fp32)"),
        ("fused select", fused, reset, (s_g + 8) * n + 8 * selected,
         f"(s_g + 8)n + 8*selected, s_g = {s_g}"),
        ("hist threshold", hist, None, 8 * n, "2 * 4n (two reads of acc)"),
        ("torch.topk", topk, None, 4 * n, "4n (one read of acc; abs inside the time)"),
        ("unfused torch", unfused, reset, (s_g + 8) * n + 8 * selected,
         f"(s_g + 8)n + 8*selected, s_g = {s_g}"),
    ]
    for name, fn, setup, nbytes, formula in specs:
        times = _timer(dev, fn, repeats, warmup, setup)
        med = statistics.median(times)
        rows.append({"name": name, "median_ms": med * 1e3, "min_ms": min(times) * 1e3,
                     "bytes": nbytes, "bytes_formula": formula, "gbps": nbytes / med / 1e9})
        if dev.type == "cuda":
            torch.cuda.empty_cache()
    copy_gbps = rows[0]["gbps"]
    topk_ms = next(r["median_ms"] for r in rows if r["name"] == "torch.topk")
    for r in rows:
        r["pct_copy_bw"] = 100.0 * r["gbps"] / copy_gbps
        r["speedup_vs_topk"] = topk_ms / r["median_ms"]
    import triton
    return {
        "benchmark": "kernels",
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(dev), "device_type": dev.type,
        "torch": torch.__version__, "triton": triton.__version__,
        "kernel_backend": used_backend,
        "n": n, "density": density, "k": k, "dtype": dtype, "regions": P, "capacity": capacity,
        "threshold": float(threshold), "selected": selected, "repeats": repeats,
        "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "results": rows,
    }


def format_table(res: Dict) -> str:
    lines = [f"device: {res['device']}   torch {res['torch']}   triton {res['triton']}   "
             f"kernel backend: {res['kernel_backend']}",
             f"n = {res['n']} ({res['dtype']} grad)   density {res['density']}   k = {res['k']}   "
             f"selected = {res['selected']}   P = {res['regions']}   repeats = {res['repeats']}"]
    if res["device_type"] != "cuda":
        lines.append("NOTE: no CUDA device — this times the torch reference path on CPU with a "
                     "small n; the Triton numbers need a GPU.")
        if res.get("load_average") is not None:
            lines.append(f"NOTE: CPU load average {res['load_average']:.1f} over "
                         f"{os.cpu_count()} cores during the run (timings are noisy when > cores).")
    hdr = f"{'step':<16}{'median ms':>11}{'GB/s':>9}{'% copy':>8}{'vs topk':>9}   bytes"
    lines += [hdr, "-" * len(hdr)]
    for r in res["results"]:
        lines.append(f"{r['name']:<16}{r['median_ms']:>11.3f}{r['gbps']:>9.1f}"
                     f"{r['pct_copy_bw']:>7.1f}%{r['speedup_vs_topk']:>8.2f}x   {r['bytes_formula']}")
    return "\n".join(lines)


def main(args) -> int:
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    n = args.n or (GPU_DEFAULT_N if dev.type == "cuda" else CPU_DEFAULT_N)
    repeats = args.repeats or (20 if dev.type == "cuda" else 5)
    res = run(n, args.density, args.dtype, args.regions, repeats, args.warmup, str(dev),
              args.backend, args.seed)
    print(format_table(res))
    if args.json:
        d = os.path.dirname(os.path.abspath(args.json))
        os.makedirs(d, exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__)
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
