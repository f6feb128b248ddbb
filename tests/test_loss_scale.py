"""Loss scaling: a change of scale must not change what error feedback owes.

The residual holds gradients in the units of the loss scale they were computed at. A run whose
scale backs off and grows (as ``torch.amp.GradScaler`` does) must deliver, unscaled, exactly what
a run at a constant scale delivers: the scales are powers of two, so exactly, bit for bit.
"""
import pytest
import torch

from conservation import mixed, torch_kernels

from oktopk_triton.algorithms import get_algorithm
from oktopk_triton.comm import LocalCluster

STEPS = 12
# a backoff at step 3, growth at 7, two backoffs at 9 and 10 (a GradScaler's pattern)
SCALES = [2.0 ** e for e in (10, 10, 10, 9, 9, 9, 9, 10, 10, 9, 8, 8)]


def _run(alg, P, n, scales, as_tensor, **opts):
    gfn = mixed(seed=3)

    def body(comm):
        red = get_algorithm(alg)(n, comm, 0.02, **opts)
        outs = []
        for t in range(STEPS):
            s = scales[t]
            scale = torch.tensor(s) if as_tensor else s
            out = red(gfn(comm.rank, t, n).float() * s, scale=scale)
            outs.append(out / s)
        return torch.stack(outs), red.residual / scales[-1]
    return LocalCluster(P).run(body)


@pytest.mark.parametrize("alg,P", [(a, 3) for a in ("oktopk", "gtopk", "topka", "spardl",
                                                     "topkdsa", "gaussiank", "dense")]
                         + [("oktopk", 4), ("spardl", 4)])
def test_scale_changes_deliver_what_a_constant_scale_does(alg, P):
    n = 3000
    # the algorithms with Triton kernels run them (interpreted here) in the run whose scale is a
    # tensor, the torch references in the other two (bit for bit the same: test_oktopk.py
    # test_triton_kernels_match_torch_path; the equalities below check it again over these 12
    # steps); Ok-Topk at P=4 the torch path throughout: the scale is applied around the kernels,
    # and the interpreter costs seconds per step
    ref = torch_kernels(alg)
    const = _run(alg, P, n, [2.0 ** 10] * STEPS, False, **ref)
    for as_tensor in (False, True):
        opts = {} if as_tensor and (alg, P) != ("oktopk", 4) else ref
        moving = _run(alg, P, n, SCALES, as_tensor, **opts)
        for r in range(P):
            assert torch.equal(moving[r][0], const[r][0]), (alg, r, as_tensor)
            assert torch.equal(moving[r][1], const[r][1]), (alg, r, as_tensor)


def test_without_following_the_scale_the_owed_mass_is_wrong():
    """The check above can fail: ignoring the scale (the old behaviour) changes the outputs."""
    n, P = 3000, 3
    const = _run("topka", P, n, [2.0 ** 10] * STEPS, False)
    gfn = mixed(seed=3)

    def body(comm):
        red = get_algorithm("topka")(n, comm, 0.02)
        return torch.stack([red(gfn(comm.rank, t, n).float() * SCALES[t]) / SCALES[t]
                            for t in range(STEPS)])
    ignored = LocalCluster(P).run(body)
    assert not torch.equal(ignored[0], const[0][0])


def test_momentum_velocity_follows_the_scale():
    n, P = 2000, 3
    const = _run("oktopk", P, n, [2.0 ** 10] * STEPS, False, momentum=0.9, backend="torch")
    moving = _run("oktopk", P, n, SCALES, True, momentum=0.9, backend="torch")
    assert torch.equal(moving[0][0], const[0][0])


def test_scale_is_saved_and_checked():
    n = 100
    red = get_algorithm("topka")(n, LocalCluster(1).run(lambda c: c)[0], 0.1)
    red(torch.randn(n) * 8.0, scale=8.0)
    sd = red.state_dict()
    assert float(sd["loss_scale"]) == 8.0
    twin = get_algorithm("topka")(n, red.comm, 0.1)
    twin.load_state_dict(sd)
    g = torch.randn(n) * 4.0
    assert torch.equal(red(g.clone(), scale=4.0), twin(g.clone(), scale=4.0))
    for bad in (0.0, -1.0, float("inf"), "x", torch.ones(2)):
        with pytest.raises(ValueError, match="scale"):
            red(torch.randn(n), scale=bad)


def test_nonfinite_step_keeps_residual_in_scale():
    """A skipped step (NaN) leaves the residual as it was, in the scale of that step; the next
    step's smaller scale rescales it."""
    n, P = 500, 3

    def body(comm):
        red = get_algorithm("gtopk")(n, comm, 0.05)
        red(torch.full((n,), 0.5) * 64, scale=64.0)
        before = red.residual.clone()
        g = torch.ones(n)
        if comm.rank == 1:
            g[3] = float("nan")
        red(g, scale=64.0)
        kept = torch.equal(red.residual, before)
        red(torch.zeros(n), scale=32.0)          # the scaler backed off: owed mass halves
        return kept, before, red.residual
    for kept, before, _ in LocalCluster(P).run(body):
        assert kept
