"""Ok-Topk's thresholds, the machinery behind :class:`~.oktopk.OkTopk`'s select pass.

Each of the P rows of a rank's message has a threshold (``th_rows``): the select pass compacts
every ``|acc|`` at or above it into the row's staging. The first step (and every step of the
exact reference mode) takes them from this step's acc (:meth:`_calibrate`); a steady step from
this step's acc at fixed random positions (:meth:`_sample_threshold`) or from the last step's
histograms, and one ``step_bookkeeping`` launch readies the next step's thresholds, regions and
global threshold (:meth:`_prepare_next`). ``OkTopk`` holds the state these methods read and write.

Measured why: docs/research/design-notes.md, ``oktopk_triton/algorithms/oktopk.py``.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import kernels as K

__all__ = ["OkTopkThresholds"]

_STAGE_FILL = 0.75   # rank thresholds: no row is aimed above this fraction of its staging


class OkTopkThresholds:
    """The threshold methods of :class:`~.oktopk.OkTopk` (a mixin: it holds no state)."""

    def _calibrate(self, grad: torch.Tensor, nonfinite: Optional[torch.Tensor]) -> None:
        """First step (and every step in the exact reference mode): thresholds from this step's
        acc itself. Rows: the region's ``stage_mid``-th largest |acc| (exact mode: this rank's
        k-th largest, the same for every row). Costs extra passes; a steady step has none."""
        acc = self.residual + self._velocity_preview(grad)
        if self._signs is not None:   # consistency: the thresholds are on the score, with the
            # sign EMA as fused_select will update it
            w = K.sign_ema(grad.reshape(-1), self._signs.clone(), self._sign_rate(),
                           backend=self.backend)
            acc = acc.abs() * w.abs()
        P, be = self.P, self.backend
        if self.opts["exact_thresholds"]:
            th = K.magnitude_threshold(acc, self.k, backend=be).reshape(1).expand(P)
        elif self.rank_threshold:   # this rank's k-th largest, no row above its staging fill
            x = K.magnitude_threshold(acc, self.k, backend=be).reshape(1)
            if not self._calibrated:   # the first step: each row's fill threshold, exact
                cap = self._per_row_threshold(acc, max(1, int(self.cap_s * _STAGE_FILL)))
            else:                      # later ones: the fill thresholds of the last histogram
                cap = self._cap_rows
            th = torch.maximum(x.expand(P), cap)
        else:   # the first step: each row at its stage_mid-th largest
            th = self._per_row_threshold(acc, max(1, int(round(self.stage_mid))))
        th = torch.where(th > 0, th, _smallest_positive(acc).expand(P))
        self.th_rows.copy_(self._keep_if_nonfinite(th.contiguous(), self.th_rows, nonfinite))

    def _per_row_threshold(self, acc: torch.Tensor, count: int) -> torch.Tensor:
        """fp32 [P]: each row's ``count``-th largest |acc| over its region. A fresh reducer's
        regions are the equal ones, known to the host; regions carried by :meth:`take_over`
        are read on the device (at most ``span`` long), with no host read."""
        n, P = self.numel, self.P
        offs, max_len = ((self.region_offsets, self.span) if self._carried
                         else ([n * j // P for j in range(P + 1)], None))
        return torch.stack([K.magnitude_threshold(acc, count, start=offs[j], end=offs[j + 1],
                                                  max_len=max_len, backend=self.backend)
                            for j in range(P)])

    def _sample_threshold(self, grad: torch.Tensor, nonfinite: Optional[torch.Tensor]) -> None:
        """Rank mode: the rank threshold from THIS step's acc at ``threshold_sample`` fixed
        random positions (the k·m/n-th largest of the sample), so a step whose scale jumped
        (Adam's updates during a learning-rate warm-up double from one step to the next) is
        not selected with last step's threshold; no row above its staging-fill threshold from
        the last histogram. Three launches (``kernels/sample.py``): the sample's |acc| (a gather
        of m entries of grad and residual, non-finite ones as 0), a top-k of m, the rows'
        thresholds (one program; kept on a non-finite step); no pass over n, no host read."""
        be = self.backend
        acc = K.sample_magnitudes(grad.reshape(-1), self.residual, self._sample_idx,
                                   velocity=self.velocity, momentum=self.momentum,
                                   weight=self._signs, weight_rate=self._sign_rate(),
                                   backend=be)
        top = torch.topk(acc, self._sample_k, sorted=False).values
        K.sample_threshold(top, self.th_rows, self._cap_rows, nonfinite, backend=be)

    def _velocity_preview(self, grad: torch.Tensor) -> torch.Tensor:
        """What fused_select will accumulate: grad, or (u·m) + grad with momentum correction."""
        if self.velocity is None:
            return grad.float()
        return self.velocity * self.momentum + grad.float()

    def _prepare_next(self, sel: K.Selection, keep: Optional[torch.Tensor], irow_idx: torch.Tensor,
                      irow_cnt: torch.Tensor, nonfinite: Optional[torch.Tensor]) -> None:
        """Next step's thresholds, regions and global threshold, and this step's stats: one
        launch (``K.step_bookkeeping``); the state is updated in place (it keeps its storage
        from step to step, so a CUDA graph of a steady step reads and writes the same memory)."""
        P, cr, cg = self.P, self.cap_r, self.cap_g
        # next row thresholds: rank mode, at most the threshold that fills a row's staging to
        # _STAGE_FILL (a full row keeps entries by position); region mode, at row_target entries
        # of this step's histogram, steered so that the staged count lands at stage_mid
        rank = self.rank_threshold
        hist_read_after = rank and self._sample_idx is None   # the rank threshold below
        stats = K.step_bookkeeping(
            self._hist, self.th_rows, self._stage.counts, sel.counts, self._gathered, irow_cnt,
            irow_idx, self.region_offsets, self.th_global, self._gval_keep.min(), nonfinite,
            n=self.numel, cap_s=self.cap_s, cap=self._cap_rows if rank else None,
            fill=self.cap_s * _STAGE_FILL, row_target=None if rank else self.row_target,
            mid=self.stage_mid, update_th=not self.opts["exact_thresholds"],
            zero_hist=not hist_read_after, span=self.span,
            backend=self.backend)
        if hist_read_after:
            # the rank's threshold: where its rows together hold row_target entries of this
            # step's histograms, steered so the rank stages about k (torch ops: not the default)
            kf = float(self.k)
            staged = self._stage.counts.to(torch.float32)
            ratio = (kf / staged.sum().clamp(min=1.0)).sqrt().clamp(0.25, 4.0)
            target = (self.row_target[:1] * ratio).clamp(kf / 64.0, 4.0 * kf)
            x = self._rank_threshold_at(self._hist, self.th_rows, target)
            if not self.opts["exact_thresholds"]:
                th = torch.maximum(x.expand(P), self._cap_rows)
                self.th_rows.copy_(self._keep_if_nonfinite(th, self.th_rows, nonfinite))
            self.row_target.copy_(self._keep_if_nonfinite(target.expand(P), self.row_target,
                                                          nonfinite))
            self._hist.zero_()
        self.stats.update(zip(K.BOOKKEEPING_STATS, stats.unbind(0)))
        self.stats.update(th_rows=self.th_rows, th_global=self.th_global, cap_r=cr, cap_g=cg)

    @staticmethod
    def _keep_if_nonfinite(new: torch.Tensor, old: torch.Tensor,
                           nonfinite: Optional[torch.Tensor]) -> torch.Tensor:
        if nonfinite is None:
            return new
        return torch.where(nonfinite > 0, old, new)

    @staticmethod
    def _rank_threshold_at(hist: torch.Tensor, th: torch.Tensor,
                           target: torch.Tensor) -> torch.Tensor:
        """The |acc| at which the rows together hold ``target`` entries at or above, from the
        rows' histograms (each binned around its own threshold ``th[j]``): every row's count is
        evaluated at every row's bin edges (piecewise linear in bit space inside a bin), the
        totals are cut at the target and interpolated between the two edges around it. Returns
        a 1-element tensor (``th.min()`` when every histogram is empty)."""
        B, shift = K.SELECT_HIST_BINS, K.SELECT_HIST_SHIFT
        W = 1 << shift
        h = hist.to(torch.float32)
        suffix = torch.flip(torch.cumsum(torch.flip(h, (1,)), 1), (1,))
        suffix = torch.cat([suffix, torch.zeros_like(suffix[:, :1])], 1)      # [P, B+1]
        tb = (th.contiguous().view(torch.int32) & 0x7FFFFFFF).to(torch.int64)  # [P]
        # candidates: the lower edges of bins 1..B-1 and the top edge, of every row
        edges = (tb.reshape(-1, 1) + (torch.arange(1, B + 1, device=th.device) - B // 2)
                 .reshape(1, -1) * W).reshape(-1).clamp(1, 0x7F7FFFFF)        # [C]
        edges = torch.sort(edges).values
        rel = edges.reshape(1, -1) - tb.reshape(-1, 1)                         # [P, C]
        b = torch.div(rel, W, rounding_mode="floor") + B // 2
        frac = (rel - (b - B // 2) * W).to(torch.float32) / W
        bc = b.clamp(0, B - 1)
        cnt = suffix.gather(1, bc + 1) + h.gather(1, bc) * (1.0 - frac)
        cnt = torch.where(b >= B, torch.zeros_like(cnt), cnt)
        cnt = torch.where(b < 1, suffix[:, :1].expand_as(cnt), cnt)
        total = cnt.sum(0)                                                     # [C], nonincreasing
        t = target.reshape(())
        above = (total > t).sum()                       # candidates still holding more than t
        C = edges.numel()
        i_hi = above.clamp(max=C - 1)
        i_lo = (above - 1).clamp(min=0)
        t_lo, t_hi = total[i_lo], total[i_hi]
        e_lo, e_hi = edges[i_lo], edges[i_hi]
        w = ((t_lo - t) / (t_lo - t_hi).clamp(min=1e-6)).clamp(0.0, 1.0)
        bits = (e_lo + (w * (e_hi - e_lo).to(torch.float32)).to(torch.int64)).clamp(1, 0x7F7FFFFF)
        new = bits.to(torch.int32).view(torch.float32).reshape(1)
        return torch.where(h.sum() > 0, new, th.min().reshape(1))


def _smallest_positive(x: torch.Tensor) -> torch.Tensor:
    """The smallest positive finite |x| (1 when there is none), 0-dim, on the device."""
    a = x.abs()
    pos = torch.where((a > 0) & torch.isfinite(a), a, torch.full_like(a, float("inf"))).min()
    return torch.where(torch.isinf(pos), torch.ones_like(pos), pos).reshape(())
