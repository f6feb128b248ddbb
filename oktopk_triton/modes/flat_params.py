"""The parameters as one flat vector: one home for what every mode of ``SparseAllreduce`` does to
the weights and their ``.grad``.

Why a component of its own: the gradient mode gathers every ``.grad`` into one persistent flat
buffer and hands the reduced vector back as views of it; the update mode, the local steps and
the frozen Adam move the weights by a reduced vector. They all slice the same flat layout, so the
layout, the buffer and the few passes over the weights live here once (:class:`FlatParams`),
with the optimizer step and the non-finite rule they share (:func:`optimizer_step`,
:func:`finite_or_zero`). Nothing here imports the front (``module.py``).
"""
from __future__ import annotations

from typing import Any, Iterable, List, NamedTuple, Optional, Tuple, Union

import torch

from .. import kernels as K
from ..algorithms.base import FLOAT_DTYPES
from ..comm.base import resolve_device

__all__ = ["FlatParams", "ParamSlice", "optimizer_step", "finite_or_zero", "nonfinite_mask",
           "parse_params", "zero_if_flagged_"]


class ParamSlice(NamedTuple):
    """One parameter's place in the flat gradient: ``flat[offset:offset + numel]``."""
    param: torch.Tensor
    offset: int
    numel: int


def parse_params(numel_or_params: Union[int, Iterable[torch.Tensor], torch.nn.Module],
                 device: Any) -> Tuple[int, Optional[List[torch.Tensor]], Any]:
    """``SparseAllreduce``'s first argument: ``(numel, params or None, device)``; parameters are
    those with ``requires_grad``, each once, of one float dtype family and on one device."""
    if isinstance(numel_or_params, bool):
        raise TypeError("numel_or_params must be an int or parameters, got a bool")
    if isinstance(numel_or_params, int):
        return numel_or_params, None, device
    if isinstance(numel_or_params, torch.Tensor):
        raise TypeError("numel_or_params: pass an int or an iterable of parameters "
                        "(e.g. model.parameters()), not a single tensor; use [tensor]")
    src = (numel_or_params.parameters() if isinstance(numel_or_params, torch.nn.Module)
           else numel_or_params)
    params: List[torch.Tensor] = []
    seen = set()
    for p in src:
        if not isinstance(p, torch.Tensor):
            raise TypeError(f"expected tensors (parameters), got {type(p).__name__}")
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            params.append(p)
    if not params:
        raise ValueError("SparseAllreduce: no parameters with requires_grad were given")
    for p in params:
        if p.dtype not in FLOAT_DTYPES:
            raise TypeError(f"SparseAllreduce: parameter dtype {p.dtype} is not one of "
                            "float32, bfloat16, float16")
    pdev = params[0].device
    if any(p.device != pdev for p in params):
        raise ValueError("SparseAllreduce: all parameters must be on one device, got "
                         f"{sorted({str(p.device) for p in params})}")
    if device is not None and resolve_device(device) != pdev:
        raise ValueError(f"SparseAllreduce: device={device} but the parameters are on {pdev}")
    return sum(p.numel() for p in params), params, pdev


