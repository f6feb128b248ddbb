"""fused_select: the hot kernel of a sparse-allreduce step.

Why it is shaped so: the step is memory bound, so one pass reads grad + residual, writes
residual = acc, and compacts the few selected (index, value) pairs straight into the
fixed-capacity slot of their destination region (no mask tensor, no nonzero, no second pass):
~ (s_grad + 8) * n bytes plus the selected entries.  Compaction inside a block is a tl.cumsum of
the selection mask; the slot base comes from one scalar atomic_add per (program, region) on the
region's count, which therefore ends as the TRUE count.  A block of BLOCK elements usually lies
inside one region; when it spans several the kernel walks them (a binary search finds the first,
empty regions fall out of the walk), so any layout works, P = 1 included.
"""
from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON, ceil_log2

if HAS_TRITON:
    import triton
    import triton.language as tl


class Selection(NamedTuple):
    indices: Tensor    # int32 [P, capacity]: index relative to the start of its region
    values: Tensor     # fp32  [P, capacity]
    counts: Tensor     # int32 [P]: TRUE number selected in each region (may exceed capacity)
    nonfinite: Tensor  # int32 [P]: 1 if any acc in the region is NaN/Inf


# ----------------------------------------------------------------------------------------------
# Triton kernel
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit(do_not_specialize=["P", "capacity"])   # n stays specialised (n % 16: vector loads)
    def _fused_select_kernel(
        grad_ptr,            # *fp32|bf16|fp16 [n]  gradient of this step
        residual_ptr,        # *fp32 [n]            residual, overwritten with acc = residual + grad
        threshold_ptr,       # *fp32 [] or [P]      selection threshold: one, or one per region
        region_offsets_ptr,  # *int64 [P+1]         region boundaries, [0]=0, [P]=n, non-decreasing
        indices_ptr,         # *int32 [P, capacity] out: relative index, row stride idx_row_stride
        values_ptr,          # *fp32  [P, capacity] out: acc value, row stride val_row_stride
        counts_ptr,          # *int32 [P]           out (zeroed by the launcher): true counts
        nonfinite_ptr,       # *int32 [P]           out (zeroed by the launcher): NaN/Inf flag
        skip_ptr,            # *int32 []            when nonzero write nothing (if HAS_SKIP)
        n,                   # number of elements
        P,                   # number of regions
        capacity,            # slots per region row
        idx_row_stride, val_row_stride, counts_stride, nonfinite_stride,
        HAS_SKIP: tl.constexpr,
        THR_PER_REGION: tl.constexpr,  # threshold_ptr holds P thresholds (region j: [j])
        SEARCH_STEPS: tl.constexpr,  # ceil(log2(P + 1)): binary-search iterations for region
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        block_start = pid * BLOCK
        offs = block_start + tl.arange(0, BLOCK).to(tl.int64)
        in_range = offs < n
        block_end = tl.minimum(block_start + BLOCK, n)

        live = in_range      # in range and not skipped
        if HAS_SKIP:
            skip_vec = tl.zeros((BLOCK,), dtype=tl.int32) + tl.load(skip_ptr)
            live = in_range & (skip_vec == 0)

        g = tl.load(grad_ptr + offs, mask=in_range, other=0.0).to(tl.float32)
        r = tl.load(residual_ptr + offs, mask=in_range, other=0.0)
        acc = r + g
        tl.store(residual_ptr + offs, acc, mask=live)

        candidate = (acc != 0.0) & live
        if not THR_PER_REGION:
            thr = tl.load(threshold_ptr)
        bad = ((acc != acc) | (tl.abs(acc) == float("inf"))) & live

        # region holding block_start: the largest p < P with region_offsets[p] <= block_start
        lo = P * 0          # int32 tensors (loop-carried)
        hi = P + 0
        for _ in range(SEARCH_STEPS):
            mid = (lo + hi) // 2
            go_right = (hi - lo > 1) & (tl.load(region_offsets_ptr + mid) <= block_start)
            shrink = (hi - lo > 1) & (tl.load(region_offsets_ptr + mid) > block_start)
            lo = tl.where(go_right, mid, lo)
            hi = tl.where(shrink, mid, hi)
        region = lo.to(tl.int64)
        region_start = tl.load(region_offsets_ptr + region)
        # walk the regions that start before the block ends (usually exactly one)
        while region_start < block_end:
            region_end = tl.load(region_offsets_ptr + region + 1)
            in_region = (offs >= region_start) & (offs < region_end)
            if THR_PER_REGION:
                thr = tl.load(threshold_ptr + region)
            take = candidate & (tl.abs(acc) >= thr) & in_region
            take_i = take.to(tl.int32)
            n_take = tl.sum(take_i, axis=0)
            # one scalar atomic per (program, region): the slot base; counts end as true counts
            slot_base = tl.atomic_add(counts_ptr + region * counts_stride, n_take, mask=n_take > 0,
                                      sem="relaxed")
            slot = slot_base + tl.cumsum(take_i, axis=0) - 1
            write = take & (slot < capacity)
            rel = (offs - region_start).to(tl.int32)
            tl.store(indices_ptr + region * idx_row_stride + slot, rel, mask=write)
            tl.store(values_ptr + region * val_row_stride + slot, acc, mask=write)
            n_bad = tl.sum((bad & in_region).to(tl.int32), axis=0)
            tl.atomic_max(nonfinite_ptr + region * nonfinite_stride, 1, mask=n_bad > 0, sem="relaxed")
            region += 1
            region_start = region_end

    @_dispatch.serialized_when_interpreted
    def _fused_select_triton(grad, residual, threshold, region_offsets, capacity, skip, out,
                             block: int = 2048):
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
            grad, residual, threshold, region_offsets,
            out.indices, out.values, out.counts, out.nonfinite,
            skip if skip is not None else out.counts,
            n, P, capacity,
            out.indices.stride(0), out.values.stride(0), out.counts.stride(0),
            out.nonfinite.stride(0),
            HAS_SKIP=skip is not None, THR_PER_REGION=threshold.dim() == 1,
            SEARCH_STEPS=ceil_log2(P + 1), BLOCK=block,
            num_warps=8 if block >= 2048 else 4,
        )
        return out


