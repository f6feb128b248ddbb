"""The step contract (docs/algorithms.md §1), checked for EVERY registered algorithm.

Parametrized over ``("dense",) + SPARSE_ALGORITHMS``; an algorithm whose module is not present
yet is skipped (reason shown), any other import failure is a test failure.

* conservation ``sum_p acc_p == P*out + sum_p residual_p'`` over a few dozen steps of structured
  gradients (Student-t heavy tails + moving hot spots + rank 0 ×30: ``conservation.mixed``),
  P in 1, 2, 3, 5, 6, 8;
* ``out`` bitwise identical on every rank at every step;
* measured bytes per rank per step within the §6 formula
  (``oktopk_triton.algorithms._sparse.volume_formula_words``) times the algorithm's stated slack
  plus a header allowance, and within the algorithm's own ``volume_bound_bytes`` when it has one;
* bad inputs: density outside (0, 1], wrong length (both lengths named), int dtype, numel
  differing across ranks (raises on every rank);
* non-finite policy: a NaN on one rank -> out non-finite on every rank, every residual unchanged
  bit for bit, and the following steps conserve again;
* bf16 / fp16 gradients: out in the gradient's dtype, conservation in that precision;
* state_dict round trip (through ``torch.save``) continues bit for bit;
* gloo (3 processes, ``distutil.run_gloo``) gives the same outs and residuals as LocalCluster.
"""
from __future__ import annotations

import functools
import io
import math

import pytest
import torch

from conservation import (FLAG_BYTES, assert_bitwise_agreement, assert_conservation, mixed,
                          run_steps, torch_kernels)
from oktopk_triton.algorithms import SPARSE_ALGORITHMS, get_algorithm
from oktopk_triton.algorithms._sparse import volume_formula_words
from oktopk_triton.comm.local import LocalCluster

ALL = ("dense",) + tuple(SPARSE_ALGORITHMS)
PS = (1, 2, 3, 5, 6, 8)
N = 2000
DENSITY = 0.02
STEPS = 24

# Stated capacity slack over the §6 formula, per algorithm (1.0: the formula already holds with
# headers only). Ok-Topk's §6 bound "< 6k(P-1)/P" is for exact counts; its fixed capacities add
# slack (docs/algorithms.md §3).
SLACK = {"oktopk": 1.5}
HEADER_WORDS_PER_MESSAGE = 8


def messages_bound(P: int) -> int:
    lg = 0 if P <= 1 else (P - 1).bit_length()
    return 4 * P + 2 * lg + 4


def byte_bound(name: str, n: int, k: int, P: int, cls=None, **opts) -> int:
    """Bytes per rank per step: the §6 formula × slack + headers + the non-finite flag."""
    if P <= 1:
        return FLAG_BYTES
    words = volume_formula_words(name, n, k, P, **opts) * SLACK.get(name, 1.0)
    words += HEADER_WORDS_PER_MESSAGE * messages_bound(P)
    return int(math.ceil(4 * words)) + FLAG_BYTES


# Whole-run checks use the kernels' torch references (``torch_kernels``): Ok-Topk's and
# Gaussiank's kernels through the interpreter cost minutes per test here (bf16 Ok-Topk: 4 min);
# the interpreted kernels are compared with the torch path bit for bit in tests/test_oktopk.py,
# tests/test_kernel_gaussian.py and tests/test_kernel_*.py.
@functools.lru_cache(maxsize=None)
def _run(name: str, P: int):
    opts = torch_kernels(name)
    return run_steps(name, P, N, STEPS, DENSITY, mixed(seed=P), timeout=120.0, **opts)


# -- conservation, agreement, bytes --------------------------------------------------------------
# the cases that read _run share one worker (make test: --dist loadgroup), so each run is made
# once, not once per worker that got a case
@pytest.mark.xdist_group("algorithms_run")
@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("name", ALL)
def test_conservation_and_bitwise_agreement(name, P):
    res = _run(name, P)
    assert_bitwise_agreement(res)
    assert_conservation(res)
    for t in range(STEPS):
        assert bool(torch.isfinite(res.outs[t][0]).all()), f"step {t}: non-finite out"
    # something actually got through (the residual is not just swallowing everything)
    total_out = sum(o[0].double().abs().sum() for o in res.outs)
    assert total_out > 0


