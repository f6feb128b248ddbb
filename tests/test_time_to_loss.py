"""oktopk_triton.planning's time to a loss: the steps ratio on synthetic validation curves, the
ratios of a train report, and `oktopk-bench project`'s time to a loss."""
import json

import pytest

from oktopk_triton import planning as lm
from oktopk_triton.bench import project

STEPS = [0, 100, 200, 300, 400]
LOSS = [5.0, 4.0, 3.0, 2.5, 2.0]


def test_interpolated_crossing():
    # 2.75 lies halfway between step 200 (3.0) and 300 (2.5): dense reaches it at 250
    r = lm.steps_ratio(STEPS, LOSS, 400, 2.75)
    assert r["dense_step"] == pytest.approx(250.0)
    assert r["ratio"] == pytest.approx(1.6)
    assert r["clamped"] is None


def test_dense_own_final_is_one():
    assert lm.steps_ratio(STEPS, LOSS, 400, 2.0)["ratio"] == pytest.approx(1.0)


def test_clamped_when_dense_never_reaches():
    r = lm.steps_ratio(STEPS, LOSS, 400, 1.5)
    assert r["clamped"] == "never" and r["ratio"] == pytest.approx(1.0)


def test_clamped_at_first_eval():
    r = lm.steps_ratio([60, 120], [4.0, 3.0], 240, 4.5)
    assert r["clamped"] == "first" and r["ratio"] == pytest.approx(4.0)
    # a diverged run, no better than dense's untrained step 0: infinitely slower, not an error
    r = lm.steps_ratio([0, 120], [5.4, 3.0], 240, 114.0)
    assert r["clamped"] == "first" and r["ratio"] == float("inf")


def test_first_crossing_wins_on_noisy_curve():
    # dense dips to 2.9 at 200, rises, then falls again: the first crossing counts
    r = lm.steps_ratio([0, 100, 200, 300, 400], [4.0, 3.2, 2.9, 3.1, 2.5], 400, 3.0)
    assert r["dense_step"] == pytest.approx(100 + 100 * (0.2 / 0.3))


def test_bad_input():
    with pytest.raises(ValueError, match="equal, non-empty"):
        lm.steps_ratio([0, 1], [1.0], 10, 1.0)


def _run(alg, seed, curve, steps=400, bytes_per_step=100.0, density=None):
    density = (1.0 if alg == "dense" else 0.01) if density is None else density
    return {"algorithm": alg, "seed": seed, "steps": steps, "val_curve": curve,
            "final_val_loss": curve[-1][1], "bytes_per_step": bytes_per_step,
            "density": density}


def test_ratios_from_a_train_report_average_seeds():
    dense = [_run("dense", s, list(zip(STEPS, [x + d for x in LOSS]))) for s, d in ((0, 0.1),
                                                                                    (1, -0.1))]
    ok = [_run("oktopk", 0, [(0, 5.0), (400, 2.7)]), _run("oktopk", 1, [(0, 5.0), (400, 2.8)])]
    r = lm.ratios_from_train({"runs": dense + ok})
    assert r["dense"]["ratio"] == pytest.approx(1.0)
    assert r["oktopk"]["final_val_loss"] == pytest.approx(2.75)
    assert r["oktopk"]["ratio"] == pytest.approx(1.6) and r["oktopk"]["seeds"] == [0, 1]
    with pytest.raises(ValueError, match="no dense run"):
        lm.ratios_from_train({"runs": ok})


def test_a_report_at_two_densities_is_read_at_the_projections_density(tmp_path):
    # one merged report: oktopk at 1% (final 2.75: ratio 1.6) and at 0.1% (final 3.0: ratio 2)
    runs = [_run("dense", 0, list(zip(STEPS, LOSS))),
            _run("oktopk", 0, [(0, 5.0), (400, 2.75)], density=0.01),
            _run("oktopk", 0, [(0, 5.0), (400, 3.0)], density=0.001)]
    assert lm.ratios_from_train({"runs": runs}, 0.01)["oktopk"]["ratio"] == pytest.approx(1.6)
    assert lm.ratios_from_train({"runs": runs}, 0.001)["oktopk"]["ratio"] == pytest.approx(2.0)
    with pytest.raises(ValueError, match="densities"):
        lm.ratios_from_train({"runs": runs})      # never an average over two densities
    p = tmp_path / "merged.json"
    p.write_text(json.dumps({"runs": runs}))
    assert project.load_ratios([str(p)], [], 0.001)["oktopk"] == pytest.approx(2.0)


