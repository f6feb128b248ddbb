"""fused_select: the hot kernel of a sparse-allreduce step (select and count in one pass).

Why it is shaped so: the step is memory bound, so one pass reads grad + residual (+ the velocity
with momentum correction), writes residual = acc (and the velocity), and compacts the few selected
(index, value) pairs straight into the fixed-capacity row of their destination region: no mask
tensor, no nonzero, no second pass; (s_grad + 8) * n bytes (+ 8n with a velocity) plus the
selected entries.  Compaction inside a block is a tl.cumsum of the selection mask; the slot base
comes from one scalar atomic_add per (program, region) on the region's count, which therefore
ends as the TRUE count.  A block usually lies inside one region; when it spans several the kernel
walks them (a binary search finds the first), so any layout works, P = 1 included.

Counting for the next step rides in the same pass (``hist``): per region, a histogram of |acc|
in bins relative to the region's threshold (1/8 of a binade in fp32 bit space, 64 bins: from 1/16
to 16 times the threshold, the two end bins open), so the caller can place next step's
threshold at any count between those edges without a threshold pass.

Measured why: docs/research/design-notes.md, ``oktopk_triton/kernels/selection.py``.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON, ceil_log2
from .consistency import ema_update

if HAS_TRITON:
    import triton
    import triton.language as tl


class Selection(NamedTuple):
    indices: Tensor    # int32 [P, capacity]: index relative to the start of its region
    values: Tensor     # fp32  [P, capacity]
    counts: Tensor     # int32 [P]: TRUE number selected in each region (may exceed capacity)
    nonfinite: Tensor  # int32 [P]: 1 if any acc in the region is NaN/Inf


SELECT_HIST_BINS = 64      # bins of the per-region count histogram of fused_select
SELECT_HIST_SHIFT = 20     # bin width: 2^20 in fp32 bit space = 1/8 binade
_ABS_MASK = 0x7FFFFFFF
# True: CPU tensors take the plain reference (_fused_select_torch) instead of the few-pass CPU
# path; for tests that compare the two
REFERENCE = False
_INF_BITS = 0x7F800000


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _region_of(region_offsets_ptr, block_start, P, SEARCH_STEPS: tl.constexpr):
        """The region holding ``block_start``: the largest p < P with
        region_offsets[p] <= block_start (a binary search of SEARCH_STEPS iterations)."""
        lo = P * 0          # int32 tensors (loop-carried)
        hi = P + 0
        for _ in range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            go_right = (hi - lo > 1) & (tl.load(region_offsets_ptr + mid) <= block_start)
            shrink = (hi - lo > 1) & (tl.load(region_offsets_ptr + mid) > block_start)
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(shrink, mid, hi)
        return lo.to(tl.int64)

    @triton.jit
    def _add_histogram(row_ptr, bits, thr, mask, HIST_BINS: tl.constexpr,
                       HIST_SHIFT: tl.constexpr):
        """Add the |acc| bins of the masked lanes to one region's histogram row: bins relative
        to the region's threshold ``thr``, HIST_SHIFT bits of the fp32 pattern wide."""
        thr_bits = thr.to(tl.int32, bitcast=True) & 0x7FFFFFFF
        hbin = ((bits - thr_bits) >> HIST_SHIFT) + HIST_BINS // 2
        hbin = tl.minimum(tl.maximum(hbin, 0), HIST_BINS - 1)
        h = tl.histogram(hbin, HIST_BINS, mask=mask)
        hb = tl.arange(0, HIST_BINS)
        tl.atomic_add(row_ptr + hb, h, mask=h != 0, sem="relaxed")

    @triton.jit
    def _accumulate(grad_ptr, residual_ptr, velocity_ptr, lane, in_range, live, momentum,
                    HAS_VELOCITY: tl.constexpr, MASK_VELOCITY: tl.constexpr):
        """Error feedback for one block (pointers at the block's start): acc = residual + grad,
        or residual + (u := momentum*u + grad) with momentum correction; acc is written over the
        residual and returned, with the block's grad as fp32."""
        g = tl.load(grad_ptr + lane, mask=in_range, other=0.0).to(tl.float32)
        r = tl.load(residual_ptr + lane, mask=in_range, other=0.0)
        if HAS_VELOCITY:
            u = tl.load(velocity_ptr + lane, mask=in_range, other=0.0)
            u = u * momentum + g           # two roundings (no FMA: enable_fp_fusion=False)
            acc = r + u
            if MASK_VELOCITY:
                u = tl.where(acc == 0.0, 0.0, u)
            tl.store(velocity_ptr + lane, u, mask=live)
        else:
            acc = r + g
        tl.store(residual_ptr + lane, acc, mask=live)
        return acc, g

    # n stays specialised (n % 16)
    @triton.jit(do_not_specialize=["P", "capacity", "momentum", "rate", "keep"])
    def _fused_select_kernel(
        grad_ptr,            # *fp32|bf16|fp16 [n]  gradient of this step
        residual_ptr,        # *fp32 [n]            residual, overwritten with acc
        velocity_ptr,        # *fp32 [n]            velocity u := momentum*u + grad
                             #                      (if HAS_VELOCITY)
        threshold_ptr,       # *fp32 [] or [P]      selection threshold: one, or one per region
        region_offsets_ptr,  # *int64 [P+1]         region boundaries, [0]=0, [P]=n, non-decreasing
        indices_ptr,         # *int32 [P, capacity] out: relative index, row stride idx_row_stride
        values_ptr,          # *fp32  [P, capacity] out: acc value, row stride val_row_stride
        counts_ptr,          # *int32 [P]           out (zeroed by the launcher): true counts
        nonfinite_ptr,       # *int32 [P]           out (zeroed by the launcher): NaN/Inf flag
        hist_ptr,            # *int32 [P, HIST_BINS] out, ADDED to: |acc| bins relative to the
                             #                      region's threshold (if HAS_HIST)
        skip_ptr,            # *int32 []            when nonzero write nothing (if HAS_SKIP)
        weight_ptr,          # *fp32 [n]            the score is |acc|·|weight| (if HAS_WEIGHT);
                             #                      first updated to rate·weight + keep·sign(grad)
                             #                      where live (if UPDATE_WEIGHT)
        n,                   # number of elements
        P,                   # number of regions
        capacity,            # slots per region row
        momentum,            # fp32 momentum factor (if HAS_VELOCITY)
        rate, keep,          # fp32 the weight's EMA: the old weight's share and 1 - rate
                             #      (if UPDATE_WEIGHT)
        idx_row_stride, val_row_stride, counts_stride, nonfinite_stride,
        HAS_SKIP: tl.constexpr,
        HAS_VELOCITY: tl.constexpr,
        MASK_VELOCITY: tl.constexpr,   # u := 0 where acc == 0 (momentum factor masking)
        HAS_HIST: tl.constexpr,
        HAS_WEIGHT: tl.constexpr,      # select and count on |acc|·|weight| instead of |acc|
        UPDATE_WEIGHT: tl.constexpr,   # weight := rate·weight + keep·sign(grad) first (an EMA)
        THR_PER_REGION: tl.constexpr,  # threshold_ptr holds P thresholds (region j: [j])
        HIST_BINS: tl.constexpr,
        HIST_SHIFT: tl.constexpr,
        SEARCH_STEPS: tl.constexpr,    # ceil(log2(P + 1)): binary-search iterations for region
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        block_start = pid * BLOCK                 # int64 scalar; per-element math stays int32
        lane = tl.arange(0, BLOCK)
        n_here = tl.minimum(n - block_start, BLOCK).to(tl.int32)   # elements of this block
        in_range = lane < n_here

        live = in_range      # in range and not skipped
        if HAS_SKIP:
            skip_vec = tl.zeros((BLOCK,), dtype=tl.int32) + tl.load(skip_ptr)
            live = in_range & (skip_vec == 0)

        acc, g = _accumulate(grad_ptr + block_start, residual_ptr + block_start,
                             velocity_ptr + block_start, lane, in_range, live, momentum,
                             HAS_VELOCITY, MASK_VELOCITY)

        score = tl.abs(acc)
        if HAS_WEIGHT:
            w = tl.load(weight_ptr + block_start + lane, mask=in_range, other=0.0)
            if UPDATE_WEIGHT:   # two roundings and an add (no FMA), as sign_ema
                w = w * rate + tl.where(g > 0, 1.0, tl.where(g < 0, -1.0, 0.0)) * keep
                tl.store(weight_ptr + block_start + lane, w, mask=live)
            score = score * tl.abs(w)
        candidate = (score != 0.0) & live
        if not THR_PER_REGION:
            thr = tl.load(threshold_ptr)
        bad = ((acc != acc) | (tl.abs(acc) == float("inf"))) & live
        if HAS_HIST:
            bits = score.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            counted = live & (bits != 0) & (bits < 0x7F800000)

        region = _region_of(region_offsets_ptr, block_start, P, SEARCH_STEPS)
        region_start = tl.load(region_offsets_ptr + region)
        block_end = block_start + n_here
        # walk the regions that start before the block ends (usually exactly one)
        while region_start < block_end:
            region_end = tl.load(region_offsets_ptr + region + 1)
            # the region as lane bounds of this block (clamped: int32)
            first = tl.maximum(region_start - block_start, 0).to(tl.int32)
            last = tl.minimum(region_end - block_start, BLOCK).to(tl.int32)
            in_region = (lane >= first) & (lane < last)
            if THR_PER_REGION:
                thr = tl.load(threshold_ptr + region)
            take = candidate & (score >= thr) & in_region
            take_i = take.to(tl.int32)
            n_take = tl.sum(take_i, axis=0)
            # one scalar atomic per (program, region): the slot base; counts end as true counts
            slot_base = tl.atomic_add(counts_ptr + region * counts_stride, n_take, mask=n_take > 0,
                                      sem="relaxed")
            slot = slot_base + tl.cumsum(take_i, axis=0) - 1
            write = take & (slot < capacity)
            rel = lane + (block_start - region_start).to(tl.int32)   # index relative to region
            tl.store(indices_ptr + region * idx_row_stride + slot, rel, mask=write)
            tl.store(values_ptr + region * val_row_stride + slot, acc, mask=write)
            n_bad = tl.sum((bad & in_region).to(tl.int32), axis=0)
            tl.atomic_max(nonfinite_ptr + region * nonfinite_stride, 1, mask=n_bad > 0,
                          sem="relaxed")
            if HAS_HIST:
                _add_histogram(hist_ptr + region * HIST_BINS, bits, thr, counted & in_region,
                               HIST_BINS, HIST_SHIFT)
            region += 1
            region_start = region_end

    @_dispatch.serialized_when_interpreted
    def _fused_select_triton(grad, residual, threshold, region_offsets, capacity, skip, out,
                             velocity, momentum, mask_velocity, hist, weight=None,
                             weight_rate=None, block: int = 2048,
                             num_warps: Optional[int] = None):
        if _dispatch.INTERPRET:
            block = 4096   # the interpreter pays per program: fewer, bigger programs
        n = residual.numel()
        P = region_offsets.numel() - 1
        out.counts.zero_()
        out.nonfinite.zero_()
        if n == 0:
            return out
        grid = (triton.cdiv(n, block),)
        _fused_select_kernel[grid](
            grad, residual, velocity if velocity is not None else residual,
            threshold, region_offsets,
            out.indices, out.values, out.counts, out.nonfinite,
            hist if hist is not None else out.counts,
            skip if skip is not None else out.counts,
            weight if weight is not None else residual,
            n, P, capacity, float(momentum),
            float(weight_rate or 0.0), float(1.0 - (weight_rate or 0.0)),
            out.indices.stride(0), out.values.stride(0), out.counts.stride(0),
            out.nonfinite.stride(0),
            HAS_SKIP=skip is not None, HAS_VELOCITY=velocity is not None,
            MASK_VELOCITY=bool(mask_velocity), HAS_HIST=hist is not None,
            HAS_WEIGHT=weight is not None, UPDATE_WEIGHT=weight_rate is not None,
            THR_PER_REGION=threshold.dim() == 1,
            HIST_BINS=SELECT_HIST_BINS, HIST_SHIFT=SELECT_HIST_SHIFT,
            SEARCH_STEPS=ceil_log2(P + 1), BLOCK=block,
            # 4 warps at BLOCK 2048: 2.20 ms at 2^28 on an H100, against 3.46 ms with 8 warps
            num_warps=num_warps or (8 if block >= 4096 else 4),
            enable_fp_fusion=False,
        )
        return out


# ----------------------------------------------------------------------------------------------
# torch reference (same semantics; the CPU path).  Nothing here reads a tensor value on the host
# (no .item(), int(), float(), .tolist(), nonzero): the same code runs for CPU tensors on a CUDA
# machine as on a CPU-only one, and a steady step stays free of host reads either way.
# ----------------------------------------------------------------------------------------------
def region_ids(region_offsets: Tensor, n: int) -> Tensor:
    """int64 [n]: the region of every element (empty regions hold none)."""
    pos = torch.arange(n, device=region_offsets.device, dtype=torch.int64)
    return torch.searchsorted(region_offsets[1:].contiguous(), pos, right=True)


def _accumulate_torch(grad, residual, velocity, momentum, mask_velocity):
    """(acc, new velocity or None): acc = residual + grad, or with a velocity
    u' = (u * momentum) + grad (two roundings, as the kernel) and acc = residual + u'."""
    g = grad.to(torch.float32)
    if velocity is None:
        return residual + g, None
    u = velocity * float(momentum) + g
    acc = residual + u
    if mask_velocity:
        u = torch.where(acc == 0, torch.zeros_like(u), u)
    return acc, u


def select_hist_bins(acc: Tensor, thr_bits: Tensor) -> Tensor:
    """int64: the fused_select histogram bin of every |acc| relative to ``thr_bits``
    (int32 bit pattern of the threshold, broadcastable)."""
    bits = acc.view(torch.int32) & _ABS_MASK
    rel = (bits.to(torch.int64) - thr_bits.to(torch.int64)) >> SELECT_HIST_SHIFT
    return (rel + SELECT_HIST_BINS // 2).clamp_(0, SELECT_HIST_BINS - 1)


def _fused_select_torch(grad, residual, threshold, region_offsets, capacity, skip, out,
                        velocity, momentum, mask_velocity, hist, weight=None, weight_rate=None):
    """No host read (CPU or CUDA tensors alike)."""
    n = residual.numel()
    P = region_offsets.numel() - 1
    dev = residual.device
    acc, new_u = _accumulate_torch(grad, residual, velocity, momentum, mask_velocity)
    active = (torch.ones((), dtype=torch.bool, device=dev) if skip is None
              else (skip.reshape(()) == 0))
    rid = region_ids(region_offsets, n)
    thr = threshold.to(torch.float32)
    thr_e = thr[rid] if thr.dim() == 1 else thr.reshape(())
    if weight is not None and weight_rate is not None:
        new_w = ema_update(weight, grad, weight_rate)
        weight.copy_(torch.where(active, new_w, weight))
    score = acc.abs() if weight is None else acc.abs() * weight.abs()
    sel = (score >= thr_e) & (score != 0) & active
    bad = (~torch.isfinite(acc)) & active
    counts = torch.zeros(P, dtype=torch.int64, device=dev).scatter_add_(0, rid, sel.to(torch.int64))
    nonfinite = torch.zeros(P, dtype=torch.int64, device=dev).scatter_reduce_(
        0, rid, bad.to(torch.int64), reduce="amax")
    before = torch.cumsum(counts, 0) - counts              # selected in earlier regions
    slot = torch.cumsum(sel.to(torch.int64), 0) - 1 - before[rid]
    write = sel & (slot < capacity)
    dump = P * capacity
    target = torch.where(write, rid * capacity + slot, torch.full_like(slot, dump))
    rel = (torch.arange(n, device=dev, dtype=torch.int64) - region_offsets[rid]).to(torch.int32)
    idx_buf = torch.cat([out.indices.reshape(-1) if out.indices.is_contiguous() else
                         out.indices.contiguous().reshape(-1), out.indices.new_zeros(1)])
    val_buf = torch.cat([out.values.contiguous().reshape(-1), out.values.new_zeros(1)])
    idx_buf.scatter_(0, target, rel)
    val_buf.scatter_(0, target, acc)
    out.indices.copy_(idx_buf[:dump].view(P, capacity))
    out.values.copy_(val_buf[:dump].view(P, capacity))
    out.counts.copy_(counts)
    out.nonfinite.copy_(nonfinite)
    if hist is not None:
        bits = score.view(torch.int32) & _ABS_MASK
        counted = (bits != 0) & (bits < _INF_BITS) & active
        thr_bits = (thr.view(torch.int32) & _ABS_MASK)
        thr_bits = thr_bits[rid] if thr.dim() == 1 else thr_bits.reshape(())
        flat = rid * SELECT_HIST_BINS + select_hist_bins(score, thr_bits)
        nbins = P * SELECT_HIST_BINS
        add = torch.bincount(torch.where(counted, flat, torch.full_like(flat, nbins)),
                             minlength=nbins + 1)[:nbins] \
            if dev.type == "cpu" else \
            torch.zeros(nbins, dtype=torch.int64, device=dev).scatter_add_(
                0, flat, counted.to(torch.int64))
        hist.view(-1).add_(add.to(hist.dtype))
    residual.copy_(torch.where(active, acc, residual))
    if velocity is not None:
        velocity.copy_(torch.where(active, new_u, velocity))
    return out


# ----------------------------------------------------------------------------------------------
# CPU path: the reference's semantics bit for bit, in a few passes over n.  On CPU a host read is
# free (no device to wait for), so each region is a slice known to the host and the selection is
# one compare and one nonzero per region; the int64 per-element region ids, gathers and scatters
# over n of the reference (about twenty passes, 167 ms a step at n = 2^20, P = 4) are gone.
# Passes over n: accumulate (grad + residual, written back), |acc|, its max (non-finite check),
# the compare + nonzero, and with ``hist`` a subtract-shift-clamp-bincount and a nonzero count.
# ----------------------------------------------------------------------------------------------
CPU_SELECT_PASSES = 5            # n-sized passes without hist (the test bounds this)
CPU_HIST_PASSES = 5              # extra n-sized passes with hist


def _fused_select_cpu(grad, residual, threshold, region_offsets, capacity, skip, out,
                      velocity, momentum, mask_velocity, hist, weight=None, weight_rate=None):
    P = region_offsets.numel() - 1
    if skip is not None and int(skip) != 0:       # nothing written, nothing counted
        out.counts.zero_()
        out.nonfinite.zero_()
        return out
    g = grad if grad.dtype == torch.float32 else grad.to(torch.float32)
    if velocity is None:
        residual.add_(g)                           # acc, in place (same rounding)
    else:
        u = velocity * float(momentum)
        u.add_(g)
        residual.add_(u)
        if mask_velocity:
            u.masked_fill_(residual == 0, 0.0)
        velocity.copy_(u)
    acc = residual
    if weight is not None and weight_rate is not None:
        weight.copy_(ema_update(weight, g, weight_rate))
    a = acc.abs() if weight is None else torch.mul(acc, weight).abs_()   # |acc|·|w|, exactly
    finite = bool(torch.isfinite(a.max())) if a.numel() else True
    offs = region_offsets.tolist()
    th = threshold.reshape(-1).tolist()
    th = th * P if len(th) == 1 else th
    counts = [0] * P
    bad = [0] * P
    for j in range(P):
        lo, hi = offs[j], offs[j + 1]
        if hi <= lo:
            continue
        aj = a[lo:hi]
        sel = aj > 0 if th[j] <= 0 else aj >= th[j]      # a NaN threshold selects nothing
        idx = _sparse_nonzero(sel)
        counts[j] = idx.numel()
        c = min(counts[j], capacity)
        if c:
            out.indices[j, :c] = idx[:c].to(torch.int32)
            out.values[j, :c] = acc[lo:hi][idx[:c]]
        if not finite:
            bad[j] = int(not bool(torch.isfinite(aj).all()))
    out.counts.copy_(torch.tensor(counts, dtype=torch.int32))
    out.nonfinite.copy_(torch.tensor(bad, dtype=torch.int32))
    if hist is not None:
        _hist_cpu(a, threshold, offs, th, finite, hist)
    return out


def _cpu_select_bytes(n: int, gbytes: int, vbytes: int, hist: bool) -> int:
    """Memory traffic of ``_fused_select_cpu`` over n (bytes; the O(selected) compaction left
    out): accumulate (grad, residual read and written), |acc| written and read back by its max
    and by the compare, the bool mask written and scanned as words, and the histogram (bits
    minus threshold written, shifted, offset and clamped in place, then bincount and
    count_nonzero): 66n + grad with the histogram, 26n + grad without. The Triton kernel reads
    grad and the residual once and writes the residual: 8n + grad."""
    select = gbytes + 8 * n + vbytes + 4 * n + 3 * 4 * n + n + n
    return select + (4 * n + 4 * n + 3 * 8 * n + 4 * n + 4 * n if hist else 0)


def _sparse_nonzero(mask: Tensor) -> Tensor:
    """int64 positions of a fresh, contiguous bool mask's True entries, ascending. A mask that
    is mostly False is scanned as int64 words (8 flags each) first, and only the nonzero words
    are expanded: nonzero over n flags cost 4.6 ms at n = 2^18 on one core (the CPU step's
    largest op), the word scan about an eighth of that."""
    L8 = mask.numel() // 8 * 8
    if L8 == 0:
        return mask.nonzero().reshape(-1)
    words = (mask[:L8].view(torch.int64) != 0).nonzero().reshape(-1)
    r, c = mask[:L8].view(-1, 8)[words].nonzero(as_tuple=True)
    head = words[r] * 8 + c
    if L8 == mask.numel():
        return head
    return torch.cat([head, mask[L8:].nonzero().reshape(-1) + L8])


def _hist_cpu(a, threshold, offs, th, finite, hist):
    """The fused_select histogram of |acc| (``a``), region by region, as the reference bins it:
    zeros and non-finite values are not counted."""
    P = len(offs) - 1
    bits = a.view(torch.int32)
    thr_bits = [(v & _ABS_MASK) for v in
                torch.tensor(th, dtype=torch.float32).view(torch.int32).tolist()]
    B, half = SELECT_HIST_BINS, SELECT_HIST_BINS // 2
    for j in range(P):
        lo, hi = offs[j], offs[j + 1]
        if hi <= lo:
            continue
        bj = bits[lo:hi]
        rel = bj - thr_bits[j]
        rel.bitwise_right_shift_(SELECT_HIST_SHIFT).add_(half).clamp_(0, B - 1)
        cnt = torch.bincount(rel, minlength=B)
        zeros = (hi - lo) - int(torch.count_nonzero(bj))
        cnt[min(max(((0 - thr_bits[j]) >> SELECT_HIST_SHIFT) + half, 0), B - 1)] -= zeros
        if not finite:                             # inf / NaN are not counted
            off = bj >= _INF_BITS
            if bool(off.any()):
                cnt -= torch.bincount(rel[off], minlength=B)
        hist[j].add_(cnt.to(hist.dtype))


# ----------------------------------------------------------------------------------------------
# public
# ----------------------------------------------------------------------------------------------
def empty_selection(P: int, capacity: int, device) -> Selection:
    return Selection(torch.zeros(P, capacity, dtype=torch.int32, device=device),
                     torch.zeros(P, capacity, dtype=torch.float32, device=device),
                     torch.zeros(P, dtype=torch.int32, device=device),
                     torch.zeros(P, dtype=torch.int32, device=device))


def fused_select(grad: Tensor, residual: Tensor, threshold: Tensor, region_offsets: Tensor,
                 capacity: int, *, skip: Optional[Tensor] = None, out: Optional[Selection] = None,
                 velocity: Optional[Tensor] = None, momentum: float = 0.0,
                 mask_velocity: bool = False, hist: Optional[Tensor] = None,
                 weight: Optional[Tensor] = None, weight_rate: Optional[float] = None,
                 backend: str = "auto") -> Selection:
    """Form ``acc = residual + grad`` (written back to ``residual``) and compact the entries with
    ``|acc| >= threshold and acc != 0`` into the fixed-capacity slot of their region.

    ``threshold``: a 0-dim fp32 tensor, or ``[P]`` (one per region: region j selects with
    ``threshold[j]``).

    See docs/CONTRACTS.md §1.  ``skip`` (0-dim int32): when nonzero nothing is written — the
    residual (and velocity) are untouched and counts and nonfinite are 0.

    ``velocity`` (fp32 [n], momentum correction): ``u := (u * momentum) + grad`` (two
    roundings) and ``acc = residual + u``; with ``mask_velocity`` u is also zeroed where acc is
    exactly 0 (the delivered entries are zeroed later, by :func:`clear_sent`).

    ``hist`` (int32 [P, SELECT_HIST_BINS], ADDED to): per region, the count of nonzero finite
    |acc| in bins relative to the region's threshold t: bin b >= 1 (b <= 62) holds the bit
    patterns in ``[bits(t) + (b - 32)·2^20, bits(t) + (b - 31)·2^20)``; bin 0 everything below,
    bin 63 everything above (see :func:`select_hist_edges`).

    ``weight`` (fp32 [n], e.g. :func:`sign_ema`'s EMA): the selection and the histogram use the
    score ``|acc|·|weight|`` instead of ``|acc|`` (an entry is taken when its score is nonzero
    and at or above the threshold); the staged values are still ``acc``. 4n more bytes.
    ``weight_rate`` (a number in [0, 1), with ``weight``): the weight is first updated in place
    to the EMA ``weight_rate·weight + (1 − weight_rate)·sign(grad)`` (not on a skipped step),
    and the score uses the new weight: :func:`sign_ema` fused into the pass, 4n more bytes.
    """
    n = _check_vectors(grad, residual, velocity)
    if weight is not None and (not isinstance(weight, Tensor) or weight.dtype != torch.float32
                               or weight.numel() != n or not weight.is_contiguous()
                               or weight.device != residual.device):
        raise ValueError(f"weight must be a contiguous fp32 tensor of {n} elements on "
                         f"{residual.device}, got {getattr(weight, 'dtype', type(weight).__name__)}"
                         f" {tuple(getattr(weight, 'shape', ()))}")
    if weight_rate is not None and (weight is None or isinstance(weight_rate, bool)
                                    or not isinstance(weight_rate, (int, float))
                                    or not 0 <= weight_rate < 1):
        raise ValueError(f"weight_rate must be a number in [0, 1) with a weight, got "
                         f"{weight_rate!r}{'' if weight is not None else ' without one'}")
    capacity = int(capacity)
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    if region_offsets.dtype != torch.int64:
        raise TypeError(f"region_offsets must be int64, got {region_offsets.dtype}")
    region_offsets = region_offsets.contiguous()
    P = region_offsets.numel() - 1
    if P < 1:
        raise ValueError("region_offsets needs P + 1 >= 2 entries")
    out = _check_out(out, P, capacity, residual.device)
    if hist is not None:
        if tuple(hist.shape) != (P, SELECT_HIST_BINS) or hist.dtype != torch.int32 \
                or not hist.is_contiguous():
            raise ValueError(f"hist must be a contiguous int32 [{P}, {SELECT_HIST_BINS}] tensor")
    threshold = _check_threshold(threshold, P, residual.device)
    gbytes = grad.element_size() * n
    vbytes = ((8 * n if velocity is not None else 0) + (4 * n if weight is not None else 0)
              + (4 * n if weight_rate is not None else 0))
    # the torch side: the CPU fast path, or the reference counted as the one pass it stands for
    fast = (_dispatch.choose(backend, residual.device) == "torch"
            and residual.device.type == "cpu" and not REFERENCE)
    if fast:
        _dispatch.record(launches=1, bytes=_cpu_select_bytes(n, gbytes, vbytes, hist is not None))
    else:
        _dispatch.record(launches=3, bytes=gbytes + 8 * n + vbytes)
    return _dispatch.run(backend, residual.device, _fused_select_triton,
                         _fused_select_cpu if fast else _fused_select_torch, grad, residual,
                         threshold, region_offsets, capacity, skip, out, velocity, momentum,
                         mask_velocity, hist, weight, weight_rate)


def _check_vectors(grad: Tensor, residual: Tensor, velocity: Optional[Tensor]) -> int:
    """n, after checking the n-sized inputs of :func:`fused_select` (dtypes, sizes, layout)."""
    n = residual.numel()
    if grad.numel() != n:
        raise ValueError(f"grad has {grad.numel()} elements, residual {n}")
    if residual.dtype != torch.float32:
        raise TypeError(f"residual must be fp32, got {residual.dtype}")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"grad must be fp32/bf16/fp16, got {grad.dtype}")
    if not (residual.is_contiguous() and grad.is_contiguous()):
        raise ValueError("grad and residual must be contiguous")
    if velocity is not None:
        if velocity.dtype != torch.float32 or velocity.numel() != n or not velocity.is_contiguous():
            raise ValueError(f"velocity must be a contiguous fp32 tensor of {n} elements")
    return n


def _check_out(out: Optional[Selection], P: int, capacity: int, device) -> Selection:
    """``out``, or a new empty selection of P rows of ``capacity``, after checking its shapes."""
    if out is None:
        out = empty_selection(P, capacity, device)
    else:
        if tuple(out.indices.shape) != (P, capacity) or tuple(out.values.shape) != (P, capacity):
            raise ValueError(f"out.indices/values must be [{P}, {capacity}]")
        if out.indices.dtype != torch.int32 or out.values.dtype != torch.float32:
            raise TypeError("out.indices must be int32 and out.values fp32")
        if (capacity > 1 and (out.indices.stride(1) != 1 or out.values.stride(1) != 1)):
            raise ValueError("out.indices/values need inner stride 1")
    return out


def _check_threshold(threshold: Tensor, P: int, device) -> Tensor:
    """The threshold as fp32: 0-dim, or [P] (one per region)."""
    if not isinstance(threshold, Tensor):
        raise TypeError(f"threshold must be a tensor (0-dim, or [P] per region), got "
                        f"{type(threshold).__name__}")
    if threshold.dim() == 1 and threshold.numel() == P and P > 1:
        threshold = threshold.to(torch.float32).contiguous()    # one per region
    elif threshold.numel() == 1:
        threshold = threshold.reshape(()).to(torch.float32)
    else:
        raise ValueError(f"threshold must be 0-dim or [P] = [{P}] (one per region), got shape "
                         f"{tuple(threshold.shape)}")
    if threshold.device != device:
        raise ValueError(f"threshold is on {threshold.device}, expected {device}")
    return threshold


def select_hist_edges(threshold: Tensor) -> Tensor:
    """fp32 [..., SELECT_HIST_BINS + 1]: the lower edges of the fused_select histogram bins for
    each threshold (edge 0 = 0, edge 64 = +inf), as fp32 values; ``count(|acc| >= edge[b])`` is
    the sum of bins b.. of the histogram."""
    tb = (threshold.to(torch.float32).contiguous().view(torch.int32) & _ABS_MASK).to(torch.int64)
    b = torch.arange(SELECT_HIST_BINS + 1, device=threshold.device, dtype=torch.int64)
    e = tb.unsqueeze(-1) + ((b - SELECT_HIST_BINS // 2) << SELECT_HIST_SHIFT)
    e = e.clamp(0, _INF_BITS)
    e[..., 0] = 0
    e[..., -1] = _INF_BITS
    return e.to(torch.int32).view(torch.float32)
