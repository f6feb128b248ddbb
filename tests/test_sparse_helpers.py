"""The shared helpers of ``oktopk_triton.algorithms._sparse`` against brute force: top-k
entries and their tie order, merging, packing, membership and the volume formulas (the
compaction and the scatter-add are kernels: tests/test_kernel_gaussian.py and
tests/test_kernel_scatter.py)."""
from __future__ import annotations

import math

import pytest
import torch

from oktopk_triton.algorithms._sparse import (is_member, merge_topk, pack_bits,
                                               pack_entries, topk_entries,
                                               unpack_bits, unpack_entries, volume_formula_range,
                                               volume_formula_words)


def _key_order(vals, idxs):
    """Python reference order: |v| descending, index ascending."""
    return sorted(zip(idxs, vals), key=lambda iv: (-abs(float(iv[1])), iv[0]))


def test_topk_entries_breaks_ties_by_index():
    x = torch.tensor([1., -1., 2., 1., -2., 0., 1., 2.])
    idx, val = topk_entries(x, 4)
    # |2| at 2, 4, 7 then the lowest-index |1| (index 0)
    assert idx.tolist() == [0, 2, 4, 7]
    assert torch.equal(val, x[idx.long()])
    assert idx.dtype == torch.int32 and val.dtype == torch.float32


def test_topk_entries_matches_torch_topk_on_distinct_values():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5000, generator=g)
    idx, val = topk_entries(x, 77)
    ref = torch.topk(x.abs(), 77).indices.sort().values
    assert torch.equal(idx.long(), ref)
    assert torch.equal(val, x[ref])


@pytest.mark.parametrize("seed", range(6))
def test_merge_topk_matches_brute_force(seed):
    g = torch.Generator().manual_seed(seed)
    n, m, k = 40, 12, 12
    ia = torch.randperm(n, generator=g)[:m].int()
    ib = torch.randperm(n, generator=g)[:m].int()
    va = torch.randint(-4, 5, (m,), generator=g).float()   # many ties, some cancellations
    vb = torch.randint(-4, 5, (m,), generator=g).float()
    idx, val = merge_topk(ia, va, ib, vb, k)
    d = {}
    for i, v in zip(ia.tolist(), va.tolist()):
        d[i] = v
    for i, v in zip(ib.tolist(), vb.tolist()):
        d[i] = d.get(i, 0.0) + v
    want = sorted(_key_order(list(d.values()), list(d.keys()))[:k])
    assert idx.tolist() == [i for i, _ in want]
    assert val.tolist() == [v for _, v in want]
    # the same on the other side, with the operands in the canonical order
    idx2, val2 = merge_topk(ia, va, ib, vb, k)
    assert torch.equal(idx, idx2) and torch.equal(val.view(torch.int32), val2.view(torch.int32))


def test_pack_unpack_entries_and_bits():
    idx = torch.tensor([3, 0, 7], dtype=torch.int32)
    val = torch.tensor([-0.0, float("nan"), 1.5])
    buf = pack_entries(idx, val, header=torch.tensor([3, 9], dtype=torch.int32))
    assert buf.dtype == torch.int32 and buf.numel() == 8
    hdr, i2, v2 = unpack_entries(buf, 3, header=2)
    assert hdr.tolist() == [3, 9] and torch.equal(i2, idx)
    assert torch.equal(v2.view(torch.int32), val.view(torch.int32))   # bits, -0.0 and NaN kept
    for m in (1, 31, 32, 33, 100):
        mask = torch.rand(m, generator=torch.Generator().manual_seed(m)) > 0.5
        words = pack_bits(mask)
        assert words.dtype == torch.int32 and words.numel() == (m + 31) // 32
        assert torch.equal(unpack_bits(words, m), mask)


def test_is_member():
    s = torch.tensor([2, 5, 9], dtype=torch.int32)
    assert is_member(torch.tensor([9, 1, 2, 10]), s).tolist() == [True, False, True, False]


def test_volume_formulas():
    n, k, P = 1 << 16, 655, 8
    assert volume_formula_words("dense", n, k, P) == 2 * n * 7 / 8
    assert volume_formula_words("topka", n, k, P) == 2 * k * 7
    assert volume_formula_words("gtopk", n, k, P) == 2 * k * 3
    assert volume_formula_words("gtopk", n, k, 5) == 2 * k * 3
    assert volume_formula_words("spardl", n, k, P) == 4 * k * 7 / 8
    assert volume_formula_range("topkdsa", n, k, P) == (4 * k * 7 / 8, (2 * k + n) * 7 / 8)
    assert volume_formula_words("oktopk", n, k, P) == 6 * k * 7 / 8
    assert volume_formula_words("gaussiank", n, k, P) == 2 * math.ceil(1.5 * k) * 7
    assert volume_formula_words("gaussiank", n, k, P, slack=2.0) == 2 * 2 * k * 7
    assert volume_formula_words("topka", n, k, 1) == 0
    with pytest.raises(ValueError):
        volume_formula_words("nope", n, k, P)
