"""Run the comparison's ranks: ONE torchrun for every (seed, algorithm) run, relaunched after
a failure (:func:`launch`), and the worker each rank runs (:func:`worker_main`, started as
``python -m oktopk_triton.bench.launcher --worker CONFIG.json OUT.jsonl``).

The workers loop over the runs, re-seeding the model, optimizer and data order for each, so every
algorithm sees exactly the same initial weights and batches. One launch pays interpreter
start-up, the torch import, and the process-group rendezvous once instead of once per algorithm.
If a run fails (an algorithm raises or a rank dies), torchrun stops the launch; the driver
records the failure for that run and relaunches with the runs that are left, so one broken
algorithm never hides the others. Rank 0 appends one JSON record per finished run to a results
file that the driver reads.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any, Dict, List, Optional

from ._common import fmt_bytes as _fmt_bytes
from .digits import load_data
from .lm_loop import train_one_lm
from .loops import train_one
from .ranks import init_rank, run_group


def launch(config: Dict[str, Any], timeout: float = 1800.0):
    jobs = [(seed, alg) for seed in config["seeds"] for alg in config["algorithms"]]
    done: Dict[tuple, dict] = {}
    failures: List[dict] = []
    env = dict(os.environ)
    # the CPU path of the kernels is the torch reference; the Triton *interpreter* (what the
    # test suite turns on) would make training ~100x slower
    env.pop("TRITON_INTERPRET", None)
    env["OMP_NUM_THREADS"] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    with tempfile.TemporaryDirectory(prefix="oktopk-train-") as tmp:
        attempt = 0
        while True:
            todo = [j for j in jobs if j not in done and
                    not any((f["seed"], f["algorithm"]) == j for f in failures)]
            if not todo:
                break
            attempt += 1
            cfg = dict(config, jobs=[list(j) for j in todo])
            cfg_path = os.path.join(tmp, f"config{attempt}.json")
            out_path = os.path.join(tmp, f"results{attempt}.jsonl")
            # the config and the per-rank JSONL lines are an internal stream between this
            # process and its ranks (in a temporary folder), not results: records.write writes
            # the report train.py builds from them
            with open(cfg_path, "w") as f:
                json.dump(cfg, f)
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                   "--nproc_per_node", str(config["world_size"]),
                   "-m", "oktopk_triton.bench.launcher", "--worker", cfg_path, out_path]
            try:
                rc = run_group(cmd, env=env, timeout=timeout)
            except subprocess.TimeoutExpired:
                rc = f"timeout (after --timeout {timeout:g} s: raise it for a longer run)"
            records = _read_jsonl(out_path)
            errors = {}
            for r in records:
                key = (r["seed"], r["algorithm"])
                if "error" in r:
                    errors.setdefault(key, r["error"])
                else:
                    done[key] = r
            if rc == 0 and all(j in done for j in todo):
                break
            # the first unfinished run is the one that failed
            pending = [j for j in todo if j not in done]
            if not pending:
                break
            failed = pending[0]
            failures.append({"seed": failed[0], "algorithm": failed[1],
                             "error": errors.get(failed, f"launch ended with rc={rc}")})
            print(f"!! {failed[1]} (seed {failed[0]}) failed: {failures[-1]['error']}; "
                  f"relaunching for the remaining runs", flush=True)
    runs = [done[j] for j in jobs if j in done]
    return runs, failures


def _read_jsonl(path: str) -> List[dict]:
    out = []
    if os.path.exists(path):
        with open(path) as f:
            for line in f:
                line = line.strip()
                if line:
                    out.append(json.loads(line))
    return out


def uses_cuda(cfg, world: Optional[int] = None) -> bool:
    """Whether the ranks train on GPUs: ``--device cuda``, or ``auto`` with a GPU per rank."""
    import torch
    world = cfg["world_size"] if world is None else world
    return (cfg.get("device", "auto") == "cuda" or
            (cfg.get("device", "auto") == "auto" and torch.cuda.is_available()
             and torch.cuda.device_count() >= world))


def _comm_and_device(cfg):
    """This torchrun worker's communicator and device: NCCL on its GPU (:func:`ranks.init_rank`
    places it) when asked for, or by default when every rank has a GPU of its own; else gloo."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = uses_cuda(cfg, world)
    device = init_rank(local_rank, world, None, gpu=use_cuda, group="nccl" if use_cuda else "gloo",
                       timeout=300.0, bind_device=True)
    from ..comm import default_communicator
    return default_communicator(device), device


def worker_main(cfg_path: str, out_path: str) -> int:
    import traceback

    import torch
    import torch.distributed as dist
    import warnings
    warnings.filterwarnings("ignore", category=FutureWarning)  # torch.distributed deprecations
    torch.set_num_threads(1)
    with open(cfg_path) as f:
        cfg = json.load(f)
    comm, device = _comm_and_device(cfg)
    rank = dist.get_rank()
    if cfg["model"] == "gpt":
        from .gpt import load_corpus
        corpus = load_corpus(cfg["val_fraction"])
        data = (corpus.train.to(device), corpus.val.to(device))
        train_fn = train_one_lm
    else:
        Xtr, ytr, Xte, yte = load_data(cfg["test_fraction"], cfg.get("train_subset", 0))
        data = (Xtr.to(device), ytr.to(device), Xte.to(device), yte.to(device))
        train_fn = train_one
    for seed, alg in cfg["jobs"]:
        t0 = time.time()
        try:
            rec = train_fn(cfg, alg, seed, comm, device, data, log=not cfg.get("quiet"))
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            tb = traceback.format_exc()
            print(f"[rank {rank}] {alg} seed {seed} failed:\n{tb}", file=sys.stderr, flush=True)
            # any rank may be the one that raised: each appends its own short line
            with open(out_path, "a") as f:
                f.write(json.dumps({"seed": seed, "algorithm": alg, "error": err}) + "\n")
            raise
        rec["wall_s"] = time.time() - t0
        if rank == 0:
            with open(out_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
            if not cfg.get("quiet"):
                metric = (f"val loss {rec['final_val_loss']:.4f} nats/byte "
                          f"({rec['final_val_bpb']:.3f} bits/byte)" if "final_val_loss" in rec
                          else f"test acc {100 * rec['final_test_acc']:.2f}%")
                print(f"  [{alg:>9} seed {seed}] done in {rec['wall_s']:.1f} s: "
                      f"{metric}, {_fmt_bytes(rec['bytes_per_step'])}"
                      f"/step, {rec['time_per_step_ms']:.1f} ms/step, replicas "
                      f"{'identical' if rec['replicas_identical'] else 'DIVERGED'}", flush=True)
    # barrier, destroy the group, then leave before interpreter finalisation, where torch 2.13's
    # gloo teardown can abort and make torchrun report a finished comparison as failed
    from ..teardown import shutdown
    shutdown(exit_code=0)
    return 0


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2], sys.argv[3]))
    print("usage: torchrun ... -m oktopk_triton.bench.launcher --worker CONFIG.json OUT.jsonl\n"
          "       (use `oktopk-bench train` to run the comparison)", file=sys.stderr)
    sys.exit(2)
