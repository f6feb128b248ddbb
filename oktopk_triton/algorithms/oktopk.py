"""Ok-Topk (Li & Hoefler, PPoPP'22) with no host round-trips (docs/algorithms.md §2–3).

A steady step on rank r of P (k = density·n), all on the device, in the paper's order:

1. **Select** (:meth:`_select`): one ``fused_select`` pass forms ``acc = residual + grad``,
   writes it back, compacts every ``|acc| >= th_row[j]`` into row j of the message for owner j
   and counts |acc| per region in 64 bins around the row's threshold.
2. **Split and reduce** (:meth:`_reduce`): ONE grouped send/recv in destination rotation; the
   owner scatter-adds its own and the received rows in a fixed order (deterministic sums).
3. **Owner selection** (:meth:`_owner_select`): the owner keeps the ``cap_g`` largest |sums|.
4. **Balanced gather and global selection** (:meth:`_gather`): ONE allgather of the slots; every
   rank takes the k largest as the global set I, writes ``out`` in one launch (bitwise identical
   on every rank) and clears its residual at ``S_r ∩ I`` (``clear_sent``).
5. **Next step** (:meth:`_prepare_next`, one ``step_bookkeeping`` launch): the rows'
   thresholds (``row_threshold="rank"``: from a sample of this step's acc; ``"region"``: each
   row its own), the regions re-balanced from I, ``th_global`` the smallest |value| in I.

Options, in short: ``volume_budget`` sizes the static capacities; ``wire_dtype="bf16"`` and
``wire_format`` ("compact", "q2", "q4", :mod:`._wire`) shrink the rows; ``region_span`` bounds
a packed row's chunk counts; ``complete_sums=True`` delivers every rank's part of I with a
values-only second exchange; ``consistency=b`` ranks entries by ``|acc|·|EMA_b(sign(grad))|``.
Conservation holds exactly: only ``clear_sent`` zeroes, and only entries that reached ``out``.

Full step and measured why: docs/research/design-notes.md, ``oktopk_triton/algorithms/oktopk.py``.
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Optional, Union

import torch

from .. import kernels as K
from . import _wire as W
from . import schedule as S
from .base import Algorithm
from ..checks import BACKEND, int_at_least, number, one_of
from .description import Description, Option
from .oktopk_thresholds import OkTopkThresholds

__all__ = ["OkTopk", "source_order"]

_HEADER = 2   # int32 words in front of every row and slot


def source_order(owner: int, P: int) -> list:
    """The fixed order in which ``owner`` adds the senders' contributions (itself first)."""
    return [(owner - i) % P for i in range(P)]


def _check_wire_dtype(values: Mapping[str, Any]) -> None:
    if values.get("wire_dtype") == "bf16" and \
            W.format_of(values.get("wire_format"), "oktopk: wire_format").packed:
        raise ValueError(f"oktopk: wire_dtype='bf16' does not combine with "
                         f"wire_format={values['wire_format']!r} (it packs the values itself)")


