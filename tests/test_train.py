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
    for r in runs:      # the optimizer (SGD, after the reduction) timed apart, every step
        assert len(r["optimizer_ms_curve"]) == len(r["step_ms_curve"]) == r["steps"]
        assert r["optimizer_ms"] > 0 and r["timing"]["warmup_steps"] == 2
        assert r["synced_curve"] == [1] * r["steps"] and r["optimizer_fused"] is False


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
    assert summary[0]["optimizer_ms"] is None and "optimizer ms" in text   # an older record
    runs[0]["optimizer_ms"] = 0.5
    summary = report.summarize(runs, ["dense"], [])
    assert summary[0]["optimizer_ms"] == 0.5 and "0.50" in report.format_table(summary, cfg)


# -- the run record's times (bench/loops.py RunLog) ------------------------------------------------
def _runlog(sync_every, synced, times):
    import torch

    from oktopk_triton.bench.loops import RunLog
    run = RunLog(torch.device("cpu"), sync_every)
    t = 0.0
    for s, (c, r, o) in zip(synced, times):
        run.record(t, t + c, t + c + r, t + c + r + o, {"bytes_sent": 100 * s, "synced": s})
        t += c + r + o + 1.0
    return run


def test_runlog_skips_two_intervals_and_splits_sync_from_local_calls():
    from oktopk_triton.bench.loops import warmup_steps
    assert warmup_steps(1) == 2 and warmup_steps(4) == 8
    synced = [(i + 1) % 4 == 0 for i in range(16)]
    # compute 10 ms; a local call reduces 1 ms, a sync 5 ms (the first one 50); optimizer 2 ms
    times = [(0.010, 0.005 if s else 0.001, 0.002) for s in synced]
    times[3] = (0.010, 0.050, 0.002)
    tot = _runlog(4, synced, times).totals()
    tm = tot["timing"]
    assert tm["warmup_steps"] == 8 and tm["timed_steps"] == 8
    assert tot["synced_curve"] == [int(s) for s in synced]
    assert len(tot["step_ms_curve"]) == len(tot["reduce_ms_curve"]) == 16
    assert tot["reduce_ms_curve"][3] == pytest.approx(50.0)
    # steps 8..15: two syncs, six local calls; the first sync's 50 ms is not averaged in
    assert tot["reduce_ms"] == pytest.approx((2 * 5 + 6 * 1) / 8)
    assert tot["optimizer_ms"] == pytest.approx(2.0) and tot["compute_ms"] == pytest.approx(10.0)
    assert tot["time_per_step_ms"] == pytest.approx(10 + 2 + 16 / 8)
    assert tm["sync_calls"]["count"] == 2 and tm["local_calls"]["count"] == 6
    assert tm["sync_calls"]["reduce_ms"] == pytest.approx(5.0)
    assert tm["local_calls"]["reduce_ms"] == pytest.approx(1.0)
    assert tm["local_calls"]["step_ms"] == pytest.approx(13.0)
    first = tm["first_sync"]
    assert first["step"] == 3 and first["reduce_ms"] == pytest.approx(50.0)
    assert first["reduce_extra_ms"] == pytest.approx(45.0)


def test_runlog_short_runs_and_every_step_syncs():
    run = _runlog(1, [True] * 3, [(0.001, 0.002, 0.003)] * 2 + [(0.001, 0.004, 0.003)])
    tot = run.totals()
    assert tot["timing"]["warmup_steps"] == 2 and tot["reduce_ms"] == pytest.approx(4.0)
    assert tot["timing"]["local_calls"] == {"count": 0, "step_ms": None, "compute_ms": None,
                                            "reduce_ms": None, "optimizer_ms": None}
    assert tot["timing"]["first_sync"]["step"] == 0
    short = _runlog(4, [False, False], [(0.001, 0.001, 0.001)] * 2).totals()
    assert short["timing"]["warmup_steps"] == 0 and short["timing"]["first_sync"] is None
    assert short["time_per_step_ms"] == pytest.approx(3.0)


def test_runlog_times_an_optimizer_step_inside_the_reduction_apart():
    """reduce_updates steps the optimizer inside the reduction: its time moves from reduce_ms to
    optimizer_ms (the watch's step hooks), as for a loop that steps it after the reduction."""
    import time

    import torch

    from oktopk_triton.bench.loops import RunLog
    w = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([w], lr=0.1)
    run = RunLog(torch.device("cpu"))
    run.watch(opt)
    opt.register_step_pre_hook(lambda *a: time.sleep(0.05))   # a slow optimizer
    for _ in range(3):
        w.grad = torch.ones(4)
        t0 = time.perf_counter()
        t1 = time.perf_counter()
        time.sleep(0.01)                                        # the reduction's own work
        opt.step()                                              # inside it
        t2 = t3 = time.perf_counter()
        run.record(t0, t1, t2, t3, {"bytes_sent": 1})
    assert all(r < 0.04 for r in run.reduce_times), run.reduce_times
    assert all(o >= 0.05 for o in run.optimizer_times), run.optimizer_times
    run.close()
    w.grad = torch.ones(4)
    opt.step()                                                   # unwatched now
    assert run._opt_spans == []


def test_adamw_is_fused_on_cuda_only():
    import torch

    from oktopk_triton.bench.loops import _make_optimizer, _offers_fused, optimizer_fused
    assert _offers_fused(torch.optim.AdamW)
    cfg = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.0}
    cpu = _make_optimizer(cfg, [torch.nn.Parameter(torch.ones(3))], False)
    assert not optimizer_fused(cpu)
    if torch.cuda.is_available():
        gpu = _make_optimizer(cfg, [torch.nn.Parameter(torch.ones(3, device="cuda"))], False)
        assert optimizer_fused(gpu)
