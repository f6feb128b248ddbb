"""Merge ``oktopk-bench train --model gpt`` runs into one results file, and print its tables.

    python -m tools.research.lm_results merge OUT.json PART.json [PART.json ...]
    python -m tools.research.lm_results tables bench/results/lm/lm-cpu-2026-11-23.json
    python -m tools.research.lm_results movement dense=A.json:dense oktopk=B.json:oktopk ...
    python -m tools.research.lm_results ablation OUT.json LABEL=PART.json[:algorithm[:seed]] ...
    python -m tools.research.lm_results plot OUT.png MERGED.json [LABEL=PART.json:algorithm ...]

A campaign is several launches (one per density and group of algorithms, so that a failure or
the time budget only costs what it was running). Dense does not depend on the density, so its
runs are the baseline of every density. ``merge`` keeps every run once (by algorithm, density
and seed; a later part replaces an earlier one), checks that the parts trained the same model on
the same corpus with the same schedule, summarises per density with ``report.summarize`` and
records the per-layer starvation table, in one result record (oktopk_triton.bench.records).
``tables`` prints the markdown the README quotes: final validation loss per algorithm and
density with the relative gap to dense, and where Ok-Topk spends its entries layer by layer.
"""
from __future__ import annotations

import math
import os
import re
import sys
from typing import Any, Dict, List

from oktopk_triton.bench import records
from oktopk_triton.bench.baselines import BASELINES
from oktopk_triton.bench.report import summarize
from oktopk_triton.planning import ratios_from_train

# config keys that must agree between parts (density, algorithms, seeds may differ)
SAME = ("model", "size", "gpt", "steps", "batch_size", "lr", "optimizer", "betas", "schedule",
        "warmup_fraction", "val_fraction", "eval_sequences", "eval_every", "world_size",
        "momentum_correction", "weight_decay", "options", "reduce")
# stats curves worth keeping in the merged file (the rest are in the parts)
KEEP_STATS = ("global_selected", "local_selected", "sent", "overflow", "reduce_overflow",
              "gather_overflow", "global_count", "collectives", "kernel_launches")
# Ok-Topk's goals per density: final validation loss within pct % of dense's, steps ratio at most
# ratio (1200 / the step at which dense's mean curve reaches its final loss); None: no goal
GOALS = {0.01: {"pct": 3.0, "ratio": 1.3}, 0.001: {"pct": None, "ratio": 2.0}}


def layer_kind(name: str) -> str:
    """``blocks.3.qkv.weight`` -> ``qkv.weight``: the same tensor in every block, one row."""
    return re.sub(r"^blocks\.\d+\.", "", name)


def merge(out_path: str, parts: List[str]) -> Dict[str, Any]:
    reports = [records.read(p) for p in parts]
    base = reports[0]
    for p, r in zip(parts, reports):
        for key in SAME:
            if r["config"].get(key) != base["config"].get(key):
                raise SystemExit(f"{p}: config {key}={r['config'].get(key)!r} differs from "
                                 f"{parts[0]}'s {base['config'].get(key)!r}")
        if r.get("corpus", {}).get("sha256") != base.get("corpus", {}).get("sha256"):
            raise SystemExit(f"{p}: a different corpus")
    failures = [f for r in reports for f in r.get("failures", [])]
    runs = records.merge((_part_run(r, run) for r in reports for run in r["runs"]),
                         key=lambda x: (x["algorithm"], x["density"], x["seed"]))
    runs_l = sorted(runs, key=lambda x: (x["density"] != 1.0, -x["density"],
                                         x["algorithm"], x["seed"]))
    densities = sorted({x["density"] for x in runs if x["density"] != 1.0}, reverse=True)
    algo_order: List[str] = []
    for r in reports:      # a merged file given as a part has no algorithm list: its runs'
        for a in r["config"].get("algorithms") or [x["algorithm"] for x in r["runs"]]:
            if a not in algo_order:
                algo_order = algo_order + [a]
    summary, layers = {}, {}
    for d in densities:
        sel = [x for x in runs_l if x["density"] in (d, 1.0)]
        algs = [a for a in algo_order if any(x["algorithm"] == a for x in sel)]
        summary[f"{d:g}"] = summarize(sel, algs, [])
        layers[f"{d:g}"] = layer_table(sel)
    cfg = {k: base["config"].get(k) for k in SAME}
    cfg["densities"] = densities
    first = runs_l[0] if runs_l else {}
    dev = str(first.get("device", "?"))
    device = base.get("device") if "host" not in base else (
        (f"cpu ({base['host'].get('cpus')} cores, shared with other jobs)"
         if dev.startswith("cpu") else dev) + f", {first.get('backend', '?')}")
    report = {
        **records.header("lm-merge", {"parts": parts}, device=device),
        "what": f"byte-level GPT on the Python stdlib's .py files, {cfg['world_size']} ranks: "
                "final validation loss (nats/byte) of every algorithm against dense",
        "part_commits": _all_of(reports),
        "part_date": max(str(r.get("part_date") or r.get("date") or "")[:10] for r in reports),
        "corpus": base.get("corpus"), "config": cfg, "parts": _part_names(parts, reports),
        "wall_s": sum(r.get("wall_s", 0.0) for r in reports), "failures": failures,
        "goals": {f"{k:g}": v for k, v in GOALS.items()},
        "summary": summary, "layers": layers, "runs": runs_l,
    }
    records.write(out_path, report, compact=True)
    return report


