"""``oktopk-bench train --model gpt``: the byte-level LM on the stdlib's .py files.

The end-to-end test runs the training function itself on 2 gloo ranks (``run_gloo``: no
torchrun start-up) with the ``tiny`` preset: the validation loss must fall and the replicas must
stay bitwise identical, dense and Ok-Topk. The rest checks the pieces on one process: the corpus
split, the model's shape rules, the presets' sizes and their construction (the GPU presets are
built on the meta device: their shapes, not their memory), and the configuration, table and plot.
"""
import argparse
import math
import os

import pytest
import torch

from oktopk_triton.bench import gpt, lm_loop, report, train
from distutil import run_pooled_torch


def _config(*argv):
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    a = p.parse_args(["--model", "gpt", *argv])
    return train.build_config(a, ["dense", "oktopk"])


def _lm_body(comm, cfg):
    import torch.distributed as dist
    from oktopk_triton.bench import gpt as g
    from oktopk_triton.bench import lm_loop as t
    corpus = g.load_corpus(cfg["val_fraction"], max_train_bytes=1 << 20)
    data = (corpus.train, corpus.val)
    out = {}
    for alg in ("dense", "oktopk"):
        out[alg] = t.train_one_lm(cfg, alg, 0, comm, torch.device("cpu"), data, log=False)
    out["world"] = dist.get_world_size()
    return out


def test_tiny_lm_learns_on_two_ranks_with_identical_replicas():
    # the ranks run the CPU kernels as `oktopk-bench train` does: the torch references, not the
    # Triton interpreter that conftest turns on (~100x slower); most of this test's ~10 s is the
    # two interpreters importing torch and torch._dynamo (which any torch optimizer imports)
    cfg = _config("--size", "tiny", "--steps", "16", "--eval-times", "2", "--density", "0.05",
                  "--lr", "1e-2", "--option", "backend=\"torch\"")
    assert cfg["options"] == {"backend": "torch"} and cfg["optimizer"] == "adamw"
    assert cfg["momentum_correction"] is False
    res = run_pooled_torch(2, _lm_body, cfg, timeout=120)
    for rank_res in res:
        assert rank_res["world"] == 2
        for alg in ("dense", "oktopk"):
            r = rank_res[alg]
            assert r["replicas_identical"], alg
            v = [loss for _, loss in r["val_curve"]]
            assert [s for s, _ in r["val_curve"]] == [0, 8, 16]
            assert all(math.isfinite(x) for x in v)
            # falls clearly: from about ln 256 = 5.5 nats/byte at the start
            assert v[-1] < v[0] - 0.3, (alg, v)
            assert r["final_val_bpb"] == pytest.approx(v[-1] / math.log(2))
            assert len(r["bytes_curve"]) == r["steps"] == 16
            assert len(r["applied_curve"]) == 16
            assert sum(L["numel"] for L in r["layers"].values()) == r["numel"]
            assert all(L["moved_sq"] >= 0 for L in r["layers"].values())
            assert sum(L["moved_sq"] for L in r["layers"].values()) > 0
    # rank 0 and rank 1 report the same evaluations (one model)
    assert res[0]["oktopk"]["val_curve"] == res[1]["oktopk"]["val_curve"]
    dense, ok = res[0]["dense"], res[0]["oktopk"]
    assert dense["numel"] == ok["numel"] and ok["k"] == round(0.05 * ok["numel"])
    # dense applies every entry; Ok-Topk at most k per step (the global selection), and sends less
    assert max(dense["applied_curve"]) <= dense["numel"]
    assert min(dense["applied_curve"]) > 0.9 * dense["numel"]
    assert max(ok["applied_curve"][1:]) <= ok["k"]
    assert ok["bytes_per_step"] < 0.5 * dense["bytes_per_step"]
    # --reduce auto: the sparse run reduced AdamW's updates, dense stayed plain data parallel
    assert ok["reduce"] == "updates" and dense["reduce"] == "gradients"


def _local_steps_body(comm, cfg):
    from oktopk_triton.bench import gpt as g
    from oktopk_triton.bench import lm_loop as t
    corpus = g.load_corpus(cfg["val_fraction"], max_train_bytes=1 << 20)
    return {alg: t.train_one_lm(cfg, alg, 0, comm, torch.device("cpu"),
                                (corpus.train, corpus.val), log=False)
            for alg in ("dense", "oktopk")}


