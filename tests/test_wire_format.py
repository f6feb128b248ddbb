"""The wire format as an object (oktopk_triton/kernels/wire_format.py): one per format, found by
name, asked for its bytes and rows; a format added in one place is carried end to end; and no
code outside the wire modules compares against a format's name."""
from __future__ import annotations

import math
import os
import pathlib
import re
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))
from conservation import assert_bitwise_agreement, assert_conservation, mixed, run_steps  # noqa: E402,I001

from oktopk_triton.algorithms import _wire as W  # noqa: E402
from oktopk_triton.kernels import wire_format as WF  # noqa: E402
from oktopk_triton.kernels.wire import Compact  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_four_formats_and_their_sizes():
    assert WF.names() == W.WIRE_FORMATS == ("fp32", "compact", "q2", "q4")
    assert W.QUANTIZED == {"q2": 2, "q4": 4}
    assert [W.entry_bytes(f) for f in W.WIRE_FORMATS] == [8.0, 4.0, 2.25, 2.5]
    for cap, span, header in ((1, 1, 0), (100, 70_000, 1), (4097, 1 << 20, 2)):
        C = math.ceil(span / 65536)
        assert W.row_words(cap, span, header) == header + C + cap
        for b in (2, 4):
            assert W.row_words(cap, span, header, f"q{b}") == \
                header + 3 * C + (cap + 1) // 2 + math.ceil(cap * b / 32)
        assert W.format_of("fp32").row_words(cap, span, header) == header + 2 * cap
    assert not W.packed("fp32") and not W.packed(None) and W.packed("q4")
    assert W.format_of("q2").quantized and not W.format_of("compact").quantized


def test_an_unknown_format_is_one_line_everywhere():
    for call, owner in ((lambda: W.entry_bytes("q3"), "entry_bytes: wire_format"),
                        (lambda: W.row_words(4, 10, fmt="q3"), "row_words: wire_format"),
                        (lambda: W.check_wire_format("topka", "q3", None, None), "topka: "
                                                                                "wire_format")):
        with pytest.raises(ValueError) as e:
            call()
        assert str(e.value) == f"{owner} must be one of ('fp32', 'compact', 'q2', 'q4'), " \
                               "got 'q3'"
    with pytest.raises(ValueError, match="has no packed rows"):
        W.encode(torch.zeros(2, dtype=torch.int32), torch.zeros(2), None, 10, fmt="fp32")


@pytest.fixture
def compact_twin():
    """A format added in one place: the compact rows under another name."""
    class Twin(Compact):
        name, rank = "compact-twin", 9
    fmt = WF.register(Twin())
    yield fmt
    WF._FORMATS.pop("compact-twin", None)


def test_a_registered_format_is_carried_end_to_end(compact_twin):
    assert "compact-twin" in WF.names() and W.entry_bytes("compact-twin") == 4.0
    idx = torch.tensor([[5, 70_000, 3, 0]], dtype=torch.int32)
    val = torch.tensor([[1.5, -2.25, 0.125, 9.0]])
    cnt = torch.tensor([3], dtype=torch.int32)
    msg = W.encode(idx, val, cnt, 140_000, fmt="compact-twin", backend="torch")
    assert torch.equal(msg, W.encode(idx, val, cnt, 140_000, fmt="compact", backend="torch"))
    i, v, c = W.decode(msg, 4, 140_000, fmt="compact-twin", backend="torch")
    assert i.tolist() == [[3, 5, 70_000, -1]] and v.tolist() == [[0.125, 1.5, -2.25, 0.0]]
    assert c.tolist() == [3]
    # an algorithm takes it as it takes compact: the same bytes, the rounding kept
    res = run_steps("topka", P=3, n=500, steps=3, density=0.05, grad_fn=mixed(seed=2),
                    wire_format="compact-twin", backend="torch")
    assert_conservation(res)
    assert_bitwise_agreement(res)
    ref = run_steps("topka", P=3, n=500, steps=3, density=0.05, grad_fn=mixed(seed=2),
                    wire_format="compact", backend="torch")
    assert all(torch.equal(a, b) for a, b in zip(res.outs[-1], ref.outs[-1]))


_NAME_COMPARED = re.compile(r"""(==|!=|\bin|\bnot in) *\(?["'](fp32|compact|q2|q4)["']"""
                            r"""|["'](fp32|compact|q2|q4)["'] *(==|!=|\bin\b)""")
# a dtype compared with "fp32" is not a wire format (Ok-Topk's wire_dtype, a gradient's dtype)
_DTYPE_COMPARED = re.compile(r"""\b\w*(dtype|gd)\b *(==|!=) *["']fp32["']""")
_WIRE_MODULES = {"oktopk_triton/kernels/wire_format.py", "oktopk_triton/kernels/wire.py",
                 "oktopk_triton/kernels/wire_quantized.py", "oktopk_triton/algorithms/_wire.py"}


def test_no_code_outside_the_wire_modules_compares_a_format_name():
    found = []
    for path in sorted([*ROOT.glob("oktopk_triton/**/*.py"), *ROOT.glob("tools/**/*.py")]):
        rel = path.relative_to(ROOT).as_posix()
        if rel in _WIRE_MODULES:
            continue
        for no, line in enumerate(path.read_text().splitlines(), 1):
            code = _DTYPE_COMPARED.sub("", line.split("#", 1)[0])
            if _NAME_COMPARED.search(code):
                found.append(f"{rel}:{no}: {line.strip()}")
    assert not found, "\n".join(found)