def _part_run(report: dict, run: dict) -> dict:
    """A part's run as the merge keeps it: its density, and only the stats worth keeping."""
    run = dict(run)
    if run["algorithm"] in BASELINES and run["density"] == 1.0 and \
            "density" in report["config"]:
        # early baseline runs recorded 1.0; they belong to the density they match
        run["density"] = report["config"]["density"]
    run["stats_curve"] = {k: v for k, v in run.get("stats_curve", {}).items() if k in KEEP_STATS}
    return run


def _all_of(reports: List[dict]) -> List[str]:
    """Every commit (``-dirty`` marked) the parts came from: a merged part's own part_commits."""
    vals = set()
    for r in reports:
        if r.get("part_commits"):
            vals.update(r["part_commits"])
            continue
        commits = r["commit"] if isinstance(r.get("commit"), list) else [r.get("commit")]
        vals.update(f"{c}-dirty" if r.get("dirty") and c else c for c in commits)
    return sorted(vals - {None})


def _part_names(parts: List[str], reports: List[dict]) -> List[str]:
    """The files merged, each once: a merged file given as a part contributes its own parts'."""
    names = [q for p, r in zip(parts, reports) for q in (r.get("parts") or [os.path.basename(p)])]
    return list(dict.fromkeys(names))


def layer_table(runs: List[dict]) -> Dict[str, Dict[str, Dict[str, float]]]:
    """Per algorithm and layer kind (mean over seeds): the fraction of the kind's entries applied
    per step, the fraction of (tensor, step) pairs with nothing applied, the kind's share of all
    applied entries and of the parameters, and the reduced update's squared norm over the local
    gradient's (how much of the layer's gradient got through, error feedback included)."""
    out: Dict[str, Dict[str, Dict[str, float]]] = {}
    for alg in sorted({r["algorithm"] for r in runs}):
        rs = [r for r in runs if r["algorithm"] == alg and r.get("layers")]
        if not rs:
            continue
        acc: Dict[str, Dict[str, float]] = {}
        for r in rs:
            tot_applied = sum(L["applied_per_step"] for L in r["layers"].values())
            tot_numel = sum(L["numel"] for L in r["layers"].values())
            for name, L in r["layers"].items():
                a = acc.setdefault(layer_kind(name), dict(numel=0, applied=0.0, starved=0.0,
                                                          tensors=0, sq_local=0.0, sq_red=0.0))
                a["numel"] += L["numel"] / len(rs)
                a["applied"] += L["applied_per_step"] / len(rs)
                a["starved"] += L["starved_steps"] / r["steps"] / len(rs)
                a["tensors"] += 1 / len(rs)
                a["sq_local"] += L["grad_sq_local"] / len(rs)
                a["sq_red"] += L["grad_sq_reduced"] / len(rs)
                a["_tot_applied"] = tot_applied
                a["_tot_numel"] = tot_numel
        out[alg] = {k: dict(numel=int(round(a["numel"])),
                            applied_fraction=a["applied"] / max(1.0, a["numel"]),
                            starved_fraction=a["starved"] / max(1.0, a["tensors"]),
                            share_of_applied=a["applied"] / max(1e-9, a["_tot_applied"]),
                            share_of_params=a["numel"] / max(1, a["_tot_numel"]),
                            reduced_over_local=a["sq_red"] / max(1e-30, a["sq_local"]))
                    for k, a in acc.items()}
    return out


