"""Shared cases and checks of the kernel tests (tests/test_kernel_*.py): devices, dtypes, region
layouts, gradients, the selection check against the reference, and fp32 bit helpers.

On CPU the Triton kernels run in the interpreter (conftest sets TRITON_INTERPRET=1 before the
kernels are imported), which fills region slots in ascending order like the reference; compiled
Triton on CUDA may fill them in any order, so slots are compared sorted, and with capacity
overflow only as a subset of the selected set.
"""
import os

import pytest
import torch
from oktopk_triton.kernels import Selection, fused_select

CUDA = torch.cuda.is_available()
DEV = torch.device("cuda" if CUDA else "cpu")
TRITON_OK = CUDA or os.environ.get("TRITON_INTERPRET") == "1"
needs_triton = pytest.mark.skipif(not TRITON_OK, reason="needs CUDA or TRITON_INTERPRET=1")
requires_cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA device")

GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
INF_BITS = 0x7F800000
BACKENDS = ("torch", "triton")

def gen(seed=0):
    return torch.Generator().manual_seed(seed)


def region_layout(n, P, seed=0, empty=True):
    """int64 [P+1] offsets with random sizes; some regions empty when P >= 3."""
    g = gen(seed)
    if P == 1:
        return torch.tensor([0, n], dtype=torch.int64, device=DEV)
    cuts = torch.randint(0, n + 1, (P - 1,), generator=g).sort().values
    offs = torch.cat([torch.tensor([0]), cuts, torch.tensor([n])]).to(torch.int64)
    if empty and P >= 3:
        offs[2] = offs[1]            # region 1 empty
        offs[P - 1] = offs[P]        # last region empty
    return offs.to(DEV)


def make_grad(n, dtype, seed=0):
    g = gen(seed)
    grad = torch.randn(n, generator=g).to(dtype)
    residual = torch.randn(n, generator=g) * 0.5
    residual[:: 11] = 0.0                 # some exact zeros of acc come from here
    grad[:: 11] = 0
    return grad.to(DEV), residual.to(DEV)


def check_selection(sel: Selection, ref: Selection, full: Selection, acc, offsets, capacity,
                    exact_order: bool):
    """Counts and nonfinite exactly; valid slots against the reference (sorted per row)."""
    assert torch.equal(sel.counts.cpu(), ref.counts.cpu())
    assert torch.equal(sel.nonfinite.cpu(), ref.nonfinite.cpu())
    P = offsets.numel() - 1
    acc = acc.cpu()
    for p in range(P):
        c = min(int(ref.counts[p]), capacity)
        idx = sel.indices[p, :c].cpu().to(torch.int64)
        val = sel.values[p, :c].cpu()
        ridx = ref.indices[p, :c].cpu().to(torch.int64)
        if exact_order:
            assert torch.equal(idx, ridx)
        order = idx.argsort()
        idx, val = idx[order], val[order]
        assert torch.equal(idx.unique(), idx), "duplicate slots"
        start = int(offsets[p])
        torch.testing.assert_close(val, acc[start + idx], rtol=0, atol=0, equal_nan=True)
        if int(ref.counts[p]) <= capacity:
            assert torch.equal(idx, ridx.sort().values)
        else:   # overflow: any min(count, cap) of the selected entries
            allowed = set(full.indices[p, :int(full.counts[p])].cpu().tolist())
            assert set(idx.tolist()) <= allowed


def run_pair(grad, residual, thr, offsets, capacity, skip=None):
    outs = {}
    for be in ("torch", "triton"):
        r = residual.clone()
        outs[be] = (r, fused_select(grad, r, thr, offsets, capacity, skip=skip, backend=be))
    return outs


def abs_bits(x):
    """int64 bit patterns of |x| as fp32."""
    return (x.float().contiguous().view(torch.int32) & 0x7FFFFFFF).to(torch.int64)


def finite_nonzero(x):
    b = abs_bits(x)
    return (b != 0) & (b < INF_BITS)


def same_bits(a, b):
    """Bitwise equality of two fp32 tensors (NaN payloads included)."""
    return torch.equal(a.cpu().contiguous().view(torch.int32),
                       b.cpu().contiguous().view(torch.int32))


def tail_count(x, t):
    """#{nonzero finite entries with |x| >= t}."""
    x = x.float().cpu()
    return int(((x.abs() >= float(t)) & finite_nonzero(x)).sum())


def wire_rows(S, cap, span, seed, ascending, specials=()):
    """A wire's input rows: ``S`` rows of ``cap`` distinct indices below ``span`` (ascending
    or in any order) and values over seven decades; ``specials`` overwrite row 0's first
    values (bf16 ties, signed zeros)."""
    g = gen(seed)
    idx = torch.stack([torch.randperm(span, generator=g)[:cap] for _ in range(S)]).int()
    if ascending:
        idx = torch.sort(idx, 1).values
    vals = torch.randn(S, cap, generator=g) * 10.0 ** torch.randint(-3, 4, (S, cap), generator=g)
    if specials:
        vals[0, :len(specials)] = torch.tensor(specials)
    return idx, vals


def range_kwargs(start, end, on_device):
    """``magnitude_threshold``'s range: by value, or (``on_device``) as device tensors with a
    host bound ``max_len`` a little above the length."""
    if not on_device:
        return dict(start=start, end=end)
    return dict(start=torch.tensor(start, device=DEV), end=torch.tensor(end, device=DEV),
                max_len=end - start + 7)
