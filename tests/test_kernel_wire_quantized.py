"""oktopk_triton/kernels/wire_quantized.py: the q2 / q4 wire's encode and decode as Triton passes.

The format through ``_wire.encode`` / ``decode`` (round trips for every order, counts None,
partial and 0, odd capacities, several chunks, a span not a multiple of 65,536; ties at the
mean, single-entry chunks, negative zero), the scales against an independent computation
(q4: the old formulas bit for bit; q2: the exact fp64 centroids within the fixed point's
rounding, and the same bits whatever the order of a chunk's entries), the Triton passes under
the interpreter (TRITON_INTERPRET=1) against the torch reference bit for bit, no op that may
synchronise with the host, the launches each call records and that the sm_90 compile check
covers every launch, and one-line errors for bad arguments.
"""
import os

import pytest
import torch

from kernel_cases import wire_rows
from oktopk_triton import kernels as K
from oktopk_triton.algorithms import _wire as W
from oktopk_triton.kernels import _dispatch
from oktopk_triton.kernels import wire_quantized as Q

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
BACKENDS = ["torch"] + (["triton"] if INTERP else [])
FORMATS = ["q2", "q4"]
ORDERS = ["ascending", "chunks", "sort"]

CASES = [  # span, cap, header, counts
    (3 * W.CHUNK + 3000, 301, 2, [301, 5, 0, 341]),
    (5000, 63, 0, None),
    (2 * W.CHUNK, 33, 1, [33, 1, 32, 0]),
]


def _rows(S, cap, span, seed, ascending):
    # signed zeros in row 0
    return wire_rows(S, cap, span, seed, ascending, specials=(-0.0, 0.0))


def _valid(counts, S, cap):
    c = torch.full((S,), cap) if counts is None else torch.tensor(counts).clamp(0, cap)
    return c


def _round_trip(fmt, order, span, cap, header, counts, backend, seed=1):
    S = 4 if counts is None else len(counts)
    idx, vals = _rows(S, cap, span, seed, order == "ascending")
    cnt = None if counts is None else torch.tensor(counts, dtype=torch.int32)
    msg, wire = W.encode(idx, vals, cnt, span, header=header, fmt=fmt, order=order,
                         return_wire=True, backend=backend)
    got = W.decode(msg, cap, span, header=header, fmt=fmt, backend=backend)
    return idx, vals, msg, wire, got


# -- the format -------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("span,cap,header,counts", CASES)
def test_round_trip(fmt, order, span, cap, header, counts, backend):
    """Decode gives each row's valid entries (ascending unless ``order="chunks"``: grouped by
    chunk), with exactly the values ``return_wire`` gave the sender for them, -1 / 0 past the
    count, the header untouched, and a row of the documented size."""
    idx, vals, msg, wire, (gi, gv, gc) = _round_trip(fmt, order, span, cap, header, counts,
                                                     backend)
    S = idx.shape[0]
    assert msg.shape == (S, W.row_words(cap, span, header, fmt))
    assert (msg[:, :header] == 0).all()
    n = _valid(counts, S, cap)
    assert gc.tolist() == n.tolist()
    for s in range(S):
        c = int(n[s])
        sent = {int(i): float(w) for i, w in zip(idx[s, :c], wire[s, :c])}
        got = gi[s, :c].long()
        assert sorted(got.tolist()) == sorted(sent)
        hi = got >> 16
        assert (hi[1:] >= hi[:-1]).all()                       # grouped by chunk
        if order != "chunks":
            assert (got[1:] > got[:-1]).all()
        assert [sent[int(i)] for i in got] == gv[s, :c].tolist()
        assert (gi[s, c:] == -1).all() and (gv[s, c:] == 0).all() and (wire[s, c:] == 0).all()
        v, w = vals[s, :c], wire[s, :c]
        assert (w[v >= 0] >= 0).all() and (w[v < 0] <= 0).all()   # a zero: the lowest level