def test_load_ratios_refuses_bad_pairs_and_files(tmp_path):
    assert project.load_ratios([], ["oktopk=1.98"]) == {"oktopk": 1.98, "dense": 1.0}
    for bad in ("oktopk", "oktopk=", "=2", "oktopk=-1", "oktopk=x"):
        with pytest.raises(SystemExit, match="expected NAME=RATIO"):
            project.load_ratios([], [bad])
    with pytest.raises(SystemExit, match="cannot read a train report"):
        project.load_ratios([str(tmp_path / "missing.json")], [])
    p = tmp_path / "t.json"
    p.write_text(json.dumps({"runs": [_run("dense", 0, list(zip(STEPS, LOSS))),
                                      _run("gtopk", 0, [(0, 5.0), (400, 2.5)])]}))
    r = project.load_ratios([str(p)], ["gtopk=3"])
    assert r["gtopk"] == 3.0                      # a pair given after the file wins
    assert project.load_ratios([str(p)], [])["gtopk"] == pytest.approx(400 / 300)


def test_time_to_loss_multiplies_and_picks_the_first():
    rows = [{"P": 4, "algorithm": "dense", "step_ms": 10.0},
            {"P": 4, "algorithm": "oktopk", "step_ms": 2.0},
            {"P": 4, "algorithm": "spardl", "step_ms": 1.0}]
    t = lm.time_to_loss(rows, {"dense": 1.0, "oktopk": 2.0}, compute_ms=4.0)
    assert [(r["algorithm"], r["time_ms"], r["first"]) for r in t] == [
        ("dense", 14.0, False), ("oktopk", 12.0, True)]     # spardl: no ratio, not ranked
    t = lm.time_to_loss(rows, {"dense": 1.0, "oktopk": 2.0}, compute_ms=10.0)
    assert [r["algorithm"] for r in t if r["first"]] == ["dense"]
    assert "first" in project.format_time_to_loss(t, "title").splitlines()[1]


def test_project_prints_time_to_loss(capsys, tmp_path):
    import argparse
    p = argparse.ArgumentParser()
    project.add_arguments(p)
    out = tmp_path / "p.json"
    args = p.parse_args(["--n", "1000000", "--world-sizes", "4", "--net", "10Gbps",
                         "--steps-ratio", "oktopk=2", "powersgd=1.1", "gtopk=1.5",
                         "--algorithms", "dense", "oktopk", "--json", str(out)])
    assert project.main(args) == 0
    text = capsys.readouterr().out
    assert "oktopk (x2.00)" in text and "no projected step for gtopk" in text
    assert "powersgd (x1.10)" in text           # priced: two allreduces of Ok-Topk's bytes
    case = json.loads(out.read_text())["cases"][0]
    dense = next(r for r in case["rows"] if r["algorithm"] == "dense")
    ok = next(r for r in case["time_to_loss"] if r["algorithm"] == "oktopk")
    assert ok["time_ms"] == pytest.approx(2 * next(
        r["step_ms"] for r in case["rows"] if r["algorithm"] == "oktopk"))
    # on 10 Gb/s a 1% step is far cheaper than dense's: twice the steps still finish sooner
    assert ok["time_ms"] < dense["step_ms"]
    # PowerSGD at Ok-Topk's bytes and a (hypothetical) ratio of 1.1 would be first
    first = [r["algorithm"] for r in case["time_to_loss"] if r["first"]]
    assert first == ["powersgd"]


