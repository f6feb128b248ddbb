"""Training techniques on top of the sparse reducers (see ``docs/research/techniques.md``): the
names ``FrozenAdam`` and ``DensitySchedule`` kept importable from here.

Each technique is a component of its own: the frozen-variance Adam of 1-bit Adam in
:mod:`oktopk_triton.modes.frozen_adam` (``SparseAllreduce.reduce_adam``), Deep Gradient
Compression's sparsity warm-up in :mod:`oktopk_triton.modes.density_schedule`
(``density_schedule=``), the local steps in :mod:`oktopk_triton.modes.local_steps`.
"""
from .modes.density_schedule import DensitySchedule, ScheduleSpec
from .modes.frozen_adam import FrozenAdam

__all__ = ["FrozenAdam", "DensitySchedule", "ScheduleSpec"]
