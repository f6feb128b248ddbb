"""A tiny run of ``oktopk-bench collectives`` (local backend) and checks of its JSON."""
import argparse
import statistics
import json
import subprocess
import sys


import pytest

from oktopk_triton.algorithms import available_algorithms
from oktopk_triton.bench import collectives as C
from oktopk_triton.bench import collectives_rank as CR
from oktopk_triton.bench import measure as M
from oktopk_triton.bench import ranks as R

N = 6144  # divisible by 2 and 3: the dense ring formula is an integer number of bytes


def _args(tmp_path, *extra):
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    return p.parse_args(["--algorithms", "all", "--world-sizes", "2", "3", "--n", str(N),
                         "--density", "0.01", "--steps", "3", "--backend", "local",
                         "--json", str(tmp_path / "c.json"), "--plot", str(tmp_path / "c.png"),
                         "--quiet", *extra])


def test_collectives_json(tmp_path, capsys, monkeypatch):
    # the kernels' torch references (the interpreter cost minutes for every algorithm at P = 2
    # and 3); interpreted launches across the LocalCluster threads are run by
    # test_collectives_local_schema
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    rc = C.main(_args(tmp_path))
    text = capsys.readouterr().out
    rep = json.loads((tmp_path / "c.json").read_text())
    assert (tmp_path / "c.png").stat().st_size > 1000
    # every available algorithm runs
    failed = {e["algorithm"] for e in rep["errors"]}
    assert not failed, rep["errors"]
    assert rc == 0
    for key in ("date", "machine", "versions", "config", "results"):
        assert key in rep
    assert rep["versions"]["torch"]
    avail = set(available_algorithms())
    ran = {r["algorithm"] for r in rep["results"]}
    assert ran | failed == avail  # 'all' = dense + every available sparse algorithm
    assert {s["algorithm"] for s in rep["skipped"] if "algorithm" in s} == \
        {"dense", "oktopk", "topka", "gtopk", "spardl", "topkdsa", "gaussiank"} - avail
    assert "lower bound" in text and "spardl" in text
    for r in rep["results"]:
        P, k = r["P"], r["k"]
        assert k == round(0.01 * N)
        # measured bytes are the communicator's count, identical to the algorithm's stats
        assert r["bytes_match_stats"], r["algorithm"]
        by = r["bytes_per_rank_per_step"]
        assert len(by) == 3 and all(len(row) == P for row in by)
        assert r["bytes_max"] == max(max(row) for row in by)
        assert r["bytes_mean"] == pytest.approx(sum(by[1]) / P / 2 + sum(by[2]) / P / 2)
        assert r["lower_bound_bytes"] == pytest.approx(4 * 2 * k * (P - 1) / P)
        assert r["check_bytes"] == 2 * (P - 1) * 4 // P
        assert 0 < r["nnz_mean"] <= N
        if r["algorithm"] == "dense":
            # dense: exactly the ring formula 2n(P-1)/P words (+ the 4-byte non-finite flag)
            assert r["formula_bytes_high"] == 4 * 2 * N * (P - 1) / P
            for row in by:
                assert all(b == r["formula_bytes_high"] + r["check_bytes"] for b in row)
            assert r["nnz_mean"] == N
        if r["algorithm"] == "spardl":
            kb = max(1, round(k / P))
            assert all(b == 2 * (P - 1) * (1 + 2 * kb) * 4 + r["check_bytes"]
                       for row in by for b in row)
        if r["algorithm"] != "dense":
            assert r["bytes_mean"] < r["formula_bytes_high"] * 1.6 + 64 * P


