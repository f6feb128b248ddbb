"""``oktopk-bench ddp`` on CPU: 2 gloo ranks, a tiny Linear stack, every hook, two sparse
algorithms."""
import argparse
import json

import pytest

from oktopk_triton.algorithms import available_algorithms
from oktopk_triton.bench import ddp_bench as D
from oktopk_triton.bench import ddp_hooks as H
from oktopk_triton.bench import ranks as R

W, LAYERS, BATCH, STEPS, WARMUP, P = 16, 2, 8, 3, 2, 2


def _two_sparse():
    avail = [a for a in ("oktopk", "topka", "gtopk", "spardl", "topkdsa", "gaussiank")
             if a in available_algorithms()]
    if len(avail) < 2:
        pytest.skip("needs two sparse algorithms")
    return avail[:2]


def _args(*argv):
    p = argparse.ArgumentParser()
    D.add_arguments(p)
    return p.parse_args(list(argv))


# the checks of the one run share one worker (make test: --dist loadgroup): the module's
# fixture then runs once, not once per worker that got a check
REPORT = pytest.mark.xdist_group("bench_ddp_report")


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """One run of the benchmark (one spawn of the ranks) shared by the checks below."""
    out = tmp_path_factory.mktemp("ddp")
    algs = _two_sparse()
    args = _args("--backend", "gloo", "--world-size", str(P), "--width", str(W),
                 "--layers", str(LAYERS), "--batch", str(BATCH), "--steps", str(STEPS),
                 "--warmup", str(WARMUP), "--hooks", "all", "--algorithms", *algs,
                 "--json", str(out / "ddp.json"), "--markdown", str(out / "ddp.md"),
                 "--timeout", "240", "--quiet")
    rc = D.main(args)
    rep = json.loads((out / "ddp.json").read_text())
    return {"rc": rc, "rep": rep, "md": (out / "ddp.md").read_text(), "algs": algs}


def _by_hook(rep):
    return {(r["hook"], r["algorithm"], r["mode"]): r for r in rep["results"]}


@REPORT
def test_schema_and_every_hook_ran(report):
    rep = report["rep"]
    assert report["rc"] == 0 and rep["errors"] == [], rep["errors"]
    for key in ("benchmark", "backend", "date", "commit", "dirty", "arguments",
                "host", "device", "gpus", "mps",
                "versions", "config", "results"):
        assert key in rep, key
    assert rep["benchmark"] == "ddp" and rep["backend"] == "gloo"
    assert rep["mps"] is None and rep["gpus"] == 0          # CPU: no GPU, MPS not applicable
    assert rep["versions"]["torch"]
    cfg = rep["config"]
    assert (cfg["W"], cfg["layers"], cfg["batch"], cfg["P"], cfg["steps"], cfg["warmup"]) == \
        (W, LAYERS, BATCH, P, STEPS, WARMUP)
    assert cfg["params"] == LAYERS * (W * W + W) and "Linear" in cfg["model"]
    modes = D.sparse_modes()
    want = {("none", None, None), ("allreduce", None, None), ("fp16", None, None),
            ("powersgd", None, None)}
    want |= {("sparse", a, m or "bucket") for a in report["algs"] for m in modes}
    got = _by_hook(rep)
    assert set(got) == want
    for r in rep["results"]:
        for key in ("hook", "algorithm", "density", "step_ms_mean", "step_ms_min",
                    "mb_sent_per_rank_per_step", "ratio_to_allreduce", "final_loss"):
            assert key in r, key
        assert 0 < r["step_ms_min"] <= r["step_ms_mean"] + 1e-9
        assert len(r["step_ms_per_step"]) == WARMUP + STEPS
        assert len(r["loss_rank0"]) == WARMUP + STEPS
        assert r["density"] == (0.01 if r["hook"] == "sparse" else None)
    assert got[("allreduce", None, None)]["ratio_to_allreduce"] == 1.0


@REPORT
def test_replicas_and_losses(report):
    got = _by_hook(report["rep"])
    none, ar = got[("none", None, None)], got[("allreduce", None, None)]
    fp16, psgd = got[("fp16", None, None)], got[("powersgd", None, None)]
    # the same initial model and data under every hook: the first loss is the same everywhere
    first = {r["loss_rank0"][0] for r in got.values()}
    assert len(first) == 1, first
    # none averages nothing: each rank follows its own gradients, the replicas drift apart and
    # rank 0's losses leave the averaged trajectory after the first update
    assert not none["replicas_identical"]
    assert none["loss_rank0"][1:] != ar["loss_rank0"][1:]
    # every averaging hook keeps the replicas bitwise identical
    for key, r in got.items():
        if key[0] != "none":
            assert r["replicas_identical"], key
    # fp16 rounds the averaged gradient: close to allreduce (small model, few steps)
    assert fp16["final_loss"] == pytest.approx(ar["final_loss"], rel=1e-2)
    # PowerSGD's first start_powerSGD_iter steps are plain allreduces: the same losses
    assert psgd["loss_rank0"][:2] == pytest.approx(ar["loss_rank0"][:2], rel=1e-6)


