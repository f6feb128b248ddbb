#!/usr/bin/env python
"""Where GPU time goes: torch.profiler over ``magnitude_threshold`` and over one steady step of
a world of one (Ok-Topk, SparDL, dense) at n = 2^24..2^28 (density 1%): each kernel's device
time per call, the launches, and the wall time per call (CUDA events).

    python -m tools.gpu_profile [--log2 24 26 28] [--reps 20] [--steps oktopk spardl dense]
                                [--graph] [--json OUT]

``--graph`` adds each step captured in a CUDA graph and replayed (``oktopk_triton.modes.graph``).

Prints, per size, the total device time per call and the kernels that make it, largest first.
Needs CUDA.
"""
from __future__ import annotations

import argparse
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from oktopk_triton import kernels as K
from oktopk_triton.algorithms import get_algorithm
from oktopk_triton.bench import records
from oktopk_triton.comm.local import SingleCommunicator
from oktopk_triton.modes.graph import GraphedStep


def kernel_table(fn, reps: int):
    """[(kernel name, device us per call, launches per call)], largest first, and the wall ms
    per call (CUDA events)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        dev_us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if dev_us > 0 and e.count:
            rows.append((e.key[:90], dev_us / reps, e.count / reps))
    rows.sort(key=lambda r: -r[1])
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return rows, start.elapsed_time(end) / reps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--log2", type=int, nargs="+", default=[24, 26, 28])
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--steps", nargs="*", default=["oktopk", "spardl", "dense"],
                    help="algorithms whose steady step (P = 1) is profiled")
    ap.add_argument("--graph", action="store_true",
                    help="also time each step replayed from a CUDA graph")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_profile: needs a CUDA device", file=sys.stderr)
        return 2
    out = {**records.header("gpu-profile", a, device=torch.cuda.get_device_name()), "sizes": []}
    for lg in a.log2:
        n = 1 << lg
        k = max(1, n // 100)
        g = torch.Generator(device="cuda").manual_seed(0)
        x = torch.randn(n, device="cuda", generator=g)
        cases = {"magnitude_threshold": lambda x=x, k=k: K.magnitude_threshold(x, k)}
        for name in a.steps:
            alg = get_algorithm(name)(n, SingleCommunicator("cuda"), 0.01)
            cases[f"{name} step, P=1"] = lambda alg=alg, x=x: alg(x)
            if a.graph:
                graphed = GraphedStep(get_algorithm(name)(n, SingleCommunicator("cuda"), 0.01))
                for _ in range(graphed.eager_steps + 2):      # eager, capture, one replay
                    graphed(x)
                cases[f"{name} step, P=1, CUDA graph"] = lambda st=graphed, x=x: st(x)
        for name, fn in cases.items():
            rows, wall = kernel_table(fn, a.reps)
            busy = sum(r[1] for r in rows) / 1e3
            print(f"\nn=2^{lg} {name}: wall {wall:.3f} ms per call, kernels busy {busy:.3f} ms, "
                  f"{sum(r[2] for r in rows):.0f} launches")
            for key, us, cnt in rows[:25]:
                print(f"  {us:9.1f} us  x{cnt:4.1f}  {key}")
            out["sizes"].append({"log2": lg, "case": name, "wall_ms": wall, "busy_ms": busy,
                                 "kernels": [{"name": r[0], "us": r[1], "calls": r[2]}
                                             for r in rows]})
        del x, cases
        torch.cuda.empty_cache()
    if a.json:
        records.write(a.json, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
