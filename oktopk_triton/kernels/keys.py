"""The keys of a deterministic top-k of ``|x|``: one int64 per entry, ``|x|``'s bits above the
inverted index, so ``torch.topk`` of the keys orders by magnitude and breaks ties by the lower
index (TopkA's and gTop-k's local top-k, ``algorithms/_sparse.topk_entries``).

Why a kernel: as torch ops the keys of ``x[0:n]`` took an ``arange`` and five int64 passes (a
view, a widening copy, an and, a shift, a subtraction and an or), each writing 8 bytes an entry:
about 92 bytes of traffic an entry and five n-sized int64 temporaries (2.5 GB at n = 2^26)
before the top-k. :func:`magnitude_keys` reads 4 bytes and writes 8, in one launch.
"""
from __future__ import annotations

import torch
from torch import Tensor

from . import _dispatch
from ._dispatch import HAS_TRITON

if HAS_TRITON:
    import triton
    import triton.language as tl

_LOW32 = (1 << 32) - 1
_BLOCK = 2048

if HAS_TRITON:

    @triton.jit
    def _magnitude_keys_kernel(
        x_ptr,         # *fp32 [n]   values
        key_ptr,       # *int64 [n]  out: (|x| bits) << 32 | (2^32 - 1 - index)
        n,
        BLOCK: tl.constexpr,
    ):
        e = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        m = e < n
        bits = tl.load(x_ptr + e, mask=m, other=0.0).to(tl.int32, bitcast=True)
        mag = (bits & 0x7FFFFFFF).to(tl.int64)
        tl.store(key_ptr + e, (mag << 32) | (4294967295 - e), mask=m)

    @_dispatch.serialized_when_interpreted
    def _magnitude_keys_triton(x, out):
        n = x.numel()
        _magnitude_keys_kernel[(triton.cdiv(n, _BLOCK),)](x, out, n, BLOCK=_BLOCK, num_warps=4)


def magnitude_key(values: Tensor, indices: Tensor) -> Tensor:
    """int64 keys ordering entries by ``|value|`` descending, then by index ascending (torch).

    ``values`` fp32, ``indices`` any integer dtype (< 2^32), same shape. Keys are unique when the
    indices are. NaN sorts above +Inf (its bit pattern is larger); -0.0 equals +0.0.
    """
    bits = values.contiguous().view(torch.int32).to(torch.int64) & 0x7FFFFFFF
    return (bits << 32) | (_LOW32 - indices.to(torch.int64))


def _magnitude_keys_torch(x, out):
    out.copy_(magnitude_key(x, torch.arange(x.numel(), device=x.device, dtype=torch.int64)))


def magnitude_keys(x: Tensor, *, backend: str = "auto") -> Tensor:
    """int64 [n]: :func:`magnitude_key` of ``x`` (contiguous fp32 [n], n < 2^32) at the
    indices ``0..n-1``, in one launch (read 4n bytes, write 8n)."""
    if not isinstance(x, Tensor) or x.dtype != torch.float32 or x.dim() != 1 \
            or not x.is_contiguous():
        got = f"{x.dtype} {tuple(x.shape)}" if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"x must be a contiguous 1-dim float32 tensor, got {got}")
    n = x.numel()
    if n > _LOW32:
        raise ValueError(f"magnitude_keys: at most 2^32 - 1 entries, got {n}")
    out = torch.empty(n, dtype=torch.int64, device=x.device)
    _dispatch.record(launches=1, bytes=12 * n)
    if n:
        _dispatch.run(backend, x.device, _magnitude_keys_triton, _magnitude_keys_torch, x, out)
    return out


# ----------------------------------------------------------------------------------------------
# compile check (oktopk_triton/kernels/_compile_check.py compiles these for sm_90 without a GPU)
# ----------------------------------------------------------------------------------------------
def compile_variants():
    """(name, kernel, signature, constexprs, divisible-by-16 args, num_warps, options)."""
    for n16 in (True, False):
        yield (f"magnitude keys n%16={'0' if n16 else 'any'}", _magnitude_keys_kernel,
               {"x_ptr": "*fp32", "key_ptr": "*i64", "n": "i64", "BLOCK": "constexpr"},
               {"BLOCK": _BLOCK}, [0, 1] + ([2] if n16 else []), 4, {})


COMPILE_STREAMING = {"_magnitude_keys_kernel": "ld st"}
