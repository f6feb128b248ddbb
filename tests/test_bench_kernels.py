"""``oktopk-bench kernels`` on CPU at tiny n: every kernel row is there with n, ms and its bytes
formula, the JSON has what the cost model and tools/ read, and the goals are judged right."""
import json
import os

import pytest

from oktopk_triton import cli
from oktopk_triton.bench import kernels as bench

KERNELS = {"copy", "read", "torch_topk", "topk_gather", "hist_threshold", "magnitude_threshold",
           "window_pass", "fused_select", "unfused_torch", "scatter_rows", "index_put", "selection",
           "magnitude_keys", "gaussian_threshold", "select_above"}
# the competitors' kernels beside the torch ops they replaced, where the backend is not torch
REPLACED = {"magnitude_keys_torch", "gaussian_threshold_torch", "select_above_torch"}
ROW_KEYS = {"kernel", "name", "n", "ms", "median_ms", "min_ms", "bytes", "bytes_formula", "gbps",
            "pct_copy_bw", "speedup_vs_topk"}


def run_cli(tmp_path, *extra):
    path = tmp_path / "k.json"
    assert cli.main(["kernels", "--n", "2048", "3001", "--repeats", "1", "--warmup", "0",
                     "--json", str(path), *extra]) == 0
    return json.loads(path.read_text())


def test_kernels_bench_json_on_cpu(tmp_path, capsys):
    rep = run_cli(tmp_path, "--device", "cpu")       # cpu also where CUDA is at hand
    for key in ("device", "device_type", "date", "torch", "triton", "commit", "dirty", "arguments",
                "density",
                "regions", "repeats", "sizes", "runs", "entries", "goals", "kernel_backend"):
        assert key in rep, key
    assert rep["device_type"] == "cpu" and rep["sizes"] == [2048, 3001]
    assert [r["n"] for r in rep["runs"]] == [2048, 3001]
    assert len(rep["entries"]) == sum(len(r["results"]) for r in rep["runs"])
    for run in rep["runs"]:
        assert {r["kernel"] for r in run["results"]} == KERNELS
        for r in run["results"]:
            assert ROW_KEYS <= set(r), r["name"]
            assert r["n"] == run["n"] and r["ms"] > 0 and r["bytes"] > 0
        fused = {(r["grad_dtype"], r["velocity"], r["hist"])
                 for r in run["results"] if r["kernel"] == "fused_select"}
        assert fused == {(g, v, h) for g in ("fp32", "bf16") for v in (False, True)
                         for h in (False, True)}
        copy = next(r for r in run["results"] if r["kernel"] == "copy")
        assert copy["pct_copy_bw"] == pytest.approx(100.0) and copy["bytes"] == 8 * run["n"]
        sel = next(r for r in run["results"] if r["kernel"] == "selection")
        assert sel["speedup_vs_topk_gather"] > 0
    assert rep["goals"] == []               # no goal is set at these n
    out = capsys.readouterr().out
    assert "magnitude_threshold" in out and "scatter_rows" in out and "goals" in out
    # the README table renders from this JSON: one row per kernel, one column per n
    from tools import readme_tables
    table = readme_tables.kernels_table(str(tmp_path / "k.json"))
    assert "| kernel | n = 2^11 | n = 3001 |" in table
    for r in rep["runs"][0]["results"]:
        assert f"| {r['name']} | " in table


def test_kernels_bench_triton_interpreter(tmp_path):
    """The Triton launchers as the benchmark calls them (compiled on CUDA, else interpreted)."""
    from oktopk_triton import kernels as K
    device = "cuda" if bench.torch.cuda.is_available() else "cpu"
    if device == "cpu" and not K.INTERPRET:
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    rep = bench.run(2048, 0.02, ["fp32", "bf16"], regions=3, repeats=1, warmup=0, device=device,
                    backend="triton")
    assert rep["kernel_backend"] == "triton"
    assert {r["kernel"] for r in rep["results"]} == KERNELS | REPLACED
    assert "fused select bf16 +velocity +hist" in bench.format_table(rep)


def test_goals_judged_on_cuda_rows():
    def fake(n, thr_ms, topk_ms, pct):
        rows = [{"kernel": "magnitude_threshold", "name": "magnitude_threshold", "ms": thr_ms,
                 "speedup_vs_topk": topk_ms / thr_ms},
                {"kernel": "fused_select", "name": "fused select fp32", "pct_copy_bw": pct}]
        return {"n": n, "device_type": "cuda", "results": rows}

    goals = bench.evaluate_goals([fake(1 << 24, 0.1, 0.42, 90.0), fake(1 << 28, 0.9, 5.93, 79.0)])
    got = {(g["n"], g["goal"]): g["met"] for g in goals}
    assert got == {(1 << 24, "threshold speedup vs torch.topk >="): False,    # 4.2x < 5x
                   (1 << 28, "threshold ms <="): False,                       # 0.9 > 0.8
                   (1 << 28, "threshold speedup vs torch.topk >="): False,    # 6.6x < 7x
                   (1 << 28, "fused select % of copy bandwidth >="): False}   # 79 < 80
    goals = bench.evaluate_goals([fake(1 << 28, 0.7, 5.93, 85.0)])
    assert all(g["met"] for g in goals) and len(goals) == 3
    cpu = fake(1 << 28, 0.7, 5.93, 85.0)
    cpu["device_type"] = "cpu"
    assert all(g["met"] is None for g in bench.evaluate_goals([cpu]))
    assert "not evaluated" in bench.format_goals(bench.evaluate_goals([cpu]))
    assert bench.default_json_path("2026-11-23") == os.path.join(
        "bench", "results", "kernels", "gpu-kernels-2026-11-23.json")
