"""Histogram thresholds: the k-th largest |x| without a sort and without a host read.

Why it is shaped so: |x| as an fp32 bit pattern is monotone in its value, so binning by the top
bits is an order-preserving bucketing.  Level 0 bins the 11 bits below the sign (8 exponent + 3
mantissa bits); level 1 bins the next 11 bits of the elements of one level-0 bin.  Two passes
over x give the k-th largest to 2^-14 relative resolution.  Counts are int64 so histograms of
several ranks can be summed with one small allreduce.  Each Triton program loops over several
blocks, accumulates its histogram in registers with ``tl.histogram(..., mask=)`` (the mask
matters: without it masked-out lanes are counted) and adds it to the output with one vector
atomic_add.

Now only the fallback of :func:`magnitude_threshold` (when its sampled window misses) and the
threshold of the simpler algorithms: on an H100 this threshold took 38 ms at n = 2^28 against
5.93 ms for ``torch.topk`` (a 2048-bin ``tl.histogram`` pass alone 9.1 ms, a 256-bin one 0.81 ms),
and Ok-Topk launched it 13 times per step (70 ms at 2^26, docs/research/gpu-measurements.md).
``skip`` (a device flag) lets the fallback be launched always and do nothing, so no host read
decides it.
"""
from __future__ import annotations

from typing import Optional, Tuple, Union

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

BITS_PER_LEVEL = 11
HIST_BINS = 1 << BITS_PER_LEVEL        # bins of one histogram level (2048)
LEVEL0_SHIFT = 31 - BITS_PER_LEVEL     # 20: bits 30..20 of |x|
LEVEL1_SHIFT = LEVEL0_SHIFT - BITS_PER_LEVEL   # 9: bits 19..9
_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000

