"""Probe: does one index per block of B contiguous entries buy quality at equal bytes?

TopkA's output at 64 ranks covers 11 to 13% of n a sync, Ok-Topk's its k (1.6 to 4.8%), and on
a q2 wire an index is 16 of an entry's 18 bits. A block of B contiguous entries with one index
costs ``16 + 2B`` bits, so at the same bytes a sync it covers ``18B / (16 + 2B)`` times as many
entries (3x at B = 4, 4.5x at B = 8, 6x at B = 16). Whether coverage bought that way is worth
its weaker selection is what this probe measures, before any wire is built for it.

    python -m tools.research.block_probe --world-size 16 --algorithms blockprobe --density 0.016 \\
        --option block=8 --option exchange=sum --option sync_every=2 --steps 320 --json OUT

It runs :mod:`quality_at_scale` (the same model, ranks, schedule, audit and record) with one
more algorithm, ``blockprobe``, an *idealised* exchange simulated by a dense allreduce:

* ``exchange="sum"`` (Ok-Topk's ideal, the global top of the sum): every rank gets the sum of
  all ranks' ``acc``, takes the blocks of largest energy (sum of squares) of it, and delivers
  them whole; every rank's residual drops them.
* ``exchange="union"`` (TopkA's): each rank takes the blocks of largest energy of its own
  ``acc``; ``out`` is the sum of what the ranks took, divided by P.
* ``exchange="partial"`` (Ok-Topk's, without its thresholds, capacities and wire): each rank
  takes its own top blocks as in ``union``; of the sum of what the ranks took (the partial
  sums), the top blocks are delivered. A rank's residual drops only what it took and was
  delivered; the other ranks' parts of a delivered entry stay owed.
* ``exchange="fill"``: the blocks ``partial`` chooses, delivered with every rank's part (the
  whole sum), as a second, values-only exchange over the chosen indices would complete them.
* ``exchange="recheck"`` (choosing from whole sums among candidates): the ``candidates·blocks``
  top blocks of the partial sums are candidates; every rank's part of them is summed (a
  values-only exchange over the candidates' indices), and the ``blocks`` of largest energy of
  those whole sums are delivered whole. ``candidates=1`` is ``fill``; ``candidates`` as large as
  n's blocks is ``sum``. Built on Ok-Topk at large P, a sync would cost ``18 + 22c`` bits per
  entry of the budget: the rows' 18, and per candidate 18 in the gather, 2 to its owner and 2
  for its whole sum gathered back (every rank then takes the same top); ``fill`` is c = 1, 40
  bits. At ``fill``'s bytes at density d, c = 1.5 takes 0.78d and c = 2 0.65d.
* ``consistency=b`` (with ``union``, ``partial``, ``fill``, ``recheck``): each rank ranks its
  own entries by ``|acc| · |EMA_b(sign(grad))|`` instead of ``|acc|``, favouring entries whose
  new part keeps its sign from sync to sync. A choice of what to send: the bits do not change.
* ``diagnose=N`` (with ``fill``): rank 0 prints, every N syncs, where the whole sum's top lies
  against the choice (:meth:`BlockProbe._diagnose`); it reads only, the exchange is unchanged.
* ``exchange="watch"`` (candidates from history, not from the rows): the blocks delivered in
  the last ``watch`` syncs are known to every rank, so their whole sums cost a values-only
  exchange (2 bits a value to its owner). Each rank takes its own top blocks *outside* that
  watch list (as ``partial``); the owner scores the watched blocks by their whole sums and the
  others by their partial sums, and the top ``blocks`` of those scores are delivered whole
  (as ``fill``). It reaches entries that no rank's own top holds now but that were large in
  the sum before. Built on Ok-Topk a sync would cost about ``40 + 2w`` bits an entry of the
  budget (``w`` the watch list's size in budgets: at most ``watch``).

``density`` is the budget in q2 entries (18 bits each): the probe takes
``round(density·n·18 / (16 + 2B))`` blocks, so every B at one density costs the same bytes on
a q2 wire. Values go in fp32 (no quantization), and the bytes the communicator counts are the
simulation's dense allreduce, not the exchange's: the record's ``sent_per_sync`` is not what
the exchange would cost. What the probe's rows compare is quality at one budget, B against B,
and the ideal exchanges against the real ones at B = 1. Conservation holds exactly (what is
not delivered stays in a residual) and is audited as in every run.
"""
from __future__ import annotations

import math
import sys
from typing import Optional

