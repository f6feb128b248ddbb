"""Gaussiank (Shi et al.): a threshold from a normal fit of ``acc``, then an allgather of
fixed-capacity slots (docs/algorithms.md §6).
Per step:

1. ``acc = residual + grad``; ``mu, sigma`` = mean and standard deviation of ``acc``;
   ``threshold = |mu| + z·sigma`` with ``z = Phi^-1(1 - density/2)`` (the two-sided normal
   quantile: under a normal fit, a fraction ``density`` of the entries has ``|acc| >= threshold``).
2. **Correction on the device** (the reference code instead loops on the host, reading the
   count back each time; here one kernel, ``kernels.gaussian_threshold``, two launches an
   iteration). ``iters`` fixed iterations (default 8), each one counting pass over
   ``acc``: a count below ``lo·k`` makes the threshold an upper bracket, above ``hi·k`` a lower
   bracket; the next threshold is the geometric mean of the brackets once both exist, else the
   threshold is divided by 4 (too few) or multiplied by 4 (too many) -- galloping, then
   bisection in log space; inside the band it stays put. No host read, no data-dependent sizes
   (and no early exit: the ``iters`` passes are always paid).
3. Select ``|acc| >= threshold`` (and ``acc != 0``), compact in ascending index order into a
   fixed capacity ``cap = ceil(slack·k)`` (default slack 1.5); entries past the capacity are not
   sent and stay in the residual (``stats["overflow"]``).
4. One allgather of an int32 message of ``2 + 2·cap`` words: ``[true count, 0][cap indices]
   [cap fp32 value bits]``; every rank adds the P sources in rank order 0..P-1 (bitwise identical
   everywhere) and divides by P.
5. ``residual = acc`` with the sent entries zeroed: conservation holds exactly.

Measured why: docs/research/design-notes.md, ``oktopk_triton/algorithms/gaussiank.py``.
"""
from __future__ import annotations

import math
from statistics import NormalDist
from typing import List, Optional, Tuple

import torch

from .. import kernels as K
from . import _wire as W
from ._sparse import pack_entries, unpack_entries
from . import schedule as S
from .base import Algorithm
from ..checks import BACKEND, at_least_one, number
from .description import Description, Option

__all__ = ["Gaussiank"]


def _volume(n: int, k: int, P: int, slack: float = 1.5, **o) -> Tuple[float, float]:
    """The allgather of fixed-capacity slots: ``2·ceil(slack·k)·(P-1)``."""
    v = 2.0 * int(math.ceil(float(slack) * k)) * (P - 1)
    return (v, v)


DESCRIPTION = Description(
    name="gaussiank", config="Gaussiank", display="Gaussiank",
    advice="""Gaussian-k: a threshold from a Gaussian fit of the accumulator, refined by a few
    counts, then an allgather. Advice:

    1. ``slack`` (default 1.5, >= 1): the message capacity in units of k.
    2. ``iters`` (default 8): refinement counts of the threshold.
    3. ``lo``, ``hi`` (defaults 0.75 and 1.25; ``0 < lo <= 1 <= hi``): the band of selected
       counts, in units of k, the refinement aims at.
    4. ``backend`` (default ``"auto"``): where the kernels run, ``"triton"`` or ``"torch"``.
    """,
    options={
        "slack": Option(1.5, at_least_one, ">= 1", annotation=float),
        "iters": Option(8, lambda x: isinstance(x, int) and x >= 0, "an int >= 0",
                        annotation=int),
        "lo": Option(0.75, lambda x: number(x) and 0.0 < x <= 1.0,
                     "in (0, 1] (0 < lo <= 1 <= hi)", annotation=float),
        "hi": Option(1.25, lambda x: number(x) and x >= 1.0, ">= 1 (0 < lo <= 1 <= hi)",
                     annotation=float),
        "backend": Option("auto", *BACKEND, annotation=str),
    },
    volume=_volume,
    # the checks (8); acc (12), std_mean (4), 8 counting passes (kernels.gaussian_threshold:
    # read 4 each; the torch ops before it: |acc| once, then >=, !=, &, sum, 14 each), the
    # selection (kernels.select_above: acc read twice, the kept mask written, 9; the mask and
    # compaction before it: 136), the sent entries zeroed in acc (9) and commit (20), out /= P (8)
    passes=(4 + 4 + 12 + 4 + 8 * 4 + 9 + 9 + 20 + 8, 0, 0),
    # the P gathered sets (1.5k capacity each) scatter-added into out
    entry_work=lambda k, P: (0.0, 20.0 * 1.5 * P * k))


