"""kernels/_dispatch.py and kernels/_compile_check.py: the backend choice, compiled Triton on
large CUDA inputs, and every kernel variant compiling for an sm_90 target."""
import os

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
    assert "fused_select grad=fp32" in p.stdout and "ld.global.v4" in p.stdout
