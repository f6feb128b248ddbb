"""Accelerate: register(accelerator, model) on 2 CPU gloo ranks against the real Accelerator.
The replicas stay bitwise equal, save_state writes one file per rank, and load_state into a fresh
Accelerator and model continues bit for bit (against the same run, which saved after its first
epoch), also after a save straight after the load (the state saved as loaded) and a load of that
save. Both runs share one launch of the ranks (a launch imports the framework: ~10 s of CPU);
tests/test_examples.py resumes in fresh processes."""
import importlib.util
import os

import pytest
import torch

import integutil as U
from distutil import run_gloo

if importlib.util.find_spec("accelerate") is None:      # imported in the ranks only
    pytest.skip("needs accelerate", allow_module_level=True)

EPOCHS = 2    # 4 steps an epoch on each rank


def _prepared():
    from accelerate import Accelerator

    from oktopk_triton.integrations.accelerate import register
    acc = Accelerator(cpu=True)
    model = U.net()
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(*U.dataset()),
                                         batch_size=8)
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), loader)
    return acc, model, opt, loader, register(acc, model, density=0.05)


def _epoch(acc, model, opt, loader):
    for x, y in loader:
        opt.zero_grad()
        acc.backward(torch.nn.functional.cross_entropy(model(x), y))
        opt.step()


def _run(comm, tmp, resume):
    U.launched_by_torchrun(comm)
    acc, model, opt, loader, state = _prepared()
    assert acc.num_processes == 2 and type(model).__name__ == "DistributedDataParallel"
    owed = None
    if resume:
        # load, save straight away (no step: the state is saved as loaded), load that, resume
        acc.load_state(os.path.join(tmp, "ckpt"))
        owed = torch.cat([state.residual(p).reshape(-1) for p in model.parameters()])
        acc.save_state(os.path.join(tmp, "again"))
        acc.load_state(os.path.join(tmp, "again"))
        _epoch(acc, model, opt, loader)
    else:
        _epoch(acc, model, opt, loader)
        acc.save_state(os.path.join(tmp, "ckpt"))
        owed = state.reducers[-1].residual.clone()
        for _ in range(EPOCHS - 1):
            _epoch(acc, model, opt, loader)
    return U.flat(model.module), state.iter, owed


def _both(comm, tmp):
    """The first run, the files it saved (as listed then), and the resumed run."""
    import torch.distributed as dist
    first = _run(comm, tmp, False)
    dist.barrier()
    saved = sorted(os.listdir(os.path.join(tmp, "ckpt", "oktopk")))
    dist.barrier()
    return first, saved, _run(comm, tmp, True)


@pytest.mark.slow
def test_accelerate_register_trains_and_resumes_bit_for_bit(tmp_path):
    tmp = str(tmp_path)
    both = run_gloo(2, _both, tmp, timeout=300)
    first = [b[0] for b in both]
    for w, it, owed in first:
        assert it == EPOCHS * 4 and owed.abs().sum() > 0
        assert torch.equal(w, first[0][0])                      # replicas bitwise equal
    assert not torch.equal(first[0][2], first[1][2])
    assert both[0][1] == ["oktopk-rank0-of2.pt", "oktopk-rank1-of2.pt"]
    for r, (w, it, owed) in enumerate(b[2] for b in both):
        assert it == EPOCHS * 4
        assert torch.equal(w, first[r][0]), (w - first[r][0]).abs().max()
        # residual(p) right after the load: what the rank owed, parameter by parameter
        assert torch.equal(owed.sort().values, first[r][2].sort().values)
        again = torch.load(os.path.join(tmp, "again", "oktopk", f"oktopk-rank{r}-of2.pt"),
                           weights_only=True)["state"]["reducers"][-1]["residual"]
        assert torch.equal(again, first[r][2])
