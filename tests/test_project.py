"""``oktopk-bench project``: the network parser, the collective cost model, the kernel costs, the
projection CLI, and the validation's fit (on synthetic JSONs generated from a known network)."""
from __future__ import annotations

import importlib.util
import json
import math
import os

import pytest

from oktopk_triton import cli
from oktopk_triton.algorithms.schedule import CollectiveSpec, allreduce, schedule_of
from oktopk_triton import planning as pl
from oktopk_triton.bench import project as pj

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_parse_net_units_and_presets():
    n = pl.parse_net("100Gbps,5us")
    assert n.bandwidth == pytest.approx(12.5e9) and n.latency == pytest.approx(5e-6)
    n = pl.parse_net("3GB/s,50us")
    assert n.bandwidth == pytest.approx(3e9) and n.latency == pytest.approx(50e-6)
    n = pl.parse_net("25Gb/s,0.02ms")
    assert n.bandwidth == pytest.approx(25e9 / 8) and n.latency == pytest.approx(20e-6)
    for name in ("10Gbps", "25Gbps", "100Gbps", "400Gbps"):
        p = pl.parse_net(name)
        assert p.bandwidth == pytest.approx(float(name[:-4]) * 1e9 / 8) and p.latency > 0
    assert pl.parse_net("10Gbps").latency > pl.parse_net("400Gbps").latency
    for bad in ("123Gbps", "fast,5us", "100Qbps,5us", "100Gbps,5parsecs"):
        with pytest.raises(ValueError):
            pl.parse_net(bad)


def test_collective_costs_follow_the_stated_algorithms():
    net = pl.Network(10e9, 10e-6)
    P = 8
    big = allreduce(4 << 20, P)
    t, how = pl.spec_time(big, P, net)
    assert how == "ring"
    assert t == pytest.approx(2 * (P - 1) * 10e-6 + 2 * (P - 1) / P * (4 << 20) / 10e9)
    t, how = pl.spec_time(allreduce(4, P), P, net)        # the flag: the tree is cheaper
    assert how == "tree" and t == pytest.approx(2 * 3 * (10e-6 + 4 / 10e9), rel=1e-3)
    ag = CollectiveSpec("allgather", (P - 1) * 1000, P - 1, P - 1)
    assert pl.spec_time(ag, P, net)[0] == pytest.approx(7 * 10e-6 + 7000 / 10e9)
    # a send/recv batch: its rounds, and the larger of sent and received
    sr = CollectiveSpec("send_recv", 0, 1, 1, recv_bytes=5000)
    assert pl.spec_time(sr, P, net)[0] == pytest.approx(10e-6 + 5000 / 10e9)
    okt = schedule_of("oktopk", 1 << 20, 10486, P)
    assert pl.spec_time(okt[1], P, net)[0] == pytest.approx(
        (P - 1) * 10e-6 + okt[1].bytes_per_rank / 10e9)


def test_selection_time_scales_linearly_with_n_and_ranks_per_gpu():
    k = pl.DEFAULT_KERNELS
    for name in pl.ALGORITHMS:
        t1 = pl.selection_time(name, 1 << 20, k)
        assert pl.selection_time(name, 1 << 21, k) == pytest.approx(2 * t1)
        assert pl.selection_time(name, 1 << 20, k, ranks_per_gpu=4) == pytest.approx(4 * t1)
    # Ok-Topk's one fused pass costs less than an exact top-k step over the same n
    assert pl.selection_time("oktopk", 1 << 24, k) < pl.selection_time("topka", 1 << 24, k)


