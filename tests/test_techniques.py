"""ef_decay, local_clip and the frozen-variance Adam (oktopk_triton/techniques.py)."""
import pytest
import torch

from conservation import assert_bitwise_agreement, assert_conservation, mixed, run_steps
from oktopk_triton import SparseAllreduce
from oktopk_triton.comm.local import LocalCluster


@pytest.mark.parametrize("algorithm", ["oktopk", "topka", "gaussiank"])
@pytest.mark.parametrize("P", [3, 4])
def test_conservation_with_decay_and_clip(algorithm, P):
    res = run_steps(algorithm, P=P, n=3000, steps=12, density=0.02, grad_fn=mixed(seed=1),
                    nonfinite={5: 1}, ef_decay=0.9, local_clip=50.0, momentum=0.9)
    assert_conservation(res)
    assert_bitwise_agreement(res)


def test_decay_drops_exactly_the_decayed_mass():
    plain = run_steps("oktopk", P=2, n=2000, steps=6, density=0.01, grad_fn=mixed(seed=2))
    dec = run_steps("oktopk", P=2, n=2000, steps=6, density=0.01, grad_fn=mixed(seed=2),
                    ef_decay=0.5)
    # same first step (empty residual), then the decayed run owes less in total
    assert torch.equal(plain.outs[0][0], dec.outs[0][0])
    assert dec.residual_sums[-1].abs().sum() < plain.residual_sums[-1].abs().sum()
    # the contract with ef_decay: acc = 0.5 * residual + grad, checked against run_steps' record
    assert_conservation(dec)


def test_local_clip_bounds_each_rank():
    res = run_steps("dense", P=4, n=500, steps=1, density=1.0,
                    grad_fn=lambda r, t, n: torch.full((n,), 10.0 * (r + 1)), local_clip=2.0)
    # each rank's vector scaled to norm 2/sqrt(4) = 1, so out = mean of four unit vectors
    assert float(torch.linalg.vector_norm(res.outs[0][0])) == pytest.approx(1.0, rel=1e-5)


def test_bad_technique_options():
    with pytest.raises(ValueError, match="ef_decay"):
        run_steps("oktopk", P=1, n=100, steps=1, density=0.1, grad_fn=mixed(0), ef_decay=1.5)
    with pytest.raises(ValueError, match="local_clip"):
        run_steps("oktopk", P=1, n=100, steps=1, density=0.1, grad_fn=mixed(0), local_clip=-1)


def _model():
    """The same weights on every rank (a local generator: the ranks are threads, and the global
    RNG would interleave their draws)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def _adam_body(comm, steps, warmup, save_at=None, state=None, density=0.05):
    model = _model()
    sar = SparseAllreduce(model.parameters(), comm=comm, density=density, adam="frozen",
                          momentum=0.9, warmup_steps=warmup)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    start = 0
    if state is not None:
        model.load_state_dict(state[comm.rank]["model"])
        sar.load_state_dict(state[comm.rank]["sar"])
        start = save_at
    g = torch.Generator().manual_seed(comm.rank)
    xs = [torch.randn(8, 16, generator=g) for _ in range(steps)]
    saved, outs = None, []
    for t in range(start, steps):
        if t == save_at and state is None:
            saved = {"model": {k: v.clone() for k, v in model.state_dict().items()},
                     "sar": {k: (v.clone() if isinstance(v, torch.Tensor) else v)
                             for k, v in sar.state_dict().items()}}
        opt.zero_grad()
        model(xs[t]).pow(2).mean().backward()
        outs.append(sar.reduce_adam(opt).clone())
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return flat, outs, saved, sar


def test_frozen_adam_dense_warmup_is_adamw():
    """Density 1 and warmup past the end: the weights follow torch's AdamW on the mean gradient."""
    P, steps = 2, 6
    res = LocalCluster(P).run(_adam_body, steps, steps + 1, None, None, 1.0)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    gens = [torch.Generator().manual_seed(r) for r in range(P)]
    xs = [[torch.randn(8, 16, generator=g) for _ in range(steps)] for g in gens]
    for t in range(steps):
        opt.zero_grad()
        sum(model(xs[r][t]).pow(2).mean() for r in range(P)).div(P).backward()
        opt.step()
    ref = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    torch.testing.assert_close(res[0][0], ref, rtol=1e-4, atol=1e-5)


def test_frozen_adam_replicas_identical_and_resume_bit_exact():
    P, steps, warmup, cut = 3, 10, 3, 6
    full = LocalCluster(P).run(_adam_body, steps, warmup, cut)
    for r in range(1, P):
        assert torch.equal(full[r][0], full[0][0])
    # the sparse phase happened: after the warm-up out is not dense
    assert int((full[0][1][-1] != 0).sum()) < full[0][1][-1].numel()
    states = [f[2] for f in full]
    resumed = LocalCluster(P).run(_adam_body, steps, warmup, cut, states)
    assert torch.equal(resumed[0][0], full[0][0])


def test_frozen_adam_needs_momentum_and_params():
    comm = LocalCluster(1).communicator(0)
    with pytest.raises(ValueError, match="momentum"):
        SparseAllreduce([torch.nn.Parameter(torch.zeros(4))], comm=comm, adam="frozen",
                        warmup_steps=2)
    with pytest.raises(ValueError, match="warmup_steps"):
        SparseAllreduce([torch.nn.Parameter(torch.zeros(4))], comm=comm, adam="frozen",
                        momentum=0.9)
