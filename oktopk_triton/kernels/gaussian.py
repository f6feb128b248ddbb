"""Gaussiank's threshold and selection (oktopk_triton/algorithms/gaussiank.py): the normal fit,
then ``iters`` device-side corrections, in ``1 + 2·iters`` launches, and the compaction of what
passes it in 3, each with a torch reference beside it.

:func:`gaussian_threshold`: ``thr = |mean| + z·std`` (``std_mean`` of ``acc``, population
standard deviation), then per step ``c = #{|acc| >= thr, acc != 0}``; ``c < lo_c`` makes
``thr`` an upper bracket, ``c > hi_c`` a lower one; the next threshold is the geometric mean of
the brackets once both exist, else ``thr/4`` (too few) or ``4·thr`` (too many); inside the band
it stays. No host read, static sizes.

:func:`select_above`: the entries at or above that threshold, compacted in ascending index order
into a fixed capacity. As torch ops (a mask of four ops, then an int64 cumsum over n, a where,
an arange and two scatters) it moved about 136 bytes an entry through n-sized temporaries; here
a count per block, a cumsum of the block counts and one writing pass read ``acc`` twice and
write the kept mask: 9 bytes an entry, 3 launches.

Measured why: docs/research/design-notes.md, ``oktopk_triton/kernels/gaussian.py``.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

_BLOCK = 4096     # elements a program counts (one atomic per program: 2^14 at n = 2^26)

if HAS_TRITON:

    @triton.jit
    def _fit_kernel(
        mean_ptr,      # *fp32 []        mean of acc
        std_ptr,       # *fp32 []        population standard deviation of acc
        state_ptr,     # *fp32 [3]       out: thr, lo bracket (0), hi bracket (+inf)
        cnt_ptr,       # *int64 [iters]  out: zeroed counters, one per step
        z, iters,
        BLOCK: tl.constexpr,
    ):
        thr = tl.abs(tl.load(mean_ptr)) + z * tl.load(std_ptr)   # two roundings (no fma)
        tl.store(state_ptr, thr)
        tl.store(state_ptr + 1, 0.0)
        tl.store(state_ptr + 2, float("inf"))
        for s in range(0, iters, BLOCK):
            j = s + tl.arange(0, BLOCK)
            tl.store(cnt_ptr + j, tl.zeros([BLOCK], tl.int64), mask=j < iters)

    @triton.jit
    def _count_kernel(
        acc_ptr,       # *fp32 [n]       acc = residual + grad
        state_ptr,     # *fp32 [3]       thr (read)
        cnt_ptr,       # *int64 []       out: += #{|acc| >= thr, acc != 0} of this block
        n,
        BLOCK: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(acc_ptr + e, mask=e < n, other=0.0)
        thr = tl.load(state_ptr)
        hit = (tl.abs(x) >= thr) & (x != 0)
        tl.atomic_add(cnt_ptr, tl.sum(hit.to(tl.int64), axis=0), sem="relaxed")

    @triton.jit
    def _update_kernel(
        state_ptr,     # *fp32 [3]       thr, lo, hi (updated)
        cnt_ptr,       # *int64 []       this step's count
        lo_c, hi_c,
    ):
        thr = tl.load(state_ptr)
        lo_t = tl.load(state_ptr + 1)
        hi_t = tl.load(state_ptr + 2)
        c = tl.load(cnt_ptr).to(tl.float32)
        few = c < lo_c
        many = c > hi_c
        lo_t = tl.where(many, thr, lo_t)
        hi_t = tl.where(few, thr, hi_t)
        bracket = (lo_t > 0) & (hi_t == hi_t) & (tl.abs(hi_t) != float("inf"))
        nxt = tl.where(bracket, tl.sqrt_rn(lo_t * hi_t), tl.where(few, thr * 0.25, thr * 4.0))
        thr = tl.where(few | many, nxt, thr)
        tl.store(state_ptr, thr)
        tl.store(state_ptr + 1, lo_t)
        tl.store(state_ptr + 2, hi_t)

    @triton.jit
    def _block_counts_kernel(
        acc_ptr,       # *fp32 [n]       acc
        thr_ptr,       # *fp32 []        the threshold
        cnt_ptr,       # *int64 [blocks] out: #{|acc| >= thr, acc != 0} of each block
        n,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        e = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(acc_ptr + e, mask=e < n, other=0.0)
        hit = (tl.abs(x) >= tl.load(thr_ptr)) & (x != 0)
        tl.store(cnt_ptr + b, tl.sum(hit.to(tl.int64), axis=0))

    @triton.jit
    def _select_write_kernel(
        acc_ptr,       # *fp32 [n]       acc
        thr_ptr,       # *fp32 []        the threshold
        cnt_ptr,       # *int64 [blocks] each block's count
        end_ptr,       # *int64 [blocks] their running sum (inclusive)
        idx_ptr,       # *int32 [cap]    out: the first cap selected indices, ascending; -1 after
        val_ptr,       # *fp32 [cap]     out: their values; 0 after
        kept_ptr,      # *int8 [n]       out: selected and within the capacity
        count_ptr,     # *int32 []       out: the true count (may exceed cap)
        n, cap, blocks,
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        lane = tl.arange(0, BLOCK)
        total = tl.load(end_ptr + blocks - 1)
        if b < blocks:
            e = b.to(tl.int64) * BLOCK + lane
            inb = e < n
            x = tl.load(acc_ptr + e, mask=inb, other=0.0)
            hit = (tl.abs(x) >= tl.load(thr_ptr)) & (x != 0) & inb
            start = tl.load(end_ptr + b) - tl.load(cnt_ptr + b)
            pos = start + tl.cumsum(hit.to(tl.int64), axis=0) - 1
            keep = hit & (pos < cap)
            tl.store(idx_ptr + pos, e.to(tl.int32), mask=keep)
            tl.store(val_ptr + pos, x, mask=keep)
            tl.store(kept_ptr + e, keep.to(tl.int8), mask=inb)
        slot = b.to(tl.int64) * BLOCK + lane              # the padding past the count
        pad = (slot < cap) & (slot >= total)
        tl.store(idx_ptr + slot, tl.full([BLOCK], -1, tl.int32), mask=pad)
        tl.store(val_ptr + slot, tl.zeros([BLOCK], tl.float32), mask=pad)
        tl.store(count_ptr, total.to(tl.int32), mask=b == 0)

    @_dispatch.serialized_when_interpreted
    def _select_counts_triton(acc, thr, cnt):
        n = acc.numel()
        _block_counts_kernel[(cnt.numel(),)](acc, thr, cnt, n, BLOCK=_BLOCK, num_warps=8)

    @_dispatch.serialized_when_interpreted
    def _select_write_triton(acc, thr, cnt, ends, idx, val, kept, count):
        n, cap, nb = acc.numel(), idx.numel(), cnt.numel()
        _select_write_kernel[(max(nb, triton.cdiv(cap, _BLOCK)),)](
            acc, thr, cnt, ends, idx, val, kept, count, n, cap, nb, BLOCK=_BLOCK, num_warps=8)

    @_dispatch.serialized_when_interpreted
    def _fit_triton(mean, std, state, cnt, z):
        _fit_kernel[(1,)](mean, std, state, cnt, z, cnt.numel(), BLOCK=64, num_warps=1,
                          enable_fp_fusion=False)

    @_dispatch.serialized_when_interpreted
    def _count_triton(acc, state, cnt):
        n = acc.numel()
        _count_kernel[(triton.cdiv(n, _BLOCK),)](acc, state, cnt, n, BLOCK=_BLOCK, num_warps=8)

    @_dispatch.serialized_when_interpreted
    def _update_triton(state, cnt, lo_c, hi_c):
        _update_kernel[(1,)](state, cnt, lo_c, hi_c, num_warps=1, enable_fp_fusion=False)


def _gaussian_threshold_triton(acc, mean, std, z, lo_c, hi_c, iters):
    state = torch.empty(3, dtype=torch.float32, device=acc.device)
    cnt = torch.empty(max(1, iters), dtype=torch.int64, device=acc.device)
    _fit_triton(mean, std, state, cnt, z)
    for i in range(iters):
        _count_triton(acc, state, cnt[i])
        _update_triton(state, cnt[i], lo_c, hi_c)
    return state[0]


def _gaussian_threshold_torch(acc, mean, std, z, lo_c, hi_c, iters):
    """The specification: the ops Gaussiank's step issued before this kernel, in fp32."""
    thr = mean.abs() + z * std
    a = acc.abs()
    lo_t = torch.zeros_like(thr)
    hi_t = torch.full_like(thr, float("inf"))
    for _ in range(iters):
        c = ((a >= thr) & (acc != 0)).sum().to(torch.float32)
        few, many = c < lo_c, c > hi_c
        lo_t = torch.where(many, thr, lo_t)
        hi_t = torch.where(few, thr, hi_t)
        bracket = (lo_t > 0) & torch.isfinite(hi_t)
        nxt = torch.where(bracket, torch.sqrt(lo_t * hi_t),
                          torch.where(few, thr * 0.25, thr * 4.0))
        thr = torch.where(few | many, nxt, thr)
    return thr


