"""The fault harnesses' own logic in this process: ``bench.ft_cluster`` (waits, results, kills),
``bench.ft_soak`` (a schedule's orchestration and judgement, the summary) and
``bench.faults`` (a run's orchestration, the four runs, the table, the record). The replicas
are stand-ins that have already finished (their files written, their process "exited"), the
lighthouse a stand-in: no process is started. The real clusters are
tests/test_torchft_soak.py's and ``make faults``.

Checked: the waits return on the replica's files and fail, bounded and in one message, on a
replica that exited early or never came; a schedule kills its victim, restarts or drops it and
passes only when the survivors agree (each of ``_judge``'s reasons is hit); ``run_cluster``
kills and restarts the victim at its gates; ``faults.main`` writes its four rows and record.
"""
import json
import os
import subprocess

import pytest
import torch

from oktopk_triton.bench import faults, ft_cluster, ft_soak


class _Proc:
    """A replica process that has already exited with ``code``."""

    def __init__(self, code, timeout_first=False):
        self.pid, self.returncode, self._timeout = -1, code, timeout_first

    def poll(self):
        return self.returncode

    def wait(self, timeout=None):
        if self._timeout:
            self._timeout = False
            raise subprocess.TimeoutExpired("replica", timeout)
        return self.returncode


class _Replica(ft_cluster.Replica):
    """A replica that ran to its end at once: ready, progress, syncing and result files written
    (a ``die`` config exits by SIGKILL; a restarted one was healed as a newcomer; a ``fail``
    config rolled one sync back). The real Replica's methods read them."""

    started = {}

    def __init__(self, config, workdir=None, fork=False):
        self.workdir = workdir
        self.config = dict(config)
        key = (workdir, config["replica"])
        n = _Replica.started[key] = _Replica.started.get(key, 0) + 1
        self.config.setdefault("result", os.path.join(workdir, f"replica{config['replica']}-{n}"))
        self.log = self.config["result"] + ".log"
        res = self.config["result"]
        syncs = self.config.get("syncs", 6)
        for suffix, text in ((".ready", "1"), (".progress", str(syncs)), (".syncing", "2")):
            with open(res + suffix, "w") as f:
                f.write(text)
        with open(self.log, "w") as f:
            f.write("replica log line\n")
        hist = [{"step": i, "P": 3, "committed": True, "healed": n > 1 and i == 0,
                 "newcomer": n > 1 and i == 0, "bytes": 100, "relative_error": 1e-9,
                 "error": None, "time": 10.0 + i} for i in range(syncs)]
        if self.config.get("fail"):
            hist.insert(1, {**hist[1], "committed": False, "relative_error": None,
                            "error": "injected", "time": 10.5})
        torch.save({"w": torch.ones(3)}, res + ".weights.pt")
        out = {"config": self.config, "error": None, "history": hist, "step": syncs,
               "evals": [[0, 2.3], [syncs, 0.25]], "eval_steps": [0, 2 * syncs],
               "bytes": 100 * syncs, "heals": int(n > 1), "local_steps": 2 * syncs,
               "weights": res + ".weights.pt"}
        with open(res, "w") as f:
            json.dump(out, f)
        self.proc = _Proc(-9 if self.config.get("die") else 0)


class _Lighthouse:
    def __init__(self, min_replicas=1, **kw):
        self.min_replicas, self.address = min_replicas, "http://127.0.0.1:1"

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None


@pytest.fixture
def fake_cluster(monkeypatch):
    """The stand-in replicas and lighthouse; ``faults`` without its half-second pause before
    releasing a restarted replica (nothing races here) and without its PNG (drawn by
    tests/test_faults_demo.py): a stub file in its place."""
    import time
    import types

    def stub_plot(runs, path, *a):
        open(path, "w").close()
        return path
    monkeypatch.setattr(faults, "time", types.SimpleNamespace(monotonic=time.monotonic,
                                                              sleep=lambda s: None))
    monkeypatch.setattr(faults, "plot", stub_plot)
    _Replica.started = {}
    monkeypatch.setattr(ft_cluster, "Replica", _Replica)
    monkeypatch.setattr(ft_cluster, "Lighthouse", _Lighthouse)
    return _Replica


# -- ft_cluster ----------------------------------------------------------------------------------
def test_the_waits_return_on_the_files_and_fail_bounded(tmp_path):
    r = _Replica({"replica": 0, "syncs": 4}, str(tmp_path))
    assert r.ready() and r.progress() == 4 and r.tail() == "replica log line\n"
    ft_cluster.wait_ready(r, 1.0)
    ft_cluster.wait_for([r], 0, 4, 1.0)
    with pytest.raises(ft_cluster.ClusterError, match="replica 0 exited early:\nreplica log"):
        ft_cluster.wait_file(r, ".never", "do it", 1.0)
    with pytest.raises(ft_cluster.ClusterError, match="replica 0 exited early"):
        ft_cluster.wait_for([r], 0, 5, 1.0)
    r.proc.returncode = None                             # still running: the bound applies
    with pytest.raises(ft_cluster.ClusterError, match="did not do it within 0 s"):
        ft_cluster.wait_file(r, ".never", "do it", 0.0)
    with pytest.raises(ft_cluster.ClusterError, match="did not reach sync 5 within 0 s"):
        ft_cluster.wait_for([r], 0, 5, 0.0)
    os.remove(r.config["result"] + ".progress")
    os.remove(r.log)
    assert r.progress() == 0 and r.tail() == ""


