"""Compile every kernel for a CUDA target without a GPU (ttir -> ... -> cubin).

    python -m oktopk_triton.kernels._compile_check [--arch 90] [--verbose] [--jobs N]
                                                   [--resources] [--spill-bounds]

Catches errors of the compiled path (types, loop-carried values, constexpr specialisation)
that the interpreter does not see.  Each variant is compiled with the signature and constexprs
its launcher passes; lengths and offsets as i64 (n > 2^31: the interpreter tests cannot
allocate such n).  The variants are this file's (:func:`variants`) and those of every module
of the kernels package that defines ``compile_variants()``, a generator of the same tuples
(:func:`discovered_variants`); a module that fails to import, or whose generator raises, counts
as a failure.  A variant carries the compile options its launcher passes (fused_select:
``enable_fp_fusion=False``), and a variant with a velocity FAILS if its PTX holds an fma (16
of them with fusion on): the velocity update ``u * momentum + grad`` must round twice,
bitwise like the torch reference.

Must run in a process WITHOUT ``TRITON_INTERPRET=1`` (the kernels are then decorated as
compiled JIT functions); tests/test_kernel_dispatch.py runs it in a subprocess.  Variants
compile in ``--jobs`` forked processes.  Exit status 1 when a variant fails to compile.

Measured why: docs/research/design-notes.md, ``oktopk_triton/kernels/_compile_check.py``.
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import traceback


def variants():
    """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps[, options]) per
    variant: ``options`` (optional) are the other compile options its launcher passes, e.g.
    ``{"enable_fp_fusion": False}``."""
    yield from _selection_variants()
    yield from _histogram_variants()
    yield from _scatter_variants()
    yield from _region_variants()
    yield from _elementwise_variants()
    yield from _bookkeeping_variants()
    yield from _wire_variants()


def _selection_variants():
    """fused_select: every gradient dtype and flag combination, and n == 1."""
    from . import selection
    sel_sig = {"grad_ptr": "*fp32", "residual_ptr": "*fp32", "velocity_ptr": "*fp32",
               "threshold_ptr": "*fp32", "region_offsets_ptr": "*i64", "indices_ptr": "*i32",
               "values_ptr": "*fp32", "counts_ptr": "*i32", "nonfinite_ptr": "*i32",
               "hist_ptr": "*i32", "skip_ptr": "*i32", "weight_ptr": "*fp32",
               "n": "i64", "P": "i32", "capacity": "i32", "momentum": "fp32", "rate": "fp32",
               "keep": "fp32",
               "idx_row_stride": "i32", "val_row_stride": "i32", "counts_stride": "i32",
               "nonfinite_stride": "i32",
               "HAS_SKIP": "constexpr", "HAS_VELOCITY": "constexpr", "MASK_VELOCITY": "constexpr",
               "HAS_HIST": "constexpr", "HAS_WEIGHT": "constexpr", "UPDATE_WEIGHT": "constexpr",
               "THR_PER_REGION": "constexpr",
               "HIST_BINS": "constexpr",
               "HIST_SHIFT": "constexpr", "SEARCH_STEPS": "constexpr", "BLOCK": "constexpr"}
    sel_const = {"HIST_BINS": selection.SELECT_HIST_BINS, "HIST_SHIFT": selection.SELECT_HIST_SHIFT,
                 "SEARCH_STEPS": 4, "BLOCK": 2048}
    ptr16 = list(range(12)) + [12]        # pointers and n divisible by 16 (as the JIT specialises)
    no_fma = {"enable_fp_fusion": False}  # as _fused_select_triton launches it
    # (skip, velocity, mask_velocity, hist, per-row thresholds); Ok-Topk's select is the last
    # three (skip: the non-finite flag; momentum correction with masking or without)
    modes = ((False, False, False, False, False), (True, False, False, False, True),
             (False, True, True, True, True), (True, True, True, False, False),
             (False, False, False, True, True), (True, False, False, True, True),
             (True, True, False, True, True), (True, True, True, True, True))
    for gd in ("*fp32", "*bf16", "*fp16"):
        for skip, vel, mask, hist, per_region in modes:
            yield (f"fused_select grad={gd[1:]} skip={skip} velocity={vel} mask={mask} "
                   f"hist={hist} thr_per_region={per_region}", selection._fused_select_kernel,
                   {**sel_sig, "grad_ptr": gd},
                   {**sel_const, "HAS_SKIP": skip, "HAS_VELOCITY": vel, "MASK_VELOCITY": mask,
                    "HAS_HIST": hist, "HAS_WEIGHT": False, "UPDATE_WEIGHT": False,
                    "THR_PER_REGION": per_region},
                   ptr16, 4, no_fma)
    # Ok-Topk's select with ``consistency`` (the score |acc|·|weight|, the weight's EMA updated
    # in the pass), and a weight alone
    for gd, upd in (("*fp32", True), ("*bf16", True), ("*fp32", False)):
        for vel in (False, True):
            yield (f"fused_select grad={gd[1:]} skip=True velocity={vel} mask={vel} hist=True "
                   f"thr_per_region=True weight=True update={upd}", selection._fused_select_kernel,
                   {**sel_sig, "grad_ptr": gd},
                   {**sel_const, "HAS_SKIP": True, "HAS_VELOCITY": vel, "MASK_VELOCITY": vel,
                    "HAS_HIST": True, "HAS_WEIGHT": True, "UPDATE_WEIGHT": upd,
                    "THR_PER_REGION": True}, ptr16, 4, no_fma)
    # n == 1 specialised to a constexpr
    yield ("fused_select n=1", selection._fused_select_kernel, {**sel_sig, "n": "constexpr"},
           {**sel_const, "n": 1, "HAS_SKIP": False, "HAS_VELOCITY": False, "MASK_VELOCITY": False,
            "HAS_HIST": False, "HAS_WEIGHT": False, "UPDATE_WEIGHT": False, "THR_PER_REGION": False,
            "SEARCH_STEPS": 1},
           list(range(12)), 4, no_fma)


def _histogram_variants():
    """abs_histogram: both levels, every dtype, with and without the skip flag (without it the
    output stands in for its pointer), and the device-range form."""
    from . import histogram
    hsig = {"x_ptr": "*fp32", "hist_ptr": "*i64", "prefix_ptr": "*i64", "start_ptr": "*i64",
            "end_ptr": "*i64", "skip_ptr": "*i32", "start_int": "i32", "end_int": "i64",
            "blocks_per_program": "i32", "HAS_SKIP": "constexpr", "LEVEL": "constexpr",
            "START_IS_PTR": "constexpr", "END_IS_PTR": "constexpr", "HIST_BINS": "constexpr",
            "SHIFT": "constexpr", "BLOCK": "constexpr"}
    hconst = {"HIST_BINS": histogram.HIST_BINS, "BLOCK": 1024}
    for lvl in (0, 1):
        for x in ("*fp32", "*bf16", "*fp16"):
            for skip in (False, True):
                yield (f"abs_histogram level={lvl} x={x[1:]} skip={skip}",
                       histogram._abs_histogram_kernel,
                       {**hsig, "x_ptr": x, "skip_ptr": "*i32" if skip else "*i64"},
                       {**hconst, "HAS_SKIP": skip, "LEVEL": lvl, "START_IS_PTR": False,
                        "END_IS_PTR": False, "SHIFT": 20 if lvl == 0 else 9},
                       [0, 1, 2, 3, 4, 5, 6, 7], 8)     # start_int 0: divisible by 16
    yield ("abs_histogram device range", histogram._abs_histogram_kernel, hsig,
           {**hconst, "HAS_SKIP": True, "LEVEL": 1, "START_IS_PTR": True, "END_IS_PTR": True,
            "SHIFT": 9}, [0, 1, 2, 3, 4, 5], 8)


def _scatter_variants():
    """scatter_add and scatter_rows."""
    from . import scatter
    for base_ptr in (False, True):      # without a base tensor the counts stand in for it
        yield (f"scatter_add base_ptr={base_ptr}", scatter._scatter_add_kernel,
               {"dense_ptr": "*fp32", "indices_ptr": "*i32", "values_ptr": "*fp32",
                "count_ptr": "*i32", "base_ptr": "*i64" if base_ptr else "*i32",
                "base_int": "i64", "capacity": "i32",
                "BASE_IS_PTR": "constexpr",
                "BLOCK": "constexpr"}, {"BASE_IS_PTR": base_ptr, "BLOCK": 1024}, [0, 1, 2, 3, 4], 4)
    for add in (False, True):
        yield (f"scatter_rows add={add}", scatter._scatter_rows_kernel,
               {"dense_ptr": "*fp32", "indices_ptr": "*i32", "values_ptr": "*fp32",
                "counts_ptr": "*i32", "row_base_ptr": "*i64", "capacity": "i32",
                "idx_row_stride": "i32", "val_row_stride": "i32", "counts_stride": "i32",
                "row_base_stride": "i32", "ADD": "constexpr", "BLOCK": "constexpr"},
               {"ADD": add, "BLOCK": 1024}, [0, 1, 2, 3, 4], 4)
    for dense in ("*bf16", "*fp16"):     # scatter_add's dense may be any float (the torch ref too)
        yield (f"scatter_add dense={dense[1:]}", scatter._scatter_add_kernel,
               {"dense_ptr": dense, "indices_ptr": "*i32", "values_ptr": "*fp32",
                "count_ptr": "*i32", "base_ptr": "*i32", "base_int": "i64", "capacity": "i32",
                "BASE_IS_PTR": "constexpr", "BLOCK": "constexpr"},
               {"BASE_IS_PTR": False, "BLOCK": 1024}, [0, 1, 2, 3, 4], 4)
    # scatter_rows_dense: as _scatter_rows_dense_triton launches it (cap, total not
    # specialised; n divisible by 16 or not; without a flag the counts stand in for its pointer)
    dsig = {"dense_ptr": "*fp32", "idx_ptr": "*i32", "val_ptr": "*fp32", "cnt_ptr": "*i32",
            "offs_ptr": "*i64", "flag_ptr": "*i32", "n": "i64", "cap": "i32", "total": "i64",
            "idx_stride": "i32", "val_stride": "i32", "STEPS": "constexpr",
            "HAS_FLAG": "constexpr", "BLOCK": "constexpr", "CHUNK": "constexpr"}
    for flag, P, n16 in ((True, 4, True), (False, 4, True), (True, 128, True),
                         (True, 4, False)):
        yield (f"scatter_rows_dense flag={flag} P={P} n%16={'0' if n16 else 'any'}",
               scatter._scatter_rows_dense_kernel,
               dsig, {"STEPS": 25 + P.bit_length(), "HAS_FLAG": flag, "BLOCK": 4096,
                      "CHUNK": 128},
               ["dense_ptr", "idx_ptr", "val_ptr", "cnt_ptr", "offs_ptr", "flag_ptr",
                "idx_stride", "val_stride"] + (["n"] if n16 else []), 4)


def _region_variants():
    """clear_sent (region_count and region_write went with region_select, commit c368816)."""
    from . import region
    for vel, bf in ((False, False), (True, False), (False, True), (True, True)):
        yield (f"clear_sent velocity={vel} keep_bf16={bf}", region._clear_sent_kernel,
               {"residual_ptr": "*fp32", "velocity_ptr": "*fp32", "sent_indices_ptr": "*i32",
                "sent_counts_ptr": "*i32", "region_offsets_ptr": "*i64",
                "global_indices_ptr": "*i32", "global_counts_ptr": "*i32",
                "cap_sent": "i32", "cap_global": "i32", "sent_row_stride": "i32",
                "sent_counts_stride": "i32", "global_row_stride": "i32",
                "global_counts_stride": "i32", "SEARCH_STEPS": "constexpr",
                "HAS_VELOCITY": "constexpr", "KEEP_BF16_ROUNDING": "constexpr",
                "BLOCK": "constexpr"},
               {"SEARCH_STEPS": 7, "HAS_VELOCITY": vel, "KEEP_BF16_ROUNDING": bf, "BLOCK": 1024},
               [0, 1, 2, 3, 4, 5, 6], 4)


def _bookkeeping_variants():
    """_bookkeeping_kernel as _bookkeeping_triton launches it: rank and region mode, P = 1
    (specialised to a constexpr, no balancing), 4 and TRITON_MAX_P, with and without the
    non-finite flag (without it the stats stand in for its pointer), zero_hist on and off."""
    from . import bookkeeping as bk
    from ._dispatch import next_pow2
    sig = {"hist_ptr": "*i32", "th_ptr": "*fp32", "cap_ptr": "*fp32", "target_ptr": "*fp32",
           "stage_ptr": "*i32", "sent_ptr": "*i32", "sent_stride": "i32", "gath_ptr": "*i32",
           "gath_stride": "i32", "icnt_ptr": "*i32", "iidx_ptr": "*i32", "iidx_stride": "i32",
           "offs_ptr": "*i64", "thg_ptr": "*fp32", "gmin_ptr": "*fp32", "nf_ptr": "*i32",
           "stats_ptr": "*i64", "P": "i32", "n": "i64", "cg": "i32", "cap_s": "i32",
           "fill": "fp32", "mid": "fp32", "span": "i64", "BP": "constexpr", "B": "constexpr",
           "SHIFT": "constexpr", "REGION": "constexpr", "UPDATE_TH": "constexpr",
           "HAS_NF": "constexpr", "BALANCE": "constexpr", "ZERO_HIST": "constexpr",
           "CAP_SPAN": "constexpr"}
    div16 = ["hist_ptr", "th_ptr", "cap_ptr", "target_ptr", "stage_ptr", "sent_ptr", "gath_ptr",
             "icnt_ptr", "iidx_ptr", "offs_ptr", "thg_ptr", "gmin_ptr", "nf_ptr", "stats_ptr",
             "n"]
    # (region, update_th, P, has_nf, zero_hist, cap_span: the regions bounded, packed wires)
    for region, upd, P, nf, zero, cap in ((False, False, 4, True, False, False),
                                          (False, False, bk.TRITON_MAX_P, False, True, False),
                                          (False, False, 1, True, True, False),
                                          (True, True, 4, True, True, False),
                                          (True, False, bk.TRITON_MAX_P, True, False, False),
                                          (True, True, bk.TRITON_MAX_P, False, True, False),
                                          (True, True, 1, False, False, False),
                                          (False, False, 64, True, False, True),
                                          (False, False, bk.TRITON_MAX_P, True, True, True)):
        vsig = {**sig, "nf_ptr": "*i32" if nf else "*i64"}
        consts = {"BP": max(2, next_pow2(P)), "B": bk.SELECT_HIST_BINS,
                  "SHIFT": bk.SELECT_HIST_SHIFT, "REGION": region, "UPDATE_TH": upd,
                  "HAS_NF": nf, "BALANCE": P > 1, "ZERO_HIST": zero, "CAP_SPAN": cap}
        if P == 1:          # the JIT specialises an int argument equal to 1
            vsig.update(P="constexpr", sent_stride="constexpr")
            consts.update(P=1, sent_stride=1)
        yield (f"bookkeeping {'region' if region else 'rank'} update_th={upd} P={P} "
               f"nonfinite={nf} zero_hist={zero} cap_span={cap}", bk._bookkeeping_kernel, vsig,
               consts, div16, bk.num_warps(P))


def _wire_variants():
    """The compact wire's passes as _encode_triton and _decode_triton launch them: the
    ascending rows' single pass (order "ascending", and "sort" after its sort), the grouped
    rows' count and placement passes (order "chunks"), the decode; each with and without the
    rows' counts, rows aligned to 16 bytes (strides divisible by 16) and not, and cap as i64."""
    from . import wire
    ptrs = ["idx_ptr", "val_ptr", "cnt_ptr", "out_ptr", "scratch_ptr"]
    strides = ["idx_stride", "val_stride", "out_stride"]
    steps = 21                                      # ceil_log2(cap + 1) for cap near 2^20
    for has, aligned, cap in ((False, True, "i32"), (True, False, "i32"), (True, True, "i64")):
        tag = f"counts={has} aligned={aligned} cap={cap}"
        div = ptrs + (strides if aligned else [])
        yield (f"wire encode_ordered {tag}", wire._encode_ordered_kernel,
               {"idx_ptr": "*i32", "val_ptr": "*fp32", "cnt_ptr": "*i32", "out_ptr": "*i32",
                "cap": cap, "C": "i32", "header": "i32", "idx_stride": "i32",
                "val_stride": "i32", "out_stride": "i32", "HAS_COUNTS": "constexpr",
                "STEPS": "constexpr", "BLOCK": "constexpr", "BLOCK_C": "constexpr"},
               {"HAS_COUNTS": has, "STEPS": steps, "BLOCK": wire._BLOCK,
                "BLOCK_C": wire._BLOCK_C}, div[:4] + div[5:], 4)
        yield (f"wire chunk_count {tag}", wire._chunk_count_kernel,
               {"idx_ptr": "*i32", "cnt_ptr": "*i32", "scratch_ptr": "*i32", "cap": cap,
                "C": "i32", "idx_stride": "i32", "HAS_COUNTS": "constexpr",
                "BLOCK": "constexpr"}, {"HAS_COUNTS": has, "BLOCK": wire._BLOCK},
               ["idx_ptr", "cnt_ptr", "scratch_ptr"] + (["idx_stride"] if aligned else []), 4)
        yield (f"wire place {tag}", wire._place_kernel,
               {"idx_ptr": "*i32", "val_ptr": "*fp32", "cnt_ptr": "*i32", "out_ptr": "*i32",
                "scratch_ptr": "*i32", "cap": cap, "C": "i32", "header": "i32",
                "idx_stride": "i32", "val_stride": "i32", "out_stride": "i32",
                "HAS_COUNTS": "constexpr", "BLOCK": "constexpr", "BLOCK_C": "constexpr",
                "BC": "constexpr"},
               {"HAS_COUNTS": has, "BLOCK": wire._BLOCK, "BLOCK_C": wire._BLOCK_C,
                "BC": wire._PLACE_BC}, div, wire._PLACE_WARPS)
        dsig = {"msg_ptr": "*i32", "idx_out": "*i32", "val_out": "*fp32", "cnt_out": "*i32",
                "cap": cap, "C": "i32", "header": "i32", "msg_stride": "i32",
                "idx_stride": "i32", "val_stride": "i32", "cnt_stride": "i32",
                "BLOCK": "constexpr", "BC": "constexpr"}
        dconst = {"BLOCK": wire._BLOCK, "BC": wire._DECODE_BC}
        if not has:         # stands for a count column of stride 1 (specialised to 1)
            dsig["cnt_stride"], dconst["cnt_stride"] = "constexpr", 1
        yield (f"wire decode aligned={aligned} cap={cap}", wire._decode_kernel, dsig, dconst,
               ["msg_ptr", "idx_out", "val_out", "cnt_out"]
               + (["msg_stride", "idx_stride", "val_stride"] if aligned else []),
               wire._DECODE_WARPS)


