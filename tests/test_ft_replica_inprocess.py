"""One torchft replica of the fault tests (oktopk_triton/bench/ft_replica.py) run in this
process: its replicas are threads with stand-in Managers (tests/ftfakes.py), its reference
mode a gloo group of one rank. The processes, lighthouse and kills are
tests/test_torchft_integration.py's; here:

* ``run_torchft`` (sparse) on 2 replicas ends at ``syncs`` committed syncs with the same weights
  on both, writes its ready/progress files and result fields, and evaluates at every sync;
* an injected collective failure rolls that sync back on both replicas, and ``retry`` syncs
  again at once (the replicas still agree);
* the reference mode (plain torch.distributed, one rank) through ``main``: the result file, the
  saved weights; a failing run is reported in one line with exit code 1;
* the task builders (the MLP and the digits CNN), the dense record, the hold gates.
"""
import json
import threading

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchft")

from ftfakes import FakeManager  # noqa: E402

from oktopk_triton.bench import ft_replica  # noqa: E402
from oktopk_triton.comm import LocalCluster  # noqa: E402
from oktopk_triton.comm.base import ring_allreduce_bytes  # noqa: E402


@pytest.fixture(autouse=True)
def _torch_kernels(monkeypatch):
    from oktopk_triton.kernels import _dispatch
    monkeypatch.setattr(_dispatch, "INTERPRET", False)


def _cfg(tmp_path, replica, **kw):
    return {**ft_replica.DEFAULTS, "replica": replica, "syncs": 3, "sync_every": 2,
            "width": 8, "batch": 8, "result": str(tmp_path / f"r{replica}.json"), **kw}


def _run_replicas(tmp_path, monkeypatch, P=2, **kw):
    """``run_torchft`` on P threads, each with a stand-in Manager; the tasks are built one at a
    time (the global RNG seeds them, as each process's own would)."""
    shared, made = {}, {}
    lock = threading.Lock()
    real_task = ft_replica.make_task

    def make_task(cfg):
        with lock:
            return real_task(cfg)

    def make_manager(cfg, state):
        m = FakeManager(made["lc"][cfg["replica"]], shared)
        # what torchft's Manager does with the user's state functions
        m.register_state_dict_fn("user", lambda sd: ft_replica._load_user(state, sd),
                                 lambda: {"model": state["model"].state_dict(),
                                          "optim": state["optim"].state_dict()})
        return m, None
    monkeypatch.setattr(ft_replica, "make_task", make_task)
    monkeypatch.setattr(ft_replica, "make_manager", make_manager)

    def body(lc):
        made.setdefault("lc", {})[lc.rank] = lc
        out = {}
        ft_replica.run_torchft(_cfg(tmp_path, lc.rank, **kw), out)
        return out
    return LocalCluster(P).run(body)


def _weights(out):
    return torch.load(out["weights"], weights_only=True)


def test_sparse_replicas_commit_every_sync_and_agree(tmp_path, monkeypatch):
    res = _run_replicas(tmp_path, monkeypatch)
    w0 = _weights(res[0])
    for r, out in enumerate(res):
        assert out["step"] == 3 and out["local_steps"] == 6 and out["heals"] == 0
        assert [h["committed"] for h in out["history"]] == [True] * 3
        assert all(h["relative_error"] <= 1e-6 for h in out["history"])
        assert [e[0] for e in out["evals"]] == [0, 1, 2, 3] and out["eval_steps"][-1] == 6
        assert len(out["losses"]) == 6 and out["bytes"] > 0
        w = _weights(out)
        assert all(torch.equal(w[k], w0[k]) for k in w0)
        assert open(str(tmp_path / f"r{r}.json.ready")).read() == "1"
        assert open(str(tmp_path / f"r{r}.json.progress")).read() == "3"
        assert open(str(tmp_path / f"r{r}.json.syncing")).read() == "6"


def test_an_injected_failure_rolls_back_and_retry_syncs_again_at_once(tmp_path, monkeypatch):
    res = _run_replicas(tmp_path, monkeypatch, fail={"sync": 2, "collective": 1}, retry=True)
    for out in res:
        hist = out["history"]
        assert [h["committed"] for h in hist] == [True, False, True, True]
        assert "injected: this collective failed" in hist[1]["error"]
        assert out["local_steps"] == 6        # the retry synced without another inner step
    w0, w1 = _weights(res[0]), _weights(res[1])
    assert all(torch.equal(w0[k], w1[k]) for k in w0)


