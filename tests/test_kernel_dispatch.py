"""kernels/_dispatch.py and kernels/_compile_check.py: the backend choice, compiled Triton on
large CUDA inputs, and every kernel variant compiling for an sm_90 target."""
import os
import re

import oktopk_triton.kernels as K
import pytest
import torch
from kernel_cases import (
    GRAD_DTYPES,
    check_selection,
    make_grad,
    region_layout,
    requires_cuda,
    run_pair,
)
from oktopk_triton.kernels import fused_select, histogram_threshold


# ----------------------------------------------------------------------------------------------
# dispatch and CUDA
# ----------------------------------------------------------------------------------------------
def test_dispatch_choice():
    cpu = torch.device("cpu")
    assert K.choose("torch", cpu) == "torch"
    assert K.choose("auto", cpu) == ("triton" if K.INTERPRET else "torch")
    with pytest.raises(ValueError):
        K.choose("cuda", cpu)


def test_run_returns_the_chosen_result_and_falls_back_where_triton_does_not_fit():
    """_dispatch.run: Triton where chosen (and ``fits``), else the reference inside
    inside_kernel(); returns what ran; a bad backend is refused even with fits=False."""
    from oktopk_triton.kernels import _dispatch
    cpu, seen = torch.device("cpu"), []

    def tri(x):
        seen.append(("triton", x))
        return "t"

    def ref(x):
        seen.append(("torch", x, _dispatch.in_kernel()))
        return "r"

    assert _dispatch.run("torch", cpu, tri, ref, 1) == "r" and seen[-1] == ("torch", 1, True)
    assert not _dispatch.in_kernel()
    if K.INTERPRET:
        assert _dispatch.run("triton", cpu, tri, ref, 2) == "t" and seen[-1] == ("triton", 2)
        assert _dispatch.run("auto", cpu, tri, ref, 3, fits=False) == "r"
        assert seen[-1] == ("torch", 3, True)
    with pytest.raises(ValueError):
        _dispatch.run("cuda", cpu, tri, ref, 4, fits=False)
    assert len(seen) == (3 if K.INTERPRET else 1)


