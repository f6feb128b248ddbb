"""The outer optimizer of local steps over error feedback, on a small MLP and thread ranks.

    python -m tools.research.outer_optimizer [--variants a,b,...] [--seeds 0,1,2] [--syncs 30]

Each variant trains the same 2,408-parameter MLP (a random teacher's 20 classes, 4096 samples)
on 3 ``LocalCluster`` ranks with AdamW inside (lr 3e-3, batch 32), syncs every 8 steps through
``SparseAllreduce`` (called on the pseudo-gradient ``anchor - weights``) and applies the outer
step itself, so that designs the library does not ship can be compared: the momentum after the
reduce (DiLoCo's Nesterov), before the sparsification (Deep Gradient Compression's correction,
masked or not), none (error feedback in its place), a decayed residual (SparseLoCo). It prints
the final loss on the whole task per seed. docs/fault-tolerance.md, "The outer optimizer",
quotes its output.
"""
from __future__ import annotations

import argparse
import json
import threading
from typing import Any, Dict

import torch

from oktopk_triton import SparseAllreduce
from oktopk_triton.comm.local import LocalCluster
from oktopk_triton.config import OkTopk

P, H = 3, 8

# lr: the outer learning rate; m: momentum; where: "after" the reduce or "before" the
# sparsification; mask: DGC's momentum factor masking; decay: residual decay per sync
VARIANTS: Dict[str, Dict[str, Any]] = {
    "dense-nesterov": dict(algorithm="dense", lr=0.7, m=0.9),
    "sparse-nesterov-after": dict(lr=0.7, m=0.9),
    "sparse-sgd1": dict(lr=1.0),
    "sparse-nest-after-m05": dict(lr=0.7, m=0.5),
    "sparse-before-nest-mask": dict(lr=0.7, m=0.9, where="before"),
    "sparse-before-nest-nomask": dict(lr=0.7, m=0.9, where="before", mask=False),
    "sparse-sgd1-decay": dict(lr=1.0, decay=0.95),
    "q2-d15-sgd1": dict(lr=1.0, wire="q2", density=0.15),
    "q2-d15-nest-m05": dict(lr=0.7, m=0.5, wire="q2", density=0.15),
    "q2-d15-nest-m07": dict(lr=0.7, m=0.7, wire="q2", density=0.15),
}

_LOCK = threading.Lock()       # the ranks are threads sharing torch's global generator


def _task(seed: int):
    g = torch.Generator().manual_seed(1234)
    teacher = torch.nn.Sequential(torch.nn.Linear(20, 32), torch.nn.Tanh(),
                                  torch.nn.Linear(32, 20))
    for p in teacher.parameters():
        torch.nn.init.normal_(p, std=1.0, generator=g)
    x = torch.randn(4096, 20, generator=g)
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.ReLU(), torch.nn.Linear(48, 20),
                                torch.nn.ReLU(), torch.nn.Linear(20, 20))
    with torch.no_grad():
        return x, teacher(x).argmax(1), model


def _outer(out, v, variant):
    """What the anchor moves by (before the learning rate)."""
    m = variant.get("m", 0.0)
    if variant.get("where", "after") == "after" and m > 0:
        v.mul_(m).add_(out)
        return out + m * v
    return out


def run(comm, variant: Dict[str, Any], seed: int, syncs: int) -> Dict[str, Any]:
    with _LOCK:
        x, y, model = _task(seed)
    params = list(model.parameters())
    inner = torch.optim.AdamW(params, lr=3e-3)
    algo = OkTopk(wire_format=variant["wire"]) if variant.get("wire") else \
        variant.get("algorithm", "oktopk")
    sar = SparseAllreduce(sum(p.numel() for p in params), comm=comm,
                          density=variant.get("density", 0.05), algorithm=algo)
    anchor = torch.cat([p.detach().reshape(-1) for p in params]).clone()
    u, v = torch.zeros_like(anchor), torch.zeros_like(anchor)
    m, before = variant.get("m", 0.0), variant.get("where", "after") == "before"
    gen = torch.Generator().manual_seed(seed * 100 + comm.rank)
    losses, sent = [], 0
    for _ in range(syncs):
        for _ in range(H):
            idx = torch.randint(0, len(x), (32,), generator=gen)
            inner.zero_grad()
            torch.nn.functional.cross_entropy(model(x[idx]), y[idx]).backward()
            inner.step()
        with torch.no_grad():
            delta = anchor - torch.cat([p.detach().reshape(-1) for p in params])
            g = delta
            if before:                       # the momentum before the sparsification
                u.mul_(m).add_(delta)
                g = delta + m * u
            if variant.get("decay", 1.0) != 1.0:
                sar.algorithm.residual.mul_(variant["decay"])
            b0 = comm.bytes_sent
            out = sar(g.clone())
            sent += comm.bytes_sent - b0
            if before and variant.get("mask", True):
                u.masked_fill_(sar.algorithm.residual == 0, 0.0)
            anchor.sub_(variant["lr"] * _outer(out, v, variant))
            torch._foreach_copy_(params, [a.view_as(p) for a, p in zip(
                anchor.split([p.numel() for p in params]), params)])
            losses.append(torch.nn.functional.cross_entropy(model(x), y).item())
    return {"losses": losses, "bytes": sent}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--syncs", type=int, default=30)
    args = ap.parse_args(argv)
    for name in args.variants.split(","):
        finals = []
        for seed in (int(s) for s in args.seeds.split(",")):
            r = LocalCluster(P).run(run, VARIANTS[name], seed, args.syncs)
            finals.append(round(r[0]["losses"][-1], 3))
        print(json.dumps({"variant": name, "final": finals, "bytes": r[0]["bytes"]}),
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