# ----------------------------------------------------------------------------------------------
# torch reference (same semantics; the CPU path).  On CUDA tensors it stays free of host reads
# (scatter into a dump slot instead of boolean indexing); on CPU it may read, and is O(selected).
# ----------------------------------------------------------------------------------------------
def region_ids(region_offsets: Tensor, n: int) -> Tensor:
    """int64 [n]: the region of every element (empty regions hold none)."""
    pos = torch.arange(n, device=region_offsets.device, dtype=torch.int64)
    return torch.searchsorted(region_offsets[1:].contiguous(), pos, right=True)


def _fused_select_torch_cpu(grad, residual, threshold, region_offsets, capacity, skip, out):
    """CPU tensors: host reads are allowed, so work on the selected entries only."""
    P = region_offsets.numel() - 1
    out.counts.zero_()
    out.nonfinite.zero_()
    if skip is not None and int(skip) != 0:
        return out
    acc = residual.add_(grad)                      # acc = residual + float(grad), in place
    ends = region_offsets[1:].contiguous()
    if threshold.dim() == 1:                       # one threshold per region
        thr_t = threshold[region_ids(region_offsets, acc.numel())]
        sel = (acc.abs() >= thr_t) & (acc != 0)    # NaN (acc or threshold) compares false
    else:
        thr = float(threshold)
        if thr > 0:
            sel = acc.abs() >= thr                 # excludes 0 and NaN already
        elif thr <= 0:
            sel = (acc != 0) & ~torch.isnan(acc)
        else:                                      # NaN threshold: nothing
            sel = torch.zeros_like(acc, dtype=torch.bool)
    idx = torch.nonzero(sel).reshape(-1)           # ascending
    rid = torch.searchsorted(ends, idx, right=True)
    counts = torch.bincount(rid, minlength=P)
    first = torch.cumsum(counts, 0) - counts
    slot = torch.arange(idx.numel(), dtype=torch.int64) - first[rid]
    keep = slot < capacity
    rid_k, slot_k, idx_k = rid[keep], slot[keep], idx[keep]
    out.indices[rid_k, slot_k] = (idx_k - region_offsets[rid_k]).to(torch.int32)
    out.values[rid_k, slot_k] = acc[idx_k]
    out.counts.copy_(counts)
    if not math.isfinite(float(acc.sum())):       # cheap filter; overflow only costs a pass
        bad = torch.nonzero(~torch.isfinite(acc)).reshape(-1)
        out.nonfinite[torch.searchsorted(ends, bad, right=True)] = 1
    return out


