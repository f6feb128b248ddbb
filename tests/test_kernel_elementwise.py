"""kernels/elementwise.py: the dense step kernels nonfinite_flag, dense_zeros and fill_if."""

import oktopk_triton.kernels as K
import pytest
import torch
from kernel_cases import (
    BACKENDS,
    DEV,
    GRAD_DTYPES,
    gen,
    needs_triton,
)


# ----------------------------------------------------------------------------------------------
# the dense step kernels: nonfinite_flag, dense_zeros, fill_if
# ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
def test_nonfinite_flag(dtype):
    dt = GRAD_DTYPES[dtype]
    x = torch.randn(1001, generator=gen(1)).to(dt).to(DEV)
    f = K.nonfinite_flag(x)
    assert f.dtype == torch.int32 and f.shape == (1,) and f.device == x.device and int(f) == 0
    big = torch.tensor(torch.finfo(dt).max, dtype=dt)
    for bad in (float("nan"), float("inf"), -float("inf")):
        for pos in (0, 500, 1000):
            y = x.clone()
            y[pos] = bad
            assert int(K.nonfinite_flag(y)) == 1, (bad, pos)
    y = x.clone()
    y[3] = big
    y[4] = -big
    assert int(K.nonfinite_flag(y)) == 0
    assert int(K.nonfinite_flag(x[:1])) == 0 and int(K.nonfinite_flag(x.view(7, 143))) == 0
    assert int(K.nonfinite_flag(x[:0])) == 0            # empty: holds no NaN/Inf


def test_dense_zeros_and_counters():
    for n in (0, 1, 4097):
        before = K.counters()
        z = K.dense_zeros(n, DEV)
        after = K.counters()
        assert z.shape == (n,) and z.dtype == torch.float32 and z.device.type == DEV.type
        assert (z == 0).all() and not torch.signbit(z).any()
        assert after["launches"] - before["launches"] == 1
        assert after["bytes"] - before["bytes"] == 4 * n


@needs_triton
@pytest.mark.parametrize("n", [0, 1, 7, 4096, 9001])
@pytest.mark.parametrize("dtype", list(GRAD_DTYPES))
def test_fill_if(n, dtype):
    dt = GRAD_DTYPES[dtype]
    out0 = torch.randn(n, generator=gen(n)).to(dt)
    if n >= 4:   # special bit patterns must survive a flag of 0 unchanged
        out0[0], out0[1], out0[2], out0[3] = -0.0, float("nan"), float("inf"), -float("inf")
    out0 = out0.to(DEV)
    for be in BACKENDS:
        for flag in (torch.zeros((), dtype=torch.int32), torch.zeros(1, dtype=torch.int32)):
            out = out0.clone()
            K.fill_if(out, flag.to(DEV), float("nan"), backend=be)
            assert torch.equal(out.view(torch.int16 if dt != torch.float32 else torch.int32),
                               out0.view(torch.int16 if dt != torch.float32 else torch.int32)), be
        for flag, value in ((torch.ones((), dtype=torch.int32), float("nan")),
                            (torch.full((1,), 7, dtype=torch.int32), -2.5)):
            out = out0.clone()
            K.fill_if(out, flag.to(DEV), value, backend=be)
            want = torch.full((n,), value, dtype=dt)
            assert torch.equal(out.cpu().float().nan_to_num(1234.0),
                               want.float().nan_to_num(1234.0)), be
    before = K.counters()
    K.fill_if(out0.clone(), torch.zeros((), dtype=torch.int32, device=DEV), 0.0)
    assert K.counters()["launches"] - before["launches"] == 1
    assert K.counters()["bytes"] == before["bytes"]
    with pytest.raises(ValueError):
        K.fill_if(torch.zeros(4, 4).t(), torch.zeros((), dtype=torch.int32), 0.0)



def test_fill_if_torch_path_reads_no_flag_on_the_host(monkeypatch):
    """The torch path once read the flag with int() on CPU tensors: a host read in every steady
    step of the path shared with the GPU (caught by the step tests on an H100)."""
    def forbid(self, *args, **kwargs):
        raise AssertionError("host read of a tensor value")
    for attr in ("item", "__bool__", "__int__", "__float__", "__index__", "tolist"):
        monkeypatch.setattr(torch.Tensor, attr, forbid)
    out = torch.ones(5)
    K.fill_if(out, torch.zeros((), dtype=torch.int32), 7.0, backend="torch")
    assert torch.equal(out, torch.ones(5))
    K.fill_if(out, torch.ones(1, dtype=torch.int32), 7.0, backend="torch")
    assert torch.equal(out, torch.full((5,), 7.0))
