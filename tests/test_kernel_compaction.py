"""kernels/compaction.py: the owner's slot and the gathered rows as a few launches, against the
chains of torch ops they replaced (transcribed here as ``_old_*``, the Ok-Topk step's code before
the cut), bit for bit, for the torch reference and the Triton path (interpreter on CPU); edge
cases: no candidate, every candidate kept, ties past the capacity, P = 1, odd P, NaN sums."""

import pytest
import torch
from kernel_cases import DEV, gen, needs_triton
from oktopk_triton.kernels import compaction as C
from oktopk_triton.kernels import rounding as R

BACKENDS = ["torch", pytest.param("triton", marks=needs_triton)]
H = 2


# -- the code before the cut (the specification of the pipeline) ------------------------------
def _old_owner_select(sums, sidx, first, slot_ids, n, inv_p, cg, th_global):
    m = sidx.numel()
    out = torch.zeros(H + 2 * cg, dtype=torch.int32, device=DEV)
    cval = sums.gather(0, slot_ids) * inv_p
    valid = first & (sidx < n) & (cval != 0)
    cidx = torch.where(valid, sidx, -1).to(torch.int32)
    mag = torch.where(valid, cval.abs(), -1.0)
    if m > cg:
        kth = torch.topk(mag, cg, sorted=False).values.min()
        keep = valid & (mag >= kth)
    else:
        keep = valid
    pos = torch.cumsum(keep, 0, dtype=torch.int64) - 1
    tgt = torch.where(keep & (pos < cg), pos, cg)
    ext_i = torch.full((cg + 1,), -1, dtype=torch.int32, device=DEV).scatter_(0, tgt, cidx)
    ext_v = torch.zeros(cg + 1, dtype=torch.float32, device=DEV).scatter_(0, tgt, cval)
    out[H:H + cg] = ext_i[:cg]
    out[H + cg:] = ext_v[:cg].view(torch.int32)
    out[0] = keep.sum(dtype=torch.int32).clamp(max=cg)
    out[1] = (valid & (mag >= th_global)).sum(dtype=torch.int32)
    return out


def _old_gather(gathered, k):
    P, cg = gathered.shape[0], (gathered.shape[1] - H) // 2
    gidx = gathered[:, H:H + cg]
    gval = gathered[:, H + cg:].view(torch.float32)
    valid = gidx >= 0
    if P * cg > k:
        mag = torch.where(valid, gval.abs(), -1.0)
        kth = torch.topk(mag.reshape(-1), k, sorted=False).values.min()
        keep = valid & (mag >= kth)
    else:
        keep = valid
    pos = torch.cumsum(keep, 1, dtype=torch.int64) - 1
    tgt = torch.where(keep, pos, cg)
    irow_idx = torch.full((P, cg + 1), -1, dtype=torch.int32, device=DEV) \
        .scatter_(1, tgt, gidx)[:, :cg]
    irow_val = torch.zeros(P, cg + 1, dtype=torch.float32, device=DEV) \
        .scatter_(1, tgt, gval)[:, :cg]
    return keep, irow_idx, irow_val, keep.sum(1, dtype=torch.int32), \
        torch.where(keep, gval.abs(), float("inf"))


# -- the pipeline as the Ok-Topk step runs it --------------------------------------------------
def _new_owner_select(sums, sidx, first, slot_ids, n, inv_p, cg, th_global, be, hdr=None):
    out = torch.full((H + 2 * cg,), 12345, dtype=torch.int32, device=DEV)   # stale contents
    mag = C.owner_magnitudes(sums, sidx, first, slot_ids, n, inv_p, backend=be)
    kth = torch.topk(mag, cg, sorted=False).values.min() if sidx.numel() > cg else None
    flags = C.keep_flags(mag.view(1, -1), kth=kth, th=th_global, backend=be)
    C.owner_slot(out, flags, torch.cumsum(flags, 1), sidx, slot_ids, sums, inv_p,
                 header_out=hdr, backend=be)
    return out