DESCRIPTION = Description(
    name="oktopk", config="OkTopk", display="Ok-Topk",
    advice="""Ok-Topk: threshold selection, a balanced sparse reduce-scatter to region owners and a
    sparse allgather of their sums (docs/algorithms.md). Advice, besides the common settings:

    1. ``volume_budget`` (default 4.0): words a rank sends a step at most, in units of
       ``k(P-1)/P``, everything included (``None``: no bound). Lower it to bound the bytes;
       the entries that do not fit stay owed.
    2. ``capacity_split`` (default 0.5): the budget's share for the reduce rows, the rest for
       the gathered sums. Leave it.
    3. ``stage_factor`` (default 4.0, >= 1): staging rows hold this many times a row's
       capacity of candidates. Leave it.
    4. ``exact_thresholds`` (default False): every row at this rank's exact k-th largest
       (a reference mode, slower).
    5. ``calibrate_steps`` (default 0): the first steps place the rows at exact thresholds.
    6. ``threshold_sample`` (default 65536): the rank threshold from this many fixed random
       positions of the step's accumulator (0: from the last histogram).
    7. ``row_threshold`` (default ``"rank"``: one threshold per rank, the paper's local
       threshold; ``"region"``: each row its own).
    8. ``wire_dtype`` (default ``"fp32"``; ``"bf16"`` halves the reduce rows' values, the
       rounding kept; not with a packed ``wire_format``, which packs the values itself).
    9. ``region_span`` (default ``"auto"``: 4 on a packed wire, else no bound): the widest
       region, as a multiple of n/P.
    10. ``backend`` (default ``"auto"``): where the kernels run, ``"triton"`` or ``"torch"``.
    11. ``complete_sums`` (default False): a values-only second exchange delivers every
        rank's part of the chosen entries, not only the parts sent in the rows.
    12. ``consistency`` (default 0, in [0, 1)): a rank ranks its entries by
        ``|acc|·|EMA_b(sign(grad))|`` (0: by ``|acc|``), favouring entries whose gradient
        keeps its sign.
    """,
    options={
        # words per rank per step <= budget·k(P−1)/P, all included
        "volume_budget": Option(4.0, lambda x: x is None or (isinstance(x, (int, float)) and x > 0),
                                "a positive number or None", annotation=Optional[float]),
        # fraction of the budget's entries given to the reduce rows
        "capacity_split": Option(0.5, lambda x: isinstance(x, (int, float)) and 0 < x < 1,
                                 "in (0, 1)", annotation=float),
        # staging rows hold stage_factor·cap_r candidates
        "stage_factor": Option(4.0, lambda x: isinstance(x, (int, float)) and x >= 1, ">= 1",
                               annotation=float),
        # reference mode: every row at this rank's exact k-th largest
        "exact_thresholds": Option(False, annotation=bool),
        # the first steps place the rows at exact thresholds (passes)
        "calibrate_steps": Option(0, annotation=int),
        # rank mode: the rank threshold from this step's acc at this many fixed random positions
        # (0: from the last histogram)
        "threshold_sample": Option(65536, int_at_least(0), "an int >= 0", annotation=int),
        # rank: one threshold per rank at its (predicted) k-th largest (the paper's local
        # threshold); region: each row its own, aimed at filling the row's staging
        "row_threshold": Option("rank", *one_of("rank", "region"), annotation=str),
        # reduce rows' values on the wire: fp32 | bf16 (rounding kept)
        "wire_dtype": Option("fp32", *one_of("fp32", "bf16"), annotation=str),
        # widest region, as a multiple of n/P (None: up to n); auto: 4 on a packed wire (its
        # rows' chunk words), else None
        "region_span": Option("auto", lambda x: x in ("auto", None) or (number(x) and x >= 1),
                              "'auto', None or a number >= 1 (the widest region as a multiple "
                              "of n/P)", annotation=Union[str, float, None]),
        "backend": Option("auto", *BACKEND, annotation=str),
        # a values-only second exchange delivers every rank's part of the chosen entries, not
        # only the parts sent in the rows
        "complete_sums": Option(False, lambda x: isinstance(x, bool), "True or False",
                                annotation=bool),
        # b in [0, 1): a rank ranks its own entries by |acc|·|EMA_b(sign(grad))| (0: by |acc|)
        "consistency": Option(0.0, lambda x: number(x) and 0 <= x < 1,
                              "a number in [0, 1) (the sign EMA's decay; 0: rank by |acc|)",
                              annotation=float),
    },
    check=_check_wire_dtype,
    # the reduce rows (k to 2k) and the gathered sums (k to 4k), in units of 2·(P-1)/P
    volume=lambda n, k, P, **o: (2.0 * k * ((P - 1) / P), 6.0 * k * ((P - 1) / P)),
    # the checks (8); fused_select reads grad and residual and writes the residual in its own
    # pass; the rest of the step works on rows of ~k entries (entry_work)
    passes=(4 + 4, 1, 0),
    # the top-k of the staging rows (stage_factor·k), the sort and top-k of the received rows
    # (≈ k each) and the top-k of the gathered slots (≈ k): 7k, and ~200 B per entry of cumsums,
    # gathers and scatters over those rows
    entry_work=lambda k, P: (7.0 * k, 200.0 * k))


