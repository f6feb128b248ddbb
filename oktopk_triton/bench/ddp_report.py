"""What ``oktopk-bench ddp`` reports: one result row a hook from its ranks' records
(:func:`_summary`), the README table (:func:`format_markdown`) and the terminal's
(:func:`format_table`).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List

from . import records
from .measure import step_stats


def _summary(spec: Dict[str, Any], per_rank: List[Dict[str, Any]],
             cfg: Dict[str, Any]) -> Dict[str, Any]:
    steps = len(per_rank[0]["time_s"])
    timed = list(range(cfg["warmup"], steps))
    st = step_stats([r["time_s"] for r in per_rank], timed)
    mb = sum(r["bytes"][t] for r in per_rank for t in timed) / (len(per_rank) * len(timed)) / 1e6
    source = {"sparse": "comm.bytes_sent", "fp16": "dist.all_reduce calls, ring model",
              "powersgd": "dist.all_reduce calls, ring model",
              "allreduce": "ring model of all parameters", "none": "nothing sent"}[spec["hook"]]
    out = {
        "hook": spec["hook"],
        "algorithm": spec["algorithm"],
        "mode": (spec["mode"] or "bucket") if spec["hook"] == "sparse" else None,
        "density": cfg["density"] if spec["hook"] == "sparse" else None,
        "step_ms_mean": st["ms_mean"],
        "step_ms_min": st["ms_min"],
        "step_ms_per_step": [1e3 * s for s in st["step_s"]],
        "mb_sent_per_rank_per_step": mb,
        "bytes_source": source,
        "ratio_to_allreduce": None,
        "final_loss": sum(r["loss"][-1] for r in per_rank) / len(per_rank),
        "loss_rank0": per_rank[0]["loss"],
        "replicas_identical": len({r["param_digest"] for r in per_rank}) == 1,
    }
    if spec["hook"] == "powersgd":
        out["one_bucket_at_a_time"] = cfg["backend"] == "gloo"
        out["matrix_approximation_rank"] = cfg["powersgd_rank"]
        out["start_powerSGD_iter"] = cfg["powersgd_start_iter"]
    if "buckets" in per_rank[0]:
        out["buckets"] = per_rank[0]["buckets"]
    return out


# -- output ----------------------------------------------------------------------------------------
_HOOK_NAMES = {"none": "none (compute floor, no communication)",
               "allreduce": "DDP default allreduce",
               "fp16": "`fp16_compress_hook`",
               "powersgd": "PowerSGD"}


def display_name(algorithm: str) -> str:
    """How a report names ``algorithm``: its description's ``display``, else the name itself."""
    from ..algorithms import find_description
    d = find_description(algorithm)
    return d.display if d is not None else algorithm


def _hook_label(r: Dict[str, Any]) -> str:
    if r["hook"] == "sparse":
        pct = f"{100 * r['density']:g}%"
        mode = f", {r['mode']}" if r.get("mode") and r["mode"] != "bucket" else ""
        name = display_name(r["algorithm"])
        return f"`sparse_allreduce_hook`, {name} {pct}{mode}"
    if r["hook"] == "powersgd":
        return f"PowerSGD rank {r.get('matrix_approximation_rank', '?')} (error feedback)"
    return _HOOK_NAMES.get(r["hook"], r["hook"])


def _commit_text(report: Dict[str, Any]) -> str:
    """The short commit of a record, ``-dirty`` when the tree differed from it."""
    return str(report.get("commit") or "?")[:10] + ("-dirty" if report.get("dirty") else "")


def _mps_on(mps: Any) -> bool:
    """A record's ``mps``: detect_mps's answer, or a bool in files from before the header."""
    return bool(mps.get("active") if isinstance(mps, dict) else mps)


def _fmt_mb(mb: float) -> str:
    return f"{mb:.1f}" if mb >= 10 else (f"{mb:.3g}" if mb > 0 else "0")


