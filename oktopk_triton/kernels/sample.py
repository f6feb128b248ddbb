"""Ok-Topk's rank threshold from a fixed sample of this step's acc: two launches around a top-k.

Why: the rank threshold (the k·m/n-th largest |acc| at m fixed random positions, docs/
algorithms.md §3) was 14 kernel-launching torch ops on m-sized and P-sized tensors
(index_select of grad and residual, add, abs, nan_to_num, top-k, min, where, min, maximum,
where, copy, ...) of a 62-launch steady step (``oktopk-bench launches``, P = 4, n = 2^17, 1%),
each a few microseconds on a GPU for at most 256 KB. Here :func:`sample_magnitudes` gathers
the sample's |acc| in one launch, ``torch.topk`` stays (a k-selection), and
:func:`sample_threshold` turns the top values into the rows' thresholds in one single-program
launch: 3 launches.

The torch references (``_*_torch``) are the specification: the ops the step issued before, in
the same order, so the results are bit for bit the same (``velocity·momentum + grad`` rounds
twice: the gather kernel runs with ``enable_fp_fusion=False``).
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON
from .consistency import ema_update

if HAS_TRITON:
    import triton
    import triton.language as tl

_BLOCK = 1024


# ----------------------------------------------------------------------------------------------
# Triton kernels
# ----------------------------------------------------------------------------------------------
if HAS_TRITON:

    @triton.jit(do_not_specialize=["m", "momentum", "rate", "keep"])
    def _sample_magnitudes_kernel(
        grad_ptr,      # *fp32|bf16|fp16 [n]  this step's gradient
        res_ptr,       # *fp32  [n]           residual (not yet accumulated)
        vel_ptr,       # *fp32  [n]           velocity (if VELOCITY)
        idx_ptr,       # *int32 [m]           the sample's positions
        out_ptr,       # *fp32  [m]           out: |residual + g|, 0 where not finite
        w_ptr,         # *fp32  [n]           weights: out is |residual + g|·|w| (if WEIGHT), w
                       #                      as rate·w + keep·sign(grad) (if PREVIEW; not stored)
        m, momentum,
        rate, keep,    # fp32 the weight's EMA (if PREVIEW): the old weight's share, 1 - rate
        VELOCITY: tl.constexpr,
        WEIGHT: tl.constexpr,
        PREVIEW: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        inb = e < m
        i = tl.load(idx_ptr + e, mask=inb, other=0).to(tl.int64)
        g = tl.load(grad_ptr + i, mask=inb, other=0.0).to(tl.float32)
        if WEIGHT:
            w = tl.load(w_ptr + i, mask=inb, other=0.0)
            if PREVIEW:         # what fused_select will store (two roundings and an add)
                w = w * rate + tl.where(g > 0, 1.0, tl.where(g < 0, -1.0, 0.0)) * keep
        if VELOCITY:
            u = tl.load(vel_ptr + i, mask=inb, other=0.0)
            g = u * momentum + g           # two roundings (no FMA: enable_fp_fusion=False)
        a = tl.abs(tl.load(res_ptr + i, mask=inb, other=0.0) + g)
        a = tl.where((a != a) | (a == float("inf")), 0.0, a)      # nan_to_num(0, 0, 0)
        if WEIGHT:
            a = a * tl.abs(w)
        tl.store(out_ptr + e, a, mask=inb)

    @triton.jit(do_not_specialize=["K", "P"])
    def _sample_threshold_kernel(
        top_ptr,       # *fp32  [K]           the sample's K largest |acc| (any order)
        th_ptr,        # *fp32  [P]           the rows' thresholds (updated)
        cap_ptr,       # *fp32  [P]           the rows' staging-fill thresholds (floors)
        nf_ptr,        # *int32 []            non-finite flag (if HAS_NF): keep th on a bad step
        K, P,
        HAS_NF: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        lane = tl.arange(0, BLOCK)
        lo = tl.full([BLOCK], float("inf"), tl.float32)
        for s in range(0, K, BLOCK):
            lo = tl.minimum(lo, tl.load(top_ptr + s + lane, mask=s + lane < K,
                                        other=float("inf")))
        x = tl.min(lo, axis=0)
        old = tl.full([BLOCK], float("inf"), tl.float32)
        for s in range(0, P, BLOCK):
            old = tl.minimum(old, tl.load(th_ptr + s + lane, mask=s + lane < P,
                                          other=float("inf")))
        x = tl.where(x > 0, x, tl.min(old, axis=0))          # an all-zero sample keeps the old
        keep = False
        if HAS_NF:
            keep = tl.load(nf_ptr) > 0
        tl.debug_barrier()      # every load of th above happens before the stores below
        for s in range(0, P, BLOCK):
            j = s + lane
            jm = j < P
            th = tl.maximum(x, tl.load(cap_ptr + j, mask=jm, other=0.0))
            if HAS_NF:
                th = tl.where(keep, tl.load(th_ptr + j, mask=jm, other=0.0), th)
            tl.store(th_ptr + j, th, mask=jm)

    @_dispatch.serialized_when_interpreted
    def _sample_magnitudes_triton(grad, res, vel, idx, out, momentum, weight=None, rate=None):
        m = idx.numel()
        _sample_magnitudes_kernel[(triton.cdiv(m, _BLOCK),)](
            grad, res, vel if vel is not None else res, idx, out,
            weight if weight is not None else res, m, momentum, float(rate or 0.0),
            float(1.0 - (rate or 0.0)), VELOCITY=vel is not None, WEIGHT=weight is not None,
            PREVIEW=rate is not None, BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)

    @_dispatch.serialized_when_interpreted
    def _sample_threshold_triton(top, th, cap, nf):
        _sample_threshold_kernel[(1,)](top, th, cap, nf if nf is not None else th, top.numel(),
                                       th.numel(), HAS_NF=nf is not None, BLOCK=_BLOCK,
                                       num_warps=4)


# ----------------------------------------------------------------------------------------------
# torch references (the specification: the step's ops before the cut)
# ----------------------------------------------------------------------------------------------
def _sample_magnitudes_torch(grad, res, vel, idx, out, momentum, weight=None, rate=None):
    g = grad.index_select(0, idx).float()
    if weight is not None:
        w = weight.index_select(0, idx)
        if rate is not None:   # what fused_select will store
            w = ema_update(w, g, rate)
    if vel is not None:
        g = vel.index_select(0, idx) * momentum + g
    acc = (res.index_select(0, idx) + g).abs()
    acc = acc.nan_to_num(0.0, 0.0, 0.0)            # non-finite entries count as 0
    out.copy_(acc if weight is None else acc * w.abs())


def _sample_threshold_torch(top, th, cap, nf):
    x = top.min()
    x = torch.where(x > 0, x, th.min())            # an all-zero sample keeps the old
    new = torch.maximum(x.expand(th.numel()), cap)
    th.copy_(new if nf is None else torch.where(nf > 0, th, new))


# ----------------------------------------------------------------------------------------------
# public functions
# ----------------------------------------------------------------------------------------------
def _vector(t, name: str, dtypes, numel: Optional[int] = None) -> None:
    if not isinstance(t, Tensor) or t.dtype not in dtypes or t.dim() != 1 \
            or not t.is_contiguous() or (numel is not None and t.numel() != numel):
        want = "/".join(str(d).replace("torch.", "") for d in dtypes)
        size = "" if numel is None else f" of {numel}"
        got = f"{t.dtype} {tuple(t.shape)}" if isinstance(t, Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a contiguous 1-dim {want} tensor{size}, got {got}")


def sample_magnitudes(grad: Tensor, residual: Tensor, idx: Tensor, *,
                      velocity: Optional[Tensor] = None, momentum: float = 0.0,
                      weight: Optional[Tensor] = None, weight_rate: Optional[float] = None,
                      backend: str = "auto") -> Tensor:
    """The sample's |acc|, fp32 [m]: ``|residual[i] + g[i]|`` at the positions ``idx`` (int32
    [m], each in ``[0, n)``), ``g = grad`` (as fp32) or, with ``velocity``,
    ``velocity·momentum + grad`` (two roundings, what ``fused_select`` will accumulate); NaN
    and ±inf count as 0. ``grad`` fp32/bf16/fp16 [n], ``residual`` and ``velocity`` fp32 [n],
    all contiguous. With ``weight`` (fp32 [n]): ``|acc[i]|·|weight[i]|``, the score
    :func:`fused_select` takes with the same weight; with ``weight_rate`` too, the weight as
    ``fused_select`` will update it first (``weight_rate·w + (1 − weight_rate)·sign(grad)``, not
    stored). One launch, no pass over n."""
    _vector(grad, "grad", (torch.float32, torch.bfloat16, torch.float16))
    n = grad.numel()
    _vector(residual, "residual", (torch.float32,), n)
    if velocity is not None:
        _vector(velocity, "velocity", (torch.float32,), n)
    if weight is not None:
        _vector(weight, "weight", (torch.float32,), n)
    if weight_rate is not None and (weight is None or isinstance(weight_rate, bool)
                                    or not isinstance(weight_rate, (int, float))
                                    or not 0 <= weight_rate < 1):
        raise ValueError(f"weight_rate must be a number in [0, 1) with a weight, got "
                         f"{weight_rate!r}")
    _vector(idx, "idx", (torch.int32,))
    m = idx.numel()
    out = torch.empty(m, dtype=torch.float32, device=residual.device)
    _dispatch.record(launches=1, bytes=m * (4 + grad.element_size() + 4 + 4
                                            + (4 if velocity is not None else 0)
                                            + (4 if weight is not None else 0)))
    if m == 0:
        return out
    args = (grad, residual, velocity, idx, out, float(momentum), weight,
            None if weight_rate is None else float(weight_rate))
    _dispatch.run(backend, residual.device, _sample_magnitudes_triton, _sample_magnitudes_torch,
                  *args)
    return out


def sample_threshold(top: Tensor, th_rows: Tensor, cap: Tensor,
                     nonfinite: Optional[Tensor] = None, *, backend: str = "auto") -> None:
    """The rows' thresholds from the sample's top values, in place: ``x = min(top)`` (``top``
    fp32 [K >= 1], the sample's K largest |acc| in any order), or ``min(th_rows)`` when
    ``x <= 0`` (an all-zero sample keeps the old); ``th_rows[j] = max(x, cap[j])`` (no row
    above its staging-fill threshold), unless ``nonfinite > 0`` (int32 one-element): then
    ``th_rows`` is kept. ``th_rows`` and ``cap`` fp32 [P], contiguous. One launch (one
    program), no host read."""
    _vector(top, "top", (torch.float32,))
    if top.numel() == 0:
        raise ValueError("top must hold at least one value (the sample's top-k), got 0")
    _vector(th_rows, "th_rows", (torch.float32,))
    P = th_rows.numel()
    if P == 0:
        raise ValueError("th_rows must hold at least one threshold, got 0")
    _vector(cap, "cap", (torch.float32,), P)
    if nonfinite is not None and (not isinstance(nonfinite, Tensor) or nonfinite.numel() != 1
                                  or nonfinite.dtype != torch.int32):
        raise ValueError(f"nonfinite must be a one-element int32 tensor, got "
                         f"{getattr(nonfinite, 'dtype', type(nonfinite).__name__)}")
    nf = None if nonfinite is None else nonfinite.reshape(())
    _dispatch.record(launches=1, bytes=4 * top.numel() + 12 * P)
    if _dispatch.choose(backend, th_rows.device) == "triton":
        _sample_threshold_triton(top, th_rows, cap, nf)
    else:
        with _dispatch.inside_kernel():
            _sample_threshold_torch(top, th_rows, cap, nf)


# ----------------------------------------------------------------------------------------------
# compile check (oktopk_triton/kernels/_compile_check.py compiles these for sm_90 without a GPU)
# ----------------------------------------------------------------------------------------------
def compile_variants():
    """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps, options) per
    variant, as the launchers above launch them (the gather also with bf16 and fp16 gradients,
    without FP fusion: ``velocity·momentum + grad`` rounds twice)."""
    for grad, vel, w, pre in (("*fp32", False, False, False), ("*fp32", True, False, False),
                              ("*bf16", False, False, False), ("*fp16", True, False, False),
                              ("*fp32", False, True, True), ("*bf16", True, True, True),
                              ("*fp32", True, True, False)):
        yield (f"sample magnitudes grad={grad[1:]} velocity={vel} weight={w} preview={pre}",
               _sample_magnitudes_kernel,
               {"grad_ptr": grad, "res_ptr": "*fp32", "vel_ptr": "*fp32", "idx_ptr": "*i32",
                "out_ptr": "*fp32", "w_ptr": "*fp32", "m": "i32", "momentum": "fp32",
                "rate": "fp32", "keep": "fp32", "VELOCITY": "constexpr", "WEIGHT": "constexpr",
                "PREVIEW": "constexpr", "BLOCK": "constexpr"},
               {"VELOCITY": vel, "WEIGHT": w, "PREVIEW": pre, "BLOCK": _BLOCK},
               [0, 1, 2, 3, 4, 5], 4, {"enable_fp_fusion": False})
    for nf in (False, True):
        yield (f"sample threshold nf={nf}", _sample_threshold_kernel,
               {"top_ptr": "*fp32", "th_ptr": "*fp32", "cap_ptr": "*fp32",
                "nf_ptr": "*i32" if nf else "*fp32", "K": "i32", "P": "i32",
                "HAS_NF": "constexpr", "BLOCK": "constexpr"},
               {"HAS_NF": nf, "BLOCK": _BLOCK}, [0, 1, 2, 3], 4, {})
