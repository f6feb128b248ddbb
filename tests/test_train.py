"""End to end: ``oktopk-bench train`` (torchrun, gloo) on 2 ranks, dense + one sparse algorithm."""
import json
import os
import subprocess
import sys

import pytest

from oktopk_triton.algorithms import available_algorithms

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sparse():
    for name in ("oktopk", "topka", "gtopk", "spardl", "topkdsa", "gaussiank"):
        if name in available_algorithms():
            return name
    pytest.skip("no sparse algorithm implemented yet")


def test_train_cli_end_to_end(tmp_path):
    alg = _sparse()
    out = tmp_path / "train-test.json"
    png = tmp_path / "train-test.png"
    cmd = [sys.executable, "-m", "oktopk_triton.cli", "train", "--algorithms", "dense", alg,
           "--world-size", "2", "--epochs", "2", "--density", "0.01", "--batch-size", "16",
           "--model", "mlp", "--json", str(out), "--plot", str(png), "--timeout", "150"]
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert out.exists() and png.exists() and png.stat().st_size > 1000
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rep = json.loads(out.read_text())
    assert rep["failures"] == []
    rows = {r["algorithm"]: r for r in rep["summary"]}
    assert set(rows) == {"dense", alg}
    for name, r in rows.items():
        assert r["status"] == "ok" and r["replicas_identical"], r
        assert r["final_test_acc"] > 0.3, (name, r["final_test_acc"])   # chance is 0.1
        assert r["bytes_per_step"] > 0 and r["time_per_step_ms"] > 0
    # the sparse run sends far less than dense
    assert rows[alg]["bytes_per_step"] < 0.2 * rows["dense"]["bytes_per_step"]
    # the table and the per-epoch progress reached stdout
    assert "bytes/rank/step" in p.stdout and "epoch  2/2" in p.stdout
    runs = rep["runs"]
    assert len(runs) == 2 and all(len(r["bytes_curve"]) == r["steps"] for r in runs)


def test_parser_and_table():
    import argparse

    from oktopk_triton.bench import report, train
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    a = p.parse_args(["--algorithms", "dense", "--seed", "3", "--option", "tau=8"])
    cfg = train.build_config(a, ["dense"])
    assert cfg["seeds"] == [3] and cfg["options"] == {"tau": 8}
    runs = [{"algorithm": "dense", "seed": 3, "final_test_acc": 0.9, "final_train_loss": 0.1,
             "bytes_per_step": 1000.0, "time_per_step_ms": 2.0, "reduce_ms": 1.0, "numel": 100,
             "k": 100, "replicas_identical": True}]
    summary = report.summarize(runs, ["dense", "oktopk"], [])
    assert summary[1]["status"] == "failed"
    text = report.format_table(summary, cfg)
    assert "dense" in text and "FAILED" in text
