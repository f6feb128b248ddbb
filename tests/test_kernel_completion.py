"""kernels/completion.py: completed sums' values-only rows (Ok-Topk ``complete_sums=True``).

Round trips (what a receiver adds is the wire value the sender kept, and the sender keeps the
rest in place), the q2 scales against an independent fp64 computation and each value at the
nearer centroid, the same scales whatever the order of a row's values, the owner's sum in rank
order and its ``P·(f - q(f))``, the velocity zeroed where delivered; the Triton passes under the
interpreter (TRITON_INTERPRET=1) give the torch reference's bits, alone and through Ok-Topk
steps at 2, 3 and 5 ranks; the launches each call records; one-line errors for bad arguments.
"""
import os

import pytest
import torch

from conservation import assert_bitwise_agreement, assert_conservation, mixed, run_steps
from oktopk_triton import kernels as K
from oktopk_triton.kernels import _dispatch
from oktopk_triton.kernels import completion as C

INTERP = os.environ.get("TRITON_INTERPRET") == "1"
needs_interp = pytest.mark.skipif(not INTERP, reason="needs TRITON_INTERPRET=1")
BACKENDS = ["torch"] + (["triton"] if INTERP else [])
FORMATS = ["fp32", "q2"]


def _rows(R=4, cap=1500, n=20000, seed=3, counts=(1500, 5, 1, 0)):
    """Region offsets, distinct ascending region-relative indices, counts, and a residual
    whose rows differ in scale by 10^5 (row 2's single value is sent as itself)."""
    g = torch.Generator().manual_seed(seed)
    offs = torch.tensor([n * j // R for j in range(R)], dtype=torch.int64)
    idx = torch.stack([torch.randperm(n // R, generator=g)[:cap].sort().values
                       for _ in range(R)]).to(torch.int32)
    cnt = torch.tensor(counts, dtype=torch.int32)
    idx = torch.where(torch.arange(cap) < cnt.view(R, 1).long(), idx, -1)
    res = torch.randn(n, generator=g) * torch.logspace(-3, 2, R).repeat_interleave(n // R)
    res[offs[0] + idx[0, :7].long()] = torch.tensor([0.0, -0.0, 1e-30, -3.0, 3.0, 3.0, 1e-3])
    return offs, idx, cnt, res


def _valid_pos(offs, idx, cnt):
    valid = torch.arange(idx.shape[1]) < cnt.view(-1, 1).long()
    return valid, (offs.view(-1, 1) + idx.long().clamp(min=0))


def _encode(fmt, backend, **kw):
    offs, idx, cnt, res = _rows(**kw)
    before = res.clone()
    msg = torch.zeros(idx.shape[0], K.values_words(idx.shape[1], fmt), dtype=torch.int32)
    K.owed_encode(res, offs, idx, cnt, msg, fmt=fmt, backend=backend)
    out = torch.zeros_like(res)
    K.values_add(msg, offs, idx, cnt, out, fmt=fmt, backend=backend)
    return offs, idx, cnt, before, res, msg, out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_keeps_what_the_wire_dropped(fmt, backend):
    offs, idx, cnt, before, res, msg, out = _encode(fmt, backend)
    valid, pos = _valid_pos(offs, idx, cnt)
    at = pos[valid]
    assert msg.shape == (4, 1500 if fmt == "fp32" else 2 + 94)
    # out + residual is the residual before, bit for bit where nothing was rounded twice
    torch.testing.assert_close(out[at] + res[at], before[at], rtol=0, atol=1e-6)
    rest = torch.ones_like(before, dtype=torch.bool)
    rest[at] = False
    assert torch.equal(res[rest], before[rest]) and not bool(out[rest].any())
    if fmt == "fp32":
        assert torch.equal(out[at], before[at]) and not bool(res[at].any())
        return
    for s in range(3):                    # 2-bit: the sign, and the nearer of two levels
        p = pos[s][valid[s]]
        a, q = before[p].abs(), out[p].abs()
        lv = q.unique()
        assert len(lv) <= 2
        assert bool(((torch.sign(out[p]) == torch.sign(before[p])) | (before[p] == 0)).all())
        near = lv[(a.view(-1, 1) - lv.view(1, -1)).abs().argmin(1)]
        ties = (a.view(-1, 1) - lv.view(1, -1)).abs()
        assert bool((q == near).all() | (ties.min(1).values == ties.max(1).values).any())
    assert float(out[pos[2, 0]]) == float(before[pos[2, 0]])   # one value: sent as itself


@pytest.mark.parametrize("backend", BACKENDS)
def test_q2_centroids_against_fp64(backend):
    """base and step are the means of the values below and at-or-above the row's mean
    (fp64 here), to the fixed point's rounding."""
    offs, idx, cnt, before, res, msg, out = _encode("q2", backend)
    valid, pos = _valid_pos(offs, idx, cnt)
    a = before[pos[0]].abs().double()
    mean = a.mean()
    lo, hi = a[a < mean].mean(), a[a >= mean].mean()
    base, step = msg[0, :2].view(torch.float32).double()
    assert float(base) == pytest.approx(float(lo), rel=1e-5)
    assert float(base + step) == pytest.approx(float(hi), rel=1e-5)


def test_q2_scales_do_not_depend_on_the_order():
    offs, idx, cnt, res = _rows()
    m1 = torch.zeros(4, K.values_words(1500, "q2"), dtype=torch.int32)
    m2 = m1.clone()
    K.owed_encode(res.clone(), offs, idx, cnt, m1, fmt="q2", backend="torch")
    idx2 = idx.clone()
    idx2[0] = idx[0][torch.randperm(1500, generator=torch.Generator().manual_seed(1))]
    K.owed_encode(res.clone(), offs, idx2, cnt, m2, fmt="q2", backend="torch")
    assert torch.equal(m1[:, :2], m2[:, :2])         # row 0 full, its values in another order


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_owner_sum_and_slot_encode(fmt, backend):
    """The owner's ``f`` is the rows' sum in rank order times 1/P; its residual gains
    ``P·(f - q(f))`` at its row's positions and nothing elsewhere."""
    offs, idx, cnt, res = _rows(counts=(1500, 700, 3, 0))
    P, cap = 4, 1500
    recv = torch.zeros(P, K.values_words(cap, fmt), dtype=torch.int32)
    for s in range(P):     # P senders' different values at the owner's row (row 0)
        K.owed_encode(res * (s + 1) - s, offs[:1], idx[:1], cnt[:1], recv[s:s + 1], fmt=fmt,
                      backend="torch")
    f = torch.empty(cap)
    K.owner_sum(recv, cnt[:1], f, 1.0 / P, fmt=fmt, backend=backend)
    ref = torch.zeros(cap)
    for s in range(P):
        d = torch.zeros(res.numel())
        K.values_add(recv[s:s + 1], offs[:1], idx[:1], cnt[:1], d, fmt=fmt, backend="torch")
        ref = ref + d[offs[0] + idx[0].long().clamp(min=0)]
    assert torch.equal(f, torch.where(torch.arange(cap) < 1500, ref * (1.0 / P), 0.0))
    slot = torch.zeros(1, K.values_words(cap, fmt), dtype=torch.int32)
    before = res.clone()
    K.slot_encode(f.view(1, cap), res, offs[:1], idx[:1], cnt[:1], slot, float(P), fmt=fmt,
                  backend=backend)
    got = torch.zeros_like(res)
    K.values_add(slot, offs[:1], idx[:1], cnt[:1], got, fmt=fmt, backend="torch")
    at = offs[0] + idx[0].long()
    torch.testing.assert_close(res[at] - before[at], P * (f - got[at]), rtol=0, atol=1e-5)
    rest = torch.ones_like(res, dtype=torch.bool)
    rest[at] = False
    assert torch.equal(res[rest], before[rest])


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_add_zeroes_the_delivered_velocity(backend):
    offs, idx, cnt, before, res, msg, out = _encode("q2", "torch")
    vel = torch.ones_like(res)
    out2 = torch.full_like(res, 2.0)
    K.values_add(msg, offs, idx, cnt, out2, vel, fmt="q2", backend=backend)
    valid, pos = _valid_pos(offs, idx, cnt)
    torch.testing.assert_close(out2 - 2.0, out, rtol=0, atol=1e-5)
    assert not bool(vel[pos[valid]].any())
    assert int((vel == 0).sum()) == int(valid.sum())


@needs_interp
@pytest.mark.parametrize("fmt", FORMATS)
def test_triton_passes_give_the_reference_bits(fmt):
    got = [_encode(fmt, b) for b in ("torch", "triton")]
    for a, b in zip(*got):
        assert torch.equal(a, b)
    offs, idx, cnt, res = _rows(counts=(1500, 700, 3, 0))
    recv = torch.randint(-2 ** 31, 2 ** 31 - 1, (5, K.values_words(1500, fmt)), dtype=torch.int32)
    if fmt == "fp32":      # finite values
        recv = (torch.randn(5, 1500, generator=torch.Generator().manual_seed(2))
                .view(torch.int32))
    else:
        recv[:, :2] = torch.tensor([0.5, 1.25]).view(torch.int32)
    fs = []
    for b in ("torch", "triton"):
        f = torch.empty(1500)
        K.owner_sum(recv, cnt[1:2], f, 0.2, fmt=fmt, backend=b)
        r = res.clone()
        slot = torch.zeros(1, K.values_words(1500, fmt), dtype=torch.int32)
        K.slot_encode(f.view(1, -1), r, offs[1:2], idx[1:2], cnt[1:2], slot, 5.0, fmt=fmt,
                      backend=b)
        fs.append((f, r, slot))
    for a, b in zip(*fs):
        assert torch.equal(a, b)


def _inputs(device="cpu"):
    return [t.to(device) for t in _rows(counts=(1500, 700, 3, 0))]


def _phase(fmt, backend, inputs):
    """The four calls of one completion, as Ok-Topk makes them (rank 1 of 4 owning row 1):
    what each wrote."""
    offs, idx, cnt, res = inputs
    device = res.device
    R, cap = idx.shape
    vw = K.values_words(cap, fmt)
    msg = torch.zeros(R, vw, dtype=torch.int32, device=device)
    K.owed_encode(res, offs, idx, cnt, msg, fmt=fmt, backend=backend)
    recv = torch.cat([msg[1:2], msg[1:2] ^ 0x10, msg[1:2], msg[1:2]])   # four senders' rows
    if fmt == "fp32":
        scale = torch.arange(4, dtype=torch.float32, device=device).view(4, 1) - 0.5
        recv = (msg[1:2].view(torch.float32) * scale).view(torch.int32)
    f = torch.empty(1, cap, device=device)
    K.owner_sum(recv, cnt[1:2], f.view(-1), 0.25, fmt=fmt, backend=backend)
    slot = torch.zeros(1, vw, dtype=torch.int32, device=device)
    K.slot_encode(f, res, offs[1:2], idx[1:2], cnt[1:2], slot, 4.0, fmt=fmt, backend=backend)
    gathered = torch.cat([slot, msg[2:3], slot, msg[0:1]])
    out = torch.zeros_like(res)
    vel = torch.ones_like(res)
    K.values_add(gathered, offs, idx, cnt, out, vel, fmt=fmt, backend=backend)
    return [msg, f, slot, res, out, vel]


@needs_interp
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_completion_triton_gives_the_reference_bits(fmt):
    for a, b in zip(_phase(fmt, "torch", _inputs()), _phase(fmt, "triton", _inputs())):
        assert torch.equal(a, b)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", FORMATS)
def test_cuda_completion_gives_the_reference_bits_without_a_host_sync(fmt):
    """Compiled: the integer sums and the owner's fixed order make the atomics' order
    irrelevant, so the GPU gives the CPU reference's bits; no call waits for the host."""
    ref = _phase(fmt, "torch", _inputs())
    _phase(fmt, "triton", _inputs("cuda"))            # compile first
    inputs = _inputs("cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = _phase(fmt, "triton", inputs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for a, b in zip(ref, got):
        assert torch.equal(a, b.cpu())


def test_launches_recorded():
    offs, idx, cnt, res = _rows()
    for fmt, want in (("q2", 5), ("fp32", 1)):
        msg = torch.zeros(4, K.values_words(1500, fmt), dtype=torch.int32)
        before = _dispatch.counters()["launches"]
        K.owed_encode(res, offs, idx, cnt, msg, fmt=fmt, backend="torch")
        assert _dispatch.counters()["launches"] - before == want
        before = _dispatch.counters()["launches"]
        K.values_add(msg, offs, idx, cnt, res.clone(), fmt=fmt, backend="torch")
        assert _dispatch.counters()["launches"] - before == 1


def test_every_kernel_has_a_compile_variant():
    names = {v[1].fn.__name__ if hasattr(v[1], "fn") else v[1].__name__
             for v in C.compile_variants()}
    assert names == {"_values_stats_kernel", "_values_sum_kernel", "_values_finish_kernel",
                     "_owner_sum_kernel", "_values_add_kernel"}


def test_bad_arguments_give_one_line_errors():
    offs, idx, cnt, res = _rows()
    msg = torch.zeros(4, K.values_words(1500, "q2"), dtype=torch.int32)
    cases = [
        (lambda: K.owed_encode(res, offs, idx, cnt, msg, fmt="q3"), "fmt must be one of"),
        (lambda: K.owed_encode(res, offs, idx, cnt, msg[:, :5], fmt="q2"),
         r"msg must be int32 \[4, 96\]"),
        (lambda: K.owed_encode(res, offs[:3], idx, cnt, msg, fmt="q2"),
         "offs and cnt must be contiguous with 4 entries"),
        (lambda: K.owed_encode(res, offs, idx.float(), cnt, msg, fmt="q2"),
         r"idx must be int32/int64 \[R, cap\]"),
        (lambda: K.slot_encode(res[:1500].view(1, -1).double(), res, offs[:1], idx[:1],
                               cnt[:1], msg[:1], 4.0, fmt="q2"), r"f must be fp32 \[1, 1500\]"),
        (lambda: K.owner_sum(msg[:, :3], cnt[:1], torch.empty(1500), 0.25, fmt="q2"),
         r"recv must be int32 \[R, 96\]"),
    ]
    for call, match in cases:
        with pytest.raises(ValueError, match=match) as e:
            call()
        assert "\n" not in str(e.value)


# -- through Ok-Topk steps: the interpreted kernels give the CPU path's bits -------------------
@needs_interp
# each wire once, one at an even and one at an odd P (the full grid, with P = 5, took ~10 min
# of interpreter time; tests/test_oktopk.py runs complete sums at P = 2, 3, 5 on both wires)
@pytest.mark.parametrize("wire,P", [("fp32", 3), ("q2", 2)])
def test_oktopk_complete_sums_triton_matches_torch(P, wire):
    args = ("oktopk", P, 3000, 6, 0.02, mixed(P))
    tri = run_steps(*args, backend="triton", wire_format=wire, complete_sums=True,
                    momentum=0.9)
    ref = run_steps(*args, backend="torch", wire_format=wire, complete_sums=True,
                    momentum=0.9)
    assert_conservation(tri)
    assert_bitwise_agreement(tri)
    for a, b in zip(tri.outs, ref.outs):
        for x, y in zip(a, b):
            assert torch.equal(x, y)
    for x, y in zip(tri.residuals, ref.residuals):
        assert torch.equal(x, y)
