"""Per-rank checkpoint files (oktopk_triton.checkpoint): ``SparseAllreduceState.save/load`` and
``SparseAllreduce.save/load`` write one file per rank that ``torch.load(weights_only=True)``
reads, a resume from them continues bit for bit, and every mismatch (world size, model,
algorithm, a missing or foreign file) is a one-line ``CheckpointError`` on every rank."""
import os
import re

import pytest
import torch

from distutil import run_gloo, run_pooled
from oktopk_triton.checkpoint import CheckpointError, rank_file
from oktopk_triton.comm.local import LocalCluster

STEPS, SAVE_AT = 8, 4


def _torch_kernels():
    """The plain-torch kernels (the Triton interpreter is slow and not what is tested here)."""
    from oktopk_triton.kernels import _dispatch
    _dispatch.INTERPRET = False


@pytest.fixture
def no_interpreter(monkeypatch):
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", False)


def _data(rank):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * 32, 12, generator=g)
    y = (x @ torch.randn(12, 5, generator=g)).argmax(1)
    return x[rank * 32:(rank + 1) * 32], y[rank * 32:(rank + 1) * 32]


def _model(hidden=32):
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(12, hidden), torch.nn.ReLU(),
                               torch.nn.Linear(hidden, 5))


def _ddp(comm, model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from oktopk_triton.ddp import SparseAllreduceState, sparse_allreduce_hook
    ddp = DDP(model, bucket_cap_mb=0.001)
    state = SparseAllreduceState(density=0.05, comm=comm)
    ddp.register_comm_hook(state, sparse_allreduce_hook)
    return ddp, state, torch.optim.SGD(ddp.parameters(), lr=0.1)


def _train(ddp, opt, x, y, first, last):
    for i in range(first, last):
        j = (i * 8) % len(y)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x[j:j + 8]), y[j:j + 8]).backward()
        opt.step()


def _flat(m):
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def _ddp_first(comm, tmp):
    _torch_kernels()
    x, y = _data(comm.rank)
    ddp, _, opt = _ddp(comm, _model())
    _train(ddp, opt, x, y, 0, STEPS)
    whole = _flat(ddp.module)
    ddp, state, opt = _ddp(comm, _model())
    _train(ddp, opt, x, y, 0, SAVE_AT)
    path = state.save(tmp)
    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict()},
               os.path.join(tmp, f"rest-{comm.rank}.pt"))
    f = torch.load(path, weights_only=True)
    owed = {n: state.residual(p).clone() for n, p in ddp.module.named_parameters()}
    return (whole, path, f["rank"], f["world_size"], f["fingerprint"],
            state.reducers[-1].residual.clone(), owed)


def _ddp_second(comm, tmp):
    _torch_kernels()
    x, y = _data(comm.rank)
    model = _model()
    rest = torch.load(os.path.join(tmp, f"rest-{comm.rank}.pt"), weights_only=True)
    model.load_state_dict(rest["model"])
    ddp, state, opt = _ddp(comm, model)
    opt.load_state_dict(rest["opt"])
    state.load(tmp, model=ddp)
    # before any backward: each parameter's loaded residual (placed by the bound DDP model)
    owed = {n: state.residual(p).clone() for n, p in ddp.module.named_parameters()}
    # a save straight after the load writes the state as loaded; loading that file resumes
    again = os.path.join(tmp, "again")
    state.save(again)
    saved = torch.load(rank_file(again, comm.rank, comm.world_size), weights_only=True)
    state.load(again, model=ddp)
    residual = state._pending_state[-1]["residual"].clone()
    _train(ddp, opt, x, y, SAVE_AT, STEPS)
    errors = {}
    for case in ("other model", "other algorithm", "missing on rank 1"):
        from oktopk_triton.ddp import SparseAllreduceState
        st = SparseAllreduceState(density=0.05, comm=comm,
                                  algorithm="topka" if case == "other algorithm" else "oktopk")
        other = _model(hidden=33) if case == "other model" else model
        if case == "missing on rank 1" and comm.rank == 1:
            os.replace(rank_file(tmp, 1, comm.world_size), os.path.join(tmp, "moved.pt"))
        comm.barrier()
        try:
            st.load(tmp, model=other)
        except CheckpointError as e:
            errors[case] = str(e)
        comm.barrier()
        if case == "missing on rank 1" and comm.rank == 1:
            os.replace(os.path.join(tmp, "moved.pt"), rank_file(tmp, 1, comm.world_size))
    return _flat(ddp.module), residual, errors, owed, saved


