"""The baselines of ``oktopk-bench train --model gpt``: torch's PowerSGD hook and bf16
compression in the same loop, their bytes counted as the communicators count an allreduce.

On 2 gloo ranks with the ``tiny`` preset: the loss falls, the replicas stay identical, bf16
sends half of dense's bytes, and PowerSGD sends dense's bytes for its warm-up steps and then
exactly what :func:`powersgd_bytes` predicts for the rank it was given (so the rank matched to
Ok-Topk's bytes is matched to what torch's hook really sends)."""
import argparse
import math

import pytest
import torch

from oktopk_triton.bench import baselines as B
from oktopk_triton.bench import train
from distutil import run_pooled_torch


def _config(*argv):
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    a = p.parse_args(["--model", "gpt", *argv])
    return train.build_config(a, ["dense", "powersgd", "bf16"])


def _body(comm, cfg):
    from oktopk_triton.bench import gpt as g
    from oktopk_triton.bench import lm_loop as t
    corpus = g.load_corpus(cfg["val_fraction"], max_train_bytes=1 << 20)
    data = (corpus.train, corpus.val)
    out = {alg: t.train_one_lm(cfg, alg, 0, comm, torch.device("cpu"), data, log=False)
           for alg in ("dense", "powersgd", "bf16")}
    model = g.GPT(g.GPTConfig(**cfg["gpt"]))
    out["shapes"] = [tuple(p.shape) for p in model.parameters()]
    return out


@pytest.mark.slow
def test_powersgd_and_bf16_train_and_send_what_they_should():
    cfg = _config("--size", "tiny", "--steps", "12", "--eval-times", "2", "--lr", "1e-2",
                  "--powersgd-start", "4")
    res = run_pooled_torch(2, _body, cfg, timeout=180)[0]
    dense = res["dense"]["bytes_curve"]
    assert len(set(dense)) == 1 and dense[0] > 0
    for alg in ("dense", "powersgd", "bf16"):
        r = res[alg]
        assert r["replicas_identical"], alg
        v = [loss for _, loss in r["val_curve"]]
        assert all(math.isfinite(x) for x in v) and v[-1] < v[0] - 0.2, (alg, v)
    n = sum(math.prod(s) for s in res["shapes"])
    assert dense[0] == 4 * n + 4          # dense: fp32 ring volume (P = 2) + the 4-byte flag
    assert res["bf16"]["bytes_curve"] == [2 * n] * 12
    ps = res["powersgd"]
    rank, start = ps["powersgd"]["rank"], ps["powersgd"]["start_iter"]
    assert start == 4 and rank >= 1
    steady = B.powersgd_bytes([torch.Size(s) for s in res["shapes"]], rank, 2)
    assert ps["bytes_curve"][:start] == [4 * n] * start
    assert ps["bytes_curve"][start:] == [steady] * (12 - start)
    assert steady < dense[0] / 4


def test_powersgd_rank_matches_the_target_bytes():
    shapes = [torch.Size(s) for s in [(256, 128), (128, 128), (128,), (512, 128), (128, 512)]]
    P = 4
    for target in (20_000, 60_000, 200_000):
        r = B.powersgd_rank_for(shapes, target, P)
        gap = abs(B.powersgd_bytes(shapes, r, P) - target)
        for other in (r - 1, r + 1):
            if other >= 1:
                assert gap <= abs(B.powersgd_bytes(shapes, other, P) - target)
    # a rank too large to pay (rows + cols)·r·2 >= rows·cols leaves the matrix uncompressed
    assert B.powersgd_bytes([torch.Size((8, 8))], 4, 2) == 8 * 8 * 4
    assert B.powersgd_bytes([torch.Size((8, 8))], 1, 2) == (8 + 8) * 4


def test_baselines_refuse_a_model_other_than_gpt(capsys):
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    args = p.parse_args(["--model", "cnn", "--algorithms", "powersgd", "--epochs", "1"])
    assert train.main(args) == 2
    assert "--model gpt only" in capsys.readouterr().err


def test_baselines_are_named_not_in_all():
    from oktopk_triton.bench._common import resolve_algorithms
    run, _ = resolve_algorithms(["all"], "train", extra=B.BASELINES)
    assert not set(run) & set(B.BASELINES)
    run, _ = resolve_algorithms(["dense", "PowerSGD", "bf16", "powersgd"], "train",
                                extra=B.BASELINES)
    assert run == ["dense", "powersgd", "bf16"]
    run, _ = resolve_algorithms(["powersgd", "all"], "train", extra=B.BASELINES)
    assert run[0] == "dense" and run[-1] == "powersgd" and "oktopk" in run
    with pytest.raises(ValueError, match="baseline must be one of"):
        B.HookBaseline(torch.nn.Linear(2, 2), "fp8")


def test_powersgd_hook_skips_cuda_sync_of_cpu_buckets(monkeypatch):
    """torch's hook synchronises ``bucket.device`` whenever CUDA is available, which raised for
    the CPU buckets of a gloo run on a GPU machine; a CUDA device is still synchronised."""
    from oktopk_triton.bench.baselines import powersgd_module
    psgd = powersgd_module()
    calls = []

    def sync(device=None):
        if torch.device(device).type != "cuda":
            raise ValueError(f"Expected a cuda device, but got: {device}")
        calls.append(device)
    monkeypatch.setattr(torch.cuda, "synchronize", sync)
    psgd.torch.cuda.synchronize(torch.device("cpu"))
    psgd.torch.cuda.synchronize(torch.device("cuda", 0))
    assert calls == [torch.device("cuda", 0)]
    assert psgd.torch.randn is torch.randn
    assert psgd.torch.cuda.is_available is torch.cuda.is_available
    assert powersgd_module() is psgd