def _fused_select_torch(grad, residual, threshold, region_offsets, capacity, skip, out):
    if residual.device.type == "cpu":
        return _fused_select_torch_cpu(grad, residual, threshold, region_offsets, capacity, skip, out)
    return _fused_select_torch_nosync(grad, residual, threshold, region_offsets, capacity, skip, out)


def _fused_select_torch_nosync(grad, residual, threshold, region_offsets, capacity, skip, out):
    """No host read: the torch path for CUDA tensors (tested on CPU too)."""
    n = residual.numel()
    P = region_offsets.numel() - 1
    dev = residual.device
    acc = residual + grad.to(torch.float32)
    active = torch.ones((), dtype=torch.bool, device=dev) if skip is None else (skip.reshape(()) == 0)
    rid = region_ids(region_offsets, n)
    thr = threshold.to(torch.float32)
    thr = thr[rid] if thr.dim() == 1 else thr.reshape(())
    sel = (acc.abs() >= thr) & (acc != 0) & active
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
    idx_buf = torch.cat([out.indices.reshape(-1), out.indices.new_zeros(1)]).scatter_(0, target, rel)
    val_buf = torch.cat([out.values.reshape(-1), out.values.new_zeros(1)]).scatter_(0, target, acc)
    out.indices.copy_(idx_buf[:dump].view(P, capacity))
    out.values.copy_(val_buf[:dump].view(P, capacity))
    out.counts.copy_(counts)
    out.nonfinite.copy_(nonfinite)
    residual.copy_(torch.where(active, acc, residual))
    return out


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
                 backend: str = "auto") -> Selection:
    """Form ``acc = residual + grad`` (written back to ``residual``) and compact the entries with
    ``|acc| >= threshold and acc != 0`` into the fixed-capacity slot of their region.

    ``threshold``: a 0-dim fp32 tensor, or ``[P]`` (one per region: region j selects with
    ``threshold[j]``; Ok-Topk raises the threshold of a region that would overflow its row so
    the row keeps the largest entries instead of the lowest indices).

    See docs/CONTRACTS.md §1.  ``skip`` (0-dim int32): when nonzero nothing is written — the
    residual is untouched and counts and nonfinite are 0.
    """
    n = residual.numel()
    if grad.numel() != n:
        raise ValueError(f"grad has {grad.numel()} elements, residual {n}")
    if residual.dtype != torch.float32:
        raise TypeError(f"residual must be fp32, got {residual.dtype}")
    if grad.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise TypeError(f"grad must be fp32/bf16/fp16, got {grad.dtype}")
    if not (residual.is_contiguous() and grad.is_contiguous()):
        raise ValueError("grad and residual must be contiguous")
    capacity = int(capacity)
    if capacity < 0:
        raise ValueError("capacity must be >= 0")
    if region_offsets.dtype != torch.int64:
        raise TypeError(f"region_offsets must be int64, got {region_offsets.dtype}")
    region_offsets = region_offsets.contiguous()
    P = region_offsets.numel() - 1
    if P < 1:
        raise ValueError("region_offsets needs P + 1 >= 2 entries")
    if out is None:
        out = empty_selection(P, capacity, residual.device)
    else:
        if tuple(out.indices.shape) != (P, capacity) or tuple(out.values.shape) != (P, capacity):
            raise ValueError(f"out.indices/values must be [{P}, {capacity}]")
        if out.indices.dtype != torch.int32 or out.values.dtype != torch.float32:
            raise TypeError("out.indices must be int32 and out.values fp32")
        if (capacity > 1 and (out.indices.stride(1) != 1 or out.values.stride(1) != 1)):
            raise ValueError("out.indices/values need inner stride 1")
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
    if threshold.device != residual.device:
        raise ValueError(f"threshold is on {threshold.device}, expected {residual.device}")
    if _dispatch.choose(backend, residual.device) == "triton":
        return _fused_select_triton(grad, residual, threshold, region_offsets, capacity, skip, out)
    return _fused_select_torch(grad, residual, threshold, region_offsets, capacity, skip, out)
