"""Adam's first moment realigned to the common step (oktopk_triton/modes/realign.py,
``moment_realign``): after a sync every rank's next Adam direction on the moved entries is the
common step's, clipped, whatever its own second moment; entries a sparse step did not move keep
their moment; the weights, conservation and identical replicas are untouched; no bytes are
added; a save/load mid interval continues bit for bit; bad values get one-line errors; the CLI
option reaches the reducer."""
import argparse

import pytest
import torch

from conservation import flat as _flat
from conservation import toy_calls, whole_and_resumed
from conservation import toy_model as _model
from oktopk_triton import SparseAllreduce
from oktopk_triton.bench import loops, train
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.modes.local_steps import OPTIONS
from oktopk_triton.modes.realign import CLIP, MomentRealign


def _direction(opt):
    """Each parameter's next Adam direction m_hat / (sqrt(v_hat) + eps), flat."""
    out = []
    for g in opt.param_groups:
        b1, b2 = g["betas"]
        for p in g["params"]:
            st = opt.state[p]
            t = float(st["step"])
            out.append(st["exp_avg"] / (1 - b1 ** t)
                       / ((st["exp_avg_sq"] / (1 - b2 ** t)).sqrt() + g["eps"]))
    return _flat(out)


def _body(comm, alg, amount, wd, calls=6, H=3, lr=0.01):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=lr, weight_decay=wd)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1.0 / (1 + i))   # lr varies
    kw = {"backend": "torch"} if alg == "oktopk" else {}
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.2, algorithm=alg, sync_every=H,
                          moment_realign=amount, **kw)
    ls = sar.local_steps
    seen = {}

    def after_step(*_):      # the pseudo-gradient the sync will see
        if ls.position + 1 == H:
            seen["delta"] = _flat(m.parameters()).double() - _flat(ls.anchor).double()
    opt.register_step_post_hook(after_step)
    gen = torch.Generator().manual_seed(7 + comm.rank)
    lrs, log = [], []
    fed = torch.zeros(sar.numel, dtype=torch.float64)
    for _ in range(calls):
        opt.zero_grad()
        m(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()
        lrs.append(opt.param_groups[0]["lr"])
        out = sar.reduce_updates(opt)
        sched.step()
        if sar.stats["synced"]:
            fed += seen["delta"]
            log.append(dict(step=out.clone(), lr_sum=sum(lrs), d=_direction(opt),
                            w=_flat(m.parameters()), sent=sar.stats["bytes_sent"],
                            alg_sent=sar.algorithm.stats["bytes_sent"]))
            lrs = []
    return log, sar.residual.clone().double(), fed


@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_the_next_direction_is_the_common_steps(wd):
    P = 3
    res = LocalCluster(P).run(_body, "dense", 1.0, wd)
    for i in range(2):                                   # both syncs
        d = [r[0][i]["d"] for r in res]
        e = res[0][0][i]
        want = (-e["step"] / e["lr_sum"] - wd * e["w"]).clamp(-CLIP, CLIP)
        for dp in d:                                      # every rank: the common direction
            assert torch.allclose(dp, want, rtol=1e-4, atol=1e-6), (dp - want).abs().max()
        assert all(torch.equal(r[0][i]["w"], e["w"]) for r in res)     # replicas identical
        assert all(r[0][i]["sent"] == r[0][i]["alg_sent"] for r in res)  # no bytes added


def test_off_leaves_each_ranks_own_direction():
    res = LocalCluster(3).run(_body, "dense", 0.0, 0.0)
    assert not torch.allclose(res[0][0][0]["d"], res[1][0][0]["d"])


def test_a_blend_moves_part_way_and_unmoved_entries_keep_their_moment():
    P = 2
    full = LocalCluster(P).run(_body, "oktopk", 1.0, 0.0)
    none = LocalCluster(P).run(_body, "oktopk", 0.0, 0.0)
    half = LocalCluster(P).run(_body, "oktopk", 0.5, 0.0)
    for r_full, r_none, r_half in zip(full, none, half):
        e = r_full[0][0]                          # first sync: all three equal up to it
        moved = e["step"] != 0
        assert moved.any() and (~moved).any()    # density 0.2: a sparse step
        assert torch.equal(r_full[0][0]["d"][~moved], r_none[0][0]["d"][~moved])
        assert not torch.allclose(r_full[0][0]["d"][moved], r_none[0][0]["d"][moved])
        mid = (r_full[0][0]["d"] + r_none[0][0]["d"]) / 2     # linear in m at a fixed v
        assert torch.allclose(r_half[0][0]["d"], mid, rtol=1e-4, atol=1e-6)
        assert torch.equal(r_full[0][0]["step"], r_none[0][0]["step"])  # the step is untouched


def test_conservation_and_identical_replicas_hold():
    P = 3
    res = LocalCluster(P).run(_body, "oktopk", 1.0, 0.0, 9)
    fed = sum(r[2] for r in res)
    delivered = sum(e["step"].double() for e in res[0][0])
    rhs = P * delivered + sum(r[1] for r in res)
    assert torch.allclose(fed, rhs, rtol=0, atol=1e-6), (fed - rhs).abs().max()
    for i in range(3):
        assert all(torch.equal(r[0][i]["w"], res[0][0][i]["w"]) for r in res)


def _resume_body(comm, calls, cut):
    def make():
        m = _model(4)
        opt = torch.optim.AdamW(m.parameters(), lr=0.02)
        sar = SparseAllreduce(m.parameters(), comm=comm, density=0.3, sync_every=3,
                              moment_realign=0.7, backend="torch")
        return m, opt, sar

    def run(m, opt, sar, first, last):
        toy_calls(comm.rank, m, opt, sar, first, last)

    whole, resumed, sums = whole_and_resumed(make, run, calls, cut,
                                             at_load=lambda r: r[2].local_steps.realign.lr_sums)
    m1 = [whole[1].state[p]["exp_avg"] for p in whole[0].parameters()]
    m2 = [resumed[1].state[p]["exp_avg"] for p in resumed[0].parameters()]
    return (sums, torch.equal(_flat(whole[0].parameters()), _flat(resumed[0].parameters())),
            torch.equal(_flat(m1), _flat(m2)))


def test_save_load_mid_interval_continues_bit_for_bit():
    for sums, same_w, same_m in LocalCluster(2).run(_resume_body, 9, 4):
        assert sums == [pytest.approx(0.02)] and same_w and same_m    # one call into interval 2


@pytest.mark.parametrize("value", [-0.5, 1.5, float("nan"), True, "1"])
def test_bad_values_raise_one_line(value):
    with pytest.raises(ValueError, match=r"moment_realign must be a number in \(0, 1\]") as e:
        SparseAllreduce(_model().parameters(), comm=LocalCluster(1).communicator(0),
                        sync_every=2, moment_realign=value)
    assert "\n" not in str(e.value)


def test_off_builds_nothing_and_on_turns_local_steps_on():
    assert MomentRealign.build(0) is None and MomentRealign.build(0.0) is None
    sar = SparseAllreduce(_model().parameters(), comm=LocalCluster(1).communicator(0),
                          moment_realign=1.0)
    assert sar.local_steps.describe()["moment_realign"] == 1.0
    assert sar.local_steps.state_dict()["realign"] == {"moment_realign": 1.0, "lr_sums": []}


def test_cli_option_reaches_the_reducer():
    assert "moment_realign" in OPTIONS
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    args = p.parse_args(["--model", "gpt", "--algorithms", "dense", "--option", "sync_every=4",
                         "--option", "moment_realign=1.0"])
    assert train.check_args(args) == ""
    assert loops.local_step_options(dict(args.option)) == dict(sync_every=4, moment_realign=1.0)
    bad = p.parse_args(["--model", "gpt", "--algorithms", "dense", "--option",
                        "moment_realign=2"])
    assert "moment_realign must be a number in (0, 1]" in train.check_args(bad)