@REPORT
def test_bytes(report):
    got = _by_hook(report["rep"])
    params = LAYERS * (W * W + W)
    ring = 2 * (P - 1) / P * 4 * params / 1e6
    assert got[("none", None, None)]["mb_sent_per_rank_per_step"] == 0
    assert got[("allreduce", None, None)]["mb_sent_per_rank_per_step"] == pytest.approx(ring)
    # fp16 allreduces every gradient as 2-byte halves
    assert got[("fp16", None, None)]["mb_sent_per_rank_per_step"] == pytest.approx(ring / 2)
    assert got[("powersgd", None, None)]["mb_sent_per_rank_per_step"] > 0
    for key, r in got.items():
        if key[0] == "sparse":
            assert r["bytes_source"] == "comm.bytes_sent"
            assert 0 < r["mb_sent_per_rank_per_step"] < ring, key


@REPORT
def test_markdown_table(report):
    md, rep = report["md"], report["rep"]
    assert md == D.format_markdown(rep) + "\n"
    rows = [ln for ln in md.splitlines() if ln.startswith("| ") and "---" not in ln]
    assert len(rows) == 1 + len(rep["results"])           # header + one row per hook
    assert "DDP default allreduce" in md and "PowerSGD rank 4" in md
    assert "fp16_compress_hook" in md and "sparse_allreduce_hook" in md
    assert f"Linear({W}, {W})" in md and "gloo" in md


def test_plan_modes_and_validation(monkeypatch):
    algs = _two_sparse()
    plan = D._plan(_args("--hooks", "sparse", "none", "--algorithms", *algs))
    assert plan[0]["hook"] == "none"                       # the floor first, whatever the order
    assert [p["algorithm"] for p in plan[1:]] == [a for a in algs for _ in D.sparse_modes()]
    # a state that accepts mode= gets both modes, each passed through
    monkeypatch.setattr(D, "sparse_modes", lambda: ["bucket", "flat"])
    plan = D._plan(_args("--hooks", "sparse", "--algorithms", algs[0]))
    assert [p["mode"] for p in plan] == ["bucket", "flat"]
    plan = D._plan(_args("--hooks", "sparse", "--algorithms", algs[0], "--modes", "flat"))
    assert [p["mode"] for p in plan] == ["flat"]
    with pytest.raises(SystemExit):
        D._plan(_args("--hooks", "sparse", "--modes", "rows"))
    with pytest.raises(SystemExit):
        D._plan(_args("--hooks", "nope"))
    with pytest.raises(SystemExit):                        # warm-up must cover PowerSGD's start
        D._resolve_config(_args("--backend", "gloo", "--warmup", "1"))
    with pytest.raises(SystemExit):
        D._resolve_config(_args("--backend", "gloo", "--density", "2"))


def test_sparse_modes_follows_the_state_signature(monkeypatch):
    import oktopk_triton.ddp as hook_mod

    class WithMode(hook_mod.SparseAllreduceState):
        __slots__ = ("mode",)

        def __init__(self, *a, mode="bucket", **kw):
            super().__init__(*a, **kw)
            self.mode = mode

    accepted = D.sparse_modes()
    assert accepted in ([None], ["bucket", "flat"])
    monkeypatch.setattr(hook_mod, "SparseAllreduceState", WithMode)
    assert D.sparse_modes() == ["bucket", "flat"]
    cfg = {"density": 0.01, "kernel_backend": "torch"}
    st = H._make_sparse_state(cfg, None, _two_sparse()[0], "flat")
    assert st.mode == "flat" and st.density == 0.01 and st.start_iter == D.SPARSE_START_ITER


def test_mps_detection(tmp_path, monkeypatch):
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path))
    assert D.detect_mps()["active"] is False                 # no control pipe
    (tmp_path / "control").write_text("")
    monkeypatch.setattr(R.os, "listdir", lambda path: [] if path == "/proc" else [])
    assert D.detect_mps()["active"] is False                 # a stale pipe, no daemon


def test_cli_has_ddp():
    from oktopk_triton import cli
    args = cli.build_parser("ddp").parse_args(["ddp", "--world-size", "2", "--hooks", "none"])
    assert args._module is D and args.world_size == 2


def test_summary_times_exclude_warmup_and_take_the_slowest_rank():
    cfg = {"warmup": 2, "density": 0.01, "powersgd_rank": 4, "powersgd_start_iter": 2}
    ranks = [{"time_s": [9.0, 9.0, 0.010, 0.030], "bytes": [0, 0, 100.0, 300.0],
              "loss": [1.0, 0.9, 0.8, 0.7], "param_digest": "a"},
             {"time_s": [9.0, 9.0, 0.020, 0.010], "bytes": [0, 0, 100.0, 300.0],
              "loss": [1.0, 0.8, 0.6, 0.5], "param_digest": "a"}]
    s = D._summary({"hook": "sparse", "algorithm": "topka", "mode": None}, ranks, cfg)
    assert s["step_ms_mean"] == pytest.approx((20 + 30) / 2)   # per step the slowest rank
    assert s["step_ms_min"] == pytest.approx(20)
    assert s["mb_sent_per_rank_per_step"] == pytest.approx(200 / 1e6)
    assert s["final_loss"] == pytest.approx(0.6) and s["replicas_identical"]
    assert s["mode"] == "bucket" and s["density"] == 0.01
    ranks[1]["param_digest"] = "b"
    assert not D._summary({"hook": "none", "algorithm": None, "mode": None}, ranks,
                          cfg)["replicas_identical"]


