"""Shared pieces of the framework integration tests (test_integration_*.py): each rank of
``run_gloo`` plays a process the framework's launcher started (torchrun's environment, a gloo
group already up), trains a small classifier and reports its weights."""
import os

import torch

N, FEATURES, CLASSES = 64, 12, 5


def launched_by_torchrun(comm) -> None:
    """The environment torchrun gives a rank: the frameworks then neither launch processes nor
    initialise another group (the one run_gloo set up is used); plain-torch kernels."""
    os.environ.update(RANK=str(comm.rank), LOCAL_RANK=str(comm.rank), NODE_RANK="0",
                      GROUP_RANK="0", WORLD_SIZE=str(comm.world_size),
                      LOCAL_WORLD_SIZE=str(comm.world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=os.environ.get("MASTER_PORT", "29500"))
    from oktopk_triton.kernels import _dispatch
    _dispatch.INTERPRET = False


def dataset():
    """The same N samples on every rank (the frameworks' samplers split them)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N, FEATURES, generator=g)
    y = (x @ torch.randn(FEATURES, CLASSES, generator=g)).argmax(1)
    return x, y


def net():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 32), torch.nn.ReLU(),
                               torch.nn.Linear(32, CLASSES))


def flat(model):
    return torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
