"""Compile every kernel for a CUDA target without a GPU (ttir -> ... -> cubin).

    python -m oktopk_triton.kernels._compile_check [--arch 90] [--verbose]

Catches errors of the compiled path (types, loop-carried values, constexpr specialisation)
that the interpreter does not see, and reports whether the streaming loads of the fused select
and the histogram are vectorised.  Must run in a process WITHOUT ``TRITON_INTERPRET=1`` (the
kernels are then decorated as compiled JIT functions); tests/test_kernels.py runs it in a
subprocess.  Exit status 1 when a variant fails to compile.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback


def variants():
    from . import histogram, region, scatter, selection
    sel_sig = {"grad_ptr": "*fp32", "residual_ptr": "*fp32", "threshold_ptr": "*fp32",
               "region_offsets_ptr": "*i64", "indices_ptr": "*i32", "values_ptr": "*fp32",
               "counts_ptr": "*i32", "nonfinite_ptr": "*i32", "skip_ptr": "*i32",
               "n": "i64", "P": "i32", "capacity": "i32", "idx_row_stride": "i32",
               "val_row_stride": "i32", "counts_stride": "i32", "nonfinite_stride": "i32",
               "HAS_SKIP": "constexpr", "THR_PER_REGION": "constexpr", "SEARCH_STEPS": "constexpr",
               "BLOCK": "constexpr"}
    ptr16 = list(range(9)) + [9]          # pointers and n divisible by 16 (as the JIT specialises)
    for gd in ("*fp32", "*bf16", "*fp16"):
        for skip in (False, True):
            for per_region in (False, True):
                yield (f"fused_select grad={gd[1:]} skip={skip} thr_per_region={per_region}",
                       selection._fused_select_kernel, {**sel_sig, "grad_ptr": gd},
                       {"HAS_SKIP": skip, "THR_PER_REGION": per_region, "SEARCH_STEPS": 4,
                        "BLOCK": 2048}, ptr16, 8)
    # n == 1 specialised to a constexpr
    yield ("fused_select n=1", selection._fused_select_kernel, {**sel_sig, "n": "constexpr"},
           {"n": 1, "HAS_SKIP": False, "THR_PER_REGION": False, "SEARCH_STEPS": 1, "BLOCK": 2048},
           list(range(9)), 8)
    hsig = {"x_ptr": "*fp32", "hist_ptr": "*i64", "prefix_ptr": "*i64", "start_ptr": "*i64",
            "end_ptr": "*i64", "start_int": "i32", "end_int": "i64", "LEVEL": "constexpr",
            "START_IS_PTR": "constexpr", "END_IS_PTR": "constexpr", "HIST_BINS": "constexpr",
            "blocks_per_program": "i32", "SHIFT": "constexpr", "BLOCK": "constexpr"}
    for lvl in (0, 1):
        for x in ("*fp32", "*bf16"):
            yield (f"abs_histogram level={lvl} x={x[1:]}", histogram._abs_histogram_kernel,
                   {**hsig, "x_ptr": x, "start_int": "constexpr"},
                   {"start_int": 0, "LEVEL": lvl, "START_IS_PTR": False, "END_IS_PTR": False,
                    "HIST_BINS": histogram.HIST_BINS, "SHIFT": 20 if lvl == 0 else 9,
                    "BLOCK": 1024}, [0, 1, 2, 3, 4, 6], 8)
    yield ("abs_histogram device range", histogram._abs_histogram_kernel, hsig,
           {"LEVEL": 1, "START_IS_PTR": True, "END_IS_PTR": True, "HIST_BINS": histogram.HIST_BINS,
            "SHIFT": 9, "BLOCK": 1024}, [0, 1, 2, 3, 4], 8)
    yield ("abs_histogram start=1", histogram._abs_histogram_kernel, {**hsig, "start_int": "constexpr"},
           {"start_int": 1, "LEVEL": 0, "START_IS_PTR": False, "END_IS_PTR": False,
            "HIST_BINS": histogram.HIST_BINS, "SHIFT": 20, "BLOCK": 1024},
           [0, 1], 8)
    for base_ptr in (False, True):
        yield (f"scatter_add base_ptr={base_ptr}", scatter._scatter_add_kernel,
               {"dense_ptr": "*fp32", "indices_ptr": "*i32", "values_ptr": "*fp32", "count_ptr": "*i32",
                "base_ptr": "*i64", "base_int": "i64", "capacity": "i32", "BASE_IS_PTR": "constexpr",
                "BLOCK": "constexpr"}, {"BASE_IS_PTR": base_ptr, "BLOCK": 1024}, [0, 1, 2, 3, 4], 4)
    rsig = {"dense_ptr": "*fp32", "threshold_ptr": "*fp32", "start_ptr": "*i64", "end_ptr": "*i64",
            "start_int": "i32", "end_int": "i32"}
    for sp in (False, True):
        yield (f"region_count start_ptr={sp}", region._region_count_kernel,
               {**rsig, "block_counts_ptr": "*i32", "START_IS_PTR": "constexpr",
                "END_IS_PTR": "constexpr", "BLOCK": "constexpr"},
               {"START_IS_PTR": sp, "END_IS_PTR": sp, "BLOCK": 1024}, [0, 1, 2, 3, 6], 4)
        yield (f"region_write start_ptr={sp}", region._region_write_kernel,
               {**rsig, "block_prefix_ptr": "*i64", "indices_ptr": "*i32", "values_ptr": "*fp32",
                "scale_ptr": "*fp32", "scale": "fp32", "capacity": "i32",
                "START_IS_PTR": "constexpr", "END_IS_PTR": "constexpr", "SCALE_IS_PTR": "constexpr",
                "BLOCK": "constexpr"},
               {"START_IS_PTR": sp, "END_IS_PTR": not sp, "SCALE_IS_PTR": sp, "BLOCK": 1024},
               [0, 1, 2, 3, 6, 7, 8, 9], 4)
    yield ("clear_sent", region._clear_sent_kernel,
           {"residual_ptr": "*fp32", "sent_indices_ptr": "*i32", "sent_counts_ptr": "*i32",
            "region_offsets_ptr": "*i64", "global_indices_ptr": "*i32", "global_counts_ptr": "*i32",
            "cap_sent": "i32", "cap_global": "i32", "sent_row_stride": "i32",
            "sent_counts_stride": "i32", "global_row_stride": "i32", "global_counts_stride": "i32",
            "SEARCH_STEPS": "constexpr", "BLOCK": "constexpr"},
           {"SEARCH_STEPS": 7, "BLOCK": 1024}, [0, 1, 2, 3, 4, 5], 4)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--verbose", action="store_true")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the kernels must be decorated as compiled JIT functions")
        return 2
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    target = GPUTarget("cuda", args.arch, 32)
    failed = 0
    for name, fn, sig, consts, div16, warps in variants():
        names = list(sig)
        attrs = {(names.index(a) if isinstance(a, str) else a,): [["tt.divisibility", 16]]
                 for a in div16}
        try:
            k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                               target=target, options={"num_warps": warps})
            ptx = k.asm["ptx"]
            loads = sorted(set(re.findall(r"ld\.global[\.\w]*", ptx)))
            atomics = sorted(set(re.findall(r"(?:atom|red)\.global[\.\w]*", ptx)))
            print(f"ok    {name:<40} loads {loads} atomics {atomics}")
        except Exception:
            failed += 1
            print(f"FAIL  {name}")
            traceback.print_exc(limit=None if args.verbose else 2)
    print(f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