IntOrTensor = Union[int, Tensor, None]


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _abs_histogram_kernel(
        x_ptr,          # *fp32|bf16|fp16 [n]  values (read as fp32)
        hist_ptr,       # *int64 [HIST_BINS]  out: counts are ADDED here (zeroed by the launcher)
        prefix_ptr,     # *int64 []           level-0 bin to refine (if LEVEL == 1)
        start_ptr,      # *int64 []           first index (if START_IS_PTR)
        end_ptr,        # *int64 []           one past the last index (if END_IS_PTR)
        skip_ptr,       # *int32 []           when nonzero count nothing (if HAS_SKIP)
        start_int, end_int,                  # the same as Python ints otherwise
        blocks_per_program,                  # runtime loop count: the grid stays ~MAX_PROGRAMS
        HAS_SKIP: tl.constexpr,
        LEVEL: tl.constexpr,
        START_IS_PTR: tl.constexpr, END_IS_PTR: tl.constexpr,
        HIST_BINS: tl.constexpr, SHIFT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        if START_IS_PTR:
            start = tl.load(start_ptr).to(tl.int64)
        else:
            start = start_int          # specialised like n (divisibility -> vector loads)
        if END_IS_PTR:
            end = tl.load(end_ptr).to(tl.int64)
        else:
            end = end_int
        prefix = 0
        if LEVEL == 1:
            prefix = tl.load(prefix_ptr).to(tl.int32)
        hist = tl.zeros((HIST_BINS,), dtype=tl.int32)
        base = start + pid * blocks_per_program * BLOCK
        n_blocks = blocks_per_program
        if HAS_SKIP:
            n_blocks = tl.where(tl.load(skip_ptr) != 0, 0, blocks_per_program)
        for b in range(0, n_blocks):
            offs = base + b * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
            in_range = offs < end
            x = tl.load(x_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
            bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            valid = in_range & (bits != 0) & (bits < 0x7F800000)
            if LEVEL == 1:
                valid = valid & ((bits >> (SHIFT + 11)) == prefix)
            bins = (bits >> SHIFT) & (HIST_BINS - 1)
            hist += tl.histogram(bins, HIST_BINS, mask=valid)
        # one vector atomic per program (empty bins skipped)
        tl.atomic_add(hist_ptr + tl.arange(0, HIST_BINS), hist.to(tl.int64), mask=hist != 0,
                      sem="relaxed")

    MAX_PROGRAMS = 1024   # programs of a histogram launch: ~8 per SM on H100/H200

    @_dispatch.serialized_when_interpreted
    def _abs_histogram_triton(x, prefix, start, end, out, skip=None, block=1024):
        n = x.numel()
        start_is_ptr = isinstance(start, Tensor)
        end_is_ptr = isinstance(end, Tensor)
        s_int = 0 if start_is_ptr or start is None else int(start)
        e_int = n if end_is_ptr or end is None else int(end)
        # static bound on the range length: the grid
        s_known = 0 if start_is_ptr else s_int
        span = n - s_known if end_is_ptr else e_int - s_known
        span = max(min(span, n), 0)
        out.zero_()
        if span == 0:
            return out
        max_programs = MAX_PROGRAMS
        if _dispatch.INTERPRET:
            # the interpreter pays per program, not per element: fewer, bigger programs
            block, max_programs = 4096, 64
        blocks = triton.cdiv(span, block)
        blocks_per_program = triton.cdiv(blocks, min(blocks, max_programs))
        grid = (triton.cdiv(blocks, blocks_per_program),)
        dummy = out
        _abs_histogram_kernel[grid](
            x, out,
            prefix if prefix is not None else dummy,
            start if start_is_ptr else dummy, end if end_is_ptr else dummy,
            skip if skip is not None else dummy,
            s_int, e_int, blocks_per_program,
            HAS_SKIP=skip is not None,
            LEVEL=0 if prefix is None else 1,
            START_IS_PTR=start_is_ptr, END_IS_PTR=end_is_ptr,
            HIST_BINS=HIST_BINS, SHIFT=LEVEL0_SHIFT if prefix is None else LEVEL1_SHIFT,
            BLOCK=block, num_warps=8,
        )
        return out


# ----------------------------------------------------------------------------------------------
# torch reference
# ----------------------------------------------------------------------------------------------
def _range_mask(n: int, start: IntOrTensor, end: IntOrTensor, device) -> Tensor:
    pos = torch.arange(n, device=device, dtype=torch.int64)
    s = _dispatch.as_index_tensor(start, 0, device)
    e = _dispatch.as_index_tensor(end, n, device)
    return (pos >= s) & (pos < e)


def _abs_histogram_torch(x, prefix, start, end, out, skip=None):
    n = x.numel()
    bits = x.reshape(-1).to(torch.float32).view(torch.int32) & _ABS_MASK
    valid = (bits != 0) & (bits < _INF_BITS)
    if skip is not None:
        valid &= skip.reshape(()) == 0
    if start is not None or end is not None:
        valid &= _range_mask(n, start, end, x.device)
    if prefix is None:
        bins = bits >> LEVEL0_SHIFT
    else:
        valid &= (bits >> LEVEL0_SHIFT).to(torch.int64) == prefix.reshape(()).to(torch.int64)
        bins = (bits >> LEVEL1_SHIFT) & (HIST_BINS - 1)
    if x.device.type == "cpu":      # bincount is fast on CPU (on CUDA it reads the max)
        dumped = torch.where(valid, bins, torch.full_like(bins, HIST_BINS))
        out.copy_(torch.bincount(dumped, minlength=HIST_BINS + 1)[:HIST_BINS])
        return out
    out.zero_()
    out.scatter_add_(0, bins.to(torch.int64), valid.to(torch.int64))
    return out


# ----------------------------------------------------------------------------------------------
# public
# ----------------------------------------------------------------------------------------------
def abs_histogram(x: Tensor, *, prefix: Optional[Tensor] = None, start: IntOrTensor = None,
                  end: IntOrTensor = None, out: Optional[Tensor] = None,
                  skip: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """int64 [HIST_BINS] histogram of |x| (nonzero, finite) over fp32 bit-pattern bins.

    Level 0 (``prefix`` None) bins by bits 30..20 of |x|; level 1 bins the elements of level-0
    bin ``prefix`` (0-dim int64 tensor) by bits 19..9.  ``start``/``end`` restrict to
    ``x[start:end]`` (ints or 0-dim int64 tensors).  ``out`` is overwritten.  ``skip`` (0-dim
    int32 device tensor): when nonzero the histogram is all zeros and (Triton) no element is read.
    """
    if x.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"x must be fp32/bf16/fp16, got {x.dtype}")
    x = x.reshape(-1)
    if not x.is_contiguous():
        x = x.contiguous()
    if out is None:
        out = torch.zeros(HIST_BINS, dtype=torch.int64, device=x.device)
    elif out.shape != (HIST_BINS,) or out.dtype != torch.int64:
        raise ValueError(f"out must be int64 [{HIST_BINS}]")
    if prefix is not None:
        prefix = prefix.reshape(()).to(torch.int64)
    if isinstance(start, Tensor):
        start = start.reshape(()).to(torch.int64)
    if isinstance(end, Tensor):
        end = end.reshape(()).to(torch.int64)
    if skip is not None:
        skip = skip.reshape(()).to(torch.int32)
    _dispatch.record(launches=2, bytes=x.element_size() * x.numel())
    return _dispatch.run(backend, x.device, _abs_histogram_triton, _abs_histogram_torch, x,
                         prefix, start, end, out, skip)


def kth_bin(hist: Tensor, k) -> Tuple[Tensor, Tensor]:
    """The highest bin ``b`` with ``sum(hist[b:]) >= k`` and ``above = sum(hist[b+1:])``.

    ``b = 0`` when the total is below ``k``.  ``k``: int or 0-dim tensor.  Both results are
    0-dim int64 tensors on ``hist``'s device; no host read.
    """
    hist = hist.reshape(-1).to(torch.int64)
    suffix = torch.flip(torch.cumsum(torch.flip(hist, (0,)), 0), (0,))   # sum(hist[b:])
    k_t = (k.reshape(()).to(device=hist.device, dtype=torch.int64) if isinstance(k, Tensor)
           else int(k))
    b = ((suffix >= k_t).to(torch.int64).sum() - 1).clamp_(min=0)
    suffix_ext = torch.cat([suffix, suffix.new_zeros(1)])
    above = suffix_ext.gather(0, (b + 1).reshape(1)).reshape(())
    return b, above


def bin_threshold(bin0: Tensor, bin1: Optional[Tensor] = None) -> Tensor:
    """fp32 0-dim: the lower edge of level-0 bin ``bin0`` (refined by level-1 ``bin1``)."""
    bits = bin0.reshape(()).to(torch.int64) << LEVEL0_SHIFT
    if bin1 is not None:
        bits = bits | (bin1.reshape(()).to(torch.int64) << LEVEL1_SHIFT)
    return bits.to(torch.int32).view(torch.float32).reshape(())


def histogram_threshold(x: Tensor, k, *, start: IntOrTensor = None, end: IntOrTensor = None,
                        skip: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """fp32 0-dim threshold t with ``count(|x| >= t, x != 0)`` close to ``k``.

    Level 0 -> kth_bin -> level 1 in that bin -> kth_bin(k - above) -> bin_threshold.  t is the
    lower edge of the final bin, so the count is >= k whenever x holds >= k nonzero finite
    entries, and exceeds k by less than the population of that final bin (relative width
    2^-14; tested in tests/test_kernel_histogram.py).  With fewer than k nonzero finite entries
    t = 0, which selects every nonzero.
    """
    h0 = abs_histogram(x, start=start, end=end, skip=skip, backend=backend)
    b0, above0 = kth_bin(h0, k)
    h1 = abs_histogram(x, prefix=b0, start=start, end=end, skip=skip, backend=backend)
    k1 = (k - above0) if isinstance(k, Tensor) else (int(k) - above0)
    b1, _ = kth_bin(h1, k1)
    return bin_threshold(b0, b1)


def exact_threshold(x: Tensor, k) -> Tensor:
    """fp32 0-dim: the k-th largest |x| through torch.topk (0 when k <= 0; the smallest |x|
    when k >= numel)."""
    a = x.reshape(-1).to(torch.float32).abs()
    k = int(k)
    if k <= 0 or a.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=x.device)
    k = min(k, a.numel())
    return torch.topk(a, k, sorted=False).values.min().reshape(())