def gaussian_threshold(acc: Tensor, z: float, lo_count: float, hi_count: float, iters: int, *,
                       backend: str = "auto") -> Tensor:
    """Gaussiank's corrected threshold, a 0-dim fp32 tensor on ``acc``'s device (no host read).
    ``acc``: contiguous fp32 [n >= 1]; ``z``: the normal quantile of the fit; ``lo_count`` and
    ``hi_count``: the band of counts (``lo·k``, ``hi·k``) inside which a threshold stays;
    ``iters`` >= 0 correction steps (module docstring). Launches: ``std_mean`` and, on the
    Triton path, ``1 + 2·iters`` (one count pass over ``acc`` a step)."""
    if not isinstance(acc, Tensor) or acc.dtype != torch.float32 or acc.dim() != 1 \
            or not acc.is_contiguous() or acc.numel() == 0:
        got = f"{acc.dtype} {tuple(acc.shape)}" if isinstance(acc, Tensor) else type(acc).__name__
        raise ValueError(f"acc must be a contiguous non-empty 1-dim float32 tensor, got {got}")
    if isinstance(iters, bool) or not isinstance(iters, int) or iters < 0:
        raise ValueError(f"iters must be an int >= 0, got {iters!r}")
    n = acc.numel()
    std, mean = torch.std_mean(acc, correction=0)
    _dispatch.record(launches=1 + 2 * iters, bytes=4 * n * iters)
    return _dispatch.run(backend, acc.device, _gaussian_threshold_triton,
                         _gaussian_threshold_torch, acc, mean, std, float(z), float(lo_count),
                         float(hi_count), iters)


