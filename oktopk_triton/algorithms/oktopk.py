"""Ok-Topk (Li & Hoefler, PPoPP'22) with no host round-trips (ALGORITHMS.md §2–3).

One step on rank r (P ranks, k = density·n, all on the device; no ``.item()``, ``nonzero`` or
boolean-mask indexing in a steady-state step):

1. **Local threshold** ``th_local``: exact (``torch.topk``) at the first step, a two-level
   histogram threshold of ``acc = residual + grad`` at steps 1, 2, 4, 8, … < ``tau_prime``
   (the residuals' distribution widens fastest at the start) and every ``tau_prime`` steps (the only steps
   that form ``acc`` in an extra pass), otherwise the previous one nudged on the device by count
   feedback: ``th *= nudge`` when the local count was > 1.25k, ``/= nudge`` when < 0.75k.
   Default ``tau_prime=1`` (every step; 3 extra passes over n): on the digits CNN (85k
   parameters, 630 steps) the nudged threshold of ``tau_prime=32`` left the local count outside
   [0.75k, 1.25k] on 32–64% of the steps (196–5,020 for k=851), which overflowed the reduce
   rows; the paper's 32 remains an option for large models whose distribution drifts slowly.
   **Row thresholds** (``region_cap``, default on; on the steps that recalibrate th_local):
   the level-0 histogram is taken per region (their sum is the global one, so no extra pass
   for th_local), and region j selects with ``max(th_local, its cap_r-th largest |acc|)`` (two
   histogram levels), so a reduce row that would overflow keeps the largest entries of its
   region. Without it the capacity cut by position (lowest indices on CPU, first programs on
   CUDA) and held the same entries back step after step: at 0.1% on the digits CNN about a
   quarter of each rank's selection (the reduce overflow) every step, always the same
   high indices of a hot region.
2. **fused_select** reads grad and residual once, writes ``residual = acc`` and compacts the
   selected entries straight into one packed int32 message buffer ``msg[P, 2 + 2·cap_r]``:
   row j = ``[true count, nonfinite flag, cap_r relative indices, cap_r fp32 value bits]`` for
   owner j. Entries past the capacity are not sent: they stay in the residual.
3. **Split-and-reduce**: destination rotation (round i: send to (r+i)%P, receive from (r−i)%P)
   in buckets of ``bucket_size`` peers through ``comm.send_recv``. The owner scatter-adds its own
   row first, then each bucket in round order, into a dense fp32 scratch of size n (absolute
   positions: base = region_offsets[r]); the summation order per owner is fixed
   (sources r, r−1, r−2, … mod P), so the result is deterministic.
4. **Global selection**. Default ``global_select="threshold"``: the paper's rule, below.
   Option ``global_select="gathered"``: each owner puts the ``cap_g``
   largest |sums| of its region into its slot (histogram threshold, step 5), and after the
   gather (step 6) every rank takes the k largest |values| among the P gathered slots as I
   (``torch.topk`` of the gathered buffer: identical on every rank, no extra message, the
   global threshold is exact for this step's slots). Why: on the digits CNN the count of sums
   above a threshold held for ``tau`` steps swung from 0.04k to 2.8k between consecutive steps
   (e.g. 31, 1043, 42, 69, 1454 for k=851), so neither the calibration nor the count feedback
   could keep |I| near k: on average 657 of 851 reached ``out`` (gather overflow 120/step on the
   steps with too many, too few on the others); with the per-step top-k, |I| = k on every step
   with at least k gathered sums, fewer bytes (no threshold exchange) and the reduce overflow
   fell from ~75 to ~9 entries/step. Accuracy (digits CNN, P=4, momentum correction, 10
   seeds) at 0.1%: 97.24 against 97.04 for the threshold rule with tau=32 and 97.55 for exact
   per-step thresholds (dense 98.75): the per-step threshold below is the default.
   ``th_global`` keeps the last k-th largest |sum| (the header count of the next step is taken
   at it: the region balance weights and the stats). ``exact_thresholds`` always uses the
   threshold rule:
   **Global threshold** ``th_global``: every ``tau`` steps (default: every step; the paper's
   tau=32 recomputes at steps 0, 1, 2, 4, … < tau and then every tau steps) the owners'
   level-0 histograms of their reduced regions are summed by one [HIST_BINS] allreduce, then
   level 1 the same way: the k-th largest |sum| to 2^-14 relative resolution, identical on
   every rank, with no gathering of nonzeros (or the top-m exchange below when it is cheaper).
   In between it is nudged by the count ``global_feedback`` names (default: the count at
   th_global, known to every rank from the gathered headers: no extra message; ``gathered``:
   |I|) outside ``global_band``·k (default [0.75, 1.25]); ``global_target`` (default 1)
   scales the k of the recalibration. Why every step: with tau=32 the count of sums above
   th_global swung between consecutive steps far outside the band (11 to 281 for k=85 at
   density 0.1%, 72 to 2,940 for k=851 at 1%), so |I| averaged 0.80k–0.90k and fell below
   0.75k on 33–48% of the steps, while 17–32% of the reduced sums above the threshold did not
   fit the slots; recomputed every step, |I| = 84.9 of 85 on average. On the digits CNN at
   0.1% (momentum correction, P=4, seeds 0–4) that raised Ok-Topk from 97.24 to 97.59 (dense
   98.80). The price is the exchange on every step: (P−1)·m words with the top-m exchange
   (+0.9 kB per step at k=85, P=4), or two fixed [2048]-bin allreduces (24.6 kB at P=4 in
   int32, under 33 kB at any P), small beside 6k(P−1)/P words once k/P is in the thousands.
5. **Owner selection** (threshold mode; in gathered mode the slot threshold is the region's
   cap_g-th largest |sum| alone) with ``region_select`` (ascending indices, values × 1/P) into the owner's
   fixed-capacity gather slot ``[count at th_global, max count received, cap_g indices, cap_g
   values]``. The slot holds the LARGEST sums of the region: the owner selects with
   ``max(th_global, the region's cap_g-th largest |sum|)`` (a histogram threshold over its
   region), so when the region holds more than cap_g sums above th_global, the capacity does
   not decide by index which go (ascending fill used to starve the high indices — the
   classifier at the end of the flat vector — whenever a region overflowed). The valid slots
   are the prefix with index >= 0 (region_select writes -1 past its count).
6. **Balanced gather**: one allgather of the slots; every rank writes
   ``out[region_offsets[j] + idx] = value`` (regions are disjoint, so the result is bitwise
   identical everywhere).
7. **clear_sent**: ``residual = 0`` at S_r ∩ I (entries this rank sent within capacity that
   were gathered). The scratch is zeroed back at the positions it received.
8. **Regions** are revised after the first step and then every ``region_period`` steps
   (default: every step) from the global set I just gathered (identical on every rank, so
   identical boundaries, no communication): boundary q sits at the q/P quantile of the global
   count, each gathered entry of region j weighted by count_j / |I_j| (an overfull slot holds
   fewer entries than reached th_global). With ``region_period < capacity_period`` the region length is
   bounded statically by n (no host read); otherwise the largest length is read at each
   revision. Revising every step cut the reduce overflow from ~100 to ~25 entries/step (k=851)
   on the digits CNN, whose hot spots move from step to step.
   **Capacities** start at ``slack · k/P`` and are adapted every ``capacity_period`` (32) steps
   from the largest counts observed in the window (message headers, gathered, so identical on
   every rank), clamped to the volume budget. That adaptation (and the largest region length,
   the static grid bound of ``region_select``) is the only host read: one small ``tolist()`` per
   ``capacity_period`` steps (and at step 0).

Volume per rank and step: the reduce sends (P−1) rows of 2+2·cap_r words, the allgather (P−1)
slots of 2+2·cap_g words. With ``volume_budget=6`` (the paper's bound, 6k(P−1)/P words) the
capacities satisfy ``cap_r + cap_g <= 3k/P``, so a step sends at most 6k(P−1)/P words + 4(P−1)
header words, plus on global-threshold recalibration steps (every step by default) the threshold exchange: either two
[HIST_BINS] histogram allreduces (fixed size, independent of n) or, when cheaper (small k/P), an
allgather of every owner's top-m |sums|, m = min(k, 2·cap_g) ((P−1)·m words: the k-th largest of that union
is the exact threshold unless an owner holds more than m of the top k; then it is lower and the
count feedback raises it). ``global_threshold="auto"`` picks the fewer bytes (static, identical on every rank), so
a recalibration step stays below ~8.5k(P−1)/P words at any size. With ``global_select="gathered"`` no step
exchanges a threshold: every step sends at most 6k(P−1)/P words + 4(P−1) header words.

Slack defaults: ``capacity_slack=(1.5, 1.25)``; when the adapted wants exceed the budget, the
budget is split in this ratio (see ``_fit``). The reduce rows see the local selections, whose
split over regions varies from rank to rank and step to step (hot spots move; each rank's
selection is balanced only on average), hence more slack there; the gather slots see the global
survivors, which the regions balance by construction, so 1.25 suffices. 1.5 + 1.25 = 2.75 < 3,
leaving room under the 6k(P−1)/P budget.

Conservation holds exactly: fused_select leaves ``residual = acc``; only clear_sent zeroes, and
only the entries that reached ``out``. Non-finite steps (``nonfinite > 0``) skip fused_select
(residual untouched bit for bit, nothing sent) and keep thresholds and regions as they were.
"""
from __future__ import annotations

