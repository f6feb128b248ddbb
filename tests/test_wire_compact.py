"""``wire_format="compact"`` (oktopk_triton/algorithms/_wire.py): one int32 word an entry (bf16
value, 16-bit chunk-relative index) behind one count per 65,536-element chunk.

The format itself (round trip, chunking, padding), then every algorithm that takes it: the step
contract (conservation with the rounding kept in a residual, out bitwise identical on every
rank) at P = 3 and 4, the bytes it saves at the same k, regions wider than one chunk, and the
refusals.
"""
import pytest
import torch

from conservation import (assert_bitwise_agreement, assert_conservation, mixed, run_steps,
                          torch_kernels)
from oktopk_triton import SparseAllreduce
from oktopk_triton.algorithms import _wire as W
from oktopk_triton.algorithms.schedule import schedule_of
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.kernels import _dispatch

BE = "torch"


# -- the format -------------------------------------------------------------------------------
def test_encode_decode_round_trip_across_chunks():
    """Unsorted rows over a span of 3.05 chunks: decode gives the valid entries sorted by index,
    values rounded to bf16 (nearest even), -1 / 0 past the count; counts above the capacity
    are cut at it; a row is header + ceil(span/65536) + cap words."""
    g = torch.Generator().manual_seed(0)
    span, cap = 3 * W.CHUNK + 3000, 700
    idx = torch.stack([torch.randperm(span, generator=g)[:cap] for _ in range(4)]).int()
    vals = torch.randn(4, cap, generator=g) * 1e3
    counts = torch.tensor([cap, 5, 0, cap + 40], dtype=torch.int32)
    msg = W.encode(idx, vals, counts, span, header=2)
    assert msg.shape == (4, W.row_words(cap, span, header=2)) == (4, 2 + 4 + cap)
    assert torch.equal(msg[:, :2], torch.zeros(4, 2, dtype=torch.int32))    # left to the caller
    got_i, got_v, got_c = W.decode(msg, cap, span, header=2)
    assert got_c.tolist() == [cap, 5, 0, cap]
    for s, c in enumerate(got_c.tolist()):
        order = torch.argsort(idx[s, :c].long())
        assert torch.equal(got_i[s, :c], idx[s, :c][order])
        assert torch.equal(got_v[s, :c], vals[s, :c][order].to(torch.bfloat16).float())
        assert (got_i[s, c:] == -1).all() and (got_v[s, c:] == 0).all()
    assert int(got_i.max()) >= 3 * W.CHUNK          # the high bits came back from the counts
    # what the wire dropped is the exact difference
    assert torch.equal(W.bf16_rounding(vals), vals - vals.to(torch.bfloat16).float())


def test_chunk_words():
    assert [W.chunks(s) for s in (1, W.CHUNK, W.CHUNK + 1, 10 * W.CHUNK)] == [1, 1, 2, 10]


# -- Ok-Topk -------------------------------------------------------------------------------------
def _delivered_far(res, P, offsets):
    """Entries of out at a region-relative index >= 65536 (its chunk count set the high bits);
    ``offsets[t]``: the regions of step t."""
    far = 0
    for t in range(len(res.outs)):
        nz = torch.nonzero(res.outs[t][0]).flatten()
        offs = offsets[t]
        for j in range(P):
            lo, hi = int(offs[j]), int(offs[j + 1])
            far += int(((nz >= lo + W.CHUNK) & (nz < hi)).sum())
    return far