def test_kernels_json_both_formats(tmp_path):
    n = 1 << 26
    a = tmp_path / "gpu-kernels-a.json"
    a.write_text(json.dumps({"device": "GPU X", "device_type": "cuda", "n": n, "results": [
        {"name": "copy", "median_ms": 0.2}, {"name": "fused select", "median_ms": 1.0},
        {"name": "torch.topk", "median_ms": 1.5}, {"name": "hist threshold", "median_ms": 9}]}))
    c = pl.load_kernels(str(a))
    assert c.copy_bandwidth == pytest.approx(8 * n / 0.2e-3)
    assert c.fused_select_s * n == pytest.approx(1.0e-3)
    assert c.topk_s * n == pytest.approx(1.5e-3)
    b = tmp_path / "variants.json"
    b.write_text(json.dumps({"device": "GPU Y", "rows": [
        {"what": "copy", "log2n": 26, "ms": 0.4}, {"what": "copy", "log2n": 28, "ms": 0.8},
        {"what": "fused_select", "log2n": 28, "hist": True, "ms": 3.0},
        {"what": "fused_select", "log2n": 28, "hist": True, "ms": 2.5},
        {"what": "fused_select", "log2n": 28, "hist": False, "ms": 1.0},
        {"what": "torch.topk", "log2n": 28, "ms": 6.0}]}))
    c = pl.load_kernels(str(b))
    assert c.fused_select_s * (1 << 28) == pytest.approx(2.5e-3)       # fastest with histogram
    assert c.copy_bandwidth == pytest.approx(8 * (1 << 28) / 0.8e-3)
    e = tmp_path / "gpu-kernels-2026.json"           # today's oktopk-bench kernels: entries
    big = 1 << 28
    e.write_text(json.dumps({"device": "GPU Z", "device_type": "cuda", "entries": [
        {"kernel": "copy", "n": 1 << 24, "ms": 0.05}, {"kernel": "copy", "n": big, "ms": 0.7},
        {"kernel": "torch_topk", "n": big, "ms": 6.0},
        {"kernel": "fused_select", "n": big, "grad_dtype": "fp32", "velocity": False,
         "hist": False, "ms": 2.2},
        {"kernel": "fused_select", "n": big, "grad_dtype": "fp32", "velocity": False,
         "hist": True, "ms": 2.9},
        {"kernel": "fused_select", "n": big, "grad_dtype": "fp32", "velocity": True,
         "hist": True, "ms": 3.6},
        {"kernel": "fused_select", "n": big, "grad_dtype": "bf16", "velocity": False,
         "hist": True, "ms": 2.7}]}))
    c = pl.load_kernels(str(e))
    assert c.fused_select_s * big == pytest.approx(2.9e-3)           # fp32, hist, no velocity
    assert c.topk_s * big == pytest.approx(6.0e-3)
    assert c.copy_bandwidth == pytest.approx(8 * big / 0.7e-3)
    cpu = tmp_path / "gpu-kernels-cpu.json"
    cpu.write_text(json.dumps({"device_type": "cpu", "n": 10, "results": []}))
    with pytest.raises(ValueError):
        pl.load_kernels(str(cpu))
    assert pl.resolve_kernels("none")[0] is pl.DEFAULT_KERNELS


def test_fastest_ranges_group_consecutive_world_sizes():
    rows = []
    for P, times in ((2, (10, 5, 7)), (4, (10, 4, 7)), (8, (10, 8, 7)), (16, (10, 9, 8))):
        for a, t in zip(("dense", "x", "y"), times):
            rows.append({"P": P, "algorithm": a, "step_ms": t})
    r = pl.fastest_ranges(rows)
    assert [(x["P_from"], x["P_to"], x["algorithm"]) for x in r] == [(2, 4, "x"), (8, 16, "y")]
    assert r[0]["speedup_vs_dense"] == pytest.approx((2.0, 2.5))
    assert "P=2-4: x (2.0-2.5x dense)" in pl.describe_ranges(r)