def _select_above_triton(acc, thr, cap):
    n, dev = acc.numel(), acc.device
    nb = triton.cdiv(n, _BLOCK)
    cnt = torch.empty(nb, dtype=torch.int64, device=dev)
    _select_counts_triton(acc, thr, cnt)
    ends = torch.cumsum(cnt, 0)
    idx = torch.empty(cap, dtype=torch.int32, device=dev)
    val = torch.empty(cap, dtype=torch.float32, device=dev)
    kept = torch.empty(n, dtype=torch.bool, device=dev)
    count = torch.empty((), dtype=torch.int32, device=dev)
    _select_write_triton(acc, thr, cnt, ends, idx, val, kept.view(torch.int8), count)
    return idx, val, count, kept


def _select_above_torch(acc, thr, cap):
    """The specification: the mask, then a fixed-capacity compaction in ascending order (the
    ops Gaussiank's step issued before this kernel)."""
    mask = (acc.abs() >= thr) & (acc != 0)
    n, dev = mask.numel(), mask.device
    pos = torch.cumsum(mask.to(torch.int64), 0) - 1
    kept = mask & (pos < cap)
    dest = torch.where(kept, pos, torch.full_like(pos, cap))   # cap = trash slot
    ar = torch.arange(n, device=dev, dtype=torch.int64)
    bi = torch.full((cap + 1,), -1, dtype=torch.int64, device=dev)
    bv = torch.zeros(cap + 1, dtype=torch.float32, device=dev)
    bi.scatter_(0, dest, ar)
    bv.scatter_(0, dest, acc)
    count = mask.sum(dtype=torch.int64).to(torch.int32)
    return bi[:cap].to(torch.int32), bv[:cap], count, kept


