"""TopkA: allgather of every rank's local top-k, each rank sums them all (docs/algorithms.md §6).

Per step, on every rank:

1. ``acc = residual + grad``;
2. the exact local top-k of ``|acc|`` (ties broken by index, :func:`._sparse.topk_entries`):
   exactly ``k`` entries, sorted by index;
3. one allgather of a fixed-size int32 message of ``2k`` words (k indices, then the k fp32 value
   bit patterns; no header: the count is always k);
4. ``out = (sum of the P sets, added source by source in rank order 0..P-1) / P`` -- the same
   operations on the same data on every rank, hence bitwise identical;
5. ``residual = acc`` with the k sent entries zeroed (every sent entry is in ``out``).

Volume ``2k(P-1)`` words per rank per step, exactly (plus the base class's 4-byte non-finite
flag allreduce). Output up to ``P·k`` nonzeros. No host read: the sizes depend on n, k, P only.

``wire_format="compact"`` (docs/algorithms.md §9): the message is ``ceil(n/65536)`` chunk counts
(the indices are global) and ``k`` words, ``(ceil(n/65536) + k)(P-1)`` words in all; every
rank sums the same bf16 values, and the sender keeps ``acc - bf16(acc)`` of its k entries.
``"q2"`` / ``"q4"``: the same with 2- or 4-bit values and two fp32 scales per chunk
(``3·ceil(n/65536) + ceil(k/2) + ceil(k·b/32)`` words); the sender keeps ``acc - q(acc)``.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from .. import kernels as K
from . import _wire as W
from ._sparse import pack_entries, topk_entries, unpack_entries
from . import schedule as S
from .base import Algorithm
from ..checks import BACKEND
from .description import Description, Option

__all__ = ["TopkA"]


DESCRIPTION = Description(
    name="topka", config="TopkA", display="TopkA",
    advice="""TopkA: every rank's top-k allgathered, summed on every rank. Advice: 1. ``backend``
    (default ``"auto"``): where the kernels run, ``"triton"`` or ``"torch"``.""",
    options={"backend": Option("auto", *BACKEND, annotation=str)},
    volume=lambda n, k, P, **o: (2.0 * k * (P - 1),) * 2,           # an allgather of k entries
    # the checks (8); acc (12); topk_entries: the int64 keys in one kernel
    # (kernels.magnitude_keys: read 4, write 8; the torch ops before it moved 92), a top-k of n
    # int64 keys (2 fp32 units); out /= P (8); commit (20)
    passes=(4 + 4 + 12 + 12 + 8 + 20, 0, 2),
    # the P gathered sets scatter-added into out (≈ 20 B per entry: int64 index, value, RMW)
    entry_work=lambda k, P: (1.0 * k, 20.0 * P * k))


class TopkA(Algorithm):
    description = DESCRIPTION
    compact_refusal = None     # global indices: chunk counts over all of n
    quantized_refusal = None   # every sent entry is delivered: the sender keeps acc - q(acc)

    @classmethod
    def volume_bound_bytes(cls, n: int, k: int, P: int, **opts) -> int:
        """Bytes one rank sends per step (exact, without the 4-byte non-finite flag)."""
        return 0 if P <= 1 else cls._msg_bytes(n, k, opts.get("wire_format")) * (P - 1)

    @staticmethod
    def _msg_bytes(n: int, k: int, wire_format) -> int:
        return 4 * (W.row_words(k, n, fmt=wire_format) if W.packed(wire_format) else 2 * k)

    @classmethod
    def schedule(cls, n: int, k: int, P: int, **options) -> List[S.CollectiveSpec]:
        """One steady step: the flag allreduce, one allgather of 2k int32 words (compact:
        ``ceil(n/65536) + k``)."""
        o = S.resolve_options(cls, n, k, P, options)
        if k >= n:
            return S.dense_step_specs(n, P, o)
        msg = cls._msg_bytes(n, k, o["wire_format"])
        return S.flag_specs(P, o) + ([S.allgather(msg, P)] if P > 1 else [])

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.backend = self.kernel_backend()
        # every source sends k entries: the counts kernels.scatter_add takes
        self._counts = torch.full((self.P,), self.k, dtype=torch.int32, device=self.device)

    def step(self, grad: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        k, P = self.k, self.P
        acc = self.accumulate(grad)
        idx, val = topk_entries(acc, k, self.backend)
        if self.compact:
            fmt = self.wire_format
            msg, wire = W.encode(idx, val, None, self.numel, fmt=fmt, return_wire=True,
                                 order="ascending")    # topk_entries: sorted by index
            allmsg = torch.empty(P, msg.shape[1], dtype=torch.int32, device=acc.device)
            if P > 1:
                self.comm.allgather(allmsg, msg)
            else:
                allmsg.copy_(msg)
            all_idx, all_val, _ = W.decode(allmsg, k, self.numel, fmt=fmt)
        elif P > 1:
            msg = pack_entries(idx, val)
            allmsg = torch.empty(P * 2 * k, dtype=torch.int32, device=acc.device)
            self.comm.allgather(allmsg, msg)
            _, all_idx, all_val = unpack_entries(allmsg.view(P, 2 * k), k)
        else:
            all_idx, all_val = idx.view(1, k), val.view(1, k)
        K.scatter_add(out, all_idx, all_val, self._counts, backend=self.backend)  # rank order
        out.div_(P)
        # every sent entry is in out; what the packed wire dropped (rounding, quantization)
        # stays owed
        acc.index_copy_(0, idx.to(torch.int64), val - wire.view(-1) if self.compact
                        else torch.zeros_like(val))
        self.mark_delivered(idx)
        self.commit_residual(acc, nonfinite)
        self.stats.update(local_selected=(val != 0).sum(), global_selected=(out != 0).sum(),
                          overflow=0)
