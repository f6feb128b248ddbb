"""Ok-Topk's owner slot and gathered rows: select-and-compact in a few launches.

Why: the owner's selection (its ``cap_g`` largest |sums| as an ascending slot) and the gather's
global set (the k largest of the P gathered slots, as ascending rows) were chains of small
torch ops on O(k) tensors: 32 + 11 kernel-launching ops of a 96-launch steady step
(``oktopk-bench launches``, P = 4, n = 2^17, 1%; docs/research/launch-budget.md), each a few
microseconds on a GPU for a few hundred kilobytes. Both follow one pattern, kept here as a
pipeline of kernels around the torch ops that need a global view (a k-selection, its min, a
scan): candidates -> magnitudes (-1: invalid) -> ``torch.topk`` -> ``.min()`` = kth ->
:func:`keep_flags` -> ``torch.cumsum`` (positions) -> ONE kernel writing the fixed-capacity
row(s) with their padding and counts (:func:`owner_slot`, :func:`gather_rows`). When the
gathered slots hold at most k entries (Ok-Topk's default capacities) the global set is all of
them: :func:`gather_rows` then copies each slot's count prefix, no flags, no cumsum.

The flags are int64: bit 0 is ``keep``, bit 32 ``valid & |v| >= th`` (the owner's count at the
last global threshold), so ONE cumsum gives both the positions (low word) and both counts
(the last element). The wires' rounding kept in the residual is in ``rounding.py``.

The torch references (``_*_torch``) are the specification; the results are bit for bit those of
the torch ops they replaced (same fp32 operations; ``sum * inv_P`` and ``(f32 - wire) * P`` then
the add are two roundings: the rounding kernel runs with ``enable_fp_fusion=False``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import run as _run
from ._dispatch import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

_HEADER = 2     # int32 words in front of an Ok-Topk slot: count, count at the global threshold
_BLOCK = 1024


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit(do_not_specialize=["m", "n"])
    def _owner_magnitudes_kernel(
        sums_ptr,      # *fp32  [>= slots]  the owner's sums, one slot per distinct index
        key_ptr,       # *int64 [m]         sorted received indices (n: padding)
        first_ptr,     # *bool  [m]         run starts (one per distinct index)
        slot_ptr,      # *int64 [m]         the slot of each sorted index
        mag_ptr,       # *fp32  [m]         out: |sum * inv_p| of a valid run start, else -1
        m, n, inv_p,
        BLOCK: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = e < m
        first = tl.load(first_ptr + e, mask=inb, other=0) != 0
        key = tl.load(key_ptr + e, mask=inb, other=0)
        live = inb & first & (key < n)
        s = tl.load(slot_ptr + e, mask=live, other=0)
        cval = tl.load(sums_ptr + s, mask=live, other=0.0) * inv_p
        valid = live & (cval != 0.0)
        tl.store(mag_ptr + e, tl.where(valid, tl.abs(cval), -1.0), mask=inb)

    @triton.jit(do_not_specialize=["L"])
    def _row_magnitudes_kernel(
        idx_ptr, idx_stride,   # *int32 [R, L] (row stride): -1 marks an empty slot
        val_ptr, val_stride,   # *fp32  [R, L] (row stride): values
        mag_ptr,               # *fp32  [R, L] out (contiguous): |value| where idx >= 0, else -1
        L,
        BLOCK: tl.constexpr,
    ):
        s = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = e < L
        valid = inb & (tl.load(idx_ptr + s * idx_stride + e, mask=inb, other=-1) >= 0)
        v = tl.load(val_ptr + s * val_stride + e, mask=valid, other=0.0)
        tl.store(mag_ptr + s * L + e, tl.where(valid, tl.abs(v), -1.0), mask=inb)

    @triton.jit(do_not_specialize=["L"])
    def _keep_flags_kernel(
        mag_ptr, mag_stride,   # *fp32 [R, L] (row stride): magnitudes, -1 for invalid
        kth_ptr,       # *fp32 []           keep needs mag >= kth (if HAS_KTH)
        th_ptr,        # *fp32 []           bit 32: valid & mag >= th (if HAS_TH)
        flags_ptr,     # *int64 [R, L]      out (contiguous)
        L,
        HAS_KTH: tl.constexpr, HAS_TH: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        s = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = e < L
        mag = tl.load(mag_ptr + s * mag_stride + e, mask=inb, other=-1.0)
        valid = mag != -1.0
        keep = valid
        if HAS_KTH:
            keep = keep & (mag >= tl.load(kth_ptr))
        f = keep.to(tl.int64)
        if HAS_TH:
            f = f | ((valid & (mag >= tl.load(th_ptr))).to(tl.int64) << 32)
        tl.store(flags_ptr + s * L + e, f, mask=inb)

    @triton.jit(do_not_specialize=["m", "cg"])
    def _owner_slot_kernel(
        flags_ptr,     # *int64 [m]         keep (bit 0) | at the global threshold (bit 32)
        csum_ptr,      # *int64 [m]         inclusive cumsum of the flags
        key_ptr,       # *int64 [m]         sorted received indices
        slot_ptr,      # *int64 [m]         the slot of each sorted index
        sums_ptr,      # *fp32  [>= slots]  the owner's sums
        out_ptr,       # *int32 [2 + 2cg]   out: count, count at th, cg indices, cg fp32 bits
        hdr_ptr,       # *int32 []          out (if HAS_HDR): the count at th again (wire slot)
        m, cg, inv_p,
        HAS_HDR: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0)
        e = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        total = tl.load(csum_ptr + tl.maximum(m - 1, 0), mask=m > 0, other=0)
        count = tl.minimum(total.to(tl.int32), cg)          # low word: kept entries
        inm = e < m
        keep = (tl.load(flags_ptr + e, mask=inm, other=0) & 1) != 0
        pos = tl.load(csum_ptr + e, mask=inm, other=0).to(tl.int32) - 1
        w = inm & keep & (pos < cg)
        idx = tl.load(key_ptr + e, mask=w, other=0).to(tl.int32)
        s = tl.load(slot_ptr + e, mask=w, other=0)
        val = tl.load(sums_ptr + s, mask=w, other=0.0) * inv_p
        p64 = pos.to(tl.int64)
        tl.store(out_ptr + 2 + p64, idx, mask=w)
        tl.store(out_ptr + 2 + cg + p64, val.to(tl.int32, bitcast=True), mask=w)
        pad = (e < cg) & (e >= count)
        tl.store(out_ptr + 2 + e, tl.full([BLOCK], -1, tl.int32), mask=pad)
        tl.store(out_ptr + 2 + cg + e, tl.zeros([BLOCK], dtype=tl.int32), mask=pad)
        if pid == 0:
            at_th = (total >> 32).to(tl.int32)               # high word
            tl.store(out_ptr, count)
            tl.store(out_ptr + 1, at_th)
            if HAS_HDR:
                tl.store(hdr_ptr, at_th)

    @triton.jit(do_not_specialize=["cg"])
    def _gather_rows_kernel(
        g_ptr, g_stride,       # *int32 [R, 2 + 2cg]: gathered slots (header, idx, fp32 bits)
        flags_ptr,     # *int64 [R, cg]     keep in bit 0 (unless PREFIX)
        csum_ptr,      # *int64 [R, cg]     row-wise inclusive cumsum of the flags (unless PREFIX)
        oidx_ptr,      # *int32 [R, cg]     out: kept indices, ascending, -1 padded
        oval_ptr,      # *fp32  [R, cg]     out: their values, 0 padded
        ocnt_ptr,      # *int32 [R]         out: kept per row
        gkeep_ptr,     # *fp32  [R, cg]     out: |value| where kept, else inf
        hsrc_ptr, hsrc_stride,  # *int32 [R] (strided): copied to g[:, 1] (if HAS_HSRC)
        cg,
        PREFIX: tl.constexpr,   # no flags: every entry of a row's count prefix is kept
        HAS_HSRC: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        s = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        e = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = e < cg
        row = g_ptr + s * g_stride
        if PREFIX:
            cnt = tl.minimum(tl.maximum(tl.load(row), 0), cg)
            keep = inb & (e < cnt)
            pos = e
        else:
            cnt = tl.load(csum_ptr + s * cg + cg - 1).to(tl.int32)
            keep = inb & ((tl.load(flags_ptr + s * cg + e, mask=inb, other=0) & 1) != 0)
            pos = (tl.load(csum_ptr + s * cg + e, mask=inb, other=0).to(tl.int32) - 1) \
                .to(tl.int64)
        idx = tl.load(row + 2 + e, mask=inb, other=-1)
        val = tl.load(row + 2 + cg + e, mask=inb, other=0).to(tl.float32, bitcast=True)
        tl.store(oidx_ptr + s * cg + pos, idx, mask=keep)
        tl.store(oval_ptr + s * cg + pos, val, mask=keep)
        pad = inb & (e >= cnt)
        tl.store(oidx_ptr + s * cg + e, tl.full([BLOCK], -1, tl.int32), mask=pad)
        tl.store(oval_ptr + s * cg + e, tl.zeros([BLOCK], dtype=tl.float32), mask=pad)
        tl.store(gkeep_ptr + s * cg + e, tl.where(keep, tl.abs(val), float("inf")), mask=inb)
        if b == 0:
            tl.store(ocnt_ptr + s, cnt)
            if HAS_HSRC:
                tl.store(row + 1, tl.load(hsrc_ptr + s * hsrc_stride))

    def _grid1(L):
        return (max(1, triton.cdiv(L, _BLOCK)),)

    @_dispatch.serialized_when_interpreted
    def _owner_magnitudes_triton(sums, key, first, slot, mag, n, inv_p):
        m = key.numel()
        _owner_magnitudes_kernel[_grid1(m)](sums, key, first, slot, mag, m, n, inv_p,
                                            BLOCK=_BLOCK, num_warps=4)

    @_dispatch.serialized_when_interpreted
    def _row_magnitudes_triton(idx, val, mag):
        R, L = idx.shape
        _row_magnitudes_kernel[(R, triton.cdiv(L, _BLOCK))](
            idx, idx.stride(0), val, val.stride(0), mag, L, BLOCK=_BLOCK, num_warps=4)

    @_dispatch.serialized_when_interpreted
    def _keep_flags_triton(mag, kth, th, flags):
        R, L = mag.shape
        _keep_flags_kernel[(R, triton.cdiv(L, _BLOCK))](
            mag, mag.stride(0), kth if kth is not None else mag,
            th if th is not None else mag, flags, L, HAS_KTH=kth is not None,
            HAS_TH=th is not None, BLOCK=_BLOCK, num_warps=4)

    @_dispatch.serialized_when_interpreted
    def _owner_slot_triton(flags, csum, key, slot, sums, out, hdr, inv_p):
        m, cg = key.numel(), (out.numel() - _HEADER) // 2
        _owner_slot_kernel[_grid1(max(m, cg))](
            flags, csum, key, slot, sums, out, hdr if hdr is not None else out, m, cg, inv_p,
            HAS_HDR=hdr is not None, BLOCK=_BLOCK, num_warps=4)

    @_dispatch.serialized_when_interpreted
    def _gather_rows_triton(g, flags, csum, oidx, oval, ocnt, gkeep, hsrc):
        R, cg = oidx.shape
        prefix = flags is None
        _gather_rows_kernel[(R, triton.cdiv(cg, _BLOCK))](
            g, g.stride(0), oidx if prefix else flags, oidx if prefix else csum, oidx, oval,
            ocnt, gkeep, hsrc if hsrc is not None else ocnt,
            hsrc.stride(0) if hsrc is not None else 0, cg, PREFIX=prefix,
            HAS_HSRC=hsrc is not None, BLOCK=_BLOCK, num_warps=4)

# ----------------------------------------------------------------------------------------------
# torch references (the specification)
# ----------------------------------------------------------------------------------------------
def _owner_magnitudes_torch(sums, key, first, slot, mag, n, inv_p):
    cval = sums.gather(0, slot) * inv_p
    valid = first & (key < n) & (cval != 0)
    mag.copy_(torch.where(valid, cval.abs(), torch.full_like(cval, -1.0)))


def _row_magnitudes_torch(idx, val, mag):
    mag.copy_(torch.where(idx >= 0, val.abs(), torch.full_like(val, -1.0)))


def _keep_flags_torch(mag, kth, th, flags):
    valid = mag != -1
    keep = valid if kth is None else valid & (mag >= kth)
    f = keep.to(torch.int64)
    if th is not None:
        f = f | ((valid & (mag >= th)).to(torch.int64) << 32)
    flags.copy_(f)


def _owner_slot_torch(flags, csum, key, slot, sums, out, hdr, inv_p):
    m, cg = key.numel(), (out.numel() - _HEADER) // 2
    keep = (flags & 1) != 0
    pos = (csum & 0xFFFFFFFF) - 1
    tgt = torch.where(keep & (pos < cg), pos, torch.full_like(pos, cg))
    cval = sums.gather(0, slot) * inv_p
    ext_i = torch.full((cg + 1,), -1, dtype=torch.int32, device=out.device) \
        .scatter_(0, tgt, key.to(torch.int32))
    ext_v = torch.zeros(cg + 1, dtype=torch.float32, device=out.device).scatter_(0, tgt, cval)
    total = csum[-1] if m else torch.zeros((), dtype=torch.int64, device=out.device)
    out[_HEADER:_HEADER + cg] = ext_i[:cg]
    out[_HEADER + cg:] = ext_v[:cg].view(torch.int32)
    out[0] = (total & 0xFFFFFFFF).clamp(max=cg)
    out[1] = total >> 32
    if hdr is not None:
        hdr.copy_(out[1])


def _gather_rows_torch(g, flags, csum, oidx, oval, ocnt, gkeep, hsrc):
    R, cg = oidx.shape
    gidx = g[:, _HEADER:_HEADER + cg]
    gval = g[:, _HEADER + cg:].view(torch.float32)
    if flags is None:   # the count prefix of each row, as it is
        cnt = g[:, 0].clamp(0, cg)
        keep = torch.arange(cg, device=g.device) < cnt.reshape(R, 1)
        oidx.copy_(torch.where(keep, gidx, -1))
        oval.copy_(torch.where(keep, gval, 0.0))
        ocnt.copy_(cnt)
    else:
        keep = (flags & 1) != 0
        low = csum & 0xFFFFFFFF
        tgt = torch.where(keep, low - 1, torch.full_like(csum, cg))
        oidx.copy_(torch.full((R, cg + 1), -1, dtype=torch.int32, device=g.device)
                   .scatter_(1, tgt, gidx)[:, :cg])
        oval.copy_(torch.zeros(R, cg + 1, dtype=torch.float32, device=g.device)
                   .scatter_(1, tgt, gval)[:, :cg])
        ocnt.copy_(low[:, -1])
    gkeep.copy_(torch.where(keep, gval.abs(), torch.full_like(gval, float("inf"))))
    if hsrc is not None:
        g[:, 1] = hsrc



# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------
def _need(t: Tensor, name: str, dtype: torch.dtype, dim: int) -> None:
    if not isinstance(t, Tensor) or t.dtype != dtype or t.dim() != dim:
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a {dim}-dim {dtype} tensor, got {got}")


def owner_magnitudes(sums: Tensor, sorted_keys: Tensor, run_start: Tensor, slot_ids: Tensor,
                     n: int, inv_p: float, *, backend: str = "auto") -> Tensor:
    """The owner's candidates as magnitudes, fp32 [m]: ``|sums[slot_ids[i]] * inv_p|`` where
    ``run_start[i]`` (one per distinct index), ``sorted_keys[i] < n`` (not padding) and the sum
    is nonzero; -1 elsewhere. ``sorted_keys`` int64 [m], ``run_start`` bool [m], ``slot_ids``
    int64 [m] (each in ``[0, sums.numel())``), ``sums`` fp32 contiguous. One launch."""
    _need(sums, "sums", torch.float32, 1)
    _need(sorted_keys, "sorted_keys", torch.int64, 1)
    _need(run_start, "run_start", torch.bool, 1)
    _need(slot_ids, "slot_ids", torch.int64, 1)
    m = sorted_keys.numel()
    if run_start.numel() != m or slot_ids.numel() != m:
        raise ValueError(f"run_start and slot_ids need {m} entries (as sorted_keys), got "
                         f"{run_start.numel()} and {slot_ids.numel()}")
    if not (sums.is_contiguous() and sorted_keys.is_contiguous() and run_start.is_contiguous()
            and slot_ids.is_contiguous()):
        raise ValueError("owner_magnitudes: sums, sorted_keys, run_start, slot_ids must be "
                         "contiguous")
    mag = torch.empty(m, dtype=torch.float32, device=sums.device)
    _dispatch.record(launches=1, bytes=8 * m + m + 8 * m + 4 * m + 4 * m)
    if m:
        _run(backend, sums.device, _owner_magnitudes_triton if HAS_TRITON else None,
             _owner_magnitudes_torch, sums, sorted_keys, run_start, slot_ids, mag, int(n),
             float(inv_p))
    return mag


def row_magnitudes(indices: Tensor, values: Tensor, *, backend: str = "auto") -> Tensor:
    """Rows as magnitudes, fp32 [R, L] contiguous: ``|values|`` where ``indices >= 0``, else -1.
    ``indices`` int32 and ``values`` fp32, both [R, L] with inner stride 1. One launch."""
    _need(indices, "indices", torch.int32, 2)
    _need(values, "values", torch.float32, 2)
    if indices.shape != values.shape:
        raise ValueError(f"indices and values must have one shape [R, L], got "
                         f"{tuple(indices.shape)} and {tuple(values.shape)}")
    R, L = indices.shape
    if L > 1 and (indices.stride(1) != 1 or values.stride(1) != 1):
        raise ValueError("row_magnitudes: indices/values need inner stride 1")
    mag = torch.empty(R, L, dtype=torch.float32, device=values.device)
    _dispatch.record(launches=1, bytes=12 * R * L)
    if R * L:
        _run(backend, values.device, _row_magnitudes_triton if HAS_TRITON else None,
             _row_magnitudes_torch, indices, values, mag)
    return mag


def keep_flags(mag: Tensor, *, kth: Optional[Tensor] = None, th: Optional[Tensor] = None,
               backend: str = "auto") -> Tensor:
    """Candidates' flags, int64 [R, L] contiguous: bit 0 ``keep = valid & (mag >= kth)``
    (``kth=None``: ``valid``), bit 32 (with ``th``) ``valid & (mag >= th)``, from magnitudes
    ``mag`` fp32 [R, L] (inner stride 1; valid where ``!= -1``, as :func:`owner_magnitudes`
    and :func:`row_magnitudes` write them). ``kth`` and ``th`` are fp32 one-element device
    tensors (no host read). One launch; a cumsum of the flags gives positions (low word) and
    counts of both."""
    _need(mag, "mag", torch.float32, 2)
    for name, t in (("kth", kth), ("th", th)):
        if t is not None and (not isinstance(t, Tensor) or t.dtype != torch.float32
                              or t.numel() != 1):
            raise ValueError(f"keep_flags: {name} must be a one-element fp32 tensor, got "
                             f"{t.dtype if isinstance(t, Tensor) else type(t).__name__}")
    R, L = mag.shape
    if L > 1 and mag.stride(1) != 1:
        raise ValueError("keep_flags: mag needs inner stride 1")
    kth = None if kth is None else kth.reshape(())
    th = None if th is None else th.reshape(())
    flags = torch.empty(R, L, dtype=torch.int64, device=mag.device)
    _dispatch.record(launches=1, bytes=12 * R * L)
    if R * L:
        _run(backend, mag.device, _keep_flags_triton if HAS_TRITON else None, _keep_flags_torch,
             mag, kth, th, flags)
    return flags


def owner_slot(out: Tensor, flags: Tensor, csum: Tensor, sorted_keys: Tensor, slot_ids: Tensor,
               sums: Tensor, inv_p: float, *, header_out: Optional[Tensor] = None,
               backend: str = "auto") -> None:
    """Write the owner's slot ``out`` (int32 [2 + 2cg]) from its kept candidates, in place:
    ``[min(kept, cg), at_th, cg indices, cg values as fp32 bits]``, the kept ones in candidate
    order (candidate i at position ``low32(csum[i]) - 1`` when below cg), -1 / 0 past the count.
    A kept candidate's index is ``int32(sorted_keys[i])``, its value
    ``sums[slot_ids[i]] * inv_p``. ``flags`` int64 [m] (:func:`keep_flags` with ``th``),
    ``csum`` its inclusive cumsum (int64 [m]): ``kept`` is the low word of its last element,
    ``at_th`` the high word. ``header_out`` (int32, one element): receives ``at_th`` too (the
    compact wire's slot header). One launch."""
    _need(out, "out", torch.int32, 1)
    for name, t in (("flags", flags), ("csum", csum), ("sorted_keys", sorted_keys),
                    ("slot_ids", slot_ids)):
        _need(t.reshape(-1) if isinstance(t, Tensor) else t, name, torch.int64, 1)
    _need(sums, "sums", torch.float32, 1)
    flags, csum = flags.reshape(-1), csum.reshape(-1)
    m = sorted_keys.numel()
    if flags.numel() != m or csum.numel() != m or slot_ids.numel() != m:
        raise ValueError(f"flags, csum and slot_ids need {m} entries (as sorted_keys), got "
                         f"{flags.numel()}, {csum.numel()}, {slot_ids.numel()}")
    if out.numel() < _HEADER or (out.numel() - _HEADER) % 2:
        raise ValueError(f"out must hold 2 + 2*cg int32 words, got {out.numel()}")
    if not all(t.is_contiguous() for t in (out, flags, csum, sorted_keys, slot_ids, sums)):
        raise ValueError("owner_slot: out, flags, csum, sorted_keys, slot_ids, sums must be "
                         "contiguous")
    if header_out is not None:
        if header_out.dtype != torch.int32 or header_out.numel() != 1:
            raise ValueError("owner_slot: header_out must be a one-element int32 tensor")
        header_out = header_out.reshape(())
    _dispatch.record(launches=1, bytes=16 * m + 8 * out.numel())
    _run(backend, out.device, _owner_slot_triton if HAS_TRITON else None, _owner_slot_torch,
         flags, csum, sorted_keys, slot_ids, sums, out, header_out, float(inv_p))


def gather_rows(gathered: Tensor, flags: Optional[Tensor] = None,
                csum: Optional[Tensor] = None, *, th_counts: Optional[Tensor] = None,
                backend: str = "auto") -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """The global set as rows, from the gathered slots ``gathered`` (int32 [R, 2 + 2cg], inner
    stride 1: count, count at th, cg indices, cg fp32 bits). Returns ``(idx int32 [R, cg],
    val fp32 [R, cg], cnt int32 [R], gval_keep fp32 [R, cg])``: the kept entries in slot
    order, -1 / 0 padded, the kept count per row, and ``|value|`` where kept (inf elsewhere).

    Kept: bit 0 of ``flags`` (int64 [R, cg]), placed by ``csum`` (their row-wise inclusive
    cumsum); or, with neither, every entry of a row's count prefix: the first
    ``clamp(gathered[s, 0], 0, cg)`` (an Ok-Topk slot holds its valid entries there, the wire
    keeps them so: then ``index >= 0`` marks the same entries). ``th_counts`` (int32 [R], any
    stride): written to ``gathered[:, 1]`` (the compact wire carries that header word apart).
    One launch."""
    _need(gathered, "gathered", torch.int32, 2)
    if (flags is None) != (csum is None):
        raise ValueError("gather_rows: pass both flags and csum, or neither (the count prefix)")
    R, cg = gathered.shape[0], (gathered.shape[1] - _HEADER) // 2
    if flags is not None:
        _need(flags, "flags", torch.int64, 2)
        _need(csum, "csum", torch.int64, 2)
        R, cg = flags.shape
        if csum.shape != (R, cg) or not flags.is_contiguous() or not csum.is_contiguous():
            raise ValueError(f"gather_rows: csum must be contiguous [R, cg] as flags "
                             f"{tuple(flags.shape)}, got {tuple(csum.shape)}")
    if cg < 1 or gathered.shape != (R, _HEADER + 2 * cg):
        raise ValueError(f"gathered must be [R, 2 + 2*cg] with cg >= 1 (as flags), got "
                         f"{tuple(gathered.shape)}")
    if gathered.stride(1) != 1:
        raise ValueError("gather_rows: gathered needs inner stride 1")
    if th_counts is not None:
        if th_counts.dtype != torch.int32 or th_counts.numel() != R:
            raise ValueError(f"gather_rows: th_counts must be int32 [{R}]")
        th_counts = th_counts.reshape(R)
    dev = gathered.device
    oidx = torch.empty(R, cg, dtype=torch.int32, device=dev)
    oval = torch.empty(R, cg, dtype=torch.float32, device=dev)
    ocnt = torch.empty(R, dtype=torch.int32, device=dev)
    gkeep = torch.empty(R, cg, dtype=torch.float32, device=dev)
    _dispatch.record(launches=1, bytes=(24 if flags is None else 40) * R * cg)
    _run(backend, dev, _gather_rows_triton if HAS_TRITON else None, _gather_rows_torch,
         gathered, flags, csum, oidx, oval, ocnt, gkeep, th_counts)
    return oidx, oval, ocnt, gkeep


# ----------------------------------------------------------------------------------------------
# the CPU compile check (kernels/_compile_check.py): every kernel as its launcher launches it
# ----------------------------------------------------------------------------------------------
def compile_variants():
    """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps[, options]) per
    variant, as the launchers launch them (the rounding kernel without fp fusion)."""
    yield ("compaction owner_magnitudes", _owner_magnitudes_kernel,
           {"sums_ptr": "*fp32", "key_ptr": "*i64", "first_ptr": "*u1", "slot_ptr": "*i64",
            "mag_ptr": "*fp32", "m": "i64", "n": "i64", "inv_p": "fp32", "BLOCK": "constexpr"},
           {"BLOCK": _BLOCK}, [0, 1, 2, 3, 4], 4)
    yield ("compaction row_magnitudes", _row_magnitudes_kernel,
           {"idx_ptr": "*i32", "idx_stride": "i32", "val_ptr": "*fp32", "val_stride": "i32",
            "mag_ptr": "*fp32", "L": "i64", "BLOCK": "constexpr"},
           {"BLOCK": _BLOCK}, [0, 2, 4], 4)
    ksig = {"mag_ptr": "*fp32", "mag_stride": "i32", "kth_ptr": "*fp32", "th_ptr": "*fp32",
            "flags_ptr": "*i64", "L": "i64", "HAS_KTH": "constexpr", "HAS_TH": "constexpr",
            "BLOCK": "constexpr"}
    for kth, th in ((True, True), (False, True), (True, False)):
        yield (f"compaction keep_flags kth={kth} th={th}", _keep_flags_kernel, ksig,
               {"HAS_KTH": kth, "HAS_TH": th, "BLOCK": _BLOCK}, [0, 4], 4)
    for hdr in (False, True):
        yield (f"compaction owner_slot hdr={hdr}", _owner_slot_kernel,
               {"flags_ptr": "*i64", "csum_ptr": "*i64", "key_ptr": "*i64", "slot_ptr": "*i64",
                "sums_ptr": "*fp32", "out_ptr": "*i32", "hdr_ptr": "*i32", "m": "i64",
                "cg": "i64", "inv_p": "fp32", "HAS_HDR": "constexpr", "BLOCK": "constexpr"},
               {"HAS_HDR": hdr, "BLOCK": _BLOCK}, [0, 1, 2, 3, 4, 5], 4)
    for prefix in (False, True):
        flag_t = "*i32" if prefix else "*i64"       # prefix: the output stands in for both
        for hsrc in (False, True):
            yield (f"compaction gather_rows prefix={prefix} hsrc={hsrc}", _gather_rows_kernel,
                   {"g_ptr": "*i32", "g_stride": "i32", "flags_ptr": flag_t, "csum_ptr": flag_t,
                    "oidx_ptr": "*i32", "oval_ptr": "*fp32", "ocnt_ptr": "*i32",
                    "gkeep_ptr": "*fp32", "hsrc_ptr": "*i32", "hsrc_stride": "i32", "cg": "i64",
                    "PREFIX": "constexpr", "HAS_HSRC": "constexpr", "BLOCK": "constexpr"},
                   {"PREFIX": prefix, "HAS_HSRC": hsrc, "BLOCK": _BLOCK},
                   [0, 2, 3, 4, 5, 6, 7], 4)
