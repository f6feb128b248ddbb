"""Reusable checks of the step contract (docs/algorithms.md §1) for every algorithm.

Usage (from any test module in ``tests/``)::

    from conservation import (run_steps, assert_conservation, assert_bitwise_agreement,
                              student_t, moving_hotspots, one_big_rank, mixed)

    res = run_steps("topka", P=4, n=4000, steps=200, density=0.01,
                    grad_fn=mixed(seed=0), capacity_slack=1.0)
    assert_conservation(res)           # sum_p acc_p == P*out + sum_p residual_p' every step
    assert_bitwise_agreement(res)      # out identical on every rank, every step
    res.stat("global_selected")        # [steps][P] python numbers

API
---
``run_steps(algorithm, P, n, steps, density, grad_fn, *, dtype=torch.float32, nonfinite=None,
check_finite="skip", timeout=120.0, on_step=None, **options) -> RunResult``
    Builds ``get_algorithm(algorithm)(n, comm, density, check_finite=..., **options)`` on every
    rank of a ``LocalCluster(P)`` (threads, CPU) and runs ``steps`` steps. ``algorithm`` may also
    be a class (an ``Algorithm`` subclass) or a factory ``f(comm) -> Algorithm``.
    ``grad_fn(rank, step, n) -> Tensor[n]`` gives rank ``rank``'s gradient at ``step`` (any float
    dtype, CPU; cast to ``dtype``); it must be deterministic. ``nonfinite={step: rank}`` puts a
    NaN into that rank's gradient at that step. ``on_step(comm, alg, step, out)`` is called on
    every rank after every step (e.g. to save a state_dict).
``RunResult`` fields (all on CPU):
    ``acc_sums[t]``      fp64 [n]: sum over ranks of ``residual_before + grad`` (exact in fp64),
    ``acc_abs_sums[t]``  fp64 [n]: sum over ranks of ``|acc|`` (the magnitude scale),
    ``outs[t][p]``       the ``out`` of rank p at step t (the algorithm's dtype, flat),
    ``residual_sums[t]`` fp64 [n]: sum over ranks of the residual after step t,
    ``residuals[p]``     fp32 [n]: rank p's final residual,
    ``stats[t][p]``      dict: rank p's ``stats`` after step t, 0-dim tensors turned into numbers,
    ``unchanged[t]``     bool: every residual bitwise unchanged by step t (for non-finite steps),
    ``P``, ``n``, ``k``, ``algs`` (the algorithm objects by rank, after the run).
    ``res.stat(key)`` -> [steps][P] list; ``res.stat_array(key)`` -> a float64 tensor [steps, P].
``assert_conservation(res, rtol=None, steps=None)``
    On every step whose out is finite:
    ``|acc_sum - (P*out + residual_sum)| <= rtol * (acc_abs_sum + P*|out|) + 1e-30``
    elementwise, with ``rtol`` default ``(P + 4) * eps(out dtype)`` (fp32 sums of P terms, a
    division and a multiplication by P, and the accumulation ``residual + grad``). On non-finite
    steps it asserts instead that out is non-finite on every rank and that every
    residual is bitwise unchanged.
``assert_bitwise_agreement(res_or_outs)``
    ``outs[t][p]`` bitwise equal (NaN payloads compared as bits) to ``outs[t][0]`` for all t, p.

Gradient generators (each returns ``grad_fn(rank, step, n)``; deterministic in (seed, rank,
step)):
    ``student_t(seed, df=3.0, scale=1.0)``      heavy tails (Student-t),
    ``moving_hotspots(seed, spots=3, width=0.02, speed=0.01, hot=20.0)``  small Gaussian noise
        plus a few hot windows (``width`` × n wide) that move by ``speed`` × n per step,
    ``one_big_rank(seed, big=0, factor=100.0, base=None)``  rank ``big``'s gradient ×factor,
    ``mixed(seed)``   Student-t + moving hot spots + rank 0 ×30 (the default workload).
"""
from __future__ import annotations

import contextlib
import io
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch

from oktopk_triton.algorithms import get_algorithm
from oktopk_triton.comm.local import LocalCluster

__all__ = ["RunResult", "run_steps", "assert_conservation", "assert_bitwise_agreement",
           "student_t", "moving_hotspots", "one_big_rank", "mixed", "to_number",
           "PS", "FLAG_BYTES", "flag_bytes", "first_step_body"]

# world sizes the per-algorithm suites run (odd and non-powers of two included)
PS = [1, 2, 3, 5, 6, 8]
# the base class's 4-byte non-finite flag allreduce: 2(P-1)/P * 4 <= 8 bytes per rank per step
FLAG_BYTES = 8


