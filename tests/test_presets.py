"""The presets (oktopk_triton.presets): each is backed by committed records that it reproduces,
sends the bytes it is set for, and recommend() chooses among them in one logged line."""
import json
import logging
import os

import pytest
import torch

from oktopk_triton import SparseAllreduce
from oktopk_triton.algorithms.schedule import bytes_per_step
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.config import OkTopk, TopkA
from oktopk_triton.ddp import SparseAllreduceState
from oktopk_triton.presets import (DILOCO_PRESETS, DILOCO_SOLVE_P, PRESETS, Preset, recommend,
                                   recommend_diloco)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _record(path):
    with open(os.path.join(ROOT, path)) as f:
        return json.load(f)


def _numel(rec):
    """The parameters a record trained (the summary's numel, or k over the density)."""
    if rec.get("summary"):
        return int(rec["summary"][0]["numel"])
    run = rec["runs"][0]
    return int(round(run["k"] / run["density"]))


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_each_preset_is_backed_by_clean_records_it_reproduces(name):
    """Every evidence file names its commit and is not from a dirty tree; the density the
    preset solves at the record's size and world size is the one the record ran with (within
    the rounding of the campaign's density, 3%), at its sync interval and wire."""
    p = PRESETS[name]
    assert p.evidence and "PENDING" not in p.measured
    matched = 0
    for path in p.evidence:
        rec = _record(path)
        assert (rec.get("commit") or rec.get("git")) and rec.get("dirty") is not True, path
        cfg = rec.get("config", {})
        algos = cfg.get("algorithms") or rec.get("arguments", {}).get("algorithms", [])
        if p.algorithm.algorithm not in algos:
            continue                     # a baseline the preset is compared with
        opts = cfg.get("options") or {}
        if name != "sgd":
            assert int(opts.get("sync_every", 1)) == p.sync_every, path
            assert opts.get("wire_format", "fp32") == p.algorithm.wire_format, path
        P = int(cfg.get("world_size") or rec.get("arguments", {}).get("world_size"))
        solved = p.density(_numel(rec), P)
        assert solved == pytest.approx(float(cfg["density"]), rel=0.03), (path, solved)
        matched += 1
    assert matched, f"no record of {name}'s own algorithm among its evidence"


@pytest.mark.parametrize("P", [3, 4, 16, 64])
def test_a_preset_sends_its_share_of_dense_bytes_at_any_world_size(P):
    """The density is solved so that a step sends the preset's fraction of a dense fp32
    allreduce's bytes (the schedules are checked against real traffic in test_schedule)."""
    n = 1 << 20
    dense = bytes_per_step("dense", n, P, 1.0)
    for p in PRESETS.values():
        d = p.density(n, P)
        opts = dict(p.algorithm.options())
        wire = opts.pop("wire_format")
        sent = bytes_per_step(p.algorithm.algorithm, n, P, d, wire, p.sync_every, **opts)
        more = bytes_per_step(p.algorithm.algorithm, n, P, d + 8 / n, wire, p.sync_every, **opts)
        assert sent <= p.bytes * dense < more, (p.name, P)


def test_the_sgd_preset_sends_what_it_says_on_three_ranks():
    """Real traffic: a reducer built from the sgd preset on 3 thread ranks counts the bytes
    the preset is set for (2% of dense's), and conserves what it does not send."""
    n = 30_000

    def body(comm):
        sar = SparseAllreduce(n, comm=comm, preset="sgd", device="cpu")
        g = torch.Generator().manual_seed(comm.rank)
        for _ in range(3):
            x = torch.randn(n, generator=g)
            out = sar(x)
        return sar.stats["bytes_sent"], out, sar.density

    res = LocalCluster(3).run(body)
    dense = bytes_per_step("dense", n, 3, 1.0)
    for sent, out, d in res:
        assert int(sent) <= 0.02 * dense * 1.05
        assert torch.equal(out, res[0][1])
        assert d == pytest.approx(PRESETS["sgd"].density(n, 3))


def test_recommend_chooses_by_optimizer_world_size_and_bytes(caplog):
    model = torch.nn.Linear(4, 4)
    cases = [(torch.optim.SGD(model.parameters(), lr=0.1), None, 4, "sgd"),
             (torch.optim.AdamW(model.parameters()), None, 4, "transformer"),
             ("adam", 0.002, 8, "transformer-lean"),
             ("adamw", 0.02, 64, "many-ranks"),
             ("adamw", None, 16, "many-ranks")]
    for opt, fraction, P, want in cases:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="oktopk_triton"):
            got = recommend(optimizer=opt, bytes=fraction, world_size=P)
        assert got.name == want
        lines = [r.getMessage() for r in caplog.records]
        assert len(lines) == 1 and want in lines[0] and f"{P}" in lines[0]
        if fraction is not None:
            assert got.bytes == fraction and got.measured_bytes == PRESETS[want].bytes


def test_a_reducer_from_a_preset_logs_one_line_and_is_what_the_preset_says(caplog):
    model = torch.nn.Linear(64, 64)
    with caplog.at_level(logging.INFO, logger="oktopk_triton"):
        sar = SparseAllreduce(model.parameters(), preset="transformer")
    lines = [r.getMessage() for r in caplog.records if "preset transformer" in r.getMessage()]
    assert len(lines) == 1 and "reduce_updates" in lines[0] and "TopkA" in lines[0]
    assert sar.config == TopkA(wire_format="q2") and sar.local_steps.sync_every == 4
    off = PRESETS["transformer"].with_bytes(0.05)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="oktopk_triton"):
        SparseAllreduce(model.parameters(), preset=off)
    assert "outside" in caplog.records[-1].getMessage()
    sgd = SparseAllreduce(model.parameters(), preset=PRESETS["sgd"])
    assert sgd.config == OkTopk(momentum=0.9) and sgd.local_steps is None


