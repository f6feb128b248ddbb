"""Quality at scale: the byte-level GPT trained with local steps on P = 16 .. 64 ranks of a
``LocalCluster`` (threads of one process), to compare Ok-Topk and TopkA at *equal quality*.

    python -m tools.research.quality_at_scale --world-size 64 --algorithms topka --density 0.005 \\
        --option sync_every=4 --option wire_format=q2 --json OUT.json

Why threads: ``oktopk-bench train`` runs one process per rank, and each holds ~140 MB of torch
before its model (measured on the 2-core, 24 GiB CPU machine: 64 gloo ranks of the 1m GPT
filled its memory). The ranks here share one torch, and from the 4m preset up the script has
glibc hand freed step temporaries back (:func:`lean_malloc`, ``--malloc``; it costs time, so the
1m GPT keeps glibc's defaults): the 1m GPT at P = 64 holds ~5 GB lean (6.6 GB without), the 4m
GPT ~10 GB (TopkA) to ~14 GB (Ok-Topk, with the audit's earlier 24 bytes an element), where it
was killed at 24 GiB before.

Each rank runs what ``train --model gpt`` runs (oktopk_triton/bench/lm_loop.py): the same
model, AdamW, learning-rate schedule, per-rank windows and reduction
(``reduce_updates`` with local steps, ``reduce_gradients`` without), on a copy of one
initial model. What differs: the validation loss is taken once, at the end, by the calling
thread on rank 0's replica (every replica is checked to be bitwise the same first), and each
rank counts the bytes it sends (the communicator's ``bytes_sent``) and receives
(``count_received`` of tools/research/volume_at_scale.py). Conservation is audited over the
whole run.
"""
from __future__ import annotations

import argparse
import copy
import ctypes
import math
import sys
import time
from typing import Any, Dict, List, Optional

import torch

from oktopk_triton import SparseAllreduce
from oktopk_triton.module import keywords
from oktopk_triton.bench import records
from oktopk_triton.bench.gpt import GPT, SIZES, GPTConfig, batch_at, load_corpus, val_starts
from oktopk_triton.bench.lm_loop import lm_lr, resolve_reduce
from oktopk_triton.bench.loops import sparse_setup
from oktopk_triton.bench.measure import params_checksum
from oktopk_triton.bench.train import CONSERVATION_TOL, GPT_DEFAULTS, parse_option
from oktopk_triton.comm.local import LocalCluster
from tools.research.volume_at_scale import count_received


def make_config(a) -> Dict[str, Any]:
    """The run's configuration, resolved as ``train --model gpt`` resolves it."""
    gcfg, defaults = SIZES[a.size]
    return dict(size=a.size, gpt=gcfg.as_dict(), density=a.density, world_size=a.world_size,
                steps=a.steps, batch_size=a.batch_size or int(defaults["batch_size"]),
                lr=a.lr or float(defaults["lr"]), optimizer="adamw",
                betas=tuple(defaults.get("betas", GPT_DEFAULTS["betas"])),
                weight_decay=a.weight_decay,
                warmup_fraction=GPT_DEFAULTS["warmup_fraction"], schedule="cosine",
                momentum_correction=False, momentum=0.0, reduce="auto",
                eval_sequences=a.eval_sequences, options=dict(a.option))


def _rank_run(comm, cfg, algorithm: str, seed: int, model0, train,
              progress: int = 0) -> Dict[str, Any]:
    """One rank's run; returns its replica, byte counts and conservation check."""
    count_received(comm)
    model = copy.deepcopy(model0)
    params = [p for p in model.parameters() if p.requires_grad]
    opt, options, density = sparse_setup(cfg, algorithm, model)
    mode = resolve_reduce(cfg, algorithm)
    sar = SparseAllreduce(params, comm=comm, density=density, **keywords(algorithm, options))
    ledger = sar.audit()
    L = cfg["gpt"]["context"] + 1
    g = torch.Generator().manual_seed(1_000_003 * seed + 7919 * comm.rank + 17)
    lr_at = lm_lr(cfg)
    losses, counts = [], {key: [] for key in _COUNTS}
    for step in range(cfg["steps"]):
        x = batch_at(train, torch.randint(0, len(train) - L, (cfg["batch_size"],), generator=g), L)
        opt.zero_grad(set_to_none=False)
        loss = model.loss(x)
        loss.backward()
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        if mode == "updates":
            sar.reduce_updates(opt)
        else:
            sar.reduce_gradients()
            opt.step()
        losses.append(float(loss.detach()))
        if progress and comm.rank == 0 and (step + 1) % progress == 0:
            _progress(cfg, step, losses)
        if sar.stats.get("synced", True):
            for key in _COUNTS:
                counts[key].append(int(sar.stats[key]))
    return dict(model=model, k=sar.k, sent=comm.bytes_sent, received=comm.bytes_received,
                conservation=ledger.check(), train_loss=sum(losses[-20:]) / len(losses[-20:]),
                checksum=params_checksum(params), counts=counts, numel=sar.numel)