def _elementwise_variants():
    """fill_if on every float dtype, at its launcher's block."""
    from . import elementwise
    for out in ("*fp32", "*bf16", "*fp16"):
        yield (f"fill_if out={out[1:]}", elementwise._fill_if_kernel,
               {"out_ptr": out, "flag_ptr": "*i32", "value": "fp32", "n": "i64",
                "BLOCK": "constexpr"}, {"BLOCK": 4096}, [0, 1, 3], 4)


def discovered_variants(package: str = __package__):
    """``(module name, its compile_variants())`` for every other module of ``package`` (the
    kernels package) that defines ``compile_variants()`` (a generator of the same tuples as
    :func:`variants`), by name. A module that fails to import is yielded with the exception
    instead of a generator."""
    import importlib
    import pkgutil
    pkg = importlib.import_module(package)
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if info.name == "_compile_check":
            continue
        try:
            module = importlib.import_module(f"{package}.{info.name}")
        except Exception as exc:              # a broken module is a failure, not a crash
            yield info.name, exc
            continue
        gen = getattr(module, "compile_variants", None)
        if callable(gen):
            yield info.name, gen


# The kernels that stream an array (the ops that should be vectorised: ld, st or both); the
# others gather or scatter at data-dependent positions, or are one small program.
STREAMING = {"_fused_select_kernel": "ld", "_abs_histogram_kernel": "ld",
             "_window_pass_kernel": "ld", "_fill_if_kernel": "st",
             "_scatter_rows_dense_kernel": "st", "_encode_ordered_kernel": "ld st",
             "_chunk_count_kernel": "ld", "_place_kernel": "ld", "_decode_kernel": "ld st"}


