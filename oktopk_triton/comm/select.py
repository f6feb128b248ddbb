"""``default_communicator(device)``: the communicator a front end gets when it passes none.

* torch.distributed not initialised: a world of one (:class:`SingleCommunicator`: every primitive
  is a local copy or a no-op, ``bytes_sent`` stays 0);
* a CUDA device and cupy importable: :class:`NcclCommunicator` bootstrapped through the default
  torch.distributed group (``NcclCommunicator.from_torch_distributed()``);
* otherwise: :class:`TorchCommunicator` on the default group.
"""
from __future__ import annotations

from typing import Optional, Union

import torch

from .base import Communicator, resolve_device

__all__ = ["default_communicator"]


def _cupy_available() -> bool:
    try:
        import cupy  # noqa: F401
        from cupy.cuda import nccl  # noqa: F401
    except Exception:
        return False
    return True


def default_communicator(device: Optional[Union[torch.device, str]] = None) -> Communicator:
    import torch.distributed as dist

    dev = resolve_device(device if device is not None else "cpu")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        from .local import SingleCommunicator
        return SingleCommunicator(dev)
    if dev.type == "cuda" and _cupy_available():
        from .nccl import NcclCommunicator
        with torch.cuda.device(dev):
            return NcclCommunicator.from_torch_distributed()
    from .torch_dist import TorchCommunicator
    return TorchCommunicator()
