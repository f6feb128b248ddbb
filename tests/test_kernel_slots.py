"""kernels/slots.py: the owner's slots (sort keys, run starts, slot sums) against the chain of
torch ops they replaced in Ok-Topk's reduce (transcribed here as ``_old_reduce``, the step's
code before the cut), bit for bit, for the torch reference and the Triton path (interpreter on
CPU); edge cases: empty rows, every row holding the same indices, counts past the capacity,
P = 1, odd P, bf16 values, additions whose order changes the fp32 result; argument errors."""

import pytest
import torch
from kernel_cases import DEV, gen, needs_triton
from oktopk_triton.kernels import scatter_add
from oktopk_triton.kernels import slots as SL

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]


# -- the code before the cut (the specification of the pipeline) ------------------------------
def _old_reduce(idx, vals, counts, n, m_sums):
    """Ok-Topk's _reduce after the cat of the rows: idx int32 [P, cap], vals fp32 [P, cap]."""
    P, cap = idx.shape
    slots_r = torch.arange(cap, dtype=torch.int32, device=DEV).reshape(1, -1)
    valid = slots_r < counts.reshape(P, 1)
    key = torch.where(valid, idx.to(torch.int64), n).reshape(-1)
    sidx, perm = torch.sort(key, stable=True)
    first = torch.ones_like(sidx, dtype=torch.bool)
    first[1:] = sidx[1:] != sidx[:-1]
    slot = torch.cumsum(first, 0, dtype=torch.int64) - 1
    slot_of = torch.empty_like(slot).scatter_(0, perm, slot).to(torch.int32).view(P, cap)
    sums = torch.zeros(m_sums, dtype=torch.float32, device=DEV)
    scatter_add(sums, slot_of, vals, counts, base=0, backend="torch")
    return sidx, first, slot, sums


def _new_reduce(ia, ca, ib, cb, va, vb, n, backend, m_sums):
    key = SL.slot_keys(ia, ca, ib, cb, n, backend=backend)
    sidx, perm = torch.sort(key, stable=True)
    first = SL.slot_starts(sidx, backend=backend)
    csum = torch.cumsum(first, 0, dtype=torch.int64)
    sums = torch.full((m_sums,), 7.5, dtype=torch.float32, device=DEV)   # stale: overwritten
    slot = SL.slot_sums(sidx, perm, first, csum, sums, ca, cb, va, vb, backend=backend)
    return sidx, first, slot, sums