@requires_cuda
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
def test_cuda_compiled_large(dtype):
    n, P = (1 << 22) + 3, 8
    grad, residual = make_grad(n, GRAD_DTYPES[dtype], seed=11)
    offsets = region_layout(n, P, seed=12)
    thr = histogram_threshold(residual + grad.float(), n // 100)
    outs = run_pair(grad, residual, thr, offsets, n // 50)
    full = fused_select(grad, residual.clone(), thr, offsets, n, backend="torch")
    check_selection(outs["triton"][1], outs["torch"][1], full, residual + grad.float(), offsets,
                    n // 50, exact_order=False)


def test_kernels_compile_for_cuda_target():
    """Every kernel compiles to a cubin for sm_90 (no GPU needed): catches compiled-only errors
    the interpreter cannot see, and every variant keeps its spill bound (SPILL_BOUNDS).  Runs in
    a subprocess without TRITON_INTERPRET."""
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-m", "oktopk_triton.kernels._compile_check",
                        "--spill-bounds"], env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0 and "FAIL" not in p.stdout:
        pytest.skip(f"no CUDA compiler backend available: {p.stderr[-500:]}")
    assert p.returncode == 0, p.stdout + p.stderr
    from oktopk_triton.kernels import _compile_check as cc
    own = list(cc.variants())
    compiled = {line[6:].split(" loads ")[0].strip() for line in p.stdout.splitlines()
                if line.startswith("ok    ")}
    missing = [v[0] for v in own if v[0] not in compiled]
    assert not missing, f"not compiled: {missing}\n{p.stdout}"
    assert all(re.search(r" regs \d+ spill \d+ B$", line) for line in p.stdout.splitlines()
               if line.startswith("ok    ")), p.stdout
    total = re.search(r"^(\d+) compiled, (\d+) failed", p.stdout, re.M)
    assert total and int(total.group(2)) == 0 and int(total.group(1)) >= len(own), p.stdout
    # the kernels no GPU had run, each compiled in every mode its launcher has
    kernels = {cc._kernel_name(v[1]) for v in own}
    assert {"_bookkeeping_kernel", "_encode_ordered_kernel", "_chunk_count_kernel",
            "_place_kernel", "_decode_kernel", "_scatter_rows_dense_kernel",
            "_clear_sent_kernel"} <= kernels
    for mode in ("bookkeeping rank", "bookkeeping region", "P=1 ", "P=128 ",
                 "nonfinite=False", "zero_hist=True", "keep_bf16=True", "flag=False"):
        assert any(mode in name for name in compiled), mode
    # every module of the package with compile_variants() was compiled
    for module, _ in cc.discovered_variants():
        assert re.search(rf"\(modules: .*\b{module}\b", p.stdout), module
    # the streams that are vectorised today stay so: 16-byte loads in every fused_select over
    # n elements and every fp32 histogram level, 16-byte stores in fill_if
    for line in p.stdout.splitlines():
        if line.startswith(("ok    fused_select grad=", "ok    abs_histogram level=0 x=fp32",
                            "ok    abs_histogram level=1 x=fp32")):
            assert "vector ld 16 B" in line, line
    assert re.search(r"^vec   yes  _fill_if_kernel st: (\d+)/\1 variants, widest 16 B", p.stdout,
                     re.M)


def test_compile_check_discovers_compile_variants(tmp_path, monkeypatch):
    """Every module of the package that defines compile_variants() is found, a module
    without it is skipped, a module that fails to import is reported with its exception."""
    from oktopk_triton.kernels import _compile_check as cc
    pkg = tmp_path / "fake_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "alpha.py").write_text("COMPILE_STREAMING = {'_alpha_kernel': 'ld st'}\n"
                                  "def compile_variants():\n    yield ('a', None, {}, {}, [], 4)\n")
    (pkg / "beta.py").write_text("X = 1\n")
    (pkg / "gamma.py").write_text("raise ImportError('half written')\n")
    (pkg / "_compile_check.py").write_text("def compile_variants():\n    yield 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = dict(cc.discovered_variants("fake_kernels"))
    assert sorted(found) == ["alpha", "gamma"]
    assert [v[0] for v in found["alpha"]()] == ["a"]
    assert isinstance(found["gamma"], ImportError) and "half written" in str(found["gamma"])
    streaming = cc.streaming_kernels(list(found.items()))
    assert streaming["_alpha_kernel"] == "ld st" and streaming["_fused_select_kernel"] == "ld"


def test_compile_check_vector_width():
    """widest(): the widest VECTOR global load or store in a PTX text, in bytes per thread
    (a scalar .b64 load is not a vector); the report names the variants left scalar."""
    from oktopk_triton.kernels import _compile_check as cc
    ptx = ("ld.global.b64 %rd1, [%rd2];\n ld.global.v2.b32 {%r1, %r2}, [%rd3];\n"
           "@%p1 st.global.v4.b32 [%rd4], {%r1, %r2, %r3, %r4};\n"
           "ld.global.L1::evict_last.v4.b32 {%r5, %r6, %r7, %r8}, [%rd5];")
    assert cc.widest(ptx, "ld") == 16 and cc.widest(ptx, "st") == 16
    assert cc.widest("ld.global.b64 %rd1, [%rd2];", "ld") == 0
    assert cc.widest("ld.global.v2.b32 {%r1, %r2}, [%rd3];", "st") == 0
    lines = cc._vector_report({"_fill_if_kernel": [("a", {"ld": 0, "st": 16}),
                                                    ("b", {"ld": 0, "st": 0})],
                               "_other_kernel": [("c", {"ld": 16, "st": 0})]})
    assert lines[1] == "vec   part _fill_if_kernel st: 1/2 variants, widest 16 B"
    assert lines[2].endswith("not vectorised: b") and len(lines) == 3


_SIZE_DEPENDENT = ("STEPS", "SEARCH_STEPS")   # constexprs that follow the sizes, not the mode


def _covers(variant, sig, consts, options):
    """A compile variant covers a recorded launch: the same parameters, the same pointer and
    float types, the same mode constexprs, the same num_warps and fp fusion; an int argument is
    compiled as i32 or i64 (which one, and whether a 1 is specialised to a constexpr, follows
    the sizes, not the mode)."""
    vsig, vconsts, warps = variant[2], variant[3], variant[5]
    vopts = variant[6] if len(variant) > 6 else {}
    if list(vsig) != list(sig) or options.get("num_warps") != warps or \
            options.get("enable_fp_fusion", True) != vopts.get("enable_fp_fusion", True):
        return False
    for name, kind in sig.items():
        want = vsig[name]
        if name in consts and kind == "constexpr" and not isinstance(consts[name], int) \
                or isinstance(consts.get(name), bool):
            if want != "constexpr" or vconsts.get(name) != consts[name]:
                return False
        elif kind in ("i32", "i64"):
            if want not in ("i32", "i64"):
                return False
        elif kind == "constexpr" and consts.get(name) == 1 and want != "constexpr":
            if want not in ("i32", "i64"):
                return False
        elif kind == "constexpr":
            if name not in _SIZE_DEPENDENT and vconsts.get(name) != consts[name]:
                return False
        elif want != kind:
            return False
    return True


def _record_launches(monkeypatch, targets):
    """Replace each ``(module, kernel name)`` by a recorder of its launches: the list of
    ``(kernel, args, kwargs)`` they append to (nothing runs)."""
    log = []

    class Recorder:
        def __init__(self, kernel):
            self.kernel = kernel

        def __getitem__(self, grid):
            return lambda *a, **kw: log.append((self.kernel, a, kw))

    for mod, name in targets:
        monkeypatch.setattr(mod, name, Recorder(getattr(mod, name)))
    return log


def _assert_covered(log, variants):
    """Each recorded launch has a compile variant of its kernel that covers it; returns the
    names of the kernels launched."""
    from oktopk_triton.kernels import _compile_check as cc
    kernels = set()
    for kernel, args, kwargs in log:
        sig, consts, _, options = cc.launch_signature(kernel, args, kwargs)
        name = cc._kernel_name(kernel)
        kernels.add(name)
        own = [v for v in variants if cc._kernel_name(v[1]) == name]
        assert any(_covers(v, sig, consts, options) for v in own), (
            f"no compile variant of {name} covers the launch {sig} {consts} {options}")
    return kernels


@pytest.mark.skipif(not K.INTERPRET, reason="records launches of CPU tensors (interpreter)")
def test_compile_variants_cover_the_launches(monkeypatch):
    """Every launch the public functions make of the kernels no GPU has run (bookkeeping, the
    wire passes, scatter_rows_dense) and of clear_sent / scatter_add / scatter_rows, in each
    mode, is covered by a variant of the sm_90 compile check with the same argument types and
    constexprs: the check compiles what the launchers launch, not a guess of it."""
    pytest.importorskip("triton")
    from oktopk_triton.kernels import _compile_check as cc
    from oktopk_triton.kernels import bookkeeping, region, scatter, wire
    variants = list(cc.variants())        # the real kernels, before they are patched
    log = _record_launches(monkeypatch, (
        (bookkeeping, "_bookkeeping_kernel"), (wire, "_encode_ordered_kernel"),
        (wire, "_chunk_count_kernel"), (wire, "_place_kernel"), (wire, "_decode_kernel"),
        (scatter, "_scatter_rows_dense_kernel"), (scatter, "_scatter_add_kernel"),
        (scatter, "_scatter_rows_kernel"), (region, "_clear_sent_kernel")))
    i32, f32 = torch.int32, torch.float32
    for P, region_mode, upd, nf, zero in ((4, False, False, True, False),
                                          (128, False, False, False, True),
                                          (1, False, False, True, True),
                                          (4, True, True, True, True),
                                          (128, True, False, True, False),
                                          (128, True, True, False, True),
                                          (1, True, True, False, False)):
        cg = 8
        K.step_bookkeeping(
            torch.zeros(P, K.SELECT_HIST_BINS, dtype=i32), torch.ones(P),
            torch.zeros(P, dtype=i32), torch.zeros(P, dtype=i32),
            torch.zeros(P, 2 + 2 * cg, dtype=i32), torch.zeros(P, dtype=i32),
            torch.zeros(P, cg + 1, dtype=i32)[:, :cg], torch.arange(P + 1) * 10,
            torch.ones(()), torch.ones(()), torch.zeros(1, dtype=i32) if nf else None,
            n=10 * P, cap_s=cg, cap=None if region_mode else torch.ones(P), fill=3.0,
            row_target=torch.ones(P) if region_mode else None, mid=4.0, update_th=upd,
            zero_hist=zero, backend="triton")
    S, cap, span = 3, 40, 1 << 17
    idx = torch.arange(S * cap, dtype=i32).reshape(S, cap)
    vals = torch.randn(S, cap)
    cnts = torch.full((S,), 20, dtype=i32)
    for ordered in (True, False):
        for counts in (None, cnts):
            out = torch.zeros(S, 5 + 2 + cap, dtype=i32)
            K.wire_encode(idx, vals, counts, out, span, header=5, ordered=ordered,
                          backend="triton")
    msg = torch.zeros(S, 5 + 2 + cap, dtype=i32)
    K.wire_decode(msg, cap, span, header=5, backend="triton")
    buf = torch.zeros(S, 2 + 2 * cap, dtype=i32)
    K.wire_decode(msg, cap, span, header=5, backend="triton",
                  out=(buf[:, 2:2 + cap], buf[:, 2 + cap:].view(f32), buf[:, 0]))
    offs = torch.tensor([0, 40, 90, 200])
    for flag in (None, torch.zeros(1, dtype=i32)):
        K.scatter_rows_dense(torch.empty(200), idx, vals, cnts, offs, flag, backend="triton")
    for vel, bf in ((None, False), (torch.zeros(200), False), (None, True),
                    (torch.zeros(200), True)):
        K.clear_sent(torch.zeros(200), idx, cnts, offs, idx, cnts, velocity=vel,
                     keep_bf16_rounding=bf, backend="triton")
    for dense, base in ((torch.zeros(300), 0), (torch.zeros(300), torch.tensor(5)),
                        (torch.zeros(300, dtype=torch.bfloat16), 0),
                        (torch.zeros(300, dtype=torch.float16), 0)):
        K.scatter_add(dense, idx, vals, cnts, base=base, backend="triton")
    for add in (False, True):
        K.scatter_rows(torch.zeros(300), idx, vals, cnts, offs[:S], add=add, backend="triton")
    kernels = _assert_covered(log, variants)
    assert len(kernels) == 9 and len(log) >= 30


@pytest.mark.skipif(not K.INTERPRET, reason="records launches of CPU tensors (interpreter)")
def test_compile_variants_cover_the_streaming_launches(monkeypatch):
    """The same for fused_select, abs_histogram, window_pass and fill_if, launched as on a GPU
    (the launchers' compiled block sizes: INTERPRET off while they are called directly), in
    the modes the library launches: Ok-Topk's select with a skip flag, histograms, per-row
    thresholds and a velocity with or without masking; every gradient dtype."""
    pytest.importorskip("triton")
    from oktopk_triton.kernels import _compile_check as cc
    from oktopk_triton.kernels import _dispatch, elementwise, histogram, selection, threshold
    variants = list(cc.variants()) + list(threshold.compile_variants())
    log = _record_launches(monkeypatch, (
        (selection, "_fused_select_kernel"), (histogram, "_abs_histogram_kernel"),
        (threshold, "_window_pass_kernel"), (elementwise, "_fill_if_kernel")))
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    i32 = torch.int32
    P, cap, n = 4, 16, 4096
    offs = torch.tensor([0, 1000, 2000, 3000, n])
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        grad = torch.zeros(n, dtype=dt)
        # (skip, velocity, mask_velocity, hist, per-row threshold)
        for skip, vel, mask, hist, rows in ((False, False, False, False, False),
                                            (True, False, False, True, True),
                                            (True, True, False, True, True),
                                            (True, True, True, True, True),
                                            (False, True, True, True, True),
                                            (False, False, False, True, True)):
            selection._fused_select_triton(
                grad, torch.zeros(n), torch.ones(P) if rows else torch.ones(()), offs, cap,
                torch.zeros((), dtype=i32) if skip else None, K.empty_selection(P, cap, "cpu"),
                torch.zeros(n) if vel else None, 0.9, mask,
                torch.zeros(P, K.SELECT_HIST_BINS, dtype=i32) if hist else None)
        for prefix in (None, torch.tensor(3)):
            histogram._abs_histogram_triton(grad, prefix, None, None,
                                            torch.zeros(K.HIST_BINS, dtype=torch.int64),
                                            None if prefix is None else torch.zeros((), dtype=i32))
        for ranged in (False, True):
            s, e = (torch.tensor(5), torch.tensor(n)) if ranged else (5, n)
            threshold._window_pass_triton(grad, torch.tensor([1, 2], dtype=i32), s, e, n - 5,
                                          torch.zeros(32, 64, dtype=i32),
                                          torch.zeros(32, dtype=torch.int64),
                                          torch.zeros(2, dtype=torch.int64))
        elementwise._fill_if_triton(grad, torch.zeros(1, dtype=i32), 0.0)
    histogram._abs_histogram_triton(torch.zeros(n), torch.tensor(3), torch.tensor(5),
                                    torch.tensor(n), torch.zeros(K.HIST_BINS, dtype=torch.int64),
                                    torch.zeros((), dtype=i32))
    selection._fused_select_triton(torch.zeros(1), torch.zeros(1), torch.ones(()),
                                   torch.tensor([0, 1]), cap, None,
                                   K.empty_selection(1, cap, "cpu"), None, 0.0, False, None)
    kernels = _assert_covered(log, variants)
    assert len(kernels) == 4 and len(log) == 35
