"""The local-steps screen on the byte-level GPT: one row per run, against dense data parallel.

    python tools/local_steps_screen.py DIR [--dense DENSE.json] [--json OUT.json]

DIR holds one ``oktopk-bench train --model gpt`` JSON per configuration (tools/lm_campaign.sh's
layout; the screen's commands are in docs/techniques.md). Each run is compared with dense
data-parallel AdamW of the same seed from ``--dense``: final validation loss against dense's,
bytes per step as a fraction of dense's fp32 bytes, and the steps ratio (the run's steps over the
step at which dense's validation curve reaches the run's final loss; planning.steps_ratio).
``--dense`` defaults to the committed 1200-step campaign (dense, seeds 0-2).
"""
from __future__ import annotations

import argparse
import glob
import os
import sys

from oktopk_triton.bench import records
from oktopk_triton.planning import steps_ratio

DENSE = "bench/results/lm/lm-gpt1m-cpu-1200steps-2026-11-25.json"


def dense_run(path: str, seed: int) -> dict:
    for r in records.read(path)["runs"]:
        if r["algorithm"] == "dense" and r["seed"] == seed and r.get("local_steps") is None:
            return r
    raise SystemExit(f"local_steps_screen: no dense run of seed {seed} in {path}")


def rows(directory: str, dense_path: str) -> list:
    out = []
    for path in sorted(glob.glob(os.path.join(directory, "*.json"))):
        rep = records.read(path)
        for r in rep.get("runs", []):
            d = dense_run(dense_path, r["seed"])
            steps = [s for s, _ in d["val_curve"]]
            loss = [v for _, v in d["val_curve"]]
            ratio = steps_ratio(steps, loss, r["steps"], r["final_val_loss"])
            opts = rep.get("config", {}).get("options", {})
            out.append({"tag": os.path.basename(path)[:-5], "algorithm": r["algorithm"],
                        "seed": r["seed"], "density": r["density"],
                        "sync_every": int(opts.get("sync_every", 1)),
                        "wire_format": opts.get("wire_format", "fp32"),
                        "final_val_loss": r["final_val_loss"],
                        "dense_final_val_loss": d["final_val_loss"],
                        "loss_vs_dense_pct": 100 * (r["final_val_loss"] / d["final_val_loss"] - 1),
                        "bytes_per_step": r["bytes_per_step"],
                        "bytes_vs_dense": r["bytes_per_step"] / d["bytes_per_step"],
                        "steps_ratio": ratio["ratio"], "clamped": ratio["clamped"],
                        "replicas_identical": r.get("replicas_identical"),
                        "commit": rep.get("commit", rep.get("git"))})
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("dir")
    p.add_argument("--dense", default=DENSE)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rs = rows(a.dir, a.dense)
    print("| run | H | density per sync | wire | bytes vs dense | final val loss | vs dense "
          "| steps ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(rs, key=lambda r: (r["algorithm"], r["sync_every"])):
        print(f"| {r['tag']} | {r['sync_every']} | {r['density']:g} | {r['wire_format']} | "
              f"{r['bytes_vs_dense']:.4f} | {r['final_val_loss']:.4f} | "
              f"{r['loss_vs_dense_pct']:+.1f}% | {r['steps_ratio']:.2f} |")
    if a.json:
        rec = records.header("lm-local-steps-screen", vars(a))
        rec.update({"dense": a.dense, "runs": rs})
        records.write(a.json, rec)
    return 0


if __name__ == "__main__":
    sys.exit(main())