class Gaussiank(Algorithm):
    description = DESCRIPTION
    HEADER = 2
    compact_refusal = None     # global indices: chunk counts over all of n

    @classmethod
    def _msg_words(cls, n: int, cap: int, wire_format) -> int:
        return W.row_words(cap, n, fmt=wire_format) if W.packed(wire_format) \
            else cls.HEADER + 2 * cap

    @classmethod
    def capacity(cls, k: int, n: int, slack: float = 1.5) -> int:
        return max(1, min(n, int(math.ceil(float(slack) * k))))

    @classmethod
    def volume_bound_bytes(cls, n: int, k: int, P: int, **opts) -> int:
        """Bytes one rank sends per step (exact, without the 4-byte non-finite flag)."""
        if P <= 1:
            return 0
        cap = cls.capacity(k, n, opts.get("slack", cls.OPTIONS["slack"]))
        return 4 * cls._msg_words(n, cap, opts.get("wire_format")) * (P - 1)

    @classmethod
    def schedule(cls, n: int, k: int, P: int, **options) -> List[S.CollectiveSpec]:
        """One steady step: the flag allreduce, one allgather of ``2 + 2·cap`` int32 words
        (``cap = ceil(slack·k)``; padding counts; compact: ``ceil(n/65536) + cap``)."""
        o = S.resolve_options(cls, n, k, P, options)
        if k >= n:
            return S.dense_step_specs(n, P, o)
        cap = cls.capacity(k, n, o["slack"])
        words = cls._msg_words(n, cap, o["wire_format"])
        return S.flag_specs(P, o) + ([S.allgather(4 * words, P)] if P > 1 else [])

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        o = self.opts          # checked by the base (oktopk_triton.config.Gaussiank's rules)
        self.backend = self.kernel_backend()
        self.cap = self.capacity(self.k, self.numel, o["slack"])
        dens = min(self.density, 1.0 - 1e-12)
        self.z = NormalDist().inv_cdf(1.0 - dens / 2.0)

    def threshold(self, acc: torch.Tensor) -> torch.Tensor:
        """Fitted and device-corrected threshold (0-dim fp32); see the module docstring. One
        kernel (``kernels.gaussian_threshold``): ``std_mean`` and ``1 + 2·iters`` launches."""
        k = float(self.k)
        return K.gaussian_threshold(acc, self.z, float(self.opts["lo"]) * k,
                                    float(self.opts["hi"]) * k, int(self.opts["iters"]),
                                    backend=self.backend)

    def step(self, grad: torch.Tensor, out: torch.Tensor,
             nonfinite: Optional[torch.Tensor]) -> None:
        P, cap, H = self.P, self.cap, self.HEADER
        acc = self.accumulate(grad)
        thr = self.threshold(acc)
        idx, val, count, kept = K.select_above(acc, thr, cap, backend=self.backend)
        if self.compact:
            msg = W.encode(idx, val, count, self.numel, order="ascending")   # ascending already
            allmsg = torch.empty(P, msg.shape[1], dtype=torch.int32, device=acc.device)
            if P > 1:
                self.comm.allgather(allmsg, msg)
            else:
                allmsg.copy_(msg)
            all_idx, all_val, counts = W.decode(allmsg, cap, self.numel)
        elif P > 1:
            header = torch.stack([count, torch.zeros_like(count)])
            msg = pack_entries(idx, val, header=header)
            allmsg = torch.empty(P * (H + 2 * cap), dtype=torch.int32, device=acc.device)
            self.comm.allgather(allmsg, msg)
            hdr, all_idx, all_val = unpack_entries(allmsg.view(P, H + 2 * cap), cap, header=H)
            counts = hdr[:, 0]
        else:
            all_idx, all_val, counts = idx.view(1, cap), val.view(1, cap), count.view(1)
        # sources in rank order, one launch each (no copy of out in and out, as torch needs)
        K.scatter_add(out, all_idx, all_val, counts, backend=self.backend)
        out.div_(P)
        # the compact wire's rounding stays owed
        self.commit_residual(torch.where(kept, W.bf16_rounding(acc), acc) if self.compact
                             else acc.masked_fill_(kept, 0.0), nonfinite)
        self.mark_delivered(kept)
        self.stats.update(local_selected=torch.clamp(count, max=cap),
                          global_selected=(out != 0).sum(),
                          overflow=torch.clamp(count - cap, min=0), threshold=thr,
                          selected_before_capacity=count)
