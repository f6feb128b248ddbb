"""Ok-Topk's ``sweep`` option (oktopk_triton/algorithms/sweep.py): a rotating window of the
residual reduced densely at 2 bits a value, beside the sparse step.

The coding (what the sender keeps is what the owner reads), the step contract with the window
on (conservation, out bitwise identical, P = 1 to 5, fp32 and q2 wires, a non-finite step), the
bytes against the schedule, the window's coverage, its state, and the refusals.
"""
import pytest
import torch

from conservation import assert_bitwise_agreement, assert_conservation, mixed, run_steps
from oktopk_triton.algorithms.oktopk import OkTopk
from oktopk_triton.algorithms.schedule import schedule_of
from oktopk_triton.algorithms.sweep import BLOCK, ResidualSweep
from oktopk_triton.comm.local import SingleCommunicator

BE = {"backend": "torch"}


def test_layout_whole_blocks_and_words():
    s, blocks, block, words = ResidualSweep.layout(1_000_000, 64, 0.05)
    assert block % 16 == 0 and block <= BLOCK and s == blocks * block
    assert 64 * s >= 50_000 and 64 * (s - 16 * blocks) < 50_000   # the least whole blocks of 16
    assert words == 2 * blocks + s // 16
    # the bytes formula of the module doc: about 0.53·sweep·n a step
    assert 0.5 < 2 * 63 * 4 * words / (0.05 * 1_000_000) < 0.56


def test_coding_reads_back_bit_for_bit_at_two_levels_a_block():
    sw = ResidualSweep(4096, SingleCommunicator(), 0.5, torch.device("cpu"))
    g = torch.Generator().manual_seed(1)
    v = torch.randn(1, sw.s, generator=g) * torch.logspace(-3, 1, sw.s)
    v[0, :sw.block] = 0.0                                  # an all-zero block codes as zeros
    q, words = sw.encode(v)
    assert torch.equal(sw.decode(words), q)
    assert torch.equal(q[0, :sw.block], torch.zeros(sw.block))
    for b in range(1, sw.blocks):
        blk, qb = v[0, b * sw.block:(b + 1) * sw.block], q[0, b * sw.block:(b + 1) * sw.block]
        assert qb.abs().unique().numel() <= 2
        assert torch.equal(torch.sign(qb), torch.sign(blk))
        # nearer the block's magnitudes than one level for all (its mean)
        assert (blk - qb).norm() < (blk.abs() - blk.abs().mean()).norm() + 1e-6


@pytest.mark.parametrize("P", [1, 3, 4])
@pytest.mark.parametrize("fmt", ["fp32", "q2"])
def test_contract_and_bytes_with_the_window(P, fmt):
    n, steps, sweep = 6000 * P, 5, 0.1
    res = run_steps("oktopk", P, n, steps, 0.01, mixed(P), wire_format=fmt, check_finite="off",
                    sweep=sweep, **BE)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    if P == 1:
        return
    sent = res.stat_array("bytes_sent")[1:]
    want = sum(s.bytes_per_rank for s in schedule_of("oktopk", n, res.k, P, check_finite="off",
                                                     wire_format=fmt, sweep=sweep, **BE))
    base = sum(s.bytes_per_rank for s in schedule_of("oktopk", n, res.k, P, check_finite="off",
                                                     wire_format=fmt, **BE))
    assert (sent == want).all(), (sent, want)
    words = ResidualSweep.layout(n, P, sweep)[3]
    assert want - base == 4 * words * 2 * (P - 1)


def test_odd_world_momentum_and_nonfinite_step_leave_residuals_bit_for_bit():
    res = run_steps("oktopk", 5, 9000, 8, 0.02, mixed(7), momentum=0.9, wire_format="q2",
                    nonfinite={4: 3}, sweep=0.2, **BE)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    assert res.unchanged[4]


def test_every_position_reaches_out_within_the_windows_period():
    """A hot spot holds the top-k; everything else is small. Without the sweep the small
    entries never reach out in these steps; with it every one does within ceil(1/sweep)."""
    n, P, sweep = 8000, 4, 0.25

    def grads(rank, step, n):
        g = torch.full((n,), 1e-3 * (rank + 1))
        g[:40] = 10.0
        return g

    reached = {}
    for sw in (0.0, sweep):
        res = run_steps("oktopk", P, n, 4, 0.005, grads, check_finite="off", sweep=sw, **BE)
        outs = torch.stack([o[0].float() for o in res.outs])
        reached[sw] = (outs[:, 40:] != 0).any(0)
    assert not reached[0.0].any()
    assert reached[sweep].all()


def test_state_dict_keeps_the_window_and_loads_without_one():
    a = OkTopk(8000, SingleCommunicator(), 0.01, sweep=0.3, **BE)
    a._sweep.offset.fill_(1234)
    sd = a.state_dict()
    b = OkTopk(8000, SingleCommunicator(), 0.01, sweep=0.3, **BE)
    b.load_state_dict(sd)
    assert int(b._sweep.offset) == 1234
    sd.pop("sweep_offset")
    b.load_state_dict(sd)
    assert int(b._sweep.offset) == 0
    assert "sweep_offset" not in OkTopk(8000, SingleCommunicator(), 0.01, **BE).state_dict()


@pytest.mark.parametrize("bad,match", [
    (1.0, r"sweep must be a fraction of n in \[0, 1\)"),
    ("0.1", r"sweep must be a fraction of n in \[0, 1\)"),
    (True, r"sweep must be a fraction of n in \[0, 1\)"),
    (0.999, r"does not fit n = 100; use a smaller sweep"),
])
def test_refusals_are_one_line(bad, match):
    with pytest.raises(ValueError, match=match) as e:
        OkTopk(100, SingleCommunicator(), 0.05, sweep=bad, **BE)
    assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=match):
        schedule_of("oktopk", 100, 5, 4, sweep=bad)