def tables(path: str) -> str:
    d = records.read(path)
    c, corpus = d["config"], d.get("corpus") or {}
    g = c["gpt"]
    n = next(iter(d["summary"].values()))[0]["numel"]
    lines = [f"`{os.path.basename(path)}`: GPT ({n:,} parameters: d {g['d_model']}, "
             f"{g['n_layer']} layers, {g['n_head']} heads, context {g['context']}), "
             f"{c['world_size']} ranks ({d.get('device')}), {c['steps']} steps of "
             f"{c['batch_size']} x "
             f"{g['context']} bytes per rank, {c['optimizer']} lr {c['lr']:g}; corpus "
             f"{corpus.get('files')} stdlib files of Python {corpus.get('python')} "
             f"({corpus.get('train_bytes', 0) / 1e6:.1f} MB train, "
             f"{corpus.get('val_bytes', 0) / 1e6:.2f} MB validation, by file); unigram "
             f"entropy {corpus.get('unigram_nats_per_byte', float('nan')):.3f} nats/byte. "
             f"{d.get('part_date') or d.get('date')}.", ""]
    for dens, rows in d["summary"].items():
        goal = d.get("goals", {}).get(dens) or {}
        k = rows[0].get('k') if rows[0]['algorithm'] != 'dense' else round(float(dens) * n)
        goals = ([f"within {goal['pct']:g}% of dense"] if goal.get("pct") else []) + \
            ([f"steps ratio at most {goal['ratio']:g}"] if goal.get("ratio") else [])
        goal_text = f"; goal: Ok-Topk {' and '.join(goals)}" if goals else ""
        lines += [f"Density {float(dens) * 100:g}% (k = {k:,} per step){goal_text}:", ""]
        sel = [x for x in d.get("runs", []) if x.get("density") in (float(dens), 1.0)]
        try:
            ratios = ratios_from_train({"runs": sel})
        except ValueError:
            ratios = {}
        lines += [records.table(rows, _summary_columns(ratios), markdown=True), ""]
    lines += layer_markdown(d)
    return "\n".join(lines)


def _summary_columns(ratios: Dict[str, Any]):
    """The columns of a density's summary table; a failed run: 0 seeds, ``failed``, no more."""
    def ok(cell):
        return lambda r: cell(r) if r.get("status") == "ok" else ""

    def ratio(r):
        x = ratios.get(r["algorithm"], {}).get("ratio")
        return "-" if x is None else f"{x:.2f}"
    return [("algorithm", lambda r: r["algorithm"]),
            ("seeds", lambda r: r["n_seeds"] if r.get("status") == "ok" else 0),
            ("val loss nats/byte (mean ± sd)", lambda r: f"{r['final_val_loss']:.4f} ± "
             f"{r['final_val_loss_std']:.4f}" if r.get("status") == "ok" else "failed"),
            ("bits/byte", ok(lambda r: f"{r['final_val_bpb']:.3f}")),
            ("vs dense", ok(lambda r: f"{r.get('loss_vs_dense_pct', 0.0):+.2f}%")),
            ("vs dense per seed", ok(lambda r: ", ".join(
                f"{x:+.1f}" for x in r.get("loss_vs_dense_pct_per_seed", [])))),
            ("applied/step", ok(lambda r: f"{r['applied_per_step']:,.0f}")),
            ("bytes/rank/step", ok(lambda r: f"{r['bytes_per_step'] / 1e3:,.1f} kB")),
            ("vs dense bytes", ok(lambda r: f"{r.get('bytes_vs_dense', float('nan')):.4f}")),
            ("time/step ms", ok(lambda r: f"{r['time_per_step_ms']:.0f}")),
            ("steps ratio", ok(ratio))]


