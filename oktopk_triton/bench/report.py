"""What ``oktopk-bench train`` reports: the per-algorithm summary over seeds
(:func:`summarize`), its table (:func:`format_table`) and the plot of the metric and the
communication volume per step (:func:`plot`)."""
from __future__ import annotations

import math
import os
from typing import Any, Dict, List

from . import records
from ._common import fmt_bytes as _fmt_bytes


def _conservation(rs: List[dict]) -> Dict[str, Any]:
    """Over an algorithm's runs: how many had their conservation checked (ledger.py) and the
    largest relative error among them (None when none was checked)."""
    checked = [r["conservation"] for r in rs if (r.get("conservation") or {}).get("checked")]
    return {"conservation_checked": len(checked),
            "conservation_max_rel_error": max((c["relative_error"] for c in checked),
                                              default=None)}


def _mean_of(rs: List[dict], key: str):
    """The mean of ``key`` over the runs that have it (records from before it: None)."""
    vals = [r[key] for r in rs if r.get(key) is not None]
    return sum(vals) / len(vals) if vals else None


def summarize(runs: List[dict], algos: List[str], failures: List[dict]) -> List[dict]:
    """One row per algorithm: mean and sample sd over seeds of the final metric (test accuracy
    for the digits, validation loss for the LM), bytes and time per step, and the comparison
    with dense (points of accuracy; relative loss gap in percent for the LM)."""
    rows = []
    for alg in algos:
        rs = [r for r in runs if r["algorithm"] == alg]
        if not rs:
            rows.append({"algorithm": alg, "status": "failed", "n_seeds": 0})
            continue
        lm = "final_val_loss" in rs[0]
        key = "final_val_loss" if lm else "final_test_acc"
        vals = [r[key] for r in rs]
        m = sum(vals) / len(vals)
        sd = math.sqrt(sum((a - m) ** 2 for a in vals) / (len(vals) - 1)) if len(vals) > 1 else 0.0
        row = {"algorithm": alg, "status": "ok", "n_seeds": len(rs),
               "seeds": [r["seed"] for r in rs],
               key: m, key + "_std": sd, key + "_per_seed": vals,
               "final_train_loss": sum(r["final_train_loss"] for r in rs) / len(rs),
               "bytes_per_step": sum(r["bytes_per_step"] for r in rs) / len(rs),
               "time_per_step_ms": sum(r["time_per_step_ms"] for r in rs) / len(rs),
               "reduce_ms": sum(r["reduce_ms"] for r in rs) / len(rs),
               "optimizer_ms": _mean_of(rs, "optimizer_ms"),
               "numel": rs[0]["numel"], "k": rs[0]["k"],
               "replicas_identical": all(r["replicas_identical"] for r in rs),
               **_conservation(rs)}
        if lm:
            row["final_val_bpb"] = m / math.log(2)
            row["applied_per_step"] = (sum(sum(r["applied_curve"]) / len(r["applied_curve"])
                                           for r in rs) / len(rs))
        rows.append(row)
    dense = next((r for r in rows if r["algorithm"] == "dense" and r["status"] == "ok"), None)
    for r in rows:
        if r["status"] == "ok" and dense is not None:
            if "final_val_loss" in r:
                r["loss_vs_dense_pct"] = 100.0 * (r["final_val_loss"] / dense["final_val_loss"] - 1)
                # paired over the seeds both ran (same init and batches): the gap's spread
                common = [s for s in r["seeds"] if s in dense["seeds"]]
                gaps = [100.0 * (r["final_val_loss_per_seed"][r["seeds"].index(s)] /
                                 dense["final_val_loss_per_seed"][dense["seeds"].index(s)] - 1)
                        for s in common]
                r["loss_vs_dense_pct_per_seed"] = gaps
            else:
                r["acc_vs_dense_points"] = 100.0 * (r["final_test_acc"] - dense["final_test_acc"])
            r["bytes_vs_dense"] = r["bytes_per_step"] / dense["bytes_per_step"]
    return rows


def format_table(summary: List[dict], config: Dict[str, Any]) -> str:
    n_seeds = len(config["seeds"])
    seeds = f" (mean±sd, {n_seeds} seeds)" if n_seeds > 1 else ""
    if config.get("model") == "gpt":
        g = config["gpt"]

        def loss(r):
            v = f"{r['final_val_loss']:.4f}"
            return v + (f" ± {r['final_val_loss_std']:.4f}" if n_seeds > 1 else "")

        title = (f"density {config['density']:g}, {config['world_size']} ranks, gpt "
                 f"{config['size']} (d {g['d_model']}, {g['n_layer']} layers, context "
                 f"{g['context']}), {config['steps']} steps, {config['optimizer']}")
        columns = [("val nats/byte" + seeds, loss),
                   ("bits/byte", lambda r: f"{r['final_val_bpb']:.3f}"),
                   ("vs dense", lambda r: f"{r.get('loss_vs_dense_pct', 0.0):+.2f}%"),
                   ("applied/step", lambda r: f"{r['applied_per_step']:.0f}")]
        return _table(summary, config, title, columns,
                      "applied = nonzero entries of the reduced gradient; ")

    def acc(r):
        a = f"{100 * r['final_test_acc']:.2f}"
        return a + (f" ± {100 * r['final_test_acc_std']:.2f}" if n_seeds > 1 else "")

    title = (f"density {config['density']:g}, {config['world_size']} ranks, {config['model']}, "
             f"{config['epochs']} epochs")
    columns = [("test acc %" + seeds, acc),
               ("vs dense", lambda r: f"{r.get('acc_vs_dense_points', 0.0):+.2f}")]
    return _table(summary, config, title, columns, "")


