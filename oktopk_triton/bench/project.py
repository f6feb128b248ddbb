"""``oktopk-bench project``: which algorithm on my cluster? A cost model of one steady step of
every algorithm, from P = 2 to 1024 GPUs, for a model size, a density and a network.

    oktopk-bench project [--model bert-large | --n N] [--density 0.01] [--net 100Gbps,5us ...]
        [--world-sizes 2 4 ... 1024] [--kernels PATH|none] [--json PATH] [--plot PATH]
    oktopk-bench project --validate GPU_COLLECTIVES.json ...  (predicted against measured)

The model (what is projected, how each part is priced, what is not modeled, and how it is
validated) and the time to a loss are the library module :mod:`oktopk_triton.planning`; this
module is its command line: arguments, tables, plot and JSON.
"""
from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

from ..algorithms._wire import WIRE_FORMATS, packed
from ..planning import (MODEL_PRESETS, NET_PRESETS, _k, describe_ranges,
                        fastest_ranges, parse_net, project, ratios_from_train, resolve_kernels,
                        step_time, time_to_loss, validate)
from . import _args as A
from . import records
from ._common import resolve_algorithms

__all__ = ["add_arguments", "main", "wire_carriers", "format_table", "format_validation",
           "format_time_to_loss", "load_ratios", "plot", "merge_collectives", "run_validation",
           "baseline_rows"]


# -- CLI ------------------------------------------------------------------------------------------
def _net_arg(text: str) -> str:
    """argparse type of --net: the text, once :func:`parse_net` accepts it."""
    import argparse
    try:
        parse_net(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e))
    return text


def _ratio_arg(text: str) -> str:
    import argparse
    try:
        load_ratios([], [text])
    except SystemExit as e:
        raise argparse.ArgumentTypeError(str(e).replace("--steps-ratio: ", ""))
    return text


def add_arguments(p) -> None:
    g = p.add_mutually_exclusive_group()
    g.add_argument("--model", nargs="+", choices=sorted(MODEL_PRESETS), default=None,
                   help="model size presets (default bert-large): resnet50 25.6M, bert-large "
                        "340M, gpt2-xl 1.5B parameters")
    g.add_argument("--n", type=A.positive_int, nargs="+", default=None,
                   help="gradient lengths instead")
    p.add_argument("--density", type=A.density, default=0.01, help="k = density * n (default 0.01)")
    p.add_argument("--net", nargs="+", default=["100Gbps"], type=_net_arg,
                   help="networks: BANDWIDTH,LATENCY (e.g. 100Gbps,5us or 3GB/s,50us) or presets "
                        + ", ".join(f"{k} = {v[0]} ({v[1]})" for k, v in NET_PRESETS.items())
                        + " (default 100Gbps)")
    p.add_argument("--world-sizes", type=A.positive_int, nargs="+",
                   default=[1 << i for i in range(1, 11)], help="P values (default 2 4 ... 1024)")
    p.add_argument("--algorithms", nargs="+", default=["all"], help="default: all")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="gradient dtype: what dense allreduces (sparse values are fp32)")
    p.add_argument("--wire-format", choices=WIRE_FORMATS, default="fp32",
                   help="the sparse messages: fp32 (8 bytes an entry), compact (16-bit "
                        "relative index + bf16 value, 4 bytes), q2 / q4 (the index + a 2- or "
                        "4-bit value with per-chunk scales, 2.25 / 2.5 bytes; Ok-Topk and TopkA "
                        "only: with 'all' the others are left out)")
    p.add_argument("--sync-every", type=A.positive_int, default=1, metavar="H",
                   help="local steps: the sparse algorithms sync every H steps at --density "
                        "per sync, so their time and bytes per step divide by H (dense stays "
                        "per step)")
    p.add_argument("--overlap", action="store_true",
                   help="with --sync-every > 1: price the sync as running behind the next H "
                        "steps' compute, max(compute, sync/H) a step (the library's sync "
                        "blocks: an upper bound on what pipelining the outer step would give)")
    p.add_argument("--check-finite", choices=("skip", "off"), default="skip",
                   help="skip (default): every step allreduces a 4-byte non-finite flag")
    p.add_argument("--kernels", default=None,
                   help="kernels JSON (default: newest bench/results/kernels/gpu-kernels-*.json, "
                        "else the built-in defaults); 'none' forces the defaults")
    p.add_argument("--topkdsa-fill", type=float, default=None,
                   help="TopkDSA's largest reduced region in units of its cap (default: the fit "
                        "0.74 + 0.465 log2 P)")
    t = p.add_argument_group("time to dense's loss (step time x steps ratio)")
    t.add_argument("--steps-ratio", nargs="+", default=[], metavar="NAME=RATIO", type=_ratio_arg,
                   help="how many times dense's steps an algorithm needs to reach its final loss "
                        "(e.g. oktopk=1.98); dense is 1")
    t.add_argument("--from-train", nargs="+", default=[], metavar="JSON",
                   help="read the steps ratios from `oktopk-bench train --model gpt` reports "
                        "(their dense runs' mean validation curve)")
    t.add_argument("--compute-ms", type=A.nonneg_float, default=0.0,
                   help="forward/backward ms per step, added to every algorithm's projected "
                        "step before it is multiplied by its ratio (default 0: communication "
                        "and selection only)")
    p.add_argument("--json", type=A.out_path, default=None,
                   help="write the projection (or validation) JSON here")
    p.add_argument("--plot", type=A.out_path, default=None,
                   help="write a step time vs P plot (PNG) here")
    p.add_argument("--breakdown", action="store_true",
                   help="also print communication / selection per algorithm at each P, and keep "
                        "every call of each schedule in the JSON")
    p.add_argument("--validate", nargs="+", default=None, metavar="JSON",
                   help="validate against one-GPU NCCL collectives JSONs (e.g. the P=4 and P=8 "
                        "files of tools/gpu_check.py) instead of projecting")
    p.add_argument("--ranks-per-gpu", type=A.positive_int, default=None,
                   help="validation: ranks sharing one GPU (default from the JSON, else P)")
    p.add_argument("--fit", choices=("per-P", "global"), default="per-P",
                   help="validation: one (alpha, beta) per world size (default) or one for all")


