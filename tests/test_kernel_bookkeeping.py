"""kernels/bookkeeping.py: step_bookkeeping (Ok-Topk's next-step state in one launch), the
Triton kernel against its torch reference, and the reference against the rules it implements."""

import pytest
import torch
from kernel_cases import DEV, gen, needs_triton
from oktopk_triton.kernels import BOOKKEEPING_STATS, SELECT_HIST_BINS, step_bookkeeping
from oktopk_triton.kernels.bookkeeping import balanced_offsets, capped_offsets, threshold_at


def _case(P, seed, cg=24, n=5000, nonfinite=None, empty=False):
    """Random inputs shaped as an Ok-Topk step leaves them (at P ranks)."""
    g = gen(seed)
    hist = torch.randint(0, 50, (P, SELECT_HIST_BINS), generator=g, dtype=torch.int32)
    hist[0] = 0                                         # an empty histogram keeps its threshold
    th = torch.rand(P, generator=g) * 0.5 + 0.01
    stage = torch.randint(0, 400, (P,), generator=g, dtype=torch.int32)
    msg = torch.zeros(P, 7, dtype=torch.int32)           # sent counts in column 0 (strided)
    msg[:, 0] = stage.clamp(max=100)
    gathered = torch.zeros(P, 2 + 2 * cg, dtype=torch.int32)
    icnt = torch.randint(0, cg + 1, (P,), generator=g, dtype=torch.int32)
    if empty:
        icnt.zero_()
    if P >= 3:
        icnt[1] = 0                                     # a region without entries
    gathered[:, 0] = icnt + torch.randint(0, 5, (P,), generator=g, dtype=torch.int32)
    gathered[:, 1] = icnt + torch.randint(0, 30, (P,), generator=g, dtype=torch.int32)
    offs = torch.tensor([n * j // P for j in range(P + 1)], dtype=torch.int64)
    iidx = torch.full((P, cg), -1, dtype=torch.int32)
    for j in range(P):
        size = int(offs[j + 1] - offs[j])
        c = int(icnt[j])
        iidx[j, :c] = torch.randperm(size, generator=g)[:c].sort().values.to(torch.int32)
    gmin = torch.tensor(float("inf") if empty else 0.0625)
    case = dict(hist=hist, th=th, stage_counts=stage, sent_counts=msg[:, 0], gathered=gathered,
                icnt=icnt, iidx=iidx, region_offsets=offs, th_global=torch.tensor(0.5),
                gmin=gmin, nonfinite=nonfinite)
    return {k: (v.to(DEV) if isinstance(v, torch.Tensor) else v) for k, v in case.items()}


def _run(case, backend, region, **kw):
    c = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in case.items()}
    P = c["hist"].shape[0]
    cap = None if region else torch.zeros(P, device=DEV)
    target = torch.full((P,), 60.0, device=DEV) if region else None
    stats = step_bookkeeping(**c, n=5000, cap_s=200, cap=cap, fill=150.0, row_target=target,
                             mid=100.0, backend=backend, **kw)
    return c, cap, target, stats


@needs_triton
@pytest.mark.parametrize("P", [1, 2, 5, 8])
@pytest.mark.parametrize("region", [False, True])
@pytest.mark.parametrize("span", [0, 1100])
def test_triton_matches_reference(P, region, span):
    # region mode's steered target divides and takes a square root: torch's CPU kernels for
    # those are not IEEE-exact (numpy's and the GPU's are), so there the rows and targets may
    # differ by an ulp; everything else is bit for bit
    for seed in range(3):
        case = _case(P, seed)
        ref = _run(case, "torch", region)
        got = _run(case, "triton", region)
        for k in ("region_offsets", "th_global"):
            assert torch.equal(ref[0][k], got[0][k]), (k, P, seed)
        assert torch.equal(ref[3], got[3]), (P, seed)
        if region:
            torch.testing.assert_close(got[2], ref[2], rtol=1e-6, atol=0)
            torch.testing.assert_close(got[0]["th"], ref[0]["th"], rtol=1e-5, atol=0)
        else:
            assert torch.equal(ref[1], got[1]), (P, seed)
            assert torch.equal(ref[0]["th"], got[0]["th"]), (P, seed)


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_nonfinite_and_empty_steps_keep_the_state(backend):
    P = 4
    flag = torch.ones((), dtype=torch.int32, device=DEV)
    for case in (_case(P, 7, nonfinite=flag), _case(P, 8, empty=True)):
        c, cap, target, stats = _run(case, backend, region=True)
        assert torch.equal(c["region_offsets"], case["region_offsets"])
        assert torch.equal(c["th_global"], case["th_global"])
        if case["nonfinite"] is not None:     # rows and targets kept too
            assert torch.equal(c["th"], case["th"])
            assert torch.equal(target, torch.full((P,), 60.0, device=DEV))


@pytest.mark.parametrize("P", [1, 3, 4])
def test_reference_rules(P):
    case = _case(P, 11)
    c, cap, _, stats = _run(case, "torch", region=False)
    # the fill thresholds: each row's histogram holds about `fill` entries at or above
    assert torch.equal(cap, threshold_at(case["hist"], case["th"],
                                         torch.full((P,), 150.0, device=DEV)))
    assert cap[0] == case["th"][0]                         # empty histogram: kept
    assert torch.equal(c["th"], case["th"])                # rank mode: rows not touched here
    assert c["th_global"] == 0.0625
    offs = c["region_offsets"]
    assert offs[0] == 0 and offs[-1] == 5000 and bool((offs[1:] >= offs[:-1]).all())
    if P > 1:
        assert torch.equal(offs, balanced_offsets(case["region_offsets"], case["icnt"],
                                                  case["gathered"][:, 1], case["iidx"], 5000,
                                                  case["iidx"].shape[1]))
    s = dict(zip(BOOKKEEPING_STATS, stats.tolist()))
    stage = case["stage_counts"].to(torch.int64)
    assert s["local_selected"] == int(stage.sum())
    assert s["sent"] == int(stage.clamp(max=100).sum())
    assert s["reduce_overflow"] == int((stage - 200).clamp(min=0).sum())
    assert s["global_selected"] == int(case["icnt"].sum())
    assert s["global_count"] == int(case["gathered"][:, 1].sum())
    assert s["gather_overflow"] == int(case["gathered"][:, 0].sum() - case["icnt"].sum())
    assert s["overflow"] == s["local_selected"] - s["sent"]


def test_balanced_offsets_split_the_weight():
    # two regions of 100; region 0 holds 10 entries of the set at 0..9 (weight 10 each: 100
    # counted), region 1 none: the boundary lands inside region 0 at about half its weight
    offs = torch.tensor([0, 100, 200], dtype=torch.int64)
    iidx = torch.full((2, 10), -1, dtype=torch.int32)
    iidx[0] = torch.arange(10, dtype=torch.int32) * 10
    b = balanced_offsets(offs, torch.tensor([10, 0], dtype=torch.int32),
                         torch.tensor([100, 0], dtype=torch.int32), iidx, 200, 10)
    assert b.tolist() == [0, 50, 200]


def test_capped_offsets_bound_every_region():
    """No region wider than the span, the ends kept, monotone; boundaries already within the
    cap unchanged; a span too small for n refused."""
    g = gen(3)
    for P, n, span in ((2, 100, 60), (5, 5000, 1100), (8, 5000, 625), (16, 10 ** 6, 65536)):
        for _ in range(20):
            inner = torch.randint(0, n + 1, (P - 1,), generator=g).sort().values
            offs = torch.cat([torch.zeros(1, dtype=torch.int64), inner,
                              torch.full((1,), n, dtype=torch.int64)])
            got = capped_offsets(offs, span)
            w = got[1:] - got[:-1]
            assert int(got[0]) == 0 and int(got[-1]) == n
            assert bool((w >= 0).all()) and int(w.max()) <= span, (P, n, span, offs, got)
            if int((offs[1:] - offs[:-1]).max()) <= span:
                assert torch.equal(got, offs)
    # the weight in the first 3%: the regions on the right take the span, the one before them
    # what is left, the first keeps its width
    offs = torch.tensor([0, 10, 20, 30, 1000], dtype=torch.int64)
    assert capped_offsets(offs, 400).tolist() == [0, 10, 200, 600, 1000]
    with pytest.raises(ValueError, match="cannot cover"):
        capped_offsets(offs, 200)


def test_balanced_offsets_with_a_span():
    # as above, but no region may be wider than 120: the weight says 50, the cap 80 at least
    offs = torch.tensor([0, 100, 200], dtype=torch.int64)
    iidx = torch.full((2, 10), -1, dtype=torch.int32)
    iidx[0] = torch.arange(10, dtype=torch.int32) * 10
    b = balanced_offsets(offs, torch.tensor([10, 0], dtype=torch.int32),
                         torch.tensor([100, 0], dtype=torch.int32), iidx, 200, 10, span=120)
    assert b.tolist() == [0, 80, 200]
    with pytest.raises(ValueError, match="short of n"):
        _run(_case(4, 1), "torch", region=False, span=1000)


def test_one_launch_recorded():
    from oktopk_triton.kernels import counters
    case = _case(4, 3)
    before = counters()["launches"]
    _run(case, "torch", region=False)
    assert counters()["launches"] - before == 1
    with pytest.raises(ValueError, match="exactly one of cap"):
        step_bookkeeping(**case, n=5000, cap_s=200)


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_zero_hist_clears_after_reading(backend):
    case = _case(4, 5)
    kept = _run(case, backend, region=False)
    cleared = _run(case, backend, region=False, zero_hist=True)
    assert torch.equal(kept[1], cleared[1])                    # read before it is cleared
    assert torch.equal(kept[0]["hist"], case["hist"])          # default: left as it was
    assert not bool(cleared[0]["hist"].any())


@needs_triton
def test_beyond_triton_max_p_the_reference_runs():
    """P > TRITON_MAX_P with backend='triton': the torch reference on the device (no launch
    of the kernel), the same state as backend='torch'; the warps the launch would take grow
    with P (4 up to 32, P/8 above)."""
    from oktopk_triton.kernels import _dispatch
    from oktopk_triton.kernels.bookkeeping import TRITON_MAX_P, num_warps
    P = TRITON_MAX_P + 1
    case = _case(P, 0, cg=4)
    before = _dispatch.launcher_calls()
    got = _run(case, "triton", False)
    assert _dispatch.launcher_calls() == before
    ref = _run(case, "torch", False)
    for k in ("region_offsets", "th_global", "th"):
        assert torch.equal(ref[0][k], got[0][k]), k
    assert torch.equal(ref[1], got[1]) and torch.equal(ref[3], got[3])
    assert [num_warps(p) for p in (1, 4, 32, 33, 64, 128)] == [4, 4, 4, 8, 8, 16]