def test_project_cli_defaults_json_and_plot(tmp_path, capsys):
    out, png = tmp_path / "p.json", tmp_path / "p.png"
    rc = cli.main(["project", "--kernels", "none", "--json", str(out), "--plot", str(png),
                   "--breakdown"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "PROJECTED" in text and "fastest:" in text and "excluded" in text
    rep = json.loads(out.read_text())
    case, = rep["cases"]
    assert case["model"] == "bert-large" and case["n"] == 340_000_000
    assert rep["world_sizes"] == [2 ** i for i in range(1, 11)]
    assert {r["algorithm"] for r in case["rows"]} == set(pl.ALGORITHMS)
    assert len(case["rows"]) == 7 * 10
    covered = sum(x["P_to"].bit_length() - x["P_from"].bit_length() + 1 for x in case["fastest"])
    assert covered == 10
    for r in case["rows"]:
        assert r["step_ms"] == pytest.approx(r["comm_ms"] + r["select_ms"])
        assert r["bytes_per_rank"] == sum(c["bytes_per_rank"] for c in r["collectives"])
    dense = {r["P"]: r for r in case["rows"] if r["algorithm"] == "dense"}
    n, bw = 340_000_000, 12.5e9
    assert dense[1024]["comm_ms"] > 1e3 * 2 * 1023 / 1024 * 4 * n / bw     # ring: bandwidth bound
    assert png.stat().st_size > 10_000


def test_project_cli_several_models_and_nets(capsys):
    rc = cli.main(["project", "--model", "resnet50", "gpt2-xl", "--net", "10Gbps", "400Gbps,2us",
                   "--world-sizes", "4", "64", "--algorithms", "dense", "spardl", "oktopk",
                   "--kernels", "none"])
    assert rc == 0
    text = capsys.readouterr().out
    assert text.count("fastest:") == 4
    assert "gpt2-xl (n = 1,500,000,000)" in text


def test_project_cli_quantized_wire_prices_its_carriers_only(tmp_path, capsys):
    out = tmp_path / "q.json"
    rc = cli.main(["project", "--n", "4194304", "--density", "0.016", "--world-sizes", "4", "64",
                   "--wire-format", "q2", "--sync-every", "2", "--kernels", "none",
                   "--json", str(out)])
    assert rc == 0
    text = capsys.readouterr().out
    assert "(--wire-format q2: gtopk, spardl, topkdsa, gaussiank left out" in text
    assert "q2 wire, sparse syncing every 2 steps" in text
    rep = json.loads(out.read_text())
    assert rep["wire_format"] == "q2"
    rows = rep["cases"][0]["rows"]
    assert {r["algorithm"] for r in rows} == {"dense", "oktopk", "topka"}
    for r in rows:         # what the algorithm's own schedule sends on that wire, per step
        opts = {} if r["algorithm"] == "dense" else {"wire_format": "q2"}
        specs = schedule_of(r["algorithm"], r["n"], r["k"], r["P"], check_finite="skip", **opts)
        H = 1 if r["algorithm"] == "dense" else 2
        assert r["bytes_per_rank"] == pytest.approx(sum(s.bytes_per_rank for s in specs) / H)
    compact = pl.project(4194304, 0.016, [64], pl.Network(12.5e9, 5e-6), pl.DEFAULT_KERNELS,
                         ["oktopk", "topka"], sync_every=2, wire_format="compact")
    q2 = {r["algorithm"]: r["bytes_per_rank"] for r in rows if r["P"] == 64}
    for r in compact:                               # 2.25 bytes an entry against 4
        assert 0.5 < q2[r["algorithm"]] / r["bytes_per_rank"] < 0.65
    with pytest.raises(SystemExit, match="^oktopk-bench project: gtopk: wire_format='q2' is not"):
        cli.main(["project", "--wire-format", "q2", "--algorithms", "oktopk", "gtopk",
                  "--kernels", "none"])


def test_topkdsa_bytes_round_trip_through_cap2():
    n, k, P = 1 << 22, 41943, 8
    for st in ({"mode": "sparse", "cap2": 7000}, {"mode": "dense"}):
        total = sum(s.bytes_per_rank for s in schedule_of("topkdsa", n, k, P, **st))
        specs = pl.algorithm_schedule("topkdsa", n, k, P, topkdsa_bytes=total)
        assert sum(s.bytes_per_rank for s in specs) == total
    st = pl.topkdsa_state(n, k, P)
    assert st["mode"] == "sparse" and st["cap2"] > math.ceil(1.25 * k / P)


@pytest.mark.parametrize("fit", ["per-P", "global"])
def test_fit_recovers_alpha_beta_and_predictions_match_on_synthetic(fit):
    truth = pl.Network(3e9, 50e-6)
    d = pl.synthetic_collectives(truth)
    v = pl.validate(d, fit=fit)
    assert v["synthetic"]
    for net in v["networks"]:
        assert net["latency_s"] == pytest.approx(50e-6, rel=1e-6)
        assert net["bandwidth_Bps"] == pytest.approx(3e9, rel=1e-6)
    assert len(v["rows"]) == 2 * len(pl.ALGORITHMS)
    for r in v["rows"]:
        assert r["predicted_ms"] == pytest.approx(r["measured_ms"], rel=1e-6)
    assert v["all_within_target"]
    text = pj.format_validation(v)
    assert text.startswith("*** SYNTHETIC") and text.rstrip().endswith("NOT a measurement ***")


def test_fit_with_noise_and_a_wrong_model_is_caught():
    truth = pl.Network(2e9, 20e-6)
    v = pl.validate(pl.synthetic_collectives(truth, noise=0.05, seed=3))
    for net in v["networks"]:
        assert net["latency_s"] == pytest.approx(20e-6, rel=0.1)
        assert net["bandwidth_Bps"] == pytest.approx(2e9, rel=0.1)
    assert all(abs(r["error_pct"]) < 25 for r in v["rows"])
    # measured steps 2x slower than the model for the sparse algorithms: reported, not hidden
    d = pl.synthetic_collectives(truth)
    d["synthetic"] = False
    d["note"] = "a pretend measurement"
    for r in d["results"]:
        if r["name"] != "dense":
            r["step_ms_mean"] *= 2
    v = pl.validate(d)
    assert not v["all_within_target"]
    text = pj.format_validation(v)
    assert "SYNTHETIC" not in text and "NOT all within 25%" in text


def test_validate_projection_tool_runs_synthetic(tmp_path, capsys):
    spec = importlib.util.spec_from_file_location(
        "validate_projection", os.path.join(ROOT, "tools", "validate_projection.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    path = tmp_path / "synthetic.json"
    rc = mod.main(["--kernels", "none", "--write-synthetic", str(path), "--json",
                   str(tmp_path / "v.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "SYNTHETIC" in out and "recovered" in out
    assert json.loads(path.read_text())["synthetic"] is True
    # the same data split in one file per world size (as tools/gpu_check.py writes them),
    # through the CLI flag
    d = json.loads(path.read_text())
    paths = []
    for P in (4, 8):
        part = dict(d, probes=[p for p in d["probes"] if p["P"] == P],
                    results=[r for r in d["results"] if r["P"] == P])
        paths.append(tmp_path / f"P{P}.json")
        paths[-1].write_text(json.dumps(part))
    assert cli.main(["project", "--validate", *map(str, paths), "--kernels", "none"]) == 0
    out = capsys.readouterr().out
    assert "SYNTHETIC" in out and "fitted for P=4" in out and "fitted for P=8" in out