def merge_collectives(docs: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """One collectives document from several runs (``tools/gpu_check.py`` writes one JSON per
    world size): probes and results concatenated, the rest from the first; synthetic if any is."""
    if not docs:
        raise ValueError("no collectives JSON given")
    out = dict(docs[0])
    out["probes"] = [p for d in docs for p in d.get("probes", [])]
    out["results"] = [r for d in docs for r in d.get("results", [])]
    out["synthetic"] = any(d.get("synthetic") for d in docs)
    notes = [d["note"] for d in docs if d.get("note")]
    if notes:
        out["note"] = " | ".join(dict.fromkeys(notes))
    return out


def run_validation(paths, kernels_spec: Optional[str] = None,
                   ranks_per_gpu: Optional[int] = None, json_out: Optional[str] = None,
                   fit: str = "per-P") -> int:
    paths = [paths] if isinstance(paths, str) else list(paths)
    docs = []
    for path in paths:
        docs.append(records.read(path))
    d = merge_collectives(docs)
    path = ", ".join(paths)
    kernels, note = resolve_kernels(kernels_spec, records.results_dir())
    if note:
        print("note:", note)
    v = validate(d, kernels, ranks_per_gpu=ranks_per_gpu, fit=fit)
    v = {**records.header("project-validation", {"validate": paths, "kernels": kernels_spec,
                                                 "ranks_per_gpu": ranks_per_gpu, "fit": fit}),
         **v, "input": path}
    print(format_validation(v))
    if json_out:
        _write_json(json_out, v)
    return 0 if v["all_within_target"] else 1


def _write_json(path: str, obj: Any) -> None:
    records.write(path, obj)
    print(f"wrote {path}")


def wire_carriers(algs: Sequence[str], wire_format: str,
                  named: bool) -> Tuple[List[str], List[str]]:
    """(the algorithms to price on ``wire_format``, those left out). Dense ignores the wire; a
    sparse algorithm that refuses it (:meth:`Algorithm.check_wire`, its constructor's check) is
    left out of ``all``, and when ``named`` on the command line exits with that one line."""
    from ..algorithms import get_algorithm
    kept, left_out = [], []
    for a in algs:
        try:
            if a != "dense":
                get_algorithm(a).check_wire(wire_format)
            kept.append(a)
        except ValueError as e:
            if named:
                raise SystemExit(f"oktopk-bench project: {e}")
            left_out.append(a)
    return kept, left_out


def baseline_rows(rows: List[Dict[str, Any]], names: Iterable[str], n: int, density: float,
                  net, kernels) -> List[Dict[str, Any]]:
    """Steps for the baselines a train report can carry, so their time to a loss is priced too:
    ``bf16`` is dense's ring allreduce of 2-byte words; ``powersgd`` (rank matched to Ok-Topk's
    bytes, as the train CLI runs it) two ring allreduces (P and Q) sending what Ok-Topk's step
    sends, its matmuls and orthogonalisation not priced (a lower bound)."""
    out = []
    for r in rows:
        if "bf16" in names and r["algorithm"] == "dense":
            b = step_time("dense", n, density, r["P"], net, kernels, dtype="bf16")
            out.append({key: v for key, v in b.items() if key != "collectives"}
                       | {"algorithm": "bf16"})
        if "powersgd" in names and r["algorithm"] == "oktopk":
            P, sent = r["P"], r["bytes_per_rank"]
            comm = 4 * (P - 1) * net.latency + sent / net.bandwidth
            out.append({"algorithm": "powersgd", "P": P, "n": n, "k": r["k"],
                        "comm_ms": 1e3 * comm, "select_ms": 0.0, "step_ms": 1e3 * comm,
                        "bytes_per_rank": sent, "messages": 4 * (P - 1), "calls": 2})
    return out


def _print_time_to_loss(rows, ratios: Dict[str, float], compute_ms: float,
                        algs: Sequence[str]) -> List[Dict[str, Any]]:
    missing = sorted(a for a in ratios if a not in algs and a not in ("bf16", "powersgd"))
    if "powersgd" in ratios and "oktopk" not in algs:
        missing.append("powersgd (priced at Ok-Topk's bytes: needs oktopk among --algorithms)")
    ttl = time_to_loss(rows, ratios, compute_ms)
    print(format_time_to_loss(
        ttl, f"time to a loss: (step{f' + {compute_ms:g} ms compute' if compute_ms else ''}) x "
             f"steps ratio, ms per dense step of progress; * = first"))
    if missing:
        print(f"(no projected step for {', '.join(missing)}: ratio given, not priced)")
    if "powersgd" in ratios and "oktopk" in algs:
        print("(powersgd: two ring allreduces of Ok-Topk's bytes; its matmuls not priced)")
    return ttl


def main(args) -> int:
    if args.validate:
        return run_validation(args.validate, args.kernels, args.ranks_per_gpu, args.json,
                              args.fit)
    if not 0 < args.density <= 1:
        raise SystemExit("--density must be in (0, 1]")
    if any(P < 2 for P in args.world_sizes):
        raise SystemExit("--world-sizes: every P must be >= 2")
    if args.overlap and args.sync_every < 2:
        raise SystemExit("--overlap: expected --sync-every H with H >= 2 (only a sync every H "
                         "steps can run behind the next steps' compute)")
    algs, _ = resolve_algorithms(args.algorithms, "project", implemented=False)
    algs, left_out = wire_carriers(algs, args.wire_format,
                                   named="all" not in [a.lower() for a in args.algorithms])
    nets = [parse_net(x) for x in args.net]
    if args.n:
        models = [(f"n={n}", n) for n in args.n]
    else:
        models = [(m, MODEL_PRESETS[m]) for m in (args.model or ["bert-large"])]
    kernels, note = resolve_kernels(args.kernels, records.results_dir())
    Ps = sorted(set(args.world_sizes))
    ratios = (load_ratios(args.from_train, args.steps_ratio, args.density)
              if args.from_train or args.steps_ratio else None)
    print("PROJECTED (a cost model, not a measurement): one steady step = communication + "
          "selection kernels; dense compute (forward/backward) excluded")
    print(f"kernels: {kernels.source} ({kernels.device})" + (f"  [{note}]" if note else ""))
    if left_out:
        print(f"(--wire-format {args.wire_format}: {', '.join(left_out)} left out, they do not "
              f"implement it)")
    cases = []
    for model, n in models:
        for net in nets:
            rows = project(n, args.density, Ps, net, kernels, algs,
                           sync_every=args.sync_every, overlap=args.overlap,
                           check_finite=args.check_finite, dtype=args.dtype,
                           topkdsa_fill=args.topkdsa_fill, wire_format=args.wire_format)
            ranges = fastest_ranges(rows)
            local = (f", sparse syncing every {args.sync_every} steps"
                     + (" (overlapped)" if args.overlap else "")
                     if args.sync_every > 1 else "")
            wire = f", {args.wire_format} wire" if packed(args.wire_format) else ""
            title = (f"\n{model} (n = {n:,}), density {args.density:g} "
                     f"(k = {_k(n, args.density):,}){wire}{local}, "
                     f"{net.describe()}; step ms (* = fastest)")
            print(format_table(rows, title))
            print("fastest: " + describe_ranges(ranges))
            ttl = (_print_time_to_loss(rows + baseline_rows(rows, ratios, n, args.density, net,
                                                            kernels),
                                       ratios, args.compute_ms, algs) if ratios else None)
            if args.breakdown:
                for r in rows:
                    print(f"  P={r['P']:<5d} {r['algorithm']:10s} comm {r['comm_ms']:10.3f} ms  "
                          f"select {r['select_ms']:8.3f} ms  {r['bytes_per_rank'] / 1e6:10.3f} MB  "
                          f"{r['messages']:5d} msgs")
            if not args.breakdown:       # the per-call lists only on request (JSON size)
                rows = [{key: v for key, v in r.items() if key != "collectives"} for r in rows]
            cases.append({"model": model, "n": n, "density": args.density,
                          "net": {"name": net.name, "bandwidth_Bps": net.bandwidth,
                                  "latency_s": net.latency, "describe": net.describe()},
                          "rows": rows, "fastest": ranges, "time_to_loss": ttl,
                          "steps_ratios": ratios, "compute_ms": args.compute_ms})
    device = "none: a projection on " + (os.uname().machine if hasattr(os, "uname")
                                         else "this machine") + " CPU"
    report = {**records.header("project", args, device=device), "projected": True,
              "model_of": "one steady step: communication (schedules priced on alpha/beta) + "
                          "selection kernels; dense compute excluded",
              "kernels": dataclasses.asdict(kernels), "dtype": args.dtype,
              "check_finite": args.check_finite, "topkdsa_fill": args.topkdsa_fill,
              "wire_format": args.wire_format, "sync_every": args.sync_every,
              "overlap": args.overlap,
              "world_sizes": Ps, "cases": cases}
    if args.json:
        _write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
        print(f"wrote {args.plot}")
    return 0


# -- output ---------------------------------------------------------------------------------------
def _fmt_ms(x: float) -> str:
    if x >= 100:
        return f"{x:.0f}"
    if x >= 10:
        return f"{x:.1f}"
    return f"{x:.2f}"


def format_table(rows: List[Dict[str, Any]], title: str = "") -> str:
    algs = list(dict.fromkeys(r["algorithm"] for r in rows))
    Ps = sorted({r["P"] for r in rows})
    by = {(r["P"], r["algorithm"]): r for r in rows}
    best = {P: min((by[(P, a)] for a in algs if (P, a) in by), key=lambda r: r["step_ms"])
            for P in Ps}

    def cell(a):
        return lambda P: "-" if (P, a) not in by else \
            _fmt_ms(by[(P, a)]["step_ms"]) + ("*" if by[(P, a)] is best[P] else "")

    def vs_dense(P):
        d = by.get((P, "dense"))
        return f"{d['step_ms'] / best[P]['step_ms']:.1f}x" if d else "-"
    cols = ([("P", str)] + [(a, cell(a)) for a in algs]
            + [("fastest", lambda P: best[P]["algorithm"]), ("vs dense", vs_dense)])
    table = records.table(Ps, cols, left=0, sep="  ")
    return f"{title}\n{table}" if title else table


def plot(report: Dict[str, Any], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    cases = report["cases"]
    ncols = min(len(cases), 2 if len(cases) == 4 else 3)
    nrows = -(-len(cases) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.2 * ncols, 4.6 * nrows), squeeze=False)
    for ax in axes.flat[len(cases):]:
        ax.axis("off")
    for ax, case in zip(axes.flat, cases):
        rows = case["rows"]
        for a in dict.fromkeys(r["algorithm"] for r in rows):
            rs = sorted((r for r in rows if r["algorithm"] == a), key=lambda r: r["P"])
            ax.plot([r["P"] for r in rs], [r["step_ms"] for r in rs], marker="o", ms=3,
                    label=a, lw=2.2 if a in ("dense", "oktopk") else 1.4)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs P")
        ax.set_title(f"{case['model']} (n={case['n']:.3g}), density {case['density']:g}\n"
                     f"{case['net']['describe']}", fontsize=9)
        ax.set_ylabel("step ms (communication + selection)", fontsize=8)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"PROJECTED, not measured (oktopk-bench project, kernels: "
                 f"{os.path.basename(report['kernels']['source'])}); dense compute excluded",
                 fontsize=10)
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