# Bytes per thread a variant may spill (ptxas -v, sm_90) before --spill-bounds fails it; a
# kernel not named may spill nothing. Recorded from --resources at today's launch options:
# step_bookkeeping at P = 128 spills 100-124 B with 16 warps (2768-2892 B with 4, 220-224 B
# with 8); the quantized wire's finish pass (kernels/wire_quantized.py: BC=32 at 4 warps, as the
# compact wire's placement pass had before it took BC=8 at 8 warps) 1764-2004 B. Raise a bound
# only with the numbers that justify it.
SPILL_BOUNDS = {"_bookkeeping_kernel": 128, "_finish_kernel": 32}


def spill_bytes(report: str) -> int:
    """The bytes spilled in a :func:`resources` report (``"regs R spill S B"``); -1 unknown."""
    m = re.search(r"spill (\d+) B", report)
    return int(m.group(1)) if m else -1


def spill_error(kernel: str, report: str, bounds=None):
    """Why ``kernel``'s :func:`resources` report breaks its spill bound (:data:`SPILL_BOUNDS`,
    0 for a kernel not named there), or None when it keeps it."""
    bound = (SPILL_BOUNDS if bounds is None else bounds).get(kernel, 0)
    spilled = spill_bytes(report)
    if spilled < 0:
        return f"{kernel}: ptxas reported no spill figure ({report!r})"
    if spilled > bound:
        return (f"{kernel} spills {spilled} B per thread, more than its bound of {bound} B "
                "(SPILL_BOUNDS): change the launch options or record the new bound")
    return None


