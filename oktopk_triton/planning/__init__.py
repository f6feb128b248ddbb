"""Planning a run: which algorithm on my cluster, and how soon does it reach a loss.

A cost model of one steady step of every algorithm, from P = 2 to 1024 GPUs, for a model size, a
density and a network (:func:`project`, :func:`step_time`), its validation against measured
steps (:func:`validate`), and the time to dense's loss: a projected step time times a *steps
ratio*, how many times dense's steps an algorithm needs to reach the loss it ends at
(:func:`ratios_from_train`, :func:`time_to_loss`). ``oktopk-bench project`` is its command line
(:mod:`oktopk_triton.bench.project`).

**What is projected.** step time = communication + selection kernels, per rank, for one steady
step (after calibration and warm-up). The forward and backward passes (dense compute) are
**excluded**: this is the time the gradient exchange adds to a step that does not overlap it.

One module a component: ``network`` (bandwidth and latency), ``communication`` (the calls of a
step priced), ``kernel_costs`` (the selection kernels), ``projection`` (a step, a range of world
sizes, the fastest), ``validation`` (the fit to measured steps), ``convergence`` (steps ratios,
the time to a loss).

Measured why: docs/research/design-notes.md, ``oktopk_triton/planning/``.
"""
from __future__ import annotations

from .communication import comm_time, spec_time
from .convergence import mean_curve, ratios_from_train, steps_ratio, time_to_loss
from .kernel_costs import (DEFAULT_KERNELS, PASSES, KernelCosts, entry_work, find_kernels_json,
                           load_kernels, resolve_kernels, selection_time)
from .network import NET_PRESETS, Network, parse_net
from .projection import (ALGORITHMS, MODEL_PRESETS, _k, algorithm_schedule, describe_ranges,
                         fastest_ranges, project, step_time, topkdsa_fill_factor, topkdsa_state)
from .validation import fit_network, synthetic_collectives, validate

__all__ = ["ALGORITHMS", "DEFAULT_KERNELS", "MODEL_PRESETS", "NET_PRESETS", "PASSES", "KernelCosts",
           "Network", "algorithm_schedule", "comm_time", "describe_ranges", "entry_work",
           "fastest_ranges", "find_kernels_json", "fit_network", "load_kernels", "mean_curve",
           "parse_net", "project", "ratios_from_train", "resolve_kernels", "selection_time",
           "spec_time", "step_time", "steps_ratio", "synthetic_collectives", "time_to_loss",
           "topkdsa_fill_factor", "topkdsa_state", "validate", "_k"]
