"""scatter_add and scatter_rows: sparse rows into a dense buffer.

Why they are shaped so: within one source the indices are unique, so a plain load-add-store is
race free; sources are added one launch after another (in order s = 0..S-1), so the float sum is
deterministic — no float atomics whose order would vary from run to run.  The per-source launch
reads the true count on the device; slots past min(count, capacity) are masked.

``scatter_rows`` writes rows that hit disjoint positions (the gathered global set: regions are
disjoint) in ONE launch over [rows, slots], skipping empty slots (index -1 or past the count).
It replaced ``out.index_put_(..., accumulate=True)`` over every padded slot, which sorted all of
them (padding at index 0 included): 40 ms per step at n = 2^26, P = 4 on an H100
(docs/research/gpu-measurements.md).  On the same H100, one scatter of the selection rows at n =
2^26, P = 4, 1%: scatter_rows 0.155 ms against 0.544 ms for index_put_(accumulate=True)
(bench/results/kernels/gpu-kernel-variants-call1.json).  Bytes: 12 per written entry (index, value,
out).

``scatter_rows_dense`` writes a whole output in one launch (zeros, the rows, or NaN on a device
flag): a step's ``out`` then needs no memset before and no NaN pass after, two launches and a
pass over n fewer (``oktopk-bench launches``, docs/research/launch-budget.md).
"""
from __future__ import annotations

from typing import Optional, Union

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON, ceil_log2

if HAS_TRITON:
    import triton
    import triton.language as tl


