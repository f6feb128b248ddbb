"""oktopk_triton/kernels/scatter.py: scatter_add and scatter_rows against their references (repeated
indices, strided and packed rows, shared bases, empty inputs)."""

import oktopk_triton.kernels as K
import pytest
import torch
from kernel_cases import BACKENDS, DEV, gen, needs_triton, region_layout, same_bits
from oktopk_triton.kernels import scatter_add


# ----------------------------------------------------------------------------------------------
# scatter_add
# ----------------------------------------------------------------------------------------------
@needs_triton
@pytest.mark.parametrize("base", [None, 5, "tensor"])
def test_scatter_add_repeated_indices_across_sources(base):
    S, cap, m = 4, 300, 1000
    g = gen(2)
    common = torch.randperm(m, generator=g)[:50]          # the same indices in every source
    rest = torch.ones(m, dtype=torch.bool)
    rest[common] = False
    others = rest.nonzero().reshape(-1)
    idx = torch.stack([torch.cat([common,
                                  others[torch.randperm(others.numel(), generator=g)[:cap - 50]]])
                       for _ in range(S)]).to(torch.int32)   # unique within a source
    vals = torch.randn(S, cap, generator=g)
    counts = torch.tensor([cap, 120, 0, cap + 40], dtype=torch.int32)   # past cap: cap valid
    b = {None: 0, 5: 5, "tensor": 17}[base]
    base_arg = torch.tensor(17, device=DEV) if base == "tensor" else base
    want = torch.randn(m + 20, generator=g)
    start = want.clone()
    for s in range(S):
        for i in range(min(int(counts[s]), cap)):
            want[b + int(idx[s, i])] += vals[s, i]
    got = {}
    for be in ("torch", "triton"):
        d = start.clone().to(DEV)
        scatter_add(d, idx.to(DEV), vals.to(DEV), counts.to(DEV), base=base_arg, backend=be)
        got[be] = d.cpu()
    assert torch.equal(got["torch"], got["triton"])      # same order: bitwise
    torch.testing.assert_close(got["torch"], want, rtol=1e-5, atol=1e-5)


@needs_triton
def test_scatter_add_strided_rows_and_empty():
    cap = 10
    msg = torch.zeros(2, 2 + 2 * cap, dtype=torch.int32, device=DEV)
    msg[:, 0] = torch.tensor([3, 0], dtype=torch.int32)
    msg[0, 2:5] = torch.tensor([0, 4, 9], dtype=torch.int32)
    msg[:, 2 + cap:].view(torch.float32)[0, :3] = torch.tensor([1.0, 2.0, 3.0])
    for be in ("torch", "triton"):
        d = torch.zeros(10, device=DEV)
        scatter_add(d, msg[:, 2:2 + cap], msg[:, 2 + cap:].view(torch.float32), msg[:, 0],
                    backend=be)
        assert d.tolist() == [1, 0, 0, 0, 2, 0, 0, 0, 0, 3]


@needs_triton
@pytest.mark.parametrize("add", [False, True])
def test_scatter_rows_shared_base_expanded(add):
    """row_base may be one base expanded to S rows (stride 0): every row lands at that base.
    (The kernel once read row_base[s] as if contiguous: past the end of a 1-element tensor.)"""
    n, S, cap = 5000, 4, 300
    g = gen(5)
    base = torch.tensor(1234, dtype=torch.int64)
    perm = torch.randperm(n - 1234, generator=g)[:S * cap].reshape(S, cap).to(torch.int32)
    vals = torch.randn(S, cap, generator=g)
    counts = torch.tensor([0, 7, cap, cap + 5], dtype=torch.int32)
    outs = {}
    for be in ("torch", "triton"):
        dense = torch.ones(n).to(DEV)
        K.scatter_rows(dense, perm.to(DEV), vals.to(DEV), counts.to(DEV),
                     base.to(DEV).expand(S), add=add, backend=be)
        outs[be] = dense.cpu()
    want = torch.ones(n)
    for s in range(S):
        c = min(int(counts[s]), cap)
        pos = 1234 + perm[s, :c].long()
        want[pos] = (want[pos] + vals[s, :c]) if add else vals[s, :c]
    assert torch.equal(outs["torch"], want)
    assert torch.equal(outs["triton"], want)


# ----------------------------------------------------------------------------------------------
# scatter_rows
# ----------------------------------------------------------------------------------------------
def scatter_expected(dense, indices, values, counts, row_base, add):
    """Plain Python: rows in order, valid slots i < min(count, cap) with index >= 0."""
    out = dense.clone().cpu()
    S, cap = indices.shape
    for s in range(S):
        for i in range(min(int(counts[s]), cap)):
            j = int(indices[s, i])
            if j < 0:
                continue
            p = int(row_base[s]) + j
            out[p] = (out[p] + values[s, i]) if add else values[s, i]
    return out


