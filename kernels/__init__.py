"""oktopk_triton.kernels: Triton kernels of the sparse allreduce, each with its torch reference.

Every public function takes ``backend="auto" | "triton" | "torch"`` (docs/CONTRACTS.md §1).
"""
from ._dispatch import BACKENDS, INTERPRET, choose
from .histogram import (HIST_BINS, abs_histogram, abs_histogram_regions, bin_threshold,
                        bin_thresholds, exact_threshold, histogram_threshold, kth_bin, kth_bins)
from .region import clear_sent, region_select
from .scatter import scatter_add
from .selection import Selection, empty_selection, fused_select

__all__ = ["Selection", "fused_select", "empty_selection", "HIST_BINS", "abs_histogram",
           "kth_bin", "bin_threshold", "abs_histogram_regions", "kth_bins", "bin_thresholds", "histogram_threshold", "exact_threshold", "scatter_add",
           "region_select", "clear_sent", "BACKENDS", "INTERPRET", "choose"]
