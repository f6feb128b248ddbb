"""Checkpoint and resume through the DDP hook: bitwise equal to the uninterrupted run.

A fresh DDP lays out its first iteration's buckets in another order than the rebuilt buckets of
every later iteration, so a resumed run's first iteration sees another layout than the one its
residuals were saved in. The hook keeps its state by parameter (``_Layout``), so the weights at
the end of a save-and-restore run must equal the uninterrupted run's bit for bit, for every
algorithm, in both modes, at an odd P. One launch runs all cases and saves; a second launch of
fresh processes restores and continues.
"""
import os

import pytest
import torch

from distutil import run_gloo, run_pooled

ALGORITHMS = ("oktopk", "gtopk", "spardl", "topka", "topkdsa", "gaussiank", "dense")
CASES = [(a, m) for a in ALGORITHMS for m in ("flat", "bucket")]
STEPS, SAVE_AT, BS = 6, 3, 8    # saved after the rebuilt-bucket iterations 1-2


def _data(rank):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * 64, 20, generator=g)
    y = (x @ torch.randn(20, 10, generator=g)).argmax(1)
    return x[rank * 64:(rank + 1) * 64], y[rank * 64:(rank + 1) * 64]


def _model(seed=1, hidden=64):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(20, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 10))


def _fresh(alg, mode, comm, model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from oktopk_triton.ddp import SparseAllreduceState, sparse_allreduce_hook
    ddp = DDP(model, bucket_cap_mb=0.01)      # several buckets
    state = SparseAllreduceState(density=0.05, algorithm=alg, comm=comm, mode=mode)
    ddp.register_comm_hook(state, sparse_allreduce_hook)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    return ddp, state, opt


def _steps(ddp, opt, x, y, first, last):
    import torch.nn.functional as F
    for i in range(first, last):
        j = (i * BS) % len(y)
        opt.zero_grad()
        F.cross_entropy(ddp(x[j:j + BS]), y[j:j + BS]).backward()
        opt.step()


def _flat(model):
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _first_half(comm, tmp):
    from oktopk_triton.kernels import _dispatch
    _dispatch.INTERPRET = False
    x, y = _data(comm.rank)
    whole = {}
    for alg, mode in CASES:
        ddp, _, opt = _fresh(alg, mode, comm, _model())
        _steps(ddp, opt, x, y, 0, STEPS)
        whole[f"{alg}-{mode}"] = _flat(ddp.module)
        ddp, state, opt = _fresh(alg, mode, comm, _model())
        _steps(ddp, opt, x, y, 0, SAVE_AT)
        torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                    "hook": state.state_dict()},
                   os.path.join(tmp, f"{alg}-{mode}-{comm.rank}.pt"))
    return whole


def _second_half(comm, tmp):
    from oktopk_triton.kernels import _dispatch
    _dispatch.INTERPRET = False
    x, y = _data(comm.rank)
    resumed = {}
    for alg, mode in CASES:
        ck = torch.load(os.path.join(tmp, f"{alg}-{mode}-{comm.rank}.pt"), weights_only=True)
        model = _model(seed=99)                 # other initial weights: the load must win
        model.load_state_dict(ck["model"])
        ddp, state, opt = _fresh(alg, mode, comm, model)
        opt.load_state_dict(ck["opt"])
        state.load_state_dict(ck["hook"])
        _steps(ddp, opt, x, y, SAVE_AT, STEPS)
        resumed[f"{alg}-{mode}"] = _flat(ddp.module)
    # a state saved for this MLP, loaded for one with other parameters: a clear error
    ck = torch.load(os.path.join(tmp, f"oktopk-flat-{comm.rank}.pt"), weights_only=True)
    ddp, state, opt = _fresh("oktopk", "flat", comm, _model(hidden=32))
    state.load_state_dict(ck["hook"])
    try:
        _steps(ddp, opt, x, y, SAVE_AT, SAVE_AT + 1)
        resumed["mismatch"] = "no error"
    except Exception as e:   # noqa: BLE001 - the message is what is checked
        resumed["mismatch"] = str(e)
    return resumed


@pytest.mark.slow
def test_resume_is_bitwise_identical(tmp_path):
    whole = run_pooled(3, _first_half, str(tmp_path), timeout=600)
    resumed = run_gloo(3, _second_half, str(tmp_path), timeout=600)
    for r in range(3):
        for key, w in whole[r].items():
            assert torch.equal(resumed[r][key], w), \
                (key, r, float((resumed[r][key] - w).abs().max()))
        assert "saved for other parameters" in resumed[r]["mismatch"], resumed[r]["mismatch"]
    for key in whole[0]:                                     # replicas identical too
        assert torch.equal(whole[0][key], whole[2][key])


def test_state_dict_records_layout_and_checks_it():
    from oktopk_triton.ddp import SparseAllreduceState
    s = SparseAllreduceState(density=0.05, algorithm="topka")
    s.layout.indices([torch.zeros(3, 2), torch.zeros(4)])
    sd = s.state_dict()
    assert sd["layout"]["shapes"] == [[3, 2], [4]]
    other = SparseAllreduceState(density=0.05, algorithm="topka")
    other.layout.indices([torch.zeros(3, 2), torch.zeros(5)])
    with pytest.raises(ValueError, match="saved for other parameters"):
        other.load_state_dict(sd)
    with pytest.raises(ValueError, match="algorithm"):
        SparseAllreduceState(algorithm="gtopk").load_state_dict(sd)
    with pytest.raises(ValueError, match="layout"):
        SparseAllreduceState(algorithm="topka").load_state_dict({"iter": 3, "reducers": {}})
    fresh = SparseAllreduceState(density=0.05, algorithm="topka")
    fresh.load_state_dict(sd)
    with pytest.raises(ValueError, match="saved for other parameters"):
        fresh.layout.indices([torch.zeros(2, 3)])


def test_loaded_state_is_saved_as_loaded_and_residual_before_any_step():
    from oktopk_triton.ddp import SparseAllreduceState
    s = SparseAllreduceState(density=0.05, algorithm="topka")
    w = torch.nn.Parameter(torch.ones(3, 2))
    assert torch.equal(s.residual(w), torch.zeros(3, 2))       # nothing seen, nothing loaded
    s.layout.indices([torch.zeros(3, 2), torch.zeros(4)])
    with pytest.raises(ValueError, match="not a parameter the hook has seen"):
        s.residual(w)
    sd = s.state_dict()
    sd["iter"] = 5
    sd["reducers"] = {-1: {"numel": 10, "residual": torch.arange(10.0)}}
    fresh = SparseAllreduceState(density=0.05, algorithm="topka")
    fresh.load_state_dict(sd)
    again = fresh.state_dict()                   # a save straight after the load: as loaded
    assert again["iter"] == 5 and again["layout"]["shapes"] == [[3, 2], [4]]
    assert torch.equal(again["reducers"][-1]["residual"], torch.arange(10.0))
    assert fresh.fingerprint()["numel"] == 10
    with pytest.raises(ValueError, match="bind the DDP model"):
        fresh.residual(w)                        # loaded, no DDP model to place it by
    # a state saved before the hook saw any parameter constrains none
    empty = SparseAllreduceState(density=0.05, algorithm="topka")
    empty.load_state_dict(SparseAllreduceState(density=0.05, algorithm="topka").state_dict())
    assert empty.layout.expected is None
    assert empty.layout.indices([torch.zeros(2)]) == [0]
