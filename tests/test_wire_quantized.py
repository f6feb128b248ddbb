"""``wire_format="q2"`` / ``"q4"`` (oktopk_triton/algorithms/_wire.py): SparseLoCo's values on the
compact wire's layout, 2- or 4-bit codes (sign + magnitude) behind two fp32 scales per 65,536-
element chunk, 16-bit chunk-relative indices two to a word.

The format (round trip, the error it reports, the words it costs), then Ok-Topk and TopkA: the
step contract (conservation with the quantization error kept in residuals, out bitwise identical
on every rank) at P = 1..5, the bytes each step counts against the schedule, the local-steps
path, the refusals and the byte helper.
"""
import math
import os

import pytest
import torch

from conservation import (assert_bitwise_agreement, assert_conservation, mixed, run_steps,
                          steady_steps_never_sync, torch_kernels)
from oktopk_triton import SparseAllreduce
from oktopk_triton.algorithms import _wire as W
from oktopk_triton.algorithms.schedule import bytes_per_step, density_for_bytes, schedule_of
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.kernels import _dispatch

BE = "torch"
QFORMATS = ["q2", "q4"]


# -- the format -------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", QFORMATS)
def test_round_trip_across_chunks_gives_the_senders_wire_values(fmt):
    """Unsorted rows over 3.05 chunks, an odd capacity, counts 0, short and over capacity:
    decode gives the valid indices sorted, and exactly the values ``return_wire`` told the
    sender (so ``v - wire`` is what it keeps); signs survive; the row is the documented size."""
    g = torch.Generator().manual_seed(1)
    span, cap, b = 3 * W.CHUNK + 3000, 701, W.QUANTIZED[fmt]
    idx = torch.stack([torch.randperm(span, generator=g)[:cap] for _ in range(4)]).int()
    vals = torch.randn(4, cap, generator=g) * 1e3
    counts = torch.tensor([cap, 5, 0, cap + 40], dtype=torch.int32)
    msg, wire = W.encode(idx, vals, counts, span, header=2, fmt=fmt, return_wire=True)
    words = 2 + 3 * 4 + (cap + 1) // 2 + math.ceil(cap * b / 32)
    assert msg.shape == (4, W.row_words(cap, span, header=2, fmt=fmt)) == (4, words)
    assert torch.equal(msg[:, :2], torch.zeros(4, 2, dtype=torch.int32))
    got_i, got_v, got_c = W.decode(msg, cap, span, header=2, fmt=fmt)
    assert got_c.tolist() == [cap, 5, 0, cap]
    for s, c in enumerate(got_c.tolist()):
        order = torch.argsort(idx[s, :c].long())
        assert torch.equal(got_i[s, :c], idx[s, :c][order])
        assert torch.equal(got_v[s, :c], wire[s, :c][order])
        assert ((wire[s, :c] < 0) == (vals[s, :c] < 0)).all()
        assert (got_i[s, c:] == -1).all() and (got_v[s, c:] == 0).all()
        assert (wire[s, c:] == 0).all()
    assert int(got_i.max()) >= 3 * W.CHUNK


def test_quantization_error_is_bounded_and_q4_beats_q2():
    """On top-k-like magnitudes (a heavy tail above a threshold): q4 keeps every entry within
    half a level of its chunk (``(max - min)/14``), q2's error is below the one-scale
    sign quantizer's (``sign · mean|v|``), and q4's below q2's."""
    g = torch.Generator().manual_seed(2)
    span = 2 * W.CHUNK
    x = torch.randn(span, generator=g) ** 3          # heavy tails
    k = 2000
    _, idx = torch.topk(x.abs(), k)
    v = x[idx]
    err = {}
    for fmt in QFORMATS:
        _, wire = W.encode(idx.int(), v, None, span, fmt=fmt, return_wire=True)
        err[fmt] = float((v - wire).norm() / v.norm())
    lo_chunk = idx < W.CHUNK
    sign_only = torch.where(lo_chunk, v.abs()[lo_chunk].mean(), v.abs()[~lo_chunk].mean())
    err["sign"] = float((v - torch.sign(v) * sign_only).norm() / v.norm())
    _, wire = W.encode(idx.int(), v, None, span, fmt="q4", return_wire=True)
    for part in (lo_chunk, ~lo_chunk):
        a = v.abs()[part]
        assert float((v - wire)[part].abs().max()) <= float(a.max() - a.min()) / 14 * 1.0001
    assert err["q4"] < err["q2"] < err["sign"], err


def test_entry_bytes_and_row_words():
    assert [W.entry_bytes(f) for f in W.WIRE_FORMATS] == [8.0, 4.0, 2.25, 2.5]
    assert W.row_words(32, 10, fmt="q2") == 3 + 16 + 2
    assert W.row_words(33, 10, fmt="q4") == 3 + 17 + 5
    with pytest.raises(ValueError, match="wire_format must be one of"):
        W.entry_bytes("q3")


