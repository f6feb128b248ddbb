"""Backend choice shared by every kernel: ``auto`` | ``triton`` | ``torch``, and step counters.

``auto``: CUDA tensors -> compiled Triton; CPU tensors -> the Triton interpreter when
``TRITON_INTERPRET=1`` was set before the kernels were decorated, else the torch reference.

Why the counters: every kernel records its launches and its bytes by formula, so a test can
see what a step costs without a GPU.  The number that made them matter: on an H100 an Ok-Topk
step launched the histogram kernel 13 times (70 ms of a 290 ms step at n = 2^26,
docs/research/gpu-measurements.md), which no CPU test had counted.
"""
from __future__ import annotations

import contextlib
import functools
import os
import threading
from typing import Dict, Union

import torch

BACKENDS = ("auto", "triton", "torch")

# Read once, at import: triton.jit decides interpreted vs compiled when it decorates.
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

try:  # triton is a hard dependency, but keep the torch path usable without it
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401
    HAS_TRITON = True
except Exception:  # pragma: no cover
    HAS_TRITON = False


# The Triton interpreter patches triton.language module-wide while a kernel runs, so two threads
# (the ranks of a LocalCluster) must never run interpreted kernels at once. Compiled launches
# (no TRITON_INTERPRET) are not serialised.
_INTERPRETER_LOCK = threading.RLock()


def serialized_when_interpreted(launcher):
    """Decorator for the Triton launchers: under the interpreter, one launch at a time. Every
    call is counted (:func:`launcher_calls`, per thread) and runs as kernel work
    (:func:`inside_kernel`), so a trace of a step's torch ops (``oktopk-bench launches``) sees
    the launch and not the interpreter's own tensor handling."""
    @functools.wraps(launcher)
    def launch(*args, **kwargs):
        _STATE.launcher_calls = getattr(_STATE, "launcher_calls", 0) + 1
        with inside_kernel():
            if not INTERPRET:
                return launcher(*args, **kwargs)
            with _INTERPRETER_LOCK:
                return launcher(*args, **kwargs)
    return launch


def choose(backend: str, device: torch.device) -> str:
    """Return ``"triton"`` or ``"torch"`` for tensors on ``device``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "torch":
        return "torch"
    cuda = device.type == "cuda"
    if backend == "auto":
        return "triton" if HAS_TRITON and (cuda or INTERPRET) else "torch"
    # explicit triton
    if not HAS_TRITON:
        raise RuntimeError("backend='triton' requested but triton is not importable")
    if not cuda and not INTERPRET:
        raise RuntimeError("backend='triton' on CPU tensors needs TRITON_INTERPRET=1 set before "
                           "oktopk_triton.kernels is imported")
    return "triton"


IntOrTensor = Union[int, torch.Tensor, None]


def as_index_tensor(v: IntOrTensor, default: int, device: torch.device) -> torch.Tensor:
    """A 0-dim int64 tensor on ``device`` (torch reference helper; no host read)."""
    if v is None:
        v = default
    if isinstance(v, torch.Tensor):
        return v.reshape(()).to(device=device, dtype=torch.int64)
    return torch.tensor(int(v), dtype=torch.int64, device=device)


def next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (int(x) - 1).bit_length()


def ceil_log2(x: int) -> int:
    """Iterations of a binary search over ``x`` candidates (>= 1)."""
    return max(1, (max(int(x), 1)).bit_length())


# ----------------------------------------------------------------------------------------------
# Step accounting: every public kernel function records the launches it makes and the bytes it
# moves through device memory by its formula (reads + writes of the big operands; the tiny
# bookkeeping tensors are not counted).  Per thread, because the ranks of a LocalCluster are
# threads.  ``inside_kernel()`` marks the torch-reference body of a kernel, so a test that
# watches the aten ops of a step can tell kernel work from glue.
# ----------------------------------------------------------------------------------------------
_STATE = threading.local()


def _counters() -> Dict[str, int]:
    c = getattr(_STATE, "counters", None)
    if c is None:
        c = _STATE.counters = {"launches": 0, "bytes": 0}
    return c


def record(launches: int = 1, bytes: int = 0) -> None:   # noqa: A002 - the natural name
    """Count ``launches`` device launches and ``bytes`` of device-memory traffic (formula)."""
    c = _counters()
    c["launches"] += int(launches)
    c["bytes"] += int(bytes)
    log = getattr(_STATE, "log", None)
    if log is not None and not in_kernel():   # a kernel built from kernels is logged once
        log.append((int(launches), int(bytes)))


def launcher_calls() -> int:
    """Calls of the Triton launchers on this thread so far (each launches its kernel)."""
    return getattr(_STATE, "launcher_calls", 0)


@contextlib.contextmanager
def recording():
    """Collect every kernel call of this thread while open: yields a list that receives one
    ``(launches, bytes)`` per outermost kernel call (the launch budget's trace reads it)."""
    prev = getattr(_STATE, "log", None)
    log: list = []
    _STATE.log = log
    try:
        yield log
    finally:
        _STATE.log = prev


def counters() -> Dict[str, int]:
    """A snapshot of this thread's totals: ``{"launches", "bytes"}``."""
    return dict(_counters())


def in_kernel() -> bool:
    return getattr(_STATE, "depth", 0) > 0


@contextlib.contextmanager
def inside_kernel():
    _STATE.depth = getattr(_STATE, "depth", 0) + 1
    try:
        yield
    finally:
        _STATE.depth -= 1


def run(backend: str, device: torch.device, triton_fn, torch_fn, *args, fits: bool = True):
    """``triton_fn(*args)`` where :func:`choose` picks Triton, else the torch reference
    ``torch_fn(*args)`` inside :func:`inside_kernel` (its ops are the kernel's, not glue);
    returns what the one that ran returns. ``fits=False``: the reference even where Triton is
    chosen (a size the kernel does not take; ``backend`` is still checked)."""
    if choose(backend, device) == "triton" and fits:
        return triton_fn(*args)
    with inside_kernel():
        return torch_fn(*args)


def scatter_valid(buf: torch.Tensor, pos: torch.Tensor, vals: torch.Tensor, valid: torch.Tensor,
                  add: bool = False) -> None:
    """``buf[pos[valid]] = vals[valid]`` (``+=`` with ``add``; positions unique) for the torch
    paths of the scatter kernels. CPU: boolean indexing, which costs only the valid entries (a
    host read is free there). Elsewhere, with no host read: the invalid entries go to one extra
    slot past the end, at the price of a copy of ``buf`` in and out (two passes over n)."""
    pos = pos.reshape(-1)
    vals = vals.reshape(-1)
    valid = valid.reshape(-1)
    if buf.device.type == "cpu":
        p, v = pos[valid], vals[valid].to(buf.dtype)
        if add:
            buf.index_add_(0, p, v)
        else:
            buf.index_copy_(0, p, v)
        return
    n = buf.numel()
    tgt = torch.where(valid, pos, torch.full_like(pos, n))
    ext = torch.cat([buf, buf.new_zeros(1)])
    if add:
        ext.index_add_(0, tgt, torch.where(valid, vals, torch.zeros_like(vals)).to(buf.dtype))
    else:
        ext.scatter_(0, tgt, vals.to(buf.dtype))
    buf.copy_(ext[:n])
