"""The communication's share of a step: each call of an algorithm's own schedule
(``Algorithm.schedule``: every call of a step with its bytes, as ``bytes_sent`` counts them, and
rounds; tested against recorded traffic) priced on a network of per-GPU bandwidth β (bytes/s,
each direction) and per-message latency α (the formula of each kind of call is in the note
linked below).

The calls of a step run one after the other (no overlap between them); the time of the rank the
step waits for is taken (``schedule(rank=None)``).

Measured why: docs/research/design-notes.md, ``oktopk_triton/planning/``.
"""
from __future__ import annotations

from typing import Tuple

from ..algorithms._sparse import _log2ceil
from .network import Network


def spec_time(spec, P: int, net: Network) -> Tuple[float, str]:
    """(seconds, the collective algorithm priced) of one call (see the module docstring)."""
    a, B = net.latency, net.bandwidth
    if P <= 1:
        return 0.0, "local"
    if spec.kind == "allreduce":
        ring = 2 * (P - 1) * a + spec.bytes_per_rank / B
        b = spec.bytes_per_rank * P / (2.0 * (P - 1))       # the message itself
        tree = 2 * _log2ceil(P) * (a + b / B)
        return (ring, "ring") if ring <= tree else (tree, "tree")
    if spec.kind == "allgather":
        return (P - 1) * a + spec.bytes_per_rank / B, "ring"
    if spec.kind == "alltoall":
        return (P - 1) * a + spec.bytes_per_rank / B, "pairwise"
    if spec.kind == "broadcast":
        b = spec.bytes_per_rank
        chain = (P - 1) * a + b / B
        tree = _log2ceil(P) * (a + b / B)
        return (chain, "chain") if chain <= tree else (tree, "binomial")
    if spec.kind == "send_recv":
        return spec.rounds * a + max(spec.bytes_per_rank, spec.received) / B, "p2p"
    raise ValueError(f"unknown collective kind {spec.kind!r}")


def comm_time(specs, P: int, net: Network) -> float:
    return sum(spec_time(s, P, net)[0] for s in specs)


def _fit_coefficients(spec, P: int, net: Network) -> Tuple[float, float]:
    """(latency count, bytes on the link) of the branch ``spec_time`` chose: time = c·α + b/β."""
    _, how = spec_time(spec, P, net)
    if spec.kind == "allreduce":
        if how == "ring":
            return 2 * (P - 1), spec.bytes_per_rank
        b = spec.bytes_per_rank * P / (2.0 * (P - 1))
        return 2 * _log2ceil(P), 2 * _log2ceil(P) * b
    if spec.kind in ("allgather", "alltoall"):
        return P - 1, spec.bytes_per_rank
    if spec.kind == "broadcast":
        if how == "chain":
            return P - 1, spec.bytes_per_rank
        return _log2ceil(P), _log2ceil(P) * spec.bytes_per_rank
    return spec.rounds, max(spec.bytes_per_rank, spec.received)
