"""Elastic resume: per-rank files saved at 4 ranks load at 2, 3 and 6 ranks. What is owed is
conserved, ``(1/P')·Σ residual' == (1/P)·Σ residual`` (the velocity alike), the state shared by
every rank comes from old rank 0, the world-size state is a fresh reducer's (the same bytes a
step), and conservation holds on the steps after; another model still errors on every rank.
SparseAllreduce on thread ranks, the DDP hook on gloo ranks."""
import os

import pytest
import torch

from distutil import run_gloo
from oktopk_triton import SparseAllreduce
from oktopk_triton.checkpoint import CheckpointError
from oktopk_triton.comm.local import LocalCluster

N, SAVED_AT, RESUME_AT = 2000, 4, (2, 3, 6)
OKTOPK = dict(algorithm="oktopk", consistency=0.9, momentum=0.9)


@pytest.fixture(autouse=True)
def no_interpreter(monkeypatch):
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", False)


def _grad(rank, t, n=N):
    g = torch.Generator().manual_seed(100 * rank + t)
    return torch.randn(n, generator=g) * (1 + rank % 3)


def _owed_mass(residuals):
    """(1/P)·Σ_p residual_p in fp64."""
    return sum(r.double() for r in residuals) / len(residuals)


def _assert_same_mass(new, old, what):
    a, b = _owed_mass(new), _owed_mass(old)
    rel = float((a - b).norm() / b.norm())
    assert rel < 1e-6, (what, rel)


# -- SparseAllreduce over a flat vector: Ok-Topk with consistency and momentum correction ------
def _flat_save(comm, tmp):
    sar = SparseAllreduce(N, comm, density=0.02, **OKTOPK)
    for t in range(4):
        sar(_grad(comm.rank, t))
    sar.save(tmp)
    alg = sar.algorithm
    return sar.residual.clone(), alg.velocity.clone(), alg._signs.clone(), alg.step_count


def _flat_resume(comm, tmp):
    sar = SparseAllreduce(N, comm, density=0.02, **OKTOPK)
    sar.load(tmp)
    alg = sar.algorithm
    loaded = (sar.residual.clone(), alg.velocity.clone(), alg._signs.clone(), alg.step_count,
              alg._calibrated)
    fresh = SparseAllreduce(N, comm, density=0.02, **OKTOPK)
    ledger = sar.audit()
    sent = []
    for t in range(4, 7):
        sar(_grad(comm.rank, t))
        fresh(_grad(comm.rank, t))
        sent.append((sar.stats["bytes_sent"], fresh.stats["bytes_sent"]))
    return loaded, sent, ledger.check()


def _other_model(comm, tmp):
    try:
        SparseAllreduce(N + 8, comm, density=0.02, **OKTOPK).load(tmp)
    except CheckpointError as e:
        return str(e)
    return None


def test_sparse_allreduce_resumes_at_another_world_size(tmp_path, caplog):
    tmp = str(tmp_path)
    saved = LocalCluster(SAVED_AT).run(_flat_save, tmp)
    caplog.set_level("INFO", logger="oktopk_triton.checkpoint")
    for P in RESUME_AT:
        res = LocalCluster(P).run(_flat_resume, tmp)
        loaded = [r[0] for r in res]
        _assert_same_mass([x[0] for x in loaded], [s[0] for s in saved], ("residual", P))
        _assert_same_mass([x[1] for x in loaded], [s[1] for s in saved], ("velocity", P))
        for q, (_, _, signs, step, calibrated) in enumerate(loaded):
            assert step == saved[0][3] and not calibrated      # Ok-Topk calibrates afresh
            group = [s[2] for p, s in enumerate(saved) if p % P == q]
            expect = torch.stack(group).mean(0) if group else torch.zeros(N)
            assert torch.equal(signs, expect), (P, q)           # the group's sign EMA, averaged
        for _, sent, check in res:
            assert all(a == b for a, b in sent), sent          # a fresh reducer's bytes
            assert check["checked"] and check["relative_error"] < 1e-6, check
    assert "resharded" in caplog.text and "from 4 to 6 ranks" in caplog.text
    errors = LocalCluster(3).run(_other_model, tmp)
    assert all(e is not None and "\n" not in e and "numel is 2000 in the file" in e
               for e in errors), errors


# -- SparseAllreduce with local steps (reduce_updates, outer momentum, moment sync) ---------------
def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))


LOCAL = dict(density=0.05, sync_every=2, outer_momentum=0.5, moment_sync_every=2)