def _new_gather(gathered, k, be, th_counts=None):
    P, cg = gathered.shape[0], (gathered.shape[1] - H) // 2
    gidx = gathered[:, H:H + cg]
    if P * cg > k:
        mag = C.row_magnitudes(gidx, gathered[:, H + cg:].view(torch.float32), backend=be)
        kth = torch.topk(mag.reshape(-1), k, sorted=False).values.min()
        flags = C.keep_flags(mag, kth=kth, backend=be)
        csum = torch.cumsum(flags, 1)
    else:   # every valid entry: the count prefix as it is
        flags = csum = None
    rows = C.gather_rows(gathered, flags, csum, th_counts=th_counts, backend=be)
    return ((gidx >= 0) if flags is None else (flags & 1) != 0,) + rows


def _owner_case(P, cr, n, seed, ties=False, nan=False, zero_frac=0.1):
    """Sorted received keys as Ok-Topk's reduce leaves them: P rows of up to cr indices, sorted
    with padding (n) last, run starts, slot ids, and the sums (some zero, maybe tied)."""
    g = gen(seed)
    counts = torch.randint(0, cr + 1, (P,), generator=g)
    keys = torch.full((P, cr), n, dtype=torch.int64)
    for j in range(P):
        c = int(counts[j])
        keys[j, :c] = torch.randperm(n, generator=g)[:c]
    sidx = torch.sort(keys.reshape(-1), stable=True).values
    first = torch.ones_like(sidx, dtype=torch.bool)
    first[1:] = sidx[1:] != sidx[:-1]
    slot_ids = torch.cumsum(first, 0, dtype=torch.int64) - 1
    sums = torch.randn(P * cr, generator=g)
    if ties:
        sums = torch.round(sums * 2) / 2          # few distinct magnitudes: ties at the kth
    sums[torch.rand(P * cr, generator=g) < zero_frac] = 0.0
    if nan:
        sums[3] = float("nan")
    return [t.to(DEV) for t in (sums, sidx, first, slot_ids)]


def _same(a, b):
    a, b = a.contiguous(), b.contiguous()
    if a.dtype == torch.float32:
        a, b = a.view(torch.int32), b.view(torch.int32)
    return a.shape == b.shape and torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("P,cr,cg,ties", [(4, 40, 30, False), (4, 40, 30, True), (3, 50, 17, True),
                                          (1, 60, 60, False), (5, 7, 100, False),
                                          (2, 1200, 300, True)])
def test_owner_slot_matches_the_old_ops(be, P, cr, cg, ties):
    """Capacity below and above the candidates (no top-k), ties past the capacity (the kept count
    is cut at cg), a slot spanning two blocks, P = 1 and odd P; th_global 0, mid, inf."""
    n, full = 5000, False
    for seed in range(3):
        sums, sidx, first, slot_ids = _owner_case(P, cr, n, seed, ties)
        inv_p = 1.0 / P
        for th in (0.0, 0.4, float("inf")):
            th_g = torch.tensor(th, device=DEV)
            ref = _old_owner_select(sums, sidx, first, slot_ids, n, inv_p, cg, th_g)
            hdr = torch.full((1,), 7, dtype=torch.int32, device=DEV)
            got = _new_owner_select(sums, sidx, first, slot_ids, n, inv_p, cg, th_g, be, hdr)
            assert _same(got, ref), (seed, th, got[:4], ref[:4])
            assert int(hdr) == int(ref[1])
            full = full or int(ref[0]) == cg
    if ties and cg < cr:   # the case the cut matters for: more at the kth than fit
        assert full


@pytest.mark.parametrize("be", BACKENDS)
def test_owner_slot_edge_cases(be):
    """Every sum zero (an empty slot: count 0, all padding), every candidate padding, NaN sums
    (NaN magnitudes are valid, the top-k sees them largest)."""
    n, P, cr, cg = 3000, 3, 20, 15
    sums, sidx, first, slot_ids = _owner_case(P, cr, n, 1)
    cases = [(torch.zeros_like(sums), sidx), (sums, torch.full_like(sidx, n)),
             (_owner_case(P, cr, n, 2, nan=True)[0], sidx)]
    for s, k in cases:
        f = torch.ones_like(first) if bool((k == n).all()) else first
        ref = _old_owner_select(s, k, f, slot_ids, n, 1.0 / P, cg, torch.tensor(0.1))
        got = _new_owner_select(s, k, f, slot_ids, n, 1.0 / P, cg, torch.tensor(0.1), be)
        assert _same(got, ref)
    assert int(ref[0]) <= cg


