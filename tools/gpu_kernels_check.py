#!/usr/bin/env python
"""GPU session check of the kernels: compiled Triton vs the torch reference, then the benchmark.

    python tools/gpu_kernels_check.py OUT.json                 # CUDA: n up to 2^28
    python tools/gpu_kernels_check.py OUT.json --quick         # CPU smoke run (interpreter, tiny n)

1. Correctness for every grad dtype (fp32/bf16/fp16) at n = 2^10+3 ... 2^28 (``--max-log2``):
   fused_select (counts/nonfinite exact, residual exact, each region's valid slots equal as
   sets when within capacity and a subset of the selection on overflow, values exact),
   abs_histogram levels 0/1 exact, histogram_threshold equal on both backends and its count vs k,
   scatter_add (bitwise), clear_sent.
2. ``oktopk-bench kernels`` at n = 2^24, 2^26, 2^28 and density 1% and 0.1% (``--bench-log2``,
   ``--densities``, ``--bench-dtypes``).

JSON is rewritten after every step, so a run cut short still leaves what it measured.
Exit status 1 when any check failed.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")   # before the kernels are decorated

from oktopk_triton import kernels as K  # noqa: E402
from oktopk_triton.bench import kernels as bench  # noqa: E402
from oktopk_triton.bench import records  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sorted_rows(indices, values, counts, capacity):
    """Valid prefix of each row sorted by index; padding = int32 max / 0."""
    valid = (torch.arange(capacity, device=indices.device)[None, :]
             < counts.clamp(max=capacity)[:, None])
    big = torch.iinfo(torch.int32).max
    idx = torch.where(valid, indices, torch.full_like(indices, big))
    order = idx.argsort(dim=1, stable=True)
    return (idx.gather(1, order),
            torch.where(valid, values, torch.zeros_like(values)).gather(1, order))


def check_fused_select(n, dtype, P, density, device, gen):
    grad = torch.randn(n, device=device, generator=gen).to(DTYPES[dtype])
    residual = torch.randn(n, device=device, generator=gen) * 0.5
    residual[:: 13] = 0
    grad[:: 13] = 0
    acc = residual + grad.float()
    cuts = torch.randint(0, n + 1, (P - 1,), device=device, generator=gen).sort().values
    offsets = torch.cat([torch.zeros(1, device=device, dtype=torch.int64), cuts.to(torch.int64),
                         torch.full((1,), n, device=device, dtype=torch.int64)])
    if P >= 3:
        offsets[2] = offsets[1]                                  # an empty region
    k = max(1, int(density * n))
    thr = K.histogram_threshold(acc, k)
    out = {}
    for cap_name, capacity in (("ample", max(1, int(3 * k / P)) + 64),
                               ("tight", max(1, k // (4 * P)))):
        rt, rr = residual.clone(), residual.clone()
        st = K.fused_select(grad, rt, thr, offsets, capacity, backend="triton")
        sr = K.fused_select(grad, rr, thr, offsets, capacity, backend="torch")
        torch.cuda.synchronize() if device.type == "cuda" else None
        res = {"counts_equal": bool(torch.equal(st.counts, sr.counts)),
               "nonfinite_equal": bool(torch.equal(st.nonfinite, sr.nonfinite)),
               "residual_equal": bool(torch.equal(rt, rr)) and bool(torch.equal(rt, acc)),
               "selected": int(sr.counts.sum()), "capacity": capacity,
               "overflow": bool((sr.counts > capacity).any())}
        it, vt = sorted_rows(st.indices, st.values, st.counts, capacity)
        ir, vr = sorted_rows(sr.indices, sr.values, sr.counts, capacity)
        within = (sr.counts <= capacity)
        res["slots_equal_within_capacity"] = bool(
            (torch.where(within[:, None], it == ir, torch.ones_like(it, dtype=torch.bool))).all())
        # every written slot holds a selected acc value at its index (covers overflow rows)
        valid = it != torch.iinfo(torch.int32).max
        gidx = (offsets[:-1, None] + it.clamp(min=0).to(torch.int64)).clamp(max=n - 1)
        a = acc[gidx]
        ok = (~valid) | ((a == vt) & (a.abs() >= thr) & (a != 0))
        res["slot_values_ok"] = bool(ok.all())
        res["no_duplicate_slots"] = bool(((it[:, 1:] != it[:, :-1]) | ~valid[:, 1:]).all())
        res["pass"] = all(res[key] for key in ("counts_equal", "nonfinite_equal", "residual_equal",
                                               "slots_equal_within_capacity", "slot_values_ok",
                                               "no_duplicate_slots"))
        out[cap_name] = res
        del rt, rr, st, sr
    return out


def check_histogram(n, dtype, density, device, gen):
    x = (torch.randn(n, device=device, generator=gen) * 2).to(DTYPES[dtype])
    x[:: 7] = 0
    k = max(1, int(density * n))
    h0t, h0r = K.abs_histogram(x, backend="triton"), K.abs_histogram(x, backend="torch")
    b0, above = K.kth_bin(h0r, k)
    h1t = K.abs_histogram(x, prefix=b0, backend="triton")
    h1r = K.abs_histogram(x, prefix=b0, backend="torch")
    s, e = n // 3, n - n // 5
    hst = K.abs_histogram(x, start=torch.tensor(s, device=device),
                          end=torch.tensor(e, device=device), backend="triton")
    hsr = K.abs_histogram(x, start=s, end=e, backend="torch")
    tt = K.histogram_threshold(x, k, backend="triton")
    tr = K.histogram_threshold(x, k, backend="torch")
    count = int(((x.float().abs() >= tt) & (x != 0)).sum())
    res = {"level0_equal": bool(torch.equal(h0t, h0r)), "level1_equal": bool(torch.equal(h1t, h1r)),
           "range_equal": bool(torch.equal(hst, hsr)), "threshold_equal": float(tt) == float(tr),
           "k": k, "count_at_threshold": count, "count_over_k": count / k}
    res["pass"] = res["level0_equal"] and res["level1_equal"] and res["range_equal"] and \
        res["threshold_equal"] and count >= min(k, int(((x != 0)).sum()))
    return res


def check_sparse(n, device, gen):
    x = torch.randn(n, device=device, generator=gen)
    thr = torch.tensor(2.0, device=device)
    res = {}
    # scatter_add: 4 sources over one region, repeated indices across sources
    S, m = 4, min(n, 1 << 20)
    capS = max(1, m // 50)
    idx = torch.stack([torch.randperm(m, device=device, generator=gen)[:capS]
                       for _ in range(S)]).to(torch.int32)
    vals = torch.randn(S, capS, device=device, generator=gen)
    counts = torch.full((S,), capS, dtype=torch.int32, device=device)
    counts[1] = capS // 2
    d0 = torch.randn(n, device=device, generator=gen)
    dt, dr = d0.clone(), d0.clone()
    K.scatter_add(dt, idx, vals, counts, base=torch.tensor(n - m, device=device), backend="triton")
    K.scatter_add(dr, idx, vals, counts, base=n - m, backend="torch")
    res["scatter_add_bitwise"] = bool(torch.equal(dt, dr))
    # clear_sent: sent = the selection rows, global = sorted subset
    P = 4
    offsets = torch.tensor([(n * p) // P for p in range(P + 1)], dtype=torch.int64, device=device)
    sel = K.fused_select(torch.zeros(n, device=device), x.clone(), thr, offsets, max(1, n // 20),
                         backend="torch")
    glob = sel.indices.clone()
    gcounts = (sel.counts.clamp(max=sel.indices.shape[1]) // 2).to(torch.int32)
    r1, r2 = x.clone(), x.clone()
    K.clear_sent(r1, sel.indices, sel.counts, offsets, glob, gcounts, backend="triton")
    K.clear_sent(r2, sel.indices, sel.counts, offsets, glob, gcounts, backend="torch")
    res["clear_sent_equal"] = bool(torch.equal(r1, r2))
    res["cleared"] = int((r2 == 0).sum())
    res["pass"] = res["scatter_add_bitwise"] and res["clear_sent_equal"]
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="JSON output path")
    ap.add_argument("--max-log2", type=int, default=28, help="largest n = 2^max-log2 to check")
    ap.add_argument("--bench-log2", type=int, nargs="*", default=[24, 26, 28])
    ap.add_argument("--densities", type=float, nargs="*", default=[0.01, 0.001])
    ap.add_argument("--bench-dtypes", nargs="*", default=["fp32", "bf16"])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--quick", action="store_true", help="tiny sizes (CPU smoke run)")
    ap.add_argument("--skip-bench", action="store_true")
    args = ap.parse_args(argv)

    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    if args.quick or not cuda:
        sizes = [1, 1000, (1 << 14) + 3]
        bench_sizes, repeats = [1 << 12], 2
    else:
        sizes = ([(1 << 10) + 3] + [1 << p for p in range(16, args.max_log2 + 1, 4)]
                 + [(1 << 20) + 7])
        if (1 << args.max_log2) not in sizes:
            sizes.append(1 << args.max_log2)
        sizes = sorted(set(sizes))
        bench_sizes, repeats = [1 << p for p in args.bench_log2], args.repeats
    report = {**records.header("kernels-check", args, device=bench.device_name(device)),
              "torch": torch.__version__,
              "interpreter": K.INTERPRET, "checks": [], "bench": [], "failed": 0}

    def save():
        records.write(args.out, report)

    gen = torch.Generator(device=device).manual_seed(0)
    for n in sizes:
        for dtype in DTYPES:
            for name, fn in (("fused_select",
                              lambda: check_fused_select(n, dtype, 8, 0.01, device, gen)),
                             ("histogram", lambda: check_histogram(n, dtype, 0.01, device, gen))):
                t0 = time.perf_counter()
                try:
                    res = fn()
                    ok = res["pass"] if "pass" in res else all(v["pass"] for v in res.values())
                except Exception:
                    res, ok = {"error": traceback.format_exc()}, False
                entry = {"check": name, "n": n, "dtype": dtype, "pass": ok,
                         "seconds": time.perf_counter() - t0,
                         "result": res}
                report["checks"].append(entry)
                report["failed"] += 0 if ok else 1
                print(f"{name:<13} n={n:<10} {dtype:<5} {'ok' if ok else 'FAIL'}  "
                      f"{entry['seconds']:.2f}s", flush=True)
                save()
                if cuda:
                    torch.cuda.empty_cache()
        t0 = time.perf_counter()
        try:
            res = check_sparse(n, device, gen)
            ok = res["pass"]
        except Exception:
            res, ok = {"error": traceback.format_exc()}, False
        report["checks"].append({"check": "sparse", "n": n, "pass": ok, "result": res,
                                 "seconds": time.perf_counter() - t0})
        report["failed"] += 0 if ok else 1
        print(f"{'sparse':<13} n={n:<10} {'':<5} {'ok' if ok else 'FAIL'}", flush=True)
        save()

    if not args.skip_bench:
        for dtype in args.bench_dtypes:
            for n in bench_sizes:
                for density in args.densities:
                    try:
                        res = bench.run(n, density, dtype, 8, repeats, 2, str(device),
                                        "auto" if cuda else "torch")
                        print(bench.format_table(res), flush=True)
                    except Exception:
                        res = {"n": n, "density": density, "dtype": dtype,
                               "error": traceback.format_exc()}
                        print(res["error"], flush=True)
                    report["bench"].append(res)
                    save()
                    if cuda:
                        torch.cuda.empty_cache()
    save()
    print(f"wrote {args.out}; {report['failed']} failed checks")
    return 1 if report["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