if HAS_TRITON:

    @triton.jit(do_not_specialize=["base_int", "capacity"])
    def _scatter_add_kernel(
        dense_ptr,     # *fp32|bf16|fp16 [n]  updated in place: dense[base + idx] += val
        indices_ptr,   # *int32 [capacity]    relative indices of ONE source (unique)
        values_ptr,    # *fp32  [capacity]    values of that source
        count_ptr,     # *int32 []            true count of that source
        base_ptr,      # *int64 []            base offset (if BASE_IS_PTR)
        base_int,      # the base as a Python int otherwise
        capacity,
        BASE_IS_PTR: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        slots = pid * BLOCK + tl.arange(0, BLOCK)
        count = tl.minimum(tl.load(count_ptr), capacity)
        valid = slots < count
        if BASE_IS_PTR:
            base = tl.load(base_ptr).to(tl.int64)
        else:
            base = base_int.to(tl.int64)
        idx = tl.load(indices_ptr + slots, mask=valid, other=0).to(tl.int64)
        val = tl.load(values_ptr + slots, mask=valid, other=0.0)
        ptr = dense_ptr + base + idx
        old = tl.load(ptr, mask=valid, other=0.0).to(tl.float32)
        tl.store(ptr, (old + val).to(dense_ptr.dtype.element_ty), mask=valid)

    @triton.jit(do_not_specialize=["capacity"])
    def _scatter_rows_kernel(
        dense_ptr,     # *fp32 [n]            out: dense[row_base[s] + idx] = val (or +=)
        indices_ptr,   # *int32 [S, capacity] relative indices (-1: empty slot)
        values_ptr,    # *fp32  [S, capacity] values
        counts_ptr,    # *int32 [S]           valid prefix of each row (true count, clamped)
        row_base_ptr,  # *int64 [S]           absolute position of each row's index 0
        capacity,
        idx_row_stride, val_row_stride, counts_stride,
        row_base_stride,   # 0 for one base shared by every row (an expanded scalar)
        ADD: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        s = tl.program_id(0).to(tl.int64)
        pid = tl.program_id(1).to(tl.int64)
        slots = pid * BLOCK + tl.arange(0, BLOCK)
        count = tl.minimum(tl.load(counts_ptr + s * counts_stride), capacity)
        valid = slots < count
        idx = tl.load(indices_ptr + s * idx_row_stride + slots, mask=valid, other=-1)
        valid = valid & (idx >= 0)
        val = tl.load(values_ptr + s * val_row_stride + slots, mask=valid, other=0.0)
        ptr = dense_ptr + tl.load(row_base_ptr + s * row_base_stride) + idx.to(tl.int64)
        if ADD:
            val = tl.load(ptr, mask=valid, other=0.0) + val
        tl.store(ptr, val, mask=valid)

    @_dispatch.serialized_when_interpreted
    def _scatter_rows_triton(dense, indices, values, counts, row_base, add, block=1024):
        S, cap = indices.shape
        if cap == 0 or S == 0:
            return
        rows = [(slice(s, s + 1)) for s in range(S)] if add else [slice(0, S)]
        for r in rows:   # add: one launch per row, in order (deterministic sums)
            ri, rv, rc, rb = indices[r], values[r], counts[r], row_base[r]
            _scatter_rows_kernel[(ri.shape[0], triton.cdiv(cap, block))](
                dense, ri, rv, rc, rb, cap, ri.stride(0), rv.stride(0), rc.stride(0),
                rb.stride(0), ADD=bool(add), BLOCK=block, num_warps=4)

    @_dispatch.serialized_when_interpreted
    def _scatter_add_triton(dense, indices, values, counts, base, block=1024):
        S, cap = indices.shape
        if cap == 0:
            return
        base_is_ptr = isinstance(base, Tensor)
        grid = (triton.cdiv(cap, block),)
        for s in range(S):
            _scatter_add_kernel[grid](
                dense, indices[s], values[s], counts[s],
                base if base_is_ptr else counts, 0 if base_is_ptr else int(base or 0), cap,
                BASE_IS_PTR=base_is_ptr, BLOCK=block, num_warps=4,
            )


    @triton.jit
    def _row_position(e, idx_ptr, cnt_ptr, offs_ptr, cap, idx_stride, mask):
        """Absolute position of flat slot ``e`` of the rows ([S, cap], row-major), or its
        region's end for a slot past the row's count: non-decreasing in ``e``."""
        s = e // cap
        i = e - s * cap
        cnt = tl.minimum(tl.load(cnt_ptr + s, mask=mask, other=0).to(tl.int64), cap)
        end = tl.load(offs_ptr + s + 1, mask=mask, other=0)
        valid = mask & (i < cnt)
        idx = tl.load(idx_ptr + s * idx_stride + i, mask=valid, other=0).to(tl.int64)
        base = tl.load(offs_ptr + s, mask=valid, other=0)
        return tl.where(valid, base + idx, end), valid, s, i

    # ``n`` is specialised (not in do_not_specialize): with n divisible by 16 the whole-``out``
    # fill ``mask=lane < n - b0`` is known to hold in runs of 4, so it compiles to 16-byte
    # vector stores (sm_90 PTX: st.global.v4.b32; with n unspecialised: scalar st.global.b32,
    # 29 -> 30 registers, no spill). Costs at most three compiled variants (n == 1, n % 16 ==
    # 0, other). Not measured on a GPU.
    @triton.jit(do_not_specialize=["cap", "total"])
    def _scatter_rows_dense_kernel(
        dense_ptr,     # *fp32 [n]        out: every element written
        idx_ptr,       # *int32 [S, cap]  ascending region-relative indices, valid prefix
        val_ptr,       # *fp32 [S, cap]
        cnt_ptr,       # *int32 [S]
        offs_ptr,      # *int64 [S+1]     region boundaries
        flag_ptr,      # *int32 []        nonzero: NaN everywhere (if HAS_FLAG)
        n, cap, total, idx_stride, val_stride,
        STEPS: tl.constexpr, HAS_FLAG: tl.constexpr, BLOCK: tl.constexpr,
        CHUNK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        b0 = pid * BLOCK
        lane = tl.arange(0, BLOCK)
        if HAS_FLAG:
            bad = tl.load(flag_ptr + lane * 0) != 0
        else:
            bad = lane < 0
        fill = tl.where(bad, float("nan"), 0.0)
        tl.store(dense_ptr + b0 + lane, fill, mask=lane < n - b0)
        # the slots whose positions fall in [b0, b0 + BLOCK): two lower bounds, one search
        two = tl.arange(0, 2)
        tgt = b0 + two.to(tl.int64) * BLOCK
        lo = tl.zeros((2,), dtype=tl.int64)
        hi = tl.zeros((2,), dtype=tl.int64) + total
        for _ in range(STEPS):
            live = lo < hi
            mid = (lo + hi) // 2
            pos, _v, _s, _i = _row_position(mid, idx_ptr, cnt_ptr, offs_ptr, cap, idx_stride,
                                            live)
            go = live & (pos < tgt)
            lo = tl.where(go, mid + 1, lo)
            hi = tl.where(live & ~go, mid, hi)
        start = tl.sum(tl.where(two == 0, lo, 0), axis=0)
        stop = tl.sum(tl.where(two == 1, lo, 0), axis=0)
        tl.debug_barrier()      # the fill above lands before the values below
        if HAS_FLAG:
            nflag = tl.load(flag_ptr)
        else:
            nflag = 0
        if nflag == 0:
            for e0 in range(start, stop, CHUNK):
                e = e0 + tl.arange(0, CHUNK).to(tl.int64)
                em = e < stop
                pos, valid, s, i = _row_position(e, idx_ptr, cnt_ptr, offs_ptr, cap, idx_stride,
                                                 em)
                valid = valid & (pos >= 0) & (pos < n)      # a slot outside dense: not written
                val = tl.load(val_ptr + s * val_stride + i, mask=valid, other=0.0)
                tl.store(dense_ptr + pos, val, mask=valid)

    @_dispatch.serialized_when_interpreted
    def _scatter_rows_dense_triton(dense, indices, values, counts, offsets, flag, block=4096):
        # 4096 a program: the two binary searches (about log2(S*cap) dependent loads each) are
        # paid once per 16 KB written. Not measured on a GPU yet.
        n = dense.numel()
        S, cap = indices.shape
        if n == 0:
            return
        total = S * cap
        _scatter_rows_dense_kernel[(triton.cdiv(n, block),)](
            dense, indices, values, counts, offsets, flag if flag is not None else counts,
            n, max(cap, 1), total, indices.stride(0), values.stride(0),
            STEPS=ceil_log2(total) + 1, HAS_FLAG=flag is not None, BLOCK=block, CHUNK=128,
            num_warps=4)


def _scatter_add_torch(dense, indices, values, counts, base):
    S, cap = indices.shape
    dev = dense.device
    b = _dispatch.as_index_tensor(base, 0, dev)
    slots = torch.arange(cap, device=dev)
    n = dense.numel()
    for s in range(S):
        valid = slots < counts[s].to(torch.int64)
        if dense.dtype == torch.float32:   # indices unique within a source: order-free sum
            _dispatch.scatter_valid(dense, b + indices[s].to(torch.int64), values[s], valid,
                                    add=True)
            continue
        tgt = torch.where(valid, b + indices[s].to(torch.int64), torch.full_like(slots, n))
        add = torch.where(valid, values[s], torch.zeros_like(values[s]))
        ext = torch.cat([dense.to(torch.float32), dense.new_zeros(1, dtype=torch.float32)])
        ext.index_add_(0, tgt, add)
        dense.copy_(ext[:n])


def _scatter_rows_torch(dense, indices, values, counts, row_base, add):
    S, cap = indices.shape
    dev = dense.device
    n = dense.numel()
    slots = torch.arange(cap, device=dev)
    valid = (slots < counts.to(torch.int64).reshape(S, 1)) & (indices >= 0)
    pos = torch.where(valid, row_base.reshape(S, 1) + indices.to(torch.int64),
                      torch.full_like(indices, n, dtype=torch.int64))
    if add:
        for s in range(S):
            _dispatch.scatter_valid(dense, pos[s], values[s], valid[s], add=True)
    else:
        _dispatch.scatter_valid(dense, pos, values, valid)


def _check_rows(dense: Tensor, indices: Tensor, values: Tensor):
    """The row layout scatter_rows and scatter_rows_dense share: int32 ``indices`` and fp32
    ``values`` of one shape [S, cap] with inner stride 1, a contiguous fp32 ``dense``.
    Returns ``(S, cap)``."""
    if indices.dim() != 2 or indices.shape != values.shape:
        raise ValueError("indices and values must have the same shape [S, cap]")
    if (indices.dtype != torch.int32 or values.dtype != torch.float32
            or dense.dtype != torch.float32):
        raise TypeError("indices must be int32, values and dense fp32")
    if not dense.is_contiguous():
        raise ValueError("dense must be contiguous")
    S, cap = indices.shape
    if cap > 1 and (indices.stride(1) != 1 or values.stride(1) != 1):
        raise ValueError("indices/values need inner stride 1")
    return S, cap


def scatter_rows(dense: Tensor, indices: Tensor, values: Tensor, counts: Tensor,
                 row_base: Tensor, *, add: bool = False, backend: str = "auto") -> None:
    """``dense[row_base[s] + indices[s, i]] = values[s, i]`` (``+=`` with ``add``) for every
    valid slot: ``i < min(counts[s], cap)`` and ``indices[s, i] >= 0``.

    ``indices`` int32 [S, cap] (unique within a row), ``values`` fp32 [S, cap] (row stride any,
    inner stride 1), ``counts`` int32 [S], ``row_base`` int64 [S] (device: no host read).  Without
    ``add`` the rows must hit disjoint positions (one launch); with ``add`` rows are added in
    order s = 0..S-1 (deterministic).  ``dense`` fp32, contiguous."""
    S, cap = _check_rows(dense, indices, values)
    row_base = row_base.reshape(-1).to(torch.int64)
    counts = counts.reshape(-1)
    if row_base.numel() != S or counts.numel() != S:
        raise ValueError(f"counts and row_base need {S} entries")
    _dispatch.record(launches=S if add else 1, bytes=12 * S * cap)
    _dispatch.run(backend, dense.device, _scatter_rows_triton, _scatter_rows_torch,
                  dense.view(-1), indices, values, counts, row_base, add)


def _scatter_rows_dense_launch(dense, indices, values, counts, offs, flag):
    _scatter_rows_dense_triton(dense.view(-1), indices, values, counts, offs, flag)


def _scatter_rows_dense_torch(dense, indices, values, counts, offs, flag):
    flat = dense.view(-1)
    flat.zero_()
    _scatter_rows_torch(flat, indices, values, counts, offs[:indices.shape[0]], False)
    if flag is not None:
        flat.masked_fill_(flag != 0, float("nan"))


def scatter_rows_dense(dense: Tensor, indices: Tensor, values: Tensor, counts: Tensor,
                       region_offsets: Tensor, flag: Optional[Tensor] = None, *,
                       backend: str = "auto") -> None:
    """Write ALL of ``dense`` (fp32, contiguous, any contents: a fresh ``torch.empty`` will do):
    ``values[s, i]`` at ``region_offsets[s] + indices[s, i]`` for ``i < min(counts[s], cap)``
    and 0 elsewhere; NaN everywhere when the int32 device ``flag`` is nonzero. One launch and one
    write of ``dense``: no memset before, no NaN pass after (what ``dense_zeros`` +
    ``scatter_rows`` + ``fill_if`` cost in three launches).

    The rows' valid slots must be their first ``min(counts[s], cap)`` (none negative),
    ascending, inside region s (``[0, region_offsets[s+1] - region_offsets[s])``): each
    program finds the slots that land in its block by a binary search over them."""
    S, cap = _check_rows(dense, indices, values)
    offs = region_offsets.reshape(-1)
    counts = counts.reshape(-1)
    if offs.numel() != S + 1 or offs.dtype != torch.int64 or counts.numel() != S:
        raise ValueError(f"region_offsets needs int64 [{S + 1}] and counts [{S}]")
    if flag is not None:
        flag = flag.reshape(()).to(torch.int32)
    n = dense.numel()
    _dispatch.record(launches=1, bytes=4 * n + 12 * S * cap)
    _dispatch.run(backend, dense.device, _scatter_rows_dense_launch, _scatter_rows_dense_torch,
                  dense, indices, values, counts, offs, flag)


def _scatter_add_launch(dense, indices, values, counts, base):
    """The Triton scatter_add reads rows of inner stride 1 (a copy otherwise)."""
    _scatter_add_triton(dense, indices if indices.stride(-1) == 1 else indices.contiguous(),
                        values if values.stride(-1) == 1 else values.contiguous(), counts, base)


def scatter_add(dense: Tensor, indices: Tensor, values: Tensor, counts: Tensor, *,
                base: Union[int, Tensor, None] = None, backend: str = "auto") -> None:
    """``dense[base + indices[s, i]] += values[s, i]`` for ``i < min(counts[s], cap)``, sources
    in order s = 0..S-1 (deterministic).  ``dense`` must be contiguous."""
    if indices.dim() == 1:
        indices, values, counts = indices[None], values[None], counts.reshape(1)
    if indices.shape != values.shape:
        raise ValueError("indices and values must have the same shape [S, cap]")
    if indices.dtype != torch.int32 or values.dtype != torch.float32:
        raise TypeError("indices must be int32 and values fp32")
    if not dense.is_contiguous():
        raise ValueError("dense must be contiguous")
    if isinstance(base, Tensor):
        base = base.reshape(()).to(torch.int64)
    _dispatch.record(launches=indices.shape[0], bytes=12 * indices.numel())
    _dispatch.run(backend, dense.device, _scatter_add_launch, _scatter_add_torch,
                  dense.view(-1), indices, values, counts.reshape(-1), base)
