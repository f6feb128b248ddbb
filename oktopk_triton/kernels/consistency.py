"""sign_ema: how steady each entry's sign is, for ranking a rank's own entries (one pass).

Why: a rank's own top-|acc| is mostly made of entries that the other ranks' parts cancel. Over
the last 100 syncs of a 16-rank probe (the 1.04M-parameter GPT, local steps every 2 steps,
1.6%, docs/research/volume-at-scale.md) only 10-13% of the whole sum's top k was chosen, while the
entries of that top that no rank offered had the sum's sign on 96-99% of the ranks. Ranking by
``|acc| · |EMA_b(sign(grad))|`` instead of ``|acc|`` (an entry whose new part keeps its sign sync
after sync ranks as its size, one whose sign wanders ranks lower) lowered the completed ideal's
validation loss by 0.011 on three seeds, and by 0.028 on the 4m GPT. The EMA is
``ema = rate·ema + (1 − rate)·sign(grad)`` (two roundings and an add, no FMA), not on a
non-finite step. This kernel computes it on its own: one launch, 12n bytes (a grad of 4 bytes).
Ok-Topk's steady step does not launch it: ``fused_select`` updates the EMA in its pass
(``weight_rate``, 8n bytes more and no launch, where this kernel was one launch and 12n bytes)
and ``sample_magnitudes`` previews the update at its sample; the calibration steps use this one
on a copy. The selection kernels take ``|ema|`` as their ``weight``.

The torch reference (``_sign_ema_torch``) is the specification; the kernel gives the same bits.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

_BLOCK = 2048


if HAS_TRITON:

    @triton.jit(do_not_specialize=["rate", "keep"])
    def _sign_ema_kernel(
        grad_ptr,      # *fp32|bf16|fp16 [n]  this step's gradient
        ema_ptr,       # *fp32  [n]           the EMA of sign(grad), updated in place
        skip_ptr,      # *int32 []            nonzero: leave ema as it is (if HAS_SKIP)
        n,
        rate,          # fp32: the old EMA's weight (0 on the first step: ema = sign(grad))
        keep,          # fp32: 1 - rate, computed on the host
        HAS_SKIP: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        live = e < n
        if HAS_SKIP:
            live = live & (tl.zeros((BLOCK,), dtype=tl.int32) + tl.load(skip_ptr) == 0)
        g = tl.load(grad_ptr + e, mask=live, other=0.0).to(tl.float32)
        s = tl.where(g > 0, 1.0, tl.where(g < 0, -1.0, 0.0))   # NaN: 0, as torch.sign on CPU
        old = tl.load(ema_ptr + e, mask=live, other=0.0)
        tl.store(ema_ptr + e, old * rate + s * keep, mask=live)

    @_dispatch.serialized_when_interpreted
    def _sign_ema_triton(grad, ema, rate, skip):
        n = ema.numel()
        _sign_ema_kernel[(triton.cdiv(n, _BLOCK),)](
            grad, ema, skip if skip is not None else ema, n, rate, float(1.0 - rate),
            HAS_SKIP=skip is not None, BLOCK=_BLOCK, num_warps=4, enable_fp_fusion=False)


def ema_update(ema: Tensor, grad: Tensor, rate: float) -> Tensor:
    """``rate·ema + (1 − rate)·sign(grad)``, a new tensor: two roundings and an add, as every
    kernel that updates or previews the EMA computes it (the torch side's one home)."""
    return ema * rate + torch.sign(grad.float()) * float(1.0 - rate)


def _sign_ema_torch(grad, ema, rate, skip):
    new = ema_update(ema, grad, rate)
    if skip is None:
        ema.copy_(new)
    else:
        ema.copy_(torch.where(skip.reshape(()) != 0, ema, new))


def sign_ema(grad: Tensor, ema: Tensor, rate: float, *, skip: Optional[Tensor] = None,
             backend: str = "auto") -> Tensor:
    """``ema = rate·ema + (1 − rate)·sign(grad)``, in place, and returned (``rate`` in [0, 1):
    0 makes ``ema = sign(grad)``, the first step). ``grad`` fp32/bf16/fp16 [n], ``ema`` fp32
    [n], both contiguous; ``skip`` (one-element int32): when nonzero, ``ema`` is left as it is
    (a non-finite step). One launch, no host read."""
    if not (isinstance(rate, (int, float)) and not isinstance(rate, bool) and 0 <= rate < 1):
        raise ValueError(f"rate must be a number in [0, 1), got {rate!r}")
    for name, t, dtypes in (("grad", grad, (torch.float32, torch.bfloat16, torch.float16)),
                            ("ema", ema, (torch.float32,))):
        if not isinstance(t, Tensor) or t.dtype not in dtypes or not t.is_contiguous():
            raise ValueError(f"{name} must be a contiguous {'/'.join(str(d)[6:] for d in dtypes)}"
                             f" tensor, got {getattr(t, 'dtype', type(t).__name__)}")
    if grad.numel() != ema.numel():
        raise ValueError(f"grad has {grad.numel()} elements, ema {ema.numel()}")
    if skip is not None and (not isinstance(skip, Tensor) or skip.numel() != 1
                             or skip.dtype != torch.int32):
        raise ValueError(f"skip must be a one-element int32 tensor, got "
                         f"{getattr(skip, 'dtype', type(skip).__name__)}")
    n = ema.numel()
    _dispatch.record(launches=1, bytes=n * (grad.element_size() + 8))
    if n:
        sk = None if skip is None else skip.reshape(())
        _dispatch.run(backend, ema.device, _sign_ema_triton, _sign_ema_torch, grad.reshape(-1),
                      ema.reshape(-1), float(rate), sk)
    return ema


def compile_variants():
    """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps, options) per
    variant, as the launcher above launches it."""
    for grad in ("*fp32", "*bf16"):
        for skip in (False, True):
            yield (f"sign ema grad={grad[1:]} skip={skip}", _sign_ema_kernel,
                   {"grad_ptr": grad, "ema_ptr": "*fp32", "skip_ptr": "*i32" if skip else "*fp32",
                    "n": "i32", "rate": "fp32", "keep": "fp32", "HAS_SKIP": "constexpr",
                    "BLOCK": "constexpr"},
                   {"HAS_SKIP": skip, "BLOCK": _BLOCK}, [0, 1, 2], 4,
                   {"enable_fp_fusion": False})
