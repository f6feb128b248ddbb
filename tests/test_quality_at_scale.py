"""tools/research/quality_at_scale.py: the GPT's local steps on P thread ranks of a LocalCluster.

Its ranks must train what ``train --model gpt`` trains on P gloo processes (the same validation
loss from the same seed); every run checks conservation and identical replicas, counts TopkA's
allgather as the closed form says, and a broken run makes the tool fail."""
import argparse
import json
import math
import os
import sys

import pytest
import torch

from distutil import run_gloo
from oktopk_triton.bench import gpt, lm_loop, train
from oktopk_triton.bench.records import HEADER_KEYS
from oktopk_triton.algorithms.schedule import schedule_of, total_bytes
from oktopk_triton.comm.base import ring_allreduce_bytes

from tools.research import quality_at_scale as qas

pytestmark = pytest.mark.research

# the torch references on CPU where the kernels allow it
OPTIONS = ["--option", "sync_every=2", "--option", "wire_format=q2", "--option", 'backend="torch"']
ARGS = ["--size", "tiny", "--steps", "6", "--density", "0.05", "--eval-sequences", "16"]


def _tool_config(P):
    return qas.make_config(qas.parse_args(["--world-size", str(P), *ARGS, *OPTIONS]))


def _train_body(comm, cfg):
    corpus = gpt.load_corpus(cfg["val_fraction"])
    return lm_loop.train_one_lm(cfg, "topka", 0, comm, torch.device("cpu"),
                                (corpus.train, corpus.val), log=False)


