"""The modes of :class:`~oktopk_triton.SparseAllreduce` (``oktopk_triton/module.py``), one file
each; the front builds them and each calls the algorithm below it.

* :mod:`.flat_params`: the parameters' one flat layout (``reduce_gradients``);
* :mod:`.updates`: error feedback in update space (``reduce_updates``);
* :mod:`.local_steps`: DiLoCo / SparseLoCo's local steps (``local_steps=``), with
  :mod:`.moments` (averaged optimizer moments) and :mod:`.realign` (their realignment);
* :mod:`.frozen_adam`: 1-bit Adam's frozen variance (``reduce_adam``);
* :mod:`.density_schedule`: Deep Gradient Compression's sparsity warm-up;
* :mod:`.graph`: a steady step replayed from a CUDA graph (``cuda_graph=True``);
* :mod:`.ledger`: the run-long conservation audit (``audit()``);
* :mod:`.state`: the front's state across a restart or a change of membership.
"""