def _local_calls(model, sar, opt, rank, first, last):
    for t in range(first, last):
        g = torch.Generator().manual_seed(10 * rank + t)
        opt.zero_grad()
        model(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        sar.reduce_updates(opt)


def _local_save(comm, tmp):
    model = _model()
    sar = SparseAllreduce(model.parameters(), comm, **LOCAL)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _local_calls(model, sar, opt, comm.rank, 0, 5)        # ends between syncs (position 1)
    sar.save(tmp)
    torch.save(model.state_dict(), os.path.join(tmp, f"model-{comm.rank}.pt"))
    ls = sar.local_steps
    return sar.residual.clone(), [a.clone() for a in ls.anchor], ls.velocity.clone(), \
        ls.position, ls.moments.count


def _local_resume(comm, tmp):
    model = _model()
    model.load_state_dict(torch.load(os.path.join(tmp, "model-0.pt"), weights_only=True))
    sar = SparseAllreduce(model.parameters(), comm, **LOCAL)
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    sar.load(tmp)
    ls = sar.local_steps
    loaded = (sar.residual.clone(), [a.clone() for a in ls.anchor], ls.velocity.clone(),
              ls.position, ls.moments.count)
    fresh = SparseAllreduce(_model().parameters(), comm, **LOCAL).algorithm
    same_caps = (sar.algorithm.cap_r, sar.algorithm.cap_g) == (fresh.cap_r, fresh.cap_g)
    ledger = sar.audit()
    _local_calls(model, sar, opt, comm.rank, 5, 10)
    return loaded, ledger.check(), same_caps


def test_local_steps_resume_at_another_world_size(tmp_path):
    tmp = str(tmp_path)
    saved = LocalCluster(SAVED_AT).run(_local_save, tmp)
    assert saved[0][3] == 1
    for P in RESUME_AT:
        res = LocalCluster(P).run(_local_resume, tmp)
        _assert_same_mass([r[0][0] for r in res], [s[0] for s in saved], ("residual", P))
        for loaded, check, same_caps in res:   # shared state: old rank 0's, bit for bit
            assert same_caps                   # a fresh reducer's capacities at P
            assert all(torch.equal(a, b) for a, b in zip(loaded[1], saved[0][1]))
            assert torch.equal(loaded[2], saved[0][2])
            assert loaded[3:] == saved[0][3:]
            assert check["checked"] and check["relative_error"] < 1e-6, check


# -- the DDP hook (gloo ranks) --------------------------------------------------------------------
def _ddp(comm, model):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from oktopk_triton.ddp import SparseAllreduceState, sparse_allreduce_hook
    ddp = DDP(model, bucket_cap_mb=0.001)
    state = SparseAllreduceState(density=0.05, comm=comm, momentum=0.9)
    ddp.register_comm_hook(state, sparse_allreduce_hook)
    return ddp, state


def _ddp_save(comm, tmp):
    from oktopk_triton.kernels import _dispatch
    _dispatch.INTERPRET = False
    ddp, state = _ddp(comm, _model())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    _local_calls_ddp(ddp, opt, comm.rank, 0, 4)
    state.save(tmp)
    red = state.reducers[-1]
    return red.residual.clone(), red.velocity.clone(), state.iter


def _local_calls_ddp(ddp, opt, rank, first, last):
    for t in range(first, last):
        g = torch.Generator().manual_seed(10 * rank + t)
        opt.zero_grad()
        ddp(torch.randn(8, 16, generator=g)).pow(2).mean().backward()
        opt.step()


def _ddp_resume(comm, tmp):
    from oktopk_triton.kernels import _dispatch
    _dispatch.INTERPRET = False
    ddp, state = _ddp(comm, _model())
    state.load(tmp, model=ddp)
    pending = state._pending_state[-1]
    loaded = (pending["residual"].clone(), pending["velocity"].clone(), state.iter)
    n = pending["numel"]
    red = state.reducer(-1, torch.empty(n))                 # built from the loaded state
    fresh = state._build(n, torch.device("cpu"))
    steps = []
    for t in range(3):
        g = _grad(comm.rank, t, n)
        acc = red.residual.double() + red.velocity.double() * red.momentum + g.double()
        out = red(g)
        fresh(g)
        steps.append((acc, out.clone(), red.residual.double().clone(),
                      red.stats["bytes_sent"], fresh.stats["bytes_sent"]))
    other = None
    try:
        from oktopk_triton.ddp import SparseAllreduceState
        SparseAllreduceState(density=0.05, comm=comm).load(
            tmp, model=torch.nn.Linear(16, 5))
    except CheckpointError as e:
        other = str(e)
    return loaded, steps, other


def _barrier(store, key, P):
    import time
    store.add(key, 1)
    while store.add(key, 0) < P:
        time.sleep(0.02)


def _ddp_phases(comm, tmp):
    """One spawn of 6 gloo processes: the first 4 save, then the first 2, 3 and 6 resume, each
    world in a process group of its own (torch.distributed re-initialised per world size)."""
    import torch.distributed as dist

    from oktopk_triton.comm import TorchCommunicator
    rank, out = comm.rank, {}
    dist.destroy_process_group()
    bar = dist.FileStore(os.path.join(tmp, "barrier"), 6)
    for i, P in enumerate((SAVED_AT,) + RESUME_AT):
        if rank < P:
            store = dist.FileStore(os.path.join(tmp, f"store{P}"), P)
            dist.init_process_group("gloo", store=store, rank=rank, world_size=P)
            c = TorchCommunicator()
            out[P] = (_ddp_save if i == 0 else _ddp_resume)(c, os.path.join(tmp, "ckpt"))
            if P != 6:       # the last world (all six) stays for the harness's final barrier
                dist.destroy_process_group()
        _barrier(bar, f"phase{i}", 6)
    return out


def test_ddp_hook_resumes_at_another_world_size(tmp_path):
    res6 = run_gloo(6, _ddp_phases, str(tmp_path))
    saved = [res6[r][SAVED_AT] for r in range(SAVED_AT)]
    for P in RESUME_AT:
        res = [res6[r][P] for r in range(P)]
        _assert_same_mass([r[0][0] for r in res], [s[0] for s in saved], ("residual", P))
        _assert_same_mass([r[0][1] for r in res], [s[1] for s in saved], ("velocity", P))
        assert all(r[0][2] == saved[0][2] for r in res)     # the iteration count, from rank 0
        for t in range(3):
            outs = [r[1][t][1] for r in res]
            assert all(torch.equal(o, outs[0]) for o in outs)
            acc = sum(r[1][t][0] for r in res)
            owed = sum(r[1][t][2] for r in res)
            err = (acc - P * outs[0].double() - owed).abs().max()
            assert float(err) <= 1e-5 * float(acc.abs().max()), (P, t, float(err))
            assert all(r[1][t][3] == r[1][t][4] for r in res)    # a fresh reducer's bytes
        assert all(r[2] is not None and "\n" not in r[2] and "other parameters" in r[2]
                   for r in res), [r[2] for r in res]