def layer_markdown(d: Dict[str, Any], algs=("dense", "oktopk")) -> List[str]:
    out = []
    for dens, per_alg in d.get("layers", {}).items():
        for alg in algs:
            if alg == "dense" or alg not in per_alg:
                continue
            L = per_alg[alg]
            out += [f"Where {alg} spends its entries at density {float(dens) * 100:g}% (mean over "
                    "seeds; applied = entries of the reduced gradient that are nonzero; starved = "
                    "tensor-steps with none; energy = ‖reduced‖² / ‖local gradient‖², summed "
                    "over steps):", ""]
            dense = per_alg.get("dense", {})

            def energy(kv):
                de = dense.get(kv[0], {}).get("reduced_over_local")
                return f"{kv[1]['reduced_over_local']:.3f}" + (f" (dense {de:.3f})" if de else "")
            cols = [("tensor kind", lambda kv: kv[0]), ("params", lambda kv: f"{kv[1]['numel']:,}"),
                    ("share of params", lambda kv: f"{100 * kv[1]['share_of_params']:.1f}%"),
                    ("share of applied", lambda kv: f"{100 * kv[1]['share_of_applied']:.1f}%"),
                    ("applied per step / numel", lambda kv: f"{kv[1]['applied_fraction']:.5f}"),
                    ("starved steps", lambda kv: f"{100 * kv[1]['starved_fraction']:.0f}%"),
                    ("energy through", energy)]
            kinds = sorted(L.items(), key=lambda kv: -kv[1]["numel"])
            out += [records.table(kinds, cols, markdown=True), ""]
    return out


def movement(labelled: List[str]) -> str:
    """``LABEL=FILE.json[:ALGORITHM]`` ...: per tensor kind, |w_end - w_0| (the norm over the
    kind's tensors, mean over the file's runs of that algorithm), one column per label: whether
    a gap comes from weights that did not move or from weights that moved the wrong way."""
    cols, finals = {}, {}
    for item in labelled:
        label, spec = item.split("=", 1)
        path, _, sel = spec.partition(":")
        alg, _, seed = sel.partition(":")
        rs = [r for r in records.read(path)["runs"] if not alg or r["algorithm"] == alg]
        rs = [r for r in rs if all("moved_sq" in L for L in r.get("layers", {}).values())]
        if not rs:
            raise SystemExit(f"{item}: no run with movement records")
        acc: Dict[str, float] = {}
        for r in rs:
            per: Dict[str, float] = {}
            for name, L in r["layers"].items():
                per[layer_kind(name)] = per.get(layer_kind(name), 0.0) + L["moved_sq"]
            for k, v in per.items():
                acc[k] = acc.get(k, 0.0) + math.sqrt(v) / len(rs)
        cols[label] = acc
        finals[label] = sum(r["final_val_loss"] for r in rs) / len(rs)
    labels = list(cols)
    kinds = list(next(iter(cols.values())))
    out = ["| tensor kind | " + " | ".join(labels) + " |", "|---|" + "---|" * len(labels)]
    for k in kinds:
        out.append(f"| {k} | " + " | ".join(f"{cols[lb].get(k, float('nan')):.2f}"
                                             for lb in labels) + " |")
    out.append("| final val loss | " + " | ".join(f"{finals[lb]:.3f}" for lb in labels) + " |")
    return "\n".join(out)


# config keys an ablation's runs may differ in (the rest must agree, as for merge)
ABLATION_KEYS = ("density", "lr", "reduce", "steps", "options")


