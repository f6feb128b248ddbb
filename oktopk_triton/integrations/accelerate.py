"""Hugging Face Accelerate: the sparse allreduce hook on the model ``accelerator.prepare``
wrapped, and every rank's state carried by ``save_state`` / ``load_state``.

    from accelerate import Accelerator
    from oktopk_triton.integrations.accelerate import register

    accelerator = Accelerator()
    model, opt, loader = accelerator.prepare(model, opt, loader)
    state = register(accelerator, model, density=0.01)
    ...
    if os.path.isdir("ckpt"):
        accelerator.load_state("ckpt")  # every rank reads its own file back
    ...
    accelerator.save_state("ckpt")      # every rank also writes ckpt/oktopk/oktopk-rank{r}-of{P}.pt

Why a function and not ``DistributedDataParallelKwargs(comm_hook=...)``: Accelerate's
``comm_hook`` takes only its built-in enum (fp16, bf16, PowerSGD) and ignores anything else, so
the hook is registered on the prepared ``DistributedDataParallel`` model instead. Accelerate's
``register_for_checkpointing`` saves on the main process only; the save/load *pre-hooks* used
here run on every rank.
"""
from __future__ import annotations

import os
from typing import Any, Callable, List, Optional

import torch

from ..ddp import SparseAllreduceState
from . import RANK_DIR, log, missing, register_on_ddp

try:
    from accelerate import Accelerator
except ImportError as e:     # pragma: no cover - exercised without accelerate installed
    raise missing("accelerate", "accelerate", e) from e

__all__ = ["register"]


def register(accelerator: Accelerator, model: torch.nn.Module,
             state: Optional[SparseAllreduceState] = None, *, density: float = 0.01,
             algorithm: str = "oktopk", hook: Optional[Callable] = None,
             **state_options: Any) -> SparseAllreduceState:
    """Reduce ``model``'s gradients with the sparse allreduce; returns the state.

    Call it after ``accelerator.prepare`` and before the first backward, on every rank.
    ``state=None`` builds a :class:`~oktopk_triton.ddp.SparseAllreduceState` from ``density``,
    ``algorithm`` and ``state_options``. The accelerator's GradScaler (``mixed_precision="fp16"``)
    is handed to the state. ``accelerator.save_state(dir)`` then also writes
    ``dir/oktopk/oktopk-rank{r}-of{P}.pt`` on every rank and ``load_state(dir)`` restores it
    (resharded when saved at another world size; a missing file or another model raises on
    every rank; a state loaded and saved again
    before any step is saved as it was loaded). With one process there is
    nothing to reduce: the model is left as it is (the state still saves and loads).
    """
    if state is None:
        state = SparseAllreduceState(density=density, algorithm=algorithm, **state_options)
    elif not isinstance(state, SparseAllreduceState):
        raise TypeError(f"register: state must be a SparseAllreduceState, got "
                        f"{type(state).__name__}")
    if accelerator.num_processes > 1:
        register_on_ddp(model, state, hook, who="oktopk_triton.integrations.accelerate.register")
    else:
        log.info("accelerate.register: one process, no gradient to reduce; hook not registered")
    if state.scaler is None and getattr(accelerator, "scaler", None) is not None:
        state.scaler = accelerator.scaler

    def save(models: List[torch.nn.Module], weights: List[Any], output_dir: str) -> None:
        state.save(os.path.join(output_dir, RANK_DIR))

    def load(models: List[torch.nn.Module], input_dir: str) -> None:
        state.load(os.path.join(input_dir, RANK_DIR), model=model)

    accelerator.register_save_state_pre_hook(save)
    accelerator.register_load_state_pre_hook(load)
    return state