def test_thread_ranks_train_what_train_trains(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    cli = train.build_config(p.parse_args(["--model", "gpt", "--world-size", "2",
                                           "--batch-size", "1", "--eval-times", "1",
                                           *ARGS, *OPTIONS]), ["topka"])
    by_gloo = run_gloo(2, _train_body, cli, timeout=120)[0]
    monkeypatch.undo()   # this process imported the kernels under the interpreter: keep it on
    cfg = _tool_config(2)
    rec = qas.run_one(cfg, "topka", 0, gpt.load_corpus(), timeout=60)
    assert rec["final_val_loss"] == pytest.approx(by_gloo["final_val_loss"], rel=1e-6)
    assert rec["replicas_identical"] and rec["conservation_checked"]
    assert rec["syncs"] == 3 and rec["steps"] == 6


@pytest.mark.parametrize("P", [3, 5])
def test_records_bytes_conservation_and_replicas(P):
    cfg = _tool_config(P)
    corpus = gpt.load_corpus()
    ta = qas.run_one(cfg, "topka", 0, corpus, timeout=60)
    ok = qas.run_one(cfg, "oktopk", 0, corpus, timeout=60)
    for r in (ta, ok):
        assert r["replicas_identical"] and r["conservation_checked"], r
        assert r["conservation_relative_error"] < 1e-5 and math.isfinite(r["final_val_loss"])
        assert qas._check(r) == ""
    # TopkA: an allgather of k entries (q2 wire) from every other rank plus the 4-byte flag, the
    # same bytes sent as received; Ok-Topk receives less at the same k
    assert ta["received_per_sync"] == ta["sent_per_sync"]
    assert ta["received_per_sync"] > (P - 1) * ta["k"] + ring_allreduce_bytes(4, P)
    assert ok["received_per_sync"] < ta["received_per_sync"]
    # entries a sync: TopkA's output is the union of the ranks' selections, so at least as many
    # as a rank's own; Ok-Topk's output is at most its k largest sums
    n = gpt.GPTConfig(**cfg["gpt"]).num_parameters()
    for r in (ta, ok):
        for key in ("local_selected", "global_selected"):
            c = r["entries_per_sync"][key]
            assert 0 < c["mean_fraction"] <= 1 and 0 < c["last_quarter_fraction"] <= 1, (key, c)
    e = ta["entries_per_sync"]
    assert e["global_selected"]["mean_fraction"] >= e["local_selected"]["mean_fraction"]
    assert e["global_selected"]["mean_fraction"] > 1.5 * ta["k"] / n
    assert ok["entries_per_sync"]["global_selected"]["mean_fraction"] <= ok["k"] / n


def test_complete_sums_in_local_steps_adds_its_schedule_and_keeps_the_contract():
    """Ok-Topk's values-only second exchange through the tool's local steps: conservation over
    the run and identical replicas still hold, and a sync costs what the schedule adds for it
    (an alltoall and an allgather of values-only rows), no more."""
    P = 3
    corpus = gpt.load_corpus()
    plain = qas.run_one(_tool_config(P), "oktopk", 0, corpus, timeout=60)
    cfg = qas.make_config(qas.parse_args(["--world-size", str(P), *ARGS, *OPTIONS,
                                          "--option", "complete_sums=true"]))
    done = qas.run_one(cfg, "oktopk", 0, corpus, timeout=60)
    assert qas._check(done) == "" and done["k"] == plain["k"]
    n = gpt.GPTConfig(**cfg["gpt"]).num_parameters()
    extra = [total_bytes(schedule_of("oktopk", n, done["k"], P, wire_format="q2", rank=0,
                                     complete_sums=c)) for c in (False, True)]
    assert extra[1] > extra[0]
    assert done["sent_per_sync"] - plain["sent_per_sync"] == pytest.approx(extra[1] - extra[0])
    assert done["final_val_loss"] != plain["final_val_loss"]


def test_a_broken_run_fails_the_tool(monkeypatch, tmp_path, capsys):
    real = qas.run_one

    def diverged(*a, **k):
        return {**real(*a, **k), "replicas_identical": False}
    monkeypatch.setattr(qas, "run_one", diverged)
    out = tmp_path / "q.json"
    rc = qas.main(["--world-size", "2", *ARGS, *OPTIONS, "--algorithms", "topka",
                   "--progress", "3", "--json", str(out)])
    printed = capsys.readouterr()
    assert rc == 1 and "replicas diverged" in printed.err
    assert [line.split(":")[0].strip() for line in printed.out.splitlines() if "/6:" in line] \
        == ["step 3/6", "step 6/6"]
    rec = json.loads(out.read_text())
    assert set(HEADER_KEYS) <= set(rec) and rec["benchmark"] == "quality-at-scale"
    assert [r["algorithm"] for r in rec["runs"]] == ["topka"]


def test_a_bad_option_is_one_line():
    with pytest.raises(SystemExit) as e:
        qas.main(["--option", "sync_every"])
    assert e.value.code == 2


_RETAINED = r"""
import sys, threading, torch
sys.path.insert(0, sys.argv[1])
from tools.research import quality_at_scale as qas
assert qas.lean_malloc()
def resident():
    return int(open('/proc/self/statm').read().split()[1]) * 4096
base = resident()
def work():
    big = torch.ones(4_000_000); del big        # raises glibc's dynamic mmap threshold
    for _ in range(5):
        xs = [torch.ones(50_000 + 1000 * j) for j in range(100)]    # ~20 MB of 200-600 kB
        del xs
threads = [threading.Thread(target=work) for _ in range(8)]
[t.start() for t in threads]; [t.join() for t in threads]
print((resident() - base) / 1e6)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or not os.path.exists("/proc/self/statm"),
                    reason="glibc's mallopt and /proc")
def test_lean_malloc_hands_freed_temporaries_back():
    """8 threads free ~100 MB of mid-sized temporaries; with glibc's defaults ~135 MB of it
    stayed resident on the CPU machine, with lean_malloc a few MB."""
    import subprocess
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", _RETAINED, root], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert float(r.stdout.strip()) < 32.0


def test_lean_malloc_only_where_memory_needs_it():
    """auto: glibc's defaults for the 1m GPT (lean costs time there), lean from the 4m preset up;
    --malloc forces either way."""
    assert not qas.wants_lean(qas.parse_args(["--size", "1m"]))
    assert qas.wants_lean(qas.parse_args(["--size", "4m"]))
    assert qas.wants_lean(qas.parse_args(["--size", "1m", "--malloc", "lean"]))
    assert not qas.wants_lean(qas.parse_args(["--size", "4m", "--malloc", "default"]))
    with pytest.raises(SystemExit):
        qas.parse_args(["--malloc", "small"])
