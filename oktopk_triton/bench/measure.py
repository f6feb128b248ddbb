"""What every benchmark measures the same way: a checksum of a tensor's bits (are the replicas
equal?) and the step times of ranks that run together (a step ends when its slowest rank does).
"""
from __future__ import annotations

from typing import Any, Dict, List, Sequence


def checksum(t) -> str:
    """A checksum of ``t``'s bit pattern computed where ``t`` lives (one 16-byte result crosses
    to the host): the sum of the words and a position-weighted sum, both mod 2^64. Equal on two
    ranks iff (up to a 2^-64-ish collision) their tensors are bitwise equal."""
    import torch
    flat = t.detach().contiguous().reshape(-1)
    words = flat.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[
        flat.element_size()])
    s1 = s2 = 0
    chunk = 1 << 24
    for start in range(0, words.numel(), chunk):
        w = words[start:start + chunk].to(torch.int64)
        idx = torch.arange(start, start + w.numel(), device=w.device, dtype=torch.int64)
        weight = (idx * 2654435761) % 2147483647 + 1
        s1 += int(w.sum())
        s2 += int((w * weight).sum())  # int64 products wrap: the same on every rank
    m = (1 << 64) - 1
    return f"{s1 & m:016x}{s2 & m:016x}"


def params_checksum(params) -> str:
    """:func:`checksum` of the parameters' fp32 values, flattened in order."""
    import torch
    return checksum(torch.cat([p.detach().reshape(-1).float() for p in params]))


def replicas_identical(model) -> bool:
    """Whether every rank of the default process group holds bitwise the same parameters."""
    import torch.distributed as dist
    mine = params_checksum(model.parameters())
    every: List[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    return all(x == mine for x in every)


def step_stats(per_rank_times: Sequence[Sequence[float]], timed: Sequence[int]
               ) -> Dict[str, Any]:
    """Steps of ranks that started together: each step's time is its slowest rank's
    (``step_s``, seconds, every step); ``ms_mean`` / ``ms_min`` / ``ms_median`` and the spread
    ``ms_p25`` / ``ms_p75`` (linear interpolation between order statistics) over the ``timed``
    steps."""
    steps = len(per_rank_times[0])
    step_s = [max(r[t] for r in per_rank_times) for t in range(steps)]
    ms = sorted(1e3 * step_s[t] for t in timed)
    return {"step_s": step_s, "ms_mean": sum(ms) / len(ms), "ms_min": ms[0],
            "ms_median": quantile(ms, 0.5), "ms_p25": quantile(ms, 0.25),
            "ms_p75": quantile(ms, 0.75)}


def quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile of ascending values, interpolating linearly between neighbours (numpy's
    default): the median of an even count is the mean of the middle two."""
    pos = q * (len(sorted_values) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)
