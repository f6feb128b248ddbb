"""oktopk_triton/kernels/wire.py: the compact wire's encode and decode as Triton passes.

The Triton passes (run by the interpreter, TRITON_INTERPRET=1) give their torch references'
words and decoded entries bit for bit, for rows already ascending and rows in any order,
with and without counts, a header, one chunk and several; no op of the Triton path is one
that may synchronise with the host (a trace of the torch ops against an allowlist), and an
Ok-Topk compact step sorts no more than its fp32 step does. On CUDA, the passes run under
``torch.cuda.set_sync_debug_mode("error")`` (skipped without a GPU).
"""
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from conservation import mixed
from kernel_cases import wire_rows
from oktopk_triton import kernels as K
from oktopk_triton.algorithms import _wire as W
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.kernels import _dispatch

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")

# ops that may wait for the device (a host read, a data-dependent size, a sort whose temporary
# storage CUDA sizes on the host in some versions)
SYNC_PRONE = {"sort", "argsort", "searchsorted", "nonzero", "_local_scalar_dense", "item",
              "masked_select", "unique", "_unique2", "unique_consecutive", "bincount",
              "repeat_interleave", "is_nonzero", "equal", "allclose", "masked_scatter",
              "index_put_", "index", "topk", "kthvalue", "histc", "multinomial", "randperm"}
# the glue around the launches: views, static-size fills and scans
ALLOWED = {"alias", "view", "slice", "select", "expand", "as_strided", "detach", "clone",
           "contiguous", "zero_", "fill_", "zeros", "empty", "empty_strided", "cumsum", "sub",
           "copy_", "_to_copy", "arange", "lt", "clamp", "where", "reshape", "unsqueeze"}


