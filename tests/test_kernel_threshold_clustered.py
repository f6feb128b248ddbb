"""kernels/threshold.py on clustered inputs: the k largest |x| in a few 4096-element blocks.

Each program of the window pass appends its candidates to its own segment of the buffer (sized
for candidates spread evenly); what a segment cannot hold goes to the shared spill buffer, so
the Triton path's threshold stays the exact k-th largest however the candidates cluster.  Only a
window holding more candidates than the whole capacity overflows the spill: the histogram
fallback then answers (within 2^-14, at or below the exact value) and ``info`` says so.  Sizes
stay small for the interpreter (n = 70001 is above the exact cut-off EXACT_BELOW = 2^16).
"""
import oktopk_triton.kernels as K
import pytest
import torch
from kernel_cases import (DEV, INF_BITS, abs_bits, gen, needs_triton, range_kwargs,
                          tail_count)
from oktopk_triton.kernels import threshold as T
from test_kernel_threshold import kth_largest, written

N = 70001


def clustered(n, hot, seed=1, width=4096, tie_step=None):
    """Small noise with ``hot`` 4096-blocks (start indices) of magnitudes in [1, 2); with
    ``tie_step`` the hot values are rounded to multiples of it (many ties at the k-th)."""
    g = gen(seed)
    x = 1e-3 * torch.randn(n, generator=g)
    for b in hot:
        w = min(width, n - b)
        v = 1 + torch.rand(w, generator=g)
        if tie_step is not None:
            v = (v / tie_step).round() * tie_step
        x[b:b + w] = v * torch.sign(torch.randn(w, generator=g))
    return x.to(DEV)


def triton_threshold(x, k, **kw):
    info = {}
    t = float(K.magnitude_threshold(x, k, backend="triton", info=info, **kw))
    return t, info


@needs_triton
def test_one_hot_block_is_exact():
    """n = 70,001, k = 700, the 4096 largest in the first block: before the spill the 320
    candidates overflowed one segment and the fallback answered 1.82440185546875 for the exact
    1.8244508504867554."""
    x = clustered(N, [0])
    want = kth_largest(x, 700)
    t, info = triton_threshold(x, 700)
    assert bool(info["window_ok"]) and int(info["spilled"]) > 0     # the spill was needed
    assert t == want == float(K.magnitude_threshold(x, 700, backend="torch"))
    assert tail_count(x, t) == 700


@needs_triton
@pytest.mark.parametrize("n,k,hot,spills", [
    (N, 100, [0], False),                    # the window's 122 fit one segment
    (N, 2000, [32768], True),                # one block in the middle
    (N, 700, [N - 3000], True),              # the odd tail, shorter than a block
    (N, 1500, [4096, 61440], False),         # two blocks on two programs
    (N, 1500, [4096, 20480], True),          # two blocks on one program (interpreter: 4)
    (100003, 3000, [8192, 24576, 40960], True),
])
def test_hot_block_layouts_are_exact(n, k, hot, spills):
    x = clustered(n, hot, seed=k)
    want = kth_largest(x, k)
    t, info = triton_threshold(x, k)
    assert bool(info["window_ok"]), info
    assert t == want
    assert tail_count(x, t) == k
    if K.INTERPRET:                          # 4 programs, block b on program b % 4
        assert (int(info["spilled"]) > 0) == spills


@needs_triton
def test_hot_block_with_ties_is_exact():
    """Hot magnitudes on a grid of 2^-6: the k-th largest ties with many others."""
    x = clustered(N, [20480], seed=5, tie_step=2.0 ** -6)
    k = 900
    want = kth_largest(x, k)
    assert tail_count(x, want) > k                                   # the data do tie at k
    t, info = triton_threshold(x, k)
    assert bool(info["window_ok"]) and t == want
    assert tail_count(x, t) == tail_count(x, want)


@needs_triton
@pytest.mark.parametrize("device_range", [False, True])
def test_range_with_hot_blocks_is_exact(device_range):
    """A hot block inside the range, a hotter one outside it (ignored)."""
    x = clustered(N + 20000, [40000], seed=3)
    x[5000:9096] = 5 + torch.rand(4096, generator=gen(4)).to(DEV)   # outside the range
    s, e, k = 12345, 12345 + N - 2, 600
    kw = range_kwargs(s, e, device_range)
    want = kth_largest(x[s:e], k)
    assert want != kth_largest(x, k)
    t, info = triton_threshold(x, k, **kw)
    assert bool(info["window_ok"]) and t == want
    assert t == float(K.magnitude_threshold(x, k, backend="torch", **kw))