@pytest.mark.parametrize("make, expect", [
    (lambda m: SparseAllreduce(m.parameters(), preset="sgd", density=0.1), "also got density"),
    (lambda m: SparseAllreduce(m.parameters(), preset="sgd", algorithm="topka"),
     "also got algorithm"),
    (lambda m: SparseAllreduce(m.parameters(), preset="fast"), "preset must be one of"),
    (lambda m: SparseAllreduceState(preset="transformer"), "gradient hook cannot"),
    (lambda m: SparseAllreduceState(preset="sgd", density=0.02), "also got density"),
    (lambda m: recommend("adamw", bytes=2.0, world_size=4), "bytes must be"),
    (lambda m: recommend("adamw", world_size=0), "world_size must be"),
    (lambda m: Preset("x", OkTopk(), 1, 0.0, "gradients", "", ()), "bytes must be"),
])
def test_bad_preset_input_is_refused_in_one_line(make, expect):
    with pytest.raises(ValueError) as e:
        make(torch.nn.Linear(4, 4))
    assert expect in str(e.value) and "\n" not in str(e.value)


def test_the_ddp_hook_and_fsdp_take_the_sgd_preset():
    from oktopk_triton.integrations.fsdp import SparseReplicaReduce
    state = SparseAllreduceState(preset="sgd")
    assert state.config == OkTopk(momentum=0.9) and state.density == pytest.approx(0.01, rel=0.01)
    fsdp = SparseReplicaReduce(None, preset="sgd")
    assert fsdp.config == state.config and fsdp.density == state.density


def _front_defaults(comm):
    sar = SparseAllreduce(64, comm=comm, device="cpu")
    return sar.algorithm.density, sar.config


def test_the_fronts_take_their_defaults_from_one_home(monkeypatch):
    """No density and no algorithm: all three fronts take config.DEFAULT_DENSITY and
    DEFAULT_ALGORITHM (moved here, each front follows)."""
    from oktopk_triton import config
    from oktopk_triton.integrations.fsdp import SparseReplicaReduce
    for density, name in ((0.01, "oktopk"), (0.03, "topka")):
        monkeypatch.setattr(config, "DEFAULT_DENSITY", density)
        monkeypatch.setattr(config, "DEFAULT_ALGORITHM", name)
        want = config.as_config(name)
        got = LocalCluster(1).run(_front_defaults)[0]
        assert got == (density, want)
        for front in (SparseAllreduceState(), SparseReplicaReduce(None)):
            assert (front.density, front.config) == (density, want)


# -- the DiLoCo presets (SparseDiLoCo; a fraction of DiLoCo's dense sync) -----------------------
@pytest.mark.parametrize("name", sorted(DILOCO_PRESETS))
def test_each_diloco_preset_is_backed_by_clean_records_it_reproduces(name):
    """Its records are clean, and its own algorithm's ran at the density the preset solves for
    the record's model at DILOCO_SOLVE_P ranks (within 3%), on its wire, with its decay."""
    p = DILOCO_PRESETS[name]
    assert p.diloco and p.evidence
    matched = 0
    for path in p.evidence:
        rec = _record(path)
        assert rec.get("commit") and rec.get("dirty") is False, path
        cfg = rec["config"]
        if p.algorithm.algorithm not in cfg["algorithms"]:
            continue                     # DiLoCo itself, the baseline
        opts = cfg.get("options") or {}
        assert opts.get("wire_format", "fp32") == p.algorithm.wire_format, path
        assert float(opts.get("residual_decay", 1.0)) == p.residual_decay, path
        assert int(cfg["world_size"]) == DILOCO_SOLVE_P
        solved = p.density(_numel(rec), DILOCO_SOLVE_P)
        assert solved == pytest.approx(float(cfg["density"]), rel=0.03), (path, solved)
        run = rec["runs"][0]
        assert run["replicas_identical"] and run["conservation"]["checked"], path
        matched += 1
    assert matched, f"no record of {name}'s own algorithm among its evidence"


def test_a_diloco_preset_sends_its_share_of_dilocos_dense_sync():
    p = DILOCO_PRESETS["diloco"]
    n = 1 << 20
    d = p.density(n, DILOCO_SOLVE_P)
    sent = bytes_per_step("oktopk", n, DILOCO_SOLVE_P, d, "q2")
    dense = bytes_per_step("dense", n, DILOCO_SOLVE_P, 1.0)
    assert 0.97 * p.bytes <= sent / dense <= p.bytes


def test_recommend_diloco_and_the_fronts_refuse_what_does_not_fit(caplog):
    with caplog.at_level(logging.INFO, logger="oktopk_triton"):
        chosen = recommend_diloco(bytes=0.05)
    assert chosen.diloco and chosen.bytes == 0.05 and chosen.name == "diloco"
    assert recommend_diloco().name == "diloco" and recommend_diloco(0.01).name == "diloco-lean"
    assert any("recommend_diloco:" in r.getMessage() for r in caplog.records)
    assert "outside it" in chosen.describe(1 << 20, 4)        # a budget it was not measured at
    for bad in (0.0, 1.5, True):
        with pytest.raises(ValueError, match="recommend_diloco: bytes must be a fraction"):
            recommend_diloco(bytes=bad)
    # a DiLoCo preset is not a per-step one: SparseAllreduce refuses it in one line
    with pytest.raises(ValueError) as e:
        SparseAllreduce(1000, LocalCluster(1).run(lambda c: c)[0], preset="diloco")
    assert str(e.value).startswith("preset 'diloco' is a DiLoCo preset") and \
        "\n" not in str(e.value)