def test_tiny_lm_with_local_steps():
    """--option sync_every=4: dense and Ok-Topk reduce their pseudo-gradients every 4th step
    (--reduce auto picks updates), bytes only on those steps, the per-layer counts only there,
    identical replicas at the end (12 steps end on a sync)."""
    cfg = _config("--size", "tiny", "--steps", "12", "--eval-times", "1", "--density", "0.2",
                  "--lr", "1e-2", "--option", "backend=\"torch\"", "--option", "sync_every=4",
                  "--option", "outer_lr=0.8")
    res = run_pooled_torch(2, _local_steps_body, cfg, timeout=120)
    for alg in ("dense", "oktopk"):
        r = res[0][alg]
        assert r["replicas_identical"] and r["reduce"] == "updates", alg
        assert r["local_steps"] == dict(sync_every=4, outer_lr=0.8, outer_momentum=0.0,
                                        residual_decay=1.0)
        syncs = [(i + 1) % 4 == 0 for i in range(12)]
        assert [b > 0 for b in r["bytes_curve"]] == syncs, r["bytes_curve"]
        assert [a > 0 for a in r["applied_curve"]] == syncs
        assert r["bytes_per_step"] == sum(r["bytes_curve"]) / 12
        assert r["stats_curve"]["synced"] == [int(x) for x in syncs]
        # the times: per step, the first two intervals left out of the averages, the first sync
        # apart, the optimizer (inside reduce_updates) timed apart from the reduction
        assert r["synced_curve"] == [int(x) for x in syncs]
        assert len(r["step_ms_curve"]) == len(r["optimizer_ms_curve"]) == 12
        t = r["timing"]
        assert t["warmup_steps"] == 8 and t["timed_steps"] == 4
        assert t["sync_calls"]["count"] == 1 and t["local_calls"]["count"] == 3
        assert t["first_sync"]["step"] == 3
        assert all(o > 0 for o in r["optimizer_ms_curve"]) and r["optimizer_ms"] > 0
        assert r["optimizer_fused"] is False and r["optimizer_in_reduce"] is False
        for i in range(12):
            parts = (r["compute_ms_curve"][i] + r["reduce_ms_curve"][i]
                     + r["optimizer_ms_curve"][i])
            assert parts == pytest.approx(r["step_ms_curve"][i], abs=1e-3)
        assert all(L["starved_steps"] <= 3 for L in r["layers"].values())
        assert r["final_val_loss"] < r["val_curve"][0][1]


def test_reduce_mode_resolution():
    cfg = _config()
    assert cfg["reduce"] == "auto"
    assert lm_loop.resolve_reduce(cfg, "oktopk") == "updates"
    assert lm_loop.resolve_reduce(cfg, "dense") == "gradients"
    assert lm_loop.resolve_reduce(dict(cfg, optimizer="sgd"), "oktopk") == "gradients"
    g = _config("--reduce", "gradients")
    assert lm_loop.resolve_reduce(g, "oktopk") == "gradients"
    u = _config("--reduce", "updates")
    assert lm_loop.resolve_reduce(u, "dense") == "updates"
    ls = _config("--option", "sync_every=2")                    # local steps: updates only
    assert lm_loop.resolve_reduce(ls, "dense") == "updates"
    assert lm_loop.resolve_reduce(_config("--option", "sync_every=1"), "dense") == "gradients"


def test_corpus_is_the_stdlib_split_by_file():
    files = gpt.stdlib_files()
    assert files == sorted(files) and len(files) > 100
    assert all(f.endswith(".py") for f in files)
    assert not any(part in gpt.SKIP_DIRS for f in files for part in f.split(os.sep)[:-1])
    c = gpt.load_corpus(0.1)
    c2 = gpt.load_corpus(0.1)
    assert c.info == c2.info and torch.equal(c.val, c2.val)        # fixed split
    assert c.info["val_files"] == round(0.1 * len(files))
    assert c.info["train_bytes"] + c.info["val_bytes"] == c.info["bytes"]
    assert c.info["val_bytes"] > 10_000
    other = gpt.load_corpus(0.1, split_seed=1)
    assert not torch.equal(other.val[:1000], c.val[:1000])
    # unigram entropy of Python source: between 2 and 8 bits per byte
    assert 2 * math.log(2) < c.unigram_entropy() < 8 * math.log(2)


