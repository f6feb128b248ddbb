"""The packed wire formats of sparse messages (``wire_format=``, docs/algorithms.md §9), as the
algorithms call them: each function asks the format's object
(:mod:`oktopk_triton.kernels.wire_format`: ``fp32``, ``compact``, ``q2``, ``q4``, one file each)
and compares against no format's name. The compact format, the one the others build on:

An fp32 entry is two int32 words: the index and the fp32 bits of the value. A compact entry is
ONE int32 word::

    word = bf16 bits of the value << 16  |  index & 0xFFFF

The value's bf16 bits are the top half of its fp32 rounding (round to nearest even, as
``tensor.to(torch.bfloat16)``), so ``word & 0xFFFF0000`` read as fp32 is that rounding itself.
The index's high bits are not sent: the entries of a row are grouped by chunk (sorted by index,
or in any order within a chunk with ``order="chunks"``), and the row
starts with one int32 count per 65,536-element chunk of the span its indices live in (a region,
a block, or all of n), ``chunks(span) = ceil(span / 65536)`` words; the receiver recovers the high
bits of entry ``i`` as the number of chunks whose running count ends at or before ``i``.

Conservation: a sender keeps ``v - bf16(v)`` of every entry it sent in its own residual (what
the wire dropped), so nothing is lost (:func:`bf16_rounding`).

Measured why: docs/research/design-notes.md, ``oktopk_triton/algorithms/_wire.py``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..kernels import wire_format as WF
from ..kernels.wire_format import CHUNK_BITS, Format, WireFormat, chunks

__all__ = ["WIRE_FORMATS", "QUANTIZED", "CHUNK", "chunks", "row_words", "entry_bytes",
           "bf16_round", "bf16_rounding", "encode", "decode", "check_wire_format", "format_of",
           "packed"]

WIRE_FORMATS = WF.names()      # ('fp32', 'compact', 'q2', 'q4')
QUANTIZED = {f.name: f.bits for f in WF.formats() if f.quantized}   # bits a value
_NOT_IMPLEMENTED = "this algorithm does not implement it"
CHUNK = 1 << CHUNK_BITS


def format_of(fmt: Format, owner: str = "wire_format") -> WireFormat:
    """The format object of ``fmt`` (a name, an object, or None for fp32); a one-line
    ``ValueError`` naming ``owner`` for an unknown name."""
    return WF.get(fmt, owner)


def packed(fmt: Format) -> bool:
    """True for a packed format (chunk counts and 16-bit indices): not fp32."""
    return format_of(fmt).packed


def check_wire_format(name: str, value, refusal: Optional[str],
                      quantized_refusal: Optional[str] = _NOT_IMPLEMENTED) -> bool:
    """True for a packed format (``"compact"``, ``"q2"``, ``"q4"``: chunk counts and 16-bit
    indices); a one-line ValueError for an unknown value, for a packed format on an algorithm
    whose messages cannot carry it (``refusal`` says why), or for a quantized one on an
    algorithm that does not keep the quantization error (``quantized_refusal``)."""
    fmt = WF.find(value) if isinstance(value, str) else None
    if fmt is None:
        raise ValueError(f"{name}: wire_format must be one of {WF.names()}, got {value!r}")
    why = refusal or (quantized_refusal if fmt.quantized else None)
    if fmt.packed and why:
        raise ValueError(f"{name}: wire_format={value!r} is not supported: {why}")
    return fmt.packed


def row_words(cap: int, span: int, header: int = 0, fmt: Format = "compact") -> int:
    """int32 words of one packed row: ``header + chunks(span) + cap`` (compact);
    ``header + 3·chunks(span) + ceil(cap/2) + ceil(cap·b/32)`` (``q2``/``q4``, b = 2/4)."""
    return format_of(fmt, "row_words: wire_format").row_words(cap, span, header)


def entry_bytes(fmt: Format) -> float:
    """Wire bytes of one sparse entry, headers and chunk words aside: fp32 8, compact 4, q2 2.25,
    q4 2.5."""
    return format_of(fmt, "entry_bytes: wire_format").entry_bytes


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16 (nearest even), as fp32."""
    return x.to(torch.bfloat16).to(torch.float32)


def bf16_rounding(x: torch.Tensor) -> torch.Tensor:
    """What the compact wire drops of ``x``: ``x - bf16(x)`` (exact in fp32)."""
    return x - bf16_round(x)


ORDERS = ("sort", "ascending", "chunks")


def encode(indices: torch.Tensor, values: torch.Tensor, counts: Optional[torch.Tensor],
           span: int, *, header: int = 0, out: Optional[torch.Tensor] = None,
           fmt: Format = "compact", return_wire: bool = False, order: str = "sort",
           backend: str = "auto"):
    """Rows of entries -> packed rows ``int32 [S, row_words(cap, span, header, fmt)]``.

    ``indices`` int [S, cap] in ``[0, span)`` (unique within a row), ``values`` fp32 [S, cap];
    only the first ``min(counts[s], cap)`` slots of row s are sent (``counts=None``: all). The
    header words are left for the caller (zero in a new buffer); the unused slots are 0.
    ``order``: ``"sort"`` (any order in; the entries go out sorted by index: one torch.sort),
    ``"ascending"`` (the valid entries are ascending already: nothing is sorted) or
    ``"chunks"`` (any order in; the entries go out grouped by chunk, in any order within one,
    which is all :func:`decode` needs: no sort on the GPU). Every format runs as Triton passes
    (its object's ``encode``: ``kernels/wire.py``, ``kernels/wire_quantized.py``; ``backend``).
    ``return_wire``: also return what the wire carries for each input slot (fp32, the shape of
    ``values``, 0 where nothing was sent), so a sender keeps ``values - wire`` (the bits
    :func:`decode` gives every receiver)."""
    if order not in ORDERS:
        raise ValueError(f"encode: order must be one of {ORDERS}, got {order!r}")
    f = format_of(fmt, "encode: fmt")
    shape = values.shape
    if indices.dim() == 1:
        indices, values = indices.unsqueeze(0), values.unsqueeze(0)
        counts = None if counts is None else counts.reshape(1)
    S, cap = indices.shape
    if out is None:
        out = torch.zeros(S, f.row_words(cap, span, header), dtype=torch.int32,
                          device=indices.device)
    got = f.encode(indices, values.to(torch.float32), counts, span, header=header, out=out,
                   return_wire=return_wire, order=order, backend=backend)
    if not return_wire:
        return got
    return got[0], got[1].view(shape)


def decode(msg: torch.Tensor, cap: int, span: int, header: int = 0,
           fmt: Format = "compact", *, backend: str = "auto",
           out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows ``[S, row_words(cap, span, header, fmt)]`` -> ``(indices int32 [S, cap]
    (in the row's order: ascending unless encoded with ``order="chunks"``; -1 past the count),
    values fp32 [S, cap] (what the wire carries: bf16 values or the quantized levels; 0 past
    the count), counts int32 [S])``. The same bits give the same result on every rank. Each
    format decodes in one Triton pass (its object's ``decode``); no op reads the host.
    ``out``: the three tensors to write (views into the caller's own layout are fine)."""
    if msg.dim() == 1:
        msg = msg.unsqueeze(0)
    return format_of(fmt, "decode: fmt").decode(msg, cap, span, header, backend=backend,
                                                 out=out)
