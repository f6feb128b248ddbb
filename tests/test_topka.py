"""TopkA specifics (the cross-algorithm suite in test_algorithms.py covers the rest): its first
step is the sum of every rank's local top-k (torch.topk), with the bytes of one allgather."""
from __future__ import annotations

import pytest
import torch

from conservation import (FLAG_BYTES, first_step_body)
from oktopk_triton.comm.local import LocalCluster


@pytest.mark.parametrize("P", (1, 3, 4))
def test_topka_first_step_is_sum_of_local_topk(P):
    n = 3000
    res = LocalCluster(P).run(first_step_body, "topka", n, 0.01, P)
    k = res[0][4]
    ref = torch.zeros(n)
    for grad, *_ in res:
        i = torch.topk(grad.abs(), k).indices
        ref[i] += grad[i]
    ref /= P
    for p, (grad, out, resid, nbytes, _) in enumerate(res):
        assert torch.equal(out, ref)
        i = torch.topk(grad.abs(), k).indices
        want = grad.clone()
        want[i] = 0
        assert torch.equal(resid, want)
        assert nbytes <= 8 * k * (P - 1) + FLAG_BYTES and nbytes >= 8 * k * (P - 1)
