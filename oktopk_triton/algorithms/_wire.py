"""The compact wire format of sparse messages (``wire_format="compact"``, docs/algorithms.md §9).

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

from .. import kernels as K

__all__ = ["WIRE_FORMATS", "QUANTIZED", "CHUNK", "chunks", "row_words", "entry_bytes",
           "bf16_round", "bf16_rounding", "encode", "decode", "check_wire_format"]

WIRE_FORMATS = ("fp32", "compact", "q2", "q4")
QUANTIZED = {"q2": 2, "q4": 4}     # bits a value: a sign bit and the magnitude code
_NOT_IMPLEMENTED = "this algorithm does not implement it"
CHUNK_BITS = 16
CHUNK = 1 << CHUNK_BITS
_LOW = CHUNK - 1
_HIGH = -CHUNK            # 0xFFFF0000 as an int32


def check_wire_format(name: str, value, refusal: Optional[str],
                      quantized_refusal: Optional[str] = _NOT_IMPLEMENTED) -> bool:
    """True for a packed format (``"compact"``, ``"q2"``, ``"q4"``: chunk counts and 16-bit
    indices); a one-line ValueError for an unknown value, for a packed format on an algorithm
    whose messages cannot carry it (``refusal`` says why), or for a quantized one on an
    algorithm that does not keep the quantization error (``quantized_refusal``)."""
    if value not in WIRE_FORMATS:
        raise ValueError(f"{name}: wire_format must be one of {WIRE_FORMATS}, got {value!r}")
    why = refusal or (quantized_refusal if value in QUANTIZED else None)
    if value != "fp32" and why:
        raise ValueError(f"{name}: wire_format={value!r} is not supported: {why}")
    return value != "fp32"


def chunks(span: int) -> int:
    """Count words of a row whose indices lie in ``[0, span)``: one per 65,536 elements."""
    return max(1, -(-int(span) // CHUNK))


def row_words(cap: int, span: int, header: int = 0, fmt: str = "compact") -> int:
    """int32 words of one packed row: ``header + chunks(span) + cap`` (compact);
    ``header + 3·chunks(span) + ceil(cap/2) + ceil(cap·b/32)`` (``q2``/``q4``, b = 2/4)."""
    if fmt == "compact":
        return header + chunks(span) + cap
    b = QUANTIZED[fmt]
    return header + 3 * chunks(span) + (cap + 1) // 2 + -(-cap * b // 32)


def entry_bytes(fmt: str) -> float:
    """Wire bytes of one sparse entry, headers and chunk words aside: fp32 8, compact 4, q2 2.25,
    q4 2.5."""
    if fmt not in WIRE_FORMATS:
        raise ValueError(f"entry_bytes: wire_format must be one of {WIRE_FORMATS}, got {fmt!r}")
    return {"fp32": 8.0, "compact": 4.0}.get(fmt) or 2.0 + QUANTIZED.get(fmt, 0) / 8.0


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16 (nearest even), as fp32."""
    return x.to(torch.bfloat16).to(torch.float32)


def bf16_rounding(x: torch.Tensor) -> torch.Tensor:
    """What the compact wire drops of ``x``: ``x - bf16(x)`` (exact in fp32)."""
    return x - bf16_round(x)


ORDERS = ("sort", "ascending", "chunks")


