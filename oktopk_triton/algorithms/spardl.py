"""SparDL (Zhao et al., 2023): block-balanced sparse allreduce, docs/algorithms.md §5.

The index space is cut into ``P`` equal blocks (block ``b`` = ``[n*b//P, n*(b+1)//P)``), each
with the budget ``k_b = max(1, round(k/P))`` entries. Every rank keeps a padded dense working
copy ``W`` of its accumulator, ``[P, L]`` with ``L = ceil(n/P)`` (padding is always zero).

* **Spar-Reduce-Scatter** (the transpose of a Bruck allgather, any P): with
  ``R = ceil(log2 P)`` rounds of distances ``d = 2^(R-1), 2^(R-2), ..., 1``, rank ``r`` holds
  the partial sums of the blocks at offsets ``[0, m)`` (block ``(r + j) mod P`` at offset ``j``,
  ``m = P`` at first); it sends the blocks at offsets ``[d, m)`` to rank ``r + d`` in ONE message
  and adds what rank ``r - d`` sends into offsets ``[0, m - d)``; then ``m = d``. Blocks sent per
  round: ``P - 2^(R-1), 2^(R-2), ..., 1`` (``P - 1`` in all). Every block is sent as the top-``k_b``
  of the rank's current partial sum (``torch.topk``, static size); the sent entries are removed
  from ``W`` and everything the rank does not forward -- its own entries and the partial sums of
  other ranks' entries alike -- stays in ``W``, i.e. in *this* rank's residual. Mass only moves
  from one rank's ``W`` to another's, never disappears.
* The owner of block ``r`` (rank ``r``) ends with the full sum of that block in ``W``; it keeps
  the top-``k_b`` as the final block and the rest stays in its residual (global residual
  collection: ``residual = W`` afterwards, so ``sum_p acc_p = P*out + sum_p residual_p`` exactly
  up to float rounding).
* **Spar-All-Gather**: a Bruck allgather of the final blocks in ``ceil(log2 P)`` rounds
  (``send_recv``), so ``out`` is built on every rank from the same bytes: bitwise identical.

Measured why: docs/research/design-notes.md, ``oktopk_triton/algorithms/spardl.py``.
"""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from . import _wire as W_
from . import schedule as S
from .base import Algorithm
from ..checks import int_at_least
from .description import Description, Option

__all__ = ["SparDL"]


def _rounds_rs(G: int) -> List[int]:
    """Distances of the Spar-Reduce-Scatter rounds for a group of G: 2^(R-1), ..., 1."""
    if G <= 1:
        return []
    R = math.ceil(math.log2(G))
    return [2 ** i for i in range(R - 1, -1, -1)]


DESCRIPTION = Description(
    name="spardl", config="SparDL", display="SparDL",
    advice="""SparDL: a sparse reduce-scatter and Bruck allgather over blocks. Advice: 1. ``teams``
    (default 1): teams of ranks reducing inside the team first; a divisor of the world size
    (checked when the reducer is built for a group).""",
    options={"teams": Option(1, int_at_least(1), "a positive int", annotation=int)},
    volume=lambda n, k, P, **o: (4.0 * k * ((P - 1) / P),) * 2,
    # the checks (8); acc (12); Spar-Reduce-Scatter touches (P-1)/P of n on each side:
    # index_select + |.| + index_copy on the sending side (24), index_select + index_copy on the
    # receiving side (16), the block top-ks cover n once (fp32); padded out (4), copy + div (16),
    # commit (20)
    passes=(4 + 4 + 12 + 40 + 4 + 16 + 20, 0, 1),
    entry_work=lambda k, P: (0.0, 20.0 * k))


