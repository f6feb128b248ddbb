"""The wires' rounding kept in the residual, each in one launch (Ok-Topk's compact and
quantized wires).

Why: what a packed wire rounds away must stay owed, or conservation breaks. The owner keeps its
slot's bf16 rounding (:func:`keep_slot_rounding`, one launch instead of seven torch ops) and a
rank keeps the quantization error of each entry it sent that the gather delivered
(:func:`keep_row_error`: a binary search of each sent entry in the gathered rows).

The torch references (``_*_torch``) are the specification; the results are bit for bit those of
the torch ops they replaced (``(f32 - wire) * P`` then the add are two roundings: the kernels run
with ``enable_fp_fusion=False``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import run as _run
from ._dispatch import HAS_TRITON
from .compaction import _BLOCK, _HEADER, _need

if HAS_TRITON:
    import triton
    import triton.language as tl


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit(do_not_specialize=["cg"])
    def _slot_rounding_kernel(
        res_ptr,       # *fp32  [n]         residual, += at the delivered entries
        slot_ptr,      # *int32 [2 + 2cg]   the owner's slot: count, _, indices, fp32 bits
        wire_ptr,      # *int32 [2 + 2cg]   the same slot as gathered (the wire's values)
        keep_ptr,      # *int64 [cg]        the gather's flags of this slot (bit 0: delivered;
                       #                    if HAS_KEEP, else all within the count)
        base_ptr,      # *int64 []          the region's start
        nf_ptr,        # *int32 []          non-finite flag (if HAS_NF): nothing on a bad step
        cg, p_f,
        HAS_KEEP: tl.constexpr, HAS_NF: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        cnt = tl.minimum(tl.load(slot_ptr), cg)
        if HAS_NF:
            cnt = tl.where(tl.load(nf_ptr) == 0, cnt, 0)     # a non-finite step: nothing
        w = e < cnt
        if HAS_KEEP:
            w = w & ((tl.load(keep_ptr + e, mask=w, other=0) & 1) != 0)
        idx = tl.load(slot_ptr + 2 + e, mask=w, other=-1)
        w = w & (idx >= 0)
        f32 = tl.load(slot_ptr + 2 + cg + e, mask=w, other=0).to(tl.float32, bitcast=True)
        wire = tl.load(wire_ptr + 2 + cg + e, mask=w, other=0).to(tl.float32, bitcast=True)
        err = (f32 - wire) * p_f
        ptr = res_ptr + tl.load(base_ptr) + idx.to(tl.int64)
        tl.store(ptr, tl.load(ptr, mask=w, other=0.0) + err, mask=w)

    @triton.jit(do_not_specialize=["idx_stride", "val_stride", "wire_stride", "got_stride",
                                   "cnt_stride", "gcnt_stride", "cr", "cg", "steps"])
    def _row_error_kernel(
        res_ptr,       # *fp32  [n]        residual, += at the delivered row entries
        idx_ptr,       # *int32 [P, cr]    the rows this rank sent (region-relative, ascending
                       #                   or not), row stride idx_stride
        val_ptr,       # *fp32  [P, cr]    their values as selected, row stride val_stride
        wire_ptr,      # *fp32  [P, cr]    what the wire carried for each (the levels), row
                       #                   stride wire_stride
        cnt_ptr,       # *int32 [P]        the rows' true counts (may exceed cr), stride
                       #                   cnt_stride (Ok-Topk's: the messages' header column)
        got_ptr,       # *int32 [P, cg]    the delivered indices per row, ascending prefix
        gcnt_ptr,      # *int32 [P]        the delivered counts, stride gcnt_stride
        base_ptr,      # *int64 [P]        the regions' starts
        idx_stride, val_stride, wire_stride, got_stride, cnt_stride, gcnt_stride, cr, cg,
        steps,         # binary-search steps: bit length of cg
        BLOCK: tl.constexpr,
    ):
        j = tl.program_id(0)
        i = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        w = i < tl.minimum(tl.load(cnt_ptr + j * cnt_stride), cr)
        target = tl.load(idx_ptr + j * idx_stride + i, mask=w, other=-1)
        w = w & (target >= 0)
        got = got_ptr + j * got_stride
        gcnt = tl.minimum(tl.load(gcnt_ptr + j * gcnt_stride), cg).to(tl.int64)
        lo = tl.zeros([BLOCK], dtype=tl.int64)         # the first delivered index >= target
        hi = tl.zeros([BLOCK], dtype=tl.int64) + gcnt
        for _ in range(steps):
            open_ = w & (lo < hi)
            mid = (lo + hi) // 2
            right = open_ & (tl.load(got + mid, mask=open_, other=0) < target)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(open_ & ~right, mid, hi)
        hit = w & (lo < gcnt)
        hit = hit & (tl.load(got + lo, mask=hit, other=-1) == target)
        err = tl.load(val_ptr + j * val_stride + i, mask=hit, other=0.0) - \
            tl.load(wire_ptr + j * wire_stride + i, mask=hit, other=0.0)
        ptr = res_ptr + tl.load(base_ptr + j) + target.to(tl.int64)
        tl.store(ptr, tl.load(ptr, mask=hit, other=0.0) + err, mask=hit)

    def _grid1(L):
        return (max(1, triton.cdiv(L, _BLOCK)),)

    @_dispatch.serialized_when_interpreted
    def _slot_rounding_triton(res, slot, wire, keep, base, nf, P):
        cg = (slot.numel() - _HEADER) // 2
        _slot_rounding_kernel[_grid1(cg)](
            res, slot, wire, keep if keep is not None else base, base,
            nf if nf is not None else slot, cg, float(P), HAS_KEEP=keep is not None,
            HAS_NF=nf is not None, BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)

    @_dispatch.serialized_when_interpreted
    def _row_error_triton(res, idx, val, wire, cnt, got, gcnt, base):
        P, cr = idx.shape
        cg = got.shape[1]
        _row_error_kernel[(P, triton.cdiv(cr, _BLOCK))](
            res, idx, val, wire, cnt, got, gcnt, base, idx.stride(0), val.stride(0),
            wire.stride(0), got.stride(0), cnt.stride(0), gcnt.stride(0), cr, cg,
            cg.bit_length(), BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)



# ----------------------------------------------------------------------------------------------
# torch references (the specification)
# ----------------------------------------------------------------------------------------------
def _slot_rounding_torch(res, slot, wire, keep, base, nf, P):
    cg = (slot.numel() - _HEADER) // 2
    mine = (keep & 1) != 0 if keep is not None else torch.ones(cg, dtype=torch.bool,
                                                               device=res.device)
    if nf is not None:
        mine = mine & (nf == 0)
    f32 = slot[_HEADER + cg:].view(torch.float32)
    err = (f32 - wire[_HEADER + cg:].view(torch.float32)) * float(P)
    idx = torch.where(mine, slot[_HEADER:_HEADER + cg], -1)
    valid = (torch.arange(cg, device=res.device) < slot[0].to(torch.int64)) & (idx >= 0)
    _dispatch.scatter_valid(res, base + idx.to(torch.int64), err, valid, add=True)


def _row_error_torch(res, idx, val, wire, cnt, got, gcnt, base):
    P, cr = idx.shape
    cg = got.shape[1]
    dev = res.device
    live = torch.arange(cg, device=dev) < gcnt.reshape(P, 1).to(torch.int64)
    got = torch.where(live, got, torch.full_like(got, torch.iinfo(torch.int32).max)).contiguous()
    pos = torch.searchsorted(got, idx.contiguous()).clamp_(max=cg - 1)
    hit = ((got.gather(1, pos) == idx) & (idx >= 0)
           & (torch.arange(cr, device=dev) < cnt.reshape(P, 1).to(torch.int64)))
    _dispatch.scatter_valid(res, base.reshape(P, 1) + idx.to(torch.int64), val - wire, hit,
                            add=True)


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------
def keep_slot_rounding(residual: Tensor, slot: Tensor, wire_slot: Tensor,
                       keep: Optional[Tensor], base: Tensor, P: int,
                       nonfinite: Optional[Tensor] = None, *, backend: str = "auto") -> None:
    """Compact wire, the owner's side: ``residual[base + idx] += (f32 - wire) * P`` at every
    delivered entry of its slot, where ``slot`` (int32 [2 + 2cg]) is what it sent as fp32 and
    ``wire_slot`` (int32 [2 + 2cg]) the same slot as every rank decoded it. Delivered: among
    the slot's first ``min(slot[0], cg)`` entries, those with bit 0 of ``keep`` (int64 [cg],
    the gather's flags of this slot; None: all of them) and, with ``nonfinite`` (int32, one
    element), only on a finite step. ``base`` int64, one element. Two roundings, as torch:
    the difference times P, then the add. One launch."""
    _need(residual, "residual", torch.float32, 1)
    _need(slot, "slot", torch.int32, 1)
    _need(wire_slot, "wire_slot", torch.int32, 1)
    cg = (slot.numel() - _HEADER) // 2
    if keep is not None:
        _need(keep, "keep", torch.int64, 1)
        if keep.numel() != cg:
            raise ValueError(f"keep must hold cg = {cg} flags for a slot of {slot.numel()} "
                             f"words, got {keep.numel()}")
    if slot.numel() != _HEADER + 2 * cg or wire_slot.numel() != slot.numel():
        raise ValueError(f"slot and wire_slot must hold the same 2 + 2*cg words, got "
                         f"{slot.numel()} and {wire_slot.numel()}")
    keep_ = slot if keep is None else keep
    if not all(t.is_contiguous() for t in (residual, slot, wire_slot, keep_)):
        raise ValueError("keep_slot_rounding: residual, slot, wire_slot, keep must be contiguous")
    if base.dtype != torch.int64 or base.numel() != 1:
        raise ValueError("keep_slot_rounding: base must be a one-element int64 tensor")
    if nonfinite is not None:
        if nonfinite.dtype != torch.int32 or nonfinite.numel() != 1:
            raise ValueError("keep_slot_rounding: nonfinite must be a one-element int32 tensor")
        nonfinite = nonfinite.reshape(())
    _dispatch.record(launches=1, bytes=28 * cg)
    if cg:
        _run(backend, residual.device, _slot_rounding_triton if HAS_TRITON else None,
             _slot_rounding_torch, residual, slot, wire_slot, keep, base.reshape(()), nonfinite,
             int(P))


def keep_row_error(residual: Tensor, indices: Tensor, values: Tensor, wire: Tensor,
                   counts: Tensor, delivered: Tensor, delivered_counts: Tensor, row_base: Tensor,
                   *, backend: str = "auto") -> None:
    """Quantized wire, the sender's side: ``residual[row_base[j] + indices[j, i]] += values[j, i]
    - wire[j, i]`` for every entry this rank sent in row j (``i < min(counts[j], cr)``,
    ``indices >= 0``) that was delivered: one of the first ``min(delivered_counts[j], cg)``
    entries of ``delivered[j]`` (ascending; found by a binary search). ``indices`` and
    ``delivered`` int32 [P, cr] / [P, cg], ``values`` and ``wire`` fp32 [P, cr] (every row
    stride any, inner stride 1), ``counts`` / ``delivered_counts`` int32 [P] (any stride),
    ``row_base`` int64 [P]; the rows lie in disjoint regions. Two roundings, as torch: the
    difference, then the add. One launch (it was 16 torch ops and P scatter launches)."""
    _need(residual, "residual", torch.float32, 1)
    _need(indices, "indices", torch.int32, 2)
    _need(delivered, "delivered", torch.int32, 2)
    P, cr = indices.shape
    for t, name in ((values, "values"), (wire, "wire")):
        _need(t, name, torch.float32, 2)
        if t.shape != indices.shape:
            raise ValueError(f"keep_row_error: {name} must have the shape of indices, "
                             f"{(P, cr)}, got {tuple(t.shape)}")
    if delivered.shape[0] != P:
        raise ValueError(f"keep_row_error: delivered must have P = {P} rows, got "
                         f"{delivered.shape[0]}")
    if any(t.shape[1] > 1 and t.stride(1) != 1 for t in (indices, values, wire, delivered)):
        raise ValueError("keep_row_error: indices, values, wire and delivered need an inner "
                         "stride of 1")
    counts, delivered_counts = counts.reshape(-1), delivered_counts.reshape(-1)
    row_base = row_base.reshape(-1)
    if (counts.dtype, delivered_counts.dtype, row_base.dtype) != (torch.int32,) * 2 + (
            torch.int64,) or not counts.numel() == delivered_counts.numel() == row_base.numel() \
            == P or not residual.is_contiguous():
        raise ValueError(f"keep_row_error: counts and delivered_counts int32 [{P}], row_base "
                         f"int64 [{P}], residual contiguous")
    cg = delivered.shape[1]
    _dispatch.record(launches=1, bytes=P * cr * (16 + 4 * max(1, cg.bit_length())))
    if cr and cg:
        _run(backend, residual.device, _row_error_triton if HAS_TRITON else None,
             _row_error_torch, residual, indices, values, wire, counts, delivered,
             delivered_counts, row_base)


# ----------------------------------------------------------------------------------------------
# the CPU compile check (kernels/_compile_check.py): every kernel as its launcher launches it
# ----------------------------------------------------------------------------------------------
def compile_variants():
    """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps[, options]) per
    variant, as the launchers launch them (without fp fusion)."""
    for keep in (False, True):
        for nf in (False, True):
            yield (f"rounding slot_rounding keep={keep} nf={nf}", _slot_rounding_kernel,
                   {"res_ptr": "*fp32", "slot_ptr": "*i32", "wire_ptr": "*i32",
                    "keep_ptr": "*i64", "base_ptr": "*i64", "nf_ptr": "*i32", "cg": "i64",
                    "p_f": "fp32", "HAS_KEEP": "constexpr", "HAS_NF": "constexpr",
                    "BLOCK": "constexpr"},
                   {"HAS_KEEP": keep, "HAS_NF": nf, "BLOCK": _BLOCK}, [0, 1, 3, 4, 5], 4,
                   {"enable_fp_fusion": False})
    yield ("rounding row_error", _row_error_kernel,
           {"res_ptr": "*fp32", "idx_ptr": "*i32", "val_ptr": "*fp32", "wire_ptr": "*fp32",
            "cnt_ptr": "*i32", "got_ptr": "*i32", "gcnt_ptr": "*i32", "base_ptr": "*i64",
            "idx_stride": "i32", "val_stride": "i32", "wire_stride": "i32", "got_stride": "i32",
            "cnt_stride": "i32", "gcnt_stride": "i32", "cr": "i64", "cg": "i64", "steps": "i32",
            "BLOCK": "constexpr"},
           {"BLOCK": _BLOCK}, [0, 1, 2, 3, 4, 5, 6, 7], 4, {"enable_fp_fusion": False})
