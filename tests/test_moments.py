"""Optimizer moments kept in step (oktopk_triton/modes/moments.py, ``moment_sync_every``): after a
moment sync every rank's Adam moments are the average over ranks, bitwise identical (LocalCluster
and gloo ranks); between them they are each rank's own; conservation and identical replicas still
hold; the bytes are counted (the sync's bytes_sent, amortised in bytes_per_step); a save/load
round trip continues bit for bit; bad values and optimizers without moments get one-line errors;
``oktopk-bench train --option moment_sync_every=K`` reaches the reducer."""
import argparse

import pytest
import torch

from conservation import flat as _flat
from conservation import toy_calls, whole_and_resumed
from conservation import toy_model as _model
from distutil import run_pooled_torch
from oktopk_triton import SparseAllreduce
from oktopk_triton.bench import loops, train
from oktopk_triton.comm.base import ring_allreduce_bytes
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.modes.local_steps import OPTIONS
from oktopk_triton.modes.moments import MomentSync


def _moments(opt, key):
    return _flat([opt.state[p][key] for g in opt.param_groups for p in g["params"]])


def _opts(alg):
    return {"backend": "torch"} if alg == "oktopk" else {}


# -- averaging, identical moments, conservation, bytes ------------------------------------------
def _body(comm, alg, H, K, which, dtype, calls):
    m = _model()
    opt = torch.optim.AdamW(m.parameters(), lr=0.02)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.1, algorithm=alg, sync_every=H,
                          moment_sync_every=K, moment_sync=which, moment_dtype=dtype,
                          **_opts(alg))
    ls = sar.local_steps
    seen = {}

    def after_step(*_):      # the moments and the pseudo-gradient the sync will see
        if ls.position + 1 == H:
            seen["m1"], seen["m2"] = _moments(opt, "exp_avg"), _moments(opt, "exp_avg_sq")
            seen["delta"] = _flat(m.parameters()) - _flat(ls.anchor)
    opt.register_step_post_hook(after_step)
    gen = torch.Generator().manual_seed(40 + comm.rank)
    n = sar.numel
    sum_fed, sum_out = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    log = []
    for _ in range(calls):
        opt.zero_grad()
        m(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()
        out = sar.reduce_updates(opt)
        st = dict(sar.stats)
        if not st["synced"]:
            continue
        sum_fed += seen["delta"].double()
        sum_out += out.double()
        log.append(dict(pre1=seen["m1"], pre2=seen["m2"], m1=_moments(opt, "exp_avg"),
                        m2=_moments(opt, "exp_avg_sq"), w=_flat(m.parameters()),
                        sent=int(st["bytes_sent"]), per_step=float(st["bytes_per_step"]),
                        alg_sent=int(sar.algorithm.stats["bytes_sent"])))
    return sum_fed, sum_out, sar.residual.double(), log, sar.numel


@pytest.mark.parametrize("alg,which,dtype", [("dense", "both", "fp32"),
                                             ("oktopk", "both", "fp32"),
                                             ("oktopk", "second", "bf16")])
def test_moment_sync_averages_and_keeps_the_invariants(alg, which, dtype):
    P, H, K, calls = 3, 2, 2, 8              # 4 syncs: the moments are averaged at the 2nd, 4th
    res = LocalCluster(P).run(_body, alg, H, K, which, dtype, calls)
    lhs = sum(r[0] for r in res)
    rhs = P * res[0][1] + sum(r[2] for r in res)
    assert torch.allclose(lhs, rhs, rtol=0, atol=1e-5), (lhs - rhs).abs().max()
    logs = [r[3] for r in res]
    n = res[0][4]
    keys = ("m1", "m2") if which == "both" else ("m2",)
    size = 4 if dtype == "fp32" else 2
    one_sync = ring_allreduce_bytes(n * len(keys) * size, P)
    for s in range(calls // H):
        entries = [lg[s] for lg in logs]
        assert all(torch.equal(entries[0]["w"], e["w"]) for e in entries[1:])  # replicas
        averaged = (s + 1) % K == 0
        for key in ("m1", "m2"):
            same = all(torch.equal(entries[0][key], e[key]) for e in entries[1:])
            assert same == (averaged and key in keys), (s, key)
            pre = torch.stack([e["pre" + key[1]] for e in entries])
            if same:        # the average over ranks of what each rank's optimizer held
                tol = 1e-6 if dtype == "fp32" else 1e-2
                assert torch.allclose(entries[0][key], pre.mean(0), rtol=tol, atol=1e-9)
            else:           # untouched: each rank's own
                assert all(torch.equal(e[key], e["pre" + key[1]]) for e in entries)
        for e in entries:   # bytes: counted on the averaging sync, amortised on every sync
            assert e["sent"] == e["alg_sent"] + (one_sync if averaged else 0)
            assert e["per_step"] == pytest.approx((e["alg_sent"] + one_sync / K) / H)


def _gloo_body(comm):
    m = _model(6)
    opt = torch.optim.AdamW(m.parameters(), lr=0.02)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.2, sync_every=2,
                          moment_sync_every=1, moment_sync="both", moment_dtype="bf16",
                          backend="torch")
    gen = torch.Generator().manual_seed(comm.rank)
    for _ in range(4):
        opt.zero_grad()
        m(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()
        sar.reduce_updates(opt)
    return _moments(opt, "exp_avg"), _moments(opt, "exp_avg_sq"), _flat(m.parameters())


def test_moments_bitwise_identical_on_gloo_ranks():
    res = run_pooled_torch(3, _gloo_body, timeout=120)
    for i in range(3):
        assert all(torch.equal(res[0][i], r[i]) for r in res[1:]), i
    assert res[0][1].abs().sum() > 0


# -- a NaN on one rank stays that rank's own ---------------------------------------------------
def _nan_body(comm):
    m = _model(7)
    opt = torch.optim.AdamW(m.parameters(), lr=0.02)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.2, sync_every=2,
                          moment_sync_every=1, backend="torch")
    gen = torch.Generator().manual_seed(comm.rank)
    for t in range(2):
        opt.zero_grad()
        m(torch.randn(6, 8, generator=gen)).pow(2).mean().backward()
        if comm.rank == 1 and t == 1:
            next(m.parameters()).grad[0, 0] = float("nan")
        sar.reduce_updates(opt)
    return _moments(opt, "exp_avg_sq"), _flat(m.parameters())


def test_a_nan_moment_is_not_spread():
    res = LocalCluster(3).run(_nan_body)
    v = [r[0] for r in res]
    assert torch.isnan(v[1][0]) and torch.isfinite(v[0][0]) and torch.isfinite(v[2][0])
    assert torch.equal(v[0][1:], v[1][1:]) and torch.equal(v[0][1:], v[2][1:])
    assert torch.equal(res[0][1], res[1][1]) and torch.isfinite(res[0][1]).all()


# -- save / load -----------------------------------------------------------------------------
def _resume_body(comm, calls, cut):
    def make():
        m = _model(4)
        opt = torch.optim.AdamW(m.parameters(), lr=0.02)
        sar = SparseAllreduce(m.parameters(), comm=comm, density=0.1, sync_every=2,
                              moment_sync_every=3, moment_sync="second", backend="torch")
        return m, opt, sar

    def run(m, opt, sar, first, last):
        toy_calls(comm.rank, m, opt, sar, first, last)

    whole, resumed, count = whole_and_resumed(make, run, calls, cut,
                                              at_load=lambda r: r[2].local_steps.moments.count)
    return (count, torch.equal(_flat(whole[0].parameters()), _flat(resumed[0].parameters())),
            torch.equal(_moments(whole[1], "exp_avg_sq"), _moments(resumed[1], "exp_avg_sq")),
            _moments(whole[1], "exp_avg_sq"))


def test_save_load_mid_period_continues_bit_for_bit():
    res = LocalCluster(2).run(_resume_body, 12, 4)   # cut after 2 syncs of a 3-sync period
    for count, same_w, same_v, _ in res:
        assert count == 2 and same_w and same_v
    assert torch.equal(res[0][3], res[1][3])         # 12 calls = 6 syncs: averaged at the 6th


def test_saved_position_must_fit():
    ms = MomentSync(2)
    assert ms.state_dict() == dict(moment_sync_every=2, moment_sync="both", moment_dtype="fp32",
                                   count=0)
    with pytest.raises(ValueError, match="moment-sync position 5 does not fit"):
        ms.load_state_dict({"count": 5})
    ms.load_state_dict(None)                        # saved without moment sync: starts afresh
    assert ms.count == 0


# -- errors and the CLI ------------------------------------------------------------------------
@pytest.mark.parametrize("kw,match", [
    (dict(moment_sync_every=-1), "moment_sync_every must be an int >= 1"),
    (dict(moment_sync_every=1.5), "moment_sync_every must be an int >= 1"),
    (dict(moment_sync_every=True), "moment_sync_every must be an int >= 1"),
    (dict(moment_sync_every=2, moment_sync="first"), "moment_sync must be one of"),
    (dict(moment_sync="x"), "moment_sync must be one of"),
    (dict(moment_sync_every=2, moment_dtype="fp16"), "moment_dtype must be one of"),
])
def test_bad_values_raise_one_line(kw, match):
    m = _model()
    with pytest.raises(ValueError, match=match) as e:
        SparseAllreduce(m.parameters(), comm=LocalCluster(1).communicator(0), sync_every=2, **kw)
    assert "\n" not in str(e.value)


def _sgd_body(comm):
    m = _model()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    sar = SparseAllreduce(m.parameters(), comm=comm, density=0.2, moment_sync_every=1,
                          backend="torch")
    m(torch.randn(2, 8)).sum().backward()
    sar.reduce_updates(opt)


def test_an_optimizer_without_moments_fails_on_every_rank():
    with pytest.raises(ValueError, match="no 'exp_avg' of its shape in SGD's state"):
        LocalCluster(2, timeout=10).run(_sgd_body)


def test_moment_sync_alone_turns_local_steps_on():
    m = _model()
    sar = SparseAllreduce(m.parameters(), comm=LocalCluster(1).communicator(0),
                          moment_sync_every=4, moment_sync="second")
    assert sar.local_steps.sync_every == 1
    assert sar.local_steps.describe()["moment_sync_every"] == 4
    with pytest.raises(RuntimeError, match="cannot take local steps"):
        sar.reduce_gradients()
    plain = SparseAllreduce(m.parameters(), comm=LocalCluster(1).communicator(0))
    assert plain.local_steps is None


def test_cli_option_reaches_the_reducer():
    assert {"moment_sync_every", "moment_sync", "moment_dtype"} <= set(OPTIONS)
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    line = ["--model", "gpt", "--algorithms", "dense", "oktopk", "--option", "sync_every=4",
            "--option", "moment_sync_every=2", "--option", "moment_sync=\"second\"",
            "--option", "moment_dtype=bf16"]
    args = p.parse_args(line)
    assert train.check_args(args) == ""
    opts = dict(args.option)
    assert loops.local_step_options(opts) == dict(sync_every=4, moment_sync_every=2,
                                                  moment_sync="second", moment_dtype="bf16")
    assert loops.takes_local_steps({"moment_sync_every": 2})
    bad = p.parse_args(["--model", "gpt", "--algorithms", "dense", "--option",
                        "moment_sync_every=-2"])
    assert "moment_sync_every must be an int >= 1" in train.check_args(bad)


def _lm_body(comm, cfg):
    from oktopk_triton.bench import gpt as g
    from oktopk_triton.bench import lm_loop as t
    corpus = g.load_corpus(cfg["val_fraction"], max_train_bytes=1 << 20)
    return t.train_one_lm(cfg, "dense", 0, comm, torch.device("cpu"),
                          (corpus.train, corpus.val), log=False)


def test_tiny_lm_run_with_moment_sync():
    """``train --model gpt --option sync_every=2 --option moment_sync_every=2``: the moments'
    bytes land on every 2nd sync, replicas stay identical, the run records the options."""
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    a = p.parse_args(["--model", "gpt", "--size", "tiny", "--steps", "8", "--eval-times", "1",
                      "--lr", "1e-2", "--option", "sync_every=2",
                      "--option", "moment_sync_every=2"])
    cfg = train.build_config(a, ["dense"])
    r = run_pooled_torch(2, _lm_body, cfg, timeout=120)[0]
    assert r["replicas_identical"] and r["reduce"] == "updates"
    assert r["local_steps"]["moment_sync_every"] == 2 and r["local_steps"]["moment_sync"] == "both"
    n, b = r["numel"], r["bytes_curve"]
    assert b[0] == b[2] == b[4] == b[6] == 0
    moment = ring_allreduce_bytes(2 * 4 * n, 2)
    assert b[3] - b[1] == b[7] - b[5] == moment and b[1] > 0