def streaming_kernels(sources):
    """:data:`STREAMING` and the ``COMPILE_STREAMING`` of every module in ``sources`` (the
    ``(name, compile_variants)`` pairs of :func:`discovered_variants`)."""
    streaming = dict(STREAMING)
    for _, gen in sources:
        module = sys.modules.get(getattr(gen, "__module__", None) or "")
        streaming.update(getattr(module, "COMPILE_STREAMING", {}))
    return streaming


def widest(ptx: str, op: str) -> int:
    """Bytes per thread of the widest VECTOR ``ld.global`` / ``st.global`` (op "ld" / "st") in
    ``ptx``: 16 for ``.v4.b32``, 8 for ``.v2.b32``; 0 when every one is scalar (a ``.b64``
    load of an int64 is scalar, not a vectorised stream)."""
    best = 0
    for m in re.finditer(rf"\b{op}\.global[\w.:]*?\.v(\d)\.[bfsu](\d+)\b", ptx):
        best = max(best, int(m.group(1)) * int(m.group(2)) // 8)
    return best


def launch_signature(kernel, args, kwargs):
    """``(signature, constexprs, divisible-by-16 args)`` the CUDA JIT would compile the launch
    ``kernel[grid](*args, **kwargs)`` with: Triton's own specialisation of each argument (an int
    equal to 1 becomes a constexpr, one divisible by 16 and a 16-byte aligned tensor are marked,
    ``do_not_specialize`` is honoured), and the launch options (num_warps, enable_fp_fusion,
    ...) as a 4th item. Works on CPU tensors and on an interpreted kernel: what a test compares
    a variant with."""
    import inspect

    from triton.backends.compiler import BaseBackend
    from triton.runtime.jit import native_specialize_impl
    fn = getattr(kernel, "fn", kernel)
    params = inspect.signature(fn).parameters
    dns = getattr(kernel, "do_not_specialize", None)
    if dns is None:                                  # an interpreted kernel keeps its kwargs
        dns = getattr(kernel, "kwargs", {}).get("do_not_specialize")
    dns = set(dns or [])
    bound = inspect.signature(fn).bind(*args, **{k: v for k, v in kwargs.items()
                                                 if k in params})
    sig, consts, div16 = {}, {}, []
    for i, (name, value) in enumerate(bound.arguments.items()):
        if "constexpr" in str(params[name].annotation):
            sig[name], consts[name] = "constexpr", value
            continue
        spec = name not in dns and i not in dns
        kind, attr = native_specialize_impl(BaseBackend, value, False, spec, True)
        sig[name] = kind
        if kind == "constexpr":
            consts[name] = value
        elif attr == "D":
            div16.append(name)
    return sig, consts, div16, {k: v for k, v in kwargs.items() if k not in params}


def _kernel_name(fn) -> str:
    return getattr(getattr(fn, "fn", fn), "__name__", str(fn))


def resources(ptx: str, arch: int, fmad: bool = True) -> str:
    """``"regs R spill S B"``: the registers per thread and the bytes spilled to local memory
    that ptxas reports for ``ptx`` (run again, verbose: the compile does not keep its log)."""
    import subprocess
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([get_ptxas(arch).path, "-v", *([] if fmad else ["--fmad=false"]),
                              f"--gpu-name={sm_arch_from_capability(arch)}", src, "-o",
                              os.path.join(tmp, "k.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores", log)
    return f"regs {regs.group(1) if regs else '?'} spill {spill.group(1) if spill else '?'} B"


def _compile_one(name, fn, sig, consts, div16, warps, options, target, with_resources=False,
                 spill_bounds=False):
    """Compile one variant; returns its report line and {op: widest bytes}. Raises on error,
    and (``spill_bounds``, which implies ``with_resources``) when the variant spills more than
    :data:`SPILL_BOUNDS` allows its kernel."""
    import triton
    from triton.compiler import ASTSource
    names = list(sig)
    attrs = {(names.index(a) if isinstance(a, str) else a,): [["tt.divisibility", 16]]
             for a in div16}
    options = {"num_warps": warps, **options}
    k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                       target=target, options=options)
    ptx = k.asm["ptx"]
    loads = sorted(set(re.findall(r"ld\.global[\.\w]*", ptx)))
    atomics = sorted(set(re.findall(r"(?:atom|red)\.global[\.\w]*", ptx)))
    fma = len(re.findall(r"\bfma\.rn\.f32", ptx))
    if consts.get("HAS_VELOCITY") and fma:
        raise AssertionError(f"{fma} fma.rn.f32 in the velocity update: it must round "
                             "twice (u * momentum, then + grad) like the torch reference")
    width = {op: widest(ptx, op) for op in ("ld", "st")}
    extra = ""
    if with_resources or spill_bounds:
        extra = resources(ptx, target.arch, options.get("enable_fp_fusion", True))
        error = spill_error(_kernel_name(fn), extra) if spill_bounds else None
        if error:
            raise AssertionError(f"{error} ({extra})")
        extra = " " + extra
    return (f"ok    {name:<40} loads {loads} atomics {atomics} fma {fma} "
            f"vector ld {width['ld']} B st {width['st']} B{extra}"), width


def _vector_report(widths, streaming=None):
    """One line per streaming kernel compiled: in how many of its variants the op that streams
    is vectorised (``.v2``/``.v4``), and which are not."""
    lines = ["streaming kernels (vectorised: a .v2/.v4 global load or store, the widest in "
             "bytes per thread):"]
    for kernel, ops in (streaming or STREAMING).items():
        seen = widths.get(kernel)
        if not seen:
            continue
        for op in ops.split():
            vec = [v for v, w in seen if w[op]]
            best = max(w[op] for _, w in seen)
            verdict = "yes " if len(vec) == len(seen) else ("part" if vec else "NO  ")
            lines.append(f"vec   {verdict} {kernel} {op}: {len(vec)}/{len(seen)} variants, "
                         f"widest {best} B")
            if vec and len(vec) < len(seen):
                not_vec = [v for v, w in seen if not w[op]]
                lines.append(f"        not vectorised: {'; '.join(not_vec)}")
    return lines


def _sources():
    """[(module name, variant generator or the exception its import raised)]: this file's
    variants first, then every module's compile_variants()."""
    return [("_compile_check", variants)] + list(discovered_variants())


def _job(job):
    """Compile variant ``i`` of source ``src`` (run in a worker: the variants are regenerated
    there, kernels are not pickled). Returns (kernel, variant, report line, widths, error)."""
    src, i, arch, verbose, with_resources, spill_bounds = job
    from triton.backends.compiler import GPUTarget
    _, gen = _sources()[src]
    for j, variant in enumerate(gen()):
        if j == i:
            break
    name, fn = variant[0], variant[1]
    try:
        options = variant[6] if len(variant) > 6 else {}
        line, width = _compile_one(*variant[:6], options, GPUTarget("cuda", arch, 32),
                                   with_resources, spill_bounds)
        return _kernel_name(fn), name, line, width, None
    except Exception:
        return _kernel_name(fn), name, f"FAIL  {name}", None, traceback.format_exc(
            limit=None if verbose else 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--jobs", type=int, default=min(8, os.cpu_count() or 1),
                    help="compile in this many processes (default: the cores, at most 8)")
    ap.add_argument("--resources", action="store_true",
                    help="also report each variant's registers and spills (ptxas -v once more)")
    ap.add_argument("--spill-bounds", action="store_true",
                    help="fail a variant that spills more than SPILL_BOUNDS allows its kernel "
                         "(implies --resources)")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the kernels must be decorated as compiled JIT functions")
        return 2
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")   # Triton 3.9's default, unwarned
    failed, jobs, sources = 0, [], _sources()
    for src, (module, gen) in enumerate(sources):
        try:                                # the module's import or its generator may break
            if isinstance(gen, Exception):
                raise gen
            jobs += [(src, i, args.arch, args.verbose, args.resources, args.spill_bounds)
                     for i, _ in enumerate(gen())]
        except Exception:
            failed += 1
            print(f"FAIL  kernels.{module}: its compile_variants() could not run")
            traceback.print_exc(limit=None if args.verbose else 2)
    if args.jobs > 1 and len(jobs) > 1:
        import multiprocessing
        pool = multiprocessing.get_context("fork").Pool(args.jobs)
        results = pool.imap(_job, jobs)
    else:
        pool, results = None, map(_job, jobs)
    compiled, widths = 0, {}
    for kernel, name, line, width, error in results:
        print(line, flush=True)
        if error is None:
            compiled += 1
            widths.setdefault(kernel, []).append((name, width))
        else:
            failed += 1
            print(error, end="")
    if pool is not None:
        pool.close()
        pool.join()
    print("\n".join(_vector_report(widths, streaming_kernels(sources))))
    print(f"{compiled} compiled, {failed} failed "
          f"(modules: {', '.join(m for m, _ in sources)})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
