"""The compact wire's encode and decode (oktopk_triton/algorithms/_wire.py, docs/algorithms.md §9)
as Triton passes, with a torch reference beside each.

* :func:`wire_encode` writes a row that is already ascending (``ordered``: Ok-Topk's slots,
  TopkA's and Gaussiank's messages) in ONE launch: each program writes its block of words in
  place and the counts of its block of chunks, each the difference of two binary searches in
  the row. Nothing is sorted, nothing is zeroed first. A row in any order (Ok-Topk's reduce
  rows, filled in any order by the selection) is grouped by chunk, not sorted, in THREE
  launches: a memset of the ``[rows, 2·chunks]`` counts and cursors, a count pass (integer
  atomics), and a placement pass in which each entry adds the counts of the chunks below its
  own (8 a step) to what an ``atomic_add`` on its chunk's cursor hands out. Decoding needs
  the entries grouped by chunk only (the low bits are explicit), so within a chunk the order
  is the atomics' (any order on a GPU, slot order in the interpreter and the torch
  reference); Ok-Topk's owner sorts what it receives anyway.
* :func:`wire_decode` is ONE launch: each program sums the row's running counts (16 chunks a
  step) to find its slots' chunks, unpacks index and value, and can write straight into the
  caller's layout (Ok-Topk's gathered slots).
* :func:`slot_chunks` is that search for the quantized formats' torch decode: static-size
  ``scatter_add`` and ``cumsum``, no ``searchsorted``.
* :data:`COMPACT` is the format object (``wire_format="compact"``, :mod:`.wire_format`): its
  bytes per entry, row words, encode and decode.

Measured why: docs/research/design-notes.md, ``oktopk_triton/kernels/wire.py``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON
from .wire_format import CHUNK_BITS, WireFormat, chunks, decode_rows, masked_rows, register

if HAS_TRITON:
    import triton
    import triton.language as tl

_LOW = (1 << CHUNK_BITS) - 1
_HIGH = -(1 << CHUNK_BITS)      # 0xFFFF0000 as an int32

if HAS_TRITON:

    @triton.jit
    def _word(idx, val, valid):
        """``bf16(v) << 16 | idx & 0xFFFF`` (0 where not valid): round to nearest even in
        integer arithmetic, as torch's ``.to(bfloat16)`` (the interpreter's float cast
        truncates); NaN -> the canonical quiet NaN."""
        bits = val.to(tl.int32, bitcast=True)
        bits = (bits + (0x7FFF + ((bits >> 16) & 1))) & -65536
        bits = tl.where(val != val, 0x7FC00000, bits)
        return tl.where(valid, bits | (idx & 0xFFFF).to(tl.int32), 0)

    @triton.jit
    def _count_below(row_ptr, n_valid, key, STEPS: tl.constexpr):
        """Per lane: how many of the ascending ``row[0:n_valid]`` are below ``key``."""
        lo = tl.zeros(key.shape, tl.int64)
        hi = tl.zeros(key.shape, tl.int64) + n_valid
        for _ in tl.static_range(STEPS):
            active = lo < hi
            mid = (lo + hi) // 2
            a = tl.load(row_ptr + mid, mask=active, other=0).to(tl.int64)
            lo = tl.where(active & (a < key), mid + 1, lo)
            hi = tl.where(active & (a >= key), mid, hi)
        return lo

    @triton.jit
    def _sum_below(cnt_ptr, chunk, C, BLOCK: tl.constexpr, BC: tl.constexpr):
        """Per lane: ``sum(cnt[c] for c < chunk)`` (the chunk's first slot), BC chunks a step."""
        acc = tl.zeros([BLOCK], tl.int64)
        for c0 in range(0, C, BC):
            cs = c0 + tl.arange(0, BC)
            cc = tl.load(cnt_ptr + cs, mask=cs < C, other=0).to(tl.int64)
            acc += tl.sum(tl.where(cs[None, :] < chunk[:, None], cc[None, :], 0), axis=1)
        return acc

    @triton.jit(do_not_specialize=["cap", "C", "header"])
    def _encode_ordered_kernel(idx_ptr, val_ptr, cnt_ptr, out_ptr, cap, C, header,
                               idx_stride, val_stride, out_stride, HAS_COUNTS: tl.constexpr,
                               STEPS: tl.constexpr, BLOCK: tl.constexpr, BLOCK_C: tl.constexpr):
        """Ascending rows in ONE launch: program (s, b) writes slots [b·BLOCK, ...) in place and
        the counts of chunks [b·BLOCK_C, ...), each the difference of two binary searches."""
        s = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        n_valid = cap
        if HAS_COUNTS:
            n_valid = tl.minimum(tl.maximum(tl.load(cnt_ptr + s).to(tl.int64), 0), cap)
        row = idx_ptr + s * idx_stride
        slots = b * BLOCK + tl.arange(0, BLOCK)
        valid = slots < n_valid
        idx = tl.load(row + slots, mask=valid, other=0).to(tl.int64)
        val = tl.load(val_ptr + s * val_stride + slots, mask=valid, other=0.0)
        base = out_ptr + s * out_stride + header
        tl.store(base + C + slots, _word(idx, val, valid), mask=slots < cap)
        cs = b * BLOCK_C + tl.arange(0, BLOCK_C)
        below = _count_below(row, n_valid, cs << 16, STEPS)
        upto = _count_below(row, n_valid, (cs + 1) << 16, STEPS)
        tl.store(base + cs, (upto - below).to(tl.int32), mask=cs < C)

    @triton.jit(do_not_specialize=["cap", "C"])
    def _chunk_count_kernel(idx_ptr, cnt_ptr, scratch_ptr, cap, C, idx_stride,
                            HAS_COUNTS: tl.constexpr, BLOCK: tl.constexpr):
        """scratch[s, idx >> 16] += 1 for every valid slot (integer atomics)."""
        s = tl.program_id(0).to(tl.int64)
        slots = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        n_valid = cap
        if HAS_COUNTS:
            n_valid = tl.minimum(tl.maximum(tl.load(cnt_ptr + s).to(tl.int64), 0), cap)
        valid = slots < n_valid
        idx = tl.load(idx_ptr + s * idx_stride + slots, mask=valid, other=0).to(tl.int64)
        hi = tl.minimum(tl.maximum(idx >> 16, 0), C - 1)   # in the row whatever the input
        tl.atomic_add(scratch_ptr + s * 2 * C + hi, tl.full([BLOCK], 1, tl.int32), mask=valid,
                      sem="relaxed")

    @triton.jit(do_not_specialize=["cap", "C", "header"])
    def _place_kernel(idx_ptr, val_ptr, cnt_ptr, out_ptr, scratch_ptr, cap, C, header,
                      idx_stride, val_stride, out_stride, HAS_COUNTS: tl.constexpr,
                      BLOCK: tl.constexpr, BLOCK_C: tl.constexpr, BC: tl.constexpr):
        """Rows in any order, grouped by chunk: an entry goes to its chunk's first slot (the
        counts below it) plus what an integer atomic on the chunk's cursor hands out; program
        (s, b) also copies the counts of chunks [b·BLOCK_C, ...) into the row. Slots past the
        count write 0 at their own place (the valid entries fill the prefix)."""
        s = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        n_valid = cap
        if HAS_COUNTS:
            n_valid = tl.minimum(tl.maximum(tl.load(cnt_ptr + s).to(tl.int64), 0), cap)
        counts = scratch_ptr + s * 2 * C
        slots = b * BLOCK + tl.arange(0, BLOCK)
        valid = slots < n_valid
        idx = tl.load(idx_ptr + s * idx_stride + slots, mask=valid, other=0).to(tl.int64)
        val = tl.load(val_ptr + s * val_stride + slots, mask=valid, other=0.0)
        hi = tl.minimum(tl.maximum(idx >> 16, 0), C - 1)
        first = _sum_below(counts, hi, C, BLOCK, BC)
        nth = tl.atomic_add(counts + C + hi, tl.full([BLOCK], 1, tl.int32), mask=valid,
                            sem="relaxed")
        pos = tl.where(valid, first + nth.to(tl.int64), slots)
        base = out_ptr + s * out_stride + header
        tl.store(base + C + pos, _word(idx, val, valid), mask=slots < cap)
        cs = b * BLOCK_C + tl.arange(0, BLOCK_C)
        tl.store(base + cs, tl.load(counts + cs, mask=cs < C, other=0), mask=cs < C)

    @triton.jit
    def _decode_slots(msg_ptr, msg_stride, header, cap, C, BLOCK: tl.constexpr,
                      BC: tl.constexpr):
        """Both decodes' start: this program's row ``s`` and BLOCK of ``slots``, the row's
        words after its header, each slot's chunk and whether it is in bounds and holds an
        entry, and the row's total count."""
        s = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        slots = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        row = msg_ptr + s * msg_stride + header
        chunk, total = _chunk_of_slots(row, slots, C, BLOCK, BC)
        inb = slots < cap
        return s, b, slots, row, chunk, total, inb, (slots < total) & inb

    @triton.jit
    def _chunk_of_slots(row, slots, C, BLOCK: tl.constexpr, BC: tl.constexpr):
        """Per lane: the chunk of slot ``slots`` (how many running counts of ``row[0:C]`` are at
        or below it), and the row's total count; BC counts a step."""
        chunk = tl.zeros([BLOCK], tl.int64)
        total = tl.sum(tl.zeros([BC], tl.int64), 0)
        for c0 in range(0, C, BC):
            cs = c0 + tl.arange(0, BC)
            cc = tl.load(row + cs, mask=cs < C, other=0).to(tl.int64)
            ends = tl.cumsum(cc, 0) + total
            below = (ends[None, :] <= slots[:, None]) & (cs < C)[None, :]
            chunk += tl.sum(below.to(tl.int64), axis=1)
            total += tl.sum(cc, 0)
        return chunk, total

    @triton.jit
    def _store_decoded(idx_row, val_row, cnt_at, slots, valid, inb, idx, val, total, b):
        """A decoded row's slots (-1 / 0 past its count) and, from program (s, 0), its count."""
        tl.store(idx_row + slots, tl.where(valid, idx, -1), mask=inb)
        tl.store(val_row + slots, tl.where(valid, val, 0.0), mask=inb)
        tl.store(cnt_at, total.to(tl.int32), mask=b == 0)

    @triton.jit(do_not_specialize=["cap", "C", "header"])
    def _decode_kernel(msg_ptr, idx_out, val_out, cnt_out, cap, C, header, msg_stride,
                       idx_stride, val_stride, cnt_stride, BLOCK: tl.constexpr,
                       BC: tl.constexpr):
        """Slot i of row s: its chunk is the number of running counts at or below i (BC counts
        a step), its index ``chunk << 16 | low``, its value the word's top half as fp32; -1 / 0
        past the row's count, which program (s, 0) writes."""
        s, b, slots, row, chunk, total, inb, valid = _decode_slots(msg_ptr, msg_stride, header,
                                                                   cap, C, BLOCK, BC)
        w = tl.load(row + C + slots, mask=valid, other=0)
        idx = (chunk.to(tl.int32) << 16) | (w & 0xFFFF)
        val = (w & -65536).to(tl.float32, bitcast=True)
        _store_decoded(idx_out + s * idx_stride, val_out + s * val_stride,
                       cnt_out + s * cnt_stride, slots, valid, inb, idx, val, total, b)

    # Launch options, from ptxas for sm_90 (``_compile_check --resources``; registers per
    # thread / bytes spilled; none measured on a GPU). BC is how many chunk counts a step of
    # the running-count loop compares against BLOCK slots ([BLOCK, BC] int64 tiles): a pure
    # integer sum, so BC and the warps change no result.
    #   place   BC=32, 4 warps: 168 regs / 1704-1848 B spilled;  BC=8, 8 warps: 128 / 0
    #   decode  BC=32, 4 warps: 255 regs / 0;                     BC=16, 8 warps: 126 / 0
    # The count and place atomics are relaxed: each only needs its own add to be atomic (a
    # cursor hands out distinct slots whatever the order); the launch boundary orders the
    # passes. PTX: {atom,red}.global.gpu.relaxed.add instead of the default acq_rel.
    _BLOCK, _BLOCK_C = 1024, 256
    _PLACE_BC, _PLACE_WARPS = 8, 8
    _DECODE_BC, _DECODE_WARPS = 16, 8

    @_dispatch.serialized_when_interpreted
    def _encode_triton(indices, values, counts, out, C, header, ordered):
        S, cap = indices.shape
        has = counts is not None
        cnt = counts.reshape(-1).contiguous() if has else indices   # (a header column: strided)
        grid = (S, max(triton.cdiv(cap, _BLOCK), triton.cdiv(C, _BLOCK_C)))
        if ordered:
            _encode_ordered_kernel[grid](
                indices, values, cnt, out, cap, C, header, indices.stride(0),
                values.stride(0), out.stride(0), HAS_COUNTS=has,
                STEPS=_dispatch.ceil_log2(cap + 1), BLOCK=_BLOCK, BLOCK_C=_BLOCK_C, num_warps=4)
            return
        scratch = torch.zeros(S, 2 * C, dtype=torch.int32, device=out.device)   # counts, cursors
        _chunk_count_kernel[(S, triton.cdiv(cap, _BLOCK))](
            indices, cnt, scratch, cap, C, indices.stride(0), HAS_COUNTS=has, BLOCK=_BLOCK,
            num_warps=4)
        _place_kernel[grid](indices, values, cnt, out, scratch, cap, C, header,
                            indices.stride(0), values.stride(0), out.stride(0), HAS_COUNTS=has,
                            BLOCK=_BLOCK, BLOCK_C=_BLOCK_C, BC=_PLACE_BC,
                            num_warps=_PLACE_WARPS)

    @_dispatch.serialized_when_interpreted
    def _decode_triton(msg, idx, val, count, cap, C, header):
        S = msg.shape[0]
        _decode_kernel[(S, max(1, triton.cdiv(cap, _BLOCK)))](
            msg, idx, val, count, cap, C, header, msg.stride(0), idx.stride(0), val.stride(0),
            count.stride(0), BLOCK=_BLOCK, BC=_DECODE_BC, num_warps=_DECODE_WARPS)


def _valid_slots(counts: Optional[Tensor], S: int, cap: int, dev) -> Tensor:
    """:func:`sent_slots` as [S, cap] always (the torch references index with it)."""
    valid = sent_slots(counts, S, cap, dev)
    return valid if counts is not None else valid.expand(S, cap)


def group_positions(indices: Tensor, counts: Optional[Tensor], C: int,
                    ordered: bool) -> Tuple[Tensor, Tensor]:
    """Torch reference of the layout: ``(pos int64 [S, cap], chunk counts int32 [S, C])``,
    where ``pos`` is each input slot's place in the row (grouped by chunk, stable within one;
    slots past the count keep their own place). ``ordered`` rows keep every slot in place."""
    S, cap = indices.shape
    dev = indices.device
    valid = _valid_slots(counts, S, cap, dev)
    hi = torch.where(valid, indices.to(torch.int64) >> CHUNK_BITS, torch.full_like(
        valid, C, dtype=torch.int64))
    cc = torch.zeros(S, C + 1, dtype=torch.int32, device=dev)
    cc.scatter_add_(1, hi, torch.ones_like(hi, dtype=torch.int32))
    if ordered:
        return torch.arange(cap, device=dev).expand(S, cap), cc[:, :C]
    # the CPU reference groups with a stable sort on the chunk (the Triton pass uses cursors)
    perm = torch.sort(hi, dim=1, stable=True).indices
    pos = torch.empty_like(perm).scatter_(1, perm, torch.arange(cap, device=dev).expand(S, cap))
    return pos, cc[:, :C]


def _encode_torch(indices, values, counts, out, C, header, ordered):
    S, cap = indices.shape
    valid = _valid_slots(counts, S, cap, indices.device)
    pos, cc = group_positions(indices, counts, C, ordered)
    idx = indices.to(torch.int64)
    word = values.to(torch.float32).to(torch.bfloat16).to(torch.float32).view(torch.int32) \
        | (idx & _LOW).to(torch.int32)
    word = torch.where(valid, word, torch.zeros_like(word))
    out[:, header:header + C] = cc
    body = out[:, header + C:header + C + cap]
    if ordered:
        body.copy_(word)
    else:
        body.scatter_(1, pos, word)


def wire_encode(indices: Tensor, values: Tensor, counts: Optional[Tensor], out: Tensor,
                span: int, header: int = 0, *, ordered: bool = False,
                backend: str = "auto") -> None:
    """Compact rows into ``out`` int32 [S, header + C + cap] (C = ceil(span/65536)): the chunk
    counts at ``header``, then one word per entry, grouped by chunk (``ordered``: the valid
    entries, the first ``min(counts[s], cap)`` slots, are ascending already and stay in
    place), 0 past the count. The header words are not touched. The indices must lie in
    ``[0, span)`` (the kernels clamp the chunk so that no write leaves the row)."""
    S, cap = indices.shape
    C = chunks(span)
    if out.shape != (S, header + C + cap) or out.dtype != torch.int32:
        raise ValueError(f"wire_encode: out must be int32 [{S}, {header + C + cap}], got "
                         f"{out.dtype} {list(out.shape)}")
    if out.stride(1) != 1:
        raise ValueError("wire_encode: out needs inner stride 1")
    if indices.stride(1) != 1:      # a row view of a wider buffer is fine as it is
        indices = indices.contiguous()
    values = values.to(torch.float32)
    if values.stride(1) != 1:
        values = values.contiguous()
    # what the CUDA path launches: one pass (ordered); the counts' and cursors' memset, the
    # count pass and the placement pass (grouped)
    _dispatch.record(launches=1 if ordered else 3, bytes=12 * S * cap)
    _dispatch.run(backend, indices.device, _encode_triton, _encode_torch, indices, values,
                  counts, out, C, header, ordered)


def slot_chunks(counts: Tensor, cap: int) -> Tuple[Tensor, Tensor]:
    """``(chunk of every slot int64 [S, cap], row count int64 [S, 1])`` from the chunk counts
    [S, C]: slot i's chunk is the number of running counts at or below i (what
    ``searchsorted(ends, i, right=True)`` gives), by a scatter_add of the running counts and a
    cumsum: static sizes."""
    S = counts.shape[0]
    ends = torch.cumsum(counts.to(torch.int64), 1)
    marks = torch.zeros(S, cap + 1, dtype=torch.int64, device=counts.device)
    marks.scatter_add_(1, ends.clamp(max=cap), torch.ones_like(ends))
    return torch.cumsum(marks, 1)[:, :cap], ends[:, -1:]


def _decode_torch(msg, cap, C, header):
    hi, count = slot_chunks(msg[:, header:header + C], cap)
    words = msg[:, header + C:header + C + cap]
    idx = (hi << CHUNK_BITS) | (words & _LOW).to(torch.int64)
    vals = (words & _HIGH).contiguous().view(torch.float32)
    return (*masked_rows(idx, vals, count), msg[:, header:header + C].sum(1, dtype=torch.int32))


def wire_decode(msg: Tensor, cap: int, span: int, header: int = 0, *,
                out: Optional[Tuple[Tensor, Tensor, Tensor]] = None,
                backend: str = "auto") -> Tuple[Tensor, Tensor, Tensor]:
    """Compact rows [S, header + C + cap] -> ``(indices int32 [S, cap] (-1 past the count),
    values fp32 [S, cap] (the bf16 values, 0 past the count), counts int32 [S])``; the entries
    in the row's order (grouped by chunk). ``out``: those three tensors to write (rows may be
    views into a wider buffer: inner stride 1), e.g. the caller's own layout. One launch."""
    C = chunks(span)
    return decode_rows("wire_decode", msg, cap, header + C + cap, out, backend,
                       lambda m, i, v, c: _decode_triton(m, i, v, c, cap, C, header),
                       lambda m: _decode_torch(m, cap, C, header))


def sent_slots(counts: Optional[Tensor], S: int, cap: int, dev) -> Tensor:
    """The slots a row sends, bool [S, cap] (or [cap] when every slot is sent: ``counts`` None):
    the first ``min(counts[s], cap)``. The encodes' glue, two to five ops."""
    slot = torch.arange(cap, device=dev)
    return slot < (cap if counts is None else counts.to(torch.int64).reshape(S, 1).clamp(0, cap))


def sorted_rows(indices: Tensor, values: Tensor, valid: Tensor, span: int
                ) -> Tuple[Tensor, Tensor, Tensor]:
    """The rows sorted by index, the slots past the count last: ``(indices int32, values,
    perm)`` (``order="sort"``; one torch.sort)."""
    key = torch.where(valid, indices.to(torch.int64), torch.full_like(valid, span,
                                                                      dtype=torch.int64))
    key, perm = torch.sort(key, dim=1)
    return key.to(torch.int32), values.gather(1, perm), perm


class Compact(WireFormat):
    """One int32 word an entry: the value's bf16 bits (round to nearest even) over its index's
    low 16 bits, after one count per 65,536-element chunk. The sender keeps ``v - bf16(v)``."""

    name, rank, packed, entry_bytes = "compact", 1, True, 4.0

    def row_words(self, cap: int, span: int, header: int = 0) -> int:
        return header + chunks(span) + cap

    def encode(self, indices, values, counts, span, *, header, out, return_wire, order,
               backend):
        S, cap = indices.shape
        body = out[:, :header + chunks(span) + cap]
        if order != "sort" and not return_wire:   # the kernels alone
            wire_encode(indices, values, counts, body, span, header,
                        ordered=order == "ascending", backend=backend)
            return out
        valid = sent_slots(counts, S, cap, indices.device)    # glue ops: only here
        if order == "sort":
            indices, values, _ = sorted_rows(indices, values, valid, span)
        wire_encode(indices, values, counts, body, span, header, ordered=order != "chunks",
                    backend=backend)
        if not return_wire:
            return out
        rounded = values.to(torch.bfloat16).to(torch.float32)
        return out, torch.where(valid, rounded, torch.zeros_like(values))

    def decode(self, msg, cap, span, header, *, backend, out):
        return wire_decode(msg, cap, span, header, out=out, backend=backend)


COMPACT = register(Compact())
