"""oktopk-triton: Ok-Topk sparse allreduce for distributed PyTorch training.

    from oktopk_triton import SparseAllreduce
    sar = SparseAllreduce(model.parameters(), density=0.01)   # algorithm="oktopk"
    loss.backward(); sar.reduce_gradients(); opt.step()
"""
import logging

__version__ = "0.2.0"

# the library logs to "oktopk_triton" (and its children, e.g. "oktopk_triton.checkpoint") and
# prints nothing; an application shows the messages with logging.basicConfig(level=logging.INFO)
logging.getLogger("oktopk_triton").addHandler(logging.NullHandler())

__all__ = ["SparseAllreduce", "LocalCluster", "TorchCommunicator", "NcclCommunicator",
           "Communicator", "GraphedStep", "get_algorithm", "shutdown", "__version__"]


def __getattr__(name):  # lazy: importing the package stays cheap and never needs cupy
    if name == "SparseAllreduce":
        from .module import SparseAllreduce
        return SparseAllreduce
    if name in ("LocalCluster", "TorchCommunicator", "NcclCommunicator", "Communicator"):
        from . import comm
        return getattr(comm, name)
    if name == "GraphedStep":
        from .graph import GraphedStep
        return GraphedStep
    if name == "shutdown":
        from .teardown import shutdown
        return shutdown
    if name == "get_algorithm":
        from .algorithms import get_algorithm
        return get_algorithm
    raise AttributeError(f"module 'oktopk_triton' has no attribute {name!r}")
