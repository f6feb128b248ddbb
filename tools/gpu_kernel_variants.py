#!/usr/bin/env python
"""One GPU call that decides the kernels' shapes: block sizes and warps of fused_select and
window_pass, the cost of the in-pass count histogram, magnitude_threshold against torch.topk, and
scatter_rows against index_put_, at n = 2^24..2^28, next to the device's copy and read bandwidth
measured in the same run.  Also checks the compiled kernels against their torch references.

    python -m tools.gpu_kernel_variants OUT.json [--max-log2 28]

Results are recorded in docs/research/kernel-measurements.md (the decisions quote them).
"""
# The timed lambdas close over loop variables that each iteration deletes after timing them
# (freeing GPU memory before the next size): ruff reads those as undefined names.
# ruff: noqa: F821, E731
from __future__ import annotations

import argparse
import statistics
import traceback

import torch

from oktopk_triton import kernels as K
from oktopk_triton.bench import records
from oktopk_triton.kernels import selection as S
from oktopk_triton.kernels import threshold as T


def timed(fn, reps=15, warmup=3, setup=None):
    for _ in range(warmup):
        if setup:
            setup()
        fn()
    ts = []
    for _ in range(reps):
        if setup:
            setup()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b))
    return statistics.median(ts)


def grad_like(n, dev, seed=0):
    g = torch.Generator(device=dev).manual_seed(seed)
    scale = torch.randn(n, device=dev, generator=g).mul_(1.5).exp_()
    return torch.randn(n, device=dev, generator=g).mul_(scale)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--max-log2", type=int, default=28)
    args = ap.parse_args()
    dev = torch.device("cuda")
    rec = {**records.header("kernel-variants", args, device=torch.cuda.get_device_name()),
           "torch": torch.__version__, "rows": [], "checks": [], "errors": []}
    import triton
    rec["triton"] = triton.__version__

    def row(**kw):
        rec["rows"].append(kw)
        print(" ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in kw.items()),
              flush=True)
        records.write(args.json, rec)

    def check(name, ok, detail=""):
        rec["checks"].append({"name": name, "ok": bool(ok), "detail": str(detail)})
        print(("PASS " if ok else "FAIL ") + name + " " + str(detail), flush=True)

    # -- correctness of the compiled kernels (n = 2^22) -----------------------------------------
    try:
        n, P, cap = (1 << 22) + 13, 5, 9000
        for vel in (False, True):
            g = grad_like(n, dev, 1)
            r = torch.randn(n, device=dev) * 0.3
            r[::9] = 0
            g[::9] = 0
            u = torch.randn(n, device=dev) if vel else None
            offs = torch.tensor([0, n // 7, n // 3, n // 3, n // 2, n], dtype=torch.int64,
                                device=dev)
            thr = torch.tensor([3.0, 2.0, 1.0, 4.0, 2.5], device=dev)
            res = {}
            for be in ("torch", "triton"):
                rr, uu = r.clone(), (u.clone() if vel else None)
                h = torch.zeros(P, K.SELECT_HIST_BINS, dtype=torch.int32, device=dev)
                sel = K.fused_select(g, rr, thr, offs, cap, velocity=uu, momentum=0.9,
                                     mask_velocity=True, hist=h, backend=be)
                res[be] = (rr, uu, sel, h)
            a, b = res["torch"], res["triton"]
            check(f"fused residual vel={vel}", torch.equal(a[0], b[0]))
            if vel:
                check("fused velocity", torch.equal(a[1], b[1]))
            check(f"fused counts vel={vel}", torch.equal(a[2].counts, b[2].counts),
                  a[2].counts.tolist())
            check(f"fused hist vel={vel}", torch.equal(a[3], b[3]))
            full = K.fused_select(g, r.clone(), thr, offs, n, velocity=u.clone() if vel else None,
                                  momentum=0.9, mask_velocity=True, backend="torch")
            ok = True
            for p in range(P):
                c = min(int(a[2].counts[p]), cap)
                got = set(b[2].indices[p, :c].tolist())
                allowed = set(full.indices[p, :int(full.counts[p])].tolist())
                ok &= len(got) == c and got <= allowed
                if int(a[2].counts[p]) <= cap:
                    ok &= got == set(a[2].indices[p, :c].tolist())
            check(f"fused slots vel={vel}", ok)
        for dist in ("normal", "student_t", "lognormal", "cauchy", "grad"):
            n = 1 << 26
            gen = torch.Generator(device=dev).manual_seed(3)
            if dist == "normal":
                x = torch.randn(n, device=dev, generator=gen)
            elif dist == "student_t":
                x = torch.distributions.StudentT(torch.tensor(3.0, device=dev)).sample((n,))
            elif dist == "lognormal":
                x = torch.randn(n, device=dev, generator=gen).exp()
            elif dist == "cauchy":
                x = torch.distributions.Cauchy(torch.tensor(0.0, device=dev),
                                               torch.tensor(1.0, device=dev)).sample((n,))
            else:
                x = grad_like(n, dev, 5)
            for dens in (0.01, 0.001):
                k = int(dens * n)
                info = {}
                t = K.magnitude_threshold(x, k, info=info)
                exact = T._exact_torch(x, k, torch.tensor(0, device=dev),
                                       torch.tensor(n, device=dev), n)
                c = int(((x.abs() >= t) & (x != 0)).sum())
                check(f"threshold {dist} d={dens}", float(t) == float(exact) and c >= k,
                      f"count/k={c / k:.5f} window_ok={bool(info['window_ok'])}")
    except Exception:
        rec["errors"].append(traceback.format_exc())
        print(traceback.format_exc(), flush=True)

    # -- bandwidth ceilings ------------------------------------------------------------------------
    for lg in sorted({24, 26, args.max_log2}):
        n = 1 << lg
        try:
            a = torch.randn(n, device=dev)
            b = torch.empty_like(a)
            t = timed(lambda: b.copy_(a))
            row(what="copy", log2n=lg, ms=t, gbps=8 * n / t / 1e6)
            t = timed(lambda: a.amax())
            row(what="read(amax)", log2n=lg, ms=t, gbps=4 * n / t / 1e6)
            del a, b
        except Exception:
            rec["errors"].append(traceback.format_exc())

    # -- fused_select variants ---------------------------------------------------------------------
    for lg in sorted({26, args.max_log2}):
        n = 1 << lg
        try:
            P = 8
            g = grad_like(n, dev, 7)
            r0 = grad_like(n, dev, 8) * 0.5
            k = n // 100
            acc = r0 + g
            thr0 = K.magnitude_threshold(acc, k)
            offs = torch.tensor([n * j // P for j in range(P + 1)], dtype=torch.int64, device=dev)
            thr = thr0.repeat(P)
            cap = int(1.25 * k / P)
            r = r0.clone()
            u = torch.zeros(n, device=dev)
            h = torch.zeros(P, K.SELECT_HIST_BINS, dtype=torch.int32, device=dev)
            out = K.empty_selection(P, cap, dev)

            def restore():
                r.copy_(r0)

            base_bytes = 12 * n + 8 * k
            for block, warps in [(1024, 4), (2048, 4), (2048, 8), (4096, 8), (4096, 16),
                                 (8192, 16)]:
                for hist in (False, True):
                    fn = lambda: S._fused_select_triton(g, r, thr, offs, cap, None, out, None, 0.0,
                                                        False, h if hist else None, block=block,
                                                        num_warps=warps)
                    t = timed(fn, setup=restore)
                    row(what="fused_select", log2n=lg, block=block, warps=warps, hist=hist, ms=t,
                        gbps=base_bytes / t / 1e6)
            for block, warps in [(2048, 8), (4096, 8)]:
                fn = lambda: S._fused_select_triton(g, r, thr, offs, cap, None, out, u, 0.9,
                                                    True, h, block=block, num_warps=warps)
                t = timed(fn, setup=restore)
                row(what="fused_select+velocity", log2n=lg, block=block, warps=warps, hist=True,
                    ms=t, gbps=(base_bytes + 8 * n) / t / 1e6)
            gb = g.to(torch.bfloat16)
            fn = lambda: S._fused_select_triton(gb, r, thr, offs, cap, None, out, None, 0.0,
                                                False, h, block=4096, num_warps=8)
            t = timed(fn, setup=restore)
            row(what="fused_select bf16", log2n=lg, block=4096, warps=8, hist=True, ms=t,
                gbps=(10 * n + 8 * k) / t / 1e6)
            t = timed(lambda: torch.topk(acc.abs(), k, sorted=False))
            row(what="torch.topk", log2n=lg, ms=t)
            del g, r0, r, u, acc
        except Exception:
            rec["errors"].append(traceback.format_exc())
            print(traceback.format_exc(), flush=True)

    # -- threshold ---------------------------------------------------------------------------------
    for lg in sorted({24, 26, args.max_log2}):
        n = 1 << lg
        try:
            x = grad_like(n, dev, 11)
            for dens in (0.01, 0.001):
                k = int(dens * n)
                t = timed(lambda: K.magnitude_threshold(x, k))
                tk = timed(lambda: torch.topk(x.abs(), k, sorted=False))
                th = timed(lambda: K.histogram_threshold(x, k))
                row(what="magnitude_threshold", log2n=lg, density=dens, ms=t, topk_ms=tk,
                    hist2level_ms=th, speedup_vs_topk=tk / t, gbps=4 * n / t / 1e6)
            S_ = T.sample_size(n // 100, n)
            cap = T.candidate_capacity(n // 100, n, S_)
            cand = torch.empty(cap, dtype=torch.int32, device=dev)
            stats = torch.zeros(3, dtype=torch.int64, device=dev)
            bounds = torch.tensor([0x40000000, 0x40200000], dtype=torch.int32, device=dev)
            s0, e0 = torch.tensor(0, device=dev), torch.tensor(n, device=dev)
            for block, warps in [(2048, 8), (4096, 8), (8192, 16)]:
                fn = lambda: T._window_pass_triton(x, bounds, s0, e0, n, cand, stats, block=block,
                                                   num_warps=warps)
                t = timed(fn, setup=lambda: stats.zero_())
                row(what="window_pass", log2n=lg, block=block, warps=warps, ms=t,
                    gbps=4 * n / t / 1e6, inside=int(stats[1]))
            t = timed(lambda: torch.sort(cand, descending=True))
            row(what="sort candidates", log2n=lg, cap=cap, ms=t)
            del x
        except Exception:
            rec["errors"].append(traceback.format_exc())
            print(traceback.format_exc(), flush=True)

    # -- scatter ---------------------------------------------------------------------------------
    try:
        n, P = 1 << 26, 4
        cap = n // 100 // P
        dense = torch.zeros(n, device=dev)
        idx = torch.sort(torch.randint(0, n // P, (P, cap), device=dev, dtype=torch.int32),
                         1).values
        val = torch.randn(P, cap, device=dev)
        cnt = torch.full((P,), int(cap * 0.8), dtype=torch.int32, device=dev)
        base = torch.tensor([j * (n // P) for j in range(P)], device=dev)
        t = timed(lambda: K.scatter_rows(dense, idx, val, cnt, base))
        pos = (base[:, None] + idx.to(torch.int64)).reshape(-1)
        t2 = timed(lambda: dense.index_put_((pos,), val.reshape(-1), accumulate=True))
        row(what="scatter_rows vs index_put_(acc)", log2n=26, ms=t, index_put_ms=t2)
    except Exception:
        rec["errors"].append(traceback.format_exc())

    # -- cupy / nccl facts -------------------------------------------------------------------------
    try:
        import cupy
        from cupy.cuda import nccl
        uid = nccl.get_unique_id()
        rec["cupy"] = {"version": cupy.__version__, "nccl": nccl.get_version(),
                       "unique_id_type": type(uid).__name__, "unique_id_len": len(uid),
                       "comm_methods": [m for m in dir(nccl.NcclCommunicator)
                                        if not m.startswith("_")]}
        print("cupy", rec["cupy"], flush=True)
    except Exception:
        rec["errors"].append(traceback.format_exc())
    records.write(args.json, rec)
    print("checks failed:", sum(not c["ok"] for c in rec["checks"]), "errors:", len(rec["errors"]))


if __name__ == "__main__":
    main()
