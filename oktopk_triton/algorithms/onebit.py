"""OneBit: every entry sent as its sign, one scale per block, error feedback twice
(docs/algorithms.md §8). The compressed allreduce of 1-bit Adam (Tang et al. 2021), in the
step contract of :mod:`.base`.

Why it is here: on the 1M GPT of the language-model campaign, top-k at 1-2% of the entries needs
about twice dense's steps, because each coordinate is delivered once in tens of steps. A sign and a
shared scale per block reach every coordinate on every step for 1/32 of dense's bytes plus the
scales (``block=512``: 3.3%), under the 5% budget of the top-k runs.

Per step, on every rank (the vector padded to ``P`` chunks of whole blocks):

1. ``acc = residual + grad``; ``q = sign(acc)·mean(|acc|)`` per block of ``block`` entries
   (the scale that minimises ``|acc - q|²``; a zero counts as positive), ``err = acc - q``;
2. one alltoall: chunk j of the packed signs and scales goes to rank j (``(P-1)/P·(n/32 + n/block)``
   words);
3. rank j decodes the P copies of its chunk and sums them in rank order: ``s_j``; it compresses
   ``s_j`` the same way to ``q_j`` and adds ``s_j - q_j`` to its own ``err`` on chunk j (the
   chunk owner's error feedback is kept in the same residual, so the state is n words);
4. one allgather of the packed ``q_j``; every rank decodes all chunks in the same order:
   ``out = q / P``, bitwise identical on every rank;
5. ``residual = err``.

Conservation: ``sum_r acc_r = sum_r q_r + sum_r err_r`` and, chunk by chunk,
``sum_r q_r = q_j + (s_j - q_j)``, so ``sum_r acc_r = P·out + sum_r residual_r``.

Volume: ``2·(P-1)/P·W`` words per rank per step with ``W = n_pad/32 + n_pad/block``; with the
4-byte flag allreduce. No host read: every size depends on n, P and ``block`` only.
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ._sparse import pack_bits, unpack_bits
from . import schedule as S
from .base import Algorithm

__all__ = ["OneBit"]


def _layout(n: int, P: int, block: int) -> Tuple[int, int]:
    """(chunk entries, words of one packed chunk): chunks of whole blocks, P of them >= n."""
    blocks = -(-n // (P * block))
    chunk = blocks * block
    return chunk, chunk // 32 + blocks


def compress(x: torch.Tensor, block: int, rms: bool = False) -> Tuple[torch.Tensor, torch.Tensor]:
    """``x`` [rows, chunk] fp32 -> (packed int32 [rows, words], ``q`` = the decoded values)."""
    rows, chunk = x.shape
    blocks = x.view(rows, chunk // block, block)
    scale = (blocks.square().mean(dim=2, keepdim=True).sqrt() if rms
             else blocks.abs().mean(dim=2, keepdim=True))
    pos = blocks >= 0
    q = torch.where(pos, scale, -scale).view(rows, chunk)
    bits = pack_bits(pos.reshape(-1)).view(rows, chunk // 32)
    msg = torch.cat([bits, scale.view(rows, -1).contiguous().view(torch.int32)], dim=1)
    return msg, q


def decompress(msg: torch.Tensor, chunk: int, block: int) -> torch.Tensor:
    """Inverse of :func:`compress`'s message: [rows, words] int32 -> [rows, chunk] fp32."""
    rows = msg.shape[0]
    bits = unpack_bits(msg[:, :chunk // 32].reshape(-1), rows * chunk).view(rows, -1, block)
    scale = msg[:, chunk // 32:].contiguous().view(torch.float32).view(rows, -1, 1)
    return torch.where(bits, scale, -scale).view(rows, chunk)


class OneBit(Algorithm):
    name = "onebit"
    OPTIONS = {"block": 512, "rms": False}

    def __init__(self, numel: int, comm, density: float = 0.01, **kwargs) -> None:
        super().__init__(numel, comm, density, **kwargs)
        block = self.opts["block"]
        if isinstance(block, bool) or not isinstance(block, int) or block < 32 or block % 32:
            raise ValueError(f"onebit: block must be a multiple of 32 (>= 32), got {block!r}")
        self.block = block
        self.chunk, self.words = _layout(numel, self.P, block)

    @classmethod
    def volume_bound_bytes(cls, n: int, k: int, P: int, **opts) -> int:
        """Bytes one rank sends per step (exact, without the 4-byte non-finite flag)."""
        _, words = _layout(n, P, opts.get("block", cls.OPTIONS["block"]))
        return 0 if P <= 1 else 2 * (P - 1) * 4 * words

    @classmethod
    def schedule(cls, n: int, k: int, P: int, **options) -> List[S.CollectiveSpec]:
        """One steady step: the flag allreduce, an alltoall of P packed chunks, an allgather of
        one packed chunk."""
        o, specs, whole = S.step_start(cls, n, k, P, options)
        if whole:
            return specs
        _, words = _layout(n, P, o["block"])
        return specs + [S.alltoall(4 * P * words, P), S.allgather(4 * words, P)]

    def step(self, grad: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        n, P, chunk, block = self.numel, self.P, self.chunk, self.block
        x = torch.zeros(P * chunk, dtype=torch.float32, device=out.device)
        x[:n] = self.accumulate(grad)
        msg, q = compress(x.view(P, chunk), block, self.opts["rms"])
        err = x.view(P, chunk) - q
        mine = slice(self.rank, self.rank + 1)
        if P > 1:
            got = torch.empty_like(msg)
            self.comm.alltoall(got, msg)
            s = decompress(got, chunk, block)
            total = s[0].clone()
            for r in range(1, P):                    # rank order: one fixed rounding
                total += s[r]
            owner_msg, owner_q = compress(total.view(1, chunk), block, self.opts["rms"])
            err[mine] += total.view(1, chunk) - owner_q
            everyone = torch.empty(P * self.words, dtype=torch.int32, device=out.device)
            self.comm.allgather(everyone, owner_msg.view(-1))
            q_all = decompress(everyone.view(P, self.words), chunk, block)
        else:
            q_all = q
        out.copy_(q_all.view(-1)[:n]).div_(P)
        self.commit_residual(err.view(-1)[:n], nonfinite)
        self.stats.update(local_selected=n, global_selected=n, overflow=0)