@pytest.mark.parametrize("name", ALL)
def test_warmup_steps_are_dense_then_sparse(name):
    """warmup_steps=3: steps 0-2 put every rank's whole acc into out (the exact average) and
    empty the residuals; the sparse steps that follow conserve and stay sparse."""
    P, W = 3, 3
    res = run_steps(name, P, N, W + 6, DENSITY, mixed(seed=11), warmup_steps=W,
                    **torch_kernels(name))
    assert_conservation(res)
    assert_bitwise_agreement(res)
    for t in range(W):
        torch.testing.assert_close(res.outs[t][0].double(), res.acc_sums[t].double() / P,
                                   rtol=1e-5, atol=1e-6)
        assert float(res.residual_sums[t].abs().max()) == 0.0
        assert all(bool(st["warmup"]) for st in res.stats[t])
    if name != "dense":
        for t in range(W, W + 6):
            assert not any(bool(st["warmup"]) for st in res.stats[t])
            assert int((res.outs[t][0] != 0).sum()) < N // 2, f"step {t} not sparse"
    with pytest.raises(ValueError, match="warmup_steps"):
        LocalCluster(1).run(lambda comm: get_algorithm(name)(N, comm, DENSITY, warmup_steps=-1))


def _velocity_recorder():
    """``(seen, on_step)``: ``seen[rank, t]`` = (residual, velocity) after step t."""
    seen = {}

    def record(comm, alg, t, out):
        seen[comm.rank, t] = (alg.residual.clone(), alg.velocity.clone())

    return seen, record


@pytest.mark.parametrize("masking", [None, False, True])
@pytest.mark.parametrize("name", ALL)
def test_momentum_correction(name, masking):
    """momentum=m: the reducer accumulates u = m·u + grad (conservation holds with
    acc = residual + u); a non-finite step leaves the velocity unchanged. Without masking,
    dense gives exactly the average velocity, i.e. momentum SGD. With DGC's momentum factor
    masking (the default of the sparse algorithms; dense does not mask by default), u restarts
    from 0 exactly where the step delivered the whole accumulated value (residual 0 after it),
    and only there."""
    P, m, steps = 3, 0.9, 8
    gf = mixed(seed=5)
    seen, record = _velocity_recorder()
    res = run_steps(name, P, N, steps, DENSITY, gf, momentum=m, momentum_masking=masking,
                    nonfinite={4: 1}, on_step=record, **torch_kernels(name))
    assert res.algs[0].momentum_masking == (masking if masking is not None else name != "dense")
    masking = res.algs[0].momentum_masking
    assert_conservation(res)
    assert_bitwise_agreement(res)
    u = [torch.zeros(N, dtype=torch.float64) for _ in range(P)]
    masked_somewhere = kept_somewhere = False
    for t in range(steps):
        if t != 4:
            for r in range(P):
                # in fp32 with two roundings, as the reducers form it (u·m, then + g)
                u[r] = (u[r].float() * m + gf(r, t, N).float()).double()
                if masking:
                    delivered = seen[r, t][0] == 0
                    u[r][delivered] = 0.0
                    masked_somewhere |= bool((delivered & (gf(r, t, N) != 0)).any())
                    kept_somewhere |= bool((~delivered).any())
        if name == "dense" and t != 4:
            # masking: every entry is delivered every step, so no momentum is left (plain SGD)
            want = sum(gf(r, t, N).double() for r in range(P)) / P if masking else sum(u) / P
            torch.testing.assert_close(res.outs[t][0].double(), want, rtol=1e-5, atol=1e-5)
        for r in range(P):
            torch.testing.assert_close(seen[r, t][1].double(), u[r], rtol=1e-5, atol=1e-5)
    if masking:
        assert masked_somewhere, "the mask never zeroed a velocity"
        if name != "dense":
            assert kept_somewhere, "a sparse algorithm delivered everything"
    with pytest.raises(ValueError, match="momentum"):
        LocalCluster(1).run(lambda comm: get_algorithm(name)(N, comm, DENSITY, momentum=1.0))


