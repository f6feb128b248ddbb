"""The Transformers ``Trainer``: a callback that reduces gradients with the sparse allreduce and
saves every rank's state with the Trainer's checkpoints.

    from transformers import Trainer
    from oktopk_triton.integrations.transformers import SparseAllreduceCallback

    trainer = Trainer(model=model, args=args, train_dataset=ds)
    trainer.add_callback(SparseAllreduceCallback(trainer, density=0.01))
    last = get_last_checkpoint(args.output_dir) if os.path.isdir(args.output_dir) else None
    trainer.train(resume_from_checkpoint=last)       # None on a first run

The Trainer has no communication-hook argument; the callback registers the hook on
``trainer.model_wrapped`` (the ``DistributedDataParallel`` model) when training begins. At every
checkpoint (``on_save``, on every rank) each rank writes
``<output_dir>/checkpoint-<step>/oktopk/oktopk-rank{r}-of{P}.pt``; a resumed run (global step
above 0 when training begins) reads its file back from, in this order, ``resume_from`` given to
the callback, ``args.resume_from_checkpoint``, or ``<output_dir>/checkpoint-<step>`` (where
``resume_from_checkpoint=True`` resumes from); files saved at another world size are resharded
(``SparseAllreduceState.load``). Not with hyper-parameter search (its run directories are
elsewhere).
"""
from __future__ import annotations

import os
from typing import Any, Callable, Optional

from ..ddp import SparseAllreduceState
from . import RANK_DIR, log, missing, register_on_ddp

try:
    from transformers import TrainerCallback
except ImportError as e:     # pragma: no cover - exercised without transformers installed
    raise missing("transformers", "transformers", e) from e

__all__ = ["SparseAllreduceCallback"]


class SparseAllreduceCallback(TrainerCallback):
    """Sparse allreduce for a ``Trainer`` (see the module doc).

    Args:
        trainer: the ``Trainer`` (its ``model_wrapped`` is DDP once training begins).
        state: a :class:`~oktopk_triton.ddp.SparseAllreduceState`; ``None`` builds one from
            ``density``, ``algorithm`` and ``state_options``.
        resume_from: the checkpoint directory a resume reads the per-rank files from (default:
            ``args.resume_from_checkpoint`` or ``<output_dir>/checkpoint-<step>``).
        hook: the communication hook (default: the sparse allreduce hook).
    """

    def __init__(self, trainer: Any, state: Optional[SparseAllreduceState] = None, *,
                 density: float = 0.01, algorithm: str = "oktopk",
                 resume_from: Optional[str] = None, hook: Optional[Callable] = None,
                 **state_options: Any) -> None:
        if state is None:
            state = SparseAllreduceState(density=density, algorithm=algorithm, **state_options)
        elif not isinstance(state, SparseAllreduceState):
            raise TypeError(f"SparseAllreduceCallback: state must be a SparseAllreduceState, "
                            f"got {type(state).__name__}")
        self.trainer = trainer
        self.sparse_state = state
        self.resume_from = resume_from
        self.hook = hook

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        wrapped = self.trainer.model_wrapped
        if args.world_size > 1:
            register_on_ddp(wrapped, self.sparse_state, self.hook, who="SparseAllreduceCallback")
        else:
            log.info("SparseAllreduceCallback: one process, no gradient to reduce")
        scaler = getattr(self.trainer.accelerator, "scaler", None)
        if scaler is not None and self.sparse_state.scaler is None:
            self.sparse_state.scaler = scaler
        if state.global_step > 0 and self.sparse_state.iter == 0:    # a resume
            ckpt = (self.resume_from or getattr(args, "resume_from_checkpoint", None)
                    or os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))
            self.sparse_state.load(os.path.join(ckpt, RANK_DIR), model=wrapped)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        ckpt = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        self.sparse_state.save(os.path.join(ckpt, RANK_DIR))