def flag_bytes(P: int) -> int:
    """The exact bytes per rank of that flag allreduce (check_finite='skip')."""
    return 2 * (P - 1) * 4 // P if P > 1 else 0



def to_number(v: Any) -> Any:
    if isinstance(v, torch.Tensor) and v.numel() == 1:
        return v.item()
    if isinstance(v, torch.Tensor):
        return v.detach().cpu().clone()
    return v


@dataclass
class RunResult:
    P: int
    n: int
    k: int
    acc_sums: List[torch.Tensor] = field(default_factory=list)
    acc_abs_sums: List[torch.Tensor] = field(default_factory=list)
    outs: List[List[torch.Tensor]] = field(default_factory=list)
    residual_sums: List[torch.Tensor] = field(default_factory=list)
    residuals: List[torch.Tensor] = field(default_factory=list)
    stats: List[List[Dict[str, Any]]] = field(default_factory=list)
    unchanged: List[bool] = field(default_factory=list)
    algs: List[Any] = field(default_factory=list)

    def stat(self, key: str) -> List[List[Any]]:
        return [[s.get(key) for s in row] for row in self.stats]

    def stat_array(self, key: str) -> torch.Tensor:
        return torch.tensor([[float(x) for x in row] for row in self.stat(key)],
                            dtype=torch.float64)


def _make(algorithm: Any, comm, n: int, density: float, check_finite: str, options: dict):
    if isinstance(algorithm, str):
        return get_algorithm(algorithm)(n, comm, density, check_finite=check_finite, **options)
    if isinstance(algorithm, type):
        return algorithm(n, comm, density, check_finite=check_finite, **options)
    return algorithm(comm)


def _rank_body(comm, algorithm, n, steps, density, grad_fn, dtype, nonfinite, check_finite,
               on_step, options):
    alg = _make(algorithm, comm, n, density, check_finite, options)
    accs, outs, res, stats, unchanged = [], [], [], [], []
    for t in range(steps):
        g = grad_fn(comm.rank, t, n).reshape(-1).to(dtype)
        if nonfinite and nonfinite.get(t) == comm.rank:
            g = g.clone()
            g[n // 2] = float("nan")
        before = alg.residual.detach().clone()
        velocity = getattr(alg, "velocity", None)
        if velocity is not None:
            # with momentum correction the reducer accumulates its velocity u = m·u + g, not g
            # (formed here as the reducer forms it: the velocity after the step may be masked)
            u = velocity * alg.momentum + g.reshape(-1).float()   # two roundings, no FMA
        out = alg(g)
        accs.append(before.double() + (g.double() if velocity is None else u.double()))
        outs.append(out.detach().reshape(-1).clone())
        after = alg.residual.detach().clone()
        res.append(after.double())
        unchanged.append(bool(torch.equal(before.view(torch.int32), after.view(torch.int32))))
        stats.append({k: to_number(v) for k, v in alg.stats.items()})
        if on_step is not None:
            on_step(comm, alg, t, out)
    return accs, outs, res, stats, unchanged, alg


def run_steps(algorithm: Any, P: int, n: int, steps: int, density: float,
              grad_fn: Callable[[int, int, int], torch.Tensor], *, dtype=torch.float32,
              nonfinite: Optional[Dict[int, int]] = None, check_finite: str = "skip",
              timeout: float = 120.0, on_step=None, **options: Any) -> RunResult:
    """Run ``steps`` steps of ``algorithm`` on a ``LocalCluster(P)``; see the module docstring."""
    per_rank = LocalCluster(P, timeout=timeout).run(
        _rank_body, algorithm, n, steps, density, grad_fn, dtype, nonfinite, check_finite,
        on_step, options)
    algs = [r[5] for r in per_rank]
    res = RunResult(P=P, n=n, k=algs[0].k, algs=algs)
    for t in range(steps):
        res.acc_sums.append(sum(r[0][t] for r in per_rank))
        res.acc_abs_sums.append(sum(r[0][t].abs() for r in per_rank))
        res.outs.append([r[1][t] for r in per_rank])
        res.residual_sums.append(sum(r[2][t] for r in per_rank))
        res.stats.append([r[3][t] for r in per_rank])
        res.unchanged.append(all(r[4][t] for r in per_rank))
    res.residuals = [a.residual.detach().clone() for a in algs]
    return res


def assert_conservation(res: RunResult, rtol: Optional[float] = None,
                        steps: Optional[range] = None) -> None:
    """``sum_p acc_p == P*out + sum_p residual_p'`` on every finite step (see module docstring)."""
    P = res.P
    for t in (steps if steps is not None else range(len(res.outs))):
        out = res.outs[t][0]
        if not bool(torch.isfinite(out).all()):
            assert all(not bool(torch.isfinite(o).all()) for o in res.outs[t]), \
                f"step {t}: out non-finite on some ranks only"
            assert res.unchanged[t], f"step {t}: non-finite step changed a residual"
            continue
        eps = torch.finfo(out.dtype).eps
        tol_r = rtol if rtol is not None else (P + 4) * eps
        o = out.double()
        lhs = res.acc_sums[t]
        rhs = P * o + res.residual_sums[t]
        err = (lhs - rhs).abs()
        bound = tol_r * (res.acc_abs_sums[t] + P * o.abs()) + 1e-30
        bad = err > bound
        if bool(bad.any()):
            i = int(bad.nonzero()[0])
            raise AssertionError(
                f"conservation broken at step {t} (P={P}): {int(bad.sum())} of {res.n} entries; "
                f"first at {i}: sum acc={lhs[i].item()!r}, P*out={P * o[i].item()!r}, "
                f"sum residual={res.residual_sums[t][i].item()!r}, err={err[i].item():.3g} > "
                f"bound {bound[i].item():.3g}")


def _bits(t: torch.Tensor) -> torch.Tensor:
    if t.element_size() == 4:
        return t.contiguous().view(torch.int32)
    if t.element_size() == 2:
        return t.contiguous().view(torch.int16)
    return t.contiguous().view(torch.int64)


def assert_bitwise_agreement(res_or_outs: Any) -> None:
    """``out`` bitwise identical on every rank at every step."""
    outs = res_or_outs.outs if isinstance(res_or_outs, RunResult) else res_or_outs
    for t, row in enumerate(outs):
        ref = _bits(row[0])
        for p, o in enumerate(row[1:], 1):
            if not torch.equal(ref, _bits(o)):
                d = int((ref != _bits(o)).sum())
                raise AssertionError(f"step {t}: out of rank {p} differs from rank 0 "
                                     f"in {d} entries")


# -- structured gradients --------------------------------------------------------------------------
def _gen(seed: int, rank: int, step: int, salt: int = 0) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + rank * 7919 + step * 104_729 + salt * 15_485_863) % (2 ** 62))
    return g