def _error_line(text: Any) -> str:
    """The line of a traceback that names the exception (the last line that says Error)."""
    lines = [ln.strip() for ln in str(text or "").strip().splitlines() if ln.strip()]
    named = [ln for ln in lines if "Error" in ln or "Exception" in ln or "timeout" in ln]
    return (named or lines or [""])[-1]


def _ratio(r: Dict[str, Any], digits: int) -> str:
    return "-" if r.get("ratio_to_allreduce") is None else f"{r['ratio_to_allreduce']:.{digits}f}"


def _failed(cell):
    """A cell of a result row; an error row (no step times) gets an empty one."""
    return lambda r: cell(r) if "step_ms_mean" in r else ""


def _error_label(e: Dict[str, Any]) -> str:
    return (e["hook"] or "run") + (f"/{e['algorithm']}" if e.get("algorithm") else "")


# the README table: one row per hook, then one per error (its label, its message, empty cells)
_MARKDOWN_COLUMNS = [
    ("comm hook", lambda r: _hook_label(r) if "step_ms_mean" in r else _error_label(r)),
    ("ms per step (mean)", lambda r: f"{r['step_ms_mean']:.1f}" if "step_ms_mean" in r
     else f"failed: {_error_line(r['error'])[:80]}"),
    ("min", _failed(lambda r: f"{r['step_ms_min']:.1f}")),
    ("MB sent per rank per step", _failed(lambda r: _fmt_mb(r["mb_sent_per_rank_per_step"]))),
    ("x allreduce", _failed(lambda r: _ratio(r, 2))),
    ("final loss", _failed(lambda r: f"{r['final_loss']:.4g}")),
    ("replicas identical", _failed(lambda r: "yes" if r["replicas_identical"] else "no")),
]
_TEXT_COLUMNS = [
    ("hook", lambda r: r["hook"]), ("algorithm", lambda r: r["algorithm"] or "-"),
    ("mode", lambda r: r["mode"] or "-"), ("ms mean", lambda r: f"{r['step_ms_mean']:.2f}"),
    ("ms min", lambda r: f"{r['step_ms_min']:.2f}"),
    ("MB/rank/step", lambda r: f"{r['mb_sent_per_rank_per_step']:.3f}"),
    ("x allreduce", lambda r: _ratio(r, 2)), ("final loss", lambda r: f"{r['final_loss']:.5g}"),
    ("replicas equal", lambda r: "yes" if r["replicas_identical"] else "no"),
]


def format_markdown(report: Dict[str, Any]) -> str:
    """The README table of a report: one row per hook, with device, date and setup above it."""
    cfg = report["config"]
    date = str(report["date"])[:10]
    if report["backend"] == "nccl":
        where = (f"{report['device']}, P={cfg['P']} ranks on {report['gpus']} GPU(s)"
                 + (f", MPS {'on' if _mps_on(report['mps']) else 'OFF (time-sliced)'}"
                    if cfg.get("ranks_per_gpu", 1) > 1 else ""))
    else:
        where = f"CPU ({report['device']}), P={cfg['P']} gloo ranks"
    rows = list(report["results"]) + list(report.get("errors", []))
    return (f"DDP, {cfg['layers']} x Linear({cfg['W']}, {cfg['W']}) ({cfg['params'] / 1e6:.1f}M "
            f"parameters), batch {cfg['batch']} per rank, {cfg['bucket_cap_mb']:g} MB buckets; "
            f"{where}; mean of {cfg['steps']} steps after {cfg['warmup']}; {date}, "
            f"commit {_commit_text(report)}.\n\n"
            + records.table(rows, _MARKDOWN_COLUMNS, markdown=True))


def format_table(report: Dict[str, Any]) -> str:
    """A plain-text table for the terminal."""
    return records.table(report["results"], _TEXT_COLUMNS, left=3)


def _write(path: str, text: str) -> None:
    d = os.path.dirname(os.path.abspath(path))
    os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        f.write(text)