def test_markdown_of_a_gpu_report():
    rep = {"backend": "nccl", "date": "2026-11-23T12:00:00+00:00", "commit": "0123456789abc",
           "device": "NVIDIA H100 80GB HBM3", "gpus": 1, "mps": False,
           "config": {"W": 2048, "layers": 16, "params": 16 * (2048 * 2048 + 2048), "batch": 64,
                      "P": 4, "steps": 8, "warmup": 3, "bucket_cap_mb": 25.0, "ranks_per_gpu": 4},
           "results": [{"hook": "allreduce", "algorithm": None, "mode": None, "density": None,
                        "step_ms_mean": 178.04, "step_ms_min": 170.0,
                        "mb_sent_per_rank_per_step": 402.7, "ratio_to_allreduce": 1.0,
                        "final_loss": 1.01, "replicas_identical": True},
                       {"hook": "sparse", "algorithm": "spardl", "mode": "flat", "density": 0.01,
                        "step_ms_mean": 37.6, "step_ms_min": 36.0,
                        "mb_sent_per_rank_per_step": 8.1, "ratio_to_allreduce": 0.211,
                        "final_loss": 1.02, "replicas_identical": True}],
           "errors": [{"hook": "sparse", "algorithm": "oktopk", "mode": None,
                       "error": "Traceback (most recent call last):\n  File x\n"
                                "RuntimeError: boom\n"}]}
    md = D.format_markdown(rep)
    assert "67.1M parameters" in md and "NVIDIA H100 80GB HBM3" in md
    assert "P=4 ranks on 1 GPU(s), MPS OFF (time-sliced)" in md and "2026-11-23" in md
    assert "| DDP default allreduce | 178.0 | 170.0 | 402.7 | 1.00 |" in md
    assert "| `sparse_allreduce_hook`, SparDL 1%, flat | 37.6 | 36.0 | 8.1 | 0.21 |" in md
    assert "| sparse/oktopk | failed: RuntimeError: boom |" in md


def test_rank_placement():
    assert [R.placement(r, 4, 1) for r in range(4)] == \
        [(0, {"NCCL_HOSTID": f"oktopk-rank{r}"}) for r in range(4)]   # one GPU: four hosts
    assert [R.placement(r, 4, 2)[0] for r in range(4)] == [0, 1, 0, 1]
    assert R.placement(3, 4, 8) == (3, {})                        # a GPU each: NCCL as usual
    with pytest.raises(RuntimeError):
        R.placement(0, 2, 0)


def test_gpu_run_around_the_ranks(monkeypatch, capsys):
    """The CUDA path without a GPU: config defaults, MPS recorded and warned about, the report
    assembled from (faked) rank records."""
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "FakeGPU 80GB")
    monkeypatch.setattr(D, "detect_mps", lambda: {"active": False})
    seen = {}

    def fake_spawn(cfg, plan, timeout, log):
        seen["cfg"], seen["plan"] = cfg, plan
        rec = {"time_s": [0.5, 0.4, 0.2, 0.1], "bytes": [0.0, 0.0, 8e6, 8e6],
               "loss": [1.0, 0.9, 0.8, 0.7], "param_digest": "x"}
        return {i: [dict(rec) for _ in range(cfg["P"])] for i in range(len(plan))}, {}, []

    monkeypatch.setattr(D, "_spawn_ranks", fake_spawn)
    rep = D.run_benchmark(_args("--hooks", "allreduce", "none", "--warmup", "2", "--steps", "2"),
                          log=lambda *a, **k: None)
    cfg = seen["cfg"]
    assert (cfg["backend"], cfg["P"], cfg["width"], cfg["layers"], cfg["batch"]) == \
        ("nccl", 4, 2048, 16, 64)
    assert cfg["ranks_per_gpu"] == 4 and cfg["kernel_backend"] == "auto"
    assert rep["config"]["params"] == 16 * (2048 * 2048 + 2048)        # 67.1M
    assert rep["backend"] == "nccl" and rep["device"] == "FakeGPU 80GB" and rep["gpus"] == 1
    assert rep["mps"]["active"] is False and rep["warnings"] and "MPS" in rep["warnings"][0]
    assert "NOT active" in capsys.readouterr().err                     # loudly, on stderr
    assert [r["hook"] for r in rep["results"]] == ["none", "allreduce"]
    assert rep["results"][1]["step_ms_mean"] == pytest.approx(150.0)
    assert rep["results"][1]["ratio_to_allreduce"] == 1.0
    assert "MPS OFF (time-sliced)" in D.format_markdown(rep)