def test_a_result_carries_the_return_code_and_a_late_replica_is_killed(tmp_path):
    r = _Replica({"replica": 1, "syncs": 2}, str(tmp_path))
    res = r.result(1.0)
    assert res["returncode"] == 0 and res["step"] == 2 and res["log"] == "replica log line\n"
    r.kill()                                             # exited already: only reaped
    late = _Replica({"replica": 2, "syncs": 2}, str(tmp_path))
    late.proc = _Proc(-9, timeout_first=True)
    with pytest.raises(ft_cluster.ClusterError,
                       match="replica 2 did not finish within 3 s; its log ends:\nreplica log"):
        late.result(3.0)


def test_the_lighthouse_command_and_a_missing_binary(monkeypatch):
    lh = ft_cluster.Lighthouse(min_replicas=2, quorum_tick_ms=7)
    assert lh.address == f"http://127.0.0.1:{lh.port}" and lh.proc is None
    assert lh._cmd[0].endswith("torchft_lighthouse")
    assert lh._cmd[1:5] == ["--min_replicas", "2", "--quorum_tick_ms", "7"]
    lh.__exit__()                                        # never started: nothing to stop
    monkeypatch.setattr(ft_cluster.os.path, "exists", lambda p: False)
    monkeypatch.setattr(ft_cluster.shutil, "which", lambda name: None)
    with pytest.raises(ft_cluster.ClusterError, match="torchft_lighthouse not found"):
        ft_cluster.lighthouse_binary()


# -- ft_soak -------------------------------------------------------------------------------------
def test_every_kind_of_schedule_passes_on_agreeing_replicas(fake_cluster, tmp_path):
    recs = [ft_soak.run_schedule(seed, str(tmp_path)) for seed in range(5)]
    assert [r["kind"] for r in recs] == list(ft_soak.KINDS)
    for r in recs:
        assert r["ok"], r
        assert r["max_relative_error"] == 1e-9 and r["committed"] == ft_soak.SYNCS
    by_kind = {r["kind"]: r for r in recs}
    assert by_kind["kill-in-sync"]["replicas"] == 2           # the victim dropped
    assert by_kind["kill-in-sync-rejoin"]["replicas"] == 3    # the victim restarted
    assert by_kind["kill-between-rejoin"]["heals"] == 1
    assert by_kind["fail-commit"]["rolled_back"] == 1
    assert by_kind["fail-commit"]["recovery_s"] == 0.5        # 10.5 (failed) -> 11.0


def test_a_victim_that_was_not_killed_fails_its_schedule(fake_cluster, monkeypatch, tmp_path):
    real = ft_soak._fault
    monkeypatch.setattr(ft_soak, "_fault", lambda s: {k: v for k, v in real(s).items()
                                                      if k != "die"})
    rec = ft_soak.run_schedule(0, str(tmp_path))
    assert not rec["ok"]
    assert rec["why"] == "ClusterError: the victim exited with 0, not by SIGKILL"


def _res(tmp_path, name, w=1.0, step=6, err=1e-9, healed=False, code=0):
    path = str(tmp_path / f"{name}.pt")
    torch.save({"w": torch.full((2,), w)}, path)
    hist = [{"committed": True, "relative_error": err, "healed": healed and i == 0,
             "newcomer": healed and i == 0, "time": float(i)} for i in range(step)]
    return {"returncode": code, "weights": path, "step": step, "history": hist,
            "error": "boom" if code else None, "log": "x" * 400}


def test_judge_names_each_way_a_schedule_fails(tmp_path):
    s = {"kind": "kill-between-rejoin"}
    good = [_res(tmp_path, "a", healed=True), _res(tmp_path, "b")]
    assert ft_soak._judge(s, good)["ok"]
    cases = [
        ([_res(tmp_path, "a", code=1), good[1]], "a replica failed: boom"),
        ([good[0], _res(tmp_path, "c", w=2.0)], "the replicas' weights differ"),
        ([_res(tmp_path, "d", step=5, healed=True), _res(tmp_path, "e", step=5)],
         "replicas ended at steps [5]"),
        ([_res(tmp_path, "f", err=1e-3, healed=True), good[1]],
         "a committed sync was not conserved (max relative error 0.001)"),
        ([_res(tmp_path, "g"), good[1]], "the restarted replica was not healed as a newcomer"),
    ]
    for results, why in cases:
        out = ft_soak._judge(s, results)
        assert not out.get("ok") and out["why"].startswith(why), (why, out)
    assert ft_soak._recovery([{"history": [{"committed": True, "time": 1.0}]}]) is None


