"""Shared sparse helpers for the algorithms (plain torch, no host reads on the hot path).

Public for the other algorithm files (SparDL, TopkDSA, ... may import from here):

* :func:`magnitude_key` / :func:`topk_entries` -- a *deterministic* top-k of ``|x|``: ties in
  magnitude are broken by index (the lower index wins), so two ranks holding the same data pick
  the same set bit for bit. ``torch.topk`` alone does not promise any order among equal values;
  here it runs on unique int64 keys ``(|x| bits << 32) | (2^32 - 1 - index)``.
* :func:`pack_entries` / :func:`unpack_entries` -- one int32 message buffer holding
  ``[header words][indices (cap)][fp32 value bits (cap)]`` (the layout of CONTRACTS.md §1
  with ``header=2``: ``[count, flags]``).
* :func:`merge_topk` -- sum two sparse sets (unique indices each) and keep the top-k of the
  union, the first operand's value always added first (``a + b``), so every rank merging the
  same pair computes the same set bit for bit.
* :func:`is_member` -- which indices of one set are in a sorted other set (searchsorted).
* :func:`pack_bits` / :func:`unpack_bits` -- a bool vector as ``ceil(m/32)`` int32 words.
* :func:`volume_formula_words` / :func:`volume_formula_range` -- the per-rank per-step volume
  formulas of docs/algorithms.md §6 for every algorithm of the library, in words (4 bytes), so the
  benchmarks can print "formula" next to the measured ``stats["bytes_sent"] / 4``.

Nothing here calls ``.item()``, ``.tolist()``, ``nonzero()`` or boolean-mask indexing; every
output size is a function of the input sizes only (static).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import kernels as K
from ..kernels.keys import magnitude_key

__all__ = ["magnitude_key", "topk_entries", "pack_entries", "unpack_entries", "merge_topk",
           "is_member", "pack_bits", "unpack_bits",
           "volume_formula_words", "volume_formula_range", "DEAD_KEY"]

_LOW32 = (1 << 32) - 1
DEAD_KEY = -1  # below every magnitude key (all of which are >= 0)


def topk_entries(x: torch.Tensor, k: int,
                 backend: str = "auto") -> Tuple[torch.Tensor, torch.Tensor]:
    """The ``k`` entries of largest ``|x|`` (ties by lower index), sorted by index ascending.

    ``x`` fp32 [n]. Returns ``(indices int32 [k], values fp32 [k])`` with ``values ==
    x[indices]`` bit for bit. Zeros are taken when ``x`` has fewer than ``k`` nonzeros (they
    contribute nothing). The keys are one kernel (``kernels.magnitude_keys``, ``backend``).
    """
    n = x.numel()
    if not (1 <= k <= n):
        raise ValueError(f"topk_entries: k must be in [1, {n}], got {k}")
    key = K.magnitude_keys(x.reshape(-1), backend=backend)
    pos = torch.topk(key, k, sorted=False).indices
    pos, _ = torch.sort(pos)
    return pos.to(torch.int32), x[pos]


def pack_entries(indices: torch.Tensor, values: torch.Tensor, header: Optional[torch.Tensor] = None,
                 out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """int32 ``[h + 2m]`` = ``[header (h words)][indices (m)][fp32 bits of values (m)]``."""
    m = indices.numel()
    h = 0 if header is None else header.numel()
    if out is None:
        out = torch.empty(h + 2 * m, dtype=torch.int32, device=indices.device)
    if h:
        out[:h] = header.to(torch.int32)
    out[h:h + m] = indices.to(torch.int32)
    out[h + m:h + 2 * m] = values.to(torch.float32).contiguous().view(torch.int32)
    return out


def unpack_entries(buf: torch.Tensor, m: int, header: int = 0):
    """Inverse of :func:`pack_entries` on the last dim: ``(header, indices, values)`` views.

    ``buf`` int32 ``[..., header + 2m]``; values are an fp32 view (a contiguous copy when the
    slice is not contiguous in memory).
    """
    hdr = buf[..., :header]
    idx = buf[..., header:header + m]
    vbits = buf[..., header + m:header + 2 * m]
    if not vbits.is_contiguous():
        vbits = vbits.contiguous()
    return hdr, idx, vbits.view(torch.float32)


def merge_topk(idx_a: torch.Tensor, val_a: torch.Tensor, idx_b: torch.Tensor,
               val_b: torch.Tensor, k: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Top-k (by ``|value|``, ties by index) of the sum of two sparse sets.

    Each operand holds unique indices (any order). A matching index gets ``val_a + val_b``
    (always in that order: make ``a`` the canonical first operand, e.g. the lower-rank group).
    The union has at least ``max(len a, len b)`` distinct indices, so ``k <= len a`` gives k
    distinct survivors. Returns ``(indices int32 [k] ascending, values fp32 [k])``.
    """
    ma, mb = idx_a.numel(), idx_b.numel()
    if not (1 <= k <= ma + mb):
        raise ValueError(f"merge_topk: k={k} out of range for sets of {ma} and {mb}")
    dev = idx_a.device
    idx = torch.cat([idx_a.to(torch.int64), idx_b.to(torch.int64)])
    val = torch.cat([val_a.to(torch.float32), val_b.to(torch.float32)])
    side = torch.cat([torch.zeros(ma, dtype=torch.int64, device=dev),
                      torch.ones(mb, dtype=torch.int64, device=dev)])
    order = torch.argsort(idx * 2 + side)            # unique keys: deterministic order
    sidx = idx[order]
    sval = val[order]
    dup = sidx[:-1] == sidx[1:]                      # (a-entry, b-entry) pairs, a first
    merged = sval.clone()
    merged[:-1] = torch.where(dup, sval[:-1] + sval[1:], sval[:-1])
    dead = torch.zeros_like(sidx, dtype=torch.bool)
    dead[1:] = dup
    key = torch.where(dead, torch.full_like(sidx, DEAD_KEY), magnitude_key(merged, sidx))
    pos = torch.topk(key, k, sorted=False).indices
    pos, _ = torch.sort(pos)                          # sidx is ascending: so is sidx[pos]
    return sidx[pos].to(torch.int32), merged[pos]