def test_reference_mode_through_main_writes_its_result(tmp_path, monkeypatch):
    from oktopk_triton.bench.ranks import free_port
    assert not dist.is_initialized()
    cfg = dict(mode="reference", replica=0, world=1, master_port=free_port(), syncs=2,
               width=8, batch=8, result=str(tmp_path / "ref.json"))
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)   # leave the suite's as is
    try:
        assert ft_replica.main([json.dumps(cfg)]) == 0
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    out = json.load(open(cfg["result"]))
    assert out["error"] is None and out["config"]["mode"] == "reference"
    w = torch.load(out["weights"], weights_only=True)
    assert set(w) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert w["0.weight"].shape == (8, 16)


def test_main_reports_a_failure_in_one_line(tmp_path, monkeypatch, capsys):
    def broken(cfg, out):
        raise RuntimeError("no lighthouse\n at all")
    monkeypatch.setattr(ft_replica, "run_torchft", broken)
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    path = str(tmp_path / "bad.json")
    assert ft_replica.main([json.dumps({"replica": 4, "result": path})]) == 1
    out = json.load(open(path))
    assert out["error"] == "RuntimeError: no lighthouse at all"
    assert "replica 4: error: RuntimeError: no lighthouse at all" in capsys.readouterr().err


def test_the_tasks_are_deterministic_and_shard_by_replica():
    base = {**ft_replica.DEFAULTS, "replica": 1, "width": 8}
    m1, batch1, ev1 = ft_replica.make_task(base)
    m2, batch2, ev2 = ft_replica.make_task(base)
    assert all(torch.equal(a, b) for a, b in zip(m1.parameters(), m2.parameters()))
    x, y = batch1(3)
    assert x.shape == (16, 16) and torch.equal(x, batch2(3)[0]) and ev1() == ev2()
    other = ft_replica.make_task({**base, "replica": 2})[1](3)[0]
    assert not torch.equal(x, other)
    pytest.importorskip("sklearn")
    cnn, batch, ev = ft_replica.make_task({**base, "model": "digits", "batch": 4})
    xb, yb = batch(0)
    assert xb.shape == (4, 1, 8, 8) and cnn(xb).shape == (4, 10) and ev() > 0
    assert isinstance(ft_replica.inner_optimizer({"inner": "adam", "lr": 0.1}, m1),
                      torch.optim.AdamW)
    assert isinstance(ft_replica.inner_optimizer({"inner": "sgd", "lr": 0.1}, m1),
                      torch.optim.SGD)
    alg = ft_replica.algorithm({"algorithm": "oktopk", "options": {"wire_format": "q2"}})
    assert alg.name == "oktopk"


class _M:
    def __init__(self, P, step):
        self.P, self.step = P, step

    def num_participants(self):
        return self.P

    def current_step(self):
        return self.step


def test_dense_records_count_a_ring_allreduce_and_mark_commits():
    hist = []

    def sent(P):                      # a ring allreduce of 300 bytes over P replicas
        return ring_allreduce_bytes(300, P) if P > 1 else 0
    ft_replica._dense_record(hist, _M(3, 1), {"heals": 0}, sent)
    ft_replica._dense_record(hist, _M(3, 1), {"heals": 1}, sent)    # no progress: not committed
    ft_replica._dense_record(hist, _M(1, 2), {"heals": 1}, sent)
    assert [h["committed"] for h in hist] == [True, False, True]
    assert [h["healed"] for h in hist] == [False, True, False]
    assert [h["bytes"] for h in hist] == [400, 400, 0]


def test_hold_waits_for_its_file_only_at_its_sync(tmp_path):
    gate = str(tmp_path / "gate")
    cfg = {"hold": [{"at": 2, "file": gate}]}
    ft_replica._hold(cfg, 1)                  # another sync: no wait
    open(gate, "w").close()
    ft_replica._hold(cfg, 2)                  # the file is there: no wait


def test_the_digits_models_and_data():
    pytest.importorskip("sklearn")
    from oktopk_triton.bench import digits
    n = {k: sum(p.numel() for p in digits.make_model(k).parameters()) for k in ("cnn", "mlp")}
    # conv 1->32: 320, conv 32->64: 18,496, fc 1024->64: 65,600, fc 64->10: 650 (make_model's
    # docstring says 85,450 for the CNN)
    assert n == {"cnn": 85_066, "mlp": 85_002}
    with pytest.raises(ValueError, match="unknown model 'rnn'"):
        digits.make_model("rnn")
    Xtr, ytr, Xte, yte = digits.load_data(train_subset=100)
    assert Xtr.shape == (100, 1, 8, 8) and len(yte) == 449 and float(Xtr.max()) <= 1.0
    torch.manual_seed(0)
    m = digits.make_model("mlp", width=2)
    acc = digits.evaluate(m, Xte, yte, batch=100)
    assert 0.0 <= acc <= 0.5 and m.training               # untrained: about chance