@pytest.mark.parametrize("fmt", FORMATS)
def test_special_chunks(fmt):
    """A single-entry chunk and a chunk of equal magnitudes (every entry at the mean) come
    back exactly; -0.0 is sent without its sign (it comes back +0.0, and ``v - wire`` = 0)."""
    span = 3 * W.CHUNK
    idx = torch.tensor([[5, W.CHUNK + 1, W.CHUNK + 9, W.CHUNK + 70, 2 * W.CHUNK + 4]],
                       dtype=torch.int32)
    vals = torch.tensor([[-3.25, 0.75, -0.75, 0.75, -0.0]])
    for be in BACKENDS:
        msg, wire = W.encode(idx, vals, None, span, fmt=fmt, order="chunks", return_wire=True,
                             backend=be)
        assert torch.equal(wire[0, :4], vals[0, :4])
        assert wire[0, 4].item() == 0.0 and not torch.signbit(wire[0, 4])
        gi, gv, gc = W.decode(msg, 5, span, fmt=fmt, backend=be)
        assert gi[0].tolist() == idx[0].tolist() and torch.equal(gv[0], wire[0])


def test_q2_entry_at_the_mean_goes_high():
    """Magnitudes 1, 2, 3 (mean 2, exact in the fixed point): 2 is in the upper half, so the
    levels are 1 and 2.5."""
    idx = torch.tensor([[3, 10, 700]], dtype=torch.int32)
    vals = torch.tensor([[-1.0, 2.0, 3.0]])
    for be in BACKENDS:
        _, wire = W.encode(idx, vals, None, 1000, fmt="q2", order="ascending",
                           return_wire=True, backend=be)
        assert wire[0].tolist() == [-1.0, 2.5, 2.5]


def _chunk_scales(a, b):
    """An independent computation of one chunk's (base, step) from its magnitudes (fp32)."""
    if b == 4:        # the old torch formulas: min, (max - min) / 7
        base = a.min()
        return base, (a.max() - base) / 7
    a64 = a.double()
    mean = a64.mean()
    big = a64 >= mean
    hi = a64[big].mean()
    lo = a64[~big].mean() if (~big).any() else hi
    return lo, hi - lo


@pytest.mark.parametrize("fmt", FORMATS)
def test_scales_match_an_independent_computation(fmt):
    """q4's scales and codes are the old torch formulas bit for bit; q2's centroids are the
    exact fp64 ones within 1e-6 relative (fixed-point units and one rounding each), and the
    codes split at the mean."""
    b = W.QUANTIZED[fmt]
    g = torch.Generator().manual_seed(3)
    span, cap = 3 * W.CHUNK, 400
    idx = torch.sort(torch.randperm(span, generator=g)[:cap]).values.int().view(1, cap)
    vals = torch.randn(1, cap, generator=g) ** 3
    msg, wire = W.encode(idx, vals, None, span, fmt=fmt, order="ascending", return_wire=True)
    C = 3
    base = msg[0, C:2 * C].view(torch.float32)
    step = msg[0, 2 * C:3 * C].view(torch.float32)
    for c in range(C):
        sel = (idx[0].long() >> 16) == c
        a = vals[0, sel].abs()
        eb, es = _chunk_scales(a, b)
        if b == 4:
            assert base[c] == eb and step[c] == es
            ratio = (a - eb) / es
            j = torch.round(ratio).clamp(0, 7)
            assert torch.equal(wire[0, sel].abs(), eb + j * es)
        else:
            assert abs(base[c].item() - eb.item()) <= 1e-6 * eb.item()
            assert abs(step[c].item() - es.item()) <= 1e-6 * (eb + es).item()
            big = a.double() >= a.double().mean()
            hi = (base[c] + step[c]).item()
            assert (wire[0, sel].abs()[big] == hi).all()
            assert (wire[0, sel].abs()[~big] == base[c]).all()


