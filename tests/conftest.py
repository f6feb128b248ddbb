"""Test configuration.

Without CUDA, Triton kernels run in the interpreter on CPU tensors: TRITON_INTERPRET must be set
before triton decorates the kernels, i.e. before anything imports ``oktopk_triton.kernels``.
"""
import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")


@pytest.fixture
def gloo1(monkeypatch):
    """A default gloo group of one rank in this process (an in-memory store), destroyed after
    the test; the kernels' torch references (fast on CPU)."""
    import torch.distributed as dist
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()




# The tests that start processes (torchrun, the frameworks, the torchft lighthouse and replicas)
# or compile kernels, by measured duration: run first, so that the workers do not end the run
# waiting on one long test started last (pytest-xdist hands tests out in this order).
_LONG_FIRST = ("test_torchft_integration.py", "test_torchft_soak.py", "test_examples.py",
               "test_integration_lightning.py", "test_integration_fsdp.py",
               "test_integration_transformers.py", "test_ddp_resume.py",
               "test_elastic_resume.py", "test_kernel_dispatch.py", "test_train.py",
               "test_compile_check_spills.py", "test_integration_accelerate.py",
               "test_integration_torchft_example.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(_LONG_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))    # stable: else as found