def test_collectives_check_finite_off_dense_exact(tmp_path):
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    a = p.parse_args(["--algorithms", "dense", "--world-sizes", "3", "--n", str(N), "--steps", "2",
                      "--check-finite", "off", "--quiet"])
    rep = C.run_benchmark(a, log=lambda *x: None)
    (r,) = rep["results"]
    assert r["check_bytes"] == 0
    assert all(b == 4 * 2 * N * 2 // 3 for row in r["bytes_per_rank_per_step"] for b in row)


@pytest.mark.parametrize("entry", [["oktopk_triton.cli", "collectives"],
                                   ["oktopk_triton.bench.collectives"]], ids=["cli", "module"])
@pytest.mark.slow
def test_collectives_cli_entry(tmp_path, entry):
    """``oktopk-bench collectives`` and ``python -m oktopk_triton.bench.collectives`` (which goes
    through the same checked parser) run and write the JSON."""
    out = tmp_path / "d.json"
    r = subprocess.run([sys.executable, "-m", *entry, "--algorithms", "dense", "spardl",
                        "--world-sizes", "2", "--n", "4096", "--steps", "2", "--json", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rep = json.loads(out.read_text())
    assert [x["algorithm"] for x in rep["results"]] == ["dense", "spardl"]
    assert "spardl" in r.stdout


# ---------------------------------------------------------------------------------------------
# the one-GPU benchmark's schema: same on every backend
# ---------------------------------------------------------------------------------------------
TOP_KEYS = ("benchmark", "backend", "comm", "date", "commit", "dirty", "arguments",
            "host", "device", "gpus", "mps",
            "versions", "config", "probes", "results")
RESULT_KEYS = ("step_ms_mean", "step_ms_min", "mb_sent_per_rank", "ratio_to_dense", "host_syncs",
               "out_bitwise_equal", "collectives_per_step")


def _check_schema(rep, backend, comm, Ps, n):
    for key in TOP_KEYS:
        assert key in rep, key
    assert rep["benchmark"] == "collectives" and rep["backend"] == backend and rep["comm"] == comm
    assert set(rep["versions"]) >= {"torch", "triton", "cupy", "nccl", "python"}
    assert rep["versions"]["torch"] and rep["versions"]["python"]
    assert isinstance(rep["mps"]["active"], bool)
    # probes: dense (4n bytes), 4 bytes and 64 KiB per P, times positive, min <= mean
    assert sorted((p["P"], p["bytes"]) for p in rep["probes"]) == sorted(
        (P, b) for P in Ps for b in (4 * n, 4, 65536))
    for p in rep["probes"]:
        assert p["op"] == "allreduce" and 0 < p["ms_min"] <= p["ms_mean"]
    for r in rep["results"]:
        for key in RESULT_KEYS:
            assert key in r, key
        assert r["out_bitwise_equal"] is True, r["algorithm"]
        assert 0 < r["step_ms_min"] <= r["step_ms_mean"]
        assert r["mb_sent_per_rank"] == pytest.approx(r["bytes_mean"] / 1e6)
        assert r["host_syncs"] is None  # CPU
        assert r["ratio_to_dense"] is not None and r["ratio_to_dense"] > 0
        timed = r["time_s_per_step"][r["warmup"]:]
        assert r["step_ms_mean"] == pytest.approx(1e3 * sum(timed) / len(timed))
        assert r["step_ms_min"] == pytest.approx(1e3 * min(timed))
        assert r["step_ms_min"] <= r["step_ms_p25"] <= r["step_ms_median"] <= r["step_ms_p75"]
        assert r["step_ms_median"] == pytest.approx(1e3 * statistics.median(timed))
        if r["algorithm"] == "dense":
            assert r["ratio_to_dense"] == 1.0
            assert r["collectives_per_step"] == 2  # the allreduce + the non-finite flag
        if r["algorithm"] == "oktopk":
            assert 1 <= r["collectives_per_step"] <= 3


def test_collectives_local_schema(tmp_path):
    """Also: under TRITON_INTERPRET=1 Ok-Topk's interpreted kernels run on the LocalCluster
    threads (the kernel layer serialises interpreted launches)."""
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    a = p.parse_args(["--algorithms", "dense", "oktopk", "--world-sizes", "2", "--n", "4096",
                      "--steps", "3", "--probe-reps", "3", "--quiet"])
    rep = C.run_benchmark(a, log=lambda *x: None)
    assert not rep["errors"], rep["errors"]
    _check_schema(rep, "local", "local", [2], 4096)
    assert rep["device"] == "cpu"


@pytest.mark.slow
def test_collectives_gloo_schema_and_rank_env(tmp_path, monkeypatch):
    """P=2 gloo processes: the schema and values, and each rank's process environment set from
    rank_env before its communicator is built (here a stand-in NCCL_HOSTID per rank)."""
    monkeypatch.setattr(C, "rank_env", lambda r, P, ngpu: {"NCCL_HOSTID": f"test-host-{r}"})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)   # ranks on the torch references
    out = tmp_path / "g.json"
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    a = p.parse_args(["--algorithms", "dense", "oktopk", "--world-sizes", "2", "--n", "4096",
                      "--steps", "3", "--warmup", "1", "--probe-reps", "3", "--backend", "gloo",
                      "--json", str(out), "--quiet", "--timeout", "120", "--comm-timeout", "60"])
    assert C.main(a) == 0
    rep = json.loads(out.read_text())
    assert not rep["errors"], rep["errors"]
    _check_schema(rep, "gloo", "torch", [2], 4096)
    assert [r["algorithm"] for r in rep["results"]] == ["dense", "oktopk"]
    assert [i["NCCL_HOSTID"] for i in rep["rank_info"]["2"]] == ["test-host-0", "test-host-1"]
    assert len({i["pid"] for i in rep["rank_info"]["2"]}) == 2  # one process per rank


def test_rank_env_gives_each_rank_sharing_a_gpu_its_own_nccl_hostid():
    assert [C.rank_env(r, 4, 4) for r in range(4)] == [{}] * 4       # one GPU per rank
    ids = [C.rank_env(r, 4, 1)["NCCL_HOSTID"] for r in range(4)]      # 4 ranks, 1 GPU
    assert len(set(ids)) == 4
    assert len({C.rank_env(r, 8, 2)["NCCL_HOSTID"] for r in range(8)}) == 8
    assert [R.placement(r, 4, 2)[0] for r in range(4)] == [0, 1, 0, 1]
    assert R.ranks_share_gpu(2, 1) and not R.ranks_share_gpu(2, 2) and not R.ranks_share_gpu(2, 0)


class _Done:
    def __init__(self, rc, out="", err=""):
        self.returncode, self.stdout, self.stderr = rc, out, err


def _fake_run(answers):
    calls = []

    def run(cmd, **kw):
        calls.append((cmd[0], kw.get("input"), kw.get("env", {}).get("CUDA_MPS_PIPE_DIRECTORY")))
        a = answers.get(cmd[0])
        if a is None:
            raise FileNotFoundError(cmd[0])
        return a
    return run, calls


def test_detect_mps_on_fake_outputs():
    # daemon up: the control pipe exists and get_server_list answers
    run, calls = _fake_run({"nvidia-cuda-mps-control": _Done(0, "4242\n")})
    m = R.detect_mps(env={"CUDA_MPS_PIPE_DIRECTORY": "/tmp/mps-pipe"}, run=run,
                     exists=lambda p: p == "/tmp/mps-pipe/control")
    assert m["active"] is True and m["servers"] == ["4242"]
    assert m["pipe_directory"] == "/tmp/mps-pipe"
    assert calls == [("nvidia-cuda-mps-control", "get_server_list\n", "/tmp/mps-pipe")]
    # daemon up, no server started yet: still active
    run, _ = _fake_run({"nvidia-cuda-mps-control": _Done(0, "")})
    assert R.detect_mps(env={}, run=run, exists=lambda p: p == "/tmp/nvidia-mps/control")["active"]
    # no daemon: the client cannot find it
    run, _ = _fake_run({"nvidia-cuda-mps-control": _Done(1, "", "Cannot find MPS control daemon "
                                                                "process")})
    m = R.detect_mps(env={}, run=run, exists=lambda p: False)
    assert m["active"] is False and "Cannot find" in m["detail"]
    # a stale pipe directory with nothing answering
    run, _ = _fake_run({"nvidia-cuda-mps-control": _Done(1, "")})
    assert R.detect_mps(env={}, run=run, exists=lambda p: True)["active"] is False
    # no control command: nvidia-smi listing an MPS server counts, a plain process list not
    run, _ = _fake_run({"nvidia-smi": _Done(0, "Processes\n  Name : nvidia-cuda-mps-server\n")})
    assert R.detect_mps(env={}, run=run, exists=lambda p: False)["active"] is True
    run, _ = _fake_run({"nvidia-smi": _Done(0, "Processes\n  Name : python\n")})
    m = R.detect_mps(env={}, run=run, exists=lambda p: False)
    assert m["active"] is False and "not found" in m["detail"]
    # nothing at all (a CPU machine)
    run, _ = _fake_run({})
    assert R.detect_mps(env={}, run=run, exists=lambda p: False)["active"] is False


def test_mps_warning_only_when_ranks_share_a_gpu_without_mps():
    off, on = {"active": False, "detail": "x"}, {"active": True}
    assert R.mps_warning(4, 1, off) and "MPS" in R.mps_warning(4, 1, off)
    assert "4 ranks share 1 GPU" in R.mps_warning(4, 1, off)
    assert R.mps_warning(4, 1, on) is None
    assert R.mps_warning(4, 4, off) is None
    assert R.mps_warning(2, 0, off) is None


def test_default_json_path_names_date_and_device():
    path = C.default_json_path({"date": "2026-11-23T10:00:00+00:00",
                                "device": "NVIDIA H100 80GB HBM3"})
    assert path.replace("\\", "/").endswith(
        "bench/results/collectives/gpu-collectives-2026-11-23-nvidia-h100-80gb-hbm3.json")


def test_nccl_backend_plumbing_with_fakes(tmp_path, monkeypatch, capsys):
    """The nccl path without a GPU: one fake GPU, MPS off, the process group replaced by
    LocalCluster running the same rank functions. P=1 gets no NCCL_HOSTID and no warning; P=2
    on the one GPU gets one NCCL_HOSTID per rank and the loud warning; the JSON goes to the
    default path with the device the ranks reported."""
    from oktopk_triton.comm import LocalCluster
    seen = {}

    def fake_group(P, algs, cfg, log=print):
        seen[P] = cfg
        res = {a: LocalCluster(P).run(CR._rank_run, a, cfg["n"], cfg["density"], cfg["steps"],
                                      cfg["seed"], cfg["check_finite"]) for a in algs}
        probes = (LocalCluster(P).run(CR._rank_probes, cfg["n"], cfg["probe_reps"])
                  if cfg["probes"] else None)
        info = [{"pid": 1000 + r, "device_name": "NVIDIA H100 80GB HBM3", "nccl": "2.28.9",
                 "NCCL_HOSTID": cfg["env"][r].get("NCCL_HOSTID")} for r in range(P)]
        return {"results": res, "probes": probes, "info": info, "error": None, "remaining": []}

    monkeypatch.setattr(C, "_gpu_count", lambda: 1)
    monkeypatch.setattr(C, "detect_mps", lambda: {"active": False, "detail": "fake: no daemon"})
    monkeypatch.setattr(C, "_run_group", fake_group)
    monkeypatch.setattr(C, "default_json_path", lambda rep: str(
        tmp_path / f"gpu-collectives-{rep['date'][:10]}-{C.device_slug(rep['device'])}.json"))
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    a = p.parse_args(["--algorithms", "dense", "spardl", "--world-sizes", "1", "2", "--n", "4096",
                      "--steps", "2", "--probe-reps", "2", "--backend", "nccl", "--quiet"])
    assert C.main(a) == 0
    err = capsys.readouterr().err
    assert seen[1]["env"] == [{}] and seen[1]["comm"] == "cupy" and seen[1]["ngpu"] == 1
    assert len({e["NCCL_HOSTID"] for e in seen[2]["env"]}) == 2
    assert "WARNING" in err and "2 ranks share 1 GPU" in err and "MPS" in err
    assert "1 ranks share" not in err
    (path,) = tmp_path.glob("gpu-collectives-*-nvidia-h100-80gb-hbm3.json")
    rep = json.loads(path.read_text())
    assert rep["device"] == "NVIDIA H100 80GB HBM3" and rep["gpus"] == 1
    assert rep["versions"]["nccl"] == "2.28.9" and rep["mps"]["active"] is False
    assert [w["P"] for w in rep["warnings"]] == [2]
    assert {(r["algorithm"], r["P"]) for r in rep["results"]} == {
        ("dense", 1), ("spardl", 1), ("dense", 2), ("spardl", 2)}
    assert [r["ranks_share_gpu"] for r in rep["results"] if r["P"] == 2] == [True, True]


def test_count_host_syncs_counts_the_sync_warnings(monkeypatch):
    import warnings

    import torch
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: modes.append(m))

    def step():
        warnings.warn("called a synchronizing CUDA operation")
        warnings.warn("something else")
        warnings.warn("called a synchronizing CUDA operation")
        return "out"
    assert CR.count_host_syncs(step) == (2, "out")
    assert modes == ["warn", 0]


def test_out_checksum_is_bitwise():
    import torch
    x = torch.randn(1000)
    assert M.checksum(x) == M.checksum(x.clone())
    y = x.clone()
    y[17] = torch.nextafter(y[17], torch.tensor(float("inf")))  # one ulp
    assert M.checksum(y) != M.checksum(x)
    z = x.clone()
    z[[3, 4]] = z[[4, 3]]  # same words, other places
    assert M.checksum(z) != M.checksum(x)
    assert M.checksum(torch.zeros(4)) != M.checksum(torch.tensor([0.0, -0.0, 0.0, 0.0]))
    assert M.checksum(x.to(torch.bfloat16)) == M.checksum(x.to(torch.bfloat16))


@pytest.mark.slow
def test_run_group_failure_ends_the_group_and_names_the_rest():
    """An algorithm that fails on the ranks ends its process group at once (no hang, no process
    left) and the algorithms after it are handed back to be run in a new group."""
    import multiprocessing
    cfg = {"backend": "gloo", "comm": "torch", "n": 2048, "density": 0.01, "steps": 2,
           "seed": 0, "check_finite": "skip", "timeout": 120, "comm_timeout": 30,
           "startup_timeout": 120, "ngpu": 0, "probes": False, "probe_reps": 0,
           "env": [{}, {}]}
    g = C._run_group(2, ["dense", "no-such-algorithm", "spardl"], cfg, log=lambda *a: None)
    assert list(g["results"]) == ["dense"]
    assert g["error"]["algorithm"] == "no-such-algorithm"
    assert "unknown algorithm" in g["error"]["error"]
    assert g["remaining"] == ["spardl"]
    assert g["probes"] is None
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("oktopk-bench")]