def encode(indices: torch.Tensor, values: torch.Tensor, counts: Optional[torch.Tensor],
           span: int, *, header: int = 0, out: Optional[torch.Tensor] = None,
           fmt: str = "compact", return_wire: bool = False, order: str = "sort",
           backend: str = "auto"):
    """Rows of entries -> packed rows ``int32 [S, row_words(cap, span, header, fmt)]``.

    ``indices`` int [S, cap] in ``[0, span)`` (unique within a row), ``values`` fp32 [S, cap];
    only the first ``min(counts[s], cap)`` slots of row s are sent (``counts=None``: all). The
    header words are left for the caller (zero in a new buffer); the unused slots are 0.
    ``order``: ``"sort"`` (any order in; the entries go out sorted by index: one torch.sort),
    ``"ascending"`` (the valid entries are ascending already: nothing is sorted) or
    ``"chunks"`` (any order in; the entries go out grouped by chunk, in any order within one,
    which is all :func:`decode` needs: no sort on the GPU). Every format runs as Triton passes
    (``kernels/wire.py``, ``kernels/wire_quantized.py``; ``backend``). ``return_wire``: also
    return what the wire carries for each input slot (fp32, the shape of ``values``, 0 where
    nothing was sent), so a sender keeps ``values - wire`` (the bits :func:`decode` gives
    every receiver)."""
    if order not in ORDERS:
        raise ValueError(f"encode: order must be one of {ORDERS}, got {order!r}")
    shape = values.shape
    if indices.dim() == 1:
        indices, values = indices.unsqueeze(0), values.unsqueeze(0)
        counts = None if counts is None else counts.reshape(1)
    S, cap = indices.shape
    C = chunks(span)
    dev = indices.device
    if out is None:
        out = torch.zeros(S, row_words(cap, span, header, fmt), dtype=torch.int32, device=dev)
    values = values.to(torch.float32)
    if fmt == "compact" and order != "sort" and not return_wire:   # the kernels alone
        K.wire_encode(indices, values, counts, out[:, :header + C + cap], span, header,
                      ordered=order == "ascending", backend=backend)
        return out
    if fmt == "compact" or order == "sort":     # the valid slots (glue ops: only here)
        slot = torch.arange(cap, device=dev)
        valid_in = slot < (cap if counts is None else
                           counts.to(torch.int64).reshape(S, 1).clamp(0, cap))
    if fmt == "compact":
        if order == "sort":
            indices, values, counts, _ = _sorted_rows(indices, values, counts, valid_in, span)
        K.wire_encode(indices, values, counts, out[:, :header + C + cap], span, header,
                      ordered=order != "chunks", backend=backend)
        if not return_wire:
            return out
        wire = torch.where(valid_in, bf16_round(values), torch.zeros_like(values))
        return out, wire.view(shape)
    # the quantized formats: the Triton passes of oktopk_triton/kernels/wire_quantized.py
    perm = None
    if order == "sort":
        indices, values, _, perm = _sorted_rows(indices, values, counts, valid_in, span)
    wire = torch.empty(S, cap, dtype=torch.float32, device=dev) if return_wire else None
    K.quantized_encode(indices, values, counts, out, span, header, bits=QUANTIZED[fmt],
                       ordered=order != "chunks", wire=wire, backend=backend)
    if not return_wire:
        return out
    if perm is not None:        # back to the input slots
        wire = torch.empty_like(wire).scatter_(1, perm, wire)
    return out, wire.view(shape)


def _sorted_rows(indices, values, counts, valid, span):
    """The rows sorted by index, the padding last (``order="sort"``)."""
    key = torch.where(valid, indices.to(torch.int64), torch.full_like(valid, span,
                                                                      dtype=torch.int64))
    key, perm = torch.sort(key, dim=1)
    return key.to(torch.int32), values.gather(1, perm), counts, perm


def decode(msg: torch.Tensor, cap: int, span: int, header: int = 0,
           fmt: str = "compact", *, backend: str = "auto",
           out: Optional[Tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
           ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Packed rows ``[S, row_words(cap, span, header, fmt)]`` -> ``(indices int32 [S, cap]
    (in the row's order: ascending unless encoded with ``order="chunks"``; -1 past the count),
    values fp32 [S, cap] (what the wire carries: bf16 values or the quantized levels; 0 past
    the count), counts int32 [S])``. The same bits give the same result on every rank. Each
    format decodes in one Triton pass (``kernels/wire.py``, ``kernels/wire_quantized.py``);
    no op reads the host. ``out``:
    the three tensors to write (views into the caller's own layout are fine)."""
    if msg.dim() == 1:
        msg = msg.unsqueeze(0)
    if fmt == "compact":
        return K.wire_decode(msg, cap, span, header, out=out, backend=backend)
    return K.quantized_decode(msg, cap, span, header, bits=QUANTIZED[fmt], out=out,
                              backend=backend)
