"""What both modes of the DDP hook do with a set of parameters: reduce them as one vector in
the canonical order, holding out those this rank did not use (their residual and gradient set
aside and put back after the step, so the step offers nothing of them).
"""
from typing import Any, Dict, List, Tuple

import torch

__all__ = ["reduce_members", "settle", "unused", "hold_out", "put_back"]


def unused(state: Any, members: List[int],
            grads: Dict[int, torch.Tensor]) -> List[int]:
    """Positions in ``members`` of the parameters this rank did not use since the last
    synchronised backward. Seen by the post-accumulate-grad hooks; in the first iteration an
    instance sees (hooks registered during it), a gradient slot that is exactly zero counts as
    unused (one host read, that iteration only: holding out a used parameter is always safe)."""
    if state._seen > 0:
        return [i for i, c in enumerate(members) if c not in state._used]
    nonzero = torch.stack([grads[c].ne(0).any() for c in members]).tolist()
    return [i for i, nz in enumerate(nonzero) if not nz]


def hold_out(red, flat: torch.Tensor, spans: List[Tuple[int, int]]):
    """Set aside what ``red`` owes the entries ``spans`` ((offset, length) in ``flat``), and
    their gradient slots, so the step offers nothing of them (acc = 0 there: never selected)."""
    take = [(o, n, red.residual[o:o + n].clone(),
             None if red.velocity is None else red.velocity[o:o + n].clone(),
             flat[o:o + n].float()) for o, n in spans]
    for o, n, *_ in take:
        red.residual[o:o + n] = 0
        if red.velocity is not None:
            red.velocity[o:o + n] = 0
    flat_held = flat.clone()
    for o, n, *_ in take:
        flat_held[o:o + n] = 0
    scale = None if red.loss_scale is None else red.loss_scale.clone()
    return take, scale, flat_held


def put_back(red, held) -> None:
    """Return what :func:`_hold_out` set aside: the residual and velocity (in the loss scale the
    step moved them to) plus the gradient slot (unless the step was non-finite, when every
    residual stays as it was)."""
    take, scale, _ = held
    ratio = None
    if scale is not None and red.loss_scale is not None:
        ratio = red.loss_scale / scale
    nonfinite = red.stats.get("nonfinite")
    for o, n, res, vel, g in take:
        if ratio is not None:
            res = res * ratio
            vel = None if vel is None else vel * ratio
        if isinstance(nonfinite, torch.Tensor):
            g = torch.where(nonfinite > 0, torch.zeros_like(g), g)
        red.residual[o:o + n] += res + g
        if vel is not None:
            red.velocity[o:o + n] += vel


def reduce_members(state: Any, key: int, members: List[int],
            grads: Dict[int, torch.Tensor]) -> None:
    """Reduce the parameters ``members`` (canonical indices) as one vector in canonical order
    with reducer ``key``; the result is written back into each parameter's gradient view.
    Parameters this rank did not use are held out (see :func:`unused`)."""
    flat = torch.cat([grads[c] for c in members])
    red = state.reducer(key, flat)
    unused_here = unused(state, members, grads)
    held = None
    if unused_here:
        offs, off = [], 0
        for c in members:
            offs.append(off)
            off += grads[c].numel()
        held = hold_out(red, flat, [(offs[i], grads[members[i]].numel()) for i in unused_here])
        flat = held[2]
        state._iter_held += len(unused_here)
    out = red(flat, scale=state._scale())
    if held is not None:
        put_back(red, held)
    state._iter_bytes += int(red.stats.get("bytes_sent", 0))
    off = 0
    for c in members:
        g = grads[c]
        g.copy_(out[off:off + g.numel()])
        off += g.numel()


def settle(pending: list, error: BaseException) -> None:
    for _, f, _ in pending:
        if not f.done():
            f.set_exception(error)