# ---------------------------------------------------------------------------------------------
# variants: NAME:KEY=VALUE[,graph=1]
# ---------------------------------------------------------------------------------------------
def test_parse_variant_reads_options_and_the_graph_flag():
    assert CR.parse_variant("oktopk") == ("oktopk", {}, False)
    assert CR.parse_variant("OkTopk:wire_format=compact,graph=1") == (
        "oktopk", {"wire_format": "compact"}, True)
    assert CR.parse_variant("oktopk:momentum=0.9,graph=false") == ("oktopk", {"momentum": 0.9},
                                                                    False)
    for bad in ("oktopk:wire_format", "oktopk:=3", "oktopk:graph=2"):
        with pytest.raises(ValueError, match="oktopk"):
            CR.parse_variant(bad)


def _variant_args(tmp_path, *algorithms, backend="local", warmup="1"):
    p = argparse.ArgumentParser()
    C.add_arguments(p)
    return p.parse_args(["--algorithms", *algorithms, "--world-sizes", "3", "--n", "4096",
                         "--steps", "6", "--warmup", warmup, "--probe-reps", "0",
                         "--backend", backend, "--quiet", "--json", str(tmp_path / "v.json")])


def test_variants_run_side_by_side_with_their_options(tmp_path, monkeypatch):
    """The compact wire as a variant of Ok-Topk runs beside the plain one on the same ranks:
    half the entry bytes, its own label, and the base name's formulas. (The kernels' torch
    references: interpreted, this took minutes; Ok-Topk's interpreted steps on the compact wire
    are compared with them in tests/test_oktopk.py.)"""
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", False)
    assert C.main(_variant_args(tmp_path, "dense", "oktopk", "oktopk:wire_format=compact")) == 0
    rep = json.loads((tmp_path / "v.json").read_text())
    by = {r["algorithm"]: r for r in rep["results"]}
    assert list(by) == ["dense", "oktopk", "oktopk:wire_format=compact"]
    plain, compact = by["oktopk"], by["oktopk:wire_format=compact"]
    assert compact["base_algorithm"] == "oktopk" and compact["options"] == {
        "wire_format": "compact"} and compact["graph"] is False
    assert plain["options"] == {} and plain["formula_bytes_high"] == compact["formula_bytes_high"]
    assert compact["out_bitwise_equal"] and compact["bytes_match_stats"]
    assert compact["bytes_mean"] < 0.75 * plain["bytes_mean"]
    assert compact["median_ratio_to_dense"] > 0


