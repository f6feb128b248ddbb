"""TopkDSA (SparCML-style sparse reduce + allgather, switching to dense), docs/algorithms.md §6.

Regions: ``P`` equal static regions (region ``j`` = ``[n*j//P, n*(j+1)//P)``, owned by rank
``j``), held padded as ``[P, L]`` with ``L = ceil(n/P)`` (padding is always zero).

One step on rank ``r``:

1. ``acc = residual + grad``; local selection: ``torch.topk(|acc|, k)``.
2. Sparse reduce to the owners: for every region ``j`` the rank sends rank ``j`` the largest
   ``cap = ceil(slack * k / P)`` of its selected entries in that region (one ``alltoall`` of
   ``[P, 1 + 2*cap]`` int32: header = count, region-relative indices, fp32 values as bits).
   Selected entries that do not fit stay in the residual (``overflow``).
3. The owner adds the ``P`` contributions in rank order (deterministic) into its region ``R``.
4. Allgather of the reduced regions, in one of two static modes:
   * ``sparse``: the owner sends the largest ``cap2`` entries of ``R`` (``[1 + 2*cap2]`` int32,
     header = the TRUE number of nonzeros of ``R``); what does not fit stays in the OWNER's
     residual, so nothing is lost;
   * ``dense``: the owner sends ``R`` itself (``L`` fp32): the SparCML switch once the sum has
     filled in. Volume ``(2*cap + 1)(P-1) + L(P-1)`` words, the ``(2k + n)(P-1)/P`` of §6.
   ``out`` = the gathered regions / P, built from the same bytes on every rank (bitwise
   identical).
5. ``residual = acc - sent`` (+ on the owner, what of ``R`` was not gathered).

Measured why: docs/research/design-notes.md, ``oktopk_triton/algorithms/topkdsa.py``.
"""
from __future__ import annotations

import math

import torch

from . import _wire as W
from . import schedule as S
from .base import Algorithm
from ..checks import at_least_one, number
from .description import Description, Option

__all__ = ["TopkDSA"]

SPARSE, DENSE = "sparse", "dense"


DESCRIPTION = Description(
    name="topkdsa", config="TopkDSA", display="TopkDSA",
    advice="""TopkDSA (SparCML-style): a sparse reduce to region owners, then a sparse or dense
    allgather of the regions. Advice:

    1. ``tau`` (default 32): steps between two choices of the allgather's mode.
    2. ``slack`` (default 1.25, >= 1): a region's capacity in units of ``k/P``.
    3. ``gather_slack`` (default 1.25, >= 1): the sparse gather's capacity over the largest
       count seen.
    4. ``fill`` (default 1/3, in (0, 1]): the region fill above which the gather turns dense.
    """,
    options={
        "tau": Option(32, lambda x: isinstance(x, int) and x >= 1, "a positive int",
                      annotation=int),
        "slack": Option(1.25, at_least_one, ">= 1", annotation=float),
        "gather_slack": Option(1.25, at_least_one, ">= 1", annotation=float),
        "fill": Option(1.0 / 3.0, lambda x: number(x) and 0.0 < x <= 1.0, "in (0, 1]",
                       annotation=float),
    },
    # the reduce to owners (2k·(P-1)/P each way); the gather sparse (2k) or dense (n)
    volume=lambda n, k, P, **o: (4.0 * k * ((P - 1) / P), (2.0 * k + n) * ((P - 1) / P)),
    # the checks (8); acc (12), |acc| (8) and a top-k over n; selection buffer (4), counts (5),
    # |sel| (8) and a row-wise top-k over n; residual scatter clone (8); padded out (4); copy +
    # div (16), commit (20)
    passes=(4 + 4 + 12 + 8 + 4 + 5 + 8 + 8 + 4 + 16 + 20, 0, 2),
    entry_work=lambda k, P: (0.0, 20.0 * 1.25 * k))        # the owner adds P·cap ≈ 1.25k