import math
from typing import Any, Optional

import torch

from .. import kernels as K
from .base import Algorithm

__all__ = ["OkTopk", "source_order"]

def source_order(owner: int, P: int) -> list:
    """The fixed order in which ``owner`` adds the senders' contributions (itself first)."""
    return [(owner - i) % P for i in range(P)]


def _smallest_positive(x: torch.Tensor) -> torch.Tensor:
    """The smallest positive finite value of x (0 when there is none), 0-dim, on the device."""
    pos = torch.where((x > 0) & torch.isfinite(x), x, torch.full_like(x, float("inf"))).min()
    return torch.where(torch.isinf(pos), torch.zeros_like(pos), pos).reshape(())


class OkTopk(Algorithm):
    name = "oktopk"
    OPTIONS = {
        "tau": 1,                  # global threshold recompute period (steps; the paper's: 32)
        "tau_prime": 1,            # local threshold recompute period (steps)
        "region_period": 1,        # region boundaries revision period (steps)
        "capacity_slack": (1.25, 1.5),  # (reduce rows, gather slots) or one float for both
        "volume_budget": 6.0,      # words per rank ≤ budget·k(P−1)/P + headers; None: no clamp
        "adapt_capacity": True,    # adapt capacities every capacity_period steps (one host read)
        "capacity_period": 32,     # capacity adaptation period (steps): the only host read
        "nudge": 1.02,             # count-feedback factor for both thresholds (minimum step)
        "adaptive_nudge": True,    # grow the nudge while the count stays off, halve on a flip
        "max_nudge": 2.0,          # largest adaptive factor per step
        "bucket_size": 4,          # peers per bucket of the split-and-reduce
        "global_threshold": "auto",  # histogram | topm | auto (the fewer bytes; see _global_threshold)
        "exact_thresholds": False,  # exact top-k thresholds every step (reference / calibration)
        "magnitude_cap": True,     # owner keeps the largest cap_g sums of its region (not the lowest indices)
        "region_cap": True,        # each reduce row keeps the largest of its region's local entries
        "global_select": "threshold",  # threshold (the paper's) | gathered: top-k of the gathered slots every step
        "global_feedback": "count",  # count fed back to th_global: count (at th_global) | gathered (|I|)
        "global_band": (0.75, 1.25),  # th_global is nudged while the fed-back count is outside band·k
        "global_target": 1.0,      # recalibration aims th_global at global_target·k sums
        "backend": "auto",         # kernels backend: auto | triton | torch
    }
    STATE = ("th_local", "th_global", "region_offsets", "cap_r", "cap_g", "max_len", "_obs",
             "_fb", "_calibrated")

    def __init__(self, numel: int, comm, density: float = 0.01, **kw: Any) -> None:
        super().__init__(numel, comm, density, **kw)
        o = self.opts
        for key in ("tau", "tau_prime", "region_period", "capacity_period", "bucket_size"):
            if not isinstance(o[key], int) or o[key] < 1:
                raise ValueError(f"oktopk: {key} must be a positive int, got {o[key]!r}")
        slack = o["capacity_slack"]
        if isinstance(slack, (int, float)):
            slack = (float(slack), float(slack))
        slack = tuple(float(s) for s in slack)
        if len(slack) != 2 or min(slack) <= 0:
            raise ValueError(f"oktopk: capacity_slack must be a positive float or a pair, got "
                             f"{o['capacity_slack']!r}")
        self.slack = slack
        if not float(o["nudge"]) >= 1.0:
            raise ValueError(f"oktopk: nudge must be >= 1, got {o['nudge']!r}")
        self.backend = o["backend"]
        dev, n, P = self.device, self.numel, self.P
        self.th_local = torch.zeros((), dtype=torch.float32, device=dev)
        self.th_global = torch.zeros((), dtype=torch.float32, device=dev)
        self.region_offsets = torch.tensor([n * j // P for j in range(P + 1)], dtype=torch.int64,
                                           device=dev)
        # regions revised more often than capacities (the default: every step) are bounded
        # only by n, a static grid bound that needs no host read; otherwise the largest region
        # length is read at each revision (one small host read per region_period steps)
        self._static_len = o["region_period"] < o["capacity_period"]
        self.max_len = n if self._static_len else max(n * (j + 1) // P - n * j // P
                                                      for j in range(P))
        kp = self.k / P
        self.cap_r, self.cap_g = self._fit(math.ceil(slack[0] * kp), math.ceil(slack[1] * kp))
        self._obs = torch.zeros(2, dtype=torch.int64, device=dev)  # window max: reduce, gather
        # count feedback state per threshold (local, global): [log step, last direction]
        self._fb = torch.tensor([[math.log(float(o["nudge"])), 0.0]] * 2, dtype=torch.float32,
                                device=dev)
        self._calibrated = False
        self._scratch = torch.zeros(n, dtype=torch.float32, device=dev)
        self._bufs_for = None
        self._inv_P = 1.0 / P
        self._empty_i = torch.empty(0, dtype=torch.int32, device=dev)
        self._empty_f = torch.empty(0, dtype=torch.float32, device=dev)

    # -- capacities -------------------------------------------------------------------------------
    def _fit(self, want_r: int, want_g: int):
        """Capacities ≥ 1 with ``cap_r + cap_g <= budget·k/(2P)`` (when a budget is set).

        Over budget, the budget is split in the ratio of the slack factors (a capacity that
        wants less than its share gives the rest to the other): both buffers keep slack. (An
        earlier rule gave the gather slots everything above ``k/P``; with noisy local counts it
        left the reduce rows no slack at all and 13–20% of k overflowed every step.)"""
        cr, cg = max(1, int(want_r)), max(1, int(want_g))
        budget = self.opts["volume_budget"]
        if budget is not None:
            limit = max(2, int(math.floor(float(budget) * self.k / (2 * self.P) + 1e-9)))
            if cr + cg > limit:
                s_r, s_g = self.slack
                share_r = min(limit - 1, max(1, int(limit * s_r / (s_r + s_g))))
                share_g = limit - share_r
                if cr <= share_r:
                    cg = limit - cr
                elif cg <= share_g:
                    cr = limit - cg
                else:
                    cr, cg = share_r, share_g
        return cr, cg

    def _ensure_buffers(self) -> None:
        key = (self.cap_r, self.cap_g)
        if self._bufs_for == key:
            return
        P, dev = self.P, self.device
        wr, wg = 2 + 2 * self.cap_r, 2 + 2 * self.cap_g
        self._msg = torch.zeros(P, wr, dtype=torch.int32, device=dev)
        self._recv = torch.zeros(max(P - 1, 1), wr, dtype=torch.int32, device=dev)
        self._slot = torch.zeros(wg, dtype=torch.int32, device=dev)
        self._gathered = torch.zeros(P, wg, dtype=torch.int32, device=dev)
        self._bufs_for = key

    # -- the step --------------------------------------------------------------------------------
    def step(self, grad: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        o = self.opts
        t = self.step_count - self.warmup_steps     # sparse steps done so far
        self._ensure_buffers()
        P, r, k, n, be = self.P, self.rank, self.k, self.numel, self.backend
        exact = bool(o["exact_thresholds"])
        first = not self._calibrated
        # recalibrate at steps 0, 1, 2, 4, 8, ... (the residuals' distribution changes fastest
        # at the start: its variance grows with t) and then every tau (tau') steps
        early = t & (t - 1) == 0
        cal_local = exact or first or t % o["tau_prime"] == 0 or (early and t < o["tau_prime"])
        cal_global = exact or first or t % o["tau"] == 0 or (early and t < o["tau"])
        cr, cg = self.cap_r, self.cap_g
        offs = self.region_offsets
        start, end = offs[r], offs[r + 1]

        # 1. local threshold (and, with region_cap, one selection threshold per region: see
        # _local_thresholds)
        capped = cal_local and bool(o["region_cap"]) and P > 1
        if cal_local:
            acc = self.residual + grad.float()
            hists = K.abs_histogram_regions(acc, offs, backend=be) if capped else None
            if exact or first:
                th_l = K.exact_threshold(acc, k)
                if capped:
                    count_at_l = ((acc.abs() >= th_l) & (acc != 0)).sum()
            elif capped:
                b0, above0 = K.kth_bin(hists.sum(0), k)
                h1 = K.abs_histogram(acc, prefix=b0, backend=be)
                b1, _ = K.kth_bin(h1, k - above0)
                th_l = K.bin_threshold(b0, b1)
                bins = torch.arange(h1.numel(), device=h1.device)
                count_at_l = above0 + torch.where(bins >= b1, h1, 0).sum()  # exact: a bin edge
            else:
                th_l = K.histogram_threshold(acc, k, backend=be)
            acc_for_rows = acc if capped else None
            del acc
            if not first:
                th_l = self._keep_if_nonfinite(th_l, self.th_local, nonfinite)
        else:
            th_l = self.th_local
        th_rows = th_l
        if capped:
            th_rows = torch.maximum(th_l, self._row_thresholds(acc_for_rows, hists, cr))
            del acc_for_rows

        # 2. fused selection straight into the packed messages
        msg = self._msg
        sel = K.Selection(indices=msg[:, 2:2 + cr], values=msg[:, 2 + cr:].view(torch.float32),
                          counts=msg[:, 0], nonfinite=msg[:, 1])
        K.fused_select(grad, self.residual, th_rows, offs, cr, skip=nonfinite, out=sel, backend=be)

        # 3. split-and-reduce: own row first, then buckets in rotation order
        scratch = self._scratch
        K.scatter_add(scratch, sel.indices[r:r + 1], sel.values[r:r + 1], sel.counts[r:r + 1],
                      base=start, backend=be)
        recv = self._recv
        B = o["bucket_size"]
        for lo in range(1, P, B):
            hi = min(P, lo + B)
            sends = [((r + i) % P, msg[(r + i) % P]) for i in range(lo, hi)]
            recvs = [((r - i) % P, recv[i - 1]) for i in range(lo, hi)]
            self.comm.send_recv(sends, recvs)
            rb = recv[lo - 1:hi - 1]
            K.scatter_add(scratch, rb[:, 2:2 + cr], rb[:, 2 + cr:].view(torch.float32),
                          rb[:, 0], base=start, backend=be)

        # 4. global threshold (global_select="gathered": the k-th largest gathered |sum| of THIS
        # step, found after the gather; th_g below is the previous one, for the header count)
        topk_sel = o["global_select"] == "gathered" and not exact
        if topk_sel:
            th_g = self.th_global
        elif cal_global:
            th_g = self._global_threshold(scratch, start, end, exact)
            if not first:
                th_g = self._keep_if_nonfinite(th_g, self.th_global, nonfinite)
        else:
            th_g = self.th_global

        # 5. owner selection into the gather slot. The slot keeps the LARGEST entries of the
        # region: when more than cap_g sums reach th_g, the owner raises its threshold to the
        # region's cap_g-th largest |sum| (histogram over the region, no host read), so the
        # capacity never decides by index which entries go. Header word 0 carries the count at
        # th_g (the count feedback of the global threshold); the valid entries are the slots
        # with an index >= 0 (region_select writes -1 past its count), a prefix of the row.
        slot = self._slot
        th_sel = th_g
        if topk_sel:
            th_sel = K.histogram_threshold(scratch, cg, start=start, end=end, backend=be)
        elif o["magnitude_cap"]:
            t_cap = K.histogram_threshold(scratch, cg, start=start, end=end, backend=be)
            th_sel = torch.maximum(th_g, t_cap)
        K.region_select(scratch, start, end, th_sel, cg, max_len=self.max_len, scale=self._inv_P,
                        out=(slot[2:2 + cg], slot[2 + cg:].view(torch.float32), slot[0]),
                        backend=be)
        if o["magnitude_cap"] or topk_sel:
            # the count at th_g itself (capacity 0: a count pass over the region only)
            K.region_select(scratch, start, end, th_g, 0, max_len=self.max_len,
                            out=(self._empty_i, self._empty_f, slot[0]), backend=be)
        if P > 1:
            recv_counts = torch.cat([msg[r:r + 1, 0], recv[:, 0]])
        else:
            recv_counts = msg[:, 0]
        slot[1].copy_(recv_counts.max())

        # zero the scratch where it received (the rest is zero already)
        slots_r = torch.arange(cr, device=self.device)
        rows = torch.cat([msg[r:r + 1], recv[:P - 1]]) if P > 1 else msg
        valid = slots_r < rows[:, 0:1].to(torch.int64)
        pos = torch.where(valid, start + rows[:, 2:2 + cr].to(torch.int64), start.clamp(max=n - 1))
        scratch.index_fill_(0, pos.reshape(-1), 0.0)

        # 6. balanced gather
        gathered = self._gathered
        if P > 1:
            self.comm.allgather(gathered, slot)
        else:
            gathered[0].copy_(slot)
        gcounts = gathered[:, 0]                      # counts at th_g (feedback)
        gidx = gathered[:, 2:2 + cg]
        gval = gathered[:, 2 + cg:].view(torch.float32)
        gvalid = gidx >= 0                            # the written slots: a prefix of each row
        if topk_sel:
            # I = the k largest |sum| among the gathered slots (ties at the k-th included):
            # computed from the gathered buffer alone, so identical on every rank; the rest of
            # the slots is dropped (its mass stays in the senders' residuals)
            gabs = torch.where(gvalid, gval.abs(), -1.0)
            kk = min(k, gabs.numel())
            th_k = torch.topk(gabs.reshape(-1), kk, sorted=False).values.min()
            keep = gvalid & (gabs >= th_k)
            # compact each row's kept entries into an ascending prefix (clear_sent, regions)
            ar = torch.arange(cg, device=self.device)
            order = torch.argsort(torch.where(keep, ar, ar + cg), dim=1)
            gvalid = keep
            gidx = torch.where(keep, gidx, -1).gather(1, order)
            gval = gval.gather(1, order)
            gvalid = gvalid.gather(1, order)
        vcounts = gvalid.sum(1, dtype=torch.int32)    # entries of I per region
        gpos = torch.where(gvalid, offs[:P, None] + gidx.to(torch.int64), 0)
        out.index_put_((gpos.reshape(-1),), torch.where(gvalid, gval, 0.0).reshape(-1),
                       accumulate=True)

        # 7. clear the residual at S_r ∩ I
        K.clear_sent(self.residual, sel.indices, sel.counts, offs, gidx, vcounts, backend=be)

        # 8. feedback, observations, regions, stats
        counts64 = sel.counts.to(torch.int64)
        local_count = counts64.sum()
        sent = counts64.clamp(max=cr).sum()
        if capped:   # entries at th_l (held back by a raised row threshold count as overflow)
            local_count = torch.maximum(count_at_l, local_count)
        gc64 = gcounts.to(torch.int64)
        global_count = gc64.sum()
        global_selected = vcounts.to(torch.int64).sum()
        nudge = float(o["nudge"])
        if capped:
            # the counts are at the raised row thresholds, not at th_l: no count feedback (th_l
            # was just recalibrated from the histogram)
            new_l, fb_l = th_l, self._fb[0]
        else:
            new_l, fb_l = self._nudged(th_l, local_count, self._fb[0], nudge)
        if topk_sel:
            new_g = torch.where(th_k > 0, th_k * float(P), th_g)   # in |sum| units (gval = sum/P)
            fb_g = self._fb[1]
            # entries above the previous threshold that did not fit their region's slot
            gat_ovf = (gc64 - cg).clamp(min=0).sum()
        else:
            gfb = global_selected if o["global_feedback"] == "gathered" else global_count
            new_g, fb_g = self._nudged(th_g, gfb, self._fb[1], nudge,
                                       tuple(float(b) for b in o["global_band"]))
            gat_ovf = global_count - global_selected
        self.th_local = self._keep_if_nonfinite(new_l, th_l, nonfinite)
        self.th_global = self._keep_if_nonfinite(new_g, th_g, nonfinite)
        self._fb = self._keep_if_nonfinite(torch.stack([fb_l, fb_g]), self._fb, nonfinite)
        self._obs = torch.maximum(self._obs, torch.stack([gathered[:, 1].to(torch.int64).max(),
                                                          gc64.max()]))
        revise_regions = P > 1 and (t == 0 or t % o["region_period"] == o["region_period"] - 1)
        if revise_regions:
            new = self._balanced_offsets(vcounts, gcounts, gidx, cg)
            keep = global_selected == 0
            if nonfinite is not None:
                keep = keep | (nonfinite > 0)
            self.region_offsets = torch.where(keep, offs, new)
        cp = o["capacity_period"]
        adapt = bool(o["adapt_capacity"]) and t % cp == cp - 1

        self.stats.update(
            local_selected=local_count, sent=sent, reduce_overflow=local_count - sent,
            global_selected=global_selected, global_count=global_count,
            gather_overflow=gat_ovf, overflow=(local_count - sent) + gat_ovf,
            th_local=th_l, th_global=th_g, cap_r=cr, cap_g=cg, calibrated=cal_global)

        # the only host reads: once at the first calibration, then once per capacity_period steps
        if first:
            self._calibrated = nonfinite is None or int(nonfinite.item()) == 0
        if (revise_regions and not self._static_len) or adapt:
            self._host_update(revise_regions, adapt)

    # -- pieces ----------------------------------------------------------------------------------
    @staticmethod
    def _keep_if_nonfinite(new: torch.Tensor, old: torch.Tensor,
                           nonfinite: Optional[torch.Tensor]) -> torch.Tensor:
        if nonfinite is None:
            return new
        return torch.where(nonfinite > 0, old, new)

    def _nudged(self, th: torch.Tensor, count: torch.Tensor, fb: torch.Tensor, nudge: float,
                band=(0.75, 1.25)):
        """Count feedback on the device. The paper's rule: outside [0.75k, 1.25k] multiply or
        divide by ``nudge``. With ``adaptive_nudge`` (default) the step is adapted like Rprop: it
        grows ×1.5 (up to ``max_nudge``) while the count stays off on the same side and halves
        (down to ``nudge``) when it crosses over, so a threshold far off (a shifted gradient
        distribution, residuals piling up) recovers in a few steps instead of tens, without the
        oscillation a proportional rule shows on steep distributions. Returns (th, new fb)."""
        k = float(self.k)
        c = count.to(torch.float32)
        e = torch.where(c > band[1] * k, 1.0, torch.where(c < band[0] * k, -1.0, 0.0))
        lo = math.log(nudge)
        if not self.opts["adaptive_nudge"]:
            return th * torch.exp(e * lo), fb
        hi = max(lo, math.log(float(self.opts["max_nudge"])))
        step, prev = fb[0], fb[1]
        step = torch.where(e == 0, step * 0.5,
                           torch.where(e == prev, step * 1.5,
                                       torch.where(e == -prev, step * 0.5, step)))
        step = step.clamp(lo, hi)
        return th * torch.exp(e * step), torch.stack([step, e])

    def _global_threshold(self, scratch: torch.Tensor, start: torch.Tensor, end: torch.Tensor,
                          exact: bool) -> torch.Tensor:
        k = self.k
        kt = self._k_target()
        if exact:
            # exact k-th largest |sum|: each owner's top-k of its region, allgathered (test mode)
            return self._topm_threshold(scratch, min(k, self.numel))
        if self._use_topm():
            # the k-th largest of the union of every owner's top-m |sum| (m = min(k, 2 cap_g)):
            # exact unless an owner holds more than m of the global top-k
            return self._topm_threshold(scratch, self._topm_m(), kt)
        h0 = self._allreduce_hist(K.abs_histogram(scratch, start=start, end=end,
                                                  backend=self.backend))
        b0, above = K.kth_bin(h0, kt)
        # fewer than k nonzero sums over all regions: take the lowest nonempty bin instead of
        # bin 0, so the threshold selects every nonzero yet stays > 0 (see _topm_threshold)
        total = h0.sum()
        lowest = torch.where(h0 > 0, torch.arange(h0.numel(), device=h0.device),
                             h0.numel()).min().clamp(max=h0.numel() - 1)
        short = total < kt
        b0 = torch.where(short, lowest, b0)
        above = torch.where(short, total - h0[lowest], above)
        h1 = self._allreduce_hist(K.abs_histogram(scratch, prefix=b0, start=start, end=end,
                                                  backend=self.backend))
        b1, _ = K.kth_bin(h1, kt - above)
        return K.bin_threshold(b0, b1)

    def _row_thresholds(self, acc: torch.Tensor, hists: torch.Tensor, cap: int) -> torch.Tensor:
        """fp32 [P]: per region, the lower edge of the (two-level) histogram bin holding its
        ``cap``-th largest |acc| (0 when the region holds fewer): selecting with
        ``max(th_l, this)`` fills a reduce row with the region's largest entries, and only ties
        within one bin of relative width 2^-14 are cut by the capacity. Without it a region
        with more than ``cap`` entries above th_l sent its lowest indices (CPU, interpreter) or
        whichever programs came first (CUDA) and held back the rest, step after step: at density
        0.1% on the digits CNN about a quarter of each rank's selection."""
        b0, above0 = K.kth_bins(hists, cap)
        h1 = K.abs_histogram_regions(acc, self.region_offsets, prefix=b0, backend=self.backend)
        b1, _ = K.kth_bins(h1, (cap - above0).clamp(min=1))
        return K.bin_thresholds(b0, b1)

    def _hist_bytes(self) -> int:
        return 4 if self.P * self.numel < 2 ** 31 else 8

    def _use_topm(self) -> bool:
        """Static (same on every rank): the top-m allgather sends (P−1)·cap_g·4 bytes, the two
        histogram allreduces 2·2(P−1)/P·HIST_BINS·(4|8); small k/P favours the former."""
        mode = self.opts["global_threshold"]
        if mode not in ("auto", "histogram", "topm"):
            raise ValueError(f"oktopk: global_threshold must be auto|histogram|topm, got {mode!r}")
        if mode != "auto":
            return mode == "topm"
        P = self.P
        topm = (P - 1) * self._topm_m() * 4
        hist = 2 * (2 * (P - 1) * K.HIST_BINS * self._hist_bytes() // max(P, 1))
        return topm <= hist

    def _k_target(self) -> int:
        """Sums the recalibrated th_global aims at (``global_target·k``, at most n)."""
        return max(1, min(self.numel, int(round(float(self.opts["global_target"]) * self.k))))

    def _topm_m(self) -> int:
        return min(self._k_target(), 2 * self.cap_g, self.numel)

    def _topm_threshold(self, scratch: torch.Tensor, m: int, k: Optional[int] = None) -> torch.Tensor:
        k = self.k if k is None else k
        P = self.P
        top = torch.topk(scratch.abs(), m, sorted=False).values
        if P > 1:
            allv = torch.empty(P * m, dtype=torch.float32, device=self.device)
            self.comm.allgather(allv, top)
        else:
            allv = top
        kk = min(k, allv.numel())
        th = torch.topk(allv, kk, sorted=False).values.min().reshape(())
        # fewer than k nonzero sums: every nonzero goes, but the threshold must not read 0 (a
        # zero threshold cannot be nudged back up and would leave the choice to the capacity)
        return torch.where(th > 0, th, _smallest_positive(allv))

    def _allreduce_hist(self, h: torch.Tensor) -> torch.Tensor:
        """Sum a histogram over ranks; in int32 (half the bytes) when P·n cannot overflow it."""
        if self.P == 1:
            return h
        if self._hist_bytes() == 4:
            h32 = h.to(torch.int32)
            self.comm.allreduce(h32)
            return h32.to(torch.int64)
        self.comm.allreduce(h)
        return h

    def _balanced_offsets(self, vcounts: torch.Tensor, gcounts: torch.Tensor, gidx: torch.Tensor,
                          cg: int) -> torch.Tensor:
        """Boundaries with about 1/P of the global count per region (on device, no host read).

        Region j holds ``vcounts[j]`` gathered entries of I but ``gcounts[j]`` sums reached th_g
        (more when the slot was full: the owner kept the largest). Each gathered entry of region
        j stands for ``gcounts[j] / vcounts[j]`` of them, so an overfull region is not mistaken
        for a balanced one (boundaries from the capped set alone stayed imbalanced)."""
        P, n, dev = self.P, self.numel, self.device
        v = vcounts.to(torch.int64).clamp(0, cg)
        c = torch.maximum(gcounts.to(torch.int64), v)
        c = torch.where(v > 0, c, torch.zeros_like(c)).to(torch.float64)   # regions with entries
        incl = torch.cumsum(c, 0)
        excl = incl - c
        T = incl[-1]
        q = torch.arange(1, P, device=dev, dtype=torch.float64)
        target = q * T / P                                       # weight where region q starts
        j = torch.searchsorted(incl, target, right=True).clamp(max=P - 1)
        frac = ((target - excl[j]) / c[j].clamp(min=1.0)).clamp(0.0, 1.0)
        col = (frac * v[j].to(torch.float64)).floor().to(torch.int64)
        col = torch.minimum(col, (v[j] - 1).clamp(min=0)).clamp(0, cg - 1)
        idx = gidx.to(torch.int64)[j, col].clamp(min=0)
        b = (self.region_offsets[j] + idx).clamp(0, n)
        b = torch.cummax(b, 0).values                           # monotone even if T is tiny
        return torch.cat([b.new_zeros(1), b, b.new_full((1,), n)])

    def _host_update(self, revise_regions: bool, adapt: bool) -> None:
        offs = self.region_offsets
        vals = torch.cat([self._obs, (offs[1:] - offs[:-1]).max().reshape(1)]).tolist()
        obs_r, obs_g, max_len = (int(v) for v in vals)
        if not self._static_len:
            self.max_len = max(1, max_len)
        if adapt:
            want_r = math.ceil(self.slack[0] * max(obs_r, 1))
            want_g = math.ceil(self.slack[1] * max(obs_g, 1))
            self.cap_r, self.cap_g = self._fit(want_r, want_g)
            self._obs = torch.zeros_like(self._obs)

    def dense_step(self, grad: torch.Tensor, out: torch.Tensor,
                   nonfinite: Optional[torch.Tensor]) -> None:
        super().dense_step(grad, out, nonfinite)
        self.stats.update(sent=self.numel, reduce_overflow=0, gather_overflow=0,
                          global_count=self.numel, cap_r=self.cap_r, cap_g=self.cap_g)