@pytest.mark.parametrize("spec,backend,warmup,expect", [
    ("oktopk:wire_fromat=compact", "local", "1", "wire_fromat"),
    ("dense:wire_format=compact", "local", "1", "dense"),
    ("oktopk:graph=1", "local", "5", "graph=1 needs --backend nccl"),
    ("oktopk:graph=1", "nccl", "3", "graph=1 needs --warmup > 3"),
    ("oktopk:graph=yes", "local", "1", "graph must be"),
    ("nosuch:graph=0", "local", "1", "unknown algorithm"),
])
def test_a_bad_variant_exits_with_one_line_before_any_rank(tmp_path, spec, backend, warmup,
                                                           expect):
    with pytest.raises(SystemExit) as e:
        C.main(_variant_args(tmp_path, spec, backend=backend, warmup=warmup))
    msg = str(e.value)
    assert expect in msg and "\n" not in msg.strip()
    assert not (tmp_path / "v.json").exists()


def test_graph_variant_times_the_graphed_step(monkeypatch):
    """graph=1 wraps the algorithm in the graphed step (a fake here: no CUDA), which then
    serves every call of the run, timed ones included."""
    from oktopk_triton.comm import LocalCluster
    calls = []

    class FakeGraphed:
        def __init__(self, alg):
            self.alg = alg

        def __call__(self, g):
            calls.append(g.numel())
            return self.alg(g)

    monkeypatch.setattr(CR, "graphed_step", FakeGraphed)
    recs = LocalCluster(2).run(CR._rank_run, "oktopk:graph=1", 2048, 0.05, 4, 0, "skip")
    assert len(calls) == 2 * (4 + 1)           # 4 timed steps + the profiled one, per rank
    assert all(len(r["time_s"]) == 4 for r in recs)
    assert recs[0]["checksum"] == recs[1]["checksum"]
