"""PyTorch Lightning: a ``DDPStrategy`` whose gradients are reduced by the sparse allreduce.

    import lightning.pytorch as pl
    from oktopk_triton.integrations.lightning import SparseDDPStrategy

    trainer = pl.Trainer(strategy=SparseDDPStrategy(density=0.01), devices=4,
                         callbacks=[pl.callbacks.ModelCheckpoint(dirpath="ckpt", save_last=True)])
    last = "ckpt/last.ckpt"                     # a resume restores every rank's residual
    trainer.fit(model, loader, ckpt_path=last if os.path.isfile(last) else None)

Why a strategy rather than ``DDPStrategy(ddp_comm_hook=...)``:

1. Lightning registers a communication hook only when the device is CUDA; on CPU (gloo) it is
   skipped silently. This strategy registers it on any device.
2. Lightning writes a checkpoint on global rank 0 only, but every rank owes a different residual.
   Here every rank also writes its own file beside the checkpoint,
   ``<checkpoint>.oktopk/oktopk-rank{r}-of{P}.pt`` (see :mod:`oktopk_triton.checkpoint`), and
   reads it back when ``fit(ckpt_path=...)`` resumes (files saved at another world size are
   resharded, docs/checkpointing.md); a missing file or another model is an error on every
   rank. A state loaded and saved again before any step is saved as it was loaded.
   Deleting a checkpoint (``ModelCheckpoint(save_top_k=...)``) deletes the rank files with it.
   Local paths only (the rank files are written with ``torch.save``).
3. With ``precision="16-mixed"`` the precision plugin's ``GradScaler`` is handed to the state,
   so what each rank owes follows the loss scale.
"""
from __future__ import annotations

import os
from typing import Any, Callable, Dict, Optional

from ..checkpoint import DEFAULT_NAME, rank_file
from ..ddp import SparseAllreduceState, sparse_allreduce_hook
from . import missing, register_on_ddp

try:
    from lightning.pytorch.strategies import DDPStrategy
    from lightning.pytorch.trainer.states import TrainerFn
except ImportError as e:     # pragma: no cover - exercised without lightning installed
    raise missing("lightning", "lightning", e) from e

__all__ = ["SparseDDPStrategy", "rank_dir"]


def rank_dir(checkpoint_path: Any) -> str:
    """The directory of the per-rank files that belong to a Lightning checkpoint file."""
    return f"{os.fspath(checkpoint_path)}.oktopk"


class SparseDDPStrategy(DDPStrategy):
    """``DDPStrategy`` with :func:`~oktopk_triton.ddp.sparse_allreduce_hook` on every device and
    per-rank reducer state saved with each checkpoint.

    Args:
        state: a :class:`~oktopk_triton.ddp.SparseAllreduceState`; ``None`` builds one from
            ``density``, ``algorithm`` and ``state_options`` (e.g. ``mode="bucket"``).
        density, algorithm: for the state built here.
        hook: the communication hook (default: the sparse allreduce hook).
        state_options: other keyword arguments of ``SparseAllreduceState``.
        **kwargs: ``DDPStrategy``'s (``find_unused_parameters``, ``static_graph``, ...).

    Attributes:
        sparse_state: the state (its ``bytes_sent``, ``iter``, ``reducers``).
    """

    strategy_name = "ddp_sparse"

    def __init__(self, state: Optional[SparseAllreduceState] = None, *, density: float = 0.01,
                 algorithm: str = "oktopk", hook: Callable = sparse_allreduce_hook,
                 state_options: Optional[Dict[str, Any]] = None, **kwargs: Any) -> None:
        for key in ("ddp_comm_state", "ddp_comm_hook", "ddp_comm_wrapper"):
            if key in kwargs:
                raise TypeError(f"SparseDDPStrategy: {key} is set by the strategy; pass "
                                "state= and hook= instead")
        if state is None:
            state = SparseAllreduceState(density=density, algorithm=algorithm,
                                         **(state_options or {}))
        elif not isinstance(state, SparseAllreduceState):
            raise TypeError(f"SparseDDPStrategy: state must be a SparseAllreduceState, got "
                            f"{type(state).__name__}")
        super().__init__(ddp_comm_state=state, ddp_comm_hook=hook, **kwargs)
        self.sparse_state = state

    def _register_ddp_hooks(self) -> None:
        # Lightning's own registers only on CUDA
        register_on_ddp(self.model, self.sparse_state, self._ddp_comm_hook,
                        who="SparseDDPStrategy")

    def setup(self, trainer: Any) -> None:
        super().setup(trainer)
        scaler = getattr(self.precision_plugin, "scaler", None)
        if scaler is not None and self.sparse_state.scaler is None:
            self.sparse_state.scaler = scaler

    def save_checkpoint(self, checkpoint: Dict[str, Any], filepath: Any,
                        storage_options: Optional[Any] = None) -> None:
        super().save_checkpoint(checkpoint, filepath, storage_options)   # rank 0's file
        self.sparse_state.save(rank_dir(filepath))                       # every rank's own

    def load_checkpoint(self, checkpoint_path: Any,
                        weights_only: Optional[bool] = None) -> Dict[str, Any]:
        ckpt = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None or trainer.state.fn == TrainerFn.FITTING:   # not for test/predict
            self.sparse_state.load(rank_dir(checkpoint_path), model=self.lightning_module)
        return ckpt

    def remove_checkpoint(self, filepath: Any) -> None:
        super().remove_checkpoint(filepath)
        d = rank_dir(filepath)
        rank, world = self.sparse_state._file_rank()
        try:
            os.remove(rank_file(d, rank, world, DEFAULT_NAME))
            os.rmdir(d)           # the last rank to get here removes the directory
        except OSError:
            pass
