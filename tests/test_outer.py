"""oktopk_triton.outer: the outer optimizer of local steps over error feedback. An SGD's momentum
above the cap is served capped with a sparse algorithm, in one log line (SparseDiLoCo's outer
optimizer in place, LocalSteps' outer_momentum on SparseAllreduce); an optimizer that is not SGD
is refused with a sparse algorithm; with a dense one everything runs as given."""
import logging

import pytest
import torch

from oktopk_triton import LocalSteps, SparseAllreduce
from oktopk_triton.comm.local import SingleCommunicator
from oktopk_triton.outer import MOMENTUM_CAP, capped_momentum, serve_outer_optimizer


def _params():
    return [torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(2))]


def _lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name.startswith("oktopk_triton")]


def test_nesterov_over_a_sparse_algorithm_is_served_capped_in_one_line(caplog):
    opt = torch.optim.SGD(_params(), lr=0.7, momentum=0.9, nesterov=True)
    with caplog.at_level(logging.INFO, logger="oktopk_triton"):
        serve_outer_optimizer(opt, sparse=True, owner="SparseDiLoCo")
    assert [g["momentum"] for g in opt.param_groups] == [MOMENTUM_CAP]
    assert opt.param_groups[0]["nesterov"] and opt.param_groups[0]["lr"] == 0.7
    lines = _lines(caplog)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert lines[0].startswith("SparseDiLoCo: the outer SGD's momentum 0.9 served as 0.5 "
                               "(Nesterov kept) with a sparse algorithm")
    # the optimizer still steps, as Nesterov at the cap
    p = opt.param_groups[0]["params"][0]
    p.grad = torch.ones(3)
    opt.step()
    assert torch.allclose(p.detach(), torch.full((3,), -0.7 * (1 + MOMENTUM_CAP)))


@pytest.mark.parametrize("momentum", [0.0, 0.3, MOMENTUM_CAP])
def test_a_momentum_at_most_the_cap_is_left_alone(caplog, momentum):
    opt = torch.optim.SGD(_params(), lr=1.0, momentum=momentum)
    with caplog.at_level(logging.INFO, logger="oktopk_triton"):
        serve_outer_optimizer(opt, sparse=True, owner="SparseDiLoCo")
    assert opt.param_groups[0]["momentum"] == momentum and not _lines(caplog)


def test_a_dense_algorithm_runs_any_outer_optimizer_as_given(caplog):
    sgd = torch.optim.SGD(_params(), lr=0.7, momentum=0.9, nesterov=True)
    adam = torch.optim.Adam(_params(), lr=1e-3)
    with caplog.at_level(logging.INFO, logger="oktopk_triton"):
        serve_outer_optimizer(sgd, sparse=False, owner="SparseDiLoCo")
        serve_outer_optimizer(adam, sparse=False, owner="SparseDiLoCo")
    assert sgd.param_groups[0]["momentum"] == 0.9 and not _lines(caplog)


def test_another_outer_optimizer_is_refused_with_a_sparse_algorithm_in_one_line():
    with pytest.raises(ValueError) as e:
        serve_outer_optimizer(torch.optim.Adam(_params()), sparse=True, owner="SparseDiLoCo")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(
        "SparseDiLoCo: with a sparse algorithm the outer optimizer must be torch.optim.SGD")
    assert "got Adam" in msg and "algorithm='dense'" in msg
    with pytest.raises(TypeError, match="must be a torch.optim.Optimizer, got str"):
        serve_outer_optimizer("sgd", sparse=False, owner="SparseDiLoCo")


def test_capped_momentum_logs_only_when_it_caps(caplog):
    with caplog.at_level(logging.INFO, logger="oktopk_triton"):
        assert capped_momentum(0.9, False, "LocalSteps") == 0.9
        assert capped_momentum(0.4, True, "LocalSteps") == 0.4
        assert not _lines(caplog)
        assert capped_momentum(0.9, True, "LocalSteps") == MOMENTUM_CAP
    assert _lines(caplog) == [
        "LocalSteps: outer momentum 0.9 served as 0.5 with a sparse algorithm: error feedback "
        "already carries the unsent pseudo-gradient, and a stronger outer momentum on top of it "
        "oscillated (docs/fault-tolerance.md, 'The outer optimizer')"]


@pytest.mark.parametrize("algorithm,served", [("oktopk", MOMENTUM_CAP), ("dense", 0.9)])
def test_local_steps_on_sparse_allreduce_get_the_same_answer(algorithm, served):
    sar = SparseAllreduce(_params(), SingleCommunicator(), density=0.5, algorithm=algorithm,
                          local_steps=LocalSteps(sync_every=2, outer_lr=0.7, outer_momentum=0.9))
    assert sar.local_steps.outer_momentum == served