def test_soak_main_prints_every_schedule_and_writes_the_record(fake_cluster, monkeypatch,
                                                               tmp_path, capsys):
    monkeypatch.setattr(ft_soak, "run", lambda seeds, jobs: [
        ft_soak.run_schedule(s, str(tmp_path)) for s in seeds])
    out = tmp_path / "soak.json"
    assert ft_soak.main(["--seeds", "0", "4", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ok   seed  0 kill-in-sync" in text and "ok   seed  4 fail-commit" in text
    assert "2 of 2 schedules passed; max relative error 1e-09" in text
    rec = json.loads(out.read_text())
    assert rec["summary"]["passed"] == 2 and len(rec["schedules"]) == 2
    monkeypatch.setattr(ft_soak, "run", lambda seeds, jobs: [
        {"seed": 3, "kind": "kill-between", "victim": 1, "ok": False, "why": "it hung",
         "seconds": 1.0}])
    assert ft_soak.main(["--schedules", "1", "--first", "3"]) == 1
    assert "FAIL seed  3 kill-between" in capsys.readouterr().out


# -- faults --------------------------------------------------------------------------------------
def test_run_cluster_kills_and_restarts_the_victim(fake_cluster, tmp_path):
    cfg = dict(mode="sparse", syncs=4, sync_every=2)
    res = faults.run_cluster(cfg, 3, 2, 1, 2, str(tmp_path), 60.0)
    assert len(res) == 3 and all(r["returncode"] == 0 for r in res)
    assert fake_cluster.started[(str(tmp_path), 2)] == 2      # the victim started twice
    assert res[2]["heals"] == 1 and res[0]["heals"] == 0
    assert faults._weights_equal(res + [None])
    none = faults.run_cluster(cfg, 2, None, 0, 0, str(tmp_path / ".."), 60.0)
    assert len(none) == 2


def test_run_cluster_raises_on_a_failed_replica(fake_cluster, monkeypatch, tmp_path):
    class Failing(_Replica):
        def __init__(self, config, workdir=None, fork=False):
            super().__init__(config, workdir, fork)
            self.proc = _Proc(1)
    monkeypatch.setattr(ft_cluster, "Replica", Failing)
    with pytest.raises(ft_cluster.ClusterError, match=r"replica 0 failed \(1\)"):
        faults.run_cluster(dict(syncs=2), 2, None, 0, 0, str(tmp_path), 60.0)


class _Now:
    """A process pool that runs each job at once, in this process (no initializer)."""

    def __init__(self, *a, **kw):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        import concurrent.futures as cf
        f = cf.Future()
        try:
            f.set_result(fn(*args))
        except Exception as exc:  # noqa: BLE001
            f.set_exception(exc)
        return f


def test_faults_main_runs_the_four_runs_and_writes_its_record(fake_cluster, monkeypatch,
                                                              tmp_path, capsys):
    import concurrent.futures as cf

    from oktopk_triton import cli
    monkeypatch.setattr(cf, "ProcessPoolExecutor", _Now)
    args = cli.build_parser("faults").parse_args(
        ["faults", "--out", str(tmp_path / "out"), "--steps", "64", "--sync-every", "4"])
    assert faults.main(args) == 0
    text = capsys.readouterr().out
    assert "4 replicas x digits CNN" in text and "faulted sparse vs fault-free: +0.00%" in text
    rec = json.load(open(tmp_path / "out" / "faults.json"))
    rows = {r["run"]: r for r in rec["summary"]}
    assert list(rows) == list(faults.RUNS)
    assert rows["sparse"]["heals"] == 0 and rows["sparse+fault"]["heals"] == 1
    assert rows["sparse+fault"]["rejoined_at"] == 1
    assert os.path.exists(rec["plot"]) and len(rec["runs"]) == 4


def test_faults_main_reports_a_failed_run_in_one_line(fake_cluster, monkeypatch, tmp_path,
                                                      capsys):
    import concurrent.futures as cf

    from oktopk_triton import cli
    monkeypatch.setattr(cf, "ProcessPoolExecutor", _Now)
    monkeypatch.setattr(faults, "_weights_equal", lambda res: False)
    args = cli.build_parser("faults").parse_args(
        ["faults", "--out", str(tmp_path / "out"), "--steps", "64", "--sync-every", "4"])
    assert faults.main(args) == 1
    err = capsys.readouterr().err
    assert "oktopk-bench faults: FAILED: RuntimeError: sparse+fault: the replicas that " \
           "finished differ in weights" in err