@pytest.mark.parametrize("P", [3, 4])
def test_oktopk_compact_conserves_agrees_and_halves_the_bytes(P):
    """Regions of about 80k elements (two chunks each): the step contract holds with the bf16
    rounding in the residuals (sender's at the rows, owner's at the slots), out is bitwise
    identical and bf16-valued, and at the same k the bytes are about half of fp32's."""
    n, steps, dens = 80_000 * P, 6, 0.01
    offsets = {0: [n * j // P for j in range(P + 1)]}

    def on_step(comm, alg, t, out):           # the regions the next step uses
        if comm.rank == 0:
            offsets[t + 1] = alg.region_offsets.tolist()

    # check_finite off: the flag's kernel runs interpreted here (TRITON_INTERPRET=1), slow at
    # this n; the non-finite path has its own test
    comp = run_steps("oktopk", P, n, steps, dens, mixed(P), backend=BE, wire_format="compact",
                     on_step=on_step, check_finite="off")
    assert_conservation(comp)
    assert_bitwise_agreement(comp)
    assert _delivered_far(comp, P, offsets) > 0, "no entry beyond the first chunk of a region"
    for t in range(steps):
        out = comp.outs[t][0]
        assert torch.equal(out, out.to(torch.bfloat16).float()), "gathered values not bf16"
    f32 = run_steps("oktopk", P, n, steps, dens, mixed(P), backend=BE, check_finite="off")
    bc, bf = comp.stat_array("bytes_sent")[1:], f32.stat_array("bytes_sent")[1:]
    ratio = float(bc.mean() / bf.mean())
    assert (bc == bc[0, 0]).all() and (bf == bf[0, 0]).all()      # static sizes
    assert ratio < 0.6, ratio
    # the same entries: about as many delivered per step
    gc = comp.stat_array("global_selected")[2:].mean()
    gf = f32.stat_array("global_selected")[2:].mean()
    assert abs(float(gc / gf) - 1) < 0.1
    print(f"\nP={P}: compact/fp32 bytes per step {ratio:.3f}; |I| {float(gc):.0f} / "
          f"{float(gf):.0f}")


def test_oktopk_compact_momentum_odd_world_and_one_rank():
    """Momentum correction (the velocity is fused into the select pass and masked by clear_sent),
    P = 5 and P = 1, a span under one chunk: the contract holds."""
    for P in (5, 1):
        res = run_steps("oktopk", P, 7000, 20, 0.02, mixed(11), backend=BE, momentum=0.9,
                        wire_format="compact")
        assert_conservation(res)
        assert_bitwise_agreement(res)
        assert res.stat_array("global_selected")[2:].min() > 0


def test_oktopk_compact_nonfinite_step_leaves_residuals():
    res = run_steps("oktopk", 3, 5000, 6, 0.02, mixed(4), backend=BE, wire_format="compact",
                    nonfinite={3: 1})
    assert_conservation(res)
    assert res.unchanged[3]


def test_oktopk_compact_schedule_is_the_wire():
    """Rows of chunks(span) + cap_r words, slots of 1 + chunks(span) + cap_g, with the fp32
    capacities: what a step counts. The span: 4·n/P by default (8 of n's 16 chunks at P = 8),
    all of n with ``region_span=None``."""
    from oktopk_triton.algorithms.oktopk import OkTopk
    n, k, P = 1 << 20, 10486, 8
    cr, cg = OkTopk.capacities(n, k, P, 4.0, 0.5, True)
    for opt, C in (("auto", 8), (None, 16)):
        specs = schedule_of("oktopk", n, k, P, wire_format="compact", region_span=opt)
        assert specs[1].bytes_per_rank == (P - 1) * 4 * (C + cr)
        assert specs[2].bytes_per_rank == (P - 1) * 4 * (1 + C + cg)
    fp32 = schedule_of("oktopk", n, k, P)
    ratio = sum(s.bytes_per_rank for s in specs) / sum(s.bytes_per_rank for s in fp32)
    assert 0.5 < ratio < 0.52


def _hot_left(seed: int = 0):
    """Gradients 3x larger in the first 5% of n: most of the global top-k lies there, so the
    re-balancing wants narrow regions there and one over most of the rest, which still
    delivers some."""
    def fn(rank: int, step: int, n: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed * 10_000 + rank * 100 + step)
        x = torch.randn(n, generator=g)
        x[: n // 20] *= 3.0
        return x
    return fn


@pytest.mark.parametrize("fmt", ["compact", "q2"])
def test_oktopk_regions_stay_within_the_span(fmt):
    """P = 8, n = 320,000 (5 chunks), most weight in the first 5%: without a bound a region grows
    past 4·n/P; with the default (4·n/P, rounded up to 3 chunks) none does, entries beyond a
    region's first chunk still arrive, the contract holds, and every step sends what the
    schedule says: rows of 3 chunks' words instead of 5."""
    P, n, steps = 8, 320_000, 6
    span = 3 * W.CHUNK

    def widest(res_offsets):
        return max(max(b - a for a, b in zip(o, o[1:])) for o in res_offsets.values())

    runs = {}
    for opt in ("auto", None):
        offsets = {0: [n * j // P for j in range(P + 1)]}

        def on_step(comm, alg, t, out, offsets=offsets):
            if comm.rank == 0:
                offsets[t + 1] = alg.region_offsets.tolist()
        res = run_steps("oktopk", P, n, steps, 0.01, _hot_left(), backend=BE, wire_format=fmt,
                        check_finite="off", region_span=opt, on_step=on_step)
        assert_conservation(res)
        assert_bitwise_agreement(res)
        runs[opt] = res, offsets
    (cap, offs_c), (free, offs_f) = runs["auto"], runs[None]
    assert cap.algs[0].span == span and free.algs[0].span == n
    assert widest(offs_f) > span                      # the bound matters here
    assert widest(offs_c) <= span
    assert _delivered_far(cap, P, offs_c) > 0
    sent = cap.stat_array("bytes_sent")[1:]
    want = sum(s.bytes_per_rank for s in schedule_of("oktopk", n, cap.k, P, check_finite="off",
                                                     wire_format=fmt))
    assert (sent == want).all(), (sent, want)
    saved = free.stat_array("bytes_sent")[1:] - sent
    per_chunk = 4 if fmt == "compact" else 12          # a row's and a slot's words per chunk
    assert (saved == 2 * (P - 1) * per_chunk * (5 - 3)).all(), saved


def test_region_span_values():
    """auto: 4·ceil(n/P) in whole chunks on a packed wire (at most n), no bound on fp32; a
    number is that multiple of n/P; None is n; anything else a one-line error."""
    from oktopk_triton.algorithms.oktopk import OkTopk
    n = 1_040_000
    assert OkTopk.region_span(n, 64, "auto", True) == W.CHUNK         # 16 chunks -> 1
    assert OkTopk.region_span(n, 4, "auto", True) == n
    assert OkTopk.region_span(n, 64, "auto", False) == n
    assert OkTopk.region_span(n, 64, 2, False) == 2 * 16_250
    assert OkTopk.region_span(n, 64, 8, True) == 2 * W.CHUNK
    assert OkTopk.region_span(n, 64, None, True) == n
    comm = LocalCluster(1).communicator(0)
    for bad in (0.5, "wide", True):
        with pytest.raises(ValueError, match="region_span must be") as e:
            SparseAllreduce(1000, comm=comm, algorithm="oktopk", region_span=bad)
        assert "\n" not in str(e.value)


def _load_wide_regions(comm, n):
    from oktopk_triton.algorithms.oktopk import OkTopk
    sd = OkTopk(n, comm, 0.01, wire_format="q2", region_span=None).state_dict()
    sd["region_offsets"] = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, n], dtype=torch.int64)
    b = OkTopk(n, comm, 0.01, wire_format="q2")
    b.load_state_dict(sd)
    return b.span, b.region_offsets


def test_checkpoint_regions_wider_than_the_span_are_capped():
    """A state saved without a bound (one region of almost all of n), loaded where there is one:
    its regions are capped alike on every rank (the rows' chunk words could not carry the
    wider one)."""
    n = 320_000
    got = LocalCluster(8).run(_load_wide_regions, n)
    span, offs = got[0]
    w = offs[1:] - offs[:-1]
    assert span == 3 * W.CHUNK and int(w.max()) <= span and int(offs[-1]) == n
    assert all(torch.equal(o, offs) for _, o in got)


# -- refusals -------------------------------------------------------------------------------------
def test_bad_values_are_refused_with_one_line():
    comm = LocalCluster(1).communicator(0)
    with pytest.raises(ValueError, match=r"wire_format must be one of \('fp32', 'compact', "):
        SparseAllreduce(1000, comm=comm, algorithm="oktopk", wire_format="bf16")
    with pytest.raises(ValueError, match="dense: wire_format='compact' is not supported"):
        SparseAllreduce(1000, comm=comm, algorithm="dense", wire_format="compact")
    with pytest.raises(ValueError, match="does not combine"):
        SparseAllreduce(1000, comm=comm, algorithm="oktopk", wire_format="compact",
                        wire_dtype="bf16")
    with pytest.raises(ValueError, match="wire_format must be"):
        schedule_of("topka", 1000, 10, 4, wire_format="int8")
    for msg in ("wire_format must be", "not supported"):
        try:
            SparseAllreduce(1000, comm=comm, algorithm="dense",
                            wire_format="compact" if msg == "not supported" else 3)
        except ValueError as e:
            assert "\n" not in str(e) and msg in str(e)


# -- every algorithm that takes it -------------------------------------------------------------
SPARSE = ["oktopk", "topka", "gaussiank", "gtopk", "spardl", "topkdsa"]
# spans beyond one chunk: SparDL's and TopkDSA's blocks are n/P long, the others' indices global
PER_RANK = 68_000


def _far_entries(name, out, P):
    """Nonzeros of out at an index >= 65536 within their span (a block of n/P, or all of n)."""
    nz = torch.nonzero(out).flatten()
    if name in ("spardl", "topkdsa"):
        n = out.numel()
        rel = nz - torch.tensor([n * j // P for j in range(P)])[(nz * P) // n]
        return int((rel >= W.CHUNK).sum())
    return int((nz >= W.CHUNK).sum())


@pytest.mark.parametrize("P", [3, 4])
@pytest.mark.parametrize("name", [a for a in SPARSE if a != "oktopk"])   # Ok-Topk: above
def test_every_algorithm_compact_conserves_agrees_and_halves_the_bytes(name, P, monkeypatch):
    """Spans of two chunks: the contract holds (the rounding in some residual), out is bitwise
    identical, entries beyond the first chunk arrive, and a step counts under 0.6 of what the
    same messages cost in fp32 (the fp32 schedule, which test_schedule checks against the
    wire)."""
    if P == 4:  # the wire's kernels interpreted at P = 3, their torch references at P = 4
        monkeypatch.setattr(_dispatch, "INTERPRET", False)
    n, steps = PER_RANK * P, 3
    res = run_steps(name, P, n, steps, 0.01, mixed(P), wire_format="compact",
                    check_finite="off", **torch_kernels(name))
    assert_conservation(res)
    assert_bitwise_agreement(res)
    assert sum(_far_entries(name, res.outs[t][0], P) for t in range(steps)) > 0
    state = {}
    if name == "topkdsa":       # the gather's size follows the decision after step 0
        state = dict(mode=res.algs[0].mode, cap2=res.algs[0].cap2)
    fp32 = max(sum(s.bytes_per_rank for s in schedule_of(name, n, res.k, P, rank=r,
                                                            check_finite="off", **state))
               for r in range(P))
    measured = res.stat_array("bytes_sent")[1:].max()
    assert measured == max(sum(s.bytes_per_rank for s in schedule_of(
        name, n, res.k, P, rank=r, check_finite="off", wire_format="compact", **state))
        for r in range(P))
    assert float(measured) / fp32 < 0.6


@pytest.mark.parametrize("name", SPARSE)
def test_compact_keeps_momentum_masking_and_the_nonfinite_policy(name):
    """Momentum correction with factor masking: the compact step stops the velocity of about
    as many entries as the fp32 step (their residual holds the rounding, not 0); a NaN on one
    rank leaves every residual bit for bit."""
    P, n = 3, 3000
    opts = torch_kernels(name)
    zeros = {}
    for wf in ("fp32", "compact"):
        res = run_steps(name, P, n, 8, 0.02, mixed(5), momentum=0.9, wire_format=wf,
                        nonfinite={5: 2}, **opts)
        assert_conservation(res)
        assert_bitwise_agreement(res)
        assert res.unchanged[5]
        zeros[wf] = sum(int((a.velocity == 0).sum()) for a in res.algs)
    assert zeros["fp32"] > 0
    assert 0.8 < zeros["compact"] / zeros["fp32"] < 1.25, zeros


def test_topkdsa_compact_dense_mode_sends_bf16_regions():
    """Once the sums fill in, TopkDSA gathers whole regions: as bf16 in the compact format (half
    of fp32's L words), with the owner keeping the rounding."""
    P, n = 4, 4001       # P a power of two: out·P is the gathered value exactly
    res = run_steps("topkdsa", P, n, 4, 0.25, mixed(6), wire_format="compact", tau=1)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    modes = res.stat("mode")
    assert all(m == "dense" for row in modes[1:] for m in row)
    L = -(-n // P)
    specs = schedule_of("topkdsa", n, res.k, P, wire_format="compact", mode="dense")
    assert specs[-1].bytes_per_rank == (P - 1) * 4 * ((L + 1) // 2)
    assert res.stat_array("bytes_sent")[1:].eq(sum(s.bytes_per_rank for s in specs)).all()
    for t in range(1, 4):
        out = res.outs[t][0] * P
        assert torch.equal(out, out.to(torch.bfloat16).float())     # the regions went as bf16


def test_benchmarks_price_the_compact_wire():
    """The projection's schedules and the byte target PowerSGD is matched to in the LM
    benchmark follow the run's wire format."""
    from oktopk_triton.algorithms.schedule import total_bytes
    from oktopk_triton.planning import algorithm_schedule
    from oktopk_triton.bench.lm_loop import _oktopk_bytes
    n, P = 1 << 20, 8
    assert _oktopk_bytes(n, 0.01, P, "compact") < 0.52 * _oktopk_bytes(n, 0.01, P)
    for name in SPARSE:
        fp32 = total_bytes(algorithm_schedule(name, n, 10486, P))
        comp = total_bytes(algorithm_schedule(name, n, 10486, P, wire_format="compact"))
        assert comp < 0.52 * fp32, name
    assert algorithm_schedule("dense", n, 10486, P, wire_format="compact") == \
        algorithm_schedule("dense", n, 10486, P)