def test_ddp_state_save_load_per_rank(tmp_path):
    tmp = str(tmp_path)
    first = run_pooled(2, _ddp_first, tmp)
    for r, (_, path, rank, world, fp, _, _) in enumerate(first):
        assert os.path.basename(path) == f"oktopk-rank{r}-of2.pt" and (rank, world) == (r, 2)
        assert fp["algorithm"] == "oktopk" and fp["group_size"] == 2 and fp["numel"] == 581
    # the ranks owe different things: one file per rank is needed
    assert not torch.equal(first[0][5], first[1][5])
    second = run_gloo(2, _ddp_second, tmp)
    for r in range(2):
        assert torch.equal(second[r][0], first[r][0])           # continues bit for bit
        assert torch.equal(second[r][1], first[r][5])           # its own residual came back
        owed, saved = second[r][3], second[r][4]
        assert owed.keys() == first[r][6].keys()
        for n, t in owed.items():                               # residual(p) right after load
            assert torch.equal(t, first[r][6][n]), n
        assert saved["state"]["reducers"][-1]["residual"].abs().sum() > 0
        assert torch.equal(saved["state"]["reducers"][-1]["residual"], first[r][5])
        assert saved["fingerprint"]["numel"] == 581
        errs = second[r][2]
        assert set(errs) == {"other model", "other algorithm", "missing on rank 1"}, errs
        # the first mismatched parameter, by name, with its shapes (not just the totals)
        assert ("saved for other parameters (parameter '0.weight' has shape [33, 12] here, "
                "which no parameter in the file has") in errs["other model"], errs["other model"]
        assert "algorithm is 'oktopk' in the file, 'topka' here" in errs["other algorithm"]
        assert "no file" in errs["missing on rank 1"] and "rank 1" in errs["missing on rank 1"]
        assert all("\n" not in e for e in errs.values())
    assert second[0][2]["missing on rank 1"].startswith("rank 1 failed: ")
    # another world size (here: one process, no process group) reshards: the one rank owes
    # what the two owed together (tests/test_elastic_resume.py checks it in full)
    from oktopk_triton.ddp import SparseAllreduceState
    one = SparseAllreduceState(density=0.05, comm=object())
    one.load(tmp)
    owed = one._pending_state[-1]
    assert owed["resharded_from"] == 2 and owed["world_size"] == 1
    assert torch.allclose(owed["residual"], (first[0][5] + first[1][5]) / 2)


def _sar_body(comm, alg, tmp, options):
    from oktopk_triton import SparseAllreduce
    torch.manual_seed(comm.rank)
    grads = [torch.randn(300) for _ in range(6)]
    a = SparseAllreduce(300, comm, density=0.05, algorithm=alg, **options)
    for g in grads[:3]:
        a(g)
    a.save(tmp, name=alg)
    b = SparseAllreduce(300, comm, density=0.05, algorithm=alg, **options)
    b.load(tmp, name=alg)
    outs_a = [a(g) for g in grads[3:]]
    outs_b = [b(g) for g in grads[3:]]
    same = all(torch.equal(u, v) for u, v in zip(outs_a, outs_b))
    return same and torch.equal(a.residual, b.residual)


@pytest.mark.parametrize("alg,options", [
    ("oktopk", {"momentum": 0.9}), ("topka", {}), ("gtopk", {}), ("spardl", {}),
    ("topkdsa", {}), ("gaussiank", {}), ("dense", {}),
    ("oktopk", {"density_schedule": [(0, 0.2), (4, 0.05)]})])
def test_sparse_allreduce_save_load_every_algorithm(tmp_path, alg, options, no_interpreter):
    assert all(LocalCluster(3).run(_sar_body, alg, str(tmp_path), options))
    for r in range(3):    # plain containers and tensors only
        f = torch.load(rank_file(str(tmp_path), r, 3, alg), weights_only=True)
        assert f["rank"] == r and f["world_size"] == 3 and f["kind"] == "SparseAllreduce"


def _sar_mismatch(comm, tmp, case):
    from oktopk_triton import SparseAllreduce
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(10, 4)), torch.nn.Parameter(torch.randn(4))]
    a = SparseAllreduce(params, comm, density=0.1)
    a.save(tmp)
    if case == "shape":
        other = [torch.nn.Parameter(torch.randn(4, 10)), torch.nn.Parameter(torch.randn(4))]
    elif case == "count":
        other = [torch.nn.Parameter(torch.randn(10, 4))]
    elif case == "dtype":
        other = [torch.nn.Parameter(torch.randn(10, 4)),
                 torch.nn.Parameter(torch.randn(4, dtype=torch.bfloat16))]
    else:
        other = params
    b = SparseAllreduce(other, comm, density=0.1, algorithm="topka" if case == "alg" else "oktopk")
    b.load(tmp)


@pytest.mark.parametrize("case,expect", [
    ("shape", "parameter 0 has shape [10, 4] in the file, [4, 10] here"),
    ("dtype", "parameter 1 has dtype float32 in the file, bfloat16 here"),
    ("count", "parameter 1 (shape [4]) exists only in the file; 2 parameters of 44 elements in "
              "the file, 1 parameter of 40 elements here"),
    ("alg", "algorithm is 'oktopk' in the file, 'topka' here")])
def test_sparse_allreduce_load_mismatch(tmp_path, case, expect, no_interpreter):
    with pytest.raises(CheckpointError, match=re.escape(expect)):
        LocalCluster(2).run(_sar_mismatch, str(tmp_path), case)


class Evil:      # an arbitrary pickled object: weights_only refuses it, nothing runs
    pass


def test_load_refuses_foreign_and_corrupt_files(tmp_path):
    from oktopk_triton import SparseAllreduce
    from oktopk_triton.comm.local import SingleCommunicator
    a = SparseAllreduce(50, SingleCommunicator(), density=0.1)
    with pytest.raises(CheckpointError, match="no file .*rank 0 of 1$"):
        a.load(str(tmp_path))
    path = rank_file(str(tmp_path), 0, 1)
    with open(path, "wb") as f:
        f.write(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        a.load(str(tmp_path))
    torch.save({"format": 1, "kind": "SparseAllreduceState", "rank": 0, "world_size": 1}, path)
    with pytest.raises(CheckpointError, match="saved by SparseAllreduceState, not SparseAll"):
        a.load(str(tmp_path))
    torch.save({"format": 1, "x": Evil()}, path)
    with pytest.raises(CheckpointError, match="cannot read"):
        a.load(str(tmp_path))
