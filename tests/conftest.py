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


