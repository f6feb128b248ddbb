"""oktopk-triton: Ok-Topk sparse allreduce for distributed PyTorch training.

    from oktopk_triton import SparseAllreduce
    sar = SparseAllreduce(model.parameters(), density=0.01)   # algorithm="oktopk"
    loss.backward(); sar.reduce_gradients(); opt.step()

    # a measured preset (oktopk_triton.presets): the algorithm, density and sync interval
    sar = SparseAllreduce(model.parameters(), preset=recommend(optimizer=opt))

    # settings as objects (oktopk_triton.config): an algorithm's, the local steps'
    sar = SparseAllreduce(model.parameters(), density=0.04, algorithm=OkTopk(momentum=0.9),
                          local_steps=LocalSteps(sync_every=4))
"""
import logging

__version__ = "0.2.0"

# the library logs to "oktopk_triton" (and its children, e.g. "oktopk_triton.checkpoint") and
# prints nothing; an application shows the messages with logging.basicConfig(level=logging.INFO)
logging.getLogger("oktopk_triton").addHandler(logging.NullHandler())

# modules that moved into a subpackage stay importable by their old names, with a warning
from .deprecation import install_moved_modules  # noqa: E402

install_moved_modules()

# the settings objects (oktopk_triton.config; an algorithm added later is found there too)
_CONFIG = ("AlgorithmConfig", "OkTopk", "TopkA", "GTopk", "SparDL", "TopkDSA", "Gaussiank", "Dense",
           "Registered", "LocalSteps")

_PRESETS = ("Preset", "PRESETS", "recommend", "DILOCO_PRESETS", "recommend_diloco")

__all__ = [*_CONFIG, *_PRESETS, "SparseAllreduce", "LocalCluster", "TorchCommunicator",
           "NcclCommunicator", "Communicator", "GraphedStep", "get_algorithm", "shutdown",
           "__version__"]


def __getattr__(name):  # lazy: importing the package stays cheap and never needs cupy
    if name == "SparseAllreduce":
        from .module import SparseAllreduce
        return SparseAllreduce
    if name in ("LocalCluster", "TorchCommunicator", "NcclCommunicator", "Communicator"):
        from . import comm
        return getattr(comm, name)
    if name in _CONFIG:
        from . import config
        return getattr(config, name)
    if name in _PRESETS:
        from . import presets
        return getattr(presets, name)
    if name == "GraphedStep":
        from .modes.graph import GraphedStep
        return GraphedStep
    if name == "shutdown":
        from .teardown import shutdown
        return shutdown
    if name == "get_algorithm":
        from .algorithms import get_algorithm
        return get_algorithm
    if name[:1].isupper():        # an algorithm's settings object (config.CONFIGS), built-in or not
        from . import config
        if name in config.__all__:
            return getattr(config, name)
    raise AttributeError(f"module 'oktopk_triton' has no attribute {name!r}")