class OkTopk(OkTopkThresholds, Algorithm):
    description = DESCRIPTION
    STATE = ("th_rows", "row_target", "th_global", "region_offsets", "_calibrated")
    SCALED = ("th_rows", "th_global", "_cap_rows")   # in the gradient's units
    fuses_velocity = True      # fused_select updates the velocity (and masks it) in its pass
    fills_out = True           # scatter_rows_dense writes all of out (zeros, I, or NaN)
    compact_refusal = None     # rows and slots are region-relative: both phases go compact
    quantized_refusal = None   # senders keep v - q(v), the owner P·(sum/P - q(sum/P))

    def __init__(self, numel: int, comm, density: float = 0.01, **kw: Any) -> None:
        super().__init__(numel, comm, density, **kw)
        o = self.opts          # checked by the base class (oktopk_triton.checks)
        budget = o["volume_budget"]
        self.rank_threshold = o["row_threshold"] == "rank"
        self.bf16_wire = o["wire_dtype"] == "bf16"
        self.backend = self.kernel_backend()
        dev, n, P = self.device, self.numel, self.P
        # compact: the same entries as fp32 (the budget counts fp32 entries), in half the bytes
        self.cap_r, self.cap_g = self.capacities(n, self.k, P, budget, o["capacity_split"],
                                                 self.check_finite != "off",
                                                 "fp32" if self.compact else o["wire_dtype"])
        self.region_offsets = torch.tensor([n * j // P for j in range(P + 1)], dtype=torch.int64,
                                           device=dev)
        # no region wider than span: a packed row's chunk words cover span, not all of n
        self.span = self.region_span(n, P, o["region_span"], self.compact)
        # staging rows: the select pass compacts every entry at or above the row threshold (aimed
        # at stage_mid candidates, the geometric middle of [cap_r, cap_s]); the rows sent are the
        # cap_r largest of them
        self.cap_s = max(self.cap_r + 1, int(math.ceil(float(o["stage_factor"]) * self.cap_r)))
        self.stage_mid = math.sqrt(self.cap_r * self.cap_s)
        self.th_rows = torch.zeros(P, dtype=torch.float32, device=dev)
        # the count each row threshold aims at: in rank mode the rank's total (k), else per row
        self.row_target = torch.full((P,), float(self.k) if self.rank_threshold else self.stage_mid,
                                     dtype=torch.float32, device=dev)
        self.th_global = torch.zeros((), dtype=torch.float32, device=dev)
        self._cap_rows = torch.zeros(P, dtype=torch.float32, device=dev)
        m = o["threshold_sample"]
        self._sample_idx = None
        if self.rank_threshold and m > 0:
            m = min(m, n)
            gen = torch.Generator().manual_seed(0x5EED)
            # int32: the sample is kept between steps (m words, not 2m)
            self._sample_idx = (torch.randperm(n, generator=gen)[:m].sort().values
                                if m < n else torch.arange(n)).to(device=dev, dtype=torch.int32)
            self._sample_k = max(1, min(m, int(round(self.k * m / n))))
        self._calibrated = False
        # True after take_over carried a calibrated reducer's regions: the first step calibrates
        # on them (exact thresholds for this k), not on equal regions
        self._carried = False
        cr, cg = self.cap_r, self.cap_g
        row = self.row_words(cr, o["wire_dtype"])
        self._msg = torch.zeros(P, row, dtype=torch.int32, device=dev)
        self._recv = torch.zeros(max(P - 1, 1), row, dtype=torch.int32, device=dev)
        self._slot = torch.zeros(_HEADER + 2 * cg, dtype=torch.int32, device=dev)
        self._gathered = torch.zeros(P, _HEADER + 2 * cg, dtype=torch.int32, device=dev)
        self._hist = torch.zeros(P, K.SELECT_HIST_BINS, dtype=torch.int32, device=dev)
        self._stage = K.empty_selection(P, self.cap_s, dev)
        # the owner's sums: one slot per distinct received index (at most P·cap_r), not an
        # n-sized scratch (that was 1.0n of the 2.33n words this reducer kept between steps)
        self._sums = torch.zeros(P * cr, dtype=torch.float32, device=dev)
        if self.compact:   # what goes on the wire (the fp32 layouts above stay the local form)
            wr = W.row_words(cr, self.span, fmt=self.wire_format)   # no region is wider
            ws = W.row_words(cg, self.span, header=1, fmt=self.wire_format)
            self._cmsg = torch.zeros(P, wr, dtype=torch.int32, device=dev)
            self._crecv = torch.zeros(max(P - 1, 1), wr, dtype=torch.int32, device=dev)
            self._cslot = torch.zeros(ws, dtype=torch.int32, device=dev)
            self._cgathered = torch.zeros(P, ws, dtype=torch.int32, device=dev)
        self._quantized = W.format_of(self.wire_format).quantized
        self._inv_P = 1.0 / P
        self.complete = o["complete_sums"] and P > 1
        if self.complete:   # values-only rows: one to each owner, then the owners' slots
            vw = K.values_words(cg, self.wire_format)
            self._complete_msg = torch.zeros(P, vw, dtype=torch.int32, device=dev)
            self._complete_recv = torch.zeros(P, vw, dtype=torch.int32, device=dev)
            self._complete_sum = torch.zeros(1, cg, dtype=torch.float32, device=dev)
            self._complete_slot = torch.zeros(1, vw, dtype=torch.int32, device=dev)
            self._complete_gathered = torch.zeros(P, vw, dtype=torch.int32, device=dev)
        b = o["consistency"]
        self.consistency = float(b)
        # the EMA of sign(grad) (n words), and whether it has seen a step (the first sets it)
        self._signs = torch.zeros(n, dtype=torch.float32, device=dev) if b > 0 else None
        self._signs_started = False

    # -- capacities -------------------------------------------------------------------------------
    @staticmethod
    def region_span(n: int, P: int, value: Any = "auto", packed: bool = False) -> int:
        """The widest region the re-balancing may make (``region_span`` option): ``value``
        times ``ceil(n/P)``, on a packed wire rounded up to whole 65,536-element chunks (a row
        carries one count, or three words on q2/q4, per chunk of it), at most n. ``"auto"``: 4
        on a packed wire, else no bound (n). At P = 64, n = 1.04M, q2: 1 chunk a row instead
        of 16, 12 bytes of header instead of 192, 126 times a step."""
        if value == "auto":
            value = 4 if packed else None
        if value is None:
            return n
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 1:
            raise ValueError(f"oktopk: region_span must be 'auto', None or a number >= 1 "
                             f"(the widest region as a multiple of n/P), got {value!r}")
        span = int(math.ceil(float(value) * -(-n // P)))
        if packed:
            span = W.CHUNK * W.chunks(span)
        return min(n, span)

    @staticmethod
    def row_words(cap_r: int, wire_dtype: str = "fp32") -> int:
        """int32 words of one reduce row: header, cap_r indices, cap_r values (fp32: one word
        each; bf16: two per word)."""
        return _HEADER + cap_r + (cap_r if wire_dtype == "fp32" else (cap_r + 1) // 2)

    @staticmethod
    def capacities(n: int, k: int, P: int, budget: Optional[float] = 4.0, split: float = 0.5,
                   flag: bool = True, wire_dtype: str = "fp32"):
        """(cap_r, cap_g): row and slot capacities (entries) for a step of at most
        ``budget·k(P−1)/P`` words per rank: (P−1) rows (``row_words``), an allgather of (P−1)
        slots of ``2 + 2·cap_g`` words and (``flag``) the 4-byte non-finite allreduce,
        2(P−1)/P words. ``split`` of the entry budget goes to the rows; a bf16 row entry costs
        1.5 words instead of 2, so the rows hold 4/3 as many. Each at least 1 and at most n;
        ``budget=None``: ``cap_r = cap_g = k``."""
        if budget is None or P == 1:
            c = max(1, min(n, k))
            return c, c
        words = float(budget) * k / P - 2 * _HEADER - (2.0 / P if flag else 0.0)
        total = max(2, int(math.floor(words / 2 + 1e-9)))
        cr_fp32 = max(1, int(round(total * float(split))))
        cg = min(n, max(1, total - cr_fp32))
        if wire_dtype == "fp32":
            cr = cr_fp32
        else:   # the rows' share of words, at 1.5 words per entry (+1 for an odd count's pad)
            cr = max(1, int(math.floor((2 * cr_fp32 - 1) / 1.5 + 1e-9)))
        return min(n, cr), cg

    @classmethod
    def schedule(cls, n: int, k: int, P: int, **options) -> list:
        """One steady step (the calibration step sends the same): the flag allreduce, ONE
        send/recv batch of P−1 rows of :meth:`row_words` int32 words (``2 + 2·cap_r``; bf16 wire:
        ``2 + cap_r + ceil(cap_r/2)``), one to and one from every other rank (destination
        rotation), ONE allgather of a ``2 + 2·cap_g``-word slot; capacities from
        :meth:`capacities`. ``complete_sums``: then an alltoall of P values-only rows and an
        allgather of one (``K.values_words(cap_g)`` words each), on top of the budget."""
        o, specs, whole = S.step_start(cls, n, k, P, options)
        if whole:
            return specs
        wire = "fp32" if o["compact"] else o["wire_dtype"]
        cr, cg = cls.capacities(n, k, P, o["volume_budget"], o["capacity_split"],
                                o["check_finite"] != "off", wire)
        if o["compact"]:   # rows: chunk counts + one word an entry; slots: 1 more header word
            fmt, span = o["wire_format"], cls.region_span(n, P, o["region_span"], True)
            row = 4 * W.row_words(cr, span, fmt=fmt)
            slot = 4 * W.row_words(cg, span, header=1, fmt=fmt)
        else:
            row, slot = 4 * cls.row_words(cr, wire), 4 * (_HEADER + 2 * cg)
        specs += [S.send_recv([row] * (P - 1), [row] * (P - 1), P - 1), S.allgather(slot, P)]
        if o["complete_sums"] and P > 1:   # values-only: an alltoall of P rows, their sums
            vals = 4 * K.values_words(cg, o["wire_format"])
            specs += [S.alltoall(P * vals, P), S.allgather(vals, P)]
        return specs

    # -- the step --------------------------------------------------------------------------------
    def step(self, grad: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        if (not self._calibrated or self.opts["exact_thresholds"]
                or self.step_count < self.opts["calibrate_steps"]):
            self._calibrate(grad, nonfinite)
        elif self._sample_idx is not None:
            self._sample_threshold(grad, nonfinite)
        offs = self.region_offsets                    # this step's regions
        sel = self._select(grad, nonfinite)
        self._reduce(sel)
        self._owner_select()
        keep, irow_idx, irow_val, irow_cnt = self._gather()
        K.scatter_rows_dense(out, irow_idx, irow_val, irow_cnt, offs, nonfinite,
                             backend=self.backend)
        K.clear_sent(self.residual, sel.indices, sel.counts, offs, irow_idx, irow_cnt,
                     velocity=self.velocity if self.momentum_masking else None,
                     keep_bf16_rounding=self.bf16_wire or (self.compact and not self._quantized),
                     backend=self.backend)
        if self._quantized:
            self._keep_row_error(sel, offs, irow_idx, irow_cnt)
        if self.compact:
            self._keep_slot_rounding(keep, offs, nonfinite)
        if self.complete:
            self._complete(out, offs, irow_idx, irow_cnt)
        self._prepare_next(sel, keep, irow_idx, irow_cnt, nonfinite)
        self._calibrated = True
        self._carried = False
        self._signs_started = self._signs is not None   # fused_select updated the sign EMA
        self._sorted = self._gval_keep = None   # nothing O(k) outlives the step
        self._row_wire = None

    # -- phases ------------------------------------------------------------------------------
    def take_over(self, old: Algorithm) -> None:
        """As the base class (residual, velocity, step count, loss scale); from a calibrated
        Ok-Topk with the same row-threshold mode also its regions, its global threshold and its
        steered row target (rescaled to this k), so a density stage goes on from the balance
        reached instead of equal regions. The first step still calibrates: every row's threshold
        exact for this density, on the carried regions. With ``consistency`` on both, the
        sign EMA goes on too."""
        super().take_over(old)
        if not (isinstance(old, OkTopk) and old._calibrated
                and old.rank_threshold == self.rank_threshold):
            return
        offs = old.region_offsets
        if old.span > self.span:   # not with one set of options (the span ignores the density)
            offs = K.capped_offsets(offs, self.span)
        self.region_offsets.copy_(offs)
        # the regions are balanced on how many of each owner's sums reach the last global
        # threshold: the old stage's is nearer this one's than a fresh reducer's 0 (every sum)
        self.th_global.copy_(old.th_global)
        if self.rank_threshold:    # region mode aims each row at stage_mid: nothing to carry
            self.row_target.copy_(old.row_target * (self.k / old.k))
        self._carried = True

    def take_owed(self, old: Algorithm, owed: bool = True) -> None:
        """As the base class; with ``consistency`` on both, the sign EMA goes on with what is
        owed (``owed=False``: it starts afresh at the next step's signs, as a fresh reducer's)."""
        super().take_owed(old, owed)
        if self._signs is None:
            return
        if owed and getattr(old, "_signs", None) is not None:
            self._signs.copy_(old._signs)
            self._signs_started = old._signs_started
        else:
            self._signs.zero_()
            self._signs_started = False

    @classmethod
    def reshard_state(cls, group: list, first: dict, rank: int, world_size: int) -> dict:
        """As the base class; the sign EMA (``consistency``) is the mean of the group's (it
        ranks the entries the new rank now owes for all of them); a new rank with no old one
        starts it afresh at its next step's signs, as a fresh reducer."""
        sd = super().reshard_state(group, first, rank, world_size)
        if first.get("consistency_signs") is not None:
            if group:
                sd["consistency_signs"] = torch.stack(
                    [g["consistency_signs"].float() for g in group]).mean(0)
            else:
                sd["consistency_signs"] = torch.zeros_like(first["consistency_signs"])
                sd["consistency_started"] = False
        return sd

    def _sign_rate(self) -> Optional[float]:
        """``consistency``: the old sign EMA's share in this step's update (0 on the first step,
        which sets it to the signs); None without it."""
        if self._signs is None:
            return None
        return self.consistency if self._signs_started else 0.0

    def _select(self, grad: torch.Tensor, nonfinite: Optional[torch.Tensor]) -> K.Selection:
        """The select pass into the staging rows, then each row's cap_r largest into the message
        (a row with fewer candidates sends them all). Entries staged but not sent stay in the
        residual, like everything below the threshold. After the select pass, three launches
        (``kernels/message.py``): the staged magnitudes, each row's top-k, the message."""
        cr, be = self.cap_r, self.backend
        stg = self._stage
        # the histograms are zero here: step_bookkeeping cleared them after reading (and they
        # start as zeros)
        K.fused_select(grad, self.residual, self.th_rows, self.region_offsets, self.cap_s,
                       skip=nonfinite, out=stg, velocity=self.velocity, momentum=self.momentum,
                       mask_velocity=self.momentum_masking and self.velocity is not None,
                       hist=self._hist, weight=self._signs, weight_rate=self._sign_rate(),
                       backend=be)
        msg = self._msg
        # a row with more than cap_r candidates sends its cap_r largest (all valid, in any
        # order); one with fewer sends them as staged (valid ones first). Unsorted: the sorted
        # top-k cost 1.3 ms of a 33 ms CPU step (n = 2^20, P = 4), the unsorted 0.57
        mags = K.staged_magnitudes(stg, weight=self._signs,
                                   offsets=None if self._signs is None else self.region_offsets,
                                   backend=be)
        pos = torch.topk(mags, cr, dim=1, sorted=False).indices
        # bf16 wire: rounded on the wire; clear_sent keeps the rounding in the residual
        vals = K.pack_rows(msg, stg, pos, bf16=self.bf16_wire, backend=be)
        if self.compact:   # sorted by index; clear_sent keeps the rounding in the residual
            # grouped by chunk, not sorted (the owner sorts what it receives anyway)
            enc = W.encode(msg[:, _HEADER:_HEADER + cr], vals, msg[:, 0], self.span,
                           out=self._cmsg, fmt=self.wire_format, order="chunks",
                           return_wire=self._quantized, backend=self.backend)
            self._row_wire = enc[1] if self._quantized else None
        return K.Selection(indices=msg[:, _HEADER:_HEADER + cr], values=vals,
                           counts=msg[:, 0], nonfinite=msg[:, 1])

    def _reduce(self, sel: K.Selection) -> None:
        """One grouped send/recv of the rows, then the owner's sums, one slot per distinct index
        (own row first, then the received rows in rotation order: sources r, r−1, r−2, ...;
        the same fp32 additions in the same order as a dense scratch would see). The rows are
        read where they landed (own row in the message, the others in the receive buffer):
        sort keys, ``torch.sort``, run starts, ``torch.cumsum``, slot sums (kernels/slots.py)."""
        P, r, cr, be = self.P, self.rank, self.cap_r, self.backend
        msg, recv = (self._cmsg, self._crecv) if self.compact else (self._msg, self._recv)
        if P > 1:
            self.comm.send_recv([((r + i) % P, msg[(r + i) % P]) for i in range(1, P)],
                                [((r - i) % P, recv[i - 1]) for i in range(1, P)])
        if self.compact:   # the own row too: every source adds its bf16 values
            rows = torch.cat([msg[r:r + 1], recv[:P - 1]]) if P > 1 else msg
            idx, vals, counts = W.decode(rows, cr, self.span, fmt=self.wire_format, backend=be)
            head = (idx[:1], counts[:1], vals[:1])
            tail = (idx[1:], counts[1:], vals[1:])
        else:
            def part(rows):   # (indices, counts, values) of rows in the message layout
                v = rows[:, _HEADER + cr:]
                v = v.view(torch.bfloat16)[:, :cr] if self.bf16_wire else v.view(torch.float32)
                return rows[:, _HEADER:_HEADER + cr], rows[:, 0], v
            head, tail = part(msg[r:r + 1]), part(recv[:P - 1])
        key = K.slot_keys(head[0], head[1], tail[0], tail[1], self.numel, backend=be)
        sidx, perm = torch.sort(key, stable=True)               # ascending; padding last
        first = K.slot_starts(sidx, backend=be)               # one slot per position
        slot = K.slot_sums(sidx, perm, first, torch.cumsum(first, 0, dtype=torch.int64),
                            self._sums, head[1], tail[1], head[2], tail[2], backend=be)
        self._sorted = (sidx, first, slot)

    def _owner_select(self) -> None:
        """The owner's slot: the cap_g largest |sums| of its region, ascending, as sum/P.

        The nonzero sums sit where the rows landed, so they are read there (P·cap_r gathers
        after one sort of the received indices), not by scanning the region: the step's only
        pass over n stays the select pass. Launches (``oktopk_triton/kernels/compaction.py``): the
        candidates' magnitudes, the top-k and its min (when they outnumber cap_g), their flags,
        one cumsum, one kernel writing the slot (and the compact slot's header word)."""
        P, cr, cg, be = self.P, self.cap_r, self.cap_g, self.backend
        sidx, first, slot_ids = self._sorted
        mag = K.owner_magnitudes(self._sums, sidx, first, slot_ids, self.numel, self._inv_P,
                                  backend=be)                     # every nonzero sum is here
        kth = torch.topk(mag, cg, sorted=False).values.min() if P * cr > cg else None
        flags = K.keep_flags(mag.view(1, -1), kth=kth, th=self.th_global, backend=be)
        slot = self._slot
        K.owner_slot(slot, flags, torch.cumsum(flags, 1), sidx, slot_ids, self._sums,
                      self._inv_P, header_out=self._cslot[:1] if self.compact else None,
                      backend=be)
        if self.compact:   # already ascending: the wire keeps the slot's order
            W.encode(slot[_HEADER:_HEADER + cg].view(1, cg),
                     slot[_HEADER + cg:].view(torch.float32).view(1, cg), slot[:1], self.span,
                     header=1, out=self._cslot.view(1, -1), fmt=self.wire_format,
                     order="ascending", backend=be)

    def _gather(self):
        """One allgather; I = the k largest |values| of the gathered slots, as ascending rows.
        Returns ``(keep, irow_idx, irow_val, irow_cnt)``; ``keep`` int64 [P, cg]: bit 0 marks
        the gathered entries in I, or None when I is every gathered entry (the slots hold at
        most k). ``kernels/compaction.py``: when they hold more, their magnitudes, a top-k and
        its min, their flags and one cumsum; then one kernel writing the rows."""
        P, cg, k, be = self.P, self.cap_g, self.k, self.backend
        gathered = self._gathered
        th_counts = None
        if self.compact:   # the wire's bf16 slots, read back into the fp32 layout
            cg_wire = self._cgathered
            if P > 1:
                self.comm.allgather(cg_wire, self._cslot)
            else:
                cg_wire[0].copy_(self._cslot)
            W.decode(cg_wire, cg, self.span, header=1, fmt=self.wire_format,
                     backend=self.backend, out=(gathered[:, _HEADER:_HEADER + cg],
                                                gathered[:, _HEADER + cg:].view(torch.float32),
                                                gathered[:, 0]))
            th_counts = cg_wire[:, 0]            # to gathered[:, 1], by gather_rows
        elif P > 1:
            self.comm.allgather(gathered, self._slot)
        else:
            gathered[0].copy_(self._slot)
        gidx = gathered[:, _HEADER:_HEADER + cg]
        if P * cg > k:
            mag = K.row_magnitudes(gidx, gathered[:, _HEADER + cg:].view(torch.float32),
                                    backend=be)
            kth = torch.topk(mag.reshape(-1), k, sorted=False).values.min()
            keep = K.keep_flags(mag, kth=kth, backend=be)
            csum = torch.cumsum(keep, 1)
        else:   # all of them: each slot's count prefix (its valid entries) as it is
            keep = csum = None
        irow_idx, irow_val, irow_cnt, self._gval_keep = K.gather_rows(
            gathered, keep, csum, th_counts=th_counts, backend=be)
        return keep, irow_idx, irow_val, irow_cnt

    def _complete(self, out: torch.Tensor, offs: torch.Tensor, irow_idx: torch.Tensor,
                  irow_cnt: torch.Tensor) -> None:
        """``complete_sums``: the chosen entries I (known to every rank after the gather) carry
        only the parts of the ranks that sent them in their rows; the other ranks' parts are
        still in their residuals. Each rank sends what it owes at region j's chosen entries,
        values only, to owner j (one alltoall), the owner adds them, and one allgather of the
        sums/P completes ``out``. Each sender keeps what the wire dropped of its values, the
        owner ``P·(f − q(f))`` of its slot: conservation holds. A non-finite
        step chose nothing (counts 0): nothing moves."""
        P, r, fmt, be = self.P, self.rank, self.wire_format, self.backend
        offs = offs[:P]
        K.owed_encode(self.residual, offs, irow_idx, irow_cnt, self._complete_msg, fmt=fmt,
                      backend=be)                                 # keeps owed − q(owed)
        self.comm.alltoall(self._complete_recv, self._complete_msg)
        mine = (offs[r:r + 1], irow_idx[r:r + 1], irow_cnt[r:r + 1])
        # only the owner adds its region's parts (everyone gets its quantized sums), in rank
        # order: one launch, the same bits on every backend
        K.owner_sum(self._complete_recv, mine[2], self._complete_sum.view(-1), self._inv_P,
                    fmt=fmt, backend=be)
        K.slot_encode(self._complete_sum, self.residual, *mine, self._complete_slot, float(P),
                      fmt=fmt, backend=be)                        # keeps P·(f − q(f))
        self.comm.allgather(self._complete_gathered, self._complete_slot.view(-1))
        masked = self.velocity is not None and self.momentum_masking   # delivered whole
        K.values_add(self._complete_gathered, offs, irow_idx, irow_cnt, out,
                     self.velocity if masked else None, fmt=fmt, backend=be)

    def _keep_row_error(self, sel: K.Selection, offs: torch.Tensor, irow_idx: torch.Tensor,
                        irow_cnt: torch.Tensor) -> None:
        """Quantized wire: clear_sent zeroed this rank's delivered row entries, but the owners
        summed ``q(v)``, so the sender keeps ``v − q(v)`` there. Delivered: a sent entry of row j
        among the first ``irow_cnt[j]`` (ascending) of ``irow_idx[j]`` (one launch; a
        non-finite step sent nothing, its counts are 0)."""
        K.keep_row_error(self.residual, sel.indices, sel.values, self._row_wire, sel.counts,
                         irow_idx, irow_cnt, offs[:self.P], backend=self.backend)

    def _keep_slot_rounding(self, keep: Optional[torch.Tensor], offs: torch.Tensor,
                            nonfinite: Optional[torch.Tensor]) -> None:
        """Compact wire: ``out`` holds the owner's slot values rounded to bf16, so the owner keeps
        what the rounding dropped, times P (``out`` is the sum over P), in its residual at its
        delivered entries. The wire kept the slot's (ascending) order: position i of the
        gathered row is position i of the slot."""
        r = self.rank
        K.keep_slot_rounding(self.residual, self._slot, self._gathered[r],
                              None if keep is None else keep[r], offs[r:r + 1], self.P,
                              nonfinite, backend=self.backend)

    def state_dict(self) -> dict:
        """As the base class; with ``consistency``, also the sign EMA and whether it started."""
        sd = super().state_dict()
        if self._signs is not None:
            sd["consistency_signs"] = self._signs.clone()
            sd["consistency_started"] = self._signs_started
        return sd

    def load_state_dict(self, sd: dict) -> None:
        """As the base class; regions saved wider than this reducer's span (a checkpoint of an
        earlier bound) are capped, the same way on every rank. With ``consistency``, the sign
        EMA is restored; a checkpoint without one (saved without ``consistency``) starts it
        afresh at the next step's signs."""
        super().load_state_dict(sd)
        if self._signs is not None:
            saved = sd.get("consistency_signs")
            if saved is None:
                self._signs.zero_()
                self._signs_started = False
            else:
                if saved.numel() != self.numel:
                    raise ValueError(f"oktopk: state_dict's consistency_signs has "
                                     f"{saved.numel()} elements, this reducer {self.numel}")
                self._signs.copy_(saved.reshape(-1).to(self.device))
                self._signs_started = bool(sd.get("consistency_started", True))
        if self.span < self.numel:
            self.region_offsets.copy_(K.capped_offsets(self.region_offsets, self.span))

    def dense_step(self, grad: torch.Tensor, out: torch.Tensor,
                   nonfinite: Optional[torch.Tensor]) -> None:
        super().dense_step(grad, out, nonfinite)
        self.stats.update(sent=self.numel, reduce_overflow=0, gather_overflow=0,
                          global_count=self.numel, cap_r=self.cap_r, cap_g=self.cap_g)
