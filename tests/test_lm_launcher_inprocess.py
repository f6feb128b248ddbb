"""The LM training loop (oktopk_triton/bench/lm_loop.py) and the comparison's launcher
(oktopk_triton/bench/launcher.py) in this process. The loop's multi-rank runs are
tests/test_train_gpt.py's (pooled ranks); here one gloo rank runs the ``tiny`` GPT a few steps
in every way a run reduces (gradients, AdamW updates, frozen Adam, a DDP compression hook) and
each record is checked: its curves, its per-layer counts, its conservation audit. The launcher's
relaunch logic runs against a stand-in for torchrun that writes what the ranks would.
"""
import argparse
import json
import math

import pytest
import torch

from oktopk_triton.bench import launcher, lm_loop, train
from oktopk_triton.comm import TorchCommunicator




def _config(*argv):
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    return train.build_config(p.parse_args(["--model", "gpt", *argv]), ["dense", "oktopk"])


_CORPUS = {}


def _data():
    if not _CORPUS:
        from oktopk_triton.bench import gpt
        c = gpt.load_corpus(0.1, max_train_bytes=1 << 16)
        _CORPUS["d"] = (c.train, c.val)
    return _CORPUS["d"]


@pytest.mark.parametrize("alg,reduce,mode", [("dense", "auto", "gradients"),
                                             ("oktopk", "auto", "updates"),
                                             ("oktopk", "adam", "adam"),
                                             ("powersgd", "auto", "gradients")])
def test_one_rank_trains_the_tiny_lm_in_every_reduce_mode(gloo1, alg, reduce, mode):
    # frozen Adam freezes its variance after a warmup of round(0.2 * steps) = 1 step here:
    # at lr 1e-2 that diverges within 4 steps (see the report), so it runs at 1e-3
    lr = "1e-3" if mode == "adam" else "1e-2"
    cfg = _config("--size", "tiny", "--steps", "4", "--eval-times", "2", "--density", "0.1",
                  "--lr", lr, "--reduce", reduce, "--option", "backend=\"torch\"")
    cfg["eval_sequences"] = 8
    rec = lm_loop.train_one_lm(cfg, alg, 0, TorchCommunicator(), torch.device("cpu"), _data(),
                               log=True)
    assert rec["reduce"] == mode and rec["world_size"] == 1 and rec["replicas_identical"]
    assert [s for s, _ in rec["val_curve"]] == [0, 2, 4]
    assert all(math.isfinite(v) for _, v in rec["val_curve"])
    assert rec["final_val_bpb"] == pytest.approx(rec["final_val_loss"] / math.log(2))
    assert len(rec["applied_curve"]) == 4 and len(rec["bytes_curve"]) == 4
    assert sum(L["numel"] for L in rec["layers"].values()) == rec["numel"]
    assert rec["optimizer_in_reduce"] == (mode == "adam")
    if alg == "powersgd":
        assert rec["conservation"]["checked"] is False and "powersgd" in rec
        assert rec["backend"] == "TorchCommunicator"
    elif mode != "adam":
        assert rec["conservation"]["relative_error"] <= 1e-6
    if alg == "oktopk" and mode == "updates":
        assert max(rec["applied_curve"][1:]) <= rec["k"]


def test_reduce_resolution_and_the_learning_rate_schedule():
    assert lm_loop.resolve_reduce({"optimizer": "adamw"}, "oktopk") == "updates"
    assert lm_loop.resolve_reduce({"optimizer": "adamw"}, "dense") == "gradients"
    assert lm_loop.resolve_reduce({"optimizer": "sgd"}, "oktopk") == "gradients"
    assert lm_loop.resolve_reduce({"reduce": "adam"}, "dense") == "adam"
    assert lm_loop.resolve_reduce({"options": {"sync_every": 4}}, "dense") == "updates"
    assert lm_loop._oktopk_bytes(1000, 0.1, 1) >= 0


# -- the launcher --------------------------------------------------------------------------------
def _fake_torchrun(plan):
    """A stand-in for ``run_group``: each launch "runs" its jobs in order, appending a record per
    finished run; ``plan[(seed, alg)]`` makes that run fail (an error line, rc 1) or hang."""
    launches = []

    def run_group(cmd, env=None, timeout=None):
        cfg_path, out_path = cmd[-2], cmd[-1]
        cfg = json.load(open(cfg_path))
        launches.append([tuple(j) for j in cfg["jobs"]])
        assert "TRITON_INTERPRET" not in env and env["OMP_NUM_THREADS"] == "1"
        with open(out_path, "a") as f:
            for seed, alg in cfg["jobs"]:
                what = plan.get((seed, alg))
                if what == "error":
                    f.write(json.dumps({"seed": seed, "algorithm": alg,
                                        "error": "ValueError: bad"}) + "\n")
                    return 1
                if what == "hang":
                    import subprocess
                    raise subprocess.TimeoutExpired(cmd, timeout)
                if what == "die":
                    return -9
                f.write(json.dumps({"seed": seed, "algorithm": alg, "acc": 1.0}) + "\n\n")
        return 0
    return run_group, launches


def test_launch_relaunches_after_each_failure_with_the_runs_left(monkeypatch, capsys):
    run_group, launches = _fake_torchrun({(0, "b"): "error", (1, "a"): "hang",
                                          (1, "c"): "die"})
    monkeypatch.setattr(launcher, "run_group", run_group)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    runs, failures = launcher.launch({"seeds": [0, 1], "algorithms": ["a", "b", "c"],
                                      "world_size": 2}, timeout=5)
    assert [(r["seed"], r["algorithm"]) for r in runs] == [(0, "a"), (0, "c"), (1, "b")]
    assert failures == [
        {"seed": 0, "algorithm": "b", "error": "ValueError: bad"},
        {"seed": 1, "algorithm": "a", "error": "launch ended with rc=timeout (after --timeout "
                                               "5 s: raise it for a longer run)"},
        {"seed": 1, "algorithm": "c", "error": "launch ended with rc=-9"}]
    assert launches[1:] == [[(0, "c"), (1, "a"), (1, "b"), (1, "c")], [(1, "b"), (1, "c")]]
    assert "!! b (seed 0) failed: ValueError: bad; relaunching" in capsys.readouterr().out


def test_uses_cuda_only_when_asked_or_every_rank_has_a_gpu(tmp_path):
    assert launcher.uses_cuda({"world_size": 2, "device": "cuda"})
    assert launcher.uses_cuda({"world_size": 2, "device": "cpu"}) is False
    assert launcher.uses_cuda({"world_size": 1}) == torch.cuda.is_available()
    assert launcher._read_jsonl(str(tmp_path / "none.jsonl")) == []