class FlatParams:
    """The parameters in order, each a slice of one flat vector of ``numel`` elements (their
    dtype when they share one, else fp32). Holds the persistent flat buffer (allocated on first
    use; after a reduction every ``.grad`` is a view of it) and a read-only zero vector."""

    def __init__(self, params: List[torch.Tensor]) -> None:
        self.params = params
        dtypes = {p.dtype for p in params}
        self.dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
        self.device = params[0].device
        self.offsets: List[int] = []
        off = 0
        for p in params:
            self.offsets.append(off)
            off += p.numel()
        self.numel = off
        self.buffer: Optional[torch.Tensor] = None
        self._views: List[torch.Tensor] = []
        self._zeros: Optional[torch.Tensor] = None

    def slices(self) -> List[ParamSlice]:
        return [ParamSlice(p, off, p.numel()) for p, off in zip(self.params, self.offsets)]

    def views(self) -> List[torch.Tensor]:
        """Each parameter's slice of the flat buffer, shaped like it (made once)."""
        if self.buffer is None:
            self.buffer = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
            self._views = [self.buffer[off:off + p.numel()].view(p.shape)
                           for p, off in zip(self.params, self.offsets)]
        return self._views

    def of(self, flat: torch.Tensor) -> List[torch.Tensor]:
        """``flat`` (``numel`` elements) cut into the parameters' shapes (views)."""
        return [flat[off:off + p.numel()].view(p.shape)
                for p, off in zip(self.params, self.offsets)]

    def zeros(self) -> torch.Tensor:
        """A zero vector of ``numel`` elements that costs one element of memory and nothing per
        call: a broadcast view of one persistent zero. Reading it is free; writing into it
        raises (``.clone()`` it first)."""
        if self._zeros is None:
            self._zeros = torch.zeros((), dtype=self.dtype, device=self.device).expand(self.numel)
        return self._zeros

    # -- .grad <-> the flat buffer -------------------------------------------------------------
    def gather_grads(self) -> torch.Tensor:
        """The flat buffer holding every ``.grad`` (``None`` → zeros); a ``.grad`` that already
        is its view is not copied."""
        views = self.views()
        for p, v in zip(self.params, views):
            g = p.grad
            if g is None:
                v.zero_()
            elif g.data_ptr() != v.data_ptr() or g.dtype != v.dtype or g.shape != v.shape:
                v.copy_(g.to_dense() if g.is_sparse else g)
        return self.buffer

    def scatter_grads(self) -> None:
        """Every ``.grad`` becomes its view of the flat buffer (a copy in its own dtype where
        the parameters' dtypes differ)."""
        for p, v in zip(self.params, self.views()):
            p.grad = v if p.dtype == v.dtype else v.to(p.dtype)

    def change_into_grads(self, base: List[torch.Tensor]) -> None:
        """``.grad = weights - base``: the change, where the gradient mode reads the gradient,
        written straight into the flat buffer where the dtypes allow (no copy in later)."""
        for p, v in zip(self.params, self.views()):
            if p.dtype == v.dtype:
                p.grad = v
            elif p.grad is None or p.grad.dtype != p.dtype or p.grad.shape != p.shape:
                p.grad = torch.empty_like(p)
        grads = [p.grad for p in self.params]
        torch._foreach_copy_(grads, self.params)
        torch._foreach_sub_(grads, base)

    # -- the weights ---------------------------------------------------------------------------
    def move_to(self, base: List[torch.Tensor], flat_upd: torch.Tensor) -> None:
        """``base += flat_upd`` (each parameter its slice, in its own dtype), then the weights
        become ``base``: two passes over the weights, ``base`` left equal to them."""
        torch._foreach_add_(base, self.of(flat_upd))
        torch._foreach_copy_(self.params, base)

    def check_optimizer(self, optimizer: Any) -> None:
        """The optimizer steps only these parameters (else a replica would drift apart)."""
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"reduce_updates: expected a torch.optim.Optimizer, got "
                            f"{type(optimizer).__name__}")
        ours = {id(p) for p in self.params}
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in ours:
                    raise ValueError("reduce_updates: the optimizer steps a parameter this "
                                     "SparseAllreduce does not reduce (its update would stay "
                                     "local and the replicas would drift apart)")


def optimizer_step(optimizer: torch.optim.Optimizer,
                   scaler: Optional[torch.amp.GradScaler]) -> None:
    """``optimizer.step()``, through the ``GradScaler`` when one is given."""
    if scaler is not None:
        scaler.step(optimizer)
    else:
        optimizer.step()


def nonfinite_mask(x: torch.Tensor, nonfinite: Optional[torch.Tensor]) -> torch.Tensor:
    """Where ``x`` must not be applied: the algorithm's non-finite flag (``stats["nonfinite"]``,
    a 0-dim int32 device tensor; one op, no pass over ``x``, no host read) as a 0-dim bool that
    broadcasts, or without a flag (``check_finite="off"``) ``~isfinite(x)``. With the flag, a
    step whose inputs were finite on every rank is applied as it came out."""
    if nonfinite is None:
        return ~torch.isfinite(x)
    return nonfinite > 0


def finite_or_zero(x: torch.Tensor, nonfinite: Optional[torch.Tensor]) -> torch.Tensor:
    """``x``, or zeros where :func:`nonfinite_mask` says it must not be applied (one pass)."""
    return torch.where(nonfinite_mask(x, nonfinite), 0.0, x)


def zero_if_flagged_(x: torch.Tensor, nonfinite: Optional[torch.Tensor]) -> torch.Tensor:
    """:func:`finite_or_zero` in place, on a temporary the caller owns (contiguous): on a
    flagged step ``x[:] = 0`` (``kernels.fill_if``: on CUDA one launch that moves no memory
    when the flag is 0, so an unflagged step pays no pass); without a flag, 0 where ``x`` is
    not finite. Returns ``x``."""
    if nonfinite is None:
        return x.masked_fill_(~torch.isfinite(x), 0.0)
    K.fill_if(x, nonfinite, 0.0)
    return x
