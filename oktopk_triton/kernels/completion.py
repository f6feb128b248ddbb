"""Completed sums' values-only rows (Ok-Topk ``complete_sums=True``, docs/algorithms.md §2):
encode, the owner's sum, and the add into ``out``, as Triton passes with a torch reference
beside each.

After the gather every rank knows the chosen entries I as rows (``idx`` int32 [R, cap], the
first ``cnt[s]`` of row s valid, region-relative to ``offs[s]``). The second exchange sends
values only, the positions being known on both ends:

* :func:`owed_encode`: each rank reads what it still owes at I from its residual, writes one
  values-only row per owner and keeps ``owed - q(owed)`` (what the wire dropped) in place;
* :func:`owner_sum`: the owner decodes the P rows it received and sums them, times ``1/P``;
* :func:`slot_encode`: the owner encodes that sum ``f`` and keeps ``P·(f - q(f))``;
* :func:`values_add`: every rank decodes the gathered slots and adds them into ``out`` at I
  (and zeroes the delivered velocity, with momentum masking).

A values-only row of ``cap`` values (:func:`values_words`): fp32, ``cap`` words of fp32 bits;
q2, two scale words (``base``, ``step``: the row's two Lloyd centroids from the split at the mean,
as q2's chunks, kernels/wire_quantized.py) and ``ceil(cap/16)`` words of 2-bit codes (sign,
the nearer centroid), code i at bit ``2·(i % 16)`` of word ``i // 16``. The row's sums are exact
integer sums of fixed-point magnitudes (that module's scheme), so the scales do not depend on
the order of the entries and the Triton passes give the reference's bits.

Measured why: docs/research/design-notes.md, ``oktopk_triton/kernels/completion.py``.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON
from .wire_format import Format
from .wire_format import get as get_format
from .wire_quantized import levels, pack_fields, quantized_scales, unpack_fields

if HAS_TRITON:
    import triton
    import triton.language as tl

    from .wire_quantized import _fixed_terms, _fixed_value

_PER = 16           # 2-bit codes a word
_SCALES = 2         # base, step
_TABLE = 4          # per row: emax, sum of units, count at or above the mean, their units

if HAS_TRITON:

    @triton.jit
    def _row_positions(offs_ptr, idx_ptr, cnt_ptr, cap, idx_stride, BLOCK: tl.constexpr):
        """Program (s, b)'s slots of row s: ``(slots, valid, pos)``, ``pos = offs[s] +
        idx[s, i]`` where valid."""
        s = tl.program_id(0).to(tl.int64)
        slots = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        n_valid = tl.minimum(tl.maximum(tl.load(cnt_ptr + s).to(tl.int64), 0), cap)
        valid = slots < n_valid
        rel = tl.load(idx_ptr + s * idx_stride + slots, mask=valid, other=0).to(tl.int64)
        return slots, valid, tl.load(offs_ptr + s).to(tl.int64) + rel

    @triton.jit
    def _row_slots(res_ptr, src_ptr, offs_ptr, idx_ptr, cnt_ptr, cap, idx_stride, src_stride,
                   GATHER: tl.constexpr, BLOCK: tl.constexpr):
        """:func:`_row_positions` and the value ``x``, read from the residual at ``pos``
        (``GATHER``) or from ``src[s]``."""
        s = tl.program_id(0).to(tl.int64)
        slots, valid, pos = _row_positions(offs_ptr, idx_ptr, cnt_ptr, cap, idx_stride, BLOCK)
        if GATHER:
            x = tl.load(res_ptr + pos, mask=valid, other=0.0)
        else:
            x = tl.load(src_ptr + s * src_stride + slots, mask=valid, other=0.0)
        return slots, valid, pos, x

    @triton.jit
    def _decode_at(row, slots, valid, Q2: tl.constexpr):
        """The values at ``slots`` of one values-only row (0 where not ``valid``)."""
        if Q2:
            base = tl.load(row).to(tl.float32, bitcast=True)
            step = tl.load(row + 1).to(tl.float32, bitcast=True)
            w = tl.load(row + 2 + slots // 16, mask=valid, other=0)
            code = (w >> ((slots % 16) * 2).to(tl.int32)) & 3
            mag = base + (code & 1).to(tl.float32) * step
            v = tl.where((code & 2) != 0, -mag, mag)
        else:
            v = tl.load(row + slots, mask=valid, other=0).to(tl.float32, bitcast=True)
        return tl.where(valid, v, 0.0)

    @triton.jit(do_not_specialize=["cap"])
    def _values_stats_kernel(res_ptr, src_ptr, offs_ptr, idx_ptr, cnt_ptr, tab_ptr, cap,
                             idx_stride, src_stride, GATHER: tl.constexpr, BLOCK: tl.constexpr):
        """The row's largest exponent (one atomic a program)."""
        slots, valid, pos, x = _row_slots(res_ptr, src_ptr, offs_ptr, idx_ptr, cnt_ptr, cap,
                                          idx_stride, src_stride, GATHER, BLOCK)
        e = tl.abs(x).to(tl.int32, bitcast=True).to(tl.int64) >> 23
        emax = tl.max(tl.where(valid, tl.maximum(e, 1), 1), axis=0)
        tl.atomic_max(tab_ptr + tl.program_id(0).to(tl.int64) * 4, emax, sem="relaxed")

    @triton.jit(do_not_specialize=["cap"])
    def _values_sum_kernel(res_ptr, src_ptr, offs_ptr, idx_ptr, cnt_ptr, tab_ptr, cap,
                           idx_stride, src_stride, GATHER: tl.constexpr, SPLIT: tl.constexpr,
                           BLOCK: tl.constexpr):
        """The row's fixed-point sum of magnitudes; ``SPLIT``: the count and the sum of those
        at or above the row's mean (exact integer sums: their order does not matter)."""
        slots, valid, pos, x = _row_slots(res_ptr, src_ptr, offs_ptr, idx_ptr, cnt_ptr, cap,
                                          idx_stride, src_stride, GATHER, BLOCK)
        s = tl.program_id(0).to(tl.int64)
        tab = tab_ptr + s * 4
        emax = tl.load(tab)
        a = tl.abs(x)
        units = tl.where(valid, _fixed_terms(a, emax), 0)
        if SPLIT:
            cnt = tl.minimum(tl.maximum(tl.load(cnt_ptr + s).to(tl.int64), 0), cap)
            mean = tl.math.div_rn(_fixed_value(tl.load(tab + 1), emax),
                                  tl.maximum(cnt, 1).to(tl.float32))
            big = valid & (a >= mean)
            tl.atomic_add(tab + 2, tl.sum(big.to(tl.int64), axis=0), sem="relaxed")
            tl.atomic_add(tab + 3, tl.sum(tl.where(big, units, 0), axis=0), sem="relaxed")
        else:
            tl.atomic_add(tab + 1, tl.sum(units, axis=0), sem="relaxed")

    @triton.jit(do_not_specialize=["cap", "vw"])
    def _values_finish_kernel(res_ptr, src_ptr, offs_ptr, idx_ptr, cnt_ptr, tab_ptr, msg_ptr,
                              cap, vw, idx_stride, src_stride, msg_stride, keep,
                              GATHER: tl.constexpr, Q2: tl.constexpr, BLOCK: tl.constexpr):
        """Each value's code (its block's words whole: no atomics), the row's scale words, and
        the residual update: ``x - q(x)`` in place (``GATHER``), else ``+= keep·(x - q(x))``."""
        slots, valid, pos, x = _row_slots(res_ptr, src_ptr, offs_ptr, idx_ptr, cnt_ptr, cap,
                                          idx_stride, src_stride, GATHER, BLOCK)
        s = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1).to(tl.int64)
        row = msg_ptr + s * msg_stride
        if Q2:
            tab = tab_ptr + s * 4
            cnt = tl.minimum(tl.maximum(tl.load(cnt_ptr + s).to(tl.int64), 0), cap)
            emax = tl.load(tab)
            tot = tl.load(tab + 1)
            nhi = tl.load(tab + 2)
            shi = tl.load(tab + 3)
            chi = tl.math.div_rn(_fixed_value(shi, emax), tl.maximum(nhi, 1).to(tl.float32))
            nlo = cnt - nhi
            clo = tl.math.div_rn(_fixed_value(tot - shi, emax), tl.maximum(nlo, 1).to(tl.float32))
            clo = tl.where(nlo > 0, clo, chi)
            step = chi - clo
            j = (tl.abs(x) >= clo + 0.5 * step).to(tl.int32)    # the nearer centroid
            code = tl.where(valid, tl.where(x < 0, 2, 0) | j, 0)
            mag = clo + j.to(tl.float32) * step
            w = tl.where(valid, tl.where(x < 0, -mag, mag), 0.0)
            shift = (tl.arange(0, 16) * 2).to(tl.int64)
            packed = tl.sum(tl.reshape(code.to(tl.int64), (BLOCK // 16, 16)) << shift[None, :],
                            axis=1)
            wi = b * (BLOCK // 16) + tl.arange(0, BLOCK // 16)
            tl.store(row + 2 + wi, packed.to(tl.int32), mask=2 + wi < vw)
            if b == 0:
                tl.store(row, clo.to(tl.int32, bitcast=True))
                tl.store(row + 1, step.to(tl.int32, bitcast=True))
        else:
            w = tl.where(valid, x, 0.0)
            tl.store(row + slots, w.to(tl.int32, bitcast=True), mask=slots < cap)
        if GATHER:
            tl.store(res_ptr + pos, x - w, mask=valid)
        else:
            r = tl.load(res_ptr + pos, mask=valid, other=0.0)
            tl.store(res_ptr + pos, r + (x - w) * keep, mask=valid)

    @triton.jit(do_not_specialize=["cap", "R", "vw"])
    def _owner_sum_kernel(recv_ptr, cnt_ptr, f_ptr, cap, R, vw, recv_stride, inv_p,
                          Q2: tl.constexpr, BLOCK: tl.constexpr):
        """``f = (row 0 + row 1 + ... + row R-1) · inv_p``, added in that order."""
        slots = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        n_valid = tl.minimum(tl.maximum(tl.load(cnt_ptr).to(tl.int64), 0), cap)
        valid = slots < n_valid
        acc = tl.zeros([BLOCK], tl.float32)
        for s in range(R):
            acc += _decode_at(recv_ptr + s * recv_stride, slots, valid, Q2)
        tl.store(f_ptr + slots, tl.where(valid, acc * inv_p, 0.0), mask=slots < cap)

    @triton.jit(do_not_specialize=["cap", "vw"])
    def _values_add_kernel(msg_ptr, offs_ptr, idx_ptr, cnt_ptr, out_ptr, vel_ptr, cap, vw,
                           idx_stride, msg_stride, Q2: tl.constexpr,
                           HAS_VELOCITY: tl.constexpr, BLOCK: tl.constexpr):
        """``out[offs[s] + idx[s, i]] += value i of row s``; the velocity there set to 0."""
        slots, valid, pos = _row_positions(offs_ptr, idx_ptr, cnt_ptr, cap, idx_stride, BLOCK)
        s = tl.program_id(0).to(tl.int64)
        v = _decode_at(msg_ptr + s * msg_stride, slots, valid, Q2)
        o = tl.load(out_ptr + pos, mask=valid, other=0.0)
        tl.store(out_ptr + pos, o + v, mask=valid)
        if HAS_VELOCITY:
            tl.store(vel_ptr + pos, tl.zeros([BLOCK], tl.float32), mask=valid)

    _BLOCK = 1024

    @_dispatch.serialized_when_interpreted
    def _encode_triton(residual, src, offs, idx, cnt, msg, keep, q2):
        R, cap = idx.shape
        gather = src is None
        src = residual if gather else src
        nb = max(1, triton.cdiv(cap, _BLOCK))
        tab = torch.zeros(R, _TABLE, dtype=torch.int64, device=msg.device)
        args = (residual, src, offs, idx, cnt, tab, cap, idx.stride(0),
                0 if gather else src.stride(0))
        if q2:
            _values_stats_kernel[(R, nb)](*args, GATHER=gather, BLOCK=_BLOCK, num_warps=4)
            for split in (False, True):
                _values_sum_kernel[(R, nb)](*args, GATHER=gather, SPLIT=split, BLOCK=_BLOCK,
                                            num_warps=4, enable_fp_fusion=False)
        _values_finish_kernel[(R, nb)](*args[:6], msg, cap, msg.shape[1], *args[7:],
                                       msg.stride(0), float(keep), GATHER=gather, Q2=q2,
                                       BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)

    @_dispatch.serialized_when_interpreted
    def _owner_sum_triton(recv, cnt, f, inv_p, q2):
        R, cap = recv.shape[0], f.numel()
        _owner_sum_kernel[(max(1, triton.cdiv(cap, _BLOCK)),)](
            recv, cnt, f, cap, R, recv.shape[1], recv.stride(0), float(inv_p), Q2=q2,
            BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)

    @_dispatch.serialized_when_interpreted
    def _add_triton(msg, offs, idx, cnt, out, velocity, q2):
        R, cap = idx.shape
        has = velocity is not None
        _values_add_kernel[(R, max(1, triton.cdiv(cap, _BLOCK)))](
            msg, offs, idx, cnt, out, velocity if has else out, cap, msg.shape[1],
            idx.stride(0), msg.stride(0), Q2=q2, HAS_VELOCITY=has, BLOCK=_BLOCK, num_warps=4,
            enable_fp_fusion=False)


# ---- torch references ---------------------------------------------------------------------
def _positions(offs: Tensor, idx: Tensor, cnt: Tensor):
    """``(valid bool [R, cap], pos int64 [R, cap])``: 0 where not valid."""
    R, cap = idx.shape
    valid = torch.arange(cap, device=idx.device) < cnt.to(torch.int64).view(R, 1).clamp(min=0)
    pos = offs.to(torch.int64).view(R, 1) + idx.to(torch.int64)
    return valid, torch.where(valid, pos, torch.zeros_like(pos))


def _scales_torch(a: Tensor, valid: Tensor):
    """``(base, step [R, 1], j int64 [R, cap])``: the row's two centroids (q2's scales of one
    chunk, :func:`quantized_scales`) and each value's nearer one, as the kernels."""
    one_chunk = torch.where(valid, 0, 1)            # chunk 0, or 1 (C) where not valid
    base, step, _ = quantized_scales(one_chunk, a, valid, 1, 2)
    base, step = base[:, :1], step[:, :1]
    return base, step, (valid & (a >= base + 0.5 * step)).to(torch.int64)   # the nearer one


def _encode_rows_torch(x: Tensor, valid: Tensor, msg: Tensor, q2: bool) -> Tensor:
    """Writes ``msg``; returns the wire values (0 where not valid)."""
    x = torch.where(valid, x, torch.zeros_like(x))
    if not q2:
        msg.copy_(x.view(torch.int32))
        return x
    base, step, j = _scales_torch(x.abs().contiguous(), valid)
    code = torch.where(valid, ((x < 0).to(torch.int64) << 1) | j, 0)
    w = levels(base, step, code, 2)
    msg[:, 0:1] = base.view(torch.int32)
    msg[:, 1:2] = step.view(torch.int32)
    msg[:, 2:] = pack_fields(code, 2)
    return torch.where(valid, w, torch.zeros_like(w))


def _decode_rows_torch(msg: Tensor, cap: int, valid: Tensor, q2: bool) -> Tensor:
    if not q2:
        v = msg[:, :cap].contiguous().view(torch.float32)
    else:
        code = unpack_fields(msg[:, 2:], 2, cap)
        base = msg[:, 0:1].contiguous().view(torch.float32)
        step = msg[:, 1:2].contiguous().view(torch.float32)
        v = levels(base, step, code, 2)
    return torch.where(valid, v, torch.zeros_like(v))


def _encode_torch(residual, src, offs, idx, cnt, msg, keep, q2):
    valid, pos = _positions(offs, idx, cnt)
    x = residual[pos] if src is None else src.to(torch.float32)
    w = _encode_rows_torch(x, valid, msg, q2)
    if src is None:
        new = x - w
    else:
        new = residual[pos] + (x - w) * keep
    _dispatch.scatter_valid(residual, pos, new, valid)


def _owner_sum_torch(recv, cnt, f, inv_p, q2):
    R, cap = recv.shape[0], f.numel()
    valid = torch.arange(cap, device=f.device) < cnt.to(torch.int64).reshape(1).clamp(min=0)
    rows = _decode_rows_torch(recv, cap, valid.expand(R, cap), q2)
    acc = torch.zeros(cap, dtype=torch.float32, device=f.device)
    for s in range(R):   # in row order, as the kernel
        acc = acc + rows[s]
    f.copy_(torch.where(valid, acc * inv_p, torch.zeros_like(acc)))


def _add_torch(msg, offs, idx, cnt, out, velocity, q2):
    valid, pos = _positions(offs, idx, cnt)
    v = _decode_rows_torch(msg, idx.shape[1], valid, q2)
    _dispatch.scatter_valid(out, pos, out[pos] + v, valid)
    if velocity is not None:
        _dispatch.scatter_valid(velocity, pos, torch.zeros_like(v), valid)


# ---- public -------------------------------------------------------------------------------
def values_words(cap: int, fmt: Format) -> int:
    """int32 words of one values-only row of ``cap`` values: ``cap`` (fp32), else
    ``2 + ceil(cap/16)`` (2-bit values, on every packed wire)."""
    return _SCALES + -(-cap // _PER) if _q2(fmt, "values_words") else cap


def _q2(fmt: Format, name: str) -> bool:
    """fp32 values on the fp32 wire; 2-bit values on every packed wire (compact, q2, q4)."""
    return get_format(fmt, f"{name}: fmt").packed


def _check_rows(name: str, offs: Tensor, idx: Tensor, cnt: Tensor, msg: Tensor, fmt: Format):
    if idx.dim() != 2 or idx.dtype not in (torch.int32, torch.int64) or idx.stride(1) != 1:
        raise ValueError(f"{name}: idx must be int32/int64 [R, cap] with inner stride 1, got "
                         f"{idx.dtype} {list(idx.shape)}")
    R, cap = idx.shape
    if offs.numel() != R or cnt.numel() != R or not offs.is_contiguous() \
            or not cnt.is_contiguous():
        raise ValueError(f"{name}: offs and cnt must be contiguous with {R} entries (one a "
                         f"row), got {list(offs.shape)} and {list(cnt.shape)}")
    vw = values_words(cap, fmt)
    if msg.shape != (R, vw) or msg.dtype != torch.int32 or msg.stride(1) != 1:
        raise ValueError(f"{name}: msg must be int32 [{R}, {vw}] with inner stride 1, got "
                         f"{msg.dtype} {list(msg.shape)}")


def owed_encode(residual: Tensor, offs: Tensor, idx: Tensor, cnt: Tensor, msg: Tensor, *,
                fmt: Format, backend: str = "auto") -> None:
    """Row s of ``msg`` (int32 [R, values_words(cap, fmt)]): the values ``residual[offs[s] +
    idx[s, i]]`` for ``i < cnt[s]``, and ``residual`` keeps ``x - q(x)`` there (positions
    distinct). q2: 5 launches (the table's memset, stats, sum, split, finish), fp32: 1."""
    q2 = _q2(fmt, "owed_encode")
    _check_rows("owed_encode", offs, idx, cnt, msg, fmt)
    R, cap = idx.shape
    # bytes: q2, four passes reading an index and a residual value (8 B a slot), the last one
    # writing the residual back and the codes (4 + 1/4); fp32, one pass: 8 + 4 + 4
    _dispatch.record(launches=5 if q2 else 1, bytes=(36 if q2 else 16) * R * cap)
    _dispatch.run(backend, residual.device, _encode_triton if HAS_TRITON else None,
                  _encode_torch, residual, None, offs, idx, cnt, msg, 1.0, q2)


def slot_encode(f: Tensor, residual: Tensor, offs: Tensor, idx: Tensor, cnt: Tensor,
                msg: Tensor, keep: float, *, fmt: Format, backend: str = "auto") -> None:
    """The owner's row: ``msg`` (int32 [1, values_words(cap, fmt)]) from ``f`` (fp32 [1, cap],
    its first ``cnt[0]`` valid), and ``residual[offs[0] + idx[0, i]] += keep·(f - q(f))``
    (``keep`` = P: ``out`` is the sum over P). Launches as :func:`owed_encode`."""
    q2 = _q2(fmt, "slot_encode")
    _check_rows("slot_encode", offs, idx, cnt, msg, fmt)
    R, cap = idx.shape
    if f.shape != (R, cap) or f.dtype != torch.float32 or f.stride(1) != 1:
        raise ValueError(f"slot_encode: f must be fp32 [{R}, {cap}] with inner stride 1, got "
                         f"{f.dtype} {list(f.shape)}")
    # bytes: q2, four passes reading an index and f (8 B a slot), the last one also reading and
    # writing the residual and writing the codes (8 + 1/4); fp32, one pass: 8 + 8 + 4
    _dispatch.record(launches=5 if q2 else 1, bytes=(40 if q2 else 20) * R * cap)
    _dispatch.run(backend, residual.device, _encode_triton if HAS_TRITON else None,
                  _encode_torch, residual, f, offs, idx, cnt, msg, keep, q2)


def owner_sum(recv: Tensor, cnt: Tensor, f: Tensor, inv_p: float, *, fmt: Format,
              backend: str = "auto") -> None:
    """``f`` (fp32 [cap]) = the sum of the R values-only rows ``recv`` (int32 [R, vw]), added in
    row order, times ``inv_p``; 0 from ``cnt[0]`` on. One launch."""
    q2 = _q2(fmt, "owner_sum")
    cap = f.numel()
    vw = values_words(cap, fmt)
    if recv.dim() != 2 or recv.shape[1] != vw or recv.dtype != torch.int32 \
            or recv.stride(1) != 1 or not f.is_contiguous() or f.dtype != torch.float32:
        raise ValueError(f"owner_sum: recv must be int32 [R, {vw}] and f contiguous fp32 "
                         f"[{cap}], got {recv.dtype} {list(recv.shape)} and {f.dtype}")
    # bytes: R rows of 1/4 (q2) or 4 (fp32) B a value read, f written
    R = recv.shape[0]
    _dispatch.record(launches=1, bytes=(R * cap // 4 if q2 else 4 * R * cap) + 4 * cap)
    _dispatch.run(backend, f.device, _owner_sum_triton if HAS_TRITON else None,
                  _owner_sum_torch, recv, cnt.reshape(-1)[:1], f, inv_p, q2)


def values_add(msg: Tensor, offs: Tensor, idx: Tensor, cnt: Tensor, out: Tensor,
               velocity: Optional[Tensor] = None, *, fmt: Format, backend: str = "auto") -> None:
    """``out[offs[s] + idx[s, i]] += value i of row s`` of ``msg`` for ``i < cnt[s]``
    (positions distinct); ``velocity`` (optional): 0 there. One launch."""
    q2 = _q2(fmt, "values_add")
    _check_rows("values_add", offs, idx, cnt, msg, fmt)
    R, cap = idx.shape
    # bytes: an index, the value (1/4 or 4), out read and written, the velocity written
    _dispatch.record(launches=1, bytes=((12 if q2 else 16) + (0 if velocity is None else 4))
                     * R * cap)
    _dispatch.run(backend, out.device, _add_triton if HAS_TRITON else None, _add_torch, msg,
                  offs, idx, cnt, out, velocity, q2)


def compile_variants():
    """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps, options) per
    variant, as the launchers above launch them."""
    no_fma = {"enable_fp_fusion": False}
    row = {"res_ptr": "*fp32", "src_ptr": "*fp32", "offs_ptr": "*i64", "idx_ptr": "*i32",
           "cnt_ptr": "*i32", "tab_ptr": "*i64", "cap": "i32", "idx_stride": "i32",
           "src_stride": "i32"}
    for gather in (True, False):
        c = {"GATHER": gather, "BLOCK": _BLOCK}
        yield (f"completion stats gather={gather}", _values_stats_kernel,
               {**row, "GATHER": "constexpr", "BLOCK": "constexpr"}, c, [0, 1, 2, 3, 4, 5],
               4, {})
        for split in (False, True):
            yield (f"completion sum gather={gather} split={split}", _values_sum_kernel,
                   {**row, "GATHER": "constexpr", "SPLIT": "constexpr", "BLOCK": "constexpr"},
                   {**c, "SPLIT": split}, [0, 1, 2, 3, 4, 5], 4, no_fma)
        for q2 in (True, False):
            sig = {k: v for k, v in row.items() if k not in ("cap", "idx_stride",
                                                             "src_stride")}
            sig.update({"msg_ptr": "*i32", "cap": "i32", "vw": "i32", "idx_stride": "i32",
                        "src_stride": "i32", "msg_stride": "i32", "keep": "fp32",
                        "GATHER": "constexpr", "Q2": "constexpr", "BLOCK": "constexpr"})
            yield (f"completion finish gather={gather} q2={q2}", _values_finish_kernel, sig,
                   {**c, "Q2": q2}, [0, 1, 2, 3, 4, 5, 6], 4, no_fma)
    for q2 in (True, False):
        yield (f"completion owner_sum q2={q2}", _owner_sum_kernel,
               {"recv_ptr": "*i32", "cnt_ptr": "*i32", "f_ptr": "*fp32", "cap": "i32",
                "R": "i32", "vw": "i32", "recv_stride": "i32", "inv_p": "fp32",
                "Q2": "constexpr", "BLOCK": "constexpr"},
               {"Q2": q2, "BLOCK": _BLOCK}, [0, 1, 2], 4, no_fma)
        for has in (True, False):
            yield (f"completion add q2={q2} velocity={has}", _values_add_kernel,
                   {"msg_ptr": "*i32", "offs_ptr": "*i64", "idx_ptr": "*i32", "cnt_ptr": "*i32",
                    "out_ptr": "*fp32", "vel_ptr": "*fp32", "cap": "i32", "vw": "i32",
                    "idx_stride": "i32", "msg_stride": "i32", "Q2": "constexpr",
                    "HAS_VELOCITY": "constexpr", "BLOCK": "constexpr"},
                   {"Q2": q2, "HAS_VELOCITY": has, "BLOCK": _BLOCK}, [0, 1, 2, 3, 4, 5], 4,
                   no_fma)
