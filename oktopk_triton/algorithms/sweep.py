"""A rotating window of the residual, reduced densely at 2 bits a value (the ``sweep`` option).

Why: at P = 64 on the project's GPT, TopkA's output (the union of the ranks' top-k) changes 11
to 13% of the parameters a sync, while Ok-Topk's fills its global k (1.6 to 4.8%); an entry that
never ranks in the global top-k waits in the residuals. The sweep bounds that wait at no index
cost: each step also reduces ``sweep·n`` consecutive positions of every rank's residual, a
window that moves on by its own length every step, so every position is reduced at least every
``ceil(1/sweep)`` steps.

A window of ``L = P·s`` positions, ``s`` for each owner (a multiple of 16, in blocks of at most
:data:`BLOCK`, each with two fp32 scales):

1. every rank takes ``v = residual[window]``, codes each block at 2 bits (the sign, and ``lo``
   or ``hi``: the means of the block's magnitudes below and at or above their mean), keeps
   ``v − q(v)`` in its residual and sends slice j to rank j (ONE alltoall);
2. owner j sums the P decoded slices, codes ``m = sum/P`` the same way, keeps
   ``sum − P·q(m)`` in its residual and allgathers the coded slice (ONE allgather);
3. every rank adds the P decoded slices to ``out`` at the window: the same bits on every rank.

Conservation: ``Σ_r q(v_r)`` left the senders' residuals, ``sum − P·q(m)`` came back to the
owner's, and ``P·q(m)`` reached ``P·out``. A non-finite step changes no residual (``out`` is NaN
there anyway). Bytes a rank sends a step: ``2·(P−1)·(s/16 + 2·blocks)`` int32 words, about
``0.53·sweep·n`` bytes (the 2 bits, and 1/16 of that again for the scales).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch

from ..kernels.wire_quantized import pack_fields, unpack_fields

__all__ = ["ResidualSweep", "BLOCK"]

BLOCK = 512   # values per pair of scales: 1/16 bit of scale a value (2 fp32 per 512)


def fraction_of(fraction) -> float:
    """The ``sweep`` option, checked: a number in [0, 1)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or \
            not 0.0 <= float(fraction) < 1.0:
        raise ValueError(f"sweep must be a fraction of n in [0, 1) (0: off), got {fraction!r}")
    return float(fraction)


class ResidualSweep:
    """The window's layout, its position and its buffers (module doc)."""

    fraction = staticmethod(fraction_of)

    @staticmethod
    def layout(n: int, P: int, fraction: float) -> Tuple[int, int, int, int]:
        """``(s, blocks, block, words)``: positions an owner holds (``blocks·block``, block a
        multiple of 16 and at most :data:`BLOCK`), and the int32 words of one coded slice
        (``2·blocks`` scales, ``s/16`` code words). Raises when ``P·s`` exceeds n."""
        fraction = fraction_of(fraction)
        want = max(1, int(math.ceil(fraction * n)))
        s = -(-want // P)
        blocks = -(-s // BLOCK)
        block = 16 * -(-(-(-s // blocks)) // 16)
        s = blocks * block
        if P * s > n:
            raise ValueError(f"sweep={fraction!r}: a window of {P} x {s} positions (whole "
                             f"blocks of 16) does not fit n = {n}; use a smaller sweep")
        return s, blocks, block, 2 * blocks + s // 16

    def __init__(self, n: int, comm, fraction: float, device: torch.device) -> None:
        self.n, self.P, self.rank, self.comm = n, comm.world_size, comm.rank, comm
        self.s, self.blocks, self.block, self.words = self.layout(n, self.P, fraction)
        self.L = self.P * self.s
        self.offset = torch.zeros((), dtype=torch.int64, device=device)   # the window's start
        self._pos = torch.arange(self.L, dtype=torch.int64, device=device)
        self._recv = torch.zeros(self.P, self.words, dtype=torch.int32, device=device)
        self._gathered = torch.zeros(self.P, self.words, dtype=torch.int32, device=device)

    # -- coding -----------------------------------------------------------------------------------
    def encode(self, v: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
        """``v`` fp32 [S, s] -> ``(q(v) [S, s], words int32 [S, words])``; ``q`` is what
        :meth:`decode` reads back from ``words``, bit for bit."""
        S, nb, b = v.shape[0], self.blocks, self.block
        x = v.reshape(S, nb, b)
        a = x.abs()
        mean = a.mean(-1, keepdim=True)
        up = a >= mean
        n_up = up.sum(-1, keepdim=True)
        hi = torch.where(up, a, 0.0).sum(-1, keepdim=True) / n_up.clamp(min=1)
        lo = torch.where(n_up < b, torch.where(up, 0.0, a).sum(-1, keepdim=True) /
                         (b - n_up).clamp(min=1), hi)
        code = (x < 0).to(torch.int64) * 2 + (2 * a >= lo + hi).to(torch.int64)
        words = torch.cat([lo.reshape(S, nb).view(torch.int32), hi.reshape(S, nb).view(torch.int32),
                           pack_fields(code.reshape(S, nb * b), 2)], 1)
        return self._levels(code, lo, hi).reshape(S, nb * b), words

    def decode(self, words: torch.Tensor) -> torch.Tensor:
        """Coded slices int32 [S, words] -> their values fp32 [S, s]."""
        S, nb, b = words.shape[0], self.blocks, self.block
        lo = words[:, :nb].contiguous().view(torch.float32).reshape(S, nb, 1)
        hi = words[:, nb:2 * nb].contiguous().view(torch.float32).reshape(S, nb, 1)
        code = unpack_fields(words[:, 2 * nb:], 2, nb * b).reshape(S, nb, b)
        return self._levels(code, lo, hi).reshape(S, nb * b)

    @staticmethod
    def _levels(code: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
        mag = torch.where((code & 1) != 0, hi, lo)
        return torch.where((code & 2) != 0, -mag, mag)

    # -- the step ---------------------------------------------------------------------------------
    def step(self, residual: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        """Reduce this step's window into ``out`` (added to what is there) and move it on."""
        P, r, s = self.P, self.rank, self.s
        idx = torch.remainder(self.offset + self._pos, self.n)
        old = residual[idx]
        v = old if nonfinite is None else torch.where(nonfinite > 0, 0.0, old)
        q, words = self.encode(v.view(P, s))
        residual[idx] = old - q.reshape(-1)              # a non-finite step: old - 0, the same
        if P > 1:
            self.comm.alltoall(self._recv, words)
        else:
            self._recv.copy_(words)
        total = self.decode(self._recv).sum(0)           # owner r's slice, from every source
        qm, slot = self.encode((total / P).view(1, s))
        mine = idx[r * s:(r + 1) * s]
        back = residual[mine] + (total - P * qm.reshape(-1))
        residual[mine] = back if nonfinite is None else torch.where(nonfinite > 0,
                                                                    residual[mine], back)
        if P > 1:
            self.comm.allgather(self._gathered, slot.reshape(-1))
        else:
            self._gathered.copy_(slot)
        out[idx] = out[idx] + self.decode(self._gathered).reshape(-1)
        self.offset.add_(self.L).remainder_(self.n)