_VALIDATION_COLUMNS = [
    ("algorithm", lambda r: r["algorithm"]), ("P", lambda r: r["P"]), ("n", lambda r: r["n"]),
    ("measured ms", lambda r: f"{r['measured_ms']:.2f}"),
    ("predicted ms", lambda r: f"{r['predicted_ms']:.2f}"),
    ("error", lambda r: f"{r['error_pct']:+.1f}%"), ("comm ms", lambda r: f"{r['comm_ms']:.2f}"),
    ("select ms", lambda r: f"{r['select_ms']:.2f}"),
    ("MB sched", lambda r: f"{r['schedule_mb']:.3f}"),
    ("MB meas", lambda r: "-" if r["measured_mb"] is None else f"{float(r['measured_mb']):.3f}")]


def format_validation(v: Dict[str, Any]) -> str:
    lines = []
    banner = "*** SYNTHETIC INPUT: generated from a known network, NOT a measurement ***"
    if v["synthetic"]:
        src = v.get("synthetic_from") or {}
        lines += [banner, f"    (generated with beta={src.get('bandwidth_Bps', 0) / 1e9:.4g} GB/s, "
                          f"alpha={src.get('latency_s', 0) * 1e6:.4g} us, noise "
                          f"{100 * src.get('noise', 0):g}%)"]
    elif v.get("note"):
        lines.append(f"input note: {v['note']}")
    for net in v["networks"]:
        if v["fit"] == "per-P" and net["P"] is None:
            continue
        which = "all P" if net["P"] is None else f"P={net['P']}"
        fb = " (too few points at this P: the global fit)" if net["fallback_to_global"] else ""
        lines.append(f"fitted for {which}: beta = {net['bandwidth_Bps'] / 1e9:.4g} GB/s per rank, "
                     f"alpha = {net['latency_s'] * 1e6:.4g} us per message{fb}")
        for p in net["points"]:
            lines.append(f"  fit point P={p['P']:<3d} {p['what']:<28s} measured "
                         f"{p['measured_ms']:9.3f} ms  model {p['fitted_ms']:9.3f} ms  "
                         f"({p['error_pct']:+.1f}%)")
    lines.append(f"kernels: {v['kernels']['source']} ({v['kernels']['device']})")
    rows = sorted(v["rows"], key=lambda r: (r["P"], r["algorithm"]))
    lines.append(records.table(rows, _VALIDATION_COLUMNS, left=0, sep="  "))
    ok = "all within" if v["all_within_target"] else "NOT all within"
    lines.append(f"{ok} {v['target_pct']:g}% of the measurement")
    if v["synthetic"]:
        lines.append(banner)
    return "\n".join(lines)


