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
    the interpreter cannot see.  Runs in a subprocess without TRITON_INTERPRET."""
    import subprocess
    import sys
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-m", "oktopk_triton.kernels._compile_check"],
                       env=env, capture_output=True, text=True, timeout=600)
    if p.returncode != 0 and "FAIL" not in p.stdout:
        pytest.skip(f"no CUDA compiler backend available: {p.stderr[-500:]}")
    assert p.returncode == 0, p.stdout + p.stderr
    from oktopk_triton.kernels import _compile_check as cc
    own = list(cc.variants())
    compiled = {line[6:].split(" loads ")[0].strip() for line in p.stdout.splitlines()
                if line.startswith("ok    ")}
    missing = [v[0] for v in own if v[0] not in compiled]
    assert not missing, f"not compiled: {missing}\n{p.stdout}"
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
    assert re.search(r"^vec   yes  _fill_if_kernel st: 1/1 variants, widest 16 B", p.stdout, re.M)


def test_compile_check_discovers_compile_variants(tmp_path, monkeypatch):
    """Every module of the package that defines compile_variants() is found, a module
    without it is skipped, a module that fails to import is reported with its exception."""
    from oktopk_triton.kernels import _compile_check as cc
    pkg = tmp_path / "fake_kernels"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "alpha.py").write_text("def compile_variants():\n    yield ('a', None, {}, {}, [], 4)\n")
    (pkg / "beta.py").write_text("X = 1\n")
    (pkg / "gamma.py").write_text("raise ImportError('half written')\n")
    (pkg / "_compile_check.py").write_text("def compile_variants():\n    yield 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    found = dict(cc.discovered_variants("fake_kernels"))
    assert sorted(found) == ["alpha", "gamma"]
    assert [v[0] for v in found["alpha"]()] == ["a"]
    assert isinstance(found["gamma"], ImportError) and "half written" in str(found["gamma"])


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
