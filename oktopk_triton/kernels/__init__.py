"""oktopk_triton.kernels: Triton kernels of the sparse allreduce, each with its torch reference.

Every public function takes ``backend="auto" | "triton" | "torch"`` (docs/CONTRACTS.md §1).
Why a Triton kernel and a torch reference each: a step is memory bound, so the kernels are
judged by the share of a copy's bandwidth they reach (2.94 TB/s for 2^28 fp32 on an H100;
``oktopk-bench kernels``), while the references keep the CPU path exact and fast enough to test
(the Triton interpreter runs about 1 s per million elements).
"""
from ._dispatch import BACKENDS, INTERPRET, choose, counters
from .bookkeeping import STATS as BOOKKEEPING_STATS
from .bookkeeping import capped_offsets, step_bookkeeping
from .completion import owed_encode, owner_sum, slot_encode, values_add, values_words
from .consistency import sign_ema
from .compaction import (gather_rows, keep_flags, owner_magnitudes, owner_slot,
                         row_magnitudes)
from .elementwise import dense_zeros, fill_if, nonfinite_flag
from .gaussian import gaussian_threshold, select_above
from .keys import magnitude_keys
from .histogram import (HIST_BINS, abs_histogram, bin_threshold, exact_threshold,
                        histogram_threshold, kth_bin)
from .message import pack_rows, staged_magnitudes
from .region import clear_sent
from .rounding import keep_row_error, keep_slot_rounding
from .sample import sample_magnitudes, sample_threshold
from .scatter import scatter_add, scatter_rows, scatter_rows_dense
from .selection import (SELECT_HIST_BINS, SELECT_HIST_SHIFT, Selection, empty_selection,
                        fused_select, select_hist_edges)
from .slots import slot_keys, slot_starts, slot_sums
from .threshold import magnitude_threshold, window_pass
from .wire import group_positions, slot_chunks, wire_decode, wire_encode
from .wire_quantized import quantized_decode, quantized_encode

__all__ = ["Selection", "fused_select", "empty_selection", "HIST_BINS", "abs_histogram",
           "kth_bin", "bin_threshold", "histogram_threshold", "exact_threshold", "scatter_add",
           "clear_sent", "BACKENDS", "INTERPRET", "choose", "counters",
           "scatter_rows", "SELECT_HIST_BINS", "SELECT_HIST_SHIFT", "select_hist_edges",
           "magnitude_threshold", "window_pass", "wire_encode", "wire_decode", "slot_chunks",
           "group_positions", "nonfinite_flag", "dense_zeros", "fill_if", "capped_offsets",
           "step_bookkeeping", "BOOKKEEPING_STATS", "scatter_rows_dense", "owner_magnitudes",
           "row_magnitudes", "keep_flags", "owner_slot", "gather_rows", "keep_slot_rounding",
           "sample_magnitudes", "sample_threshold", "staged_magnitudes", "pack_rows",
           "slot_keys", "slot_starts", "slot_sums", "quantized_encode", "quantized_decode",
           "keep_row_error", "gaussian_threshold", "magnitude_keys",
           "select_above", "owed_encode", "owner_sum", "slot_encode", "values_add",
           "values_words", "sign_ema"]