class _Trace(TorchDispatchMode):
    """Every aten op, with whether it ran inside a kernel call (the interpreter's own
    tensor handling, or a torch reference body)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append((func.overloadpacket.__name__, _dispatch.in_kernel()))
        return func(*args, **(kwargs or {}))


def _rows(S, cap, span, seed, ascending):
    # bf16 ties / rounding in row 0
    return wire_rows(S, cap, span, seed, ascending,
                     specials=(1.00390625 + 1e-4, -2.00390625, 0.0))


CASES = [  # span, cap, header, counts
    (3 * W.CHUNK + 3000, 701, 2, [701, 5, 0, 741]),
    (5000, 64, 0, None),
    (2 * W.CHUNK, 33, 1, [33, 1, 32, 0]),
]


@needs_interp
@pytest.mark.parametrize("order", ["ascending", "chunks"])
@pytest.mark.parametrize("span,cap,header,counts", CASES)
def test_triton_encode_decode_match_torch(order, span, cap, header, counts):
    S = 4
    idx, vals = _rows(S, cap, span, cap, order == "ascending")
    cnt = None
    if counts is not None:     # a header column, as Ok-Topk passes it: a strided view
        hdr = torch.zeros(S, 3, dtype=torch.int32)
        hdr[:, 1] = torch.tensor(counts, dtype=torch.int32)
        cnt = hdr[:, 1]
    msgs = {}
    for be in ("torch", "triton"):
        out = torch.full((S, W.row_words(cap, span, header)), 7, dtype=torch.int32)
        W.encode(idx, vals, cnt, span, header=header, out=out, order=order, backend=be)
        assert (out[:, :header] == 7).all()                       # the header is the caller's
        msgs[be] = out
    assert torch.equal(msgs["torch"], msgs["triton"])
    dec = {be: W.decode(msgs["torch"], cap, span, header, backend=be) for be in ("torch",
                                                                                 "triton")}
    for a, b in zip(dec["torch"], dec["triton"]):
        assert torch.equal(a, b)
    got_i, got_v, got_c = dec["triton"]
    want_c = [cap] * S if counts is None else [min(c, cap) for c in counts]
    assert got_c.tolist() == want_c
    for s, c in enumerate(want_c):
        sent = sorted(zip(idx[s, :c].tolist(), vals[s, :c].to(torch.bfloat16).float().tolist()))
        assert sorted(zip(got_i[s, :c].tolist(), got_v[s, :c].tolist())) == sent
        hi = (got_i[s, :c].long() >> 16)
        assert bool((hi[1:] >= hi[:-1]).all()), "not grouped by chunk"
        if order == "ascending":
            assert torch.equal(got_i[s, :c], idx[s, :c])        # kept in place
        assert (got_i[s, c:] == -1).all() and (got_v[s, c:] == 0).all()
        assert (msgs["torch"][s, header + W.chunks(span) + c:] == 0).all()


def test_torch_reference_matches_the_sorted_format():
    """An ascending row encodes to the same words as the sorting encoder; the decoder without
    searchsorted gives what searchsorted gives."""
    span, cap = 3 * W.CHUNK + 17, 500
    idx, vals = _rows(3, cap, span, 4, True)
    cnt = torch.tensor([500, 17, 0], dtype=torch.int32)
    a = W.encode(idx, vals, cnt, span, order="ascending", backend="torch")
    perm = torch.randperm(cap, generator=torch.Generator().manual_seed(9))
    full = W.encode(idx, vals, None, span, order="ascending", backend="torch")
    assert torch.equal(full, W.encode(idx[:, perm], vals[:, perm], None, span, order="sort",
                                      backend="torch"))
    counts = a[:, :W.chunks(span)]
    hi, total = K.slot_chunks(counts, cap)
    ends = torch.cumsum(counts.long(), 1)
    want = torch.searchsorted(ends, torch.arange(cap).expand(3, cap).contiguous(), right=True)
    assert torch.equal(hi, want) and total.flatten().tolist() == [500, 17, 0]


# -- no host synchronisation --------------------------------------------------------------------
def _trace(fn):
    t = _Trace()
    with t:
        fn()
    return t.ops


@pytest.mark.parametrize("backend", ["triton", "torch"])
def test_no_sync_prone_op_in_encode_or_decode(backend):
    """The Triton path (both orders) and the torch path of ascending rows: no op that may
    synchronise, and outside the launches only allowlisted glue. (The torch reference of
    unordered rows groups them with a stable sort on the chunk: the CPU path only.)"""
    if backend == "triton" and not INTERP:
        pytest.skip("needs TRITON_INTERPRET=1")
    span, cap, S = 2 * W.CHUNK + 5, 300, 4
    for order in (["ascending", "chunks"] if backend == "triton" else ["ascending"]):
        idx, vals = _rows(S, cap, span, 1, order == "ascending")
        cnt = torch.tensor([300, 3, 0, 299], dtype=torch.int32)
        out = torch.zeros(S, W.row_words(cap, span, 1), dtype=torch.int32)
        ops = _trace(lambda: (W.encode(idx, vals, cnt, span, header=1, out=out, order=order,
                                       backend=backend),
                              W.decode(out, cap, span, 1, backend=backend)))
        names = {name for name, _ in ops}
        assert not names & SYNC_PRONE, (order, names & SYNC_PRONE)
        glue = {name for name, inside in ops if not inside}
        assert glue <= ALLOWED, (order, glue - ALLOWED)


def _oktopk_sorts(comm, wire):
    from oktopk_triton.algorithms.oktopk import OkTopk
    alg = OkTopk(W.CHUNK + 5000, comm, 0.01, backend="triton", wire_format=wire,
                 check_finite="off")
    fn = mixed(3)
    for t in range(2):
        alg(fn(comm.rank, t, alg.numel))
    g = fn(comm.rank, 2, alg.numel)
    if comm.rank:              # rank 0 traces its step (as oktopk-bench launches does)
        alg(g)
        return None
    ops = _trace(lambda: alg(g))
    return sum(name in ("sort", "argsort") for name, _ in ops), \
        sum(name == "searchsorted" for name, _ in ops)


@needs_interp
def test_oktopk_compact_step_sorts_no_more_than_fp32():
    """A steady Ok-Topk step on the Triton path: the compact wire adds no sort and no
    searchsorted to fp32's step (the owner's own sort of the received indices stays)."""
    P = 2
    fp32 = LocalCluster(P).run(_oktopk_sorts, "fp32")[0]
    comp = LocalCluster(P).run(_oktopk_sorts, "compact")[0]
    assert comp == fp32 and fp32[0] >= 1, (comp, fp32)
    print(f"\nsorts, searchsorted per steady step: fp32 {fp32}, compact {comp}")


# -- CUDA -------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("order", ["ascending", "chunks"])
def test_cuda_encode_decode_never_sync(order):
    span, cap, S = 1 << 22, 40_000, 4
    idx, vals = _rows(S, cap, span, 5, order == "ascending")
    idx, vals = idx.cuda(), vals.cuda()
    cnt = torch.tensor([cap, 3, 0, cap - 1], dtype=torch.int32, device="cuda")
    out = torch.zeros(S, W.row_words(cap, span, 1), dtype=torch.int32, device="cuda")
    W.encode(idx, vals, cnt, span, header=1, out=out, order=order)      # compile first
    W.decode(out, cap, span, 1)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        W.encode(idx, vals, cnt, span, header=1, out=out, order=order)
        got_i, got_v, got_c = W.decode(out, cap, span, 1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    ref = W.encode(idx.cpu(), vals.cpu(), cnt.cpu(), span, header=1, order=order,
                   backend="torch")
    i2, v2, c2 = W.decode(ref, cap, span, 1, backend="torch")
    assert torch.equal(got_c.cpu(), c2)
    for s in range(S):          # the same entries (the order within a chunk is the atomics')
        c = int(c2[s])
        a = sorted(zip(got_i[s, :c].tolist(), got_v[s, :c].tolist()))
        assert a == sorted(zip(i2[s, :c].tolist(), v2[s, :c].tolist()))