def test_q2_scales_do_not_depend_on_the_order_of_entries():
    """The chunk sums are exact integer sums: any order of a chunk's entries (what the
    atomics give on a GPU) gives the same scale words."""
    g = torch.Generator().manual_seed(4)
    span, cap = 2 * W.CHUNK, 500
    idx = torch.randperm(span, generator=g)[:cap].int().view(1, cap)
    vals = (torch.randn(1, cap, generator=g) * 10.0 ** torch.randint(-6, 6, (1, cap),
                                                                     generator=g))
    ref = W.encode(idx, vals, None, span, fmt="q2", order="chunks")
    for seed in range(3):
        p = torch.randperm(cap, generator=torch.Generator().manual_seed(seed))
        msg = W.encode(idx[:, p], vals[:, p], None, span, fmt="q2", order="chunks")
        assert torch.equal(msg[:, :3 * 2], ref[:, :3 * 2])


def test_fixed_point_sum():
    """fixed_terms / fixed_value: equal exponents sum exactly; the units of a magnitude far
    below its chunk's largest are dropped, never negative; the sum back in fp32 is one
    rounding of the units."""
    a = torch.tensor([1.5, 1.25, 1.75, 2.0 ** -45, 3.0 * 2 ** -149])
    e = (a.view(torch.int32).long() >> 23).clamp(min=1)
    emax = torch.full_like(e, int(e.max()))
    u = Q.fixed_terms(a, emax)
    assert (u >= 0).all() and u[3] == 0 and u[4] == 0
    assert Q.fixed_value(u[:3].sum().view(1), emax[:1]).item() == 4.5
    one = Q.fixed_terms(torch.tensor([7.0]), torch.tensor([129]))
    assert Q.fixed_value(one, torch.tensor([129])).item() == 7.0


# -- the Triton passes against the reference --------------------------------------------------
@needs_interp
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("span,cap,header,counts", CASES)
def test_triton_matches_torch_bitwise(fmt, order, span, cap, header, counts):
    """Words, wire values and decoded entries: the interpreter's Triton passes give the
    torch reference's bits (with ``order="chunks"`` the interpreter's atomics hand out the
    slots in slot order, as the reference's stable grouping does)."""
    tri = _round_trip(fmt, order, span, cap, header, counts, "triton", seed=7)
    ref = _round_trip(fmt, order, span, cap, header, counts, "torch", seed=7)
    for a, b in zip(tri[2:4], ref[2:4]):
        assert torch.equal(a, b)
    for a, b in zip(tri[4], ref[4]):
        assert torch.equal(a, b)


@needs_interp
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_counts_from_a_header_column(fmt):
    """Counts read in place from a strided column (Ok-Topk's message header), wire values
    into a fresh buffer: the reference's bits."""
    span, cap = 2 * W.CHUNK + 11, 45
    idx, vals = _rows(3, cap, span, 5, False)
    hdr = torch.zeros(3, 4, dtype=torch.int32)
    hdr[:, 0] = torch.tensor([45, 7, 0])
    got = [W.encode(idx, vals, hdr[:, 0], span, fmt=fmt, order="chunks", return_wire=True,
                    backend=be) for be in ("triton", "torch")]
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@needs_interp
def test_triton_decode_writes_into_views():
    """``out`` rows may be views into a wider buffer (the caller's own layout)."""
    span, cap = W.CHUNK + 10, 21
    idx, vals = _rows(2, cap, span, 9, True)
    msg = W.encode(idx, vals, None, span, header=1, fmt="q4", order="ascending")
    buf = torch.zeros(2, 1 + 2 * cap, dtype=torch.int32)
    out = (buf[:, 1:1 + cap], buf[:, 1 + cap:].view(torch.float32), buf[:, 0])
    W.decode(msg, cap, span, header=1, fmt="q4", backend="triton", out=out)
    ri, rv, rc = W.decode(msg, cap, span, header=1, fmt="q4", backend="torch")
    assert torch.equal(out[0], ri) and torch.equal(out[1], rv) and torch.equal(out[2], rc)