def is_member(query: torch.Tensor, sorted_set: torch.Tensor) -> torch.Tensor:
    """bool mask: ``query[i] in sorted_set`` (``sorted_set`` ascending, non-empty)."""
    s = sorted_set.to(torch.int64).contiguous()
    q = query.to(torch.int64).contiguous()
    pos = torch.searchsorted(s, q).clamp_(max=s.numel() - 1)
    return s[pos] == q


def pack_bits(mask: torch.Tensor) -> torch.Tensor:
    """bool [m] -> int32 [ceil(m/32)] (bit j of word w = mask[32w + j])."""
    m = mask.numel()
    words = (m + 31) // 32
    pad = torch.zeros(words * 32, dtype=torch.int64, device=mask.device)
    pad[:m] = mask.to(torch.int64)
    shifts = torch.arange(32, device=mask.device, dtype=torch.int64)
    w = (pad.view(words, 32) << shifts).sum(1)        # < 2^32
    w = torch.where(w >= (1 << 31), w - (1 << 32), w)
    return w.to(torch.int32)


def unpack_bits(words: torch.Tensor, m: int) -> torch.Tensor:
    """Inverse of :func:`pack_bits`."""
    shifts = torch.arange(32, device=words.device, dtype=torch.int64)
    w = words.to(torch.int64) & _LOW32
    bits = (w.unsqueeze(1) >> shifts) & 1
    return bits.reshape(-1)[:m].to(torch.bool)


# -- volume formulas (docs/algorithms.md §6), words per rank per step ------------------------------
def _log2ceil(P: int) -> int:
    return 0 if P <= 1 else (P - 1).bit_length()


def volume_formula_range(name: str, n: int, k: int, P: int, **opts) -> Tuple[float, float]:
    """(low, high) words sent per rank per step by the §6 formulas (headers not included): the
    ``volume`` of algorithm ``name``'s description, 0 for P <= 1.

    ``gaussiank`` takes ``slack`` (default 1.5, its capacity factor); its formula is the
    allgather of fixed-capacity slots, ``2·ceil(slack·k)·(P-1)``.
    """
    from . import find_description
    name = name.lower()
    if P <= 1:
        return (0.0, 0.0)
    d = find_description(name)
    if d is None:
        raise ValueError(f"volume_formula_words: unknown algorithm {name!r}")
    return d.volume(n, k, P, **opts)


def volume_formula_words(name: str, n: int, k: int, P: int, **opts) -> float:
    """The §6 formula (the upper end where §6 gives a range) in words per rank per step."""
    return volume_formula_range(name, n, k, P, **opts)[1]