def _rows(P, cap, n, seed, counts=None, same=False, dtype=torch.float32):
    """P rows of distinct indices each (overlapping across rows), values of mixed scale."""
    g = gen(seed)
    base = torch.randperm(n, generator=g)[:cap]
    rows = [base]
    for _ in range(P - 1):   # overlaps: every row shares about half its indices with row 0
        shared = base[torch.randperm(cap, generator=g)[: cap // 2]]
        rest = torch.randperm(n, generator=g)
        rest = rest[~torch.isin(rest, shared)]
        rows.append(base if same else torch.cat([shared, rest])[:cap])
    idx = torch.stack(rows).to(torch.int32)
    assert all(len(set(row.tolist())) == cap for row in idx)   # a row's indices are distinct
    scale = torch.tensor([1e8, 1.0, 1e-3, 3.0])[torch.randint(0, 4, (P, cap), generator=g)]
    vals = (torch.randn(P, cap, generator=g) * scale).to(dtype)
    vals[0, :2] = -0.0
    if counts is None:
        counts = torch.randint(0, cap + 1, (P,), generator=g)
    counts = torch.as_tensor(counts).to(torch.int32)
    return idx.to(DEV), vals.to(DEV), counts.to(DEV)


def _check(P, cap, n, seed, backend, **kw):
    idx, vals, counts = _rows(P, cap, n, seed, **kw)
    msg = torch.zeros(P, 2 + 2 * cap + 3, dtype=torch.int32, device=DEV)   # a strided layout
    msg[:, 0], msg[:, 2:2 + cap] = counts, idx
    head, tail = slice(0, 1), slice(1, P)
    m = P * cap + 5
    old = _old_reduce(idx, vals.float(), counts, n, m)
    new = _new_reduce(msg[head, 2:2 + cap], msg[head, 0], msg[tail, 2:2 + cap], msg[tail, 0],
                      vals[head], vals[tail], n, backend, m)
    for name, a, b in zip(("keys", "first", "slot"), old[:3], new[:3]):
        assert torch.equal(a, b), name
    # the sums bit for bit on [0, m); past the m = P*cap slots nothing is written
    assert torch.equal(old[3][:P * cap].view(torch.int32), new[3][:P * cap].view(torch.int32))
    assert torch.equal(new[3][P * cap:], torch.full((5,), 7.5, device=DEV))
    return old


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("P,cap,n,seed", [(4, 40, 100, 0), (3, 17, 30, 1), (5, 9, 1000, 2),
                                          (2, 1, 3, 3), (7, 33, 64, 4)])
def test_matches_the_old_reduce(backend, P, cap, n, seed):
    sidx, first, slot, sums = _check(P, cap, n, seed, backend)
    assert int(first.sum()) == int(slot[-1]) + 1


@pytest.mark.parametrize("backend", BACKENDS)
def test_one_rank(backend):
    _check(1, 30, 50, 5, backend, counts=[21])


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_rows_and_counts_past_the_capacity(backend):
    _check(4, 12, 40, 6, backend, counts=[0, 0, 0, 0])
    _check(4, 12, 40, 7, backend, counts=[0, 30, 12, 0])      # count 30 > cap: all valid


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_row_the_same_indices(backend):
    """Runs of P entries (the longest a run gets), summed in row order."""
    sidx, first, slot, sums = _check(5, 20, 25, 8, backend, counts=[20] * 5, same=True)
    assert int(first[:100].sum()) == 20


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_values(backend):
    _check(4, 25, 60, 9, backend, dtype=torch.bfloat16)


@pytest.mark.parametrize("backend", BACKENDS)
def test_order_of_the_additions(backend):
    """1e8 + 1 - 1e8 is 0 in fp32, 1e8 - 1e8 + 1 is 1: the rows are added own row first."""
    idx = torch.tensor([[5], [5], [5]], dtype=torch.int32, device=DEV)
    cnt = torch.ones(3, dtype=torch.int32, device=DEV)
    for vals, want in (([1e8, 1.0, -1e8], 0.0), ([1e8, -1e8, 1.0], 1.0)):
        v = torch.tensor(vals, device=DEV).reshape(3, 1)
        _, _, _, sums = _new_reduce(idx[:1], cnt[:1], idx[1:], cnt[1:], v[:1], v[1:], 10,
                                    backend, 3)
        assert sums.tolist() == [want, 0.0, 0.0]


def test_argument_errors():
    i = torch.zeros(1, 4, dtype=torch.int32)
    c = torch.ones(1, dtype=torch.int32)
    with pytest.raises(ValueError, match="slot_keys: indices must be two"):
        SL.slot_keys(i.long(), c, i, c, 10)
    with pytest.raises(ValueError, match="slot_keys: indices must be two"):
        SL.slot_keys(i, c, torch.zeros(1, 5, dtype=torch.int32), c, 10)
    with pytest.raises(ValueError, match="slot_keys: counts must be int32"):
        SL.slot_keys(i, c.long(), i, c, 10)
    with pytest.raises(ValueError, match="slot_keys: out must be contiguous int64"):
        SL.slot_keys(i, c, i, c, 10, out=torch.empty(7, dtype=torch.int64))
    with pytest.raises(ValueError, match="slot_starts: keys must be contiguous int64"):
        SL.slot_starts(torch.zeros(8, dtype=torch.int32))
    k = torch.zeros(8, dtype=torch.int64)
    f = torch.ones(8, dtype=torch.bool)
    v = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="slot_sums: first must be contiguous torch.bool"):
        SL.slot_sums(k, k, k, k, torch.zeros(8), c, c, v, v)
    with pytest.raises(ValueError, match=r"slot_sums: sums must be contiguous fp32 \[>= 8\]"):
        SL.slot_sums(k, k, f, k, torch.zeros(7), c, c, v, v)
    with pytest.raises(ValueError, match="slot_sums: values must be two"):
        SL.slot_sums(k, k, f, k, torch.zeros(8), c, c, v, v.half())


def test_compile_variants_are_well_formed():
    """Every variant names its kernel's parameters, in order, with constexprs among them."""
    seen = set()
    for name, fn, sig, consts, div16, warps in SL.compile_variants():
        params = list(fn.arg_names) if hasattr(fn, "arg_names") else None
        assert params is None or params == list(sig), name
        assert set(consts) <= set(sig) and all(0 <= a < len(sig) for a in div16)
        assert warps == 4
        seen.add(fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__)
    assert seen == {"_slot_keys_kernel", "_slot_starts_kernel", "_slot_sums_kernel"}


@pytest.mark.skipif(not SL._dispatch.INTERPRET, reason="records launches of CPU tensors")
def test_compile_variants_cover_the_launches(monkeypatch):
    """Every launch the public functions make (fp32 and bf16 values, P = 1 and 4, the message
    layout's strided rows) is covered by a variant of the sm_90 compile check."""
    from test_kernel_dispatch import _assert_covered, _record_launches
    variants = list(SL.compile_variants())
    names = ("_slot_keys_kernel", "_slot_starts_kernel", "_slot_sums_kernel")
    log = _record_launches(monkeypatch, [(SL, name) for name in names])
    for P, dtype in ((4, torch.float32), (1, torch.bfloat16), (3, torch.bfloat16)):
        idx, vals, counts = _rows(P, 10, 40, 0, dtype=dtype)
        msg = torch.zeros(P, 25, dtype=torch.int32, device=DEV)
        msg[:, 0], msg[:, 2:12] = counts, idx
        ia, ca, ib, cb = msg[:1, 2:12], msg[:1, 0], msg[1:, 2:12], msg[1:, 0]
        key = torch.arange(P * 10, device=DEV)
        SL.slot_keys(ia, ca, ib, cb, 40, backend="triton")
        first = torch.ones(P * 10, dtype=torch.bool, device=DEV)
        SL.slot_starts(key, out=first, backend="triton")
        SL.slot_sums(key, key, first, key, torch.zeros(P * 10, device=DEV), ca, cb, vals[:1],
                     vals[1:], backend="triton")
    assert _assert_covered(log, variants) == set(names)