def test_baselines_are_priced_from_dense_and_oktopk():
    from oktopk_triton.bench import project
    from oktopk_triton.planning import DEFAULT_KERNELS, parse_net
    net = parse_net("10Gbps")
    n, P = 1 << 24, 8
    rows = lm.project(n, 0.01, [P], net, DEFAULT_KERNELS, ["dense", "oktopk"])
    dense, ok = rows
    b16, psgd = project.baseline_rows(rows, {"bf16": 1.1, "powersgd": 4.0}, n, 0.01, net,
                                      DEFAULT_KERNELS)
    assert b16["algorithm"] == "bf16" and psgd["algorithm"] == "powersgd"
    # bf16: half of dense's ring bytes, so nearly half its time on a slow network
    assert b16["bytes_per_rank"] == pytest.approx(dense["bytes_per_rank"] / 2, rel=0.01)
    assert 0.4 < b16["step_ms"] / dense["step_ms"] < 0.6
    # PowerSGD at matched bytes: Ok-Topk's bytes, two allreduces' latency, no kernels
    assert psgd["bytes_per_rank"] == ok["bytes_per_rank"]
    assert psgd["step_ms"] == pytest.approx(
        1e3 * (4 * (P - 1) * net.latency + ok["bytes_per_rank"] / net.bandwidth))
    assert project.baseline_rows(rows, {"oktopk": 2.0}, n, 0.01, net, DEFAULT_KERNELS) == []


def test_local_steps_divide_a_sparse_step_by_h_and_leave_dense_per_step():
    from oktopk_triton.planning import DEFAULT_KERNELS, parse_net
    net = parse_net("100Gbps")
    n, P, d = 1 << 24, 8, 0.08
    per_step = {r["algorithm"]: r for r in lm.project(n, d, [P], net, DEFAULT_KERNELS,
                                                       ["dense", "oktopk"])}
    local = {r["algorithm"]: r for r in lm.project(n, d, [P], net, DEFAULT_KERNELS,
                                                    ["dense", "oktopk"], sync_every=4)}
    ok, ok4 = per_step["oktopk"], local["oktopk"]
    assert ok4["step_ms"] == pytest.approx(ok["step_ms"] / 4)
    assert ok4["bytes_per_rank"] == pytest.approx(ok["bytes_per_rank"] / 4)
    assert ok4["sync_every"] == 4 and ok4["overlap"] is False
    assert local["dense"]["step_ms"] == per_step["dense"]["step_ms"]   # dense: every step
    assert local["dense"]["sync_every"] == 1
    # the compact wire halves Ok-Topk's sparse bytes (4 bytes an entry instead of 8)
    compact = lm.project(n, d, [P], net, DEFAULT_KERNELS, ["oktopk"], wire_format="compact")[0]
    assert 0.4 < compact["bytes_per_rank"] / ok["bytes_per_rank"] < 0.6
    with pytest.raises(ValueError, match="sync_every"):
        lm.step_time("oktopk", n, d, P, net, DEFAULT_KERNELS, sync_every=0)


def test_overlapped_sync_costs_the_larger_of_compute_and_sync():
    rows = [{"P": 4, "algorithm": "oktopk", "step_ms": 30.0, "overlap": True},
            {"P": 4, "algorithm": "gtopk", "step_ms": 30.0, "overlap": False}]
    t = {r["algorithm"]: r for r in lm.time_to_loss(rows, {"oktopk": 2.0, "gtopk": 2.0},
                                                     compute_ms=100.0)}
    assert t["oktopk"]["time_ms"] == pytest.approx(200.0)      # max(100, 30) x 2
    assert t["gtopk"]["time_ms"] == pytest.approx(260.0)       # (100 + 30) x 2
    t = lm.time_to_loss(rows[:1], {"oktopk": 2.0}, compute_ms=10.0)
    assert t[0]["time_ms"] == pytest.approx(60.0)              # the sync is the longer


def test_project_cli_sync_every_and_its_errors(capsys, tmp_path):
    import argparse
    p = argparse.ArgumentParser()
    project.add_arguments(p)
    out = tmp_path / "p.json"
    args = p.parse_args(["--n", "1000000", "--world-sizes", "4", "--net", "100Gbps",
                         "--density", "0.08", "--wire-format", "compact", "--sync-every", "4",
                         "--algorithms", "dense", "oktopk", "--json", str(out)])
    assert project.main(args) == 0
    assert "sparse syncing every 4 steps" in capsys.readouterr().out
    rep = json.loads(out.read_text())
    assert rep["sync_every"] == 4 and rep["wire_format"] == "compact"
    ok = next(r for r in rep["cases"][0]["rows"] if r["algorithm"] == "oktopk")
    assert ok["sync_every"] == 4
    bad = p.parse_args(["--n", "1000000", "--world-sizes", "4", "--overlap"])
    with pytest.raises(SystemExit, match="--overlap: expected --sync-every"):
        project.main(bad)