@pytest.mark.parametrize("name", SPARSE_ALGORITHMS)
def test_momentum_not_masked_in_dense_warmup(name):
    """The dense warm-up steps deliver every entry; masking there would drop all momentum, so
    the velocity stays exactly momentum SGD's (u = m·u + grad, and out its average) until the
    first sparse step, which masks."""
    P, m, warm = 2, 0.9, 3
    gf = mixed(seed=8)
    seen, record = _velocity_recorder()
    res = run_steps(name, P, N, warm + 1, DENSITY, gf, momentum=m, warmup_steps=warm,
                    on_step=record, **torch_kernels(name))
    assert_conservation(res)
    u = [torch.zeros(N, dtype=torch.float64) for _ in range(P)]
    for t in range(warm):
        for r in range(P):
            u[r] = m * u[r] + gf(r, t, N).double()
            torch.testing.assert_close(seen[r, t][1].double(), u[r], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(res.outs[t][0].double(), sum(u) / P, rtol=1e-5, atol=1e-5)
    for r in range(P):   # the first sparse step masks what it delivered
        residual, velocity = seen[r, warm]
        assert bool((velocity[residual == 0] == 0).all())
        assert bool((velocity != 0).any())


@pytest.mark.xdist_group("algorithms_run")
@pytest.mark.parametrize("P", PS)
@pytest.mark.parametrize("name", ALL)
def test_bytes_per_step_within_formula(name, P):
    cls = get_algorithm(name)
    res = _run(name, P)
    k = res.k
    bound = byte_bound(name, N, k, P)
    own = getattr(cls, "volume_bound_bytes", None)
    opts = getattr(res.algs[0], "opts", {})
    measured = res.stat_array("bytes_sent")  # [steps, P]
    assert measured.shape == (STEPS, P)
    worst = float(measured.max())
    assert worst <= bound, (f"{name} P={P}: {worst:.0f} bytes per rank per step > bound {bound} "
                            f"(formula {4 * volume_formula_words(name, N, k, P, **opts):.0f} B, "
                            f"k={k}, n={N})")
    if own is not None:
        assert worst <= own(N, k, P, **opts) + FLAG_BYTES, \
            f"{name}: above its own volume_bound_bytes"
    if P > 1 and name != "dense":
        # static sizes: the per-rank volume does not depend on the data (same every step)
        for p in range(P):
            col = measured[:, p]
            assert bool((col == col[0]).all()) or name in ("oktopk", "topkdsa"), \
                f"{name}: rank {p} sent data-dependent byte counts {col.tolist()}"


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("name", ALL)
def test_low_precision_gradients_conserve(name, dtype):
    res = run_steps(name, 3, 1000, 8, 0.03, mixed(seed=2), dtype=dtype, **torch_kernels(name))
    assert all(o.dtype == dtype for row in res.outs for o in row)
    assert_bitwise_agreement(res)
    assert_conservation(res)


# -- bad inputs ------------------------------------------------------------------------------------
def _bad_inputs_body(comm, name):
    cls = get_algorithm(name)
    for d in (0.0, -0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match="density"):
            cls(100, comm, d)
    alg = cls(100, comm, 0.1)
    with pytest.raises(ValueError) as ei:
        alg(torch.zeros(99))
    assert "99" in str(ei.value) and "100" in str(ei.value)
    with pytest.raises(TypeError):
        alg(torch.zeros(100, dtype=torch.int32))
    with pytest.raises(TypeError):
        alg(torch.zeros(100, dtype=torch.int64))
    # still usable after the errors
    out = alg(torch.ones(100))
    return out


@pytest.mark.parametrize("name", ALL)
def test_bad_inputs(name):
    outs = LocalCluster(2, timeout=30).run(_bad_inputs_body, name)
    assert torch.equal(outs[0], outs[1])


def _numel_mismatch_body(comm, name):
    try:
        get_algorithm(name)(100 + comm.rank, comm, 0.1)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize("name", ALL)
def test_numel_differing_across_ranks_raises_everywhere(name):
    msgs = LocalCluster(3, timeout=30).run(_numel_mismatch_body, name)
    assert all(m is not None for m in msgs), msgs
    for m in msgs:
        assert "100" in m and "102" in m


# -- non-finite policy -----------------------------------------------------------------------------
@pytest.mark.parametrize("P", (2, 3))
@pytest.mark.parametrize("name", ALL)
def test_nonfinite_policy(name, P):
    steps = 8
    # P = 2 through the kernels as they are (interpreted under TRITON_INTERPRET=1), P = 3 through
    # their torch references (Ok-Topk interpreted at P = 3: over 2 min)
    opts = torch_kernels(name) if P == 3 else {}
    res = run_steps(name, P, 600, steps, 0.05, mixed(seed=11), nonfinite={4: P - 1}, **opts)
    for p in range(P):
        assert not bool(torch.isfinite(res.outs[4][p]).all()), f"rank {p}: out finite on a NaN step"
    assert res.unchanged[4], "a residual changed on the non-finite step"
    assert_conservation(res)          # includes the non-finite step's checks
    assert_bitwise_agreement(res)
    for t in (3, 5, 6, 7):
        assert bool(torch.isfinite(res.outs[t][0]).all())


# -- state_dict ------------------------------------------------------------------------------------
def _state_body(comm, name, n, density):
    grad = mixed(seed=5)
    opts = torch_kernels(name)
    a = get_algorithm(name)(n, comm, density, **opts)
    for t in range(4):
        a(grad(comm.rank, t, n))
    buf = io.BytesIO()
    torch.save(a.state_dict(), buf)
    outs_a = [a(grad(comm.rank, t, n)).clone() for t in range(4, 9)]
    b = get_algorithm(name)(n, comm, density, **opts)
    buf.seek(0)
    b.load_state_dict(torch.load(buf, weights_only=False))
    outs_b = [b(grad(comm.rank, t, n)).clone() for t in range(4, 9)]
    return outs_a, outs_b, a.residual.clone(), b.residual.clone(), a.step_count, b.step_count


@pytest.mark.parametrize("name", ALL)
def test_state_dict_round_trip(name):
    for r in LocalCluster(3, timeout=60).run(_state_body, name, 900, 0.03):
        outs_a, outs_b, ra, rb, sa, sb = r
        for oa, ob in zip(outs_a, outs_b):
            assert torch.equal(oa.view(torch.int32), ob.view(torch.int32))
        assert torch.equal(ra.view(torch.int32), rb.view(torch.int32))
        assert sa == sb


# -- gloo == LocalCluster --------------------------------------------------------------------------
GLOO_ARGS = (1200, 3, 0.03)  # n, steps, density


def _steps_body(comm, name, n, steps, density):
    grad = mixed(seed=21)
    a = get_algorithm(name)(n, comm, density)
    outs = [a(grad(comm.rank, t, n)).clone() for t in range(steps)]
    return outs, a.residual.clone()


def _all_steps_body(comm, names, n, steps, density):
    """Every algorithm in one gloo world (one spawn for all: spawning costs seconds)."""
    import traceback
    res = {}
    for name in names:
        try:
            res[name] = _steps_body(comm, name, n, steps, density)
        except Exception:  # noqa: BLE001 - reported by the test of that algorithm
            res[name] = traceback.format_exc()
            comm.barrier()
    return res


def _present(name):
    try:
        get_algorithm(name)
        return True
    except (ImportError, AttributeError):
        return False


@functools.lru_cache(maxsize=None)
def _gloo_all():
    distutil = pytest.importorskip("distutil")
    names = tuple(n for n in ALL if _present(n))
    return distutil.run_pooled(3, _all_steps_body, names, *GLOO_ARGS, timeout=180)


# one worker runs every case (make test: --dist loadgroup), so _gloo_all runs once, not once
# per worker that got a case
@pytest.mark.xdist_group("gloo_all")
@pytest.mark.parametrize("name", ALL)
def test_gloo_equals_local_cluster(name):
    gloo = [r[name] for r in _gloo_all()]
    for p, g in enumerate(gloo):
        assert not isinstance(g, str), f"{name} failed on gloo rank {p}:\n{g}"
    n, steps, _ = GLOO_ARGS
    local = LocalCluster(3, timeout=60).run(_steps_body, name, *GLOO_ARGS)
    for p in range(3):
        (go, gr), (lo, lr) = gloo[p], local[p]
        for t in range(steps):
            if name == "dense":  # gloo's ring sums in another order than LocalCluster
                torch.testing.assert_close(go[t], lo[t], rtol=1e-6, atol=1e-6)
            else:
                assert torch.equal(go[t].view(torch.int32), lo[t].view(torch.int32)), \
                    f"{name}: rank {p} step {t}: gloo out differs from LocalCluster"
        assert torch.equal(gr.view(torch.int32), lr.view(torch.int32)) or name == "dense"
