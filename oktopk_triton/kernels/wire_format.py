"""A wire format as an object: how one sparse entry travels (``wire_format=``), with its bytes
per entry, its row words, its encode and decode and the kernels behind them.

Each format is one object, registered from its own file ``kernels/wire*.py``:

* ``fp32`` (here): an int32 index and an fp32 value, two words an entry; the algorithms pack
  those rows themselves (``algorithms/_sparse.pack_entries``);
* ``compact`` (``wire.py``): one word an entry, the value's bf16 bits and a 16-bit index, after
  one count per 65,536-element chunk;
* ``q2`` and ``q4`` (``wire_quantized.py``): 2- or 4-bit values, a base and a step per chunk.

Adding a format is one file ``kernels/wire_<name>.py`` that subclasses :class:`WireFormat` and
calls :func:`register`; :func:`get` finds it by name. Nothing outside a format's object
compares against its name: a caller asks the object (``packed``, ``quantized``, ``bits``,
``row_words``, ``entry_bytes``, ``encode``, ``decode``).

The packed formats share the layout of a row's head, ``[header][one count per chunk]``, and
their decode's tail (:func:`decode_rows`: the checks, the output made or checked, the launch or
the torch reference, and the entries past a row's count masked by :func:`masked_rows`).
"""
from __future__ import annotations

import importlib
import pkgutil
from typing import Callable, Dict, Optional, Tuple, Union

import torch
from torch import Tensor

from . import _dispatch

__all__ = ["WireFormat", "Format", "FP32", "CHUNK_BITS", "chunks", "register", "find", "get",
           "names", "formats", "decode_rows", "masked_rows"]

CHUNK_BITS = 16

Rows = Tuple[Tensor, Tensor, Tensor]        # (indices int32 [S, cap], values fp32, counts [S])
Format = Union[str, "WireFormat", None]     # a format's name or object (None: fp32)


