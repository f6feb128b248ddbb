"""kernels/_compile_check.py's spill bounds (``--spill-bounds``, :data:`SPILL_BOUNDS`): a variant
that spills more bytes per thread than its kernel's bound fails the check. No GPU needed: ptxas
for sm_90 reports the spills. Why: the launch options that keep step_bookkeeping at P = 128 and
the compact wire's placement pass from spilling kilobytes per thread (ptxas, not measured on a
GPU) are a choice a later edit could undo without any interpreter test noticing."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from oktopk_triton.kernels import _compile_check as cc


def test_spill_error_reads_the_report_against_the_bound():
    assert cc.spill_bytes("regs 128 spill 100 B") == 100
    assert cc.spill_bytes("regs ? spill ? B") == -1
    bound = cc.SPILL_BOUNDS["_bookkeeping_kernel"]
    assert cc.spill_error("_bookkeeping_kernel", f"regs 128 spill {bound} B") is None
    err = cc.spill_error("_bookkeeping_kernel", f"regs 255 spill {bound + 1} B")
    assert f"spills {bound + 1} B" in err and f"bound of {bound} B" in err
    # a kernel not named may spill nothing
    assert cc.spill_error("_place_kernel", "regs 128 spill 0 B") is None
    assert "bound of 0 B" in cc.spill_error("_place_kernel", "regs 168 spill 8 B")
    assert "no spill figure" in cc.spill_error("_place_kernel", "regs ? spill ? B")
    assert cc.spill_error("_x", "regs 9 spill 8 B", bounds={"_x": 8}) is None


# Compiles, with the spill bounds enforced, one variant of each kernel whose launch options were
# chosen against spills at the options it had before (4 warps; the placement pass also at
# BC=32), which must fail. At the options its launcher passes every variant is compiled with the
# bounds by tests/test_kernel_dispatch.py's full check, which must pass.
_SCRIPT = r"""
import json, sys
from oktopk_triton.kernels import _compile_check as cc
from triton.backends.compiler import GPUTarget
target = GPUTarget("cuda", 90, 32)
want = ("bookkeeping region update_th=True P=128", "wire place counts=True aligned=False")
for v in cc.variants():
    if not v[0].startswith(want):
        continue
    if "bookkeeping" in v[0]:
        tries = [("4 warps", v[3], 4)]
    else:
        tries = [("BC=32, 4 warps", {**v[3], "BC": 32}, 4)]
    for label, consts, warps in tries:
        try:
            line, _ = cc._compile_one(v[0], v[1], v[2], consts, v[4], warps, {}, target,
                                      spill_bounds=True)
            print(json.dumps([v[0], label, "ok", line]), flush=True)
        except AssertionError as e:
            print(json.dumps([v[0], label, "fail", str(e)]), flush=True)
"""


@pytest.mark.slow
def test_the_old_launch_options_break_the_spill_bounds():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    p = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                       text=True, timeout=600)
    if p.returncode != 0:
        if "ptxas" in p.stderr or "backend" in p.stderr.lower():
            pytest.skip(f"no CUDA compiler backend available: {p.stderr[-500:]}")
        raise AssertionError(p.stdout + p.stderr)
    got = {(name.split(" counts=")[0].split(" aligned=")[0].split(" update_th=")[0], label):
           (verdict, text) for name, label, verdict, text in map(json.loads,
                                                                 p.stdout.splitlines())}
    assert set(got) == {("bookkeeping region", "4 warps"),
                        ("wire place", "BC=32, 4 warps")}, p.stdout
    for key, kernel in ((("bookkeeping region", "4 warps"), "_bookkeeping_kernel"),
                        (("wire place", "BC=32, 4 warps"), "_place_kernel")):
        verdict, text = got[key]
        assert verdict == "fail" and f"{kernel} spills" in text, got[key]
        assert cc.spill_bytes(text.split("(")[-1]) > 1024, text    # kilobytes, not a margin
