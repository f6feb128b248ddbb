"""The owner's slots: its received rows reduced to one sum per distinct index, in 3 launches.

Why: after the send/recv, Ok-Topk's owner sorts the indices it received (its own row first, then
the P-1 received rows) and sums each run of equal indices into one slot. As torch ops that was
14 glue ops (cat, casts, the valid mask, where, ones_like, ne, the shift, a scatter of the slot
numbers, the zeroing of the sums) plus ``scatter_add``'s P launches: 18 of a 96-launch steady
step (``oktopk-bench launches``, P = 4, n = 2^17, 1%; docs/research/launch-budget.md), each a few
microseconds on a GPU for a few tens of kilobytes. Here: :func:`slot_keys` (the sort keys,
straight from the two receive buffers), ``torch.sort`` (stable), :func:`slot_starts` (the run
starts), ``torch.cumsum`` and :func:`slot_sums` (the slot numbers and every slot's sum, the
unused slots zeroed): 5 launches; the sort and the scan stay torch ops.

Rows are given as a head (``[Ra, cap]``, e.g. the owner's own row inside its send buffer) and a
tail (``[Rb, cap]``, the receive buffer), each with its counts: row ``i`` of the reduce is head
row ``i`` for ``i < Ra``, else tail row ``i - Ra``; flat position ``e = row·cap + col``.

Order of the additions: a slot's sum is ``((0 + v_0) + v_1) + ...`` over its run in sorted
order, which (stable sort) is row order: the same fp32 additions as zeroing the slots and
``scatter_add``-ing the rows one after another. A run holds at most one entry per row (a row's
indices are distinct), so :func:`slot_sums` walks at most ``Ra + Rb`` entries from each run
start. The torch references (``_*_torch``) are the specification.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON
from .scatter import _scatter_add_torch

if HAS_TRITON:
    import triton
    import triton.language as tl

_BLOCK = 1024


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit
    def _row_entry(e, ca_ptr, ca_stride, cb_ptr, cb_stride, Ra, cap, inb):
        """Row, column, head flag and validity (column < the row's count) of flat position e."""
        row = e // cap
        col = e - row * cap
        in_a = row < Ra
        rb = row - Ra
        cnt_a = tl.load(ca_ptr + row * ca_stride, mask=inb & in_a, other=0)
        cnt_b = tl.load(cb_ptr + rb * cb_stride, mask=inb & (row >= Ra), other=0)
        cnt = tl.where(in_a, cnt_a, cnt_b).to(tl.int64)
        return row, col, in_a, inb & (col < cnt)

    @triton.jit(do_not_specialize=["Ra", "total", "cap", "n"])
    def _slot_keys_kernel(
        key_ptr,                 # *int64 [total]     out: index, or n past the row's count
        ia_ptr, ia_stride,       # *int32 [Ra, cap]   head rows' indices (inner stride 1)
        ca_ptr, ca_stride,       # *int32 [Ra]        head rows' counts (strided)
        ib_ptr, ib_stride,       # *int32 [Rb, cap]   tail rows' indices (inner stride 1)
        cb_ptr, cb_stride,       # *int32 [Rb]        tail rows' counts (strided)
        Ra, total, cap, n,
        BLOCK: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = e < total
        row, col, in_a, valid = _row_entry(e, ca_ptr, ca_stride, cb_ptr, cb_stride, Ra, cap,
                                           inb)
        ia = tl.load(ia_ptr + row * ia_stride + col, mask=valid & in_a, other=0)
        ib = tl.load(ib_ptr + (row - Ra) * ib_stride + col, mask=valid & (row >= Ra), other=0)
        idx = tl.where(in_a, ia, ib).to(tl.int64)
        tl.store(key_ptr + e, tl.where(valid, idx, n), mask=inb)

    @triton.jit(do_not_specialize=["m"])
    def _slot_starts_kernel(
        key_ptr,       # *int64 [m]   sorted keys
        first_ptr,     # *int1  [m]   out: e == 0 or key[e] != key[e-1]
        m,
        BLOCK: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = e < m
        key = tl.load(key_ptr + e, mask=inb, other=0)
        prev = tl.load(key_ptr + e - 1, mask=inb & (e > 0), other=0)
        tl.store(first_ptr + e, (e == 0) | (key != prev), mask=inb)

    @triton.jit(do_not_specialize=["Ra", "R", "m", "cap"])
    def _slot_sums_kernel(
        key_ptr,                 # *int64 [m]         sorted keys
        perm_ptr,                # *int64 [m]         flat position of each sorted key
        first_ptr,               # *int1  [m]         run starts
        csum_ptr,                # *int64 [m]         inclusive cumsum of the run starts
        slot_ptr,                # *int64 [m]         out: csum - 1 (may not alias csum)
        sums_ptr,                # *fp32  [>= m]      out: [0, S) the slots' sums, [S, m) zero
        ca_ptr, ca_stride,       # *int32 [Ra]        head rows' counts (strided)
        cb_ptr, cb_stride,       # *int32 [Rb]        tail rows' counts (strided)
        va_ptr, va_stride,       # *fp32|bf16 [Ra, cap] head rows' values (inner stride 1)
        vb_ptr, vb_stride,       # *fp32|bf16 [Rb, cap] tail rows' values (inner stride 1)
        Ra, R, m, cap,
        BLOCK: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = e < m
        cs = tl.load(csum_ptr + e, mask=inb, other=0)
        tl.store(slot_ptr + e, cs - 1, mask=inb)
        n_slots = tl.load(csum_ptr + m - 1)
        start = inb & (tl.load(first_ptr + e, mask=inb, other=0) != 0)
        key = tl.load(key_ptr + e, mask=start, other=0)
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        alive = start
        for t in range(0, R):        # a run: at most one entry per row, in row order
            j = e + t
            alive = alive & (j < m)
            alive = alive & (tl.load(key_ptr + j, mask=alive, other=0) == key)
            p = tl.load(perm_ptr + j, mask=alive, other=0)
            row, col, in_a, valid = _row_entry(p, ca_ptr, ca_stride, cb_ptr, cb_stride, Ra,
                                               cap, alive)
            va = tl.load(va_ptr + row * va_stride + col, mask=valid & in_a, other=0.0)
            vb = tl.load(vb_ptr + (row - Ra) * vb_stride + col, mask=valid & (row >= Ra),
                         other=0.0)
            v = tl.where(in_a, va.to(tl.float32), vb.to(tl.float32))
            acc = tl.where(valid, acc + v, acc)
        tl.store(sums_ptr + (cs - 1), acc, mask=start)
        tl.store(sums_ptr + e, tl.zeros((BLOCK,), dtype=tl.float32), mask=inb & (e >= n_slots))

    def _grid(total):
        return (triton.cdiv(total, _BLOCK),)

    @_dispatch.serialized_when_interpreted
    def _slot_keys_triton(key, ia, ca, ib, cb, n):
        Ra, cap = ia.shape
        _slot_keys_kernel[_grid(key.numel())](
            key, ia, ia.stride(0), ca, ca.stride(0), ib, ib.stride(0), cb, cb.stride(0),
            Ra, key.numel(), cap, n, BLOCK=_BLOCK, num_warps=4)

    @_dispatch.serialized_when_interpreted
    def _slot_starts_triton(key, first):
        _slot_starts_kernel[_grid(key.numel())](key, first, key.numel(), BLOCK=_BLOCK,
                                                 num_warps=4)

    @_dispatch.serialized_when_interpreted
    def _slot_sums_triton(key, perm, first, csum, slot, sums, ca, cb, va, vb):
        Ra, cap = va.shape
        m = key.numel()
        _slot_sums_kernel[_grid(m)](
            key, perm, first, csum, slot, sums, ca, ca.stride(0), cb, cb.stride(0),
            va, va.stride(0), vb, vb.stride(0), Ra, Ra + vb.shape[0], m, cap,
            BLOCK=_BLOCK, num_warps=4)


# ----------------------------------------------------------------------------------------------
# torch references (the specification)
# ----------------------------------------------------------------------------------------------
def _slot_keys_torch(key, ia, ca, ib, cb, n):
    idx = torch.cat([ia, ib]).to(torch.int64)
    counts = torch.cat([ca, cb]).reshape(-1, 1)
    slots = torch.arange(idx.shape[1], device=idx.device)
    key.copy_(torch.where(slots < counts, idx, n).reshape(-1))


def _slot_starts_torch(key, first):
    first[:1] = True
    first[1:] = key[1:] != key[:-1]


def _slot_sums_torch(key, perm, first, csum, slot, sums, ca, cb, va, vb):
    m = key.numel()
    slot.copy_(csum - 1)
    vals = torch.cat([va, vb]).float()
    slot_of = torch.empty_like(slot).scatter_(0, perm, slot).to(torch.int32).view(vals.shape)
    sums[:m].zero_()
    _scatter_add_torch(sums, slot_of, vals, torch.cat([ca, cb]), 0)


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------
def _check_rows(fn: str, what: str, a: Tensor, b: Tensor, ca: Tensor, cb: Tensor, dtypes):
    """Head and tail rows [Ra, cap] and [Rb, cap] of one dtype (inner stride 1), counts int32
    [Ra] and [Rb]; returns (Ra + Rb, cap)."""
    if (a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[1] or a.dtype != b.dtype
            or a.dtype not in dtypes or (a.shape[1] > 1 and (a.stride(1) != 1
                                                             or b.stride(1) != 1))):
        raise ValueError(f"{fn}: {what} must be two {'|'.join(str(d) for d in dtypes)} "
                         f"tensors [Ra, cap] and [Rb, cap] with inner stride 1, got "
                         f"{a.dtype} {list(a.shape)} and {b.dtype} {list(b.shape)}")
    if (ca.dim() != 1 or cb.dim() != 1 or ca.dtype != torch.int32 or cb.dtype != torch.int32
            or ca.shape[0] != a.shape[0] or cb.shape[0] != b.shape[0]):
        raise ValueError(f"{fn}: counts must be int32 [{a.shape[0]}] and [{b.shape[0]}], got "
                         f"{ca.dtype} {list(ca.shape)} and {cb.dtype} {list(cb.shape)}")
    return a.shape[0] + b.shape[0], a.shape[1]


def slot_keys(head: Tensor, head_counts: Tensor, tail: Tensor, tail_counts: Tensor, n: int, *,
              out: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """The sort keys of the rows ``head`` then ``tail`` (int32 [Ra, cap], [Rb, cap]; counts
    int32 [Ra], [Rb], may be strided views): int64 [(Ra + Rb)·cap], the index at ``row·cap +
    col`` for ``col < count[row]``, else ``n`` (sorts last). One launch."""
    R, cap = _check_rows("slot_keys", "indices", head, tail, head_counts, tail_counts,
                         (torch.int32,))
    if out is None:
        out = torch.empty(R * cap, dtype=torch.int64, device=head.device)
    if out.shape != (R * cap,) or out.dtype != torch.int64 or not out.is_contiguous():
        raise ValueError(f"slot_keys: out must be contiguous int64 [{R * cap}], got "
                         f"{out.dtype} {list(out.shape)}")
    _dispatch.record(launches=1, bytes=12 * R * cap)
    if out.numel() == 0:
        return out
    _dispatch.run(backend, head.device, _slot_keys_triton, _slot_keys_torch, out, head,
                  head_counts, tail, tail_counts, int(n))
    return out


def slot_starts(keys: Tensor, *, out: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """Run starts of sorted keys (int64 [m]): bool [m], ``e == 0 or keys[e] != keys[e-1]``.
    One launch."""
    if keys.dim() != 1 or keys.dtype != torch.int64 or not keys.is_contiguous():
        raise ValueError(f"slot_starts: keys must be contiguous int64 [m], got {keys.dtype} "
                         f"{list(keys.shape)}")
    if out is None:
        out = torch.empty_like(keys, dtype=torch.bool)
    if out.shape != keys.shape or out.dtype != torch.bool or not out.is_contiguous():
        raise ValueError(f"slot_starts: out must be contiguous bool [{keys.numel()}], got "
                         f"{out.dtype} {list(out.shape)}")
    _dispatch.record(launches=1, bytes=9 * keys.numel())
    if keys.numel() == 0:
        return out
    _dispatch.run(backend, keys.device, _slot_starts_triton, _slot_starts_torch, keys, out)
    return out


def slot_sums(keys: Tensor, perm: Tensor, first: Tensor, csum: Tensor, sums: Tensor,
              head_counts: Tensor, tail_counts: Tensor, head_values: Tensor,
              tail_values: Tensor, *, backend: str = "auto") -> Tensor:
    """Each slot's sum: returns ``slot`` (int64 [m], ``csum - 1``: the slot of each sorted key)
    and writes ``sums[s]`` (fp32, ``numel >= m``) = the sum, in row order, of the valid entries
    (``col < count[row]``) whose sorted position has slot ``s``, for the ``S = csum[-1]`` slots,
    and zero on ``[S, m)``. ``keys, perm = torch.sort(slot_keys(...), stable=True)``; ``first
    = slot_starts(keys)``, ``csum = torch.cumsum(first, 0)`` (int64); the rows' values (fp32 or
    bf16 [Ra, cap], [Rb, cap], inner stride 1) and counts are those the keys were built from.
    The same fp32 additions as zeroing ``sums`` and ``scatter_add``-ing the rows in order. One
    launch, no host read."""
    R, cap = _check_rows("slot_sums", "values", head_values, tail_values, head_counts,
                         tail_counts, (torch.float32, torch.bfloat16))
    m = R * cap
    for name, t, dt in (("keys", keys, torch.int64), ("perm", perm, torch.int64),
                        ("first", first, torch.bool), ("csum", csum, torch.int64)):
        if t.shape != (m,) or t.dtype != dt or not t.is_contiguous():
            raise ValueError(f"slot_sums: {name} must be contiguous {dt} [{m}], got {t.dtype} "
                             f"{list(t.shape)}")
    if sums.dim() != 1 or sums.dtype != torch.float32 or not sums.is_contiguous() \
            or sums.numel() < m:
        raise ValueError(f"slot_sums: sums must be contiguous fp32 [>= {m}], got {sums.dtype} "
                         f"{list(sums.shape)}")
    slot = torch.empty_like(csum)
    _dispatch.record(launches=1, bytes=(8 * 4 + 1 + 4 + 4) * m)
    if m == 0:
        return slot
    _dispatch.run(backend, keys.device, _slot_sums_triton, _slot_sums_torch, keys, perm, first,
                  csum, slot, sums, head_counts, tail_counts, head_values, tail_values)
    return slot


# ----------------------------------------------------------------------------------------------
# the CPU compile check (oktopk_triton/kernels/_compile_check.py)
# ----------------------------------------------------------------------------------------------
def compile_variants():
    """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps) per variant."""
    yield ("slots slot_keys", _slot_keys_kernel,
           {"key_ptr": "*i64", "ia_ptr": "*i32", "ia_stride": "i32", "ca_ptr": "*i32",
            "ca_stride": "i32", "ib_ptr": "*i32", "ib_stride": "i32", "cb_ptr": "*i32",
            "cb_stride": "i32", "Ra": "i64", "total": "i64", "cap": "i64", "n": "i64",
            "BLOCK": "constexpr"},
           {"BLOCK": _BLOCK}, [0, 1, 3, 5, 7], 4)
    yield ("slots slot_starts", _slot_starts_kernel,
           {"key_ptr": "*i64", "first_ptr": "*u1", "m": "i64", "BLOCK": "constexpr"},
           {"BLOCK": _BLOCK}, [0, 1], 4)
    for vt in ("*fp32", "*bf16"):
        yield (f"slots slot_sums values={vt[1:]}", _slot_sums_kernel,
               {"key_ptr": "*i64", "perm_ptr": "*i64", "first_ptr": "*u1", "csum_ptr": "*i64",
                "slot_ptr": "*i64", "sums_ptr": "*fp32", "ca_ptr": "*i32", "ca_stride": "i32",
                "cb_ptr": "*i32", "cb_stride": "i32", "va_ptr": vt, "va_stride": "i32",
                "vb_ptr": vt, "vb_stride": "i32", "Ra": "i64", "R": "i64", "m": "i64",
                "cap": "i64", "BLOCK": "constexpr"},
               {"BLOCK": _BLOCK}, [0, 1, 2, 3, 4, 5], 4)
