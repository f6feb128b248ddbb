"""Sparse allreduce where users train: PyTorch Lightning, Hugging Face Accelerate, the
Transformers ``Trainer`` and FSDP2 (HSDP).

Each submodule imports its framework and is imported only when asked for
(``from oktopk_triton.integrations.lightning import SparseDDPStrategy``); a missing framework is
an ``ImportError`` naming the extra to install (``pip install "oktopk-triton[integrations]"``).

* :mod:`~oktopk_triton.integrations.lightning`: ``SparseDDPStrategy``, a ``DDPStrategy`` that
  registers the hook on any device, hands it the precision plugin's GradScaler and saves every
  rank's state beside the checkpoint.
* :mod:`~oktopk_triton.integrations.accelerate`: ``register(accelerator, model, state)`` after
  ``accelerator.prepare``; ``save_state`` / ``load_state`` carry every rank's state.
* :mod:`~oktopk_triton.integrations.transformers`: ``SparseAllreduceCallback`` for the Trainer.
* :mod:`~oktopk_triton.integrations.fsdp`: a sparse cross-replica reduce for HSDP.

What the three DDP integrations share lives here: registering the hook once on a
``DistributedDataParallel`` model and the name of the per-rank directory inside a framework's
checkpoint directory.
"""
from __future__ import annotations

import logging
from typing import Callable, Optional

import torch

from ..ddp import SparseAllreduceState, sparse_allreduce_hook

__all__ = ["missing", "register_on_ddp", "RANK_DIR"]

log = logging.getLogger(__name__)

# the per-rank files' directory inside a framework's checkpoint directory
RANK_DIR = "oktopk"


def missing(module: str, package: str, error: ImportError) -> ImportError:
    """The ImportError a submodule raises when its framework is not installed."""
    return ImportError(f"oktopk_triton.integrations.{module} needs {package} ({error}): "
                       f"pip install \"oktopk-triton[integrations]\" (or pip install {package})")


def register_on_ddp(model: torch.nn.Module, state: SparseAllreduceState,
                    hook: Optional[Callable] = None, who: str = "register") -> None:
    """Register ``hook`` (default :func:`sparse_allreduce_hook`) with ``state`` on a
    ``DistributedDataParallel`` model, once (a second call with the same state does nothing)."""
    from torch.nn.parallel import DistributedDataParallel
    if not isinstance(model, DistributedDataParallel):
        raise TypeError(f"{who}: expected the DistributedDataParallel model the framework "
                        f"wrapped (call it after the model is prepared), got "
                        f"{type(model).__name__}")
    if getattr(model, "_oktopk_state", None) is state:
        return
    if getattr(model, "_oktopk_state", None) is not None:
        raise RuntimeError(f"{who}: this model already has a sparse allreduce hook with another "
                           "state (DDP takes one communication hook)")
    model.register_comm_hook(state, hook or sparse_allreduce_hook)
    model._oktopk_state = state
    state.bind(model)
    log.info("%s: sparse allreduce hook registered (%r)", who, state)