def ablation(out_path: str, labelled: List[str]) -> str:
    """Single runs with different settings (reduce mode, density, lr, ...) side by side: one
    compact file (final and curve of the validation loss, bytes, applied entries, the settings
    that differ) and a markdown table."""
    rows, base = [], None
    for item in labelled:
        label, _, spec = item.partition("=")
        path, _, sel = spec.partition(":")
        alg, _, seed = sel.partition(":")
        d = records.read(path)
        cfg = d["config"]
        same = {k: cfg.get(k) for k in SAME if k not in ABLATION_KEYS}
        if base is None:
            base = same
        elif same != base:
            diff = sorted(k for k in same if same[k] != base.get(k))
            raise SystemExit(f"{path}: differs from the first part in {diff}")
        for r in d["runs"]:
            if (alg and r["algorithm"] != alg) or (seed and r["seed"] != int(seed)):
                continue
            # records before the per-run "reduce" field: the config's mode applied to every run
            mode = r.get("reduce") or ("updates" if cfg.get("reduce") == "updates"
                                       else "gradients")
            rows.append({"label": label, "file": os.path.basename(path),
                         "algorithm": r["algorithm"], "seed": r["seed"],
                         "reduce": mode,
                         "density": r["density"], "lr": cfg.get("lr"), "steps": r["steps"],
                         "final_val_loss": r["final_val_loss"], "val_curve": r["val_curve"],
                         "bytes_per_step": r["bytes_per_step"],
                         "applied_per_step": sum(r["applied_curve"]) / len(r["applied_curve"]),
                         "moved": (math.sqrt(sum(L["moved_sq"] for L in r["layers"].values()))
                                   if all("moved_sq" in L for L in r["layers"].values())
                                   else None)})
    records.write(out_path, {**records.header("lm-ablation", {"runs": labelled}),
                             "config": base, "runs": rows})
    cols = [("run", lambda r: r["label"]), ("algorithm", lambda r: r["algorithm"]),
            ("reduce", lambda r: r["reduce"]), ("density", lambda r: f"{r['density']:g}"),
            ("lr", lambda r: f"{r['lr']:g}"), ("seed", lambda r: r["seed"]),
            ("val loss nats/byte", lambda r: f"{r['final_val_loss']:.4f}"),
            ("bytes/rank/step", lambda r: f"{r['bytes_per_step'] / 1e3:,.1f} kB"),
            ("applied/step", lambda r: f"{r['applied_per_step']:,.0f}"),
            ("‖w_end − w_0‖", lambda r: "n/a" if r["moved"] is None else f"{r['moved']:.2f}")]
    return records.table(rows, cols, markdown=True)


def plot(out_png: str, merged: str, extra: List[str] = ()) -> None:
    """Validation loss against step, one panel per density: each algorithm's mean curve over
    its seeds, dense's on every panel, plus ``LABEL=PART.json:algorithm`` curves (ablations)
    on the panel of their density."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from oktopk_triton.planning import mean_curve
    d = records.read(merged)
    runs = d.get("runs", [])
    dens = sorted({float(x) for x in d["summary"]}, reverse=True)
    fig, axes = plt.subplots(1, len(dens), figsize=(6.5 * len(dens), 5.5), squeeze=False)
    for ax, de in zip(axes[0], dens):
        algs = dict.fromkeys(r["algorithm"] for r in runs)
        for k, alg in enumerate(algs):
            sel = [r for r in runs if r["algorithm"] == alg
                   and (alg == "dense" or abs(r.get("density", 1.0) - de) < 1e-12)]
            curve = mean_curve(sel)
            if curve is None:
                continue
            ax.plot(curve[0], curve[1], marker="os^vD<>"[k % 7], markersize=3,
                    color=f"C{k % 10}",     # one colour per algorithm on every panel
                    label=f"{alg} ({len(sel)} seed{'s' if len(sel) > 1 else ''})")
        for item in extra:
            label, spec = item.split("=", 1)
            path, alg = spec.rsplit(":", 1)
            part = records.read(path)
            sel = [r for r in part.get("runs", []) if r["algorithm"] == alg
                   and abs(part["config"]["density"] - de) < 1e-12]
            curve = mean_curve(sel)
            if curve is not None:
                ax.plot(curve[0], curve[1], linestyle="--", label=label)
        ax.set(title=f"density {de * 100:g}%", xlabel="step",
               ylabel="validation loss (nats/byte)", ylim=(1.2, 3.2))
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3,
                  frameon=False)     # below the panel: no curve hidden
    c = d["config"]
    fig.suptitle(f"byte-level GPT, {c['world_size']} ranks, {c['steps']} steps "
                 f"({d.get('date')}, {d.get('device')})", fontsize=10)
    fig.tight_layout()
    fig.savefig(out_png, dpi=110)


def main(argv: List[str]) -> int:
    if len(argv) >= 3 and argv[0] == "plot":
        plot(argv[1], argv[2], argv[3:])
        return 0
    if len(argv) >= 3 and argv[0] == "ablation":
        print(ablation(argv[1], argv[2:]))
        return 0
    if len(argv) >= 2 and argv[0] == "movement":
        print(movement(argv[1:]))
        return 0
    if len(argv) >= 3 and argv[0] == "merge":
        merge(argv[1], argv[2:])
        print(tables(argv[1]))
        return 0
    if len(argv) == 2 and argv[0] == "tables":
        print(tables(argv[1]))
        return 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