def load_ratios(paths: List[str], pairs: List[str],
                density: Optional[float] = None) -> Dict[str, float]:
    """``--from-train`` reports (their runs at ``density``), then ``--steps-ratio NAME=R``
    pairs (later ones win)."""
    ratios: Dict[str, float] = {}
    for p in paths:
        try:
            report = records.read(p)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--from-train {p}: cannot read a train report ({e})")
        try:
            ratios.update({a: r["ratio"]
                           for a, r in ratios_from_train(report, density).items()})
        except ValueError as e:
            raise SystemExit(f"--from-train {p}: {e}")
    for pair in pairs:
        name, sep, val = pair.partition("=")
        try:
            r = float(val)
        except ValueError:
            r = -1.0
        if not sep or not name or not r > 0:
            raise SystemExit(f"--steps-ratio: expected NAME=RATIO with RATIO > 0 (e.g. "
                             f"oktopk=1.98), got {pair!r}")
        ratios[name.lower()] = r
    ratios.setdefault("dense", 1.0)
    return ratios


def format_time_to_loss(rows: List[Dict[str, Any]], title: str) -> str:
    algs = list(dict.fromkeys(r["algorithm"] for r in rows))
    Ps = sorted({r["P"] for r in rows})
    by = {(r["P"], r["algorithm"]): r for r in rows}
    def cell(a):
        return lambda P: f"{by[(P, a)]['time_ms']:.1f}" + ("*" if by[(P, a)]["first"] else "")

    def first(P):
        return next((a for a in reversed(algs) if by[(P, a)]["first"]), "-")
    cols = ([("P", str)] + [(f"{a} (x{by[(Ps[0], a)]['ratio']:.2f})", cell(a)) for a in algs]
            + [("first", first)])
    return f"{title}\n" + records.table(Ps, cols, left=0, sep="  ")


if __name__ == "__main__":  # python -m oktopk_triton.bench.project: the CLI's checked path
    from ..cli import main as _cli_main
    raise SystemExit(_cli_main(["project", *sys.argv[1:]]))