@needs_triton
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("S,cap", [(1, 1), (3, 7), (4, 1500)])
def test_scatter_rows_packed_rows(add, S, cap):
    """Rows as views of packed messages (row stride > cap, counts a strided column), -1 slots
    inside the valid prefix, counts past capacity, zero counts.  Without ``add`` rows are disjoint
    regions; with ``add`` they overlap and are summed in row order (bitwise)."""
    g = gen(S * cap)
    region = 2 * cap + 5
    n = S * region + 3
    row_base = torch.arange(S, dtype=torch.int64) * (region if not add else 1) + 1
    span = region if not add else n - S - 1
    idx_msg = torch.full((S, cap + 3), 99, dtype=torch.int32)        # [count, pad, idx..., pad]
    val_msg = torch.randn(S, cap + 2, generator=g)
    for s in range(S):
        idx_msg[s, 2:2 + cap] = torch.randperm(span, generator=g)[:cap].to(torch.int32)
    idx_msg[:, 2 + cap // 2] = -1                                      # an empty slot
    counts_full = torch.tensor([cap, cap + 9, 0, max(cap - 1, 0)], dtype=torch.int32)[:S]
    idx_msg[:, 0] = counts_full
    indices, values, counts = idx_msg[:, 2:2 + cap], val_msg[:, 1:1 + cap], idx_msg[:, 0]
    assert indices.stride(0) == cap + 3 and counts.stride(0) == cap + 3
    dense0 = torch.randn(n, generator=g)
    want = scatter_expected(dense0, indices, values, counts, row_base, add)
    assert not torch.equal(want, dense0) or S == 1 and cap == 1
    idx_msg, val_msg, rb = idx_msg.to(DEV), val_msg.to(DEV), row_base.to(DEV)
    for be in BACKENDS:
        dense = dense0.clone().to(DEV)
        K.scatter_rows(dense, idx_msg[:, 2:2 + cap], val_msg[:, 1:1 + cap], idx_msg[:, 0], rb,
                       add=add, backend=be)
        assert same_bits(dense, want), be


@needs_triton
def test_scatter_rows_empty():
    for be in BACKENDS:
        dense = torch.arange(10, dtype=torch.float32, device=DEV)
        for S, cap in ((0, 5), (3, 0)):
            K.scatter_rows(dense, torch.zeros(S, cap, dtype=torch.int32, device=DEV),
                           torch.ones(S, cap, device=DEV), torch.full((S,), 9, dtype=torch.int32,
                                                                      device=DEV),
                           torch.zeros(S, dtype=torch.int64, device=DEV), backend=be)
        K.scatter_rows(dense, torch.full((2, 4), -1, dtype=torch.int32, device=DEV),
                       torch.ones(2, 4, device=DEV), torch.full((2,), 4, dtype=torch.int32,
                                                                device=DEV),
                       torch.zeros(2, dtype=torch.int64, device=DEV), add=True, backend=be)
        assert dense.tolist() == list(range(10)), be
    with pytest.raises(TypeError):
        K.scatter_rows(torch.zeros(4), torch.zeros(1, 2, dtype=torch.int64), torch.zeros(1, 2),
                       torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))


# ----------------------------------------------------------------------------------------------
# scatter_rows_dense: the whole output in one launch (zeros, the rows, or NaN on a flag)
# ----------------------------------------------------------------------------------------------
def _ascending_rows(n, P, cap, seed):
    g = gen(seed)
    offs = region_layout(n, P, seed=seed).cpu()
    idx = torch.full((P, cap + 1), -7, dtype=torch.int32)     # junk past the count
    val = torch.randn(P, cap + 1, generator=g)
    cnt = torch.zeros(P, dtype=torch.int32)
    for j in range(P):
        size = int(offs[j + 1] - offs[j])
        c = min(size, int(torch.randint(0, cap + 1, (1,), generator=g)))
        idx[j, :c] = torch.randperm(size, generator=g)[:c].sort().values.to(torch.int32)
        cnt[j] = c if c < cap else cap + 3                     # a full row: true count past it
    # strided views, as Ok-Topk passes them ([:, :cap] of a wider buffer)
    return offs.to(DEV), idx[:, :cap].to(DEV), val[:, :cap].to(DEV), cnt.to(DEV)


@needs_triton
@pytest.mark.parametrize("P", [1, 3, 8])
@pytest.mark.parametrize("flagged", [None, 0, 1])
def test_scatter_rows_dense_matches_zeros_then_rows(P, flagged):
    n, cap = 5000, 40
    for seed in range(2):
        offs, idx, val, cnt = _ascending_rows(n, P, cap, seed + 10 * P)
        flag = None if flagged is None else torch.tensor(flagged, dtype=torch.int32, device=DEV)
        want = torch.zeros(n, device=DEV)
        K.scatter_rows(want, idx, val, cnt, offs[:P], backend="torch")
        if flagged:
            want.fill_(float("nan"))
        for be in ("torch", "triton"):
            out = torch.full((n,), 123.0, device=DEV)      # stale contents: all overwritten
            K.scatter_rows_dense(out, idx, val, cnt, offs, flag, backend=be)
            assert torch.equal(out, want) or (flagged and bool(out.isnan().all())), (be, seed)


def test_scatter_rows_dense_checks_its_arguments():
    out = torch.empty(10)
    idx = torch.zeros(2, 3, dtype=torch.int32)
    with pytest.raises(ValueError, match="region_offsets needs int64"):
        K.scatter_rows_dense(out, idx, torch.zeros(2, 3), torch.zeros(2, dtype=torch.int32),
                             torch.tensor([0, 10]))