def student_t(seed: int = 0, df: float = 3.0, scale: float = 1.0):
    """Heavy-tailed gradients: Student-t with ``df`` degrees of freedom (z / sqrt(chi2/df))."""
    def fn(rank: int, step: int, n: int) -> torch.Tensor:
        g = _gen(seed, rank, step, 1)
        z = torch.randn(n, generator=g)
        chi2 = torch.randn(n, int(df), generator=g).pow(2).sum(1) if df == int(df) else \
            torch.distributions.Chi2(df).sample((n,))
        return (z / torch.sqrt(chi2 / df).clamp_min(1e-6) * scale).float()
    return fn


def moving_hotspots(seed: int = 0, spots: int = 3, width: float = 0.02, speed: float = 0.01,
                    hot: float = 20.0, noise: float = 1.0):
    """Gaussian noise plus ``spots`` hot windows that drift by ``speed * n`` per step."""
    def fn(rank: int, step: int, n: int) -> torch.Tensor:
        g = _gen(seed, rank, step, 2)
        x = torch.randn(n, generator=g) * noise
        w = max(1, int(width * n))
        for s in range(spots):
            start = int((s / spots + speed * step) * n) % n
            idx = (torch.arange(w) + start) % n
            x[idx] += hot * torch.randn(w, generator=g)
        return x
    return fn


def one_big_rank(seed: int = 0, big: int = 0, factor: float = 100.0, base=None):
    """``base`` (default Student-t) with rank ``big`` scaled by ``factor``."""
    base = base if base is not None else student_t(seed)

    def fn(rank: int, step: int, n: int) -> torch.Tensor:
        x = base(rank, step, n)
        return x * factor if rank == big else x
    return fn


def mixed(seed: int = 0, big: int = 0, factor: float = 30.0):
    """Student-t + moving hot spots, rank ``big`` ×``factor``: the default hard workload."""
    t = student_t(seed)
    h = moving_hotspots(seed + 1, hot=10.0, noise=0.0)

    def fn(rank: int, step: int, n: int) -> torch.Tensor:
        x = t(rank, step, n) + h(rank, step, n)
        return x * factor if rank == big else x
    return fn


def first_step_body(comm, name, n, density, seed):
    """One step of ``name`` from a zero residual on a seeded gradient: (grad, out, residual,
    bytes sent, k); a ``LocalCluster.run`` body."""
    g = torch.Generator().manual_seed(seed * 100 + comm.rank)
    grad = torch.randn(n, generator=g) * (1 + comm.rank)
    a = get_algorithm(name)(n, comm, density)
    out = a(grad)
    return grad, out, a.residual.clone(), a.stats["bytes_sent"], a.k


