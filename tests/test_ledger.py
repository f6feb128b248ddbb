"""SparseAllreduce.audit() (oktopk_triton/modes/ledger.py): a run-long conservation check that
passes for every algorithm at an odd P in every reduce mode, catches owed gradient that was
lost, and says why where the sum it checks is not the invariant."""
import pytest
import torch

from oktopk_triton import SparseAllreduce
from oktopk_triton.algorithms import SPARSE_ALGORITHMS
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.modes.ledger import ConservationLedger

ALL = ("dense",) + tuple(SPARSE_ALGORITHMS)


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    """The ledger's accounting does not depend on the kernel path: the kernels' torch references
    (interpreted, Ok-Topk's run alone took over a minute; the interpreted kernels are compared
    with the references bit for bit in tests/test_oktopk.py and tests/test_kernel_*.py)."""
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", False)


def _model():
    g = torch.Generator().manual_seed(3)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return m


def _run(comm, alg, mode, calls=9, lose_at=None, **kw):
    m = _model()
    opt = (torch.optim.AdamW(m.parameters(), lr=0.02) if mode == "updates"
           else torch.optim.SGD(m.parameters(), lr=0.05))
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.1, algorithm=alg, **kw)
    ledger = sar.audit()
    gen = torch.Generator().manual_seed(50 + comm.rank)
    for i in range(calls):
        opt.zero_grad()
        m(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()
        if mode == "updates":
            sar.reduce_updates(opt)
        else:
            sar.reduce_gradients()
            opt.step()
        if i == lose_at and comm.rank == 1:
            sar.residual.zero_()          # what rank 1 owed vanishes: a lost gradient
    return ledger.check()


@pytest.mark.parametrize("alg", ALL)
def test_every_algorithm_conserves_over_a_run(alg):
    for mode, kw in (("gradients", {}), ("updates", {}), ("updates", {"sync_every": 3})):
        for c in LocalCluster(3).run(_run, alg, mode, **kw):
            assert c["checked"] and c["calls"] == (3 if kw else 9), (mode, kw, c)
            assert c["relative_error"] < 1e-6, (mode, kw, c)


@pytest.mark.parametrize("alg", ["oktopk", "gtopk", "topka"])
def test_a_lost_residual_is_caught(alg):
    for c in LocalCluster(3).run(_run, alg, "gradients", lose_at=4):
        assert c["checked"] and c["relative_error"] > 1e-3, c


@pytest.mark.parametrize("alg", ALL)
def test_momentum_correction_conserves_the_velocity_accumulated(alg):
    for masking in (True, False):
        res = LocalCluster(3).run(_run, alg, "gradients", momentum=0.9,
                                  momentum_masking=masking, warmup_steps=2)
        for c in res:
            assert c["checked"] and c["relative_error"] < 1e-6, (masking, c)


@pytest.mark.parametrize("alg", ALL)
def test_a_decayed_residual_is_checked(alg):
    """SparseLoCo's decay drops what is owed on purpose; the ledger is told what it dropped."""
    for c in LocalCluster(3).run(_run, alg, "updates", sync_every=3, residual_decay=0.9):
        assert c["checked"] and c["calls"] == 3 and c["relative_error"] < 1e-6, c


def test_the_decay_accounting_is_what_makes_it_hold(monkeypatch):
    """Without the dropped mass given back the same decayed run does not balance."""
    monkeypatch.setattr(ConservationLedger, "dropped", lambda self, before, after: None)
    for c in LocalCluster(3).run(_run, "oktopk", "updates", sync_every=3, residual_decay=0.9):
        assert c["checked"] and c["relative_error"] > 1e-3, c


def _frozen(comm):
    p = torch.nn.Parameter(torch.ones(32))
    sar = SparseAllreduce([p], comm=comm, density=0.25, adam="frozen", momentum=0.9,
                          warmup_steps=2)
    return sar.audit().check()


def test_where_the_sum_is_not_the_invariant_it_says_why():
    assert all(not c["checked"] and "frozen" in c["unchecked"] and c["relative_error"] is None
               for c in LocalCluster(3).run(_frozen))


def test_the_audit_holds_twelve_bytes_an_element_and_leaves_the_residual_alone():
    """One fp64 balance and one fp32 input: 12 bytes an element (three fp64 sums took 24); the
    balance starts as a copy of the residual, and feeding it leaves the residual as it was."""
    sar = SparseAllreduce(_model().parameters(), comm=LocalCluster(1).communicator(0),
                          density=0.1, algorithm="oktopk")
    sar.residual.fill_(0.5)
    ledger = sar.audit()
    tensors = [v for v in vars(ledger).values() if isinstance(v, torch.Tensor)]
    assert sum(t.numel() * t.element_size() for t in tensors) == 12 * sar.numel
    ledger.fed_in(torch.ones(sar.numel), None)
    assert torch.all(sar.residual == 0.5)
