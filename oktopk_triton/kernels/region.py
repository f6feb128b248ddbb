"""clear_sent: zero the residual where this rank's sent entries reached the global set.

Why it is shaped so: clear_sent reads only the sent entries: each one binary-searches
the sorted global indices of its region (a fixed number of steps) and zeroes the residual where
found, so the cost is O(entries · log capacity) and independent of n (not measured on its
own; a scan of the region would cost at least a read of it: 0.11 ms at n = 2^26, 0.37 ms at 2^28
on an H100, bench/results/kernels/gpu-kernel-variants-call1.json).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON, ceil_log2

if HAS_TRITON:
    import triton
    import triton.language as tl



# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit(do_not_specialize=["cap_sent", "cap_global"])
    def _clear_sent_kernel(
        residual_ptr,        # *fp32 [n]              updated: zeroed at sent ∩ global
        velocity_ptr,        # *fp32 [n]              zeroed there too (if HAS_VELOCITY)
        sent_indices_ptr,    # *int32 [P, cap_sent]   relative indices this rank sent to region j
        sent_counts_ptr,     # *int32 [P]             true counts of the sent rows
        region_offsets_ptr,  # *int64 [P+1]           region boundaries
        global_indices_ptr,  # *int32 [P, cap_global] sorted ascending, relative to region j
        global_counts_ptr,   # *int32 [P]             true counts of the global rows
        cap_sent, cap_global,
        sent_row_stride, sent_counts_stride, global_row_stride, global_counts_stride,
        SEARCH_STEPS: tl.constexpr,   # ceil(log2(cap_global + 1))
        HAS_VELOCITY: tl.constexpr,
        KEEP_BF16_ROUNDING: tl.constexpr,  # residual := r - bf16(r) (what a bf16 wire dropped)
        BLOCK: tl.constexpr,
    ):
        j = tl.program_id(0).to(tl.int64)            # region
        pid = tl.program_id(1).to(tl.int64)          # block of sent slots
        slots = pid * BLOCK + tl.arange(0, BLOCK)
        n_sent = tl.minimum(tl.load(sent_counts_ptr + j * sent_counts_stride), cap_sent)
        valid = slots < n_sent
        target = tl.load(sent_indices_ptr + j * sent_row_stride + slots, mask=valid, other=0)
        m = tl.minimum(tl.load(global_counts_ptr + j * global_counts_stride), cap_global)
        row = global_indices_ptr + j * global_row_stride
        lo = tl.zeros((BLOCK,), dtype=tl.int32)
        hi = tl.zeros((BLOCK,), dtype=tl.int32) + m
        for _ in range(SEARCH_STEPS):           # lower bound of target in row[:m]
            searching = valid & (lo < hi)
            mid = (lo + hi) // 2
            g = tl.load(row + mid, mask=searching, other=0)
            less = g < target
            lo = tl.where(searching & less, mid + 1, lo)
            hi = tl.where(searching & (~less), mid, hi)
        hit_possible = valid & (lo < m)
        g = tl.load(row + lo, mask=hit_possible, other=-1)
        found = hit_possible & (g == target)
        base = tl.load(region_offsets_ptr + j)
        if KEEP_BF16_ROUNDING:
            r = tl.load(residual_ptr + base + target.to(tl.int64), mask=found, other=0.0)
            # bf16(r) by round-to-nearest-even in the bits (as torch's .to(bfloat16); the
            # interpreter's own fp32 -> bf16 conversion truncates)
            b = r.to(tl.int32, bitcast=True)
            mag = b & 0x7FFFFFFF
            rmag = (mag + 0x7FFF + ((mag >> 16) & 1)) & 0x7FFF0000
            left = r - (rmag | (b ^ mag)).to(tl.float32, bitcast=True)
        else:
            left = tl.zeros((BLOCK,), tl.float32)
        tl.store(residual_ptr + base + target.to(tl.int64), left, mask=found)
        if HAS_VELOCITY:
            tl.store(velocity_ptr + base + target.to(tl.int64), tl.zeros((BLOCK,), tl.float32),
                     mask=found)

    @_dispatch.serialized_when_interpreted
    def _clear_sent_triton(residual, sent_indices, sent_counts, region_offsets,
                           global_indices, global_counts, velocity=None, keep_bf16=False,
                           block=1024):
        P, cap_sent = sent_indices.shape
        cap_global = global_indices.shape[1]
        if cap_sent == 0 or cap_global == 0 or P == 0:
            return
        grid = (P, triton.cdiv(cap_sent, block))
        _clear_sent_kernel[grid](
            residual, velocity if velocity is not None else residual, sent_indices, sent_counts,
            region_offsets, global_indices, global_counts,
            cap_sent, cap_global,
            sent_indices.stride(0), sent_counts.stride(0), global_indices.stride(0),
            global_counts.stride(0),
            SEARCH_STEPS=ceil_log2(cap_global + 1), HAS_VELOCITY=velocity is not None,
            KEEP_BF16_ROUNDING=bool(keep_bf16),
            BLOCK=block, num_warps=4)


# ----------------------------------------------------------------------------------------------
# torch references
# ----------------------------------------------------------------------------------------------
def _clear_sent_torch(residual, sent_indices, sent_counts, region_offsets, global_indices,
                      global_counts, velocity=None, keep_bf16=False):
    residual = residual.view(-1)
    P, cap_sent = sent_indices.shape
    cap_global = global_indices.shape[1]
    if cap_sent == 0 or cap_global == 0:
        return
    dev = residual.device
    n = residual.numel()
    big = torch.iinfo(torch.int64).max
    g = global_indices.to(torch.int64)
    g_valid = (torch.arange(cap_global, device=dev)
               < global_counts.to(torch.int64).reshape(P, 1).clamp(max=cap_global))
    g = torch.where(g_valid, g, torch.full_like(g, big)).contiguous()  # padding sorts last
    t = sent_indices.to(torch.int64).contiguous()
    s_valid = torch.arange(cap_sent, device=dev) < sent_counts.to(torch.int64).reshape(P, 1)
    pos = torch.searchsorted(g, t).clamp(max=cap_global - 1)
    found = s_valid & (g.gather(1, pos) == t)
    tgt = torch.where(found, region_offsets[:P].reshape(P, 1).to(torch.int64) + t,
                      torch.full_like(t, n))
    zeros = torch.zeros(tgt.numel(), dtype=residual.dtype, device=dev)
    safe = torch.where(found, tgt, torch.zeros_like(tgt)).reshape(-1)
    for buf in (residual, velocity):
        if buf is None:
            continue
        left = zeros
        if keep_bf16 and buf is residual:
            r = buf.gather(0, safe)
            left = r - r.to(torch.bfloat16).to(torch.float32)
        _dispatch.scatter_valid(buf, safe, left, found)


# ----------------------------------------------------------------------------------------------
# public
# ----------------------------------------------------------------------------------------------
def _clear_sent_launch(residual, sent_indices, sent_counts, region_offsets, global_indices,
                       global_counts, velocity, keep_bf16_rounding):
    """The Triton clear_sent reads contiguous region offsets (a copy otherwise)."""
    _clear_sent_triton(residual.view(-1), sent_indices, sent_counts, region_offsets.contiguous(),
                       global_indices, global_counts, velocity, keep_bf16_rounding)


def clear_sent(residual: Tensor, sent_indices: Tensor, sent_counts: Tensor, region_offsets: Tensor,
               global_indices: Tensor, global_counts: Tensor, *,
               velocity: Optional[Tensor] = None, keep_bf16_rounding: bool = False,
               backend: str = "auto") -> None:
    """Zero ``residual[region_offsets[j] + sent_indices[j, s]]`` for every valid sent entry that
    is among the first ``min(global_counts[j], capg)`` (ascending) entries of
    ``global_indices[j]``; ``velocity`` (optional, fp32 [n]) is zeroed at the same positions
    (momentum factor masking of the delivered entries). ``keep_bf16_rounding``: the entries
    were sent as bf16, so the residual keeps what the rounding dropped, ``r - bf16(r)``,
    instead of 0 (nothing is lost to the wire format)."""
    if sent_indices.dim() != 2 or global_indices.dim() != 2:
        raise ValueError("sent_indices and global_indices must be [P, cap]")
    if sent_indices.shape[0] != global_indices.shape[0]:
        raise ValueError("sent and global rows differ")
    if region_offsets.dtype != torch.int64:
        raise TypeError("region_offsets must be int64")
    v = velocity.view(-1) if velocity is not None else None
    _dispatch.record(launches=1, bytes=8 * sent_indices.numel())
    _dispatch.run(backend, residual.device, _clear_sent_launch, _clear_sent_torch,
                  residual, sent_indices, sent_counts, region_offsets, global_indices,
                  global_counts, v, keep_bf16_rounding)