def test_model_shapes_tying_and_presets():
    torch.manual_seed(0)
    cfg = gpt.GPTConfig(d_model=16, n_layer=2, n_head=2, context=8)
    m = gpt.GPT(cfg)
    assert m.head.weight is m.tok.weight
    names = [n for n, _ in m.named_parameters()]
    assert "head.weight" not in names and "tok.weight" in names and "pos.weight" in names
    idx = torch.randint(0, 256, (3, 8))
    assert m(idx).shape == (3, 8, 256)
    # causal: the first position's logits do not depend on later bytes
    idx2 = idx.clone()
    idx2[:, 1:] = (idx2[:, 1:] + 1) % 256
    assert torch.allclose(m(idx)[:, 0], m(idx2)[:, 0])
    assert not torch.allclose(m(idx)[:, -1], m(idx2)[:, -1])
    loss = m.loss(torch.randint(0, 256, (2, 9)))
    assert abs(float(loss.detach()) - math.log(256)) < 0.5   # near uniform at init
    loss.backward()
    assert m.tok.weight.grad is not None
    with pytest.raises(ValueError):
        m(torch.zeros(1, 9, dtype=torch.long))     # longer than the learned positions
    with pytest.raises(ValueError):
        gpt.GPT(gpt.GPTConfig(d_model=10, n_layer=1, n_head=3, context=4))
    # the presets' sizes: the formula is checked against built models (tiny, 1m), then trusted
    # for the GPU presets (building 100M parameters on CPU costs seconds)
    assert cfg.num_parameters() == gpt.num_parameters(m)
    for name in ("tiny", "1m", "4m", "480k"):
        built = gpt.num_parameters(gpt.GPT(gpt.SIZES[name][0]))
        assert gpt.SIZES[name][0].num_parameters() == built
    expect = {"480k": (0.4e6, 0.55e6), "1m": (0.8e6, 1.3e6), "4m": (3.5e6, 4.5e6),
              "25m": (20e6, 30e6), "100m": (85e6, 115e6)}
    for name, (lo, hi) in expect.items():
        assert lo <= gpt.SIZES[name][0].num_parameters() <= hi, name
    # 4m is 1m's recipe at about 4x the parameters (a campaign's size trend): same tokens and lr
    assert gpt.SIZES["4m"][1] == gpt.SIZES["1m"][1]
    assert gpt.SIZES["4m"][0].context == gpt.SIZES["1m"][0].context
    # 480k, the presets' check, shares none of the tuned recipe: width, depth, context, lr, betas
    b, tuned = gpt.SIZES["480k"], gpt.SIZES["1m"]
    for field in ("d_model", "n_layer", "context"):
        assert getattr(b[0], field) != getattr(tuned[0], field), field
    assert b[1]["lr"] != tuned[1]["lr"] and tuple(b[1]["betas"]) != (0.9, 0.95)


def test_gpu_config_path_builds_on_cpu():
    """What --device cuda --size 25m configures, and a tiny model through the same code path:
    the model, the corpus windows and the reducer all on one device, autocast only on CUDA."""
    cfg = _config("--size", "25m", "--device", "cuda")
    assert cfg["device"] == "cuda" and cfg["gpt"]["d_model"] == 512 and cfg["size"] == "25m"
    assert cfg["steps"] == gpt.SIZES["25m"][1]["steps"]
    with pytest.raises(SystemExit):
        _config("--size", "tiny", "--context", "64")      # beyond the learned positions
    dev = torch.device("cpu")
    assert isinstance(lm_loop._autocast(dev), type(lm_loop._autocast(dev)))
    assert not isinstance(lm_loop._autocast(dev), torch.autocast)
    data = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    starts = gpt.val_starts(len(data), 5, 33)
    assert starts[0] == 0 and starts[-1] == len(data) - 33
    x = gpt.batch_at(data, starts, 33)
    assert x.shape == (5, 33) and x.dtype == torch.int64 and x.device == data.device
    assert torch.equal(x[1], torch.arange(int(starts[1]), int(starts[1]) + 33) % 256)


def test_lm_table_summary_and_plot(tmp_path):
    cfg = _config("--size", "tiny", "--seeds", "0", "1")
    runs = []
    for alg, base in (("dense", 2.0), ("oktopk", 2.1)):
        for s in (0, 1):
            v = base + 0.01 * s
            runs.append({"algorithm": alg, "seed": s, "final_val_loss": v,
                         "final_val_bpb": v / math.log(2),
                         "val_curve": [(0, 5.5), (10, v)], "final_train_loss": v,
                         "bytes_per_step": 1000.0 if alg == "dense" else 20.0,
                         "bytes_curve": [1000] * 10, "time_per_step_ms": 2.0, "reduce_ms": 1.0,
                         "numel": 100, "k": 1, "replicas_identical": True,
                         "applied_curve": [100 if alg == "dense" else 1] * 10})
    summary = report.summarize(runs, ["dense", "oktopk"], [])
    ok = summary[1]
    assert ok["loss_vs_dense_pct"] == pytest.approx(100 * (2.105 / 2.005 - 1))
    assert ok["loss_vs_dense_pct_per_seed"] == pytest.approx([5.0, 100 * (2.11 / 2.01 - 1)])
    assert ok["applied_per_step"] == 1 and summary[0]["applied_per_step"] == 100
    text = report.format_table(summary, cfg)
    assert "val nats/byte" in text and "bits/byte" in text
    assert f"{100 * (2.105 / 2.005 - 1):+.2f}%" in text and "2.1050 ± 0.0071" in text
    png = tmp_path / "lm.png"
    report.plot({"config": cfg, "runs": runs, "corpus": {"unigram_nats_per_byte": 3.3}}, str(png))
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