def _gathered_case(P, cg, seed, prefix=True, ties=False, counts=None):
    g = gen(seed)
    out = torch.zeros(P, H + 2 * cg, dtype=torch.int32)
    cnt = torch.randint(0, cg + 1, (P,), generator=g) if counts is None else torch.tensor(counts)
    for j in range(P):
        c = int(cnt[j])
        idx = torch.full((cg,), -1, dtype=torch.int32)
        val = torch.zeros(cg)
        idx[:c] = torch.randperm(4 * cg, generator=g)[:c].sort().values.to(torch.int32)
        val[:c] = torch.randn(c, generator=g)
        if ties:
            val = torch.round(val * 2) / 2
        if not prefix:                       # holes: the kernel does not assume a prefix
            hole = torch.rand(cg, generator=g) < 0.3
            idx[hole] = -1
        out[j, 0] = c
        out[j, 1] = c + 3
        out[j, H:H + cg] = idx
        out[j, H + cg:] = val.view(torch.int32)
    return out.to(DEV)


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("P,cg,k,prefix,ties", [(4, 30, 200, True, False), (4, 30, 50, True, True),
                                                (3, 25, 40, False, True), (1, 40, 40, True, False),
                                                (5, 1100, 2000, False, False)])
def test_gather_rows_match_the_old_ops(be, P, cg, k, prefix, ties):
    """With and without the top-k over the gathered slots (P·cg above and below k: without,
    the count prefix as it is), rows with holes (the top-k's path), ties at the kth, P = 1 and
    odd P, a row spanning two blocks."""
    for seed in range(3):
        gathered = _gathered_case(P, cg, seed, prefix, ties)
        ref = _old_gather(gathered, k)
        g2 = gathered.clone()
        keep, idx, val, cnt, gkeep = _new_gather(g2, k, be)
        assert torch.equal(keep.cpu(), ref[0].cpu())
        for a, b in zip((idx, val, cnt, gkeep), ref[1:]):
            assert _same(a, b)
        assert torch.equal(g2.cpu(), gathered.cpu())       # the slots are read, not written


@pytest.mark.parametrize("be", BACKENDS)
def test_gather_rows_empty_and_full_rows_and_header_copy(be):
    """An empty row (count 0), a full row (cg entries, all kept), and th_counts written to the
    gathered header word 1 (the compact wire's)."""
    P, cg = 3, 33
    gathered = _gathered_case(P, cg, 5, counts=[0, cg, 10])
    th_counts = torch.tensor([[9, 0], [8, 0], [7, 0]], dtype=torch.int32, device=DEV)[:, 0]
    _, idx, val, cnt, gkeep = _new_gather(gathered, 10 ** 6, be, th_counts=th_counts)
    assert cnt.tolist() == [0, cg, 10]
    assert (idx[0] == -1).all() and (val[0] == 0).all() and bool(torch.isinf(gkeep[0]).all())
    assert torch.equal(idx[1], gathered[1, H:H + cg])
    assert gathered[:, 1].tolist() == [9, 8, 7]


