"""The compact wire format of sparse messages (``wire_format="compact"``, docs/algorithms.md §9).

An fp32 entry is two int32 words: the index and the fp32 bits of the value. A compact entry is
ONE int32 word::

    word = bf16 bits of the value << 16  |  index & 0xFFFF

The value's bf16 bits are the top half of its fp32 rounding (round to nearest even, as
``tensor.to(torch.bfloat16)``), so ``word & 0xFFFF0000`` read as fp32 is that rounding itself.
The index's high bits are not sent: the entries of a row are sorted by index, and the row
starts with one int32 count per 65,536-element chunk of the span its indices live in (a region,
a block, or all of n), ``chunks(span) = ceil(span / 65536)`` words; the receiver recovers the high
bits of entry ``i`` as the number of chunks whose running count ends at or before ``i``.

A row of capacity ``cap`` over a span of ``span`` elements is ``header + chunks(span) + cap``
words (``header``: the algorithm's own words in front), against ``header' + 2·cap`` in fp32. The
sort is one ``torch.sort`` of the row on the device (the selection kernels may fill rows in any
order on CUDA), the counts one ``scatter_add``: static sizes, no host read.

Conservation: a sender keeps ``v - bf16(v)`` of every entry it sent in its own residual (what
the wire dropped), so nothing is lost (:func:`bf16_rounding`).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

__all__ = ["WIRE_FORMATS", "CHUNK", "chunks", "row_words", "bf16_round", "bf16_rounding",
           "encode", "decode", "check_wire_format"]

WIRE_FORMATS = ("fp32", "compact")
CHUNK_BITS = 16
CHUNK = 1 << CHUNK_BITS
_LOW = CHUNK - 1
_HIGH = -CHUNK            # 0xFFFF0000 as an int32


def check_wire_format(name: str, value, refusal: Optional[str]) -> bool:
    """True for ``"compact"``; a one-line ValueError for an unknown value, or for ``"compact"``
    on an algorithm whose messages cannot carry it (``refusal`` says why)."""
    if value not in WIRE_FORMATS:
        raise ValueError(f"{name}: wire_format must be one of {WIRE_FORMATS}, got {value!r}")
    if value == "compact" and refusal:
        raise ValueError(f"{name}: wire_format='compact' is not supported: {refusal}")
    return value == "compact"


def chunks(span: int) -> int:
    """Count words of a row whose indices lie in ``[0, span)``: one per 65,536 elements."""
    return max(1, -(-int(span) // CHUNK))


def row_words(cap: int, span: int, header: int = 0) -> int:
    """int32 words of one compact row: ``header + chunks(span) + cap``."""
    return header + chunks(span) + cap


def bf16_round(x: torch.Tensor) -> torch.Tensor:
    """``x`` rounded to bf16 (nearest even), as fp32."""
    return x.to(torch.bfloat16).to(torch.float32)


def bf16_rounding(x: torch.Tensor) -> torch.Tensor:
    """What the compact wire drops of ``x``: ``x - bf16(x)`` (exact in fp32)."""
    return x - bf16_round(x)


def encode(indices: torch.Tensor, values: torch.Tensor, counts: Optional[torch.Tensor],
           span: int, *, header: int = 0, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows of entries -> compact rows ``int32 [S, header + chunks(span) + cap]``.

    ``indices`` int [S, cap] in ``[0, span)`` (unique within a row, any order), ``values`` fp32
    [S, cap]; only the first ``min(counts[s], cap)`` slots of row s are sent (``counts=None``:
    all). The header words are left for the caller (zero in a new buffer). Entries go out
    sorted by index; the unused slots are 0."""
    if indices.dim() == 1:
        indices, values = indices.unsqueeze(0), values.unsqueeze(0)
        counts = None if counts is None else counts.reshape(1)
    S, cap = indices.shape
    C = chunks(span)
    dev = indices.device
    if out is None:
        out = torch.zeros(S, header + C + cap, dtype=torch.int32, device=dev)
    slot = torch.arange(cap, device=dev)
    idx = indices.to(torch.int64)
    if counts is None:
        key = idx
        valid = torch.ones(S, cap, dtype=torch.bool, device=dev)
    else:
        n_valid = counts.to(torch.int64).reshape(S, 1).clamp(0, cap)
        key = torch.where(slot < n_valid, idx, torch.full_like(idx, span))   # padding sorts last
        valid = slot < n_valid          # sorted: the valid entries are the first n_valid
    key, perm = torch.sort(key, dim=1)
    vals = values.to(torch.float32).gather(1, perm)
    hi = torch.where(valid, key >> CHUNK_BITS, torch.full_like(key, C))
    cc = torch.zeros(S, C + 1, dtype=torch.int32, device=dev)
    cc.scatter_add_(1, hi, torch.ones_like(hi, dtype=torch.int32))
    word = bf16_round(vals).view(torch.int32) | (key & _LOW).to(torch.int32)
    out[:, header:header + C] = cc[:, :C]
    out[:, header + C:] = torch.where(valid, word, torch.zeros_like(word))
    return out


def decode(msg: torch.Tensor, cap: int, span: int,
           header: int = 0) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Compact rows ``[S, header + chunks(span) + cap]`` -> ``(indices int32 [S, cap] (ascending,
    -1 past the count), values fp32 [S, cap] (the bf16 values, 0 past the count), counts int32
    [S])``. The same bits give the same result on every rank."""
    if msg.dim() == 1:
        msg = msg.unsqueeze(0)
    S = msg.shape[0]
    C = chunks(span)
    dev = msg.device
    ends = torch.cumsum(msg[:, header:header + C].to(torch.int64), 1)        # [S, C]
    count = ends[:, -1:]
    words = msg[:, header + C:header + C + cap]
    slot = torch.arange(cap, device=dev, dtype=torch.int64).expand(S, cap).contiguous()
    hi = torch.searchsorted(ends.contiguous(), slot, right=True)             # chunk of slot i
    idx = (hi << CHUNK_BITS) | (words & _LOW).to(torch.int64)
    vals = (words & _HIGH).contiguous().view(torch.float32)
    valid = slot < count
    idx = torch.where(valid, idx, torch.full_like(idx, -1)).to(torch.int32)
    vals = torch.where(valid, vals, torch.zeros_like(vals))
    return idx, vals, count.reshape(S).to(torch.int32)