# -- Ok-Topk and TopkA -----------------------------------------------------------------------
@pytest.mark.parametrize("name", ["oktopk", "topka"])
@pytest.mark.parametrize("fmt", QFORMATS)
@pytest.mark.parametrize("P", [1, 2, 3, 4])
def test_contract_and_bytes(name, fmt, P, monkeypatch):
    """Spans beyond one chunk: conservation with the quantization error in the residuals,
    out bitwise identical, entries delivered, every step's bytes what the schedule says, and
    near 2.25/4 (q2) or 2.5/4 (q4) of compact's at the same k (the chunk words and headers
    weigh more at this small n)."""
    if P == 4:  # the wire's kernels interpreted at P = 1, 2, 3, their torch references at P = 4
        monkeypatch.setattr(_dispatch, "INTERPRET", False)
    n, steps = 70_000 * P, 4
    opts = torch_kernels(name)
    res = run_steps(name, P, n, steps, 0.01, mixed(P), wire_format=fmt, check_finite="off",
                    **opts)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    assert res.stat_array("global_selected")[1:].min() > 0
    if P == 1:
        return
    sent = res.stat_array("bytes_sent")[1:]
    want = sum(s.bytes_per_rank for s in schedule_of(name, n, res.k, P, check_finite="off",
                                                     wire_format=fmt))
    assert (sent == want).all(), (sent, want)
    comp = sum(s.bytes_per_rank for s in schedule_of(name, n, res.k, P, check_finite="off",
                                                     wire_format="compact"))
    assert want < (W.entry_bytes(fmt) / W.entry_bytes("compact") + 0.08) * comp


@pytest.mark.parametrize("name", ["oktopk", "topka"])
def test_odd_world_momentum_and_nonfinite(name):
    """P = 5 with momentum correction (masked velocity), and a NaN on one rank: the contract
    holds and the non-finite step leaves every residual bit for bit."""
    opts = torch_kernels(name)
    res = run_steps(name, 5, 9000, 8, 0.02, mixed(7), momentum=0.9, wire_format="q2",
                    nonfinite={4: 3}, **opts)
    assert_conservation(res)
    assert_bitwise_agreement(res)
    assert res.unchanged[4]
    assert sum(int((a.velocity == 0).sum()) for a in res.algs) > 0


def test_oktopk_out_holds_quantized_levels():
    """What reaches out is the gathered slots' levels: per region and chunk at most 2 distinct
    magnitudes (q2) times P, before the division by P."""
    P, n = 3, 30_000
    res = run_steps("oktopk", P, n, 3, 0.02, mixed(3), backend=BE, wire_format="q2",
                    check_finite="off")
    for t in range(1, 3):
        out = res.outs[t][0]
        mags = out[out != 0].abs().unique()
        assert 2 <= mags.numel() <= 2 * P, mags   # every region within one chunk: 2 levels


# -- refusals and the byte helper -------------------------------------------------------------
def test_refusals_are_one_line():
    comm = LocalCluster(1).communicator(0)
    for name in ("gtopk", "spardl", "gaussiank", "topkdsa", "dense"):
        with pytest.raises(ValueError, match=rf"{name}: wire_format='q2' is not supported") as e:
            SparseAllreduce(1000, comm=comm, algorithm=name, wire_format="q2")
        assert "\n" not in str(e.value)
        with pytest.raises(ValueError, match="not supported"):
            schedule_of(name, 1000, 10, 4, wire_format="q4")
    with pytest.raises(ValueError, match=r"wire_format must be one of \('fp32', 'compact', "
                                         r"'q2', 'q4'\)"):
        SparseAllreduce(1000, comm=comm, algorithm="oktopk", wire_format="q8")
    with pytest.raises(ValueError, match="does not combine"):
        SparseAllreduce(1000, comm=comm, algorithm="oktopk", wire_format="q2", wire_dtype="bf16")


def test_bytes_per_step_and_density_for_bytes():
    """The helper prices a step from the schedule (sync_every divides it); the density it
    returns for a byte budget fits that budget and is near the largest that does."""
    n, P = 1 << 20, 8
    assert bytes_per_step("oktopk", n, P, 0.01) == sum(
        s.bytes_per_rank for s in schedule_of("oktopk", n, 10486, P))
    assert bytes_per_step("topka", n, P, 0.02, "q2", sync_every=4) == pytest.approx(
        sum(s.bytes_per_rank for s in schedule_of("topka", n, 20972, P, wire_format="q2")) / 4)
    budget = bytes_per_step("oktopk", n, P, 0.01, "compact")
    for fmt in ("fp32", "compact", "q2", "q4"):
        d = density_for_bytes("oktopk", n, P, budget, fmt)
        assert bytes_per_step("oktopk", n, P, d, fmt) <= budget
        assert bytes_per_step("oktopk", n, P, d * 1.01, fmt) > budget
    assert density_for_bytes("oktopk", n, P, budget, "q2") > 1.6 * 0.01
    assert density_for_bytes("oktopk", n, P, budget, "fp32") < 0.51 * 0.01 * 1.05