@needs_triton
def test_spill_overflow_falls_back_and_says_so(monkeypatch):
    """A window fuller than the capacity (forced: capacity 40) overflows the spill: the
    histogram fallback answers, never above the exact value and never selecting fewer than k,
    and ``info`` reports it (window_ok False, spilled > cap)."""
    monkeypatch.setattr(T, "candidate_capacity", lambda k, max_len, S: 40)
    x = clustered(N, [0], seed=1)
    k = 700
    t, info = triton_threshold(x, k)
    assert not bool(info["window_ok"])
    assert int(info["spilled"]) > info["cap"] == 40
    assert t == float(K.histogram_threshold(x, k, backend="torch"))
    want = kth_largest(x, k)
    assert t <= want and (want - t) <= want * 2.0 ** -14
    assert k <= tail_count(x, t) <= 1.01 * k


# ----------------------------------------------------------------------------------------------
# window_pass with a spill buffer
# ----------------------------------------------------------------------------------------------
def _window_case(n=20001, seed=13):
    x = torch.randn(n, generator=gen(seed))
    x[3000:7000] = 0.2 + torch.rand(4000, generator=gen(seed + 1))   # clustered candidates
    x = x.to(DEV)
    lo, hi = int(abs_bits(torch.tensor([0.3]))), int(abs_bits(torch.tensor([1.1])))
    b = abs_bits(x.cpu())
    valid = (b != 0) & (b < INF_BITS)
    inside = b[valid & (b >= lo) & (b < hi)].to(torch.int64).sort().values
    return x, torch.tensor([lo, hi], dtype=torch.int32, device=DEV), inside


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_window_pass_spill_holds_the_rest(backend):
    """Segments too small for the clustered candidates: segments plus spill hold every one
    exactly once; the spill's count is the overflow of the segments, ADDED to."""
    x, bounds, inside = _window_case()
    seg_cap = 50
    cand = torch.full((4, seg_cap), -1, dtype=torch.int32, device=DEV)
    spill = torch.full((inside.numel(),), -1, dtype=torch.int32, device=DEV)
    seg_count = torch.zeros(4, dtype=torch.int64, device=DEV)
    spill_count = torch.tensor(0, dtype=torch.int64, device=DEV)
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    K.window_pass(x, bounds, cand, seg_count, stats, spill=spill, spill_count=spill_count,
                  backend=backend)
    over = int((seg_count.cpu() - seg_cap).clamp(min=0).sum())
    assert int(seg_count.sum()) == inside.numel() and int(spill_count) == over > 0
    _, in_segments = written(cand.cpu(), seg_count.cpu())
    got = torch.cat([in_segments, spill.cpu()[:over].to(torch.int64)]).sort().values
    assert torch.equal(got, inside)
    assert (spill[over:] == -1).all()


@needs_triton
@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_window_pass_spill_overflow_writes_within_capacity(backend):
    """A spill too small: its true count still, only its capacity written, each a candidate."""
    x, bounds, inside = _window_case()
    cand = torch.full((4, 50), -1, dtype=torch.int32, device=DEV)
    spill = torch.full((64,), -1, dtype=torch.int32, device=DEV)
    seg_count = torch.zeros(4, dtype=torch.int64, device=DEV)
    spill_count = torch.tensor(5, dtype=torch.int64, device=DEV)     # ADDED to
    stats = torch.zeros(2, dtype=torch.int64, device=DEV)
    K.window_pass(x, bounds, cand, seg_count, stats, spill=spill, spill_count=spill_count,
                  backend=backend)
    over = int((seg_count.cpu() - 50).clamp(min=0).sum())
    assert int(spill_count) == 5 + over > 64
    sp = spill.cpu()[5:].to(torch.int64)
    assert (spill.cpu()[:5] == -1).all()        # the slots before the count's start
    assert torch.isin(sp, inside).all()


@needs_triton
def test_compile_variants_cover_the_spill_launches(monkeypatch):
    """threshold.compile_variants() covers window_pass launched as on a GPU, with and without
    a spill buffer, every dtype, the range by value and by pointer."""
    pytest.importorskip("triton")
    from oktopk_triton.kernels import _dispatch
    from test_kernel_dispatch import _assert_covered, _record_launches
    variants = list(T.compile_variants())
    log = _record_launches(monkeypatch, ((T, "_window_pass_kernel"),))
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    n, i64 = 4096, torch.int64
    for dt in (torch.float32, torch.bfloat16, torch.float16):
        for ranged in (False, True):
            for with_spill in (False, True):
                s, e = (torch.tensor(5), torch.tensor(n)) if ranged else (5, n)
                sp = (torch.zeros(100, dtype=torch.int32), torch.zeros((), dtype=i64)) \
                    if with_spill else (None, None)
                T._window_pass_triton(torch.zeros(n, dtype=dt), torch.tensor([1, 2]).int(), s,
                                      e, n - 5, torch.zeros(32, 64, dtype=torch.int32),
                                      torch.zeros(32, dtype=i64), torch.zeros(2, dtype=i64), *sp)
    assert _assert_covered(log, variants) == {"_window_pass_kernel"} and len(log) == 12
