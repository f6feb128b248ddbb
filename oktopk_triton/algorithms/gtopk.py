"""gTop-k (Shi et al., 2019), butterfly variant with a sticky residual mask (docs/algorithms.md §4).

Per step:

1. ``acc = residual + grad``; every rank takes its exact local top-k ``L`` (ties by index,
   :func:`._sparse.topk_entries`).
2. **Fold** (P not a power of two): with ``P2 = 2^floor(log2 P)`` and ``e = P - P2``, ranks
   ``2j`` and ``2j+1`` (j < e) pair up; the odd one sends its ``L`` to the even one, which merges
   (its own value first) and keeps the top-k. The remaining ``P2`` ranks are renumbered
   ``v = 0..P2-1``.
3. **Butterfly**: in round i = 0..log2(P2)-1, virtual ranks ``v`` and ``v XOR 2^i`` exchange their
   current k-entry sets and both compute ``merge_topk(lower group's set, higher group's set)``:
   matching indices add (lower group's value + higher group's value, a canonical order, so
   the sum of 3+ contributions is the same on every rank), the top-k of the union survives
   (ties by index). After the last round every participant holds the same final set ``F``.
4. **Unfold**: each even rank of a pair sends ``F`` back, plus a bit mask telling its partner
   which of the partner's entries reached ``F`` (see below).
5. ``out[F] = F.values / P`` (the same bits on every rank).

Measured why: docs/research/design-notes.md, ``oktopk_triton/algorithms/gtopk.py``.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from . import _wire as W
from ._sparse import (_log2ceil, is_member, merge_topk, pack_bits, pack_entries, topk_entries,
                      unpack_bits, unpack_entries)
from . import schedule as S
from .base import Algorithm
from ..checks import BACKEND
from .description import Description, Option

__all__ = ["GTopk"]


def _layout(P: int):
    P2 = 1 << (P.bit_length() - 1)
    return P2, P - P2


DESCRIPTION = Description(
    name="gtopk", config="GTopk", display="gTop-k",
    advice="""gTop-k: a butterfly of pairwise top-k merges (log2 P rounds). Advice: 1. ``backend``
    (default ``"auto"``): where the kernels run, ``"triton"`` or ``"torch"``.""",
    options={"backend": Option("auto", *BACKEND, annotation=str)},
    volume=lambda n, k, P, **o: (2.0 * k * _log2ceil(P),) * 2,        # 2k words per round
    # as TopkA (its top-k of n int64 keys) without the division (out.index_copy_)
    passes=(4 + 4 + 12 + 12 + 20, 0, 2),
    # a merge per round: argsort and top-k of 2k (4k per round), ~300 B per entry of keys and
    # concatenations
    entry_work=lambda k, P: (1.0 * k + 4.0 * k * max(0, P.bit_length() - 1),
                             300.0 * k * max(0, P.bit_length() - 1)))


class GTopk(Algorithm):
    description = DESCRIPTION
    compact_refusal = None     # global indices; a group's rounding kept by its lowest member

    @staticmethod
    def _set_words(n: int, k: int, compact) -> int:
        """int32 words of one k-entry set message."""
        return W.row_words(k, n) if compact else 2 * k

    @classmethod
    def volume_bound_bytes(cls, n: int, k: int, P: int, **opts) -> int:
        """Most bytes any rank sends per step (without the 4-byte non-finite flag)."""
        if P <= 1:
            return 0
        P2, e = _layout(P)
        rounds = P2.bit_length() - 1
        entries = cls._set_words(n, k, W.packed(opts.get("wire_format")))
        words = entries * rounds
        if e:
            words += entries + (k + 31) // 32
        return 4 * words

    @classmethod
    def schedule(cls, n: int, k: int, P: int, **options) -> List[S.CollectiveSpec]:
        """One steady step of one rank (ranks differ when P is not a power of two): the flag
        allreduce, then, for a rank of the butterfly, log2(P2) exchanges of 2k words with one
        partner each; the survivor of a fold pair first receives its partner's 2k words and
        finally sends it ``2k + ceil(k/32)`` words; the folded rank sends 2k words, then receives
        the result. ``rank=None``: rank 0 (a survivor whenever there are folds: the critical
        path). Compact: a set is ``ceil(n/65536) + k`` words instead of 2k."""
        o, specs, whole = S.step_start(cls, n, k, P, options)
        if whole:
            return specs
        r = 0 if o["rank"] is None else o["rank"]
        P2, e = _layout(P)
        entries = 4 * cls._set_words(n, k, o["compact"])
        unfold = entries + 4 * ((k + 31) // 32)
        butterfly = [S.send_recv([entries], [entries], 1)] * (P2.bit_length() - 1)
        if r < 2 * e and r % 2 == 1:            # folded
            return specs + [S.send_recv([entries], [], 1), S.send_recv([], [unfold], 1)]
        if r < 2 * e:                           # survivor
            return specs + [S.send_recv([], [entries], 1)] + butterfly + \
                [S.send_recv([unfold], [], 1)]
        return specs + butterfly

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.backend = self.kernel_backend()
        P, r = self.P, self.rank
        self._P2, self._extra = _layout(P)
        e = self._extra
        if r < 2 * e:
            self._role = "survivor" if r % 2 == 0 else "folded"
            self._fold_peer = r + 1 if r % 2 == 0 else r - 1
            self._v = r // 2
        else:
            self._role = "plain"
            self._fold_peer = None
            self._v = r - e

    def _real(self, v: int) -> int:
        return 2 * v if v < self._extra else v + self._extra

    def _exchange(self, peer: int, msg: torch.Tensor, recv_words: int) -> torch.Tensor:
        buf = torch.empty(recv_words, dtype=torch.int32, device=msg.device)
        self.comm.send_recv([(peer, msg)], [(peer, buf)])
        return buf

    def _pack(self, idx: torch.Tensor, val: torch.Tensor) -> torch.Tensor:
        if self.compact:
            # topk_entries and merge_topk give ascending indices: written as they are, no sort
            return W.encode(idx, val, None, self.numel, order="ascending").view(-1)
        return pack_entries(idx, val)

    def _unpack(self, buf: torch.Tensor):
        if self.compact:
            idx, val, _ = W.decode(buf, self.k, self.numel)
            return idx.view(-1), val.view(-1)
        _, idx, val = unpack_entries(buf, self.k)
        return idx, val

    def step(self, grad: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        k, P = self.k, self.P
        nmask = (k + 31) // 32
        words = self._set_words(self.numel, k, self.compact)
        acc = self.accumulate(grad)
        L_idx, L_val = topk_entries(acc, k, self.backend)
        # compact: [indices, rounding, still alive] this rank keeps where the index survives
        owed: list = []

        if self._role == "folded":
            peer = self._fold_peer
            self.comm.send_recv([(peer, self._pack(L_idx, L_val))], [])
            buf = torch.empty(words + nmask, dtype=torch.int32, device=acc.device)
            self.comm.send_recv([], [(peer, buf)])
            F_idx, F_val = self._unpack(buf[:words])
            alive = unpack_bits(buf[words:], k)
            if self.compact:   # what the wire dropped of the entries it sent
                owed.append([L_idx, W.bf16_rounding(L_val), alive])
        else:
            S_idx, S_val = L_idx, L_val
            alive = torch.ones(k, dtype=torch.bool, device=acc.device)
            p_idx = p_alive = None
            if self._role == "survivor":
                peer = self._fold_peer
                buf = torch.empty(words, dtype=torch.int32, device=acc.device)
                self.comm.send_recv([], [(peer, buf)])
                p_idx, p_val = self._unpack(buf)
                S_idx, S_val = merge_topk(S_idx, S_val, p_idx, p_val, k)   # lower rank first
                alive = is_member(L_idx, S_idx)
                p_alive = is_member(p_idx, S_idx)
            v = self._v
            bit = 1
            while bit < self._P2:
                if self.compact:
                    # both partners merge the rounded sets; the group's lowest member keeps
                    # the rounding of its partial sums
                    rounded = W.bf16_round(S_val)
                    if v & (bit - 1) == 0:
                        owed.append([S_idx, S_val - rounded,
                                     torch.ones(k, dtype=torch.bool, device=acc.device)])
                    S_val = rounded
                peer = self._real(v ^ bit)
                theirs = self._exchange(peer, self._pack(S_idx, S_val), words)
                t_idx, t_val = self._unpack(theirs)
                if v & bit == 0:
                    S_idx, S_val = merge_topk(S_idx, S_val, t_idx, t_val, k)
                else:
                    S_idx, S_val = merge_topk(t_idx, t_val, S_idx, S_val, k)
                alive &= is_member(L_idx, S_idx)
                if p_alive is not None:
                    p_alive &= is_member(p_idx, S_idx)
                for entry in owed:           # a rounding survives only with its index
                    entry[2] = entry[2] & is_member(entry[0], S_idx)
                bit <<= 1
            F_idx, F_val = S_idx, S_val
            if self.compact:   # every rank applies bf16(F); virtual rank 0 keeps the rest
                rounded = W.bf16_round(F_val)
                if v == 0:
                    owed.append([F_idx, F_val - rounded,
                                 torch.ones(k, dtype=torch.bool, device=acc.device)])
                F_val = rounded
            if self._role == "survivor":
                msg = torch.cat([self._pack(F_idx, F_val), pack_bits(p_alive)])
                self.comm.send_recv([(self._fold_peer, msg)], [])

        out.index_copy_(0, F_idx.to(torch.int64), F_val / P)
        L64 = L_idx.to(torch.int64)
        acc.scatter_(0, L64, torch.where(alive, torch.zeros_like(L_val), L_val))
        for idx, err, keep in owed:
            acc.index_add_(0, idx.to(torch.int64), torch.where(keep, err, torch.zeros_like(err)))
        self.mark_delivered(L_idx, alive)
        self.commit_residual(acc, nonfinite)
        self.stats.update(local_selected=alive.sum(), global_selected=(F_val != 0).sum(),
                          overflow=0, dropped=k - alive.sum())