import torch

from oktopk_triton.algorithms import Algorithm, register_algorithm
from tools.research import quality_at_scale

INDEX_BITS, VALUE_BITS = 16, 2      # a q2 entry: a chunk-relative index and a 2-bit code
_EXCHANGES = ("sum", "union", "partial", "fill", "recheck", "watch")


def blocks_for(density: float, n: int, block: int) -> int:
    """Blocks of ``block`` entries that cost what ``density·n`` q2 entries cost."""
    bits = density * n * (INDEX_BITS + VALUE_BITS)
    return max(1, min(math.ceil(n / block), round(bits / (INDEX_BITS + VALUE_BITS * block))))


class BlockProbe(Algorithm):
    """The idealised block exchange of the module docstring (a probe, not a wire)."""

    name = "blockprobe"
    OPTIONS = {"block": 1, "exchange": "sum", "candidates": 2.0, "watch": 1, "diagnose": 0,
               "consistency": 0.0}

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.block = int(self.opts["block"])
        if self.block < 1 or self.opts["exchange"] not in _EXCHANGES:
            raise ValueError(f"blockprobe: block must be an int >= 1 and exchange one of "
                             f"{_EXCHANGES}, got {self.opts['block']!r}, {self.opts['exchange']!r}")
        self.blocks = blocks_for(self.density, self.numel, self.block)
        c = self.opts["candidates"]
        if not (isinstance(c, (int, float)) and not isinstance(c, bool) and c >= 1):
            raise ValueError(f"blockprobe: candidates must be a number >= 1, got {c!r}")
        self.candidates = min(math.ceil(self.numel / self.block), math.ceil(c * self.blocks))
        w = self.opts["watch"]
        if not (isinstance(w, int) and not isinstance(w, bool) and w >= 1):
            raise ValueError(f"blockprobe: watch must be an int >= 1, got {w!r}")
        self._history = []          # the masks delivered in the last ``watch`` syncs
        b = self.opts["consistency"]
        if not (isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1):
            raise ValueError(f"blockprobe: consistency must be a number in [0, 1), got {b!r}")
        self._signs = None          # this rank's EMA of sign(grad), with ``consistency``
        self._diag, self._prev_S = [], None     # ``diagnose``: its rows, the last sync's S
        ex = self.opts["exchange"]
        if (b and ex in ("sum", "watch")) or (self.opts["diagnose"] and ex != "fill"):
            raise ValueError(f"blockprobe: consistency needs exchange union, partial, fill or "
                             f"recheck, diagnose needs fill; got exchange={ex!r}")

    def _chosen(self, x: torch.Tensor, count: Optional[int] = None) -> torch.Tensor:
        """Mask [n] of the ``count`` (default ``self.blocks``) blocks of largest energy of
        ``x``."""
        n, B = self.numel, self.block
        nb = math.ceil(n / B)
        sq = torch.zeros(nb * B, device=x.device)
        sq[:n] = x.square()
        top = torch.topk(sq.view(nb, B).sum(1), count or self.blocks, sorted=False).indices
        keep = torch.zeros(nb, dtype=torch.bool, device=x.device)
        keep[top] = True
        return keep.repeat_interleave(B)[:n]

    def step(self, grad: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        acc = self.accumulate(grad)
        score = self._consistent(acc, grad)
        if self.opts["exchange"] == "watch":
            mask = self._watched_choice(acc, out)
        elif self.opts["exchange"] in ("partial", "fill", "recheck"):
            mine = self._chosen(score)
            part = torch.where(mine, acc, 0.0)
            self.comm.allreduce(part)
            recheck = self.opts["exchange"] == "recheck"
            mask = self._chosen(part, self.candidates if recheck else None)
            if recheck:
                total = self._whole(acc)
                mask = self._chosen(torch.where(mask, total, 0.0))
                self._deliver(out, mask, total)
            elif self.opts["exchange"] == "fill":
                total = self._whole(acc)
                self._deliver(out, mask, total)
                if self.opts["diagnose"]:
                    self._diagnose(acc, score, mine, mask, total)
            else:
                out.copy_(torch.where(mask, part, 0.0).div_(self.P))
                mask &= mine
        elif self.opts["exchange"] == "sum":
            total = self._whole(acc)
            mask = self._chosen(total)
            self._deliver(out, mask, total)
        else:
            mask = self._chosen(score)
            part = torch.where(mask, acc, 0.0)
            self.comm.allreduce(part)
            out.copy_(part.div_(self.P))
        acc.masked_fill_(mask, 0.0)
        self.commit_residual(acc, nonfinite)
        self.stats.update(local_selected=mask.sum(), global_selected=(out != 0).sum(),
                          overflow=0)

    def _whole(self, acc: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's ``acc`` (a dense allreduce of a copy)."""
        total = acc.clone()
        self.comm.allreduce(total)
        return total

    def _deliver(self, out: torch.Tensor, mask: torch.Tensor, total: torch.Tensor) -> None:
        """``out`` = the whole sums at ``mask``, divided by P; 0 elsewhere."""
        out.copy_(torch.where(mask, total, 0.0).div_(self.P))

    def _consistent(self, acc: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        """What a rank's own choice ranks (all but ``sum`` and ``watch``): ``acc``, or with
        ``consistency=b > 0``, ``acc · |EMA_b(sign(grad))|``: an entry whose new part keeps
        its sign sync after sync ranks as its size, one whose sign wanders ranks lower. The
        EMA starts at the first sync's signs."""
        b = float(self.opts["consistency"])
        if b == 0:
            return acc
        sign = torch.sign(grad.float())
        self._signs = sign if self._signs is None else self._signs.mul_(b).add_(sign, alpha=1 - b)
        return acc * self._signs.abs()

    def _diagnose(self, acc, score, mine, mask, total) -> None:
        """``diagnose=N`` (with ``fill``): where the whole sum's top lies against the choice,
        printed by rank 0 every N syncs (means over the last N): the shares of the whole sum's
        top ``S`` that the choice holds, that some rank's own top holds, that the last sync's
        ``S`` held, the share of ``S``'s energy the choice misses, and for the entries of ``S``
        that no rank's own top holds, the share of ranks whose ``acc`` has the sum's sign and
        their mean ranking score (``|acc|``, or its ``consistency`` score) against their own
        threshold."""
        S = self._chosen(total)
        picked = mine.float()
        self.comm.allreduce(picked)
        outside = S & (picked == 0)
        agree = (torch.sign(acc) == torch.sign(total)).float()
        self.comm.allreduce(agree)
        thr = score.abs()[mine].min() if bool(mine.any()) else acc.new_tensor(1.0)
        rel = score.abs() / thr
        self.comm.allreduce(rel)
        k, e = S.sum().clamp(min=1), total.square()
        prev = torch.zeros_like(S) if self._prev_S is None else self._prev_S
        row = [float((S & mask).sum() / k), float((S & (picked > 0)).sum() / k),
               float((S & prev).sum() / k), float(e[S & ~mask].sum() / e[S].sum()),
               float(agree[outside].mean() / self.P), float(rel[outside].mean() / self.P)]
        self._prev_S = S
        self._diag.append(row)
        N = int(self.opts["diagnose"])
        if len(self._diag) % N == 0 and self.comm.rank == 0:
            m = torch.tensor(self._diag[-N:]).mean(0).tolist()
            print(f"    diagnose sync {len(self._diag)}: S in choice {m[0]:.3f}, in some own top "
                  f"{m[1]:.3f}, in last S {m[2]:.3f}, energy missed {m[3]:.3f}; outside every "
                  f"own top: ranks with the sum's sign {m[4]:.3f}, |acc|/threshold {m[5]:.3f}",
                  flush=True)

    def _watched_choice(self, acc: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``exchange="watch"``: whole sums on the watch list, partial sums elsewhere, the top
        delivered whole; returns the delivered mask (also the watch list's newest entry)."""
        watch = torch.zeros_like(acc, dtype=torch.bool)
        for m in self._history:
            watch |= m
        mine = self._chosen(torch.where(watch, 0.0, acc))
        part = torch.where(mine, acc, 0.0)
        self.comm.allreduce(part)
        total = self._whole(acc)
        mask = self._chosen(torch.where(watch, total, part))
        self._deliver(out, mask, total)
        self._history = (self._history + [mask])[-int(self.opts["watch"]):]
        self.stats.update(watched=watch.sum(), watched_delivered=(mask & watch).sum())
        return mask


def register() -> None:
    """Make ``algorithm="blockprobe"`` resolve to :class:`BlockProbe`."""
    register_algorithm("blockprobe", BlockProbe)


if __name__ == "__main__":
    register()
    a = quality_at_scale.parse_args()
    sys.exit(quality_at_scale.main(lean=quality_at_scale.wants_lean(a)
                                   and quality_at_scale.lean_malloc()))