class SparDL(Algorithm):
    description = DESCRIPTION
    STATE = ()
    compact_refusal = None     # block-relative indices; the rounding stays in the sender's W

    @staticmethod
    def _block_words(L: int, kb: int, compact: bool) -> int:
        """int32 words of one block message: header + k_b entries."""
        return W_.row_words(kb, L) if compact else 1 + 2 * kb

    @classmethod
    def schedule(cls, n: int, k: int, P: int, **options) -> List[S.CollectiveSpec]:
        """One steady step (the same on every rank): the flag allreduce, then one send/recv
        with one partner per round: Spar-Reduce-Scatter inside the team (units of ``teams``
        blocks) and across teams (single blocks), then the Bruck allgathers across teams and
        inside the team. A block message is ``1 + 2·k_b`` int32 words (compact:
        ``ceil(L/65536) + k_b``)."""
        o = S.resolve_options(cls, n, k, P, options)
        if k >= n:
            return S.dense_step_specs(n, P, o)
        d = o["teams"]
        if not isinstance(d, int) or d < 1 or P % d:
            raise ValueError(f"spardl: teams must be a positive divisor of the world size {P}, "
                             f"got {d!r}")
        L = -(-n // P)
        kb = max(1, min(L, int(round(k / P))))
        block = 4 * cls._block_words(L, kb, o["compact"])
        T = P // d

        def reduce_scatter(G, unit):
            out, m = [], G
            for dist in _rounds_rs(G):
                b = (m - dist) * unit
                out.append(S.send_recv([b], [b], 1 if 2 * dist % G == 0 else 2))
                m = dist
            return out

        def bruck(G, unit):
            out, c = [], 1
            while c < G:
                b = min(c, G - c) * unit
                out.append(S.send_recv([b], [b], 1 if 2 * c % G == 0 else 2))
                c += min(c, G - c)
            return out

        return (S.flag_specs(P, o) + reduce_scatter(T, d * block) + reduce_scatter(d, block)
                + bruck(d, block) + bruck(T, d * block))

    def __init__(self, numel, comm, density=0.01, **kw):
        super().__init__(numel, comm, density, **kw)
        P, n = self.P, self.numel
        d = self.opts["teams"]
        if not isinstance(d, int) or d < 1 or P % d:
            raise ValueError(f"spardl: teams must be a positive divisor of the world size {P}, "
                             f"got {d!r}")
        self.teams = d
        self.L = -(-n // P)
        self.kb = max(1, min(self.L, int(round(self.k / P))))
        # flat index -> position in the padded [P, L] layout
        b = torch.arange(P + 1, dtype=torch.int64) * n // P
        lens = b[1:] - b[:-1]
        blk = torch.repeat_interleave(torch.arange(P), lens)
        pos = torch.arange(n, dtype=torch.int64) - b[:-1][blk] + blk * self.L
        # None when n % P == 0: the padded layout is the flat vector itself (no copies)
        self._pad_pos = None if n % P == 0 else pos.to(self.device)
        # groups: phase 1 inside the team (units = super-blocks of d blocks), phase 2 across teams
        T = P // d
        t, q = divmod(self.rank, T)
        self._team = [t * T + j for j in range(T)]          # position q in it
        self._cross = [j * T + q for j in range(d)]         # position t in it
        self._q, self._t, self._T = q, t, T
        # static schedules (index tensors built once, no host->device copies in a step)
        self._rs_team = self._rs_plan(T, q)
        self._rs_cross = self._rs_plan(d, t)
        self._ag_order_team = self._ag_order(T, q)
        self._ag_order_cross = self._ag_order(d, t)
        self.stats.update(local_selected=0, global_selected=0, overflow=0, dropped=0)

    # -- one group of G ranks; W is [G, U, L] (unit = U rows) in this group's unit order -------
    def _rs_plan(self, G: int, gi: int) -> list:
        plan, m = [], G
        for d in _rounds_rs(G):
            s = m - d
            if s > 0:
                send_units = torch.tensor([(gi + j) % G for j in range(d, m)], device=self.device)
                recv_units = torch.tensor([(gi + j) % G for j in range(0, s)], device=self.device)
                plan.append((d, s, send_units, recv_units))
            m = d
        return plan

    def _ag_order(self, G: int, gi: int) -> torch.Tensor:
        # after the Bruck rounds offset j holds unit (gi + j) % G -> unit u at offset (u - gi) % G
        return torch.tensor([(u - gi) % G for u in range(G)], device=self.device)

    def _msg(self, blocks: torch.Tensor, sent: Optional[torch.Tensor] = None):
        """Top-k_b of every row of ``blocks`` [B, L] packed as [B, 1 + 2 k_b] int32 (compact:
        [B, ceil(L/65536) + k_b]); the sent entries are zeroed in ``blocks`` (in place; compact:
        left with the bf16 rounding). Returns (message, nonzeros sent per row). ``sent``
        (bool [B, L], optional): set at the sent positions."""
        kb = self.kb
        _, idx = torch.topk(blocks.abs(), kb, dim=1, sorted=False)
        vals = blocks.gather(1, idx)
        nnz = (vals != 0).sum(1, dtype=torch.int32)
        if sent is not None:
            sent.scatter_(1, idx, True)
        if self.compact:
            blocks.scatter_(1, idx, W_.bf16_rounding(vals))
            return W_.encode(idx, vals, None, self.L), nnz
        blocks.scatter_(1, idx, 0.0)
        msg = torch.empty(blocks.shape[0], 1 + 2 * kb, dtype=torch.int32, device=blocks.device)
        msg[:, 0] = nnz
        msg[:, 1:1 + kb] = idx.to(torch.int32)
        msg[:, 1 + kb:] = vals.view(torch.int32)
        return msg, nnz

    def _unpack(self, msg: torch.Tensor):
        kb = self.kb
        if self.compact:
            idx, vals, _ = W_.decode(msg, kb, self.L)
            return idx.long(), vals
        idx = msg[:, 1:1 + kb].long()
        vals = msg[:, 1 + kb:].contiguous().view(torch.float32)
        return idx, vals

    def _reduce_scatter(self, W: torch.Tensor, group: List[int], gi: int, plan: list,
                        counters: list, D: Optional[torch.Tensor] = None) -> None:
        """``D`` (optional, bool like ``W``): where this rank's W holds nothing but what a send
        left (the compact wire's rounding), for momentum factor masking."""
        G = len(group)
        U, L = W.shape[1], W.shape[2]
        for d, s, send_units, recv_units in plan:
            blocks = W.index_select(0, send_units).reshape(s * U, L)
            sent = None if D is None else D.index_select(0, send_units).reshape(s * U, L)
            msg, nnz = self._msg(blocks, sent)
            W.index_copy_(0, send_units, blocks.view(s, U, L))
            if D is not None:
                D.index_copy_(0, send_units, sent.view(s, U, L))
            counters.append(nnz.sum())
            rmsg = torch.empty_like(msg)
            self.comm.send_recv([(group[(gi + d) % G], msg)], [(group[(gi - d) % G], rmsg)])
            idx, vals = self._unpack(rmsg)
            tgt = W.index_select(0, recv_units).reshape(s * U, L)
            tgt.scatter_add_(1, idx, vals)
            W.index_copy_(0, recv_units, tgt.view(s, U, L))
            if D is not None:   # a nonzero arrival makes the position owe again
                dt = D.index_select(0, recv_units).reshape(s * U, L)
                dt.scatter_(1, idx, dt.gather(1, idx) & (vals == 0))
                D.index_copy_(0, recv_units, dt.view(s, U, L))

    def _allgather(self, mine: torch.Tensor, group: List[int], gi: int,
                   order: torch.Tensor) -> torch.Tensor:
        """Bruck allgather of ``mine`` [U, w] over the group; returns [G, U, w] in unit order."""
        G = len(group)
        M = torch.empty((G,) + tuple(mine.shape), dtype=mine.dtype, device=mine.device)
        M[0] = mine
        c = 1
        while c < G:
            cnt = min(c, G - c)
            recv = torch.empty_like(M[c:c + cnt])
            self.comm.send_recv([(group[(gi - c) % G], M[:cnt].contiguous())],
                                [(group[(gi + c) % G], recv)])
            M[c:c + cnt] = recv
            c += cnt
        return M.index_select(0, order)

    # -- the step -------------------------------------------------------------------------------
    def step(self, grad, out, nonfinite):
        P, L, kb, d, T = self.P, self.L, self.kb, self.teams, self._T
        acc = self.accumulate(grad)
        if self._pad_pos is None:
            Wflat = acc
        else:
            Wflat = torch.zeros(P * L, dtype=torch.float32, device=self.device)
            Wflat.index_copy_(0, self._pad_pos, acc)
        W = Wflat.view(P, L)
        # compact wire with masked momentum: where W holds only a send's rounding
        track = self.compact and self.velocity is not None and self.momentum_masking
        D = torch.zeros(P, L, dtype=torch.bool, device=self.device) if track else None
        counters: list = []
        q, t = self._q, self._t
        # phase 1: inside the team, units = super-blocks of d blocks
        if T > 1:
            self._reduce_scatter(W.view(T, d, L), self._team, q, self._rs_team, counters,
                                 None if D is None else D.view(T, d, L))
        # phase 2: across teams, super-block q's d blocks, one per team
        sup = W.view(T, d, L)[q]                     # [d, L] view into W
        if d > 1:
            self._reduce_scatter(sup.view(d, 1, L), self._cross, t, self._rs_cross, counters,
                                 None if D is None else D.view(T, d, L)[q].view(d, 1, L))
        # owner: final top-k_b of its block (rank (t, q) owns block q*d + t)
        own = sup[t:t + 1]                           # [1, L] view into W
        before = own.clone()
        own_sent = None if D is None else D.view(T, d, L)[q][t:t + 1]
        final, final_nnz = self._msg(own, own_sent)  # zeroes the kept entries in W
        # Spar-All-Gather
        blocks = final
        if d > 1:
            # super-block q
            blocks = self._allgather(blocks, self._cross, t, self._ag_order_cross).reshape(d, -1)
        if T > 1:
            # all blocks
            blocks = self._allgather(blocks, self._team, q,
                                     self._ag_order_team).reshape(T * d, -1)
        idx, vals = self._unpack(blocks.reshape(P, -1))
        opad = torch.zeros(P, L, dtype=torch.float32, device=self.device)
        opad.scatter_(1, idx, vals)
        if self._pad_pos is None:
            out.copy_(opad.view(-1)).div_(P)
            self.commit_residual(Wflat, nonfinite)
        else:
            out.copy_(opad.view(-1).index_select(0, self._pad_pos).div_(P))
            self.commit_residual(Wflat.index_select(0, self._pad_pos), nonfinite)
        if D is not None:
            D = D.view(-1)
            self.mark_delivered(D if self._pad_pos is None else D.index_select(0, self._pad_pos))

        sent = counters[0] if counters else final_nnz.sum()
        if len(counters) > 1:
            sent = torch.stack(counters).sum()
        self.stats.update(
            local_selected=sent,
            global_selected=(out != 0).sum(),
            overflow=0,
            # entries of the owner's full block sum that did not make its top-k_b
            dropped=(before != 0).sum() - final_nnz.sum(),
            block_budget=kb,
        )
