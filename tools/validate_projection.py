"""Validate the step-time projection (``oktopk-bench project``) against a measured run.

    python -m tools.validate_projection GPU_COLLECTIVES.json ... [--kernels GPU_KERNELS.json]
        [--fit per-P|global] [--ranks-per-gpu N] [--json OUT]
    python -m tools.validate_projection --synthetic [--alpha 50us --beta 3GB/s --noise 0.05]
        [--write-synthetic PATH]

With one or more JSONs of ``oktopk-bench collectives --backend nccl`` (merged: e.g. the P=4 and
P=8 files that ``tools/gpu_check.py`` writes) (top-level ``probes[{P, op, bytes,
ms_mean, ms_min}]`` and ``results[{name, P, n, k, step_ms_mean, step_ms_min, mb_sent_per_rank}]``)
it fits the network's α (latency per message) and β (bandwidth per rank) to the allreduce probes
and the dense steps, predicts every algorithm's step at P = 4 and 8 from its schedule and the
kernel costs, and prints predicted against measured with the error (goal: within 25%). Exit
status 0 when every prediction is within the goal, 1 otherwise.

``--synthetic`` (also the default without a JSON): no GPU measurement exists yet, so the check
runs on a JSON generated from the model itself with a known α and β (and optional noise): the
fit must recover them (within 1% without noise, 10% with) and the predictions must match. The
output says SYNTHETIC at the top and the bottom: such a run validates the fitting and the
plumbing, not the model.
"""
from __future__ import annotations

import argparse
import sys

from oktopk_triton import planning as pl
from oktopk_triton.bench import project as pj
from oktopk_triton.bench import records


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json_in", nargs="*", help="collectives JSONs (one-GPU NCCL runs)")
    ap.add_argument("--synthetic", action="store_true", help="validate on a generated JSON")
    ap.add_argument("--alpha", default="50us", help="synthetic: latency per message (50us)")
    ap.add_argument("--beta", default="3GB/s", help="synthetic: bandwidth per rank (3GB/s)")
    ap.add_argument("--noise", type=float, default=0.05,
                    help="synthetic: multiplicative noise on the timings, uniform +-x (0.05)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--write-synthetic", default=None, metavar="PATH",
                    help="also write the generated JSON here")
    ap.add_argument("--kernels", default=None,
                    help="kernels JSON (default: newest bench/results/kernels/gpu-kernels-*.json, "
                         "else the built-in defaults; 'none': the defaults)")
    ap.add_argument("--fit", choices=("per-P", "global"), default="per-P")
    ap.add_argument("--ranks-per-gpu", type=int, default=None)
    ap.add_argument("--target", type=float, default=25.0, help="goal in percent (25)")
    ap.add_argument("--json", default=None, help="write the validation JSON here")
    a = ap.parse_args(argv)

    kernels, note = pl.resolve_kernels(a.kernels)
    if note:
        print("note:", note)
    synthetic = a.synthetic or not a.json_in
    truth = None
    if synthetic:
        truth = pl.parse_net(f"{a.beta},{a.alpha}")
        d = pl.synthetic_collectives(truth, kernels, noise=a.noise, seed=a.seed)
        if a.write_synthetic:
            records.write(a.write_synthetic, d)
            print(f"wrote {a.write_synthetic} (SYNTHETIC)")
    else:
        docs = []
        for path in a.json_in:
            docs.append(records.read(path))
        d = pj.merge_collectives(docs)
    v = pl.validate(d, kernels, ranks_per_gpu=a.ranks_per_gpu, target_pct=a.target, fit=a.fit)
    v["input"] = a.json_in or "generated"
    if not a.json_in and a.write_synthetic:
        v["input"] = a.write_synthetic
    print(pj.format_validation(v))
    ok = v["all_within_target"]
    if truth is not None:
        tol = 0.01 if a.noise == 0 else 0.10
        nets = [x for x in v["networks"] if x["P"] is not None] or v["networks"]
        for x in nets:
            ea = abs(x["latency_s"] / truth.latency - 1)
            eb = abs(x["bandwidth_Bps"] / truth.bandwidth - 1)
            good = ea <= tol and eb <= tol
            ok = ok and good
            verdict = "recovered" if good else "NOT recovered"
            print(f"SYNTHETIC check, fit for P={x['P']}: alpha off by {100 * ea:.2f}%, beta off by "
                  f"{100 * eb:.2f}% (tolerance {100 * tol:g}%): {verdict}")
        v["recovered"] = ok
    if a.json:
        records.write(a.json, {**records.header("project-validation", a), **v})
        print(f"wrote {a.json}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
