"""Gaussiank's threshold (oktopk_triton/algorithms/gaussiank.py): the normal fit, then ``iters``
device-side corrections, in ``1 + 2·iters`` launches, with a torch reference beside it.

Why a kernel: the correction is a loop of ``iters`` steps (8 by default), each one count over
``acc`` and a bracket update on 0-dim tensors. As torch ops that is about 19 launches a step
(``abs``, ``ge``, ``ne``, ``and``, ``sum``, then ``lt``, ``gt``, five ``where``, ...), 151 of
Gaussiank's 240 launches a steady call (``oktopk-bench launches``, P = 4, n = 2^17, 1%), most
of them on one element. Here each step is two launches: a count pass over ``acc`` (integer
atomics, one per program) and a one-program update of ``[thr, lo, hi]``; one more launch makes
the first threshold from the fit and zeroes the counters. The count is an exact integer and the
update does what the reference does in fp32 (IEEE square root, no fma contraction), so both
paths give the same threshold bit for bit.

:func:`gaussian_threshold`: ``thr = |mean| + z·std`` (``std_mean`` of ``acc``, population
standard deviation), then per step ``c = #{|acc| >= thr, acc != 0}``; ``c < lo_c`` makes
``thr`` an upper bracket, ``c > hi_c`` a lower one; the next threshold is the geometric mean of
the brackets once both exist, else ``thr/4`` (too few) or ``4·thr`` (too many); inside the band
it stays. No host read, static sizes.
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


# ----------------------------------------------------------------------------------------------
# compile check (kernels/_compile_check.py compiles these for sm_90 without a GPU)
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
    yield ("gaussian update", _update_kernel,
           {"state_ptr": "*fp32", "cnt_ptr": "*i64", "lo_c": "fp32", "hi_c": "fp32"},
           {}, [0, 1], 1, no_fma)


# the count streams acc: the compile check reports whether its load is vectorised
COMPILE_STREAMING = {"_count_kernel": "ld"}
