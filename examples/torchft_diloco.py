"""SparseDiLoCo on torchft: a lighthouse and 3 replica groups on this machine, each a process.

    pip install -e ".[torchft]"
    python examples/torchft_diloco.py [--replicas 3] [--syncs 20] [--sync-every 8]

The launcher starts ``torchft_lighthouse`` on loopback and one process per replica group (rank
0 of 1 inside its group), waits for them (every wait bounded) and stops what it started by pid.
Each replica trains a small MLP on its own shard of a synthetic task with AdamW, and every 8th
inner step syncs through ``SparseDiLoCo`` with DiLoCo's outer optimizer (SGD, lr 0.7, Nesterov
momentum 0.9; served at momentum 0.5 over error feedback, in one log line) and the ``diloco``
preset (Ok-Topk on the 2-bit wire at 1/10 of DiLoCo's bytes). It prints each replica's loss
before and after, and fails unless the loss fell and the replicas hold the same weights.
"""
import argparse
import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
from datetime import timedelta

import torch

import oktopk_triton


def task(seed: int, rank: int):
    """The synthetic task (a random teacher's classes) and this replica's shard of it."""
    g = torch.Generator().manual_seed(seed)
    w_in, w_out = torch.randn(20, 32, generator=g), torch.randn(32, 20, generator=g)
    x = torch.randn(4096, 20, generator=g)
    y = (torch.tanh(x @ w_in) @ w_out).argmax(1)
    return x, y, torch.Generator().manual_seed(seed * 100 + rank)


def replica(args) -> None:
    from torch.distributed import TCPStore
    from torchft import Manager, ProcessGroupGloo

    from oktopk_triton.integrations.torchft import SparseDiLoCo

    logging.basicConfig(format=f"replica {args.replica}: %(message)s")
    logging.getLogger("oktopk_triton").setLevel(logging.INFO)   # the preset's line, the optimizer's
    torch.manual_seed(args.seed)              # every replica starts from the same weights
    model = torch.nn.Sequential(torch.nn.Linear(20, 48), torch.nn.ReLU(),
                                torch.nn.Linear(48, 20), torch.nn.ReLU(), torch.nn.Linear(20, 20))
    inner_opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x, y, gen = task(args.seed, args.replica)
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(), min_replica_size=args.replicas, use_async_quorum=False,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    inner_opt.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner_opt.state_dict()},
        init_sync=False, rank=0, world_size=1, store_addr="127.0.0.1", store_port=store.port,
        lighthouse_addr=args.lighthouse, replica_id=f"replica_{args.replica}",
        hostname="127.0.0.1", timeout=timedelta(seconds=30),
        quorum_timeout=timedelta(seconds=60), connect_timeout=timedelta(seconds=30))

    def loss_fn():
        with torch.no_grad():
            return torch.nn.functional.cross_entropy(model(x), y).item()

    first = loss_fn()
    outer_opt = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
    # with DiLoCo(manager, [model], inner_opt, outer_opt, sync_every=8):
    with SparseDiLoCo(manager, [model], inner_opt, outer_opt, sync_every=8, preset="diloco"):
        while manager.current_step() < args.syncs:
            idx = torch.randint(0, len(x), (32,), generator=gen)
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            inner_opt.step()                  # every 8th step syncs (a hook)
            inner_opt.zero_grad()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    print(json.dumps({"replica": args.replica, "first": first, "last": loss_fn(),
                      "weights": float(weights.double().sum()), "syncs": args.syncs}),
          flush=True)
    manager.shutdown(wait=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args) -> None:
    """The lighthouse and one process per replica; every process it started is stopped."""
    here = os.path.join(os.path.dirname(sys.executable), "torchft_lighthouse")  # the venv's
    binary = here if os.path.exists(here) else shutil.which("torchft_lighthouse")
    if binary is None:
        raise SystemExit("torchft_lighthouse is not on PATH: pip install -e '.[torchft]'")
    port = _free_port()
    procs = [subprocess.Popen([binary, "--min_replicas", str(args.replicas), "--quorum_tick_ms",
                               "100", "--join_timeout_ms", "10000", "--bind",
                               f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)]
    env = dict(os.environ, RUST_LOG="error", OMP_NUM_THREADS="1")
    try:
        time.sleep(1.0)
        for i in range(args.replicas):
            procs.append(subprocess.Popen(
                [sys.executable, __file__, "--replica", str(i), "--lighthouse",
                 f"http://127.0.0.1:{port}", "--replicas", str(args.replicas), "--syncs",
                 str(args.syncs), "--seed", str(args.seed)], env=env, stdout=subprocess.PIPE,
                text=True))
        results = [json.loads(p.communicate(timeout=args.timeout)[0].strip().splitlines()[-1])
                   for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
    for r in results:
        print(f"replica {r['replica']}: loss {r['first']:.3f} -> {r['last']:.3f} after "
              f"{r['syncs']} syncs")
    if len({r["weights"] for r in results}) != 1:
        raise SystemExit("the replicas' weights differ")
    if not all(r["last"] < 0.8 * r["first"] for r in results):
        raise SystemExit("the loss did not fall")
    print("the replicas agree and the loss fell")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--syncs", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole run")
    ap.add_argument("--replica", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--lighthouse", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    replica(args) if args.replica is not None else launch(args)


if __name__ == "__main__":
    main()
    oktopk_triton.shutdown(exit_code=0)
