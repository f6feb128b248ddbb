"""Training techniques on top of the sparse reducers (see ``docs/research/techniques.md``): the
names ``FrozenAdam`` and ``DensitySchedule`` kept importable from here.

Each technique is a component of its own: the frozen-variance Adam of 1-bit Adam in
:mod:`oktopk_triton.frozen_adam` (``SparseAllreduce.reduce_adam``), Deep Gradient Compression's
sparsity warm-up in :mod:`oktopk_triton.density_schedule` (``density_schedule=``), the local
steps in :mod:`oktopk_triton.local_steps`.
"""
from .density_schedule import DensitySchedule, ScheduleSpec
from .frozen_adam import FrozenAdam

__all__ = ["FrozenAdam", "DensitySchedule", "ScheduleSpec"]