def chunks(span: int) -> int:
    """Count words of a packed row whose indices lie in ``[0, span)``: one per 65,536."""
    return max(1, -(-int(span) // (1 << CHUNK_BITS)))


class WireFormat:
    """One wire format. Subclasses set the class attributes and, when ``packed``, implement
    :meth:`row_words`, :meth:`encode` and :meth:`decode` (``algorithms/_wire.py`` documents the
    arguments: they are its ``encode`` and ``decode``).

    * ``name``: what ``wire_format=`` takes; ``rank``: where it is listed (lowest first).
    * ``packed``: rows of chunk counts and 16-bit indices (False: index and fp32 value words).
    * ``bits``: the bits of a quantized value (None: the value is not quantized).
    * ``entry_bytes``: wire bytes of one entry, headers and chunk words aside.
    """

    name: str = ""
    rank: int = 0
    packed: bool = True
    bits: Optional[int] = None
    entry_bytes: float = 0.0

    @property
    def quantized(self) -> bool:
        """The values are quantized (the sender keeps each entry's error in its residual)."""
        return self.bits is not None

    def row_words(self, cap: int, span: int, header: int = 0) -> int:
        """int32 words of one row of ``cap`` entries whose indices lie in ``[0, span)``."""
        raise NotImplementedError

    def encode(self, indices: Tensor, values: Tensor, counts: Optional[Tensor], span: int, *,
               header: int, out: Tensor, return_wire: bool, order: str, backend: str):
        """Rows of entries into ``out`` (``_wire.encode``'s contract)."""
        raise ValueError(f"wire format {self.name!r} has no packed rows to encode")

    def decode(self, msg: Tensor, cap: int, span: int, header: int, *, backend: str,
               out: Optional[Rows]) -> Rows:
        """Packed rows back to entries (``_wire.decode``'s contract)."""
        raise ValueError(f"wire format {self.name!r} has no packed rows to decode")

    def __repr__(self) -> str:
        return f"WireFormat({self.name!r})"


class Fp32(WireFormat):
    """An int32 index and the fp32 value: two words an entry, nothing rounded."""

    name, rank, packed, entry_bytes = "fp32", 0, False, 8.0

    def row_words(self, cap: int, span: int, header: int = 0) -> int:
        return header + 2 * cap


_FORMATS: Dict[str, WireFormat] = {}
_FOUND = False


def register(fmt: WireFormat) -> WireFormat:
    """Make ``wire_format=fmt.name`` resolve to ``fmt`` (a name registered again is replaced)."""
    if not isinstance(fmt, WireFormat) or not fmt.name:
        raise TypeError(f"register: expected a named WireFormat, got {fmt!r}")
    _FORMATS[fmt.name] = fmt
    return fmt


FP32 = register(Fp32())


def _discover() -> None:
    """Import every ``kernels/wire*.py`` once: each registers its formats."""
    global _FOUND
    if _FOUND:
        return
    _FOUND = True
    package = __name__.rsplit(".", 1)[0]
    for mod in pkgutil.iter_modules(importlib.import_module(package).__path__):
        if mod.name.startswith("wire") and mod.name != "wire_format":
            importlib.import_module(f"{package}.{mod.name}")


def formats() -> Tuple[WireFormat, ...]:
    """Every registered format, by ``rank``."""
    _discover()
    return tuple(sorted(_FORMATS.values(), key=lambda f: (f.rank, f.name)))


def names() -> Tuple[str, ...]:
    """Every registered format's name, by ``rank``: ``('fp32', 'compact', 'q2', 'q4')``."""
    return tuple(f.name for f in formats())


def find(fmt: Format) -> Optional[WireFormat]:
    """The format named ``fmt`` (``None``: fp32; a format object: itself), or None."""
    if isinstance(fmt, WireFormat):
        return fmt
    if fmt is None:
        return FP32
    _discover()
    return _FORMATS.get(fmt) if isinstance(fmt, str) else None


def get(fmt: Format, owner: str = "wire_format") -> WireFormat:
    """:func:`find`, or a one-line ``ValueError`` naming ``owner`` and the formats."""
    found = find(fmt)
    if found is None:
        raise ValueError(f"{owner} must be one of {names()}, got {fmt!r}")
    return found


# -- the decode tail the packed formats share ---------------------------------------------------
def masked_rows(idx: Tensor, vals: Tensor, count: Tensor) -> Tuple[Tensor, Tensor]:
    """A torch decode's rows past their count: index -1 (as int32), value 0 (``count`` int64
    [S, 1])."""
    S, cap = idx.shape
    valid = torch.arange(cap, device=idx.device).expand(S, cap) < count
    return (torch.where(valid, idx, torch.full_like(idx, -1)).to(torch.int32),
            torch.where(valid, vals, torch.zeros_like(vals)))


def decode_rows(name: str, msg: Tensor, cap: int, words: int, out: Optional[Rows],
                backend: str, launch: Callable[..., None],
                reference: Callable[[Tensor], Rows]) -> Rows:
    """A packed decode: ``msg`` checked (int32 [S, >= words]), ``out`` made (or checked: int32
    [S, cap], fp32 [S, cap], int32 [S], inner stride 1), one launch recorded, then
    ``launch(msg, idx, val, count)`` (Triton; rows of inner stride 1) or the torch
    ``reference(msg) -> (idx, val, count)`` copied into ``out``."""
    if msg.dtype != torch.int32 or msg.dim() != 2 or msg.shape[1] < words:
        raise ValueError(f"{name}: msg must be int32 [S, >= {words}], got {msg.dtype} "
                         f"{list(msg.shape)}")
    S = msg.shape[0]
    if out is None:
        out = (torch.empty(S, cap, dtype=torch.int32, device=msg.device),
               torch.empty(S, cap, dtype=torch.float32, device=msg.device),
               torch.empty(S, dtype=torch.int32, device=msg.device))
    idx, val, count = out
    if (idx.shape != (S, cap) or val.shape != (S, cap) or count.shape != (S,)
            or idx.dtype != torch.int32 or val.dtype != torch.float32
            or count.dtype != torch.int32 or (cap > 1 and (idx.stride(1) != 1
                                                           or val.stride(1) != 1))):
        raise ValueError(f"{name}: out must be (int32 [{S}, {cap}], fp32 [{S}, {cap}], "
                         f"int32 [{S}]) with inner stride 1")
    _dispatch.record(launches=1, bytes=12 * S * cap)

    def _triton(m: Tensor) -> None:
        launch(m if m.stride(1) == 1 else m.contiguous(), idx, val, count)

    def _torch(m: Tensor) -> None:
        for dst, src in zip(out, reference(m)):
            dst.copy_(src)
    _dispatch.run(backend, msg.device, _triton, _torch, msg)
    return idx, val, count
