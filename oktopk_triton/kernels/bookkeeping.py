"""step_bookkeeping: Ok-Topk's state for the next step in ONE launch (thresholds, regions, stats).

What it computes (the torch reference, :func:`_bookkeeping_torch`, is the specification):

* rows (rank mode): ``cap[j]`` = the |acc| at which row j's 64-bin histogram (bins around
  ``th[j]``, ``SELECT_HIST_SHIFT`` bits of the fp32 pattern wide) holds ``fill`` entries at or
  above, interpolated linearly in bit space inside the bin (:func:`threshold_at`);
  (region mode) each row's target is steered by its staged count, ``th[j]`` moves to it;
* ``th_global`` = ``gmin`` (the smallest |value| of the global set), kept when the set is empty;
* ``region_offsets``: boundaries with about 1/P of the global count per region (each entry of
  region j weighing ``max(gcount[j], v[j]) / v[j]``), unchanged on an empty or non-finite step;
  with ``span`` > 0 no region is wider than ``span`` elements (:func:`capped_offsets`: the
  packed wires size a row's chunk words by it, so a static message need not cover all of n);
* stats (int64 [7]): local_selected, sent, reduce_overflow, global_selected, global_count,
  gather_overflow, overflow.

Every rank computes ``region_offsets`` from the same gathered bits with the same program, so
the regions stay identical on every rank (fp64 for the weights, exact for integer counts).

Measured why: docs/research/design-notes.md, ``oktopk_triton/kernels/bookkeeping.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON, next_pow2
from .selection import SELECT_HIST_BINS, SELECT_HIST_SHIFT

if HAS_TRITON:
    import triton
    import triton.language as tl

TRITON_MAX_P = 128     # the program holds [P, P] tiles for the region search
STATS = ("local_selected", "sent", "reduce_overflow", "global_selected", "global_count",
         "gather_overflow", "overflow")
_MAX_BITS = 0x7F7FFFFF


def num_warps(P: int) -> int:
    """The launch's warps: 4 up to P = 32, above that one warp per 8 rows of the [P, P] tiles
    (8 at P = 64, 16 at P = 128). ptxas for sm_90 (``python -m oktopk_triton.kernels.
    _compile_check --resources``; registers per thread / bytes spilled, not measured on a GPU):

    ====  ==============  ==============  ==============
    P     4 warps         8 warps         16 warps
    ====  ==============  ==============  ==============
    32    72-80 / 0       58-64 / 0       52-63 / 0
    64    162-168 / 0     118-128 / 0     64-90 / 0-4
    128   255 / 2768-2892 255 / 220-224   128 / 100-124
    ====  ==============  ==============  ==============

    The warps change no result: every float reduction of the kernel is exact (integer counts in
    fp32/fp64, or one nonzero term), so any order of its partial sums gives the same bits."""
    return max(4, next_pow2(P) // 8)


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _max_combine(a, b):
        return tl.maximum(a, b)

    @triton.jit
    def _min_combine(a, b):
        return tl.minimum(a, b)

    @triton.jit
    def _threshold_rows(h, th, target, rm, B: tl.constexpr, SHIFT: tl.constexpr):
        """Per row of the int32 histogram tile ``h`` [BP, B]: the threshold_at value."""
        cols = tl.arange(0, B)
        suf = tl.cumsum(h, axis=1, reverse=True).to(tl.float32)              # >= bin b
        ge = (suf >= target[:, None]) & rm[:, None]
        b = tl.minimum(tl.maximum(tl.sum(ge.to(tl.int32), axis=1) - 1, 0), B - 1)
        s_b = tl.sum(tl.where(cols[None, :] == b[:, None], suf, 0.0), axis=1)
        s_next = tl.sum(tl.where(cols[None, :] == b[:, None] + 1, suf, 0.0), axis=1)
        frac = tl.math.div_rn(s_b - target, tl.maximum(s_b - s_next, 1.0))
        frac = tl.minimum(tl.maximum(frac, 0.0), 1.0)
        tb = (th.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.int64)
        lo = tb + ((b - B // 2).to(tl.int64) << SHIFT)
        lo = tl.where(b == 0, tb - ((B // 2 + 32) << SHIFT), lo)            # open bottom bin
        width = tl.where(b == 0, 32 << SHIFT, 1 << SHIFT).to(tl.float32)
        bits = lo + (frac * width).to(tl.int64)
        bits = tl.minimum(tl.maximum(bits, 1), 0x7F7FFFFF)
        new = bits.to(tl.int32).to(tl.float32, bitcast=True)
        return tl.where(tl.sum(h, axis=1) > 0, new, th)

    @triton.jit
    def _bookkeeping_kernel(
        hist_ptr,      # *int32 [P, B]      select pass histograms (bins around th)
        th_ptr,        # *fp32 [P]          the thresholds the histograms were binned around
        cap_ptr,       # *fp32 [P]          out (rank mode): the fill thresholds
        target_ptr,    # *fp32 [P]          region mode: the rows' targets (updated)
        stage_ptr,     # *int32 [P]         staged counts (true)
        sent_ptr, sent_stride,          # *int32 [P] (strided): counts sent
        gath_ptr, gath_stride,          # *int32 [P, >=2]: gathered slot headers (count, gcount)
        icnt_ptr,      # *int32 [P]         entries of the global set per region
        iidx_ptr, iidx_stride,          # *int32 [P, cg]: their region-relative indices (asc.)
        offs_ptr,      # *int64 [P+1]       region boundaries (updated)
        thg_ptr,       # *fp32 []           global threshold (updated)
        gmin_ptr,      # *fp32 []           smallest |value| of the global set (inf: none)
        nf_ptr,        # *int32 []          non-finite flag (if HAS_NF)
        stats_ptr,     # *int64 [7]         out
        P, n, cg, cap_s, fill, mid,
        span,          # int64: the widest region allowed (if CAP_SPAN; P·span >= n)
        BP: tl.constexpr, B: tl.constexpr, SHIFT: tl.constexpr, REGION: tl.constexpr,
        UPDATE_TH: tl.constexpr, HAS_NF: tl.constexpr, BALANCE: tl.constexpr,
        ZERO_HIST: tl.constexpr, CAP_SPAN: tl.constexpr,
    ):
        rows = tl.arange(0, BP)
        rm = rows < P
        cols = tl.arange(0, B)
        h = tl.load(hist_ptr + rows[:, None] * B + cols[None, :], mask=rm[:, None], other=0)
        th = tl.load(th_ptr + rows, mask=rm, other=1.0)
        stage = tl.load(stage_ptr + rows, mask=rm, other=0)
        nf = tl.load(nf_ptr) if HAS_NF else 0
        # next rows
        if REGION:
            rt = tl.load(target_ptr + rows, mask=rm, other=1.0)
            staged = tl.maximum(stage.to(tl.float32), 1.0)
            midv = (tl.zeros((BP,), dtype=tl.float32) + mid).to(tl.float32)   # fp32, as torch
            ratio = tl.minimum(tl.maximum(tl.sqrt_rn(tl.math.div_rn(midv, staged)), 0.25), 4.0)
            # * 2^-6 rounds as / 64 does; Triton compiles "/ 64.0" to div.approx.f32
            target = tl.minimum(tl.maximum(rt * ratio, midv * 0.015625), 4.0 * midv)
        else:
            target = (tl.zeros((BP,), dtype=tl.float32) + fill).to(tl.float32)
        new = _threshold_rows(h, th, target, rm, B, SHIFT)
        # the global set: global threshold, stats, balanced regions
        icnt = tl.load(icnt_ptr + rows, mask=rm, other=0).to(tl.int64)
        gcnt = tl.load(gath_ptr + rows * gath_stride + 1, mask=rm, other=0).to(tl.int64)
        gfull = tl.load(gath_ptr + rows * gath_stride, mask=rm, other=0).to(tl.int64)
        sent = tl.load(sent_ptr + rows * sent_stride, mask=rm, other=0).to(tl.int64)
        s64 = stage.to(tl.int64)
        delivered = tl.sum(icnt, axis=0)
        empty = (delivered == 0) | (nf > 0)
        gmin = tl.load(gmin_ptr)
        thg = tl.load(thg_ptr)
        thg_new = tl.where((gmin == float("inf")) | (nf > 0), thg, gmin)
        if BALANCE:
            q = rows                                     # lane q: boundary q + 1
            v = tl.minimum(tl.maximum(icnt, 0), cg)
            c = tl.where(v > 0, tl.maximum(gcnt, v), 0).to(tl.float64)
            incl = tl.cumsum(c, axis=0)
            T = tl.sum(c, axis=0)
            excl = incl - c
            tgt = ((q + 1).to(tl.float64) * T) / P
            le = (incl[None, :] <= tgt[:, None]) & rm[None, :]
            j = tl.minimum(tl.sum(le.to(tl.int32), axis=1), P - 1)
            at_j = rows[None, :] == j[:, None]
            excl_j = tl.sum(tl.where(at_j, excl[None, :], 0.0), axis=1)
            c_j = tl.sum(tl.where(at_j, c[None, :], 0.0), axis=1)
            v_j = tl.sum(tl.where(at_j, v[None, :], 0), axis=1)
            frac = (tgt - excl_j) / tl.maximum(c_j, 1.0)
            frac = tl.minimum(tl.maximum(frac, 0.0), 1.0)
            col = (frac * v_j.to(tl.float64)).to(tl.int64)           # >= 0: floor
            col = tl.minimum(col, tl.maximum(v_j - 1, 0))
            col = tl.minimum(tl.maximum(col, 0), cg - 1)
            qm = q < P - 1
            idx = tl.load(iidx_ptr + j.to(tl.int64) * iidx_stride + col, mask=qm, other=0)
            idx = tl.maximum(idx.to(tl.int64), 0)
            bnd = tl.load(offs_ptr + j, mask=qm, other=0) + idx
            bnd = tl.minimum(tl.maximum(bnd, 0), n)
            bnd = tl.associative_scan(bnd, 0, _max_combine)      # monotone even if T is tiny
            if CAP_SPAN:    # capped_offsets: no region wider than span
                qs = (q + 1).to(tl.int64) * span
                bnd = tl.associative_scan(bnd - qs, 0, _min_combine) + qs
                bnd = tl.maximum(tl.minimum(bnd, qs), n - (P - 1 - q).to(tl.int64) * span)
            old = tl.load(offs_ptr + 1 + q, mask=qm, other=0)
        tl.debug_barrier()      # every load above happens before the stores below
        if REGION:
            if UPDATE_TH:
                tl.store(th_ptr + rows, tl.where(nf > 0, th, new), mask=rm)
            tl.store(target_ptr + rows, tl.where(nf > 0, rt, target), mask=rm)
        else:
            tl.store(cap_ptr + rows, new, mask=rm)
        tl.store(thg_ptr, thg_new)
        if ZERO_HIST:       # ready for the next select pass, which adds to them
            tl.store(hist_ptr + rows[:, None] * B + cols[None, :], tl.zeros_like(h),
                     mask=rm[:, None])
        if BALANCE:
            tl.store(offs_ptr + 1 + q, tl.where(empty, old, bnd), mask=qm)
        local = tl.sum(s64, axis=0)
        sent_t = tl.sum(sent, axis=0)
        tl.store(stats_ptr + 0, local)
        tl.store(stats_ptr + 1, sent_t)
        tl.store(stats_ptr + 2, tl.sum(tl.maximum(s64 - cap_s, 0), axis=0))
        tl.store(stats_ptr + 3, delivered)
        tl.store(stats_ptr + 4, tl.sum(gcnt, axis=0))
        tl.store(stats_ptr + 5, tl.maximum(tl.sum(gfull, axis=0) - delivered, 0))
        tl.store(stats_ptr + 6, local - sent_t)

    @_dispatch.serialized_when_interpreted
    def _bookkeeping_triton(hist, th, cap, target, stage, sent, gathered, icnt, iidx, offs, thg,
                            gmin, nf, stats, n, cg, cap_s, fill, mid, region, update_th,
                            zero_hist, span):
        P = hist.shape[0]
        _bookkeeping_kernel[(1,)](
            hist, th, cap if cap is not None else th, target if target is not None else th,
            stage, sent, sent.stride(0), gathered, gathered.stride(0), icnt, iidx,
            iidx.stride(0), offs, thg, gmin, nf if nf is not None else stats, stats,
            P, n, cg, cap_s, float(fill), float(mid), span if 0 < span < n else n,
            BP=max(2, next_pow2(P)), B=SELECT_HIST_BINS, SHIFT=SELECT_HIST_SHIFT,
            REGION=region, UPDATE_TH=update_th, HAS_NF=nf is not None, BALANCE=P > 1,
            ZERO_HIST=zero_hist, CAP_SPAN=0 < span < n, num_warps=num_warps(P))


# ----------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------
def threshold_at(hist: Tensor, th: Tensor, target: Tensor) -> Tensor:
    """Per row: the |acc| at which the row's histogram holds ``target`` entries at or above,
    interpolated linearly in fp32 bit space inside the bin (bit space is piecewise log).
    A row whose histogram is empty keeps its threshold; one with fewer entries than the
    target gets the lowest edge (4 binades below the bins). Counts are summed exactly (int64)."""
    B = SELECT_HIST_BINS
    h = hist.to(torch.int64)
    suffix = torch.flip(torch.cumsum(torch.flip(h, (1,)), 1), (1,))      # [P, B]: >= bin b
    suffix = torch.cat([suffix, torch.zeros_like(suffix[:, :1])], 1).to(torch.float32)
    t = target.reshape(-1, 1)
    b = ((suffix[:, :B] >= t).sum(1) - 1).clamp(0, B - 1)                # last bin >= target
    s_b = suffix.gather(1, b.reshape(-1, 1)).reshape(-1)
    s_next = suffix.gather(1, (b + 1).reshape(-1, 1)).reshape(-1)
    frac = ((s_b - target) / (s_b - s_next).clamp(min=1.0)).clamp(0.0, 1.0)
    tb = (th.contiguous().view(torch.int32) & 0x7FFFFFFF).to(torch.int64)
    shift = SELECT_HIST_SHIFT
    lo = tb + ((b - B // 2) << shift)
    lo = torch.where(b == 0, tb - ((B // 2 + 32) << shift), lo)          # open bottom bin
    width = torch.where(b == 0, torch.full_like(lo, 32 << shift),
                        torch.full_like(lo, 1 << shift))
    bits = (lo + (frac * width.to(torch.float32)).to(torch.int64)).clamp(1, _MAX_BITS)
    new = bits.to(torch.int32).view(torch.float32)
    return torch.where(h.sum(1) > 0, new, th)


def balanced_offsets(offs: Tensor, icnt: Tensor, gcnt: Tensor, iidx: Tensor, n: int,
                     cg: int, span: int = 0) -> Tensor:
    """Boundaries [P+1] with about 1/P of the global count per region (on the device).

    Region j holds ``icnt[j]`` entries of the global set but ``gcnt[j]`` of its sums reached the
    previous global threshold (more when its slot was full: the owner kept the largest). Each
    entry of region j stands for ``gcnt[j] / icnt[j]`` of them, so an overfull region is not
    mistaken for a balanced one. ``span`` > 0: then :func:`capped_offsets`."""
    P, dev = offs.numel() - 1, offs.device
    v = icnt.to(torch.int64).clamp(0, cg)
    c = torch.maximum(gcnt.to(torch.int64), v)
    c = torch.where(v > 0, c, torch.zeros_like(c)).to(torch.float64)   # regions with entries
    incl = torch.cumsum(c, 0)
    excl = incl - c
    T = incl[-1]
    q = torch.arange(1, P, device=dev, dtype=torch.float64)
    target = q * T / P                                       # weight where region q starts
    j = torch.searchsorted(incl, target, right=True).clamp(max=P - 1)
    frac = ((target - excl[j]) / c[j].clamp(min=1.0)).clamp(0.0, 1.0)
    col = (frac * v[j].to(torch.float64)).floor().to(torch.int64)
    col = torch.minimum(col, (v[j] - 1).clamp(min=0)).clamp(0, cg - 1)
    idx = iidx.to(torch.int64)[j, col].clamp(min=0)
    b = (offs[j] + idx).clamp(0, n)
    b = torch.cummax(b, 0).values                           # monotone even if T is tiny
    if 0 < span < n:
        b = _capped(b, n, span)
    return torch.cat([b.new_zeros(1), b, b.new_full((1,), n)])


def _capped(b: Tensor, n: int, span: int) -> Tensor:
    """Inner boundaries ``b`` [P−1] (monotone) moved as little as the cap needs: from the left,
    each at most ``span`` past the one before (a prefix minimum of ``b[q] − q·span``); then at
    least ``n − (P−q)·span``, so the regions to its right can still reach n."""
    P = b.numel() + 1
    q = torch.arange(1, P, device=b.device, dtype=torch.int64)
    b = torch.cummin(b - q * span, 0).values + q * span
    return torch.maximum(torch.minimum(b, q * span), n - (P - q) * span)


def capped_offsets(offs: Tensor, span: int) -> Tensor:
    """Boundaries [P+1] (monotone, 0 to n) with no region wider than ``span`` (``P·span >= n``):
    regions already within it are unchanged; a wider one gives its excess to its neighbours.
    Each gap is at most ``span``: a gap of the prefix minimum is at most ``span`` by
    construction, and the lower bound rises by exactly ``span`` a boundary."""
    P, n = offs.numel() - 1, int(offs[-1])
    if P * span < n:
        raise ValueError(f"capped_offsets: {P} regions of at most {span} cannot cover n = {n}")
    if P == 1 or span >= n:
        return offs.clone()
    inner = _capped(offs[1:-1].to(torch.int64), n, span)
    return torch.cat([offs[:1], inner.to(offs.dtype), offs[-1:]])


def _bookkeeping_torch(hist, th, cap, target, stage, sent, gathered, icnt, iidx, offs, thg,
                       gmin, nf, stats, n, cg, cap_s, fill, mid, region, update_th, zero_hist,
                       span):
    P = hist.shape[0]
    bad = (nf > 0) if nf is not None else torch.zeros((), dtype=torch.bool, device=th.device)
    if region:
        ratio = (mid / stage.to(torch.float32).clamp(min=1.0)).sqrt().clamp(0.25, 4.0)
        tgt = (target * ratio).clamp(mid / 64.0, 4.0 * mid)
        new = threshold_at(hist, th, tgt)
        if update_th:
            th.copy_(torch.where(bad, th, new))
        target.copy_(torch.where(bad, target, tgt))
    else:
        cap.copy_(threshold_at(hist, th, torch.full_like(th, fill)))
    delivered = icnt.to(torch.int64).sum()
    empty = (delivered == 0) | bad
    thg.copy_(torch.where(torch.isinf(gmin) | bad, thg, gmin))
    if P > 1:
        new_offs = balanced_offsets(offs, icnt, gathered[:, 1], iidx, n, cg, span)
        offs.copy_(torch.where(empty, offs, new_offs))
    s64 = stage.to(torch.int64)
    local, sent_t = s64.sum(), sent.to(torch.int64).sum()
    stats.copy_(torch.stack([
        local, sent_t, (s64 - cap_s).clamp(min=0).sum(), delivered,
        gathered[:, 1].to(torch.int64).sum(),
        (gathered[:, 0].to(torch.int64).sum() - delivered).clamp(min=0), local - sent_t]))
    if zero_hist:
        hist.zero_()


def step_bookkeeping(hist: Tensor, th: Tensor, stage_counts: Tensor, sent_counts: Tensor,
                     gathered: Tensor, icnt: Tensor, iidx: Tensor, region_offsets: Tensor,
                     th_global: Tensor, gmin: Tensor, nonfinite: Optional[Tensor], *, n: int,
                     cap_s: int, cap: Optional[Tensor] = None, fill: float = 0.0,
                     row_target: Optional[Tensor] = None, mid: float = 0.0,
                     update_th: bool = True, zero_hist: bool = False, span: int = 0,
                     backend: str = "auto") -> Tensor:
    """Ok-Topk's next-step state in one launch; returns the stats (int64 [7], :data:`STATS`).

    Rank mode (``cap`` given): ``cap[j]`` becomes the |acc| at which row j's histogram holds
    ``fill`` entries at or above. Region mode (``row_target`` given): each row's target is
    steered towards ``mid`` staged entries (``target·sqrt(mid/staged)``, clamped) and, with
    ``update_th``, ``th`` moves to it; both kept on a non-finite step. Always: ``th_global``
    becomes ``gmin`` (kept when it is inf or the step is non-finite); ``region_offsets``
    (P > 1) are re-balanced from the global set (``icnt`` entries per region at ``iidx``,
    ascending, and the gathered headers ``gathered[:, :2]`` = (count, count at the last global
    threshold)), kept on an empty or non-finite step, none wider than ``span`` when it is
    positive (``P·span >= n``). ``zero_hist``: ``hist`` is zeroed after it
    is read (the next select pass adds to it). In place, no host read."""
    P = hist.shape[0]
    region = row_target is not None
    if region == (cap is not None):
        raise ValueError("step_bookkeeping: pass exactly one of cap (rank mode) and row_target "
                         "(region mode)")
    if hist.shape != (P, SELECT_HIST_BINS) or hist.dtype != torch.int32:
        raise ValueError(f"hist must be int32 [P, {SELECT_HIST_BINS}], got {hist.dtype} "
                         f"{tuple(hist.shape)}")
    stats = torch.empty(len(STATS), dtype=torch.int64, device=hist.device)
    if span and P * int(span) < n:
        raise ValueError(f"step_bookkeeping: span={span} leaves {P} regions short of n = {n}")
    nf = None if nonfinite is None else nonfinite.reshape(())
    args = (hist, th, cap, row_target, stage_counts, sent_counts, gathered, icnt, iidx,
            region_offsets, th_global.reshape(()), gmin.reshape(()), nf, stats, int(n),
            iidx.shape[1], int(cap_s), float(fill), float(mid), region, bool(update_th),
            bool(zero_hist), int(span))
    _dispatch.record(launches=1, bytes=4 * hist.numel() + 8 * P * 8)
    _dispatch.run(backend, hist.device, _bookkeeping_triton, _bookkeeping_torch, *args,
                  fits=P <= TRITON_MAX_P)
    return stats