def _progress(cfg, step: int, losses: List[float]) -> None:
    """Where a run of tens of minutes stands (rank 0, ``--progress N``)."""
    recent = losses[-20:]
    print(f"    step {step + 1}/{cfg['steps']}: train loss {sum(recent) / len(recent):.4f} "
          f"(rank 0, last {len(recent)} steps)", flush=True)


# entries a sync, from the algorithm's stats: this rank's selected entries, and the entries of
# the reduced output (nonzero in ``out``, the same on every rank)
_COUNTS = ("local_selected", "global_selected")


def _count_summary(res, syncs: int) -> Dict[str, Any]:
    """Per-sync entry counts: local (mean over ranks) and output (rank 0), as fractions of the
    reduced vector's n, over the whole run and over its last quarter of syncs (late training)."""
    n, tail = res[0]["numel"], max(1, syncs // 4)

    def mean(lists):
        return sum(map(sum, lists)) / max(1, sum(map(len, lists))) / n
    out = {}
    for key in _COUNTS:
        per_rank = [r["counts"][key] for r in (res if key == "local_selected" else res[:1])]
        out[key] = dict(mean_fraction=mean(per_rank),
                        last_quarter_fraction=mean([c[-tail:] for c in per_rank]))
    return out


def evaluate(model, val, cfg, batch: int = 64) -> float:
    """Mean next-byte cross entropy (nats) over the run's validation windows."""
    L = cfg["gpt"]["context"] + 1
    starts = val_starts(len(val), cfg["eval_sequences"], L)
    tot = n = 0.0
    model.eval()
    with torch.no_grad():
        for i in range(0, len(starts), batch):
            x = batch_at(val, starts[i:i + batch], L)
            tot += float(model.loss(x)) * x.shape[0]
            n += x.shape[0]
    return tot / n


def run_one(cfg, algorithm: str, seed: int, corpus, timeout: float,
            progress: int = 0) -> Dict[str, Any]:
    """Train ``algorithm`` at ``seed`` on ``cfg['world_size']`` thread ranks; the record."""
    torch.manual_seed(seed)                     # the same init for every algorithm at a seed
    model0 = GPT(GPTConfig(**cfg["gpt"]))
    t0 = time.perf_counter()
    res = LocalCluster(cfg["world_size"], timeout=timeout).run(
        _rank_run, cfg, algorithm, seed, model0, corpus.train, progress)
    wall = time.perf_counter() - t0
    syncs = cfg["steps"] // int(cfg["options"].get("sync_every", 1))
    cons = [r["conservation"] for r in res]
    return dict(algorithm=algorithm, seed=seed, density=cfg["density"] if algorithm != "dense"
                else 1.0, k=res[0]["k"], world_size=cfg["world_size"], steps=cfg["steps"],
                syncs=syncs, final_val_loss=evaluate(res[0]["model"], corpus.val, cfg),
                final_train_loss=sum(r["train_loss"] for r in res) / len(res),
                replicas_identical=len({r["checksum"] for r in res}) == 1,
                sent_per_sync=max(r["sent"] for r in res) / max(1, syncs),
                received_per_sync=max(r["received"] for r in res) / max(1, syncs),
                conservation_checked=all(c["checked"] for c in cons),
                conservation_relative_error=max((c["relative_error"] or 0.0) for c in cons),
                entries_per_sync=_count_summary(res, syncs), wall_s=wall)


def _check(rec: Dict[str, Any]) -> str:
    if not rec["replicas_identical"]:
        return "replicas diverged"
    if not (rec["conservation_checked"] and rec["conservation_relative_error"] <= CONSERVATION_TOL):
        return f"conservation broken (relative error {rec['conservation_relative_error']})"
    if not math.isfinite(rec["final_val_loss"]):
        return "non-finite validation loss"
    return ""


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--algorithms", nargs="+", default=["topka", "oktopk"])
    p.add_argument("--density", type=float, default=0.005, help="per sync (dense: ignored)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0])
    p.add_argument("--size", choices=sorted(SIZES), default="1m")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=1, help="per rank")
    p.add_argument("--lr", type=float, default=None, help="default: the --size preset's")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--eval-sequences", type=int, default=256)
    p.add_argument("--option", action="append", default=[], type=parse_option,
                   metavar="KEY=VALUE", help="SparseAllreduce option (VALUE as JSON if it parses)")
    p.add_argument("--progress", type=int, default=0, metavar="N",
                   help="print rank 0's train loss every N steps (0: only the results)")
    p.add_argument("--timeout", type=float, default=600.0, help="per collective, seconds")
    p.add_argument("--json", default=None)
    p.add_argument("--malloc", choices=("auto", "lean", "default"), default="auto",
                   help="glibc's allocator: lean (lean_malloc), default, or auto: lean from the "
                        "4m preset up, where memory needs it")
    return p.parse_args(argv)


# the presets small enough for glibc's defaults at P = 64 on the 24 GiB machine (1m: 6.6 GB)
_DEFAULT_MALLOC_SIZES = ("tiny", "1m")


def wants_lean(a: argparse.Namespace) -> bool:
    """Whether the run should call :func:`lean_malloc`. Why not always: it maps and unmaps every
    temporary of 64 KiB and up afresh, which costs time. The 1m GPT at P = 64, Ok-Topk at 1.6%,
    12 steps (setup and evaluation included) took 98 s lean and 73 s with glibc's defaults, one
    run each, the same validation loss and conservation error (2026-11-29, 00969d2; CPU). Its
    320-step runs took 35-42 minutes lean, about 20 before lean existed (not isolated)."""
    return a.malloc == "lean" or (a.malloc == "auto" and a.size not in _DEFAULT_MALLOC_SIZES)


def lean_malloc() -> bool:
    """Have glibc hand freed tensors back to the system: buffers of 64 KiB and up are mapped
    and unmapped on their own, and the 64 rank threads share two arenas. Why: a step's
    temporaries over n, freed into 64 threads' arenas, stayed resident; the 1m GPT at P = 64
    (6 steps, Ok-Topk) peaked at 6.6 GB with glibc's defaults and at 4.8 GB with these, which
    is what lets the 4m GPT at P = 64 fit the 24 GiB CPU machine. False where there is no glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return False
    M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8
    return all(libc.mallopt(opt, val) == 1 for opt, val in
               ((M_ARENA_MAX, 2), (M_TRIM_THRESHOLD, 0), (M_MMAP_THRESHOLD, 64 * 1024)))


def main(argv: Optional[List[str]] = None, lean: bool = False) -> int:
    """The CLI; ``lean``: :func:`lean_malloc` is in effect (the script's own entry sets it, a
    caller importing the tool keeps its process's allocator as it was)."""
    a = parse_args(argv)
    torch.set_num_threads(1)
    cfg = make_config(a)
    corpus = load_corpus()
    print(f"quality at scale: P={a.world_size}, gpt {a.size}, {a.steps} steps of "
          f"{cfg['batch_size']} x {cfg['gpt']['context']} bytes per rank, density {a.density}, "
          f"options {cfg['options']}{'' if lean else ' (glibc defaults)'}", flush=True)
    runs, errors = [], []
    for alg in a.algorithms:
        for seed in a.seeds:
            rec = run_one(cfg, alg, seed, corpus, a.timeout, a.progress)
            runs.append(rec)
            err = _check(rec)
            errors += [f"{alg} seed {seed}: {err}"] if err else []
            print(f"  {alg:>7} seed {seed}: val {rec['final_val_loss']:.4f} nats/byte, sent "
                  f"{rec['sent_per_sync'] / 1e3:,.1f} kB / received "
                  f"{rec['received_per_sync'] / 1e3:,.1f} kB a sync (largest rank), conservation "
                  f"{rec['conservation_relative_error']:.1e}, {rec['wall_s']:.0f} s"
                  + (f"  ERROR: {err}" if err else ""), flush=True)
    if a.json:
        records.write(a.json, {**records.header("quality-at-scale", vars(a)), "config": cfg,
                               "corpus": corpus.info, "runs": runs})
        print(f"results: {a.json}")
    for e in errors:
        print(f"ERROR: {e}", file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(lean=wants_lean(parse_args()) and lean_malloc()))
