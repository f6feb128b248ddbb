"""The three dense operations of a step outside the selection pass, each one launch and counted.

Why they are shaped so: a steady step should touch the gradient-sized vectors as few times as
possible.  ``nonfinite_flag`` reads the gradient once (``torch.aminmax`` propagates NaN and
shows Inf; ``(~isfinite(g)).any()`` wrote and read an n-byte mask as well).  ``fill_if`` poisons
``out`` with NaN only on a non-finite step: it reads a device flag and masks its stores, so a
normal step pays one launch and no traffic (``torch.where(flag, nan, out)`` read and wrote all of
``out`` every step).  ``dense_zeros`` is the output buffer (one memset).  The number: at
n = 2^26 such a full read + write of ``out`` is a copy, 0.19 ms on an H100
(bench/results/kernels/gpu-kernel-variants-call1.json), paid on every step for a flag that is almost
always 0; ``fill_if`` pays one launch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _fill_if_kernel(
        out_ptr,    # *fp32|bf16|fp16 [n]  overwritten with value where the flag is nonzero
        flag_ptr,   # *int32 []            the device flag
        value,      # fp32 fill value
        n,
        BLOCK: tl.constexpr,
    ):
        pid = tl.program_id(0).to(tl.int64)
        lane = tl.arange(0, BLOCK)
        flag = tl.load(flag_ptr + lane * 0)       # broadcast: the interpreter wants a block mask
        m = (lane < n - pid * BLOCK) & (flag != 0)
        v = (tl.zeros((BLOCK,), dtype=tl.float32) + value).to(out_ptr.dtype.element_ty)
        tl.store(out_ptr + pid * BLOCK + lane, v, mask=m)

    @_dispatch.serialized_when_interpreted
    def _fill_if_triton(out, flag, value, block=4096):
        n = out.numel()
        if n:
            _fill_if_kernel[(triton.cdiv(n, block),)](out, flag, float(value), n, BLOCK=block,
                                                     num_warps=4)


def nonfinite_flag(x: Tensor) -> Tensor:
    """int32 [1] on x's device: 1 if x holds a NaN or an Inf, else 0 (one read of x)."""
    _dispatch.record(launches=3, bytes=x.element_size() * x.numel())
    if x.numel() == 0:      # aminmax has no identity: an empty x holds no NaN/Inf
        return torch.zeros(1, dtype=torch.int32, device=x.device)
    with _dispatch.inside_kernel():
        lo, hi = torch.aminmax(x.reshape(-1))
        return (~(torch.isfinite(lo) & torch.isfinite(hi))).to(torch.int32).reshape(1)


def dense_zeros(n: int, device) -> Tensor:
    """fp32 zeros [n]: a step's dense output."""
    _dispatch.record(launches=1, bytes=4 * n)
    with _dispatch.inside_kernel():
        return torch.zeros(n, dtype=torch.float32, device=device)


def _fill_if_launch(out: Tensor, flag: Tensor, value: float) -> None:
    _fill_if_triton(out.view(-1), flag, value)


def _fill_if_torch(out: Tensor, flag: Tensor, value: float) -> None:
    # no host read on CPU either (a pass over out, ~0.2 ms at n = 2^20): the step tests
    # forbid host reads on the torch path a GPU step shares
    out.masked_fill_(flag != 0, value)


def fill_if(out: Tensor, flag: Tensor, value: float, *, backend: str = "auto") -> None:
    """``out[:] = value`` if the 0-dim (or [1]) int32 device ``flag`` is nonzero; no host read.
    Costs one launch and no memory traffic when the flag is 0 (Triton)."""
    if not out.is_contiguous():
        raise ValueError("out must be contiguous")
    flag = flag.reshape(()).to(torch.int32)
    _dispatch.record(launches=1, bytes=0)
    _dispatch.run(backend, out.device, _fill_if_launch, _fill_if_torch, out, flag, value)