def _old_slot_rounding(residual, slot, wire_slot, keep_row, base, P, nonfinite):
    from oktopk_triton.kernels import scatter_rows
    cg = keep_row.numel()
    mine = keep_row
    if nonfinite is not None:
        mine = mine & (nonfinite == 0)
    err = ((slot[H + cg:].view(torch.float32) - wire_slot[H + cg:].view(torch.float32))
           * float(P)).view(1, cg)
    idx = torch.where(mine, slot[H:H + cg], -1).view(1, cg)
    scatter_rows(residual, idx, err, slot[:1], base, add=True, backend="torch")


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("nf", [None, 0, 1])
@pytest.mark.parametrize("all_kept", [False, True])
def test_keep_slot_rounding_matches_the_old_ops(be, nf, all_kept):
    """The compact wire's owner-side rounding: P·(f32 − wire) added at the delivered entries
    only (kept by the gather, or all without flags; within the slot's count; a finite step),
    two roundings."""
    n, P, cg = 4000, 3, 50
    for seed in range(3):
        sums, sidx, first, slot_ids = _owner_case(P, 40, n, seed)
        slot = _old_owner_select(sums, sidx, first, slot_ids, n, 1.0 / P, cg, torch.tensor(0.0))
        wire = slot.clone()
        f32 = slot[H + cg:].view(torch.float32)
        wire[H + cg:] = f32.to(torch.bfloat16).float().view(torch.int32)
        keep = torch.rand(cg, generator=gen(seed)) < (2.0 if all_kept else 0.7)
        base = torch.tensor([n // 4], dtype=torch.int64, device=DEV)
        res0 = torch.randn(2 * n, generator=gen(seed + 9)).to(DEV)   # regions of n from base
        nonf = None if nf is None else torch.tensor(nf, dtype=torch.int32, device=DEV)
        ref = res0.clone()
        _old_slot_rounding(ref, slot, wire, keep, base, P, nonf)
        got = res0.clone()
        R.keep_slot_rounding(got, slot, wire, None if all_kept else keep.to(torch.int64), base,
                             P, nonf, backend=be)
        assert _same(got, ref)
        assert torch.equal(got, res0) == (nf == 1 or int(slot[0]) == 0)


def _row_error_case(P, cr, cg, region, seed, strided=False):
    """What Ok-Topk's quantized wire leaves: P sent rows (region-relative indices, some -1, true
    counts up to past cr), their values and wire levels, the delivered ascending prefixes (a
    subset of the sent entries plus some that were not sent), counts, region starts."""
    g = gen(seed)
    idx = torch.full((P, cr + 3 if strided else cr), -7, dtype=torch.int32)
    got = torch.full((P, cg), 5, dtype=torch.int32)
    counts = torch.randint(0, cr + 3, (P,), generator=g).to(torch.int32)
    gcounts = torch.zeros(P, dtype=torch.int32)
    for j in range(P):
        sent = torch.randperm(region, generator=g)[:cr].to(torch.int32)
        sent[torch.rand(cr, generator=g) < 0.1] = -1
        idx[j, :cr] = sent
        real = sent[:min(int(counts[j]), cr)]
        real = real[real >= 0]
        pick = real[torch.rand(real.numel(), generator=g) < 0.6]
        extra = torch.randint(0, region, (cg,), generator=g).to(torch.int32)
        d = torch.unique(torch.cat([pick, extra]))[:cg]             # ascending, unique
        got[j, :d.numel()] = d
        gcounts[j] = min(d.numel(), int(torch.randint(0, cg + 1, (), generator=g)) + 2)
    vals = torch.randn(P, cr + 2 if strided else cr, generator=g)
    wire = vals.to(torch.bfloat16).float()
    base = torch.arange(P, dtype=torch.int64) * region
    if strided:      # Ok-Topk's counts are its messages' header column
        idx, vals, wire = idx[:, :cr], vals[:, :cr], wire[:, 1:cr + 1]
        counts = torch.stack([counts, counts], 1)[:, 0]
        gcounts = torch.stack([gcounts, -gcounts, gcounts], 1)[:, 2]
    return (idx.to(DEV), vals.to(DEV), wire.to(DEV), counts.to(DEV), got.to(DEV),
            gcounts.to(DEV), base.to(DEV))


def _loop_row_error(res, idx, vals, wire, counts, got, gcounts, base):
    """The rule, one entry at a time."""
    res = res.cpu().clone()
    for j in range(idx.shape[0]):
        delivered = set(got[j, :int(gcounts[j])].tolist())
        for i in range(min(int(counts[j]), idx.shape[1])):
            x = int(idx[j, i])
            if x >= 0 and x in delivered:
                e = (vals[j, i] - wire[j, i]).cpu()
                res[int(base[j]) + x] = res[int(base[j]) + x] + e
    return res


@pytest.mark.parametrize("be", BACKENDS)
@pytest.mark.parametrize("P,cr,cg,strided", [(4, 40, 30, False), (3, 33, 17, True),
                                              (1, 5, 1, False), (5, 1, 64, True)])
def test_keep_row_error_adds_at_the_delivered_sent_entries(be, P, cr, cg, strided):
    """``v − q(v)`` added at every sent entry (within the true count, not -1) that the owner
    delivered, nowhere else; strided rows; a delivered entry this rank did not send is left."""
    region = 200
    for seed in range(3):
        case = _row_error_case(P, cr, cg, region, seed, strided)
        res0 = torch.randn(P * region, generator=gen(seed + 5)).to(DEV)
        ref = _loop_row_error(res0, *case)
        got = res0.clone()
        R.keep_row_error(got, *case, backend=be)
        assert _same(got, ref.to(DEV))
    idx, vals, wire, counts, gotidx, gcounts, base = _row_error_case(P, cr, cg, region, 0)
    untouched = res0.clone()
    R.keep_row_error(untouched, idx, vals, wire, counts, gotidx, torch.zeros_like(gcounts), base,
                     backend=be)
    assert torch.equal(untouched, res0)                      # nothing delivered: nothing kept


def test_argument_errors():
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    z = torch.zeros
    with pytest.raises(ValueError, match="sorted_keys must be a 1-dim torch.int64"):
        C.owner_magnitudes(z(4), z(4, dtype=i32), z(4, dtype=torch.bool), z(4, dtype=i64), 9, 1.0)
    with pytest.raises(ValueError, match="run_start and slot_ids need 4 entries"):
        C.owner_magnitudes(z(4), z(4, dtype=i64), z(3, dtype=torch.bool), z(4, dtype=i64), 9, 1.0)
    with pytest.raises(ValueError, match="mag must be a 2-dim torch.float32"):
        C.keep_flags(z(3, 2, dtype=i32))
    with pytest.raises(ValueError, match="kth must be a one-element fp32"):
        C.keep_flags(z(2, 3), kth=z((), dtype=i64))
    with pytest.raises(ValueError, match="out must hold 2 \\+ 2\\*cg"):
        C.owner_slot(z(5, dtype=i32), z(4, dtype=i64), z(4, dtype=i64), z(4, dtype=i64),
                     z(4, dtype=i64), z(4, dtype=f32), 1.0)
    with pytest.raises(ValueError, match="flags, csum and slot_ids need 4 entries"):
        C.owner_slot(z(6, dtype=i32), z(3, dtype=i64), z(4, dtype=i64), z(4, dtype=i64),
                     z(4, dtype=i64), z(4, dtype=f32), 1.0)
    with pytest.raises(ValueError, match="gathered must be \\[R, 2 \\+ 2\\*cg\\]"):
        C.gather_rows(z(2, 7, dtype=i32), z(2, 3, dtype=i64), z(2, 3, dtype=i64))
    with pytest.raises(ValueError, match="both flags and csum, or neither"):
        C.gather_rows(z(2, 8, dtype=i32), z(2, 3, dtype=i64))
    with pytest.raises(ValueError, match="th_counts must be int32 \\[2\\]"):
        C.gather_rows(z(2, 8, dtype=i32), z(2, 3, dtype=i64), z(2, 3, dtype=i64),
                      th_counts=z(3, dtype=i32))
    with pytest.raises(ValueError, match="indices and values must have one shape"):
        C.row_magnitudes(z(2, 3, dtype=i32), z(2, 4))
    with pytest.raises(ValueError, match="slot and wire_slot must hold the same 2 \\+ 2\\*cg"):
        R.keep_slot_rounding(z(10), z(8, dtype=i32), z(6, dtype=i32), z(3, dtype=i64),
                             z(1, dtype=i64), 2)
    with pytest.raises(ValueError, match="keep must hold cg = 3 flags"):
        R.keep_slot_rounding(z(10), z(8, dtype=i32), z(8, dtype=i32), z(4, dtype=i64),
                             z(1, dtype=i64), 2)
    with pytest.raises(ValueError, match="nonfinite must be a one-element int32"):
        R.keep_slot_rounding(z(10), z(8, dtype=i32), z(8, dtype=i32), z(3, dtype=i64),
                             z(1, dtype=i64), 2, z(2, dtype=i32))


def test_keep_row_error_argument_errors():
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    z = torch.zeros
    ok = (z(2, 3, dtype=i32), z(2, 3), z(2, 3), z(2, dtype=i32), z(2, 4, dtype=i32),
          z(2, dtype=i32), z(2, dtype=i64))
    R.keep_row_error(z(10), *ok)
    with pytest.raises(ValueError, match="wire must have the shape of indices"):
        R.keep_row_error(z(10), *ok[:2], z(2, 4), *ok[3:])
    with pytest.raises(ValueError, match="delivered must have P = 2 rows"):
        R.keep_row_error(z(10), *ok[:4], z(3, 4, dtype=i32), *ok[5:])
    with pytest.raises(ValueError, match="row_base int64"):
        R.keep_row_error(z(10), *ok[:6], z(2, dtype=i32))
    with pytest.raises(ValueError, match="indices must be a 2-dim torch.int32"):
        R.keep_row_error(z(10), z(2, 3, dtype=i64), *ok[1:])
    with pytest.raises(ValueError, match="inner stride of 1"):
        R.keep_row_error(z(10), *ok[:1], z(3, 2, dtype=f32).t(), *ok[2:])


def test_launches_recorded():
    """Each public function records one launch (the launch budget counts them on CPU)."""
    from oktopk_triton.kernels import _dispatch
    sums, sidx, first, slot_ids = _owner_case(4, 30, 2000, 0)
    before = _dispatch.counters()["launches"]
    _new_owner_select(sums, sidx, first, slot_ids, 2000, 0.25, 20, torch.tensor(0.0), "torch")
    assert _dispatch.counters()["launches"] - before == 3


def test_compile_variants_name_every_kernel_argument():
    """The compile check's signatures list the kernels' arguments in order (a missing or
    misspelled one would only fail in a process without the interpreter)."""
    seen = set()
    for name, fn, sig, consts, div16, warps, *options in [*C.compile_variants(),
                                                           *R.compile_variants()]:
        assert list(sig) == list(fn.arg_names), name
        assert options == ([{"enable_fp_fusion": False}]
                           if "rounding" in name or "row_error" in name else [])
        assert set(consts) <= set(sig) and all(0 <= a < len(sig) for a in div16)
        seen.add(fn.fn.__name__ if hasattr(fn, "fn") else fn.__name__)
    assert {"_owner_magnitudes_kernel", "_row_magnitudes_kernel", "_keep_flags_kernel",
            "_owner_slot_kernel", "_gather_rows_kernel", "_slot_rounding_kernel",
            "_row_error_kernel"} <= seen


@pytest.mark.skipif(not C._dispatch.INTERPRET, reason="records launches of CPU tensors")
def test_compile_variants_cover_the_launches(monkeypatch):
    """Every launch the public functions make, in each mode, is covered by a variant of the
    sm_90 compile check (same argument types, mode constexprs, num_warps, fp fusion)."""
    from test_kernel_dispatch import _assert_covered, _record_launches
    variants = [*C.compile_variants(), *R.compile_variants()]
    names = ("_owner_magnitudes_kernel", "_row_magnitudes_kernel", "_keep_flags_kernel",
             "_owner_slot_kernel", "_gather_rows_kernel", "_slot_rounding_kernel",
             "_row_error_kernel")
    log = _record_launches(monkeypatch, [(R if "rounding" in name or "row_error" in name else C,
                                          name) for name in names])
    sums, sidx, first, slot_ids = _owner_case(3, 20, 900, 0)
    mag = C.owner_magnitudes(sums, sidx, first, slot_ids, 900, 1 / 3, backend="triton")
    one = torch.ones(())
    for kth, th in ((one, one), (None, one), (one, None)):
        C.keep_flags(mag.view(1, -1), kth=kth, th=th, backend="triton")
    flags = torch.zeros(1, sidx.numel(), dtype=torch.int64)
    for hdr in (None, torch.zeros(1, dtype=torch.int32)):
        C.owner_slot(torch.zeros(2 + 2 * 9, dtype=torch.int32), flags, flags, sidx, slot_ids,
                     sums, 1 / 3, header_out=hdr, backend="triton")
    g = _gathered_case(3, 9, 0)
    C.row_magnitudes(g[:, H:H + 9], g[:, H + 9:].view(torch.float32), backend="triton")
    f3 = torch.zeros(3, 9, dtype=torch.int64)
    for f in (None, f3):
        for hs in (None, g[:, 0]):
            C.gather_rows(g, f, f, th_counts=hs, backend="triton")
    for keep in (None, f3[0]):
        for nf in (None, torch.zeros(1, dtype=torch.int32)):
            R.keep_slot_rounding(torch.zeros(100), g[0].contiguous(), g[1].contiguous(), keep,
                                 torch.zeros(1, dtype=torch.int64), 3, nf, backend="triton")
    case = _row_error_case(3, 12, 8, 300, 0)
    R.keep_row_error(torch.zeros(900), *case, backend="triton")
    assert _assert_covered(log, variants) == set(names)