class TopkDSA(Algorithm):
    description = DESCRIPTION
    STATE = ("mode", "cap2", "decisions")
    compact_refusal = None     # region-relative indices; the owner keeps the gather's rounding

    @staticmethod
    def _sizes(L: int, cap: int, compact: bool):
        """(reduce message words, sparse gather words as a function of cap2, dense gather
        words) of one region."""
        if compact:
            return W.row_words(cap, L), (lambda c2: W.row_words(c2, L, header=1)), (L + 1) // 2
        return 1 + 2 * cap, (lambda c2: 1 + 2 * c2), L

    @classmethod
    def schedule(cls, n: int, k: int, P: int, **options) -> list:
        """One steady step: the flag allreduce, one alltoall of ``[P, 1 + 2·cap]`` int32, one
        allgather of the reduced region: ``1 + 2·cap2`` int32 (sparse mode) or ``L`` fp32
        (dense mode); compact: ``ceil(L/65536) + cap``, ``1 + ceil(L/65536) + cap2`` and
        ``ceil(L/2)`` words. Mode and ``cap2`` follow the fill observed at the last decision: pass
        ``mode`` ("sparse"/"dense") and ``cap2`` (the algorithm's state) for the exact size;
        without them the gather is data dependent, from the smallest sparse message
        (``cap2 = 1``) up to a dense region."""
        o = S.resolve_options(cls, n, k, P, options, extra=("mode", "cap2"))
        if k >= n:
            return S.dense_step_specs(n, P, o)
        specs = S.flag_specs(P, o)
        if P == 1:
            return specs
        L = -(-n // P)
        cap = max(1, min(L, math.ceil(float(o["slack"]) * k / P)))
        red, sparse, dense = cls._sizes(L, cap, o["compact"])
        specs.append(S.alltoall(4 * P * red, P))
        mode, cap2 = o["mode"], o["cap2"]
        if mode is None:
            hi = 4 * dense
            lo = 4 * sparse(1) if sparse(1) < dense else hi
            specs.append(S.allgather(hi, P, data_dependent=(P - 1) * (hi - lo)))
        elif mode == DENSE:
            specs.append(S.allgather(4 * dense, P))
        elif mode == SPARSE:
            if not (isinstance(cap2, int) and 1 <= cap2 <= L):
                raise ValueError(f"topkdsa.schedule: sparse mode needs cap2 in [1, {L}], "
                                 f"got {cap2!r}")
            specs.append(S.allgather(4 * sparse(cap2), P))
        else:
            raise ValueError(f"topkdsa.schedule: mode must be None, {SPARSE!r} or {DENSE!r}, "
                             f"got {mode!r}")
        return specs

    def __init__(self, numel, comm, density=0.01, **kw):
        super().__init__(numel, comm, density, **kw)
        P, n = self.P, self.numel
        tau = self.opts["tau"]      # checked by the base (oktopk_triton.config.TopkDSA's rules)
        self.tau = tau
        self.L = L = -(-n // P)
        self.cap = max(1, min(L, math.ceil(float(self.opts["slack"]) * self.k / P)))
        b = torch.arange(P + 1, dtype=torch.int64) * n // P
        lens = b[1:] - b[:-1]
        blk = torch.repeat_interleave(torch.arange(P), lens)
        # None when n % P == 0: the padded layout is the flat vector itself (no copies)
        self._pad_pos = None if n % P == 0 else \
            (torch.arange(n, dtype=torch.int64) - b[:-1][blk] + blk * L).to(self.device)
        # message sizes in this wire format: reduce, sparse gather (of cap2), dense gather
        _, self._sparse_words, self._dense_words = self._sizes(L, self.cap, self.compact)
        # step 0: lossless gather
        self.cap2 = min(L, P * self.cap)
        self.mode = DENSE if self._sparse_words(self.cap2) >= self._dense_words else SPARSE
        self.decisions = 0
        self.stats.update(local_selected=0, global_selected=0, overflow=0)

    # -- helpers -----------------------------------------------------------------------------
    @staticmethod
    def _pack(idx: torch.Tensor, vals: torch.Tensor, header: torch.Tensor) -> torch.Tensor:
        c = idx.shape[-1]
        msg = torch.empty(idx.shape[:-1] + (1 + 2 * c,), dtype=torch.int32, device=idx.device)
        msg[..., 0] = header.to(torch.int32)
        msg[..., 1:1 + c] = idx.to(torch.int32)
        msg[..., 1 + c:] = vals.contiguous().view(torch.int32)
        return msg

    @staticmethod
    def _unpack(msg: torch.Tensor):
        c = (msg.shape[-1] - 1) // 2
        return msg[..., 1:1 + c].long(), msg[..., 1 + c:].contiguous().view(torch.float32)

    def _decide(self, counts: torch.Tensor, nonfinite) -> None:
        """The amortised host read: mode and cap2 for the next tau steps."""
        if nonfinite is not None and int(nonfinite.item()) > 0:
            return  # counts of a NaN step mean nothing; keep the current sizes
        c = counts.tolist()
        total, mx = sum(c), max(c)
        cap2 = max(1, min(self.L, math.ceil(float(self.opts["gather_slack"]) * mx)))
        if total > float(self.opts["fill"]) * self.numel or \
                self._sparse_words(cap2) >= self._dense_words:
            self.mode = DENSE
        else:
            self.mode, self.cap2 = SPARSE, cap2
        self.decisions += 1

    # -- the step ------------------------------------------------------------------------------
    def step(self, grad, out, nonfinite):
        P, L, cap, r = self.P, self.L, self.cap, self.rank
        dev = self.device
        acc = self.accumulate(grad)
        if self._pad_pos is None:
            acc_pad = acc.view(P, L)  # read only below
        else:
            acc_pad = torch.zeros(P * L, dtype=torch.float32, device=dev)
            acc_pad.index_copy_(0, self._pad_pos, acc)
            acc_pad = acc_pad.view(P, L)

        residual, sel_count, sent_count, rmsg = self._select_and_send(acc, acc_pad)

        # 3. owner reduces in rank order
        if self.compact:
            iidx, ivals, _ = W.decode(rmsg, cap, L)
            iidx = iidx.long()
        else:
            iidx, ivals = self._unpack(rmsg)
        R = torch.zeros(L, dtype=torch.float32, device=dev)
        for s in range(P):
            R.index_add_(0, iidx[s], ivals[s])

        # 4. allgather of the reduced regions
        mode = self.mode
        opad, counts, kept = self._gather_regions(R, mode)
        residual[r] += R
        if self._pad_pos is None:
            out.copy_(opad.view(-1)).div_(P)
            self.commit_residual(residual.view(-1), nonfinite)
        else:
            out.copy_(opad.view(-1).index_select(0, self._pad_pos).div_(P))
            self.commit_residual(residual.view(-1).index_select(0, self._pad_pos), nonfinite)
        if self.compact:
            self._mark_sent()

        self.stats.update(
            local_selected=sent_count.sum(),
            global_selected=(out != 0).sum(),
            overflow=(sel_count - sent_count).sum(),
            fill=counts.sum(),
            gathered=kept,
            mode=mode,
            cap=cap,
            cap2=self.cap2 if mode == SPARSE else L,
        )
        if self.step_count % self.tau == 0:
            self._decide(counts, nonfinite)

    def _select_and_send(self, acc, acc_pad):
        """Steps 1 and 2: the local top-k, and the largest ``cap`` selected entries of each
        region sent to its owner (one alltoall). Returns (residual rows, selected per region,
        sent per region, the received messages)."""
        P, L, cap, dev = self.P, self.L, self.cap, self.device
        # 1. local top-k
        _, sidx = torch.topk(acc.abs(), self.k, sorted=False)
        sel = torch.zeros(P * L, dtype=torch.float32, device=dev)
        pidx = sidx if self._pad_pos is None else self._pad_pos.index_select(0, sidx)
        sel.index_copy_(0, pidx, acc_pad.view(-1).index_select(0, pidx))
        sel = sel.view(P, L)
        sel_count = (sel != 0).sum(1)

        # 2. the largest `cap` selected entries of each region go to its owner
        _, ridx = torch.topk(sel.abs(), cap, dim=1, sorted=False)
        rvals = sel.gather(1, ridx)
        sent_count = (rvals != 0).sum(1)
        # acc - sent: exact zeros where sent (the values are copies); slots that picked an
        # unselected (zero in `sel`) position leave acc there untouched
        # (compact: what the wire carries is bf16(rvals); the rounding stays owed)
        wire = W.bf16_round(rvals) if self.compact else rvals
        residual = acc_pad.scatter(1, ridx, acc_pad.gather(1, ridx) - wire)
        if self.compact:   # for the velocity mask (_mark_sent), dropped there
            self._sent = (ridx, rvals != 0)
        # compact: grouped by chunk (no sort); the owner adds each row's unique indices
        msg = W.encode(ridx, rvals, None, L, order="chunks") if self.compact else \
            self._pack(ridx, rvals, sent_count)
        rmsg = torch.empty_like(msg)
        if P > 1:
            self.comm.alltoall(rmsg.view(-1), msg.view(-1))
        else:
            rmsg.copy_(msg)

        return residual, sel_count, sent_count, rmsg

    def _gather_regions(self, R, mode):
        """Step 4: every rank's reduced region to everyone, sparse (the ``cap2`` largest; what
        does not fit stays in ``R``) or dense (``R`` zeroed). Returns (the gathered rows, the
        entries per row, the entries kept)."""
        P, L, dev = self.P, self.L, self.device
        if mode == SPARSE:
            _, gidx = torch.topk(R.abs(), self.cap2, sorted=False)
            gvals = R.gather(0, gidx)
            fill_own = (R != 0).sum()
            # what does not fit stays with the owner (compact: and the rounding of what does)
            R.scatter_(0, gidx, W.bf16_rounding(gvals) if self.compact
                       else torch.zeros_like(gvals))
            if self.compact:
                gmsg = W.encode(gidx, gvals, None, L, header=1, order="chunks").view(-1)
                gmsg[0] = fill_own.to(torch.int32)
            else:
                gmsg = self._pack(gidx, gvals, fill_own)
            allm = torch.empty(P, gmsg.numel(), dtype=torch.int32, device=dev)
            if P > 1:
                self.comm.allgather(allm, gmsg)
            else:
                allm[0] = gmsg
            if self.compact:
                aidx, avals, _ = W.decode(allm, self.cap2, L, header=1)
                aidx = aidx.long()
            else:
                aidx, avals = self._unpack(allm)
            opad = torch.zeros(P, L, dtype=torch.float32, device=dev)
            opad.scatter_(1, aidx, avals)
            counts = allm[:, 0]
            kept = (avals != 0).sum()
        elif self.compact:   # R as bf16, two to a word (an odd L padded); R keeps the rounding
            half = self._dense_words
            wire = torch.zeros(2 * half, dtype=torch.bfloat16, device=dev)
            wire[:L] = R
            allw = torch.empty(P, half, dtype=torch.int32, device=dev)
            if P > 1:
                self.comm.allgather(allw, wire.view(torch.int32))
            else:
                allw[0] = wire.view(torch.int32)
            opad = allw.view(torch.bfloat16)[:, :L].float()
            R.sub_(opad[self.rank])
            counts = (opad != 0).sum(1)
            kept = counts.sum()
        else:
            opad = torch.empty(P, L, dtype=torch.float32, device=dev)
            if P > 1:
                self.comm.allgather(opad, R)
            else:
                opad[0] = R
            R.zero_()
            counts = (opad != 0).sum(1)
            kept = counts.sum()
        return opad, counts, kept

    def _mark_sent(self) -> None:
        """Compact wire, masked momentum: the entries this rank sent to their owners are
        delivered whole but for the rounding (the velocity restarts there), like the zeros a
        fp32 step leaves."""
        ridx, nz = self._sent
        self._sent = None
        P, n = self.P, self.numel
        j = torch.arange(P, device=self.device).reshape(P, 1)
        start, end = n * j // P, n * (j + 1) // P           # region j of the flat vector
        self.mark_delivered(start + ridx, nz & (ridx < end - start))