# the columns every results table ends with: (header, cell of a summary row)
_TABLE_TAIL = [
    ("bytes/rank/step", lambda r: _fmt_bytes(r["bytes_per_step"])),
    ("x dense", lambda r: f"{r.get('bytes_vs_dense', float('nan')):.4f}"),
    ("time/step ms", lambda r: f"{r['time_per_step_ms']:.1f}"),
    ("reduce ms", lambda r: f"{r['reduce_ms']:.2f}"),
    ("optimizer ms", lambda r: "-" if r.get("optimizer_ms") is None
     else f"{r['optimizer_ms']:.2f}"),
    ("replicas", lambda r: "identical" if r["replicas_identical"] else "DIVERGED"),
]


def _table(summary: List[dict], config: Dict[str, Any], title: str, columns, note: str) -> str:
    """A results table (records.table): one row per algorithm, ``columns`` (the metric first)
    then the tail columns, FAILED for a run that failed, and the model's size and k below."""
    def ok(cell, failed=""):
        return lambda r: cell(r) if r["status"] == "ok" else failed
    cols = [("algorithm", lambda r: r["algorithm"]), (columns[0][0], ok(columns[0][1], "FAILED"))]
    cols += [(h, ok(cell)) for h, cell in list(columns[1:]) + _TABLE_TAIL]
    lines = [title, records.table(summary, cols, sep="  ")]
    ok_rows = [r for r in summary if r.get("numel")]
    if ok_rows:
        n = ok_rows[0]["numel"]
        lines.append(f"(model: {n} parameters; sparse k = {max(1, round(config['density'] * n))} "
                     f"at density {config['density']:g}; {note}bytes counted by the communicator)")
    return "\n".join(lines)


# one marker and dash pattern per algorithm, so lines that coincide (Ok-Topk's volume sits just
# under SparDL's) stay apart; dense is the thick black reference
_MARKERS = ("o", "s", "^", "v", "D", "P", "X", "*", "<", ">")
_DASHES = ("-", "--", "-.", ":")


def _style(i: int, alg: str, n_points: int, n_algs: int) -> Dict[str, Any]:
    """Line style of the ``i``-th algorithm: its marker drawn every ``n_points / 12`` points,
    staggered by algorithm so that the markers of coinciding lines do not sit on each other;
    earlier algorithms drawn above later ones (a dashed line over a solid one shows both)."""
    every = max(1, n_points // 12)
    style = dict(marker=_MARKERS[i % len(_MARKERS)], markersize=5, lw=1.4,
                 zorder=3.0 - i / max(1, n_algs),
                 ls=_DASHES[i % len(_DASHES)],
                 markevery=(min(n_points - 1, (i * every) // max(1, n_algs)), every))
    if alg == "dense":
        style.update(lw=2.4, color="black", ls="-")
    return style


def _mean_curve(rs: List[dict], curve: str):
    """(steps, mean over the seeds' runs ``rs``) of the curve ``curve`` at its common steps."""
    steps = [s for s, _ in rs[0][curve]]
    return steps, [sum(r[curve][i][1] for r in rs) / len(rs) for i in range(len(steps))]


def _plot_curves(report: Dict[str, Any], ax1, ax2, lm: bool) -> None:
    """Per algorithm: the metric (validation loss, or test error in % for the digits) over the
    steps on ``ax1``, from the evaluation at step 0, and the bytes sent per step on ``ax2``."""
    algs = [a for a in report["config"]["algorithms"]
            if any(r["algorithm"] == a for r in report["runs"])]
    for i, alg in enumerate(algs):
        rs = [r for r in report["runs"] if r["algorithm"] == alg]
        steps, ys = _mean_curve(rs, "val_curve" if lm else "acc_curve")
        if not lm:   # test error on a log axis: the first evaluations and the last ones both show
            ys = [max(100.0 * (1.0 - y), 0.1) for y in ys]
        (line,) = ax1.plot(steps, ys, label=alg, **_style(i, alg, len(steps), len(algs)))
        b = rs[0]["bytes_curve"]
        style = _style(i, alg, len(b), len(algs))
        style["color"] = line.get_color()
        ax2.plot(range(1, len(b) + 1), b, label=alg, **style)


def plot(report: Dict[str, Any], path: str) -> None:
    """Two panels, every step from the first: the metric (the LM's validation loss, or the
    digits' test error on a log axis) and the bytes sent per rank per step (log); one legend to
    the right of both."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = report["config"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    lm = cfg.get("model") == "gpt"
    _plot_curves(report, ax1, ax2, lm)
    for ax in (ax1, ax2):
        ax.set_xlabel("step")
        ax.set_xlim(left=0)
        ax.grid(alpha=0.3, which="both")
    if lm:
        uni = (report.get("corpus") or {}).get("unigram_nats_per_byte")
        if uni:
            ax1.axhline(uni, color="gray", ls=":", lw=1, label="unigram entropy")
        ax1.set_ylabel("validation loss (nats/byte)")
        ax1.set_title(f"byte LM ({cfg['size']}), {cfg['world_size']} ranks, "
                      f"density {cfg['density']:g}")
    else:
        ax1.set_yscale("log")
        ax1.set_ylabel("test error (%, log; 0 drawn at 0.1)")
        ax1.set_title(f"digits, {cfg['world_size']} ranks, density {cfg['density']:g}")
    ax2.set_yscale("log")
    ax2.set_ylabel("bytes sent per rank per step")
    ax2.set_title("communication volume")
    handles, labels = ax1.get_legend_handles_labels()
    fig.legend(handles, labels, loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=9,
               frameon=False)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
