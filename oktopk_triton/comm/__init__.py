"""Communicators with static-size primitives and honest byte counting.

``LocalCluster`` (threads in one process), ``TorchCommunicator`` (torch.distributed: gloo, nccl)
and ``NcclCommunicator`` (CuPy NCCL on the current torch stream; cupy imported only when used).
"""
from .base import (CommAborted, CommError, CommTimeout, Communicator, ring_allreduce_bytes,
                   tensor_bytes)

__all__ = ["Communicator", "CommError", "CommAborted", "CommTimeout", "tensor_bytes",
           "ring_allreduce_bytes",
           "LocalCluster", "LocalCommunicator", "SingleCommunicator", "TorchCommunicator",
           "NcclCommunicator", "ManagerCommunicator",
           "default_communicator"]


def __getattr__(name):  # lazy, so a missing optional backend never breaks the package import
    if name in ("LocalCluster", "LocalCommunicator", "SingleCommunicator"):
        from . import local
        return getattr(local, name)
    if name == "TorchCommunicator":
        from .torch_dist import TorchCommunicator
        return TorchCommunicator
    if name == "NcclCommunicator":
        from .nccl import NcclCommunicator
        return NcclCommunicator
    if name == "ManagerCommunicator":
        from .torchft import ManagerCommunicator
        return ManagerCommunicator
    if name == "default_communicator":
        from .select import default_communicator
        return default_communicator
    raise AttributeError(name)