def select_above(acc: Tensor, thr: Tensor, cap: int, *, backend: str = "auto"):
    """Gaussiank's selection: the entries with ``|acc| >= thr`` and ``acc != 0`` (``thr`` a
    0-dim fp32 device tensor), the first ``cap`` of them in ascending index order. Returns
    ``(indices int32 [cap] (-1 padding), values fp32 [cap] (0 padding), count int32 0-dim
    (the true count, may exceed cap), kept bool [n] (selected and within the capacity))``.
    Triton: a count per block, a cumsum of the counts, a writing pass (3 launches, 8 bytes an
    entry read and 1 written); no host read."""
    if not isinstance(acc, Tensor) or acc.dtype != torch.float32 or acc.dim() != 1 \
            or not acc.is_contiguous() or acc.numel() == 0:
        got = f"{acc.dtype} {tuple(acc.shape)}" if isinstance(acc, Tensor) else type(acc).__name__
        raise ValueError(f"acc must be a contiguous non-empty 1-dim float32 tensor, got {got}")
    if not isinstance(thr, Tensor) or thr.numel() != 1 or thr.dtype != torch.float32:
        raise ValueError("thr must be a one-element float32 tensor")
    if isinstance(cap, bool) or not isinstance(cap, int) or cap < 1:
        raise ValueError(f"cap must be an int >= 1, got {cap!r}")
    n = acc.numel()
    _dispatch.record(launches=3, bytes=9 * n + 8 * cap)
    return _dispatch.run(backend, acc.device, _select_above_triton, _select_above_torch, acc,
                         thr.reshape(()), cap)


# ----------------------------------------------------------------------------------------------
# compile check (oktopk_triton/kernels/_compile_check.py compiles these for sm_90 without a GPU)
# ----------------------------------------------------------------------------------------------
def compile_variants():
    """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps, options) per
    variant, as the launchers above launch them (no fma: the fit and the update round as the
    reference does)."""
    no_fma = {"enable_fp_fusion": False}
    yield ("gaussian fit", _fit_kernel,
           {"mean_ptr": "*fp32", "std_ptr": "*fp32", "state_ptr": "*fp32", "cnt_ptr": "*i64",
            "z": "fp32", "iters": "i32", "BLOCK": "constexpr"},
           {"BLOCK": 64}, [0, 1, 2, 3], 1, no_fma)
    for n16 in (True, False):
        yield (f"gaussian count n%16={'0' if n16 else 'any'}", _count_kernel,
               {"acc_ptr": "*fp32", "state_ptr": "*fp32", "cnt_ptr": "*i64", "n": "i64",
                "BLOCK": "constexpr"},
               {"BLOCK": _BLOCK}, [0, 1, 2] + ([3] if n16 else []), 8, {})
    for n16 in (True, False):
        yield (f"gaussian block counts n%16={'0' if n16 else 'any'}", _block_counts_kernel,
               {"acc_ptr": "*fp32", "thr_ptr": "*fp32", "cnt_ptr": "*i64", "n": "i64",
                "BLOCK": "constexpr"},
               {"BLOCK": _BLOCK}, [0, 1, 2] + ([3] if n16 else []), 8, {})
        yield (f"gaussian select write n%16={'0' if n16 else 'any'}", _select_write_kernel,
               {"acc_ptr": "*fp32", "thr_ptr": "*fp32", "cnt_ptr": "*i64", "end_ptr": "*i64",
                "idx_ptr": "*i32", "val_ptr": "*fp32", "kept_ptr": "*i8", "count_ptr": "*i32",
                "n": "i64", "cap": "i64", "blocks": "i32", "BLOCK": "constexpr"},
               {"BLOCK": _BLOCK}, [0, 1, 2, 3, 4, 5, 6, 7] + ([8] if n16 else []), 8, {})
    yield ("gaussian update", _update_kernel,
           {"state_ptr": "*fp32", "cnt_ptr": "*i64", "lo_c": "fp32", "hi_c": "fp32"},
           {}, [0, 1], 1, no_fma)


# the count streams acc: the compile check reports whether its load is vectorised
COMPILE_STREAMING = {"_count_kernel": "ld", "_block_counts_kernel": "ld"}