# -- the local-steps path ---------------------------------------------------------------------
def _train_body(comm, cfg):
    from oktopk_triton.bench import gpt as g
    from oktopk_triton.bench import lm_loop as t
    corpus = g.load_corpus(cfg["val_fraction"], max_train_bytes=1 << 19)
    return {alg: t.train_one_lm(cfg, alg, 0, comm, torch.device("cpu"),
                                (corpus.train, corpus.val), log=False)
            for alg in ("oktopk", "topka")}


def test_train_gpt_local_steps_q2():
    """``oktopk-bench train --model gpt --size tiny --option wire_format=q2 --option
    sync_every=4`` on 2 gloo ranks, Ok-Topk and TopkA: replicas identical, bytes only on the
    syncs, the loss falls."""
    import argparse
    from distutil import run_pooled_torch
    from oktopk_triton.bench import train
    p = argparse.ArgumentParser()
    train.add_arguments(p)
    a = p.parse_args(["--model", "gpt", "--size", "tiny", "--steps", "8", "--eval-times", "1",
                      "--density", "0.1", "--lr", "1e-2", "--option", "wire_format=q2",
                      "--option", "sync_every=4"])
    cfg = train.build_config(a, ["oktopk", "topka"])
    assert cfg["options"]["wire_format"] == "q2"
    res = run_pooled_torch(2, _train_body, cfg, timeout=180)
    for alg in ("oktopk", "topka"):
        r = res[0][alg]
        assert r["replicas_identical"], alg
        syncs = [(i + 1) % 4 == 0 for i in range(8)]
        assert [b > 0 for b in r["bytes_curve"]] == syncs, r["bytes_curve"]
        assert r["final_val_loss"] < r["val_curve"][0][1], alg


def test_sparse_allreduce_local_steps_q2_on_four_ranks():
    """``SparseAllreduce(params, sync_every=4, wire_format="q2").reduce_updates(opt)`` on a
    LocalCluster of 4: replicas stay identical after every sync and the parameters move."""
    import copy
    import threading
    P, steps = 4, 8
    cluster = LocalCluster(P)
    results, errors = [None] * P, []

    torch.manual_seed(0)    # the replicas start equal (built here: threads share the RNG)
    proto = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    models = [copy.deepcopy(proto) for _ in range(P)]

    def body(rank):
        try:
            model = models[rank]
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            sar = SparseAllreduce(list(model.parameters()), comm=cluster.communicator(rank),
                                  density=0.2, algorithm="oktopk", sync_every=4,
                                  wire_format="q2", backend=BE)
            g = torch.Generator().manual_seed(100 + rank)
            start = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
            for _ in range(steps):
                x = torch.randn(8, 16, generator=g)
                loss = model(x).pow(2).mean()
                opt.zero_grad()
                loss.backward()
                sar.reduce_updates(opt)
            flat = torch.cat([p.detach().flatten() for p in model.parameters()])
            results[rank] = (flat, start)
        except BaseException as e:   # noqa: BLE001 (reported below)
            errors.append(e)
            cluster.abort() if hasattr(cluster, "abort") else None

    ts = [threading.Thread(target=body, args=(r,)) for r in range(P)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors
    for r in range(1, P):
        assert torch.equal(results[r][0], results[0][0])
    assert not torch.equal(results[0][0], results[0][1])


# -- the interpreted Triton kernels give the torch path's step bit for bit --------------------
def _backend_body(comm, n, backend):
    from oktopk_triton.algorithms.oktopk import OkTopk
    alg = OkTopk(n, comm, 0.02, backend=backend, momentum=0.9, wire_format="q2")
    fn = mixed(12)
    outs = [alg(fn(comm.rank, t, n)).clone() for t in range(4)]
    return torch.stack(outs), alg.residual.clone(), alg.velocity.clone()


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="needs TRITON_INTERPRET=1 (the interpreter runs Triton on CPU tensors)")
def test_oktopk_q2_triton_kernels_match_torch():
    n, P = 3000, 3
    tri = LocalCluster(P).run(_backend_body, n, "triton")
    ref = LocalCluster(P).run(_backend_body, n, "torch")
    for a, b in zip(tri, ref):
        for x, y in zip(a, b):
            assert torch.equal(x, y)


# -- CUDA: a steady step never synchronises with the host -------------------------------------
def _sync_body(comm, name, n, fmt):
    from oktopk_triton.algorithms import get_algorithm
    alg = get_algorithm(name)(n, comm, 0.01, momentum=0.9, device=comm.device, wire_format=fmt)
    return steady_steps_never_sync(alg, comm, n)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["oktopk", "topka"])
@pytest.mark.parametrize("fmt", QFORMATS)
def test_cuda_quantized_step_never_syncs(name, fmt):
    assert LocalCluster(2, device="cuda").run(_sync_body, name, 1 << 20, fmt) == [True] * 2
