"""magnitude_threshold: the k-th largest |x| in one pass over x, with no sort of x and no host read.

1. **Sample.** S = 2^12..2^18 positions spread over the range (a fixed jittered stride); their
   |x| bit patterns are sorted (S is small).  The k-th largest of the range sits, with very high
   probability, between the sample's order statistics at ranks r ∓ 6√r (r = k·S/len): the
   window ``[lo, hi)``.
2. **One pass** (``window_pass``): count the entries with |x| >= hi, count the nonzero finite
   ones, and compact the bit patterns of those in the window into a candidate buffer (one
   ``tl.cumsum`` per block and one scalar atomic per block, as fused_select does).  Program p
   appends to segment p % 32 of the buffer, sized for candidates spread evenly; what a segment
   cannot hold goes to a spill buffer shared by all programs, as large as the whole capacity:
   when the k largest cluster in a few 4096-blocks (a hot embedding row, a layer whose gradient
   jumped) one segment may receive every candidate, and the answer stays exact.
3. **Exact answer** from the candidates: the (k − above)-th largest of them (``torch.sort`` of
   the segments and the spill: two buffers of the capacity, 1.25 × the expected window population
   12·√(k·len/S), so about 0.5 k slots at density 1%), on the device.  A window of one value
   ``[v, v + 1)`` (the sample tied at both ranks, e.g. all magnitudes equal) needs no
   candidates: when it holds the k-th largest, that is v.

Measured why: docs/research/design-notes.md, ``oktopk_triton/kernels/threshold.py``.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON
from .histogram import histogram_threshold

if HAS_TRITON:
    import triton
    import triton.language as tl

IntOrTensor = Union[int, Tensor, None]
_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
WINDOW_Z = 6.0          # window half-width in standard deviations of the sample rank
EXACT_BELOW = 1 << 16   # ranges up to this length take the exact torch.topk path everywhere
WINDOW_SEGMENTS = 32    # candidate buffer segments (one slot counter each): see window_pass


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit(do_not_specialize=["seg_cap", "spill_cap", "start_int", "end_int"])
    def _window_pass_kernel(
        x_ptr,          # *fp32|bf16|fp16 [n]  values (read as fp32)
        bounds_ptr,     # *int32 [2]           window [lo, hi) as |x| bit patterns
        start_ptr,      # *int64 []            first index of the range (if RANGE_IS_PTR)
        end_ptr,        # *int64 []            one past the last index (if RANGE_IS_PTR)
        cand_ptr,       # *int32 [NSEG, seg_cap] out: bit patterns of the entries in the window
        seg_count_ptr,  # *int64 [NSEG]        out, added to: true count per segment
        stats_ptr,      # *int64 [2]           out, added to: [#|x| >= hi, #nonzero finite]
        spill_ptr,      # *int32 [spill_cap]   out: the candidates past their segment's capacity
        spill_count_ptr,  # *int64 []          out, added to: true number of spilled candidates
        start_int, end_int,                  # the range as ints otherwise
        seg_cap,        # candidate slots per segment
        spill_cap,      # slots of the shared spill buffer
        RANGE_IS_PTR: tl.constexpr,
        NSEG: tl.constexpr,   # program p appends to segment p % NSEG: spreads the slot atomics
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        step = (tl.num_programs(0) * BLOCK).to(tl.int64)
        if RANGE_IS_PTR:
            start = tl.load(start_ptr)
            end = tl.load(end_ptr)
        else:
            start = start_int.to(tl.int64)
            end = end_int.to(tl.int64)
        lo = tl.load(bounds_ptr)
        hi = tl.load(bounds_ptr + 1)
        seg = pid % NSEG
        lane = tl.arange(0, BLOCK)
        n_above = tl.zeros((BLOCK,), dtype=tl.int32)     # per lane: no reduction per block
        n_nonzero = tl.zeros((BLOCK,), dtype=tl.int32)
        for base in range(start + pid * BLOCK, end, step):
            m = lane < (end - base).to(tl.int32)
            x = tl.load(x_ptr + base + lane, mask=m, other=0.0).to(tl.float32)
            bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            valid = m & (bits != 0) & (bits < 0x7F800000)
            n_above += (valid & (bits >= hi)).to(tl.int32)
            n_nonzero += valid.to(tl.int32)
            inside = valid & (bits >= lo) & (bits < hi)
            inside_i = inside.to(tl.int32)
            n_in = tl.sum(inside_i, axis=0)
            if n_in > 0:
                slot_base = tl.atomic_add(seg_count_ptr + seg, n_in.to(tl.int64), sem="relaxed")
                slot = slot_base + tl.cumsum(inside_i, axis=0).to(tl.int64) - 1
                tl.store(cand_ptr + seg * seg_cap + slot, bits, mask=inside & (slot < seg_cap))
                if slot_base + n_in > seg_cap:   # clustered candidates: one shared counter
                    spill = inside & (slot >= seg_cap)
                    spill_i = spill.to(tl.int32)
                    n_sp = tl.sum(spill_i, axis=0).to(tl.int64)
                    sp_base = tl.atomic_add(spill_count_ptr, n_sp, sem="relaxed")
                    sp = sp_base + tl.cumsum(spill_i, axis=0).to(tl.int64) - 1
                    tl.store(spill_ptr + sp, bits, mask=spill & (sp < spill_cap))
        tl.atomic_add(stats_ptr, tl.sum(n_above.to(tl.int64), axis=0), sem="relaxed")
        tl.atomic_add(stats_ptr + 1, tl.sum(n_nonzero.to(tl.int64), axis=0), sem="relaxed")

    _SM_COUNT: Dict[int, int] = {}

    def _programs(device: torch.device, max_len: int, block: int) -> int:
        if _dispatch.INTERPRET or device.type != "cuda":
            return max(1, min(4, triton.cdiv(max_len, block)))
        idx = device.index if device.index is not None else torch.cuda.current_device()
        if idx not in _SM_COUNT:
            _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
        return max(1, min(8 * _SM_COUNT[idx], triton.cdiv(max_len, block)))

    WINDOW_BLOCK = 4096

    @_dispatch.serialized_when_interpreted
    def _window_pass_triton(x, bounds, start, end, max_len, cand, seg_count, stats,
                            spill=None, spill_count=None, block=WINDOW_BLOCK, num_warps=8):
        nseg, seg_cap = cand.shape
        grid = (_programs(x.device, max_len, block),)
        ranged = isinstance(start, Tensor)
        spill, spill_count = _no_spill(spill, spill_count, x.device)
        _window_pass_kernel[grid](
            x, bounds, start if ranged else stats, end if ranged else stats, cand, seg_count,
            stats, spill, spill_count, 0 if ranged else int(start), 0 if ranged else int(end),
            seg_cap, spill.numel(), RANGE_IS_PTR=ranged, NSEG=nseg, BLOCK=block,
            num_warps=num_warps)

    def compile_variants():
        """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps) per variant:
        window_pass for every dtype, the range by value and by pointer."""
        for x in ("*fp32", "*bf16", "*fp16"):
            for ranged in (False, True):
                yield (f"window_pass x={x[1:]} range_ptr={ranged}", _window_pass_kernel,
                       {"x_ptr": x, "bounds_ptr": "*i32", "start_ptr": "*i64",
                        "end_ptr": "*i64", "cand_ptr": "*i32", "seg_count_ptr": "*i64",
                        "stats_ptr": "*i64", "spill_ptr": "*i32", "spill_count_ptr": "*i64",
                        "start_int": "i64", "end_int": "i64", "seg_cap": "i32",
                        "spill_cap": "i32", "RANGE_IS_PTR": "constexpr", "NSEG": "constexpr",
                        "BLOCK": "constexpr"},
                       {"RANGE_IS_PTR": ranged, "NSEG": WINDOW_SEGMENTS, "BLOCK": WINDOW_BLOCK},
                       [0, 1, 2, 3, 4, 5, 6, 7, 8], 8)


# ----------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------
def _abs_bits(x: Tensor) -> Tensor:
    return x.to(torch.float32).contiguous().view(torch.int32) & _ABS_MASK


def _no_spill(spill: Optional[Tensor], spill_count: Optional[Tensor], dev):
    """The spill buffer and its counter; an empty one (nothing kept) when not given."""
    if spill is None:
        spill = torch.empty(0, dtype=torch.int32, device=dev)
    if spill_count is None:
        spill_count = torch.zeros((), dtype=torch.int64, device=dev)
    return spill, spill_count


def _window_pass_torch(x, bounds, start, end, max_len, cand, seg_count, stats, spill=None,
                       spill_count=None):
    """Reference: every candidate goes to segment 0, the rest to the spill buffer (both in
    ascending position order)."""
    spill, spill_count = _no_spill(spill, spill_count, x.device)
    n = x.numel()
    dev = x.device
    rel = torch.arange(max_len, device=dev, dtype=torch.int64)
    pos = start + rel
    m = pos < end
    bits = _abs_bits(x.gather(0, pos.clamp(max=max(n - 1, 0))))
    valid = m & (bits != 0) & (bits < _INF_BITS)
    lo, hi = bounds[0], bounds[1]
    inside = valid & (bits >= lo) & (bits < hi)
    flat = cand.view(-1)
    cap = cand.shape[1]
    slot = seg_count[0] + torch.cumsum(inside.to(torch.int64), 0) - 1
    tgt = torch.where(inside & (slot < cap), slot, torch.full_like(slot, flat.numel()))
    buf = torch.cat([flat, flat.new_zeros(1)]).scatter_(0, tgt, bits)
    flat.copy_(buf[:flat.numel()])
    spilled = inside & (slot >= cap)
    sp = spill_count + torch.cumsum(spilled.to(torch.int64), 0) - 1
    tgt = torch.where(spilled & (sp < spill.numel()), sp, torch.full_like(sp, spill.numel()))
    buf = torch.cat([spill, spill.new_zeros(1)]).scatter_(0, tgt, bits)
    spill.copy_(buf[:spill.numel()])
    spill_count += spilled.sum()
    seg_count[0] += inside.sum()
    stats.add_(torch.stack([(valid & (bits >= hi)).sum(), valid.sum()]))


def window_pass(x: Tensor, bounds: Tensor, cand: Tensor, seg_count: Tensor, stats: Tensor, *,
                start: IntOrTensor = None, end: IntOrTensor = None, max_len: Optional[int] = None,
                backend: str = "auto", spill: Optional[Tensor] = None,
                spill_count: Optional[Tensor] = None) -> None:
    """One pass over ``x[start:end]``.  ``stats`` (int64 [2], ADDED to) gets the number of
    nonzero finite entries with ``bits(|x|) >= hi`` and the number of nonzero finite entries;
    the bit patterns of the entries with ``lo <= bits(|x|) < hi`` go to ``cand`` (int32
    [NSEG, seg_cap]: program p appends to segment p % NSEG, any order; the reference puts all of
    them in segment 0), whose true counts are ADDED to ``seg_count`` (int64 [NSEG]).  Entries
    past their segment's capacity go to ``spill`` (int32 [spill_cap], shared by all segments,
    any order), whose true count is ADDED to ``spill_count`` (int64 []); entries past the
    spill's capacity (or every one past a segment's, without ``spill``) are not written.
    ``bounds``: int32 [2] = (lo, hi)."""
    x = x.reshape(-1)
    n = x.numel()
    dev = x.device
    ranged = isinstance(start, Tensor) or isinstance(end, Tensor)
    if max_len is None:
        max_len = n if ranged else max(int(end if end is not None else n) - int(start or 0), 0)
    _dispatch.record(launches=1, bytes=x.element_size() * max_len)
    if max_len == 0 or n == 0:
        return
    if ranged:
        start = _dispatch.as_index_tensor(start, 0, dev)
        end = _dispatch.as_index_tensor(end, n, dev)
    else:
        start, end = int(start or 0), int(end if end is not None else n)
    spill, spill_count = _no_spill(spill, spill_count, dev)
    _dispatch.run(backend, dev, _window_pass_triton, _window_pass_torch, x, bounds, start, end,
                  int(max_len), cand, seg_count, stats, spill, spill_count)


# ----------------------------------------------------------------------------------------------
# the threshold
# ----------------------------------------------------------------------------------------------
_JITTER: Dict[Tuple[int, str], Tensor] = {}


def _jitter(S: int, device: torch.device) -> Tensor:
    key = (S, str(device))
    j = _JITTER.get(key)
    if j is None:
        g = torch.Generator().manual_seed(0x5EED + S)
        j = (torch.arange(S, dtype=torch.float64) + torch.rand(S, generator=g, dtype=torch.float64))
        j = _JITTER[key] = (j / S).to(device)
    return j


def sample_size(k: int, max_len: int) -> int:
    """Static sample size: about 2048 expected hits above the threshold, within [2^12, 2^18]."""
    want = 1 << max(12, min(18, math.ceil(math.log2(max(1.0, 2048.0 * max_len / max(k, 1))))))
    return int(min(want, max(1, max_len)))


def candidate_capacity(k: int, max_len: int, S: int) -> int:
    """Static candidate buffer: the expected window population (2z√(k·len/S) + 3·len/S at the
    largest range) with 25% to spare."""
    pop = 2.0 * WINDOW_Z * math.sqrt(k * max_len / S) + 3.0 * max_len / S
    return int(min(max_len, math.ceil(1.25 * pop) + 256))


def _exact_torch(x, k, s, e, max_len):
    """The exact k-th largest |x| (nonzero finite) in x[s:e] through torch.topk; 0 when fewer
    than k.  No host read (s, e: ints or 0-dim device tensors)."""
    n = x.numel()
    dev = x.device
    if isinstance(s, Tensor) or isinstance(e, Tensor):
        rel = torch.arange(max_len, device=dev, dtype=torch.int64)
        pos = s + rel
        bits = _abs_bits(x.gather(0, pos.clamp(max=max(n - 1, 0))))
        valid = (pos < e) & (bits != 0) & (bits < _INF_BITS)
    else:
        bits = _abs_bits(x[s:e])
        valid = (bits != 0) & (bits < _INF_BITS)
    keyed = torch.where(valid, bits, torch.full_like(bits, -1))
    kk = min(k, max_len)
    kth = torch.topk(keyed, kk, sorted=False).values.min()
    short = (valid.sum() < k) | (kth < 0)
    return torch.where(short, torch.zeros_like(kth), kth).view(torch.float32).reshape(())


def magnitude_threshold(x: Tensor, k: int, *, start: IntOrTensor = None, end: IntOrTensor = None,
                        max_len: Optional[int] = None, backend: str = "auto",
                        info: Optional[dict] = None) -> Tensor:
    """fp32 0-dim: the k-th largest |x| among the nonzero finite entries of ``x[start:end]``, so
    ``count(|x| >= t, x != 0)`` is k (more only through ties at t); 0 when the range holds fewer
    than k nonzero finite entries.  ``start``/``end``: ints or 0-dim int64 device tensors
    (``max_len``: a static bound on ``end - start``, default n).  No host read.

    ``info`` (a dict, optional) receives device tensors: ``window_ok`` (the one-pass window held
    the k-th largest and the answer is exact; else the two-level histogram fallback answered,
    at or below it by at most 2^-14 relative), ``stats`` ([above, in window, nonzero]),
    ``spilled`` (candidates past their segment's capacity; above ``cap`` the spill overflowed),
    and the ints ``S`` (sample size) and ``cap`` (candidate capacity).
    """
    x = x.reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be fp32/bf16/fp16, got {x.dtype}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = x.numel()
    dev = x.device
    s, e, max_len, ranged = _range(start, end, max_len, n, dev)
    max_len = int(min(max_len, n))
    if max_len == 0:
        return torch.zeros((), dtype=torch.float32, device=dev)
    use_triton = _dispatch.choose(backend, dev) == "triton"
    if not use_triton or max_len <= EXACT_BELOW:
        _dispatch.record(launches=4, bytes=x.element_size() * max_len)
        with _dispatch.inside_kernel():
            return _exact_torch(x, k, s, e, max_len)

    # 1. sample: S jittered evenly spaced positions of the range, sorted by |x|: the window
    S = sample_size(k, max_len)
    bounds = _window_bounds(x, k, s, e, max_len, S, ranged)
    # 2. one pass over the range collects the window's candidates; 3. the (k - above)-th
    # largest of them (or the histogram fallback)
    t, ok, above, inside, nonzero, cap, spilled = _window_threshold(x, k, s, e, max_len, S,
                                                                    bounds, backend)
    if info is not None:
        info.update(window_ok=ok, stats=torch.stack([above, inside, nonzero]), S=S, cap=cap,
                    spilled=spilled)
    return t


def _range(start: IntOrTensor, end: IntOrTensor, max_len: Optional[int], n: int, dev):
    """(start, end, static bound on the length, whether the range is on the device)."""
    ranged = isinstance(start, Tensor) or isinstance(end, Tensor)
    if ranged:   # device range: the static bound sizes everything
        s = _dispatch.as_index_tensor(start, 0, dev)
        e = _dispatch.as_index_tensor(end, n, dev)
        if max_len is None:
            max_len = n
    else:        # host range: plain ints (a device scalar made from an int is a host sync)
        s, e = int(start or 0), int(end if end is not None else n)
        max_len = max(e - s, 0) if max_len is None else min(int(max_len), max(e - s, 0))
    return s, e, max_len, ranged


def _window_bounds(x: Tensor, k: int, s, e, max_len: int, S: int, ranged: bool) -> Tensor:
    """Step 1, the window: S jittered evenly spaced positions of the range sorted by |x|; the
    int32 |x| bits [lo, hi] at sample ranks k*S/len -+ (WINDOW_Z*sqrt(r) + 1), hi at least
    lo + 1 (a tied sample gives the one-value window [v, v + 1))."""
    dev, n = x.device, x.numel()
    if ranged:
        length = (e - s).clamp(min=1).to(torch.float64)
        pos = s + (_jitter(S, dev) * length).floor().to(torch.int64)
        r = float(k) * S / length
        half = WINDOW_Z * torch.sqrt(r) + 1.0
        r_hi = torch.floor(r - half).to(torch.int64)
        r_lo = torch.ceil(r + half).to(torch.int64)
    else:
        pos = (s + (_jitter(S, dev) * max_len).floor()).to(torch.int64)
        r = float(k) * S / max_len
        half = WINDOW_Z * math.sqrt(r) + 1.0
        r_hi = math.floor(r - half)
        r_lo = math.ceil(r + half)
    sbits = _abs_bits(x.gather(0, pos.clamp(max=n - 1)))
    sbits = torch.where(sbits < _INF_BITS, sbits, torch.full_like(sbits, -1))
    ordered = torch.sort(sbits, descending=True).values
    if ranged:
        hi = torch.where(r_hi < 0, torch.full_like(ordered[0], _INF_BITS),
                         ordered.gather(0, r_hi.clamp(0, S - 1).reshape(1)).reshape(()))
        at_lo = ordered.gather(0, r_lo.clamp(0, S - 1).reshape(1)).reshape(())
        lo = torch.where(r_lo >= S, torch.ones_like(ordered[0]), at_lo.clamp(min=1))
        bounds = torch.stack([lo, torch.maximum(hi, lo + 1)]).to(torch.int32)
    else:
        hi_i = min(max(r_hi, 0), S - 1)
        lo_i = min(max(r_lo, 0), S - 1)
        pair = torch.stack([ordered[lo_i], ordered[hi_i]])
        lo = pair[0].clamp(min=1) if r_lo < S else torch.ones_like(pair[0])
        hi = pair[1] if r_hi >= 0 else torch.full_like(pair[1], _INF_BITS)
        bounds = torch.stack([lo, torch.maximum(hi, lo + 1)]).to(torch.int32)
    return bounds


def _window_threshold(x: Tensor, k: int, s, e, max_len: int, S: int, bounds: Tensor,
                      backend: str):
    """Steps 2 and 3: one pass gathers the candidates inside the window, the (k - above)-th
    largest of them is the threshold; the histogram fallback answers when the window missed.
    Returns (threshold, window held it, above, inside, nonzero, candidate capacity, spilled)."""
    dev = x.device
    # 2. one pass (program p appends to segment p % nseg: as many segments as programs, at most
    # WINDOW_SEGMENTS, each with its even share of the capacity; what a segment cannot hold goes
    # to the shared spill buffer).  The spill holds the whole capacity, since clustering can put
    # every candidate in one segment: n = 70,001, k = 700 with the 4096 largest in one block put
    # all 320 candidates in one of 4 segments (270 slots each); on a GPU a segment is 1/32.
    # Only a window fuller than the capacity overflows the spill, however the candidates cluster.
    cap = candidate_capacity(k, max_len, S)
    nseg = max(1, min(WINDOW_SEGMENTS, _programs(dev, max_len, WINDOW_BLOCK)))
    seg_cap = -(-cap // nseg) + 64
    cand = torch.full((nseg, seg_cap), -1, dtype=torch.int32, device=dev)
    spill = torch.full((cap,), -1, dtype=torch.int32, device=dev)
    seg_count = torch.zeros(nseg, dtype=torch.int64, device=dev)
    spill_count = torch.zeros((), dtype=torch.int64, device=dev)
    stats = torch.zeros(2, dtype=torch.int64, device=dev)
    window_pass(x, bounds, cand, seg_count, stats, start=s, end=e, max_len=max_len,
                backend=backend, spill=spill, spill_count=spill_count)
    above, nonzero = stats[0], stats[1]
    inside = seg_count.sum()

    # 3. the (k - above)-th largest candidate; a one-value window [v, v + 1) (the sample tied at
    # both ranks) needs no candidates: if it holds the k-th largest, that is v
    kk = k - above
    single = bounds[1] == bounds[0] + 1
    ok = (above < k) & (above + inside >= k) & ((spill_count <= cap) | single)
    short = nonzero < k
    top = torch.sort(torch.cat([cand.view(-1), spill]), descending=True).values
    t_bits = top.gather(0, (kk - 1).clamp(0, top.numel() - 1).reshape(1)).reshape(())
    t_bits = torch.where(single, bounds[0], t_bits.to(torch.int32))
    t_window = t_bits.clamp(min=0).to(torch.int32).view(torch.float32).reshape(())

    # fallback: two histogram passes, launched always, doing nothing unless the window missed
    skip = (ok | short).to(torch.int32)
    t_fallback = histogram_threshold(x, k, start=s, end=e, backend=backend, skip=skip)
    t = torch.where(short, torch.zeros_like(t_window), torch.where(ok, t_window, t_fallback))
    return t, ok, above, inside, nonzero, cap, spill_count
