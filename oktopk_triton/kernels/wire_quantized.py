"""The 2-bit / 4-bit wire's encode and decode (``wire_format="q2"`` / ``"q4"``,
oktopk_triton/algorithms/_wire.py, docs/algorithms.md §9) as Triton passes, a torch reference
beside each.

* :func:`quantized_encode`: a memset of the ``[rows, 6, chunks]`` int64 table, then passes over
  the row's slots: ``stats`` (per chunk: the count, and the largest exponent (q2) or the
  smallest and largest magnitude bits (q4), integer atomics; it also zeroes the row's packed
  words), for q2 ``sum`` (the magnitudes' fixed-point sum) and ``split`` (the count and the sum
  of the magnitudes at or above the chunk's mean), and ``finish``: each entry's code from its
  chunk's scales, its place in the row (in place for ascending rows; grouped by chunk with a
  cursor per chunk otherwise, as the compact wire), the 16-bit index and the code OR-ed into
  their words, what the wire carries for its input slot, and the chunk words (count, base,
  step). q2: 5 launches, q4: 3. Nothing is sorted, no host read, static sizes.
* :func:`quantized_decode`: ONE launch, each slot's chunk from the running counts as the
  compact decode finds it.
* :data:`Q2` and :data:`Q4` are the format objects (``wire_format="q2"`` / ``"q4"``,
  :mod:`.wire_format`): their bytes per entry, row words, encode and decode.

Measured why: docs/research/design-notes.md, ``oktopk_triton/kernels/wire_quantized.py``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON
from .wire import _valid_slots, group_positions, sent_slots, slot_chunks, sorted_rows
from .wire_format import CHUNK_BITS, WireFormat, chunks, decode_rows, masked_rows, register

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .wire import _decode_slots, _store_decoded, _sum_below   # shared with the compact wire

_LOW = (1 << CHUNK_BITS) - 1
_INF_BITS = 0x7F800000
_TABLE = 6          # count, emax | inverted min bits, sum | max bits, n_hi, s_hi, cursor

if HAS_TRITON:

    @triton.jit
    def _fixed_terms(a, emax):
        """The fixed-point units of magnitudes ``a`` (fp32, >= 0) at their chunk's exponent."""
        bits = a.to(tl.int32, bitcast=True).to(tl.int64)
        e = bits >> 23
        m = (bits & 0x7FFFFF) | tl.where(e > 0, 0x800000, 0)
        shift = tl.minimum(tl.maximum(emax - tl.maximum(e, 1), 0), 63)
        return (m << 16) >> shift

    @triton.jit
    def _fixed_value(units, emax):
        """A sum of units back in fp32: ``fp32(units) · 2^-39 · 2^(emax-127)``."""
        p = (tl.minimum(tl.maximum(emax, 1), 254).to(tl.int32) << 23).to(tl.float32,
                                                                          bitcast=True)
        return units.to(tl.float32) * 1.8189894035458565e-12 * p

    @triton.jit
    def _mean_of(tab, hi, C, mask):
        cnt = tl.load(tab + hi, mask=mask, other=0)
        emax = tl.load(tab + C + hi, mask=mask, other=0)
        tot = tl.load(tab + 2 * C + hi, mask=mask, other=0)
        return tl.math.div_rn(_fixed_value(tot, emax), tl.maximum(cnt, 1).to(tl.float32))

    @triton.jit
    def _scales(tab, hi, C, mask, Q2: tl.constexpr, TOP: tl.constexpr):
        """``(base, step)`` of chunks ``hi`` from the row's table."""
        cnt = tl.load(tab + hi, mask=mask, other=0)
        if Q2:
            emax = tl.load(tab + C + hi, mask=mask, other=0)
            tot = tl.load(tab + 2 * C + hi, mask=mask, other=0)
            nhi = tl.load(tab + 3 * C + hi, mask=mask, other=0)
            shi = tl.load(tab + 4 * C + hi, mask=mask, other=0)
            chi = tl.math.div_rn(_fixed_value(shi, emax), tl.maximum(nhi, 1).to(tl.float32))
            nlo = cnt - nhi
            clo = tl.math.div_rn(_fixed_value(tot - shi, emax),
                                 tl.maximum(nlo, 1).to(tl.float32))
            clo = tl.where(nlo > 0, clo, chi)
            return clo, chi - clo
        else:
            inv = tl.load(tab + C + hi, mask=mask, other=0)
            mxb = tl.load(tab + 2 * C + hi, mask=mask, other=0)
            mn = (0x7F800000 - inv).to(tl.int32).to(tl.float32, bitcast=True)
            base = tl.where(cnt > 0, mn, 0.0)
            mx = mxb.to(tl.int32).to(tl.float32, bitcast=True)
            step = tl.math.div_rn(mx - base, tl.zeros_like(base) + TOP)
            return base, step

    @triton.jit
    def _slots(idx_ptr, val_ptr, cnt_ptr, cap, C, idx_stride, val_stride, cnt_stride,
               HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
        """Program (s, b)'s slots: ``(slots, valid, index, value, chunk)``."""
        s = tl.program_id(0).to(tl.int64)
        slots = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        n_valid = cap
        if HAS_COUNTS:
            n_valid = tl.minimum(tl.maximum(tl.load(cnt_ptr + s * cnt_stride).to(tl.int64), 0),
                                 cap)
        valid = slots < n_valid
        idx = tl.load(idx_ptr + s * idx_stride + slots, mask=valid, other=0).to(tl.int64)
        val = tl.load(val_ptr + s * val_stride + slots, mask=valid, other=0.0)
        hi = tl.minimum(tl.maximum(idx >> 16, 0), C - 1)   # in the row whatever the input
        return slots, valid, idx, val, hi

    @triton.jit(do_not_specialize=["cap", "C", "header", "iw", "cw"])
    def _stats_kernel(idx_ptr, val_ptr, cnt_ptr, tab_ptr, out_ptr, cap, C, header, iw, cw,
                      idx_stride, val_stride, cnt_stride, out_stride, Q2: tl.constexpr,
                      HAS_COUNTS: tl.constexpr, PER: tl.constexpr, BLOCK: tl.constexpr):
        """Per chunk: the count, the largest exponent (q2) or the smallest (inverted) and the
        largest magnitude bits (q4); and zero the packed words of slots [b·BLOCK, ...)."""
        slots, valid, idx, val, hi = _slots(idx_ptr, val_ptr, cnt_ptr, cap, C, idx_stride,
                                            val_stride, cnt_stride, HAS_COUNTS, BLOCK)
        s = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        tab = tab_ptr + s * 6 * C
        bits = tl.abs(val).to(tl.int32, bitcast=True).to(tl.int64)
        tl.atomic_add(tab + hi, tl.full([BLOCK], 1, tl.int64), mask=valid, sem="relaxed")
        if Q2:
            tl.atomic_max(tab + C + hi, tl.maximum(bits >> 23, 1), mask=valid, sem="relaxed")
        else:
            tl.atomic_max(tab + C + hi, 0x7F800000 - bits, mask=valid,    # inf's bits
                          sem="relaxed")
            tl.atomic_max(tab + 2 * C + hi, bits, mask=valid, sem="relaxed")
        body = out_ptr + s * out_stride + header + 3 * C
        wi = b * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
        tl.store(body + wi, tl.zeros([BLOCK // 2], tl.int32), mask=wi < iw)
        wc = b * (BLOCK // PER) + tl.arange(0, BLOCK // PER)
        tl.store(body + iw + wc, tl.zeros([BLOCK // PER], tl.int32), mask=wc < cw)

    @triton.jit(do_not_specialize=["cap", "C"])
    def _sum_kernel(idx_ptr, val_ptr, cnt_ptr, tab_ptr, cap, C, idx_stride, val_stride,
                    cnt_stride, SPLIT: tl.constexpr, HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
        """q2: the chunk's fixed-point sum of magnitudes; ``SPLIT``: the count and the sum of
        those at or above the chunk's mean."""
        slots, valid, idx, val, hi = _slots(idx_ptr, val_ptr, cnt_ptr, cap, C, idx_stride,
                                            val_stride, cnt_stride, HAS_COUNTS, BLOCK)
        tab = tab_ptr + tl.program_id(0).to(tl.int64) * 6 * C
        a = tl.abs(val)
        units = _fixed_terms(a, tl.load(tab + C + hi, mask=valid, other=1))
        if SPLIT:
            big = valid & (a >= _mean_of(tab, hi, C, valid))
            tl.atomic_add(tab + 3 * C + hi, tl.full([BLOCK], 1, tl.int64), mask=big,
                          sem="relaxed")
            tl.atomic_add(tab + 4 * C + hi, units, mask=big, sem="relaxed")
        else:
            tl.atomic_add(tab + 2 * C + hi, units, mask=valid, sem="relaxed")

    @triton.jit(do_not_specialize=["cap", "C", "header", "iw"])
    def _finish_kernel(idx_ptr, val_ptr, cnt_ptr, tab_ptr, out_ptr, wire_ptr, cap, C, header,
                       iw, idx_stride, val_stride, cnt_stride, out_stride, wire_stride,
                       Q2: tl.constexpr,
                       HAS_COUNTS: tl.constexpr, ORDERED: tl.constexpr, HAS_WIRE: tl.constexpr,
                       B: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr,
                       BC: tl.constexpr):
        """Each entry's code, place, packed fields and wire value; the chunk words of chunks
        [b·BLOCK_C, ...)."""
        slots, valid, idx, val, hi = _slots(idx_ptr, val_ptr, cnt_ptr, cap, C, idx_stride,
                                            val_stride, cnt_stride, HAS_COUNTS, BLOCK)
        s = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        tab = tab_ptr + s * 6 * C
        TOP: tl.constexpr = (1 << (B - 1)) - 1
        PER: tl.constexpr = 32 // B
        a = tl.abs(val)
        base, step = _scales(tab, hi, C, valid, Q2, TOP)
        if Q2:
            j = (a >= _mean_of(tab, hi, C, valid)).to(tl.int32)
        else:
            pos_step = step > 0
            r = tl.math.div_rn(a - base, tl.where(pos_step, step, 1.0))
            r = tl.minimum(tl.maximum(r, 0.0), TOP * 1.0)
            fl = tl.floor(r)
            d = r - fl
            fi = fl.to(tl.int32)
            j = fi + ((d > 0.5) | ((d == 0.5) & ((fi & 1) == 1))).to(tl.int32)
            j = tl.where(pos_step, j, 0)
        code = tl.where(val < 0, 1 << (B - 1), 0) | j
        mag = base + j.to(tl.float32) * step
        if HAS_WIRE:
            w = tl.where(val < 0, -mag, mag)
            tl.store(wire_ptr + s * wire_stride + slots, tl.where(valid, w, 0.0),
                     mask=slots < cap)
        if ORDERED:
            pos = slots
        else:
            first = _sum_below(tab, hi, C, BLOCK, BC)
            nth = tl.atomic_add(tab + 5 * C + hi, tl.full([BLOCK], 1, tl.int64), mask=valid,
                                sem="relaxed")
            pos = tl.where(valid, first + nth, slots)
        row = out_ptr + s * out_stride + header
        low = (idx & 0xFFFF).to(tl.int32) << ((pos & 1) * 16).to(tl.int32)
        tl.atomic_or(row + 3 * C + pos // 2, low, mask=valid, sem="relaxed")
        cw = (code & ((1 << B) - 1)) << ((pos % PER) * B).to(tl.int32)
        tl.atomic_or(row + 3 * C + iw + pos // PER, cw, mask=valid, sem="relaxed")
        cs = b * BLOCK_C + tl.arange(0, BLOCK_C)
        cm = cs < C
        cbase, cstep = _scales(tab, cs, C, cm, Q2, TOP)
        tl.store(row + cs, tl.load(tab + cs, mask=cm, other=0).to(tl.int32), mask=cm)
        tl.store(row + C + cs, cbase.to(tl.int32, bitcast=True), mask=cm)
        tl.store(row + 2 * C + cs, cstep.to(tl.int32, bitcast=True), mask=cm)

    @triton.jit(do_not_specialize=["cap", "C", "header", "iw"])
    def _decode_kernel(msg_ptr, idx_out, val_out, cnt_out, cap, C, header, iw, msg_stride,
                       idx_stride, val_stride, cnt_stride, B: tl.constexpr,
                       BLOCK: tl.constexpr, BC: tl.constexpr):
        """Slot i of row s: its chunk from the running counts (BC a step), its index
        ``chunk << 16 | low``, its value ``±(base + j·step)``; -1 / 0 past the row's count,
        which program (s, 0) writes."""
        PER: tl.constexpr = 32 // B
        s, b, slots, row, chunk, total, inb, valid = _decode_slots(msg_ptr, msg_stride, header,
                                                                   cap, C, BLOCK, BC)
        hc = tl.minimum(chunk, C - 1)
        wi = tl.load(row + 3 * C + slots // 2, mask=valid, other=0)
        low = (wi >> ((slots & 1) * 16).to(tl.int32)) & 0xFFFF
        wc = tl.load(row + 3 * C + iw + slots // PER, mask=valid, other=0)
        code = (wc >> ((slots % PER) * B).to(tl.int32)) & ((1 << B) - 1)
        base = tl.load(row + C + hc, mask=valid, other=0).to(tl.float32, bitcast=True)
        step = tl.load(row + 2 * C + hc, mask=valid, other=0).to(tl.float32, bitcast=True)
        mag = base + (code & ((1 << (B - 1)) - 1)).to(tl.float32) * step
        val = tl.where((code >> (B - 1)) != 0, -mag, mag)
        idx = (chunk.to(tl.int32) << 16) | low
        _store_decoded(idx_out + s * idx_stride, val_out + s * val_stride,
                       cnt_out + s * cnt_stride, slots, valid, inb, idx, val, total, b)

    _BLOCK, _BLOCK_C = 1024, 256
    # chunks a step of the running-count scans, and warps (ptxas, sm_90, per thread; as the
    # compact wire's passes): finish BC=32 with 4 warps spilled 1764-2004 B, BC=8 with 8 warps
    # 0-24 B (128-176 registers); decode BC=16 with 8 warps 127 registers, no spill. BC only
    # sets how many chunk counts one step of an integer scan loads: the bits do not depend on
    # it. Every atomic is relaxed: counts, maxima, sums and ORs that later launches read.
    _FINISH_BC, _FINISH_WARPS = 8, 8
    _DECODE_BC, _DECODE_WARPS = 16, 8

    @_dispatch.serialized_when_interpreted
    def _encode_triton(indices, values, counts, out, wire, C, header, bits, ordered):
        S, cap = indices.shape
        has = counts is not None
        cnt = counts.reshape(-1) if has else indices     # a header column: its stride
        q2 = bits == 2
        iw, cw = (cap + 1) // 2, -(-cap * bits // 32)
        tab = torch.zeros(S, _TABLE, C, dtype=torch.int64, device=out.device)
        nb = max(1, triton.cdiv(cap, _BLOCK))
        common = (indices, values, cnt, tab)
        strides = (indices.stride(0), values.stride(0), cnt.stride(0) if has else 0)
        _stats_kernel[(S, nb)](*common, out, cap, C, header, iw, cw, *strides, out.stride(0),
                               Q2=q2, HAS_COUNTS=has, PER=32 // bits, BLOCK=_BLOCK,
                               num_warps=4)
        if q2:
            for split in (False, True):
                _sum_kernel[(S, nb)](*common, cap, C, *strides, SPLIT=split, HAS_COUNTS=has,
                                     BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)
        grid = (S, max(nb, triton.cdiv(C, _BLOCK_C)))
        _finish_kernel[grid](*common, out, values if wire is None else wire, cap, C, header, iw,
                             *strides, out.stride(0), 0 if wire is None else wire.stride(0),
                             Q2=q2, HAS_COUNTS=has, ORDERED=ordered, HAS_WIRE=wire is not None,
                             B=bits, BLOCK=_BLOCK, BLOCK_C=_BLOCK_C, BC=_FINISH_BC,
                             num_warps=_FINISH_WARPS, enable_fp_fusion=False)

    @_dispatch.serialized_when_interpreted
    def _decode_triton(msg, idx, val, count, cap, C, header, bits):
        S = msg.shape[0]
        _decode_kernel[(S, max(1, triton.cdiv(cap, _BLOCK)))](
            msg, idx, val, count, cap, C, header, (cap + 1) // 2, msg.stride(0), idx.stride(0),
            val.stride(0), count.stride(0), B=bits, BLOCK=_BLOCK, BC=_DECODE_BC,
            num_warps=_DECODE_WARPS, enable_fp_fusion=False)


# ---- torch references ---------------------------------------------------------------------

def _to_int32(w: Tensor) -> Tensor:
    """int64 words in [0, 2^32) -> the int32 with the same 32 bits."""
    return torch.where(w >= 1 << 31, w - (1 << 32), w).to(torch.int32)


def pack_fields(fields: Tensor, bits: int) -> Tensor:
    """[S, m] int64 fields of ``bits`` bits -> [S, ceil(m·bits/32)] int32 words, field i at
    bit ``(i % per)·bits`` of word ``i // per`` (``per = 32 // bits``)."""
    S, m = fields.shape
    per = 32 // bits
    nw = -(-m // per)
    f = torch.nn.functional.pad(fields, (0, nw * per - m)).view(S, nw, per)
    shift = torch.arange(per, device=fields.device, dtype=torch.int64) * bits
    return _to_int32((f << shift).sum(-1))


def unpack_fields(words: Tensor, bits: int, m: int) -> Tensor:
    """Inverse of :func:`pack_fields`: [S, nw] int32 -> [S, m] int64 fields."""
    S, nw = words.shape
    per = 32 // bits
    shift = torch.arange(per, device=words.device, dtype=torch.int64) * bits
    w = (words.to(torch.int64) & 0xFFFFFFFF).unsqueeze(-1)
    return ((w >> shift) & ((1 << bits) - 1)).reshape(S, nw * per)[:, :m]


def levels(base: Tensor, step: Tensor, code: Tensor, b: int) -> Tensor:
    """The value of ``code`` (sign bit on top, magnitude ``j`` below) at a chunk's base/step:
    ``±(base + j·step)`` in fp32 (two roundings); the one formula of encoder and decoder."""
    j = (code & ((1 << (b - 1)) - 1)).to(torch.float32)
    mag = base + j * step
    return torch.where((code >> (b - 1)) != 0, -mag, mag)


def fixed_terms(a: Tensor, emax: Tensor) -> Tensor:
    """int64 fixed-point units of fp32 magnitudes ``a`` at exponents ``emax`` (module doc)."""
    bits = a.contiguous().view(torch.int32).to(torch.int64)
    e = bits >> 23
    m = (bits & 0x7FFFFF) | torch.where(e > 0, 0x800000, 0)
    return (m << 16) >> (emax - e.clamp(min=1)).clamp(0, 63)


def fixed_value(units: Tensor, emax: Tensor) -> Tensor:
    """A sum of units back in fp32: ``fp32(units) · 2^-39 · 2^(emax-127)``."""
    p = (emax.clamp(1, 254) << 23).to(torch.int32).view(torch.float32)
    return units.to(torch.float32) * 2.0 ** -39 * p


def quantized_scales(hi: Tensor, a: Tensor, valid: Tensor, C: int, b: int):
    """``(base, step [S, C+1], j int64 [S, cap])``: each chunk's scales and each slot's
    magnitude code (``hi``: the slot's chunk, C where not valid; ``a``: |value|)."""
    S, cap = a.shape
    dev = a.device
    f = hi + torch.arange(S, device=dev).reshape(S, 1) * (C + 1)
    zeros = torch.zeros(S * (C + 1), dtype=torch.int64, device=dev)
    cnt = zeros.scatter_add(0, f.reshape(-1), valid.to(torch.int64).reshape(-1))
    bits = a.contiguous().view(torch.int32).to(torch.int64)
    if b == 2:
        e = torch.where(valid, (bits >> 23).clamp(min=1), torch.ones_like(bits))
        emax = zeros.scatter_reduce(0, f.reshape(-1), e.reshape(-1), "amax")
        units = torch.where(valid, fixed_terms(a, emax[f]), torch.zeros_like(bits))
        tot = zeros.scatter_add(0, f.reshape(-1), units.reshape(-1))
        mean = fixed_value(tot, emax) / cnt.clamp(min=1).to(torch.float32)
        big = valid & (a >= mean[f])
        n_hi = zeros.scatter_add(0, f.reshape(-1), big.to(torch.int64).reshape(-1))
        s_hi = zeros.scatter_add(0, f.reshape(-1), torch.where(big, units, 0).reshape(-1))
        c_hi = fixed_value(s_hi, emax) / n_hi.clamp(min=1).to(torch.float32)
        n_lo = cnt - n_hi
        c_lo = fixed_value(tot - s_hi, emax) / n_lo.clamp(min=1).to(torch.float32)
        c_lo = torch.where(n_lo > 0, c_lo, c_hi)
        base, step = c_lo, c_hi - c_lo
        j = big.to(torch.int64)
    else:
        top = (1 << (b - 1)) - 1
        inv = zeros.scatter_reduce(0, f.reshape(-1), torch.where(
            valid, _INF_BITS - bits, 0).reshape(-1), "amax")
        mxb = zeros.scatter_reduce(0, f.reshape(-1), torch.where(valid, bits, 0).reshape(-1),
                                   "amax")
        base = (_INF_BITS - inv).to(torch.int32).view(torch.float32)
        base = torch.where(cnt > 0, base, torch.zeros_like(base))
        step = (mxb.to(torch.int32).view(torch.float32) - base) / top
        sf = step[f]
        ratio = (a - base[f]) / torch.where(sf > 0, sf, torch.ones_like(sf))
        j = torch.round(ratio.clamp(0, top)).to(torch.int64)
        j = torch.where(sf > 0, j, torch.zeros_like(j))
    return base.view(S, C + 1), step.view(S, C + 1), j


def _encode_torch(indices, values, counts, out, wire, C, header, b, ordered):
    S, cap = indices.shape
    dev = indices.device
    valid = _valid_slots(counts, S, cap, dev)
    pos, cc = group_positions(indices, counts, C, ordered)
    idx = indices.to(torch.int64)
    hi = torch.where(valid, (idx >> CHUNK_BITS).clamp(0, C - 1), torch.full_like(idx, C))
    base, step, j = quantized_scales(hi, values.abs(), valid, C, b)
    code = torch.where(valid, ((values < 0).to(torch.int64) << (b - 1)) | j, 0)
    if wire is not None:
        w = levels(base.gather(1, hi), step.gather(1, hi), code, b)
        wire.copy_(torch.where(valid, w, torch.zeros_like(w)))
    low = torch.where(valid, idx & _LOW, 0)
    if not ordered:
        low = torch.empty_like(low).scatter_(1, pos, low)
        code = torch.empty_like(code).scatter_(1, pos, code)
    iw = (cap + 1) // 2
    row = out[:, header:]
    row[:, :C] = cc
    row[:, C:2 * C] = base[:, :C].contiguous().view(torch.int32)
    row[:, 2 * C:3 * C] = step[:, :C].contiguous().view(torch.int32)
    row[:, 3 * C:3 * C + iw] = pack_fields(low, 16)
    row[:, 3 * C + iw:] = pack_fields(code, b)


def _decode_torch(msg, cap, C, header, b):
    hi, count = slot_chunks(msg[:, header:header + C], cap)
    row = msg[:, header:]
    iw = (cap + 1) // 2
    low = unpack_fields(row[:, 3 * C:3 * C + iw], 16, cap)
    code = unpack_fields(row[:, 3 * C + iw:3 * C + iw + -(-cap * b // 32)], b, cap)
    hc = hi.clamp(max=C - 1)
    base = row[:, C:2 * C].contiguous().view(torch.float32).gather(1, hc)
    step = row[:, 2 * C:3 * C].contiguous().view(torch.float32).gather(1, hc)
    vals = levels(base, step, code, b)
    idx = (hi << CHUNK_BITS) | low
    return (*masked_rows(idx, vals, count), count.reshape(msg.shape[0]).to(torch.int32))


# ---- public -------------------------------------------------------------------------------

def quantized_words(cap: int, C: int, bits: int) -> int:
    """int32 words of a quantized row past its header: counts, bases, steps (C each), the
    16-bit indices two a word and the ``bits``-bit codes ``32/bits`` a word."""
    return 3 * C + (cap + 1) // 2 + -(-cap * bits // 32)


def _check_bits(name: str, bits: int) -> None:
    if bits not in (2, 4):
        raise ValueError(f"{name}: bits must be 2 or 4, got {bits!r}")


def quantized_encode(indices: Tensor, values: Tensor, counts: Optional[Tensor], out: Tensor,
                     span: int, header: int = 0, *, bits: int, ordered: bool = False,
                     wire: Optional[Tensor] = None, backend: str = "auto") -> None:
    """Quantized rows into ``out`` int32 [S, header + quantized_words(cap, C, bits)]
    (C = ceil(span/65536)): per chunk the count, base and step, then the 16-bit indices and
    the codes, grouped by chunk (``ordered``: the valid entries, the first
    ``min(counts[s], cap)`` slots, are ascending already and stay in place), 0 past the
    count; the header words are not touched. ``wire`` (fp32 [S, cap], optional): what the
    wire carries for each input slot, 0 past the count. Indices must lie in ``[0, span)``."""
    _check_bits("quantized_encode", bits)
    S, cap = indices.shape
    C = chunks(span)
    words = header + quantized_words(cap, C, bits)
    if out.shape != (S, words) or out.dtype != torch.int32 or out.stride(1) != 1:
        raise ValueError(f"quantized_encode: out must be int32 [{S}, {words}] with inner "
                         f"stride 1, got {out.dtype} {list(out.shape)}")
    if wire is not None and (wire.shape != (S, cap) or wire.dtype != torch.float32
                             or (cap > 1 and wire.stride(1) != 1)):
        raise ValueError(f"quantized_encode: wire must be fp32 [{S}, {cap}] with inner "
                         f"stride 1, got {wire.dtype} {list(wire.shape)}")
    if indices.stride(1) != 1:
        indices = indices.contiguous()
    values = values.to(torch.float32)
    if values.stride(1) != 1:
        values = values.contiguous()
    # what the CUDA path launches: the table's memset, stats, (q2: sum, split), finish
    _dispatch.record(launches=5 if bits == 2 else 3, bytes=(24 if bits == 2 else 16) * S * cap)
    _dispatch.run(backend, indices.device, _encode_triton if HAS_TRITON else None,
                  _encode_torch, indices, values, counts, out, wire, C, header, bits, ordered)


def quantized_decode(msg: Tensor, cap: int, span: int, header: int = 0, *, bits: int,
                     out: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
                     backend: str = "auto") -> Tuple[Tensor, Tensor, Tensor]:
    """Quantized rows [S, >= header + quantized_words(cap, C, bits)] -> ``(indices int32
    [S, cap] (-1 past the count), values fp32 [S, cap] (the levels, 0 past the count), counts
    int32 [S])`` in the row's order. ``out``: those three tensors to write (inner stride 1).
    One launch."""
    _check_bits("quantized_decode", bits)
    C = chunks(span)
    return decode_rows("quantized_decode", msg, cap, header + quantized_words(cap, C, bits), out,
                       backend, lambda m, i, v, c: _decode_triton(m, i, v, c, cap, C, header,
                                                                  bits),
                       lambda m: _decode_torch(m, cap, C, header, bits))


class Quantized(WireFormat):
    """``bits``-bit values (a sign bit and the magnitude's code) at ``base + j·step`` of their
    chunk, 16-bit indices two a word, after the chunk's count, base and step. The sender keeps
    each entry's quantization error."""

    packed = True

    def __init__(self, name: str, bits: int, rank: int) -> None:
        self.name, self.bits, self.rank = name, bits, rank
        self.entry_bytes = 2.0 + bits / 8.0

    def row_words(self, cap: int, span: int, header: int = 0) -> int:
        return header + quantized_words(cap, chunks(span), self.bits)

    def encode(self, indices, values, counts, span, *, header, out, return_wire, order,
               backend):
        S, cap = indices.shape
        perm = None
        if order == "sort":
            valid = sent_slots(counts, S, cap, indices.device)
            indices, values, perm = sorted_rows(indices, values, valid, span)
        wire = torch.empty(S, cap, dtype=torch.float32, device=indices.device) \
            if return_wire else None
        quantized_encode(indices, values, counts, out, span, header, bits=self.bits,
                         ordered=order != "chunks", wire=wire, backend=backend)
        if not return_wire:
            return out
        if perm is not None:        # back to the input slots
            wire = torch.empty_like(wire).scatter_(1, perm, wire)
        return out, wire

    def decode(self, msg, cap, span, header, *, backend, out):
        return quantized_decode(msg, cap, span, header, bits=self.bits, out=out,
                                backend=backend)


Q2 = register(Quantized("q2", 2, rank=2))
Q4 = register(Quantized("q4", 4, rank=3))


def compile_variants():
    """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps, options) per
    variant, as the launchers above launch them."""
    no_fma = {"enable_fp_fusion": False}
    row = {"idx_ptr": "*i32", "val_ptr": "*fp32", "cnt_ptr": "*i32", "tab_ptr": "*i64"}
    for bits in (2, 4):
        for has in (False, True):
            yield (f"wire_quantized stats b={bits} counts={has}", _stats_kernel,
                   {**row, "out_ptr": "*i32", "cap": "i32", "C": "i32", "header": "i32",
                    "iw": "i32", "cw": "i32", "idx_stride": "i32", "val_stride": "i32",
                    "cnt_stride": "i32", "out_stride": "i32", "Q2": "constexpr",
                    "HAS_COUNTS": "constexpr", "PER": "constexpr", "BLOCK": "constexpr"},
                   {"Q2": bits == 2, "HAS_COUNTS": has, "PER": 32 // bits, "BLOCK": _BLOCK},
                   [0, 1, 2, 3, 4], 4, {})
            for ordered in (False, True):
                for has_wire in (False, True):
                    yield (f"wire_quantized finish b={bits} counts={has} ordered={ordered} "
                           f"wire={has_wire}", _finish_kernel,
                           {**row, "out_ptr": "*i32", "wire_ptr": "*fp32", "cap": "i32",
                            "C": "i32", "header": "i32", "iw": "i32", "idx_stride": "i32",
                            "val_stride": "i32", "cnt_stride": "i32", "out_stride": "i32",
                            "wire_stride": "i32",
                            "Q2": "constexpr", "HAS_COUNTS": "constexpr",
                            "ORDERED": "constexpr", "HAS_WIRE": "constexpr", "B": "constexpr",
                            "BLOCK": "constexpr", "BLOCK_C": "constexpr", "BC": "constexpr"},
                           {"Q2": bits == 2, "HAS_COUNTS": has, "ORDERED": ordered,
                            "HAS_WIRE": has_wire, "B": bits, "BLOCK": _BLOCK,
                            "BLOCK_C": _BLOCK_C, "BC": _FINISH_BC}, [0, 1, 2, 3, 4, 5],
                           _FINISH_WARPS, no_fma)
        yield (f"wire_quantized decode b={bits}", _decode_kernel,
               {"msg_ptr": "*i32", "idx_out": "*i32", "val_out": "*fp32", "cnt_out": "*i32",
                "cap": "i32", "C": "i32", "header": "i32", "iw": "i32", "msg_stride": "i32",
                "idx_stride": "i32", "val_stride": "i32", "cnt_stride": "i32",
                "B": "constexpr", "BLOCK": "constexpr", "BC": "constexpr"},
               {"B": bits, "BLOCK": _BLOCK, "BC": _DECODE_BC}, [0, 1, 2, 3], _DECODE_WARPS,
               no_fma)
    for has in (False, True):
        for split in (False, True):
            yield (f"wire_quantized sum split={split} counts={has}", _sum_kernel,
                   {**row, "cap": "i32", "C": "i32", "idx_stride": "i32", "val_stride": "i32",
                    "cnt_stride": "i32", "SPLIT": "constexpr", "HAS_COUNTS": "constexpr",
                    "BLOCK": "constexpr"},
                   {"SPLIT": split, "HAS_COUNTS": has, "BLOCK": _BLOCK}, [0, 1, 2, 3], 4,
                   no_fma)
