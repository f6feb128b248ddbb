"""scatter_add: add received sparse entries into a dense buffer.

Why it is shaped so: within one source the indices are unique, so a plain load-add-store is
race free; sources are added one launch after another (in order s = 0..S-1), so the float sum is
deterministic — no float atomics whose order would vary from run to run.  The per-source launch
reads the true count on the device; slots past min(count, capacity) are masked.
"""
from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON

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


def _scatter_add_torch(dense, indices, values, counts, base):
    S, cap = indices.shape
    dev = dense.device
    b = _dispatch.as_index_tensor(base, 0, dev)
    slots = torch.arange(cap, device=dev)
    n = dense.numel()
    for s in range(S):
        valid = slots < counts[s].to(torch.int64)
        tgt = torch.where(valid, b + indices[s].to(torch.int64), torch.full_like(slots, n))
        add = torch.where(valid, values[s], torch.zeros_like(values[s]))
        ext = torch.cat([dense.to(torch.float32), dense.new_zeros(1, dtype=torch.float32)])
        ext.index_add_(0, tgt, add)   # indices unique within a source: same order-free sum
        dense.copy_(ext[:n])


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
    if _dispatch.choose(backend, dense.device) == "triton":
        if indices.stride(-1) != 1:
            indices = indices.contiguous()
        if values.stride(-1) != 1:
            values = values.contiguous()
        _scatter_add_triton(dense.view(-1), indices, values, counts.reshape(-1), base)
    else:
        _scatter_add_torch(dense.view(-1), indices, values, counts.reshape(-1), base)