# -- launches, host reads, compile coverage, errors -------------------------------------------
def test_recorded_launches():
    """What the CUDA path launches: q2 encode 5 (memset, stats, sum, split, finish), q4 3,
    decode 1."""
    span, cap = W.CHUNK, 40
    idx, vals = _rows(2, cap, span, 2, True)
    for fmt, want in (("q2", 5), ("q4", 3)):
        before = _dispatch.counters()["launches"]
        msg = W.encode(idx, vals, None, span, fmt=fmt, order="ascending")
        assert _dispatch.counters()["launches"] - before == want
        before = _dispatch.counters()["launches"]
        W.decode(msg, cap, span, fmt=fmt)
        assert _dispatch.counters()["launches"] - before == 1


@needs_interp
def test_no_sync_prone_op():
    """The Triton path of both formats and the orders that need no sort: no op that may
    synchronise with the host, outside the launches only allowlisted glue."""
    from test_wire_kernels import ALLOWED, SYNC_PRONE, _trace
    span, cap, S = 2 * W.CHUNK + 5, 300, 4
    cnt = torch.tensor([300, 3, 0, 299], dtype=torch.int32)
    for fmt in FORMATS:
        for order in ("ascending", "chunks"):
            idx, vals = _rows(S, cap, span, 1, order == "ascending")
            out = torch.zeros(S, W.row_words(cap, span, 1, fmt), dtype=torch.int32)
            ops = _trace(lambda: (W.encode(idx, vals, cnt, span, header=1, out=out, fmt=fmt,
                                           order=order, return_wire=True, backend="triton"),
                                  W.decode(out, cap, span, 1, fmt=fmt, backend="triton")))
            names = {name for name, _ in ops}
            assert not names & SYNC_PRONE, (fmt, order, names & SYNC_PRONE)
            glue = {name for name, inside in ops if not inside}
            assert glue <= ALLOWED, (fmt, order, glue - ALLOWED)


def test_compile_variants_name_every_kernel_argument():
    seen = set()
    for name, fn, sig, consts, div16, warps, *options in Q.compile_variants():
        assert list(sig) == list(fn.arg_names), name
        assert set(consts) <= set(sig) and all(0 <= a < len(sig) for a in div16)
        seen.add(fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__)
    assert seen == {"_stats_kernel", "_sum_kernel", "_finish_kernel", "_decode_kernel"}


@needs_interp
def test_compile_variants_cover_the_launches(monkeypatch):
    """Every launch of encode (both formats, both orders, counts or not, wire or not) and of
    decode is covered by a variant of the sm_90 compile check."""
    from test_kernel_dispatch import _assert_covered, _record_launches
    variants = list(Q.compile_variants())
    names = ("_stats_kernel", "_sum_kernel", "_finish_kernel", "_decode_kernel")
    log = _record_launches(monkeypatch, [(Q, name) for name in names])
    span, cap = W.CHUNK + 7, 9
    idx, vals = _rows(1, cap, span, 3, True)
    for fmt in FORMATS:
        for order in ("ascending", "chunks"):
            for cnt in (None, torch.tensor([4], dtype=torch.int32)):
                for rw in (False, True):
                    W.encode(idx, vals, cnt, span, fmt=fmt, order=order, return_wire=rw,
                             backend="triton")
        W.decode(torch.zeros(1, W.row_words(cap, span, 0, fmt), dtype=torch.int32), cap, span,
                 fmt=fmt, backend="triton")
    assert _assert_covered(log, variants) == set(names)


def test_bad_arguments_are_one_line_errors():
    idx = torch.zeros(1, 4, dtype=torch.int32)
    vals = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="bits must be 2 or 4"):
        K.quantized_encode(idx, vals, None, torch.zeros(1, 8, dtype=torch.int32), 10, bits=3)
    with pytest.raises(ValueError, match=r"out must be int32 \[1, 6\]"):
        K.quantized_encode(idx, vals, None, torch.zeros(1, 8, dtype=torch.int32), 10, bits=2)
    with pytest.raises(ValueError, match="wire must be fp32"):
        K.quantized_encode(idx, vals, None, torch.zeros(1, 6, dtype=torch.int32), 10, bits=2,
                           wire=torch.zeros(1, 3))
    with pytest.raises(ValueError, match="msg must be int32"):
        K.quantized_decode(torch.zeros(1, 5, dtype=torch.int32), 4, 10, bits=2)