@contextlib.contextmanager
def host_syncs_raise(comm):
    """CUDA: the body runs with ``torch.cuda.set_sync_debug_mode("error")`` on rank 0 (any host
    synchronisation there raises), entered and left by every rank together (barriers), the mode
    restored also when the body raises."""
    torch.cuda.synchronize()
    comm.barrier()
    if comm.rank == 0:
        torch.cuda.set_sync_debug_mode("error")
    comm.barrier()
    try:
        yield
    finally:
        if comm.rank == 0:
            torch.cuda.set_sync_debug_mode("default")
    comm.barrier()
    torch.cuda.synchronize()


def steady_steps_never_sync(alg, comm, n: int) -> bool:
    """CUDA: two steps (calibration and one steady step, syncs allowed), then three steady steps
    under :func:`host_syncs_raise`. Returns True when none synchronised."""
    fn = mixed(2)
    for t in range(2):                         # calibration + one steady step, syncs allowed
        alg(fn(comm.rank, t, n).to(comm.device))
    grads = [fn(comm.rank, t, n).to(comm.device) for t in range(2, 5)]
    with host_syncs_raise(comm):
        for g in grads:
            alg(g)
    return True


def toy_model(seed: int = 3) -> torch.nn.Module:
    """A small MLP (8 -> 16 -> 4) with the same weights on every rank for one seed. LocalCluster
    ranks are threads and ``torch.manual_seed`` seeds the one process-wide generator, so the
    weights come from a generator of our own (else concurrent ranks interleave their draws)."""
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def flat(ts) -> torch.Tensor:
    """The tensors' values, detached, one after another in one vector."""
    return torch.cat([t.detach().reshape(-1) for t in ts])


def toy_calls(rank: int, model, opt, sar, first: int, last: int, reduce=None) -> None:
    """Calls ``first..last-1`` of a deterministic toy loop on ``rank``: batch ``t`` is the t-th
    draw of rank's own generator (earlier batches are drawn and skipped, so a resumed run sees
    the same data), a squared-output loss, backward, then ``reduce(sar, opt)`` (default
    ``sar.reduce_updates(opt)``)."""
    gen = torch.Generator().manual_seed(100 + rank)
    for t in range(last):
        x = torch.randn(6, 8, generator=gen)
        if t < first:
            continue
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        if reduce is None:
            sar.reduce_updates(opt)
        else:
            reduce(sar, opt)


def whole_and_resumed(make, run, calls: int, cut: int, at_load=None):
    """``(whole, resumed, seen)``: ``make()``'s (model, optimizer, reducer) run for ``calls``
    calls in one go, and fresh ones loaded from a save (through bytes, ``weights_only``) of a
    run cut after ``cut`` calls, then run on to ``calls``; ``run(model, opt, sar, first, last)``
    runs calls ``first..last-1``; ``seen = at_load(resumed)`` right after the load."""
    whole = make()
    run(*whole, 0, calls)
    part = make()
    run(*part, 0, cut)
    blob = io.BytesIO()
    torch.save({"m": part[0].state_dict(), "o": part[1].state_dict(), "s": part[2].state_dict()},
               blob)
    ck = torch.load(io.BytesIO(blob.getvalue()), weights_only=True)
    resumed = make()
    for obj, key in zip(resumed, "mos"):
        obj.load_state_dict(ck[key])
    seen = None if at_load is None else at_load(resumed)
    run(*resumed, cut, calls)
    return whole, resumed, seen


def continued_from_save(make, call, steps: int, cut: int):
    """``(a, outs, b, outs2)``: a reducer ``a = make()`` called for ``steps`` steps
    (``call(a, t)`` returns step t's output), its state saved before step ``cut`` (through
    bytes, ``weights_only``) and loaded into a fresh ``b = make()`` that runs steps
    ``cut..steps-1``."""
    a, outs, blob = make(), [], None
    for t in range(steps):
        if t == cut:
            buf = io.BytesIO()
            torch.save(a.state_dict(), buf)
            blob = buf.getvalue()
        outs.append(call(a, t))
    b = make()
    b.load_state_dict(torch.load(io.BytesIO(blob), weights_only=True))
    return a, outs, b, [call(b, t) for t in range(cut, steps)]


def torch_kernels(name: str) -> Dict[str, Any]:
    """The option that runs an algorithm's kernels through their torch references, for the
    algorithms that take one (their interpreted Triton paths cost minutes in whole-run tests and
    are compared with the references in tests/test_kernel_*.py and tests/test_oktopk.py)."""
    return {"backend": "torch"} if "backend" in get_algorithm(name).OPTIONS else {}
