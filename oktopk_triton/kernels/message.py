"""Ok-Topk's reduce rows: from the staging rows to the packed int32 message in two launches.

Why: after the select pass, each row's ``cap_r`` largest staged candidates became the message
``msg[P, 2 + cap_r + value words]`` through 12 kernel-launching torch ops on [P, cap_s]
tensors (the staged magnitudes, a top-k, the choice between its positions and the staging
order, the header's clamp and copy, two gathers, the values' bit copy; the bf16 wire one more)
of a 62-launch steady step (``oktopk-bench launches``, P = 4, n = 2^17, 1%), each a few
microseconds on a GPU for under 100 KB. Here :func:`staged_magnitudes` (one launch) feeds
``torch.topk`` (kept: a k-selection, and its tie order is the step's), and :func:`pack_rows`
(one launch) writes the whole message, header, indices and values (fp32 bits, or bf16 pairs),
and returns the rows' fp32 values for the compact encode and the Selection: 3 launches.

A row with more than ``cap_r`` candidates sends the ``cap_r`` its top-k chose (in the top-k's
order); one with fewer sends its staging slots in order (valid ones first, then whatever the
staging row holds past its count: the receivers read only the count). The torch references
(``_*_torch``) are the specification: the ops the step issued before, so the message is bit for
bit the same (bf16: round to nearest even in integer arithmetic, as torch's ``.to(bfloat16)``;
the interpreter's own float cast truncates).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON
from .selection import Selection

if HAS_TRITON:
    import triton
    import triton.language as tl

_HEADER = 2     # int32 words in front of a row: count (clamped to cap_r), non-finite flag
_BLOCK = 1024


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit(do_not_specialize=["L"])
    def _staged_magnitudes_kernel(
        val_ptr, val_stride,   # *fp32  [P, L] (row stride): staged values
        cnt_ptr,               # *int32 [P]    true staged counts (may exceed L)
        mag_ptr,               # *fp32  [P, L] out (contiguous): |value| below the count, else -1
        idx_ptr, idx_stride,   # *int32 [P, L] (row stride): staged region-relative indices
                               #               (if HAS_WEIGHT)
        off_ptr,               # *int64 [P+1]  the regions' starts (if HAS_WEIGHT)
        w_ptr,                 # *fp32  [n]    weights: the magnitude is |value|·|w[start + idx]|
                               #               (if HAS_WEIGHT)
        L,
        HAS_WEIGHT: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        j = tl.program_id(0).to(tl.int64)
        e = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = e < L
        staged = inb & (e < tl.load(cnt_ptr + j))
        a = tl.abs(tl.load(val_ptr + j * val_stride + e, mask=staged, other=0.0))
        if HAS_WEIGHT:
            i = tl.load(idx_ptr + j * idx_stride + e, mask=staged, other=0).to(tl.int64)
            a = a * tl.abs(tl.load(w_ptr + tl.load(off_ptr + j) + i, mask=staged, other=0.0))
        tl.store(mag_ptr + j * L + e, tl.where(staged, a, -1.0), mask=inb)

    @triton.jit
    def _bf16_bits(v):
        """fp32 -> the 16 bits of bf16(v), round to nearest even; NaN -> 0x7FC0 (as torch)."""
        b = v.to(tl.int32, bitcast=True)
        r = ((b + (0x7FFF + ((b >> 16) & 1))) >> 16) & 0xFFFF
        return tl.where(v != v, 0x7FC0, r)

    @triton.jit
    def _row_entries(sidx_ptr, sval_ptr, pos_ptr, choose, e, inb):
        """Staging position of entries ``e`` (the top-k's when ``choose``, else ``e``) and the
        index and value there (pointers at the row's start)."""
        p = tl.where(choose, tl.load(pos_ptr + e, mask=inb, other=0), e)
        idx = tl.load(sidx_ptr + p, mask=inb, other=0)
        val = tl.load(sval_ptr + p, mask=inb, other=0.0)
        return idx, val

    @triton.jit(do_not_specialize=["cr"])
    def _pack_rows_kernel(
        sidx_ptr, sidx_stride,  # *int32 [P, cap_s] (row stride): staged indices
        sval_ptr, sval_stride,  # *fp32  [P, cap_s] (row stride): staged values
        cnt_ptr,                # *int32 [P]   true staged counts
        nf_ptr,                 # *int32 [P]   the select pass's non-finite flags
        pos_ptr,                # *int64 [P, cr] (contiguous): the top-k's staging positions
        msg_ptr, msg_stride,    # *int32 [P, 2 + cr + words] (row stride): out, the message
        vals_ptr,               # *fp32  [P, cr] (contiguous): out, the rows' values
        cr,
        BF16: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        j = tl.program_id(0).to(tl.int64)
        b = tl.program_id(1)
        cnt = tl.load(cnt_ptr + j)
        choose = cnt > cr                    # more candidates than the row holds: the top-k's
        sidx = sidx_ptr + j * sidx_stride
        sval = sval_ptr + j * sval_stride
        pos = pos_ptr + j * cr
        row = msg_ptr + j * msg_stride
        if BF16:   # lanes are words: entries 2w (low half) and 2w + 1 (high half, 0 past cr)
            w = b.to(tl.int64) * (BLOCK // 2) + tl.arange(0, BLOCK // 2)
            e0 = 2 * w
            e1 = e0 + 1
            m0 = e0 < cr
            m1 = e1 < cr
            i0, v0 = _row_entries(sidx, sval, pos, choose, e0, m0)
            i1, v1 = _row_entries(sidx, sval, pos, choose, e1, m1)
            tl.store(row + 2 + e0, i0, mask=m0)
            tl.store(row + 2 + e1, i1, mask=m1)
            tl.store(vals_ptr + j * cr + e0, v0, mask=m0)
            tl.store(vals_ptr + j * cr + e1, v1, mask=m1)
            word = _bf16_bits(v0) | (tl.where(m1, _bf16_bits(v1), 0) << 16)
            tl.store(row + 2 + cr + w, word, mask=m0)
        else:
            e = b.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
            inb = e < cr
            idx, val = _row_entries(sidx, sval, pos, choose, e, inb)
            tl.store(row + 2 + e, idx, mask=inb)
            tl.store(row + 2 + cr + e, val.to(tl.int32, bitcast=True), mask=inb)
            tl.store(vals_ptr + j * cr + e, val, mask=inb)
        if b == 0:
            tl.store(row, tl.minimum(cnt, cr))
            tl.store(row + 1, tl.load(nf_ptr + j))

    @_dispatch.serialized_when_interpreted
    def _staged_magnitudes_triton(values, counts, mag, indices=None, offsets=None, weight=None):
        P, L = values.shape
        w = weight is not None
        _staged_magnitudes_kernel[(P, triton.cdiv(L, _BLOCK))](
            values, values.stride(0), counts, mag, indices if w else counts,
            indices.stride(0) if w else 0, offsets if w else counts, weight if w else mag, L,
            HAS_WEIGHT=w, BLOCK=_BLOCK, num_warps=4)

    @_dispatch.serialized_when_interpreted
    def _pack_rows_triton(msg, stage, pos, vals, cr, bf16):
        P = msg.shape[0]
        _pack_rows_kernel[(P, triton.cdiv(cr, _BLOCK))](
            stage.indices, stage.indices.stride(0), stage.values, stage.values.stride(0),
            stage.counts, stage.nonfinite, pos, msg, msg.stride(0), vals, cr,
            BF16=bf16, BLOCK=_BLOCK, num_warps=4)


# ----------------------------------------------------------------------------------------------
# torch references (the specification: the step's ops before the cut)
# ----------------------------------------------------------------------------------------------
def _staged_magnitudes_torch(values, counts, mag, indices=None, offsets=None, weight=None):
    P, L = values.shape
    staged = torch.arange(L, dtype=torch.int32, device=values.device) < counts.reshape(P, 1)
    a = values.abs()
    if weight is not None:   # unstaged slots may hold anything: their positions are clamped
        pos = (offsets[:P].reshape(P, 1) + indices.to(torch.int64)).clamp(0, weight.numel() - 1)
        a = a * weight[pos].abs()
    mag.copy_(torch.where(staged, a, torch.full_like(values, -1.0)))


def _pack_rows_torch(msg, stage, pos, vals, cr, bf16):
    P = msg.shape[0]
    counts = stage.counts.reshape(P, 1)
    slots = torch.arange(cr, dtype=torch.int32, device=msg.device).reshape(1, -1)
    pos = torch.where(counts > cr, pos, slots)
    msg[:, 0] = stage.counts.clamp(max=cr)
    msg[:, 1] = stage.nonfinite
    torch.gather(stage.indices, 1, pos, out=msg[:, _HEADER:_HEADER + cr])
    vals.copy_(stage.values.gather(1, pos))
    if bf16:   # pairs of bf16 per word, the odd count's pad half 0
        wire = torch.zeros(P, 2 * ((cr + 1) // 2), dtype=torch.bfloat16, device=msg.device)
        wire[:, :cr] = vals
        msg[:, _HEADER + cr:] = wire.view(torch.int32)
    else:
        msg[:, _HEADER + cr:] = vals.view(torch.int32)


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------
def _check_stage(stage: Selection) -> Tuple[int, int]:
    """(P, cap_s) of a staging selection, after checking its dtypes and layouts."""
    if not isinstance(stage, Selection):
        raise ValueError(f"stage must be a Selection (fused_select's staging rows), got "
                         f"{type(stage).__name__}")
    idx, val, cnt, nf = stage
    if idx.dtype != torch.int32 or idx.dim() != 2 or val.dtype != torch.float32 \
            or val.shape != idx.shape:
        raise ValueError(f"stage.indices int32 and stage.values fp32 must be [P, cap_s], got "
                         f"{idx.dtype} {tuple(idx.shape)} and {val.dtype} {tuple(val.shape)}")
    P, L = idx.shape
    for name, t in (("counts", cnt), ("nonfinite", nf)):
        if t.dtype != torch.int32 or t.shape != (P,) or not t.is_contiguous():
            raise ValueError(f"stage.{name} must be a contiguous int32 [{P}] tensor, got "
                             f"{t.dtype} {tuple(t.shape)}")
    if L > 1 and (idx.stride(1) != 1 or val.stride(1) != 1):
        raise ValueError("stage.indices/values need inner stride 1")
    return P, L


def staged_magnitudes(stage: Selection, *, weight: Optional[Tensor] = None,
                      offsets: Optional[Tensor] = None, backend: str = "auto") -> Tensor:
    """The staging rows as magnitudes, fp32 [P, cap_s] contiguous: ``|values[j, s]|`` where
    ``s < counts[j]`` (staged), else -1 (what the row's top-k never prefers to a staged one).
    With ``weight`` (fp32 [n], the score :func:`fused_select` staged with) and ``offsets``
    (int64 [P+1], the regions the staged indices are relative to), ``|values[j, s]| ·
    |weight[offsets[j] + indices[j, s]]|``. One launch."""
    P, L = _check_stage(stage)
    if (weight is None) != (offsets is None):
        raise ValueError("staged_magnitudes: weight and offsets go together (the staged indices "
                         "are relative to their region's start)")
    if weight is not None:
        if not (isinstance(weight, Tensor) and weight.dtype == torch.float32
                and weight.dim() == 1 and weight.is_contiguous()):
            raise ValueError(f"weight must be a contiguous 1-dim fp32 tensor, got "
                             f"{getattr(weight, 'dtype', type(weight).__name__)}")
        if not (isinstance(offsets, Tensor) and offsets.dtype == torch.int64
                and offsets.dim() == 1 and offsets.numel() >= P + 1 and offsets.is_contiguous()):
            got = getattr(offsets, "dtype", type(offsets).__name__)
            raise ValueError(f"offsets must be a contiguous int64 tensor of at least {P + 1} "
                             f"region starts, got {got}")
    mag = torch.empty(P, L, dtype=torch.float32, device=stage.values.device)
    extra = 8 * P * L if weight is not None else 0      # the staged indices and their weights
    _dispatch.record(launches=1, bytes=8 * P * L + 4 * P + extra)
    if P * L:
        args = (stage.values, stage.counts, mag)
        if weight is not None:
            args += (stage.indices, offsets, weight)
        _dispatch.run(backend, mag.device, _staged_magnitudes_triton, _staged_magnitudes_torch,
                      *args)
    return mag


def pack_rows(msg: Tensor, stage: Selection, pos: Tensor, *, bf16: bool = False,
              backend: str = "auto") -> Tensor:
    """Write the reduce rows' message ``msg`` (int32 [P, 2 + cap_r + words], inner stride 1)
    from the staging rows and return their values, fp32 [P, cap_r] contiguous.

    ``pos`` int64 [P, cap_r] (contiguous): per row, the staging positions its top-k chose;
    used where ``counts[j] > cap_r``, else row j takes positions ``0..cap_r-1``. Row j of
    ``msg``: ``[min(counts[j], cap_r), nonfinite[j], cap_r indices, values]``, the values as
    fp32 bits (``words = cap_r``) or, with ``bf16``, two per word, rounded to nearest even, low
    half first, the odd count's last high half 0 (``words = ceil(cap_r / 2)``). One launch."""
    P, L = _check_stage(stage)
    if not isinstance(pos, Tensor) or pos.dtype != torch.int64 or pos.dim() != 2 \
            or pos.shape[0] != P or not pos.is_contiguous():
        raise ValueError(f"pos must be a contiguous int64 [{P}, cap_r] tensor (the top-k's "
                         f"positions), got {getattr(pos, 'dtype', type(pos).__name__)} "
                         f"{tuple(getattr(pos, 'shape', ()))}")
    cr = pos.shape[1]
    if not 1 <= cr <= L:
        raise ValueError(f"cap_r (pos.shape[1]) must be in [1, cap_s = {L}], got {cr}")
    words = (cr + 1) // 2 if bf16 else cr
    if not isinstance(msg, Tensor) or msg.dtype != torch.int32 \
            or tuple(msg.shape) != (P, _HEADER + cr + words) or msg.stride(1) != 1:
        raise ValueError(f"msg must be an int32 [{P}, {_HEADER + cr + words}] tensor with inner "
                         f"stride 1 ({'bf16' if bf16 else 'fp32'} values), got "
                         f"{getattr(msg, 'dtype', type(msg).__name__)} "
                         f"{tuple(getattr(msg, 'shape', ()))}")
    vals = torch.empty(P, cr, dtype=torch.float32, device=msg.device)
    # reads: positions, staged index and value; writes: index, value word(s), vals
    _dispatch.record(launches=1, bytes=P * (24 * cr + 4 * words + 16))
    if P:
        args = (msg, stage, pos, vals, cr, bool(bf16))
        _dispatch.run(backend, msg.device, _pack_rows_triton, _pack_rows_torch, *args)
    return vals


# ----------------------------------------------------------------------------------------------
# compile check (oktopk_triton/kernels/_compile_check.py compiles these for sm_90 without a GPU)
# ----------------------------------------------------------------------------------------------
def compile_variants():
    """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps, options) per
    variant, as the launchers above launch them."""
    for w in (False, True):
        yield (f"message staged_magnitudes weight={w}", _staged_magnitudes_kernel,
               {"val_ptr": "*fp32", "val_stride": "i32", "cnt_ptr": "*i32", "mag_ptr": "*fp32",
                "idx_ptr": "*i32" if w else "*i32", "idx_stride": "i32",
                "off_ptr": "*i64" if w else "*i32", "w_ptr": "*fp32", "L": "i32",
                "HAS_WEIGHT": "constexpr", "BLOCK": "constexpr"},
               {"HAS_WEIGHT": w, "BLOCK": _BLOCK}, [0, 2, 3, 4, 6, 7], 4, {})
    for bf16 in (False, True):
        yield (f"message pack_rows bf16={bf16}", _pack_rows_kernel,
               {"sidx_ptr": "*i32", "sidx_stride": "i32", "sval_ptr": "*fp32",
                "sval_stride": "i32", "cnt_ptr": "*i32", "nf_ptr": "*i32", "pos_ptr": "*i64",
                "msg_ptr": "*i32", "msg_stride": "i32", "vals_ptr": "*fp32", "cr": "i32",
                "BF16": "constexpr", "BLOCK": "constexpr"},
               {"BF16": bf16, "BLOCK": _BLOCK}, [0, 2, 4, 5, 6, 7, 9], 4, {})
